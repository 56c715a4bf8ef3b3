"""Reading job and cluster files: YAML with positions, strict keys, and located errors.

The YAML is composed into nodes (which keep line and column), turned into plain Python data while a
source map records the position of every field path, and then validated by the pydantic schemas. Any
failure becomes a `JobError`/`ClusterError` naming file, line, column and the field path, with a fix.
Duplicate keys are refused (plain YAML silently keeps the last one).
"""

from __future__ import annotations

import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import yaml
from pydantic import BaseModel, ValidationError

from graphrl.errors import ClusterError, GraphRLError, JobError, Location, format_path
from graphrl.schemas.cluster import CLUSTER_PRESETS, ClusterSpec
from graphrl.schemas.job import JobSpec

Path_ = tuple[str | int, ...]


@dataclass
class SourceMap:
    """Field path -> position in the file it came from, or the command-line option that set it."""

    file: str | None
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    overrides: dict[Path_, str] = field(default_factory=dict)  # path -> the option as written, e.g. '--set a.b=1'

    def locate(self, path: Path_) -> Location:
        """Where `path` (or its closest ancestor that has a place) was written: an option, or the file.
        A key that only an option created (`--set placement.roles.x.tp=2` made `placement.roles.x`) is
        located at that option."""
        if tuple(path) not in self.positions:
            below = [origin for p, origin in self.overrides.items() if tuple(p[:len(path)]) == tuple(path)]
            if below:
                return Location(below[-1])
        for cut in range(len(path), -1, -1):
            here = tuple(path[:cut])
            if here in self.overrides:
                return Location(self.overrides[here])
            pos = self.positions.get(here)
            if pos is not None:
                return Location(self.file, pos[0], pos[1])
        return Location(self.file)

    def overridden(self, path: Path_, origin: str) -> "SourceMap":
        """This map with `path` (and everything below it) now set by the option `origin`."""
        cut = len(path)
        keep = lambda p: tuple(p[:cut]) != path  # noqa: E731
        return SourceMap(self.file, {p: v for p, v in self.positions.items() if keep(p)},
                         {**{p: v for p, v in self.overrides.items() if keep(p)}, path: origin})


@dataclass(frozen=True)
class LoadedJob:
    spec: JobSpec
    source: SourceMap
    path: Path | None

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path is not None else Path.cwd()


def _read_text(path: Path, error: type[GraphRLError]) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"file not found: {path}", fix="check the path") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a YAML file", fix="give the path of a .yaml file") from None
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from None
    if b"\x00" in raw:
        raise error("this is a binary file, not YAML", location=Location(str(path)),
                    fix="give a YAML job file (text)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise error(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                    location=Location(str(path), line), fix="save the file as UTF-8") from None
    if not text.strip() or all(l.strip().startswith("#") or not l.strip() for l in text.splitlines()):
        raise error("the file is empty", location=Location(str(path), 1),
                    fix="write a job: see examples/grpo_tiny.yaml") from None
    return text


# Aliases can make a small file expand into billions of values ("billion laughs"); refuse past this.
MAX_VALUES = 1_000_000


# Plain (unquoted) numbers that YAML 1.2 reads as floats but PyYAML's YAML 1.1 rules as strings: an
# exponent without a dot or without a sign (`1e-5`, `2.0e12`). The strict schemas would refuse them
# as strings; a quoted "1e-5" stays a string.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def _scalar(node: yaml.Node, path: Path_, source: SourceMap, error: type[GraphRLError]) -> Any:
    """A scalar resolved with the safe loader's rules; a tag it cannot construct is a located error."""
    if node.tag == "tag:yaml.org,2002:str":
        if isinstance(node, yaml.ScalarNode) and node.style is None and _EXPONENT_FLOAT.fullmatch(node.value):
            return float(node.value)
        return node.value
    try:  # construct the node itself: a round trip through text loses empty values (`key:` is null)
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError) as exc:  # `!!int abc` raises ValueError, `!foo` a YAMLError
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"invalid YAML value {node.value!r} (tag {node.tag}): {problem}", path=path,
                    location=Location(source.file, node.start_mark.line + 1, node.start_mark.column + 1),
                    fix="remove the tag and write a plain value") from None


def _to_python(node: yaml.Node, path: Path_, source: SourceMap, error: type[GraphRLError]) -> Any:
    source.positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if len(source.positions) > MAX_VALUES:
        raise error(f"the YAML expands to more than {MAX_VALUES} values (through aliases?)",
                    location=Location(source.file, node.start_mark.line + 1, node.start_mark.column + 1),
                    fix="write the job without deeply nested aliases")
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise error("a mapping key must be a plain value", path=path,
                            location=Location(source.file, key_node.start_mark.line + 1, key_node.start_mark.column + 1))
            key_at = Location(source.file, key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            # PyYAML tags '<<' as a merge key, which no scalar constructor accepts: test the tag first.
            key = "<<" if key_node.tag == "tag:yaml.org,2002:merge" else _scalar(key_node, path, source, error)
            if key == "<<":
                raise error("YAML merge keys ('<<') are not supported", path=path, location=key_at,
                            fix="write the keys out")
            if key is None:
                raise error("a key is empty (null)", path=path, location=key_at, fix="write the name of the key")
            if not isinstance(key, (str, int)):
                key = str(key)
            if key in out:
                first = source.positions.get(path + (key,), (0, 0))[0]
                raise error(f"duplicate key {key!r} (first defined on line {first})", path=path + (key,),
                            location=Location(source.file, key_node.start_mark.line + 1, key_node.start_mark.column + 1),
                            fix="each name may appear once; rename or remove one of them")
            out[key] = _to_python(value_node, path + (key,), source, error)
            if isinstance(value_node, yaml.CollectionNode):  # a block's errors point at its key, not its first child
                source.positions[path + (key,)] = (key_at.line, key_at.column)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path + (i,), source, error) for i, item in enumerate(node.value)]
    # Scalars: resolve with the safe loader's rules (ints, floats, bools, nulls, strings).
    return _scalar(node, path, source, error)


def parse_yaml(text: str, file: str | None, error: type[GraphRLError]) -> tuple[Any, SourceMap]:
    """YAML text -> (plain data, source map). Errors carry the file position."""
    source = SourceMap(file)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file)
        raise error(f"invalid YAML: {exc.problem or exc.context}", location=loc,
                    fix="fix the YAML syntax at this position") from None
    except yaml.reader.ReaderError as exc:  # a control character; it knows only its offset
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        raise error(f"invalid YAML: character #x{exc.character:04x} is not allowed ({exc.reason})",
                    location=Location(file, line, column), fix="remove the control character") from None
    except yaml.YAMLError as exc:
        raise error(f"invalid YAML: {exc}", location=Location(file)) from None
    if node is None:
        raise error("the file is empty", location=Location(file, 1), fix="write a job: see examples/grpo_tiny.yaml")
    try:
        data = _to_python(node, (), source, error)
    except yaml.YAMLError as exc:
        raise error(f"invalid YAML value: {exc}", location=Location(file)) from None
    except RecursionError:
        raise error("the YAML is nested too deeply", location=Location(file)) from None
    return data, source


# --- pydantic errors -> located errors with fixes ----------------------------------------------------

def _unwrap(annotation: Any) -> list[Any]:
    """The concrete types an annotation may hold (Optional/Union/Annotated peeled)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _written_keys(model: type[BaseModel]) -> dict[str, str]:
    """The keys a job writes for `model`'s fields (an alias where one is set: `from`) -> the field names."""
    return {f.alias or name: name for name, f in model.model_fields.items()}


def _model_at(root: type[BaseModel], path: Path_, data: Any) -> type[BaseModel] | None:
    """The schema class describing the mapping at `path` (for 'allowed keys' hints)."""
    current: list[Any] = [root]
    node = data
    for part in path:
        nxt: list[Any] = []
        for t in current:
            origin = typing.get_origin(t)
            if isinstance(t, type) and issubclass(t, BaseModel):
                f = t.model_fields.get(_written_keys(t).get(str(part), str(part)))
                if f is not None:
                    nxt.extend(_unwrap(f.annotation))
            elif origin in (dict, list, tuple):
                args = typing.get_args(t)
                if args:
                    nxt.extend(_unwrap(args[-1] if origin is dict else args[0]))
        node = node.get(part) if isinstance(node, dict) else (node[part] if isinstance(node, list) and isinstance(part, int) and part < len(node) else None)
        models = [t for t in nxt if isinstance(t, type) and issubclass(t, BaseModel)]
        if len(models) > 1 and isinstance(node, dict):  # discriminated union: pick by tag
            tagged = [m for m in models if "op" in m.model_fields and m.model_fields["op"].default == node.get("op")]
            models = tagged or models
        current = models + [t for t in nxt if not (isinstance(t, type) and issubclass(t, BaseModel))]
    models = [t for t in current if isinstance(t, type) and issubclass(t, BaseModel)]
    return models[0] if len(models) == 1 else None


def _data_path(loc: tuple[Any, ...], data: Any) -> Path_:
    """Drop the pydantic-inserted union tags from an error location, keeping real data keys."""
    out: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                out.append(part)
                node = node[part]
            elif node.get("op") == part or isinstance(part, str) and ("[" in part or part.startswith("function-")):
                continue  # union member tag or validator name
            else:
                out.append(part)
                node = None
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part.startswith("function-")):
            continue
        else:
            out.append(part)
            node = None
    return tuple(out)


def _describe(err: dict[str, Any], path: Path_, root: type[BaseModel], data: Any) -> tuple[str, str | None]:
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(root, path[:-1], data)
        allowed = list(_written_keys(parent)) if parent else []
        key = str(path[-1]) if path else "?"
        close = difflib.get_close_matches(key, allowed, n=1)
        fix = f"did you mean {close[0]!r}?" if close else (f"allowed keys: {', '.join(allowed)}" if allowed else None)
        return f"unknown key {key!r}", fix
    if kind == "missing":
        return "required field is missing", "add it (see `graphrl schema` or the README's job reference)"
    if kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        return (f"unknown op {ctx.get('tag')!r}",
                f"use one of: {ctx.get('expected_tags', '').replace(chr(39), '')}")
    if kind == "union_tag_not_found":
        return "node has no 'op'", "add 'op:' (dataset, generate, logprob, value, reward, advantage, train)"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if kind == "literal_error":
        return message.replace("Input should be", "must be"), None
    if kind in _WANTED and "input" in err:
        return _wrong_scalar(_WANTED[kind], err["input"])
    if kind == "string_type" and isinstance(err.get("input"), (int, float)) and not isinstance(err["input"], bool):
        return f"must be a string (got {err['input']!r})", f"quote it: \"{err['input']}\""
    if kind == "finite_number":
        return (f"must be a finite number (got {err.get('input')!r})",
                "infinity and nan are no value a run can use; write a finite number")
    if "input" in err and not isinstance(err["input"], (dict, list)):
        message = f"{message} (got {err['input']!r})"
    return message, None


_WANTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false"}


def _wrong_scalar(wanted: str, value: Any) -> tuple[str, str | None]:
    """The message for a value of the wrong scalar type: say what was given, and the likely fix."""
    if isinstance(value, bool):
        return f"must be {wanted}, not a boolean (got {str(value).lower()})", f"write {wanted}"
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return f"must be {wanted}, not a string (got {value!r})", None
        if not math.isfinite(number):
            return (f"must be a finite number, not the string {value!r}",
                    "infinity and nan are no value a run can use; write a finite number")
        return f"must be {wanted}, not a string (got {value!r})", "write the number without quotes"
    if isinstance(value, float) and wanted == "an integer":
        return f"must be an integer (got {value!r})", f"write {int(value)}" if value.is_integer() else None
    if isinstance(value, (dict, list)):
        return f"must be {wanted}, not a {'mapping' if isinstance(value, dict) else 'list'}", None
    return f"must be {wanted} (got {value!r})", None


def validation_error(exc: ValidationError, root: type[BaseModel], data: Any, source: SourceMap,
                     error: type[GraphRLError]) -> GraphRLError:
    # One error per field: the members of a union (`options` values) each report the same value, and
    # "not finite" says more about an inf than "not an integer" does.
    by_path: dict[Path_, list[dict[str, Any]]] = {}
    for err in exc.errors():
        by_path.setdefault(_data_path(tuple(err["loc"]), data), []).append(err)
    path, errors = next(iter(by_path.items()))
    # A misspelt key (`max_new_token`) is also the required key it was meant to be, missing: the typo is
    # the mistake to report, at its own line, and the missing key no further error.
    typos = _misspelt_keys(by_path)
    if typos:
        path, meant = next(iter(typos.items()))
        errors = by_path[path]
        del by_path[path[:-1] + (meant,)]
    first = next((e for e in errors if e["type"] == "finite_number"), errors[0])
    message, fix = _describe(first, path, root, data)
    if len(by_path) > 1:
        message += f" (and {len(by_path) - 1} more error{'s' if len(by_path) > 2 else ''})"
    return error(message, path=path, fix=fix, location=source.locate(path))


def _misspelt_keys(by_path: dict[Path_, list[dict[str, Any]]]) -> dict[Path_, str]:
    """Unknown keys that are close to a required key missing beside them: path of the unknown key -> the
    missing key's name."""
    missing = {path: errors for path, errors in by_path.items() if path and any(e["type"] == "missing" for e in errors)}
    typos: dict[Path_, str] = {}
    for path, errors in by_path.items():
        if not path or not any(e["type"] == "extra_forbidden" for e in errors):
            continue
        beside = [str(p[-1]) for p in missing if p[:-1] == path[:-1] and p[-1] not in typos.values()]
        close = difflib.get_close_matches(str(path[-1]), beside, n=1)
        if close:
            typos[path] = close[0]
    return typos


def load_job_text(text: str, file: str | None = None, overrides: Sequence["Override"] = ()) -> LoadedJob:
    """A job from YAML text, with `overrides` applied before the files it names are checked (a `--set`
    may be what makes them fit: `--set nodes.prompts.prompt_len=128`)."""
    data, source = parse_yaml(text, file, JobError)
    if not isinstance(data, dict):
        raise JobError(f"a job file must be a mapping of keys, not a {type(data).__name__}",
                       location=Location(file, 1), fix="start with 'name:', 'models:' and 'nodes:'")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, JobSpec, data, source, JobError) from None
    loaded = LoadedJob(spec, source, Path(file) if file else None)
    return apply_overrides(loaded, overrides) if overrides else with_files_resolved(loaded)


def with_files_resolved(loaded: LoadedJob) -> LoadedJob:
    """Checkpoint and dataset paths made absolute from the job file's folder, and checked to exist."""
    from graphrl.jobfiles import resolve_job_files

    try:
        return LoadedJob(resolve_job_files(loaded.spec, loaded.base_dir), loaded.source, loaded.path)
    except GraphRLError as exc:
        if exc.path and exc.location is None:
            exc.location = loaded.source.locate(exc.path)
        raise


def load_job(path: str | Path, overrides: Sequence["Override"] = ()) -> LoadedJob:
    """Read and validate a job file (with `overrides` applied). Raises JobError with file, line, column and
    field path."""
    path = Path(path)
    text = _read_text(path, JobError)
    importable(path.parent)
    return load_job_text(text, str(path), overrides)


def importable(folder: Path) -> None:
    """Let a job's `module:function` and `module:Class` names find modules beside the job file (after every
    other place Python looks: a module there never hides an installed one)."""
    where = str(folder.resolve())
    if where not in sys.path:
        sys.path.append(where)


# --- overrides: `--set KEY=VALUE` ------------------------------------------------------------------

@dataclass(frozen=True)
class Override:
    """One command-line change to a job: a field path, its new value, and the option as the user wrote it."""

    path: Path_
    value: Any
    origin: str


# Mappings whose keys name things the job declares: an override changes them, it never adds one.
_DECLARED_NAMES = {("models",): "model", ("nodes",): "node"}


def parse_override(text: str) -> Override:
    """`KEY=VALUE` from `--set`: KEY is a dotted field path (`placement.roles.policy/generate.tp`), VALUE
    is read as YAML (`20`, `1e-4`, `true`, `null`, `0-3`, `[a, b]`); an empty VALUE is null."""
    origin = f"--set {text}"
    key, sep, raw = text.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep or not all(parts):
        raise JobError(f"{text!r} is not KEY=VALUE with a dotted KEY", location=Location(origin),
                       fix="e.g. --set schedule.checkpoint_every=20 --set placement.roles.policy/generate.tp=2")
    value = parse_yaml(raw, origin, JobError)[0] if raw.strip() else None
    return Override(parts, value, origin)


def _schema_types(annotation: Any, data: Any) -> list[Any]:
    """The types `annotation` allows for `data`; a tagged union (the nodes) narrowed by the data's `op`."""
    kinds = _unwrap(annotation)
    models = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
    if len(models) > 1 and isinstance(data, dict):
        tagged = [m for m in models if "op" in m.model_fields and m.model_fields["op"].default == data.get("op")]
        if tagged:
            return tagged
    return kinds


def _describe_type(kinds: list[Any]) -> str:
    names = [getattr(t, "__name__", str(t)) for t in kinds if t is not type(None)]
    return " or ".join(names) or "null"


def _assign(data: dict[str, Any], o: Override) -> None:
    """Set `o.path` in the plain job data `data`, walking the schema beside it so that a wrong path is
    refused at the first key that does not exist, with the keys that do."""
    where = Location(o.origin)
    annotation: Any = JobSpec
    container: Any = data
    for depth, part in enumerate(o.path):
        here, last = o.path[:depth], depth == len(o.path) - 1
        kinds = _schema_types(annotation, container)
        models = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
        mappings = [t for t in kinds if typing.get_origin(t) is dict]
        sequences = [t for t in kinds if typing.get_origin(t) in (list, tuple)]
        key: str | int = part
        if models and isinstance(container, dict):
            model = models[0]
            written = _written_keys(model)
            if part not in written:
                allowed = list(written)
                close = difflib.get_close_matches(part, allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise JobError(f"unknown key {part!r}", path=here + (part,), location=where,
                               fix=f"{hint}keys {'under ' + format_path(here) if here else 'of a job'}: {', '.join(allowed)}")
            key = written[part]  # the job's data is dumped by field name (`from_run`), not alias (`from`)
            annotation = model.model_fields[key].annotation
        elif mappings and isinstance(container, dict):
            noun = _DECLARED_NAMES.get(tuple(here))
            if noun is not None and part not in container:
                raise JobError(f"the job has no {noun} {part!r}", path=here + (part,), location=where,
                               fix=f"{noun}s of this job: {', '.join(container)}")
            annotation = typing.get_args(mappings[0])[-1]
        elif sequences and isinstance(container, list):
            if not part.isdigit() or int(part) >= len(container):
                raise JobError(f"{part!r} is not an index of this list of {len(container)}", path=here + (part,),
                               location=where, fix=f"use 0-{len(container) - 1}, or set the whole list: "
                                                   f"--set {format_path(here)}=[...]")
            key = int(part)
            args = typing.get_args(sequences[0])
            annotation = args[min(key, len(args) - 1)] if typing.get_origin(sequences[0]) is tuple else args[0]
        else:
            raise JobError(f"this is a value ({_describe_type(kinds)}), not a section with keys",
                           path=here, location=where, fix=f"set it directly: --set {format_path(here)}=VALUE")
        if last:
            container[key] = o.value
            return
        child = container[key] if isinstance(container, list) else container.get(key)
        if child is None:  # an unset section (`placement.roles.policy`, `models.policy.dims`) starts empty
            child = container[key] = {}
        container = child


def apply_overrides(job: LoadedJob, overrides: Sequence[Override]) -> LoadedJob:
    """The job with each override applied in order and validated exactly as a job file is; errors name the
    field path and the option that set it."""
    if not overrides:
        return job
    data = job.spec.model_dump(mode="json")  # plain data, as a YAML file would give
    source = job.source
    for o in overrides:
        _assign(data, o)
        source = source.overridden(o.path, o.origin)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, JobSpec, data, source, JobError) from None
    return with_files_resolved(LoadedJob(spec, source, job.path))


def load_cluster(ref: str | Path, base_dir: Path | None = None) -> ClusterSpec:
    """A cluster preset by name, or a cluster YAML file (relative paths from `base_dir`)."""
    name = str(ref)
    if name in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[name]
    path = Path(name)
    if not path.is_absolute() and base_dir is not None:  # relative to the job file, never to the cwd
        path = base_dir / path
    if not path.exists():
        raise ClusterError(
            f"cluster {name!r} is neither a preset nor an existing file",
            fix=f"use a preset ({', '.join(CLUSTER_PRESETS)}) or the path of a cluster YAML file",
        )
    text = _read_text(path, ClusterError)
    data, source = parse_yaml(text, str(path), ClusterError)
    if not isinstance(data, dict):
        raise ClusterError("a cluster file must be a mapping of keys", location=Location(str(path), 1),
                           fix="write 'name:', 'num_nodes:', 'devices_per_node:' and 'hardware:'")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, ClusterSpec, data, source, ClusterError) from None


def job_cluster(job: LoadedJob, override: str | None) -> ClusterSpec:
    """The cluster to compile for: `--cluster` if given, else the job's default."""
    ref = override or job.spec.cluster
    if ref is None:
        raise JobError("no cluster given", path=("cluster",),
                       fix="pass --cluster (a preset such as local-cpu-2, or a cluster file) or set 'cluster:' in the job")
    try:
        return load_cluster(ref, job.base_dir if override is None else None)
    except GraphRLError as exc:
        if override is None and exc.location is None:
            exc.path = ("cluster",)
            exc.location = job.source.locate(("cluster",))
        raise


__all__ = ["LoadedJob", "Override", "SourceMap", "apply_overrides", "format_path", "job_cluster", "load_cluster",
           "load_job", "load_job_text", "parse_override"]

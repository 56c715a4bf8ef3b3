"""Reading job and cluster files: YAML with positions, strict keys, and located errors.

The YAML is composed into nodes (which keep line and column), turned into plain Python data while a
source map records the position of every field path, and then validated by the pydantic schemas. Any
failure becomes a `JobError`/`ClusterError` naming file, line, column and the field path, with a fix.
Duplicate keys are refused (plain YAML silently keeps the last one).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from graphrl.errors import ClusterError, GraphRLError, JobError, Location, format_path
from graphrl.schemas.cluster import CLUSTER_PRESETS, ClusterSpec
from graphrl.schemas.job import JobSpec

Path_ = tuple[str | int, ...]


@dataclass
class SourceMap:
    """Field path -> position in the file it came from."""

    file: str | None
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def locate(self, path: Path_) -> Location:
        """The position of `path`, or of its closest ancestor that has one."""
        for cut in range(len(path), -1, -1):
            pos = self.positions.get(tuple(path[:cut]))
            if pos is not None:
                return Location(self.file, pos[0], pos[1])
        return Location(self.file)


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


def _scalar(node: yaml.Node, path: Path_, source: SourceMap, error: type[GraphRLError]) -> Any:
    """A scalar resolved with the safe loader's rules; a tag it cannot construct is a located error."""
    if node.tag == "tag:yaml.org,2002:str":
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


def _model_at(root: type[BaseModel], path: Path_, data: Any) -> type[BaseModel] | None:
    """The schema class describing the mapping at `path` (for 'allowed keys' hints)."""
    current: list[Any] = [root]
    node = data
    for part in path:
        nxt: list[Any] = []
        for t in current:
            origin = typing.get_origin(t)
            if isinstance(t, type) and issubclass(t, BaseModel):
                f = t.model_fields.get(str(part))
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
        allowed = list(parent.model_fields) if parent else []
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
    if "input" in err and not isinstance(err["input"], (dict, list)):
        message = f"{message} (got {err['input']!r})"
    return message, None


def validation_error(exc: ValidationError, root: type[BaseModel], data: Any, source: SourceMap,
                     error: type[GraphRLError]) -> GraphRLError:
    errors = exc.errors()
    first = errors[0]
    path = _data_path(tuple(first["loc"]), data)
    message, fix = _describe(first, path, root, data)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error(message, path=path, fix=fix, location=source.locate(path))


def load_job_text(text: str, file: str | None = None) -> LoadedJob:
    data, source = parse_yaml(text, file, JobError)
    if not isinstance(data, dict):
        raise JobError(f"a job file must be a mapping of keys, not a {type(data).__name__}",
                       location=Location(file, 1), fix="start with 'name:', 'models:' and 'nodes:'")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, JobSpec, data, source, JobError) from None
    loaded = LoadedJob(spec, source, Path(file) if file else None)
    return with_files_resolved(loaded)


def with_files_resolved(loaded: LoadedJob) -> LoadedJob:
    """Checkpoint and dataset paths made absolute from the job file's folder, and checked to exist."""
    from graphrl.jobfiles import resolve_job_files

    try:
        return LoadedJob(resolve_job_files(loaded.spec, loaded.base_dir), loaded.source, loaded.path)
    except GraphRLError as exc:
        if exc.path and exc.location is None:
            exc.location = loaded.source.locate(exc.path)
        raise


def load_job(path: str | Path) -> LoadedJob:
    """Read and validate a job file. Raises JobError with file, line, column and field path."""
    path = Path(path)
    return load_job_text(_read_text(path, JobError), str(path))


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


__all__ = ["LoadedJob", "SourceMap", "format_path", "job_cluster", "load_cluster", "load_job", "load_job_text"]

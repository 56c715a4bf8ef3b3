"""Mutated examples never crash `graphrl validate`.

Hypothesis takes an example job and damages it, on the text (delete, duplicate or swap lines, truncate,
insert random bytes) and on the parsed structure (delete or add a key, rename a key, give a value
another type) written back with `yaml.safe_dump`. Whatever comes out, `graphrl validate` either
accepts it (exit 0) or refuses it with our own error: exit code 2, one `error:` line and at most one
`  fix:` line, never a traceback or another exit code. The run is derandomized, so CI sees the same
150 cases every time; a failure prints the mutated file.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrl.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {p.name: p.read_bytes() for p in sorted((REPO / "examples").glob("*.yaml"))}

# Keys of the job schema, so added and renamed keys are sometimes plausible typos, sometimes valid.
KEY_WORDS = ["op", "model", "inputs", "preset", "dims", "batch_size", "steps", "lr", "kl_coef", "fn", "task",
             "estimator", "loss", "devices", "roles", "placement", "samples_per_prompt", "max_new_tokens", "name"]

Draw = Callable[[st.SearchStrategy[Any]], Any]


# -- text mutations --------------------------------------------------------------------------------

def _uniform(draw: Draw) -> random.Random:
    """Hypothesis leans to small integers and first elements; its Random picks positions evenly."""
    return draw(st.randoms(use_true_random=False))


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True) or [b""]


def _line_index(lines: list[bytes], draw: Draw) -> int:
    """A line with content (Hypothesis favours small numbers, and the examples open with comments)."""
    content = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith(b"#")]
    return _uniform(draw).choice(content) if content else _uniform(draw).randrange(len(lines))


def _offset(data: bytes, draw: Draw) -> int:
    """A byte offset past the opening comments (cutting inside them only ever gives an empty file)."""
    start = max(data.find(b"\nname:"), 0)
    return _uniform(draw).randint(start, len(data))


def delete_line(data: bytes, draw: Draw) -> bytes:
    lines = _lines(data)
    del lines[_line_index(lines, draw)]
    return b"".join(lines)


def duplicate_line(data: bytes, draw: Draw) -> bytes:
    """Usually a duplicate key, which plain YAML would silently resolve to the last one."""
    lines = _lines(data)
    i = _line_index(lines, draw)
    lines.insert(draw(st.sampled_from([i, i + 1, _line_index(lines, draw)])), lines[i])
    return b"".join(lines)


def swap_lines(data: bytes, draw: Draw) -> bytes:
    lines = _lines(data)
    i, j = _line_index(lines, draw), _line_index(lines, draw)
    lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


def truncate(data: bytes, draw: Draw) -> bytes:
    return data[: _offset(data, draw)]


def insert_bytes(data: bytes, draw: Draw) -> bytes:
    at = _offset(data, draw)
    junk = draw(st.one_of(st.binary(min_size=1, max_size=6), st.text(min_size=1, max_size=6).map(str.encode),
                          st.sampled_from([b":", b"- ", b"{", b"}", b"[", b"\t", b"\n  ", b"&a ", b"*a", b"!!str ", b"'"])))
    return data[:at] + junk + data[at:]


TEXT_MUTATIONS = [delete_line, duplicate_line, swap_lines, truncate, insert_bytes]


# -- structural mutations --------------------------------------------------------------------------

def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside dicts and lists."""
    out: list[tuple] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_paths(child, prefix + (key,)))
    return out


def _parent(root: Any, path: tuple) -> Any:
    for part in path[:-1]:
        root = root[part]
    return root


def _get(root: Any, path: tuple) -> Any:
    for part in path:
        root = root[part]
    return root


def _other_type(value: Any, draw: Draw) -> Any:
    """A value of another type: int -> string, string -> list, scalar -> mapping, anything -> null..."""
    options: list[st.SearchStrategy[Any]] = [
        st.just(str(value)), st.just([value]), st.just({"value": value}), st.none(), st.booleans(),
        st.integers(-2, 2), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8), st.sampled_from(["", "a.b", "x:y", "0-1", "3-1", "policy", "rollout.rollouts"]),
    ]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        options.append(st.just(-value))
        options.append(st.just(0))
    return draw(st.one_of(options))


def delete_key(data: Any, draw: Draw) -> Any:
    paths = [p for p in _paths(data) if isinstance(_parent(data, p), dict)]
    if paths:
        path = _uniform(draw).choice(paths)
        del _parent(data, path)[path[-1]]
    return data


def add_key(data: Any, draw: Draw) -> Any:
    dicts = [()] + [p for p in _paths(data) if isinstance(_get(data, p), dict)]
    path = _uniform(draw).choice(dicts)
    target = _get(data, path)
    if isinstance(target, dict):
        key = draw(st.one_of(st.sampled_from(KEY_WORDS), st.text(min_size=1, max_size=6)))
        target[key] = draw(st.one_of(st.integers(-1, 3), st.text(max_size=5), st.sampled_from(["policy", "x.y"])))
    return data


def rename_key(data: Any, draw: Draw) -> Any:
    paths = [p for p in _paths(data) if isinstance(_parent(data, p), dict)]
    if paths:
        path = _uniform(draw).choice(paths)
        parent = _parent(data, path)
        new = draw(st.one_of(st.sampled_from(KEY_WORDS), st.text(min_size=1, max_size=6),
                             st.just(str(path[-1]) + "s")))
        parent[new] = parent.pop(path[-1])
    return data


def retype_value(data: Any, draw: Draw) -> Any:
    paths = _paths(data)
    if paths:
        path = _uniform(draw).choice(paths)
        parent = _parent(data, path)
        parent[path[-1]] = _other_type(parent[path[-1]], draw)
    return data


STRUCT_MUTATIONS = [delete_key, add_key, rename_key, retype_value]


@st.composite
def mutated_example(draw: Draw) -> tuple[str, bytes, list[str]]:
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    data = EXAMPLES[name]
    applied: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        mutation = draw(st.sampled_from(TEXT_MUTATIONS + STRUCT_MUTATIONS))
        if mutation in STRUCT_MUTATIONS:
            try:
                parsed = yaml.safe_load(data)
            except (yaml.YAMLError, UnicodeDecodeError, ValueError):
                parsed = None
            if not isinstance(parsed, dict):
                continue  # an earlier text mutation broke the YAML; nothing structural to change
            data = yaml.safe_dump(mutation(parsed, draw), sort_keys=False, allow_unicode=True).encode()
        else:
            data = mutation(data, draw)
        applied.append(mutation.__name__)
    return name, data, applied


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the examples' cluster files, so relative `cluster:` references still resolve."""
    folder = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(REPO / "examples" / "clusters", folder / "clusters")
    return folder


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=mutated_example())
def test_mutated_example_is_accepted_or_refused_cleanly(workdir: Path, case: tuple[str, bytes, list[str]]) -> None:
    name, data, applied = case
    path = workdir / name
    path.write_bytes(data)
    result = CliRunner().invoke(main, ["validate", str(path)])
    context = f"{name} after {applied}:\n{data.decode('utf-8', 'replace')}\n--- output:\n{result.output}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"crashed with {type(result.exception).__name__}: {result.exception}\n{context}") \
            from result.exception
    assert result.exit_code in (0, 2), context
    assert "Traceback" not in result.output, context
    if result.exit_code == 0:
        assert result.stdout.startswith("ok: "), context
        assert all(line.startswith("warning: ") for line in result.stderr.splitlines()), context
    else:
        lines = result.stderr.rstrip("\n").split("\n")
        assert result.stdout == "", context
        assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), context
        assert len(lines) == 1 or lines[1].startswith("  fix: "), context


def test_mutations_do_change_the_examples() -> None:
    """Guard against a fuzzer that silently tests nothing: each mutation kind alters a real example."""
    original = EXAMPLES["ppo_tiny.yaml"]
    parsed = yaml.safe_load(original)
    changed: set[str] = set()

    @settings(max_examples=20, derandomize=True, database=None)
    @given(st.data())
    def mutate_each(data: st.DataObject) -> None:
        for mutation in TEXT_MUTATIONS:
            if mutation(original, data.draw) != original:
                changed.add(mutation.__name__)
        for mutation in STRUCT_MUTATIONS:
            if mutation(yaml.safe_load(original), data.draw) != parsed:
                changed.add(mutation.__name__)

    mutate_each()
    assert changed == {m.__name__ for m in TEXT_MUTATIONS + STRUCT_MUTATIONS}

"""Each fact once: a set of choices is spelled out in one place, and no two classes share a name.

What broke: the sharding kinds were listed four times (once in another order), the precisions twice, the
schedule modes five times, and `Slice`, `Bucket` and `WeightSyncPlan` were each two different classes; a
new choice added to one list was missing from the others. The test reads every module of the package
with `ast`, so a second spelling of a fact fails here, whatever it is named.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path
from typing import get_args

import pytest

from graphrl.schemas.job import Precision, ScheduleMode, Sharding
from graphrl.schemas.weightsync import WeightSyncKind

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("compiler", "schemas", "graphrl", "executors")
FACTS = {"Sharding": Sharding, "Precision": Precision, "ScheduleMode": ScheduleMode, "WeightSyncKind": WeightSyncKind}


@functools.cache
def modules() -> list[tuple[str, ast.Module]]:
    files = sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)
    assert files, ROOT
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), filename=str(p))) for p in files]


def string_sets(tree: ast.Module) -> list[tuple[int, frozenset[str]]]:
    """(line, values) of every `Literal[...]`, tuple, list and set written as string constants only."""
    found = []
    literal_args = set()  # a Literal's tuple of arguments is counted with its Literal, not again
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            literal_args.add(id(node.slice))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in literal_args:
            items = node.elts
        else:
            continue
        if len(items) > 1 and all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            found.append((node.lineno, frozenset(i.value for i in items)))
    return found


@pytest.mark.parametrize("name", sorted(FACTS))
def test_a_set_of_choices_is_written_once(name: str) -> None:
    """The choices appear as one `Literal` in the package; everything else imports it (or its tuple)."""
    values = frozenset(get_args(FACTS[name]))
    places = [f"{path}:{line}" for path, tree in modules() for line, found in string_sets(tree) if found == values]
    assert len(places) == 1, f"{name} {sorted(values)} is written {len(places)} times: {places}"


def test_no_two_classes_share_a_name() -> None:
    """Two classes of one name (two `Slice`s, two `WeightSyncPlan`s) make a reader guess which one a name means."""
    where: dict[str, list[str]] = defaultdict(list)
    for path, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path}:{node.lineno}")
    assert {name: places for name, places in where.items() if len(places) > 1} == {}

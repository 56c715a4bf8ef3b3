"""The README's walk from a job file to a rank's `Generate` stays true: at most 12 code files, each named
file and name exists, each file is imported by one before it in the walk, and no file comes twice."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 12
# Where the installed package's subpackages live in the tree (pyproject's package-dir).
PACKAGE_DIRS = {"graphrl.compiler": "compiler", "graphrl.executors": "executors", "graphrl.schemas": "schemas",
                "graphrl": "graphrl"}
STEP = re.compile(r"^\d+\. `(?P<path>[^`]+)` `(?P<name>[^`]+)`: (?P<what>.+)$")


def walk() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### The walk:", 1)[1].split("\n#", 1)[0]
    return [(m["path"], m["name"]) for m in map(STEP.match, section.splitlines()) if m]


def module_file(module: str) -> str | None:
    """The tree path of a graphrl module (`graphrl.compiler.lower` -> compiler/lower.py)."""
    for prefix, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").replace(".", "/")
            base = ROOT / folder / rest if rest else ROOT / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return str(candidate.relative_to(ROOT))
    return None


def imported_files(path: str) -> set[str]:
    """Tree paths of the graphrl modules `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {f for f in map(module_file, names) if f is not None}
    return found


def defines(path: str, name: str) -> bool:
    """Whether `path` defines `name` at top level (a function, class or assignment) or `Class.method`."""
    tree = ast.parse((ROOT / path).read_text())
    head, _, method = name.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == head:
            return not method or any(isinstance(m, ast.FunctionDef) and m.name == method for m in node.body)
        targets = [t for t in getattr(node, "targets", [getattr(node, "target", None)]) if t is not None]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(isinstance(t, ast.Name) and t.id == head
                                                                 for t in targets):
            return not method
    return False


def test_the_walk_is_short_and_every_step_is_there() -> None:
    steps = walk()
    files = [path for path, _ in steps]
    assert 8 <= len(steps) <= MAX_FILES, steps
    assert len(set(files)) == len(files), "a file is visited twice"
    assert files[0] == "graphrl/cli.py" and files[-1].startswith("executors/")
    for path, name in steps:
        assert (ROOT / path).is_file(), path
        assert defines(path, name), f"{path} defines no {name}"


def test_each_file_is_reached_from_one_before_it() -> None:
    files = [path for path, _ in walk()]
    for k, path in enumerate(files[1:], start=1):
        before = set().union(*(imported_files(f) for f in files[:k]))
        assert path in before, f"{path} is imported by none of {files[:k]}"

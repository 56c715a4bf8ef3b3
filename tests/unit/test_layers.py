"""The layers as the folders show them, read from the source: every import of every module, at any depth
(a lazy import inside a function is an import too), followed from module to module.

- `schemas/` describes: it imports nothing of graphrl but itself.
- `executors/` run what the plan says: nothing they import, directly or through `graphrl/`, is in
  `compiler/`, and none of it is the weight-sync planner (ranks never plan their part of a sync).
- `compiler/` never reaches `executors/`, directly or through `graphrl/`.

A message names the chain of imports that breaks a rule, each link with its file and line.
"""

from __future__ import annotations

import ast
import functools
import tomllib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGES: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
PLANNER = "graphrl.compiler.ddma"  # the DDMA weight-sync planner


class Import(NamedTuple):
    """One import statement's target module, and where the statement is."""

    module: str
    file: Path
    line: int


def _module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the installed packages (`package-dir` in pyproject.toml).
    A package's subfolders that are packages of their own name there (graphrl's `schemas` is not: it is
    `graphrl.schemas` from the folder `schemas/`) are found under their own folder."""
    files: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else [parts[-1]])))
            files[name] = path
    return files


MODULES = _module_files()
FILES = {path: name for name, path in MODULES.items()}


def _known(name: str) -> str | None:
    """The module `name` runs: itself, or the nearest enclosing module we have (an attribute's module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The graphrl modules `module` imports, each with the line of its import statement."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return tuple(i for i in imports_in(path, package) if i.module != module)


def imports_in(path: Path, package: str) -> list[Import]:
    """The graphrl modules the file `path` of `package` imports, at any depth. `from a import b` imports
    `a`, and `a.b` where that is a module; importing `a.b.c` also runs the packages `a` and `a.b`. An
    import under `if TYPE_CHECKING:` runs only in a type checker, never with the module: it is left out."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node.test)
                   for stmt in node.body for inner in ast.walk(stmt)}
    found: list[Import] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            name = _known(target)
            while name is not None:  # the module and the packages it lives in
                found.append(Import(name, path, node.lineno))
                name = _known(name.rpartition(".")[0])
    return list(dict.fromkeys(found))


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _chain(links: list[Import], start: str) -> str:
    text = start
    for link in links:
        text += f"\n  -> {link.module}  ({link.file.relative_to(ROOT)}:{link.line})"
    return text


def reachable(start: str) -> dict[str, list[Import]]:
    """Every module `start` runs through its imports, with the shortest chain of imports to it."""
    chains: dict[str, list[Import]] = {start: []}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for link in imports_of(module):
            if link.module not in chains:
                chains[link.module] = chains[module] + [link]
                todo.append(link.module)
    return chains


def _deepest(imports: tuple[Import, ...]) -> list[Import]:
    """`imports` less the packages a statement runs only because it imports a module inside them."""
    return [i for i in imports if not any(j.line == i.line and j.module.startswith(i.module + ".") for j in imports)]


def _of(package: str) -> list[str]:
    return sorted(m for m in MODULES if _in(m, package))


def test_the_walk_finds_every_package_and_every_import(tmp_path: Path) -> None:
    """The rules below would hold vacuously if the walk found no modules, or missed an import inside a
    function or a relative one; an import for the type checker only is no import."""
    for package in ("graphrl.schemas", "graphrl.compiler", "graphrl.executors"):
        assert len(_of(package)) > 5, package
    assert PLANNER in MODULES, f"{PLANNER} not found: the weight-sync planner moved; name it here"
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from graphrl.compiler.weight_sync import ddma_record\n"
                      "from .mesh import Mesh\nif TYPE_CHECKING:\n    from graphrl.executors import fp8\n")
    found = {i.module for i in imports_in(module, "graphrl.schemas")}
    assert found == {"graphrl", "graphrl.compiler", "graphrl.compiler.weight_sync", "graphrl.schemas",
                     "graphrl.schemas.mesh"}


def test_schemas_import_nothing_of_graphrl_but_themselves() -> None:
    bad = [_chain([i], m) for m in _of("graphrl.schemas") for i in _deepest(imports_of(m))
           if not _in(i.module, "graphrl.schemas") and i.module != "graphrl"]
    assert not bad, "schemas/ imports graphrl modules outside schemas/:\n" + "\n".join(bad)


def crossings(starts: list[str], forbidden: Callable[[str], bool]) -> list[str]:
    """The chains by which `starts` reach a forbidden module, one per import that first crosses into it."""
    found: dict[tuple[Path, int], tuple[str, str]] = {}  # the crossing statement -> (its module, the chain)
    for start in starts:
        for links in reachable(start).values():
            cut = next((k for k, link in enumerate(links) if forbidden(link.module)), None)
            if cut is None:
                continue
            link = links[cut]
            known = found.get((link.file, link.line))
            if known is None or link.module.startswith(known[0] + "."):  # name the module, not its package
                found[link.file, link.line] = (link.module, _chain(links[:cut + 1], start))
    return [chain for _, chain in found.values()]


def test_executors_never_reach_the_compiler_or_the_planner() -> None:
    bad = crossings(_of("graphrl.executors"), lambda m: _in(m, "graphrl.compiler") or m == PLANNER)
    assert not bad, "executors/ reach compiler/ or the planner (ranks would re-derive what the plan says):\n" + \
        "\n".join(bad)


def test_the_compiler_never_reaches_the_executors() -> None:
    bad = crossings(_of("graphrl.compiler"), lambda m: _in(m, "graphrl.executors"))
    assert not bad, "compiler/ reaches executors/:\n" + "\n".join(bad)

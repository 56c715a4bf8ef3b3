"""The contract between plan and run: executors read only the plan.

The executors import `schemas/` and the torch-free sharding description, and nothing from `compiler/` (the
DDMA planner included); a compiler import in an executor module would let a rank re-derive what the plan
should have told it (the job graph, a weight-sync plan, a verification), so it fails here, and
`test_layers.py` follows the imports through `graphrl/` as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from graphrl.compiler.compile import compile_job
from graphrl.loader import job_cluster, load_job

ROOT = Path(__file__).resolve().parents[2]
EXECUTOR_MODULES = sorted((ROOT / "executors").rglob("*.py"))


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", EXECUTOR_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_executor_module_imports_the_compiler(path: Path) -> None:
    bad = [name for name in _imports(path)
           if name.startswith("graphrl.compiler") or name in ("graphrl.ir", "graphrl.ir.build_graph")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: executors read only the plan"


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    """A lazy import inside a function is still an import; the walk must find it."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from graphrl.compiler.weight_sync import ddma_record\n")
    assert "graphrl.compiler.weight_sync" in _imports(module)


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml", "aipo_async_tiny.yaml"])
def test_the_plan_binds_every_node_and_role(name: str) -> None:
    """Each node's inputs name their producer and its op; each role its head and learning rate."""
    job = load_job(ROOT / "examples" / name)
    plan = compile_job(job, job_cluster(job, None), steps=2)
    b = plan.bindings
    assert b is not None
    assert set(b.nodes) == set(job.spec.nodes)
    for node, binding in b.nodes.items():
        for port, ref in job.spec.nodes[node].inputs.items():
            src = binding.inputs[port]
            assert f"{src.node}.{src.port}" == ref and src.op == job.spec.nodes[src.node].op
    assert set(b.roles) == {p.role for p in plan.chosen.placements}
    for p in plan.chosen.placements:
        role = b.roles[p.role]
        assert (role.lr is not None) == (p.kind == "train")
    scalar = {n.model for n in job.spec.nodes.values() if n.op in ("value", "reward") and getattr(n, "model", None)}
    assert {r.model for r in b.roles.values() if r.head == "value"} == scalar  # critics and reward models
    assert job.spec.nodes[b.generate_node].op == "generate" and job.spec.nodes[b.dataset_node].op == "dataset"

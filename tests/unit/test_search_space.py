"""The placement search proposes only layouts the executors run: no pipeline parallelism unless pinned.

The executors refuse pp > 1 (executors/executor.py), yet the search used to rank pipelined trainers and
chose `fsdp16xtp2xpp2` candidates for the 8B example, so a plan the preview recommended could not run.
These tests enumerate every candidate half and every evaluated candidate of small clusters and fail on
any pp > 1 the user did not pin; a pinned pp is still laid out (the preview shows it) and `graphrl run`
refuses it before starting a rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.typecheck import typecheck
from graphrl.compiler.candidates import Problem, make_problem, splits, train_cfgs
from graphrl.compiler.placement import search
from graphrl.ir import build_graph
from graphrl.loader import apply_overrides, job_cluster, load_job, parse_override

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def problem(example: str, cluster: str | None = None, *sets: str) -> Problem:
    job = apply_overrides(load_job(EXAMPLES / example), [parse_override(s) for s in sets])
    spec = job_cluster(job, cluster)
    hw = resolve_hardware(spec)
    graph = typecheck(build_graph(job.spec), spec)
    return make_problem(graph, spec, hw)


CASES = [("grpo_tiny.yaml", "local-cpu-2"), ("grpo_tiny.yaml", "local-cpu-4"), ("ppo_tiny.yaml", "local-cpu-4"),
         ("llama3_8b.yaml", str(EXAMPLES / "clusters" / "h200_8.yaml"))]


@pytest.mark.parametrize("example, cluster", CASES)
def test_search_never_proposes_pipeline_parallelism(example: str, cluster: str) -> None:
    p = problem(example, cluster)
    meshes = [(0, p.num_devices)] + [(t_first, t_n) for _, _, t_first, t_n in splits(p)]
    halves = [cfg for first, n in meshes for cfg in train_cfgs(p, first, n)]
    assert halves and all(cfg.pp == 1 for cfg in halves)
    # The enumeration still covers the other axes, so the test cannot pass by enumerating nothing.
    assert {cfg.sharding for cfg in halves} >= {"none", "fsdp"} and max(cfg.fsdp for cfg in halves) == p.num_devices
    result = search(p, exhaustive=True)
    assert all(ev.train.pp == 1 for ev in result.ranked + result.rejected)
    assert result.best.train.pp == 1 and (result.baseline is None or result.baseline.train.pp == 1)


def test_a_pinned_pp_is_still_laid_out_for_the_preview() -> None:
    p = problem("grpo_tiny.yaml", "local-cpu-2", "placement.roles.policy.pp=2")
    result = search(p, exhaustive=True)
    assert result.ranked and all(ev.train.pp == 2 for ev in result.ranked)


@pytest.mark.parametrize("command", ["run", "launch"])
def test_run_and_launch_refuse_a_pinned_pp_up_front(command: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--out", str(out), "--quiet"] if command == "run" else ["--emit", "torchrun", "-o", str(out)]
    result = CliRunner().invoke(main, [command, str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "1", *args,
                                       "--set", "placement.roles.policy.pp=2"])
    assert result.exit_code == 2, result.output
    assert "placement.roles.policy.pp: pp 2: pipeline-parallel execution is not implemented" in result.stderr
    assert "Traceback" not in result.output and not out.exists()  # nothing started, nothing written


@pytest.mark.parametrize("example, cluster", CASES)
def test_a_colocated_plan_predicts_the_generation_the_search_ranked(example: str, cluster: str) -> None:
    """The Generate duration the programs carry (what the simulator charges) is the one the search ranked
    the candidate by: both leave the generator the memory the trainer's idle state does not hold."""
    from graphrl.compiler.cost import layout_durations
    from graphrl.compiler.to_layout import to_layout
    from graphrl.schemas.program import CostKey

    p = problem(example, cluster)
    colocated = [ev for ev in search(p, exhaustive=True).ranked if ev.strategy == "colocated" and ev.fits]
    assert colocated
    key = CostKey("Generate", p.generator.name)
    for ev in colocated:
        assert layout_durations(p, ev, to_layout(p, ev))[key] == pytest.approx(ev.phases["generate"], rel=1e-12)

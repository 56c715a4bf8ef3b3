"""Every kind of layout the placement search can choose on 2- and 4-rank CPU clusters runs, and trains
exactly as the single-rank run does.

The search is enumerated exhaustively (every candidate it ranks, `search(exhaustive=True)`); candidates
are grouped by what the executor does differently for them: the strategy, how the trainer is wrapped
(one rank, DDP, FSDP2, tp, FSDP2 x tp) and whether generation is tensor parallel. One representative of
each kind is pinned through `--set`, exactly as a user would, and run for a few steps.

Why equal results can be asked for: prompts are drawn for the whole batch and every response is sampled
from uniforms seeded by (seed, step, response index) alone (`executor.response_uniforms`), so a layout
changes neither the prompts nor the draws; losses are token means over the whole batch on every layout
(`executors/training.py:loss_weights`). What remains is the order of float32 sums (data-parallel gradient
averaging, tp's partial products and all-reduces), which moves losses by about 1e-7 relative per step
here (measured: below 1e-6 over three steps); LOSS_REL = 1e-5 leaves a margin while a wrong shard, a
gradient averaged over the wrong group or a missing all-reduce changes the losses in the second digit.
A sampled token could flip only if a uniform fell within ~1e-7 of a CDF boundary (about 1e-3 odds over
a run's draws): rule rewards then agree exactly, and a reward model's (ppo_tiny) within the same
LOSS_REL. That the single-rank run learns is test_learning's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.typecheck import typecheck
from graphrl.compiler.candidates import Evaluated, make_problem
from graphrl.compiler.placement import search
from graphrl.ir import build_graph
from graphrl.loader import job_cluster, load_job

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3
LOSS_REL = 1e-5


def trainer_wrapping(ev: Evaluated) -> str:
    t = ev.train
    data_parallel = t.dp * t.fsdp
    if t.tp > 1:
        return "fsdp2 x tp" if data_parallel > 1 else "tp"
    if data_parallel == 1:
        return "single"
    return "fsdp2" if t.sharding in ("fsdp", "zero2") else "ddp"  # zero2 is fully_shard without resharding


def kind(ev: Evaluated) -> tuple[str, str, bool]:
    return ev.strategy, trainer_wrapping(ev), ev.gen.tp > 1


def pins(ev: Evaluated) -> list[str]:
    """The `--set` overrides that make the search return exactly this candidate's layout."""
    t, g = ev.train, ev.gen
    sets = [f"placement.strategy={ev.strategy}", f"placement.roles.policy.tp={t.tp}",
            f"placement.roles.policy.dp={t.dp}", f"placement.roles.policy.fsdp={t.fsdp}",
            f"placement.roles.policy.sharding={t.sharding}", f"placement.roles.policy/generate.tp={g.tp}"]
    if ev.strategy == "disaggregated":
        sets += [f"placement.roles.policy.devices={t.first}-{t.first + t.n - 1}",
                 f"placement.roles.policy/generate.devices={g.first}-{g.first + g.n - 1}"]
    return sets


def representatives(example: str, cluster: str) -> dict[tuple[str, str, bool], Evaluated]:
    job = load_job(EXAMPLES / example)
    spec = job_cluster(job, cluster)
    hw = resolve_hardware(spec)
    graph = typecheck(build_graph(job.spec), spec)
    out: dict[tuple[str, str, bool], Evaluated] = {}
    for ev in search(make_problem(graph, spec, hw), exhaustive=True).ranked:
        out.setdefault(kind(ev), ev)
    return out


def run(example: str, out: Path, *sets: str) -> tuple[str, list[dict]]:
    args = ["run", str(EXAMPLES / example), "--steps", str(STEPS), "--out", str(out), "-q"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, f"{' '.join(sets)}:\n{result.output}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result.output.splitlines()[0], rows


def cases() -> list[tuple[str, str, tuple[str, str, bool]]]:
    """Every (strategy, trainer wrapping) once with data-parallel generation, and per strategy one
    trainer wrapping with tensor-parallel generation: the generator's code path does not depend on how
    the trainer is wrapped, except through the weight sync, which test_tensor_parallel covers shard by
    shard for full, FSDP2 and fsdp x tp trainers."""
    found = []
    seen: set[tuple[str, str, bool]] = set()
    gen_tp_for: set[str] = set()
    for cluster in ("local-cpu-2", "local-cpu-4"):
        for k in representatives("grpo_tiny.yaml", cluster):
            strategy, wrapping, gen_tp = k
            if k in seen or (gen_tp and strategy in gen_tp_for):
                continue
            seen.add(k)
            if gen_tp:
                gen_tp_for.add(strategy)
            found.append(("grpo_tiny.yaml", cluster, k))
    # A critic and a frozen reference on a tensor-parallel trainer mesh.
    found.append(("ppo_tiny.yaml", "local-cpu-4", ("colocated", "fsdp2 x tp", False)))
    return found


CASES = cases()


def test_the_enumeration_covers_every_wrapping_and_tensor_parallel_generation() -> None:
    kinds = {k for _, _, k in CASES}
    assert {w for _, w, _ in kinds} == {"single", "ddp", "fsdp2", "tp", "fsdp2 x tp"}
    assert {s for s, _, _ in kinds} == {"colocated", "disaggregated"}
    assert any(gen_tp for _, _, gen_tp in kinds) and any(not gen_tp for _, _, gen_tp in kinds)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("single")
    return {ex: run(ex, base / ex, "cluster=local-cpu-1")[1] for ex in {ex for ex, _, _ in CASES}}


@pytest.mark.parametrize("example, cluster, layout", CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_layout_runs_like_the_single_rank_run(example: str, cluster: str, layout, single_rank, tmp_path) -> None:
    ev = representatives(example, cluster)[layout]
    label, rows = run(example, tmp_path, f"cluster={cluster}", *pins(ev))
    assert ev.train.label.split(" rc")[0].split(" off")[0] in label and ev.gen.label in label, (label, ev.label)
    want = single_rank[example]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["reward_mean"] for r in rows] == pytest.approx([r["reward_mean"] for r in want], rel=LOSS_REL)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=LOSS_REL)

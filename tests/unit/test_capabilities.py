"""The capability table is the one place that says what runs: the search, the pin checks, the launcher and
the README all follow it.

Before, the search offered zero1/zero2 (charged as sharded, run as DDP with replicated AdamW), a ZeRO
stage on one data-parallel rank (run as a plain local trainer), and none/zero1 on a tensor-parallel
trainer with data parallelism (run as FSDP2 with sharded weights); each of these is now either run as
charged or refused, naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.compile import compile_job
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.typecheck import typecheck
from graphrl.compiler.candidates import make_problem, splits, train_cfgs
from graphrl.compiler.placement import search
from graphrl.errors import RunError
from graphrl.executors.launcher import launch_local
from graphrl.ir import build_graph
from graphrl.loader import apply_overrides, job_cluster, load_job, parse_override
from graphrl.schemas.capabilities import (CAPABILITIES, generator_reads_trainer, hardware_has_fp8, plan_refusals,
                                          precision_refusal, runs, train_layout_refusal, what_runs_markdown)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_the_readme_table_is_the_capability_table() -> None:
    """README's "what runs" table is generated from CAPABILITIES; an entry added to one and not the other
    (a choice the search can make that the README does not list) fails here."""
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- what-runs:begin -->\n", "\n<!-- what-runs:end -->"
    assert begin in text and end in text
    assert text[text.index(begin) + len(begin):text.index(end)] == what_runs_markdown()


def test_every_entry_says_how_and_the_table_has_one_verdict_per_choice() -> None:
    seen = set()
    for c in CAPABILITIES:
        assert c.how
        for role in c.roles:
            assert (c.kind, c.value, role) not in seen, (c.kind, c.value, role)
            seen.add((c.kind, c.value, role))
    assert runs("precision", "fp8", "generate") and not runs("precision", "fp8", "train")
    assert not runs("axis", "pp", "train") and runs("sharding", "zero1", "train")


@pytest.mark.parametrize("dp, fsdp, tp, pp, sharding, field", [
    (1, 1, 1, 1, "zero1", "sharding"), (1, 1, 2, 1, "zero2", "sharding"), (1, 1, 1, 1, "fsdp", "sharding"),
    (1, 2, 2, 1, "none", "sharding"), (2, 1, 2, 1, "zero1", "sharding"), (1, 2, 1, 2, "fsdp", "pp"),
    (1, 2, 1, 1, "zero1", None), (2, 2, 1, 1, "zero2", None), (1, 2, 2, 1, "fsdp", None), (1, 1, 2, 1, "none", None),
])
def test_train_layout_refusals(dp: int, fsdp: int, tp: int, pp: int, sharding: str, field: str | None) -> None:
    refusal = train_layout_refusal(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sharding=sharding)
    assert (refusal.field if refusal else None) == field


def test_fp8_generation_needs_fp8_hardware() -> None:
    assert precision_refusal("generate", "fp8", hardware_fp8=True) is None
    assert precision_refusal("generate", "fp8", hardware_fp8=False).field == "precision"  # type: ignore[union-attr]
    assert precision_refusal("train", "fp8", hardware_fp8=True).field == "precision"  # type: ignore[union-attr]


@pytest.mark.parametrize("sharding, one_unit, reads", [
    ("none", False, True), ("zero1", False, True),  # replicated weights
    ("zero2", False, True), ("zero2", True, True),  # gathered at the sync, kept through backward
    ("fsdp", True, True),  # one unit: the root keeps the gathered weights through backward
    ("fsdp", False, False),  # units resharded after each forward: the generator keeps a copy of its own
])
def test_a_colocated_generator_reads_the_trainer_when_its_weights_stay_whole(sharding: str, one_unit: bool,
                                                                            reads: bool) -> None:
    whole = dict(colocated=True, gen_tp=1, precision="bf16", train_tp=1, sharding=sharding, one_unit=one_unit)
    assert generator_reads_trainer(**whole) is reads  # type: ignore[arg-type]
    # Another copy in every other case: disaggregated, cut over tp, fp8, or a tensor-parallel trainer.
    for change in (dict(colocated=False), dict(gen_tp=2), dict(precision="fp8"), dict(train_tp=2)):
        assert not generator_reads_trainer(**{**whole, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_the_preview_says_a_sharded_trainer_is_gathered_for_its_generator(sharding: str) -> None:
    """grpo_tiny is one FSDP2 unit, so under zero2 and fsdp alike its colocated generator samples from the
    trainer's weights gathered in place (the executors' `build_generate` reads the same rule)."""
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override(s) for s in (
        "placement.strategy=colocated", f"placement.roles.policy.sharding={sharding}", "placement.roles.policy.tp=1")])
    plan = compile_job(job, job_cluster(job, "local-cpu-2"), target="run", steps=2)
    sync = next(op for op in plan.chosen.operations if op.kind == "reshard_in_place")
    assert sync.detail.startswith(f"gather the trainer's {sharding} shards in place"), sync.detail
    assert sync.num_bytes > 0
    # Its weights are the trainer's gathered ones, charged once: with the trainer, in every phase.
    gen, trainer = (next(p for p in plan.chosen.placements if p.kind == kind) for kind in ("generate", "train"))
    assert gen.memory_bytes.params == 0.0 and trainer.memory_bytes.gathered > 0


def test_a_trainer_gathered_by_its_generators_sync_is_not_charged_the_forward_gather_again() -> None:
    """The sync's gather is the one the first forward would do: the policy's predicted update drops it
    (zero2, fsdp), and a replicated trainer's gathers nothing either way."""
    from graphrl.compiler.cost import role_times
    from graphrl.schemas.program import CostKey

    p = _problem("grpo_tiny.yaml", "local-cpu-2", "run")
    update = CostKey("TrainStep", p.policy.name)
    by_sharding = {cfg.sharding: cfg for cfg in train_cfgs(p, 0, p.num_devices) if cfg.tp == 1 and not cfg.offload
                   and not cfg.recompute}
    for sharding, cfg in by_sharding.items():
        plain, gathered = role_times(p, cfg)[update], role_times(p, cfg, gathered_at_sync=True)[update]
        if sharding in ("zero2", "fsdp"):
            assert gathered < plain, sharding
        else:
            assert gathered == plain, sharding


def _problem(example: str, cluster: str | None, target: str):  # noqa: ANN202
    job = load_job(EXAMPLES / example)
    spec = job_cluster(job, cluster)
    hw = resolve_hardware(spec)
    graph = typecheck(build_graph(job.spec), spec, target)  # type: ignore[arg-type]
    return make_problem(graph, spec, hw, target)  # type: ignore[arg-type]


@pytest.mark.parametrize("example, cluster", [("grpo_tiny.yaml", "local-cpu-2"), ("grpo_tiny.yaml", "local-cpu-4"),
                                              ("ppo_tiny.yaml", "local-cpu-4"),
                                              ("llama3_8b.yaml", str(EXAMPLES / "clusters" / "h200_8.yaml"))])
def test_the_search_offers_run_only_what_runs(example: str, cluster: str) -> None:
    p = _problem(example, cluster, "run")
    meshes = [(0, p.num_devices)] + [(t_first, t_n) for _, _, t_first, t_n in splits(p)]
    halves = [cfg for first, n in meshes for cfg in train_cfgs(p, first, n)]
    for cfg in halves:
        assert train_layout_refusal(dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp, sharding=cfg.sharding) is None
    # Every sharding that runs is still offered somewhere, so the filter cannot pass by offering nothing.
    assert {cfg.sharding for cfg in halves} == {"none", "zero1", "zero2", "fsdp"}
    result = search(p, exhaustive=True)
    fp8 = hardware_has_fp8(p.hw)
    for ev in result.ranked:
        if ev.gen is not None:
            assert precision_refusal("generate", ev.gen.precision, hardware_fp8=fp8) is None


def _invoke(*args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main, list(args))
    return out.exit_code, out.output


@pytest.mark.parametrize("cluster, sets, field, words", [
    ("local-cpu-2", ["placement.roles.policy.tp=2", "placement.roles.policy.sharding=zero1"],
     "placement.roles.policy.sharding", "one data-parallel rank"),
    ("local-cpu-4", ["placement.roles.policy.tp=2", "placement.roles.policy.sharding=zero1"],
     "placement.roles.policy.sharding", "tensor-parallel trainer"),
    ("local-cpu-2", ["placement.roles.policy.precision=fp8"], "placement.roles.policy.precision", "generation copies"),
])
@pytest.mark.parametrize("command", ["validate", "compile"])
def test_pins_the_executors_do_not_run_are_refused_naming_the_field(command: str, cluster: str, sets: list[str],
                                                                     field: str, words: str) -> None:
    args = [command, str(EXAMPLES / "grpo_tiny.yaml"), "--set", f"cluster={cluster}", "--set",
            "placement.strategy=colocated"]
    for s in sets:
        args += ["--set", s]
    code, output = _invoke(*args)
    assert code == 2, output
    assert field in output and words in output and "Traceback" not in output


def test_a_pinned_pp_is_for_the_preview_only() -> None:
    """validate checks for `run` by default (a pp is refused, naming it); `--target preview` accepts what
    `compile` lays out, and the preview says that the plan does not run."""
    pin = ["--set", "placement.roles.policy.pp=2"]
    code, output = _invoke("validate", str(EXAMPLES / "grpo_tiny.yaml"), *pin)
    assert code == 2 and "placement.roles.policy.pp" in output and "pipeline-parallel" in output
    code, output = _invoke("validate", str(EXAMPLES / "grpo_tiny.yaml"), "--target", "preview", *pin)
    assert code == 0, output
    code, output = _invoke("compile", str(EXAMPLES / "grpo_tiny.yaml"), "--plan", *pin)
    assert code == 0 and "preview only, `graphrl run` refuses this plan" in output


def test_a_float16_trainer_is_refused_for_run() -> None:
    code, output = _invoke("validate", str(EXAMPLES / "grpo_tiny.yaml"), "--set", "models.policy.dtype=float16")
    assert code == 2 and "models.policy.dtype" in output and "loss scaling" in output


def test_the_launcher_refuses_a_plan_that_does_not_run_before_starting_a_rank(tmp_path: Path) -> None:
    """A plan compiled for the preview (a pinned pp) and handed to the launcher is refused before any
    process starts: nothing is written to the run folder."""
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override("placement.roles.policy.pp=2")])
    plan = compile_job(job, job_cluster(job, None), steps=1)
    assert [r.refusal.field for r in plan_refusals(plan)] == ["pp"]
    with pytest.raises(RunError, match="pipeline-parallel"):
        launch_local(plan, tmp_path / "run")
    assert not (tmp_path / "run").exists()

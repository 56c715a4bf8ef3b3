"""The compiler's stages: the design's passes in order, each stage's spec holds on every example
job, and each spec catches the mistake it exists for, reported under the pass that made it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest

from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler import candidates, passes
from graphrl.compiler.background import Later
from graphrl.compiler.compile import start, with_steps
from graphrl.loader import job_cluster, load_job
from graphrl.schemas.program import CostKey, Recv
from graphrl.schemas.weightsync import Round
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.offload import RoleOffload
from graphrl.compiler.passes import CompileContext, PassFailure, run_passes
from graphrl.compiler.pipeline import PIPELINE, PROGRAM_PASSES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _compile(name: str, passes=PIPELINE, **options):  # noqa: ANN001, ANN202
    job = load_job(str(EXAMPLES / name))
    cluster = job_cluster(job, None)
    spec = with_steps(job.spec, 8)
    ctx = CompileContext(spec, cluster, resolve_hardware(cluster), dict(options))
    return run_passes(start(spec), ctx, passes, check=True)


def test_the_pipeline_is_the_designs_passes() -> None:
    assert [p.name for p in PIPELINE] == ["typecheck", "placement", "refine_placement", "weight_sync", "offload",
                                          "reshard", "schedule", "baseline", "lower", "estimate", "verify"]
    # The chosen layout's programs are made by the same passes as every other layout's.
    names = [p.name for p in PIPELINE]
    assert [n for n in names if n in {p.name for p in PROGRAM_PASSES}] == [p.name for p in PROGRAM_PASSES]
    # Every pass after placement reads only what the passes before it ensured.
    ensured: set[str] = set()
    for p in PIPELINE:
        assert set(p.requires) <= ensured, p.name
        ensured |= set(p.ensures)


# Colocated without offload (grpo), disaggregated async with DDMA (aipo), a critic (ppo), paper scale.
@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "aipo_async_tiny.yaml", "ppo_tiny.yaml", "llama3_8b.yaml"])
def test_every_stage_spec_holds_on_the_examples(name: str) -> None:
    graph = _compile(name)
    for p in PIPELINE:
        if p.spec is not None:
            assert p.spec(graph) == [], p.name
    assert graph.weight_sync.kind in ("in_place", "ddma")


def test_placement_hands_on_typed_records_not_the_search() -> None:
    """The passes after placement read the job's shape, the layouts and their durations: nothing of the
    search's own records (`Problem`, `Evaluated`) leaves the placement pass."""
    placed = _compile("aipo_async_tiny.yaml").placement
    private = (candidates.Problem, candidates.Evaluated, candidates.TrainCfg, candidates.GenCfg)
    for f in dataclasses.fields(placed):
        assert not isinstance(getattr(placed, f.name), private), f.name
    assert {k.kind for k in placed.durations} >= {"TrainStep", "Generate", "Rule", "Checkpoint"}
    assert all(isinstance(k, CostKey) for k in placed.durations)
    assert placed.shape.generator is not None and placed.meshes()[1] is not None


def _corrupting(pass_name: str, corrupt):  # noqa: ANN001, ANN202
    """The pipeline with one pass's output spoiled by `corrupt(graph) -> graph`."""
    def spoil(p):  # noqa: ANN001, ANN202
        return dataclasses.replace(p, fn=lambda g, c: corrupt(p.fn(g, c)))
    return tuple(spoil(p) if p.name == pass_name else p for p in PIPELINE)


def _replace_attr(graph, name: str, **changes):  # noqa: ANN001, ANN202
    return dataclasses.replace(graph, **{name: dataclasses.replace(getattr(graph, name), **changes)})


def _forget_the_generation_time(graph):  # noqa: ANN001, ANN202
    durations = {k: v for k, v in graph.placement.durations.items() if k.kind != "Generate"}
    return _replace_attr(graph, "placement", durations=MappingProxyType(durations))


def _drop_first_transfer(graph):  # noqa: ANN001, ANN202
    return _replace_attr(graph, "reshard", transfers=graph.reshard.transfers[1:])


def _double_offload_bytes(graph):  # noqa: ANN001, ANN202
    roles = {r: RoleOffload(o.state, 2 * o.num_bytes + 1) for r, o in graph.offload.roles.items()}
    return _replace_attr(graph, "offload", roles=MappingProxyType(roles))


def _same_sender_twice_in_a_round(graph):  # noqa: ANN001, ANN202
    record = graph.weight_sync.record
    src, dst, contents = (record.columns[k][0] for k in record.rounds[0])
    n = len(record.columns)
    columns = record.columns + [(src, src), (dst, dst + 1), (contents, contents)]
    rounds = [Round(n, n + 1, n + 2)] + record.rounds[1:]
    spoiled = record.model_copy(update={"columns": columns, "rounds": rounds})
    return _replace_attr(graph, "weight_sync", planned=Later.now((graph.weight_sync.seconds, spoiled)))


def _drop_a_receive(graph):  # noqa: ANN001, ANN202
    sched = graph.schedule
    transcripts = {}
    for n, streams in sched.transcripts.items():
        rank = next(r for r, s in enumerate(streams) if any(isinstance(i, Recv) for i in s))
        stream = list(streams[rank])
        stream.remove(next(i for i in stream if isinstance(i, Recv)))
        transcripts[n] = streams[:rank] + (tuple(stream),) + streams[rank + 1:]
    return _replace_attr(graph, "schedule", transcripts=MappingProxyType(transcripts))


def _drop_a_body_instruction(graph):  # noqa: ANN001, ANN202
    programs = graph.programs
    rank = next(r for r, p in enumerate(programs.ranks) if p.body)
    ranks = list(programs.ranks)
    ranks[rank] = dataclasses.replace(ranks[rank], body=ranks[rank].body[1:])
    return dataclasses.replace(graph, programs=dataclasses.replace(programs, ranks=ranks))


@pytest.mark.parametrize("stage, corrupt, example, reason", [
    ("placement", _forget_the_generation_time, "grpo_tiny.yaml", "no finite predicted duration for Generate"),
    ("reshard", _drop_first_transfer, "aipo_async_tiny.yaml", "needs responses"),
    ("offload", _double_offload_bytes, "llama3_70b.yaml", "its placement holds"),
    ("weight_sync", _same_sender_twice_in_a_round, "aipo_async_tiny.yaml", "sends or receives twice"),
    ("schedule", _drop_a_receive, "aipo_async_tiny.yaml", "do not pair up"),
    ("lower", _drop_a_body_instruction, "grpo_tiny.yaml", "is not the schedule's transcript"),
])
def test_a_spoiled_stage_is_caught_by_its_spec_under_its_name(stage, corrupt, example, reason) -> None:  # noqa: ANN001
    graph = _compile(example, passes=PIPELINE[:PIPELINE.index(next(p for p in PIPELINE if p.name == stage)) + 1])
    assert stage != "offload" or graph.offload.roles, f"{example}'s layout offloads nothing"
    assert stage != "reshard" or graph.reshard.transfers, f"{example}'s layout moves no responses"
    with pytest.raises(PassFailure) as err:
        _compile(example, passes=_corrupting(stage, corrupt))
    assert err.value.pass_name == stage
    assert reason in str(err.value)


def test_debug_compile_checks_every_stage(monkeypatch) -> None:  # noqa: ANN001
    checked: list[int] = []
    real = passes.check_invariants
    monkeypatch.setattr(passes, "check_invariants", lambda g: checked.append(1) or real(g))
    plain = CliRunner().invoke(main, ["compile", str(EXAMPLES / "grpo_tiny.yaml"), "--plan", "--format", "json"])
    assert plain.exit_code == 0 and not checked
    debug = CliRunner().invoke(main, ["--debug", "compile", str(EXAMPLES / "grpo_tiny.yaml"), "--plan", "--format", "json"])
    assert debug.exit_code == 0, debug.output
    assert len(checked) == len(PIPELINE)


COLOCATED_TP2 = ["cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.tp=1",
                 "placement.roles.policy.sharding=fsdp", "placement.roles.policy/generate.tp=2"]


def _job_with(name: str, *sets: str):  # noqa: ANN202
    from graphrl.loader import apply_overrides, parse_override

    return apply_overrides(load_job(str(EXAMPLES / name)), [parse_override(s) for s in sets])


def test_a_colocated_tensor_parallel_generator_is_filled_by_a_stored_ddma_plan() -> None:
    """Colocated fsdp2 trainer, tp2 generator on the same 2 ranks: the plan stores the DDMA plan of the
    reshard (ranks once planned it themselves when the run started), which copies the weight matrices
    rank-locally and sends only the norms; the baseline and the ranking, only simulated, plan none."""
    from graphrl.compiler.compile import compile_job
    from graphrl.schemas.program import ReshardInPlace

    job = _job_with("grpo_tiny.yaml", *COLOCATED_TP2)
    plan = compile_job(job, job_cluster(job, None), check=True)
    assert plan.chosen.strategy == "colocated"
    assert any(isinstance(i, ReshardInPlace) for r in plan.programs.ranks for i in r.body)
    (record,) = plan.programs.weight_syncs.values()
    assert record.model == "policy" and record.src.devices == record.dst.devices == (0, 1)
    crossing = {s.param for b in record.buckets() for s in b.slices}
    assert crossing and all(name.endswith("norm.weight") for name in crossing), crossing
    assert record.summary.local_bytes > 100 * record.summary.total_bytes
    assert {c.rank for c in record.local} == {0, 1}


def test_each_rank_reads_its_part_of_the_stored_weight_sync() -> None:
    """What an executor reads of a stored sync: in every round exactly the buckets its rank sends or
    receives (each round in place, maybe empty), and its own local copies."""
    from graphrl.compiler.compile import compile_job

    job = load_job(str(EXAMPLES / "aipo_async_tiny.yaml"))
    plan = compile_job(job, job_cluster(job, None))
    (stored,) = plan.programs.weight_syncs.values()
    everything = [stored.round_buckets(k) for k in range(len(stored.rounds))]
    assert sum(map(len, everything)) == stored.summary.num_buckets > 0
    for rank in range(plan.cluster.num_devices):
        assert [stored.round_buckets(k, rank) for k in range(len(stored.rounds))] == [
            [b for b in r if rank in (b.src, b.dst)] for r in everything]
        assert stored.local_copies(rank) == [c for c in stored.local_copies() if c.rank == rank]

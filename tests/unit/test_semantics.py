"""The tables of instruction meaning: the shared traits, the compiler's semantics and the executor's
handlers are complete and consistent, and what the simulator and `verify` read."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphrl.compiler.compile import compile_graph
from graphrl.compiler.semantics import SEMANTICS, STATE, Costs, Ledger
from graphrl.errors import VerifyError
from graphrl.executors.executor import HANDLERS
from graphrl.loader import job_cluster, load_job
from graphrl.schemas.plan import MemoryBytes, RolePlacement
from graphrl.schemas.program import (INSTRUCTION_TYPES, TRAITS, CostKey, Generate, Offload, Onload,
                                     ReleaseWeights, ReshardInPlace, Send, TrainStep)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_instruction_kind_has_traits_semantics_and_one_executor_handler():
    kinds = set(INSTRUCTION_TYPES.values())
    assert set(TRAITS) == kinds and set(SEMANTICS) == kinds and set(HANDLERS) == kinds
    assert all(callable(h) for h in HANDLERS.values())
    assert len(set(HANDLERS.values())) == len(HANDLERS), "two kinds share an executor handler"


def test_point_to_point_sides_pair_up_and_moves_cancel():
    sides = sorted(t.p2p for t in TRAITS.values() if t.p2p)
    assert sides == ["recv", "send"]
    assert sorted(t.moves for t in TRAITS.values() if t.moves) == [-1, 1]
    assert [k for k, t in TRAITS.items() if t.weights == "produces"] == [TrainStep]


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml", "aipo_async_tiny.yaml", "llama3_8b.yaml"])
def test_every_instruction_of_a_compiled_plan_has_a_predicted_duration(name):
    """The simulator times each non-transfer instruction from the plan's durations through its entry."""
    job = load_job(EXAMPLES / name)
    graph = compile_graph(job, job_cluster(job, None), steps=4)
    programs, placed = graph.programs, graph.placement
    costs = Costs(programs.durations, placed.hardware)
    seen = set()
    for rank in range(programs.num_ranks):
        for ins in programs.rank_stream(rank):
            seen.add(type(ins))
            if not TRAITS[type(ins)].p2p:
                assert SEMANTICS[type(ins)].duration(ins, costs) >= 0.0
    assert Generate in seen and TrainStep in seen


def _placement(role: str, kind: str = "train") -> RolePlacement:
    return RolePlacement(role=role, model="policy", kind=kind, ops=[], mesh="m",
                         memory_bytes=MemoryBytes(params=10, grads=10, optimizer=40, activations=5, kv_cache=2))


def test_the_ledger_follows_each_kinds_memory_effect():
    ledger = Ledger({"policy": _placement("policy"), "policy/generate": _placement("policy/generate", "generate")})
    ledger.keep("policy", STATE)
    assert ledger.held == 60

    def apply(ins):
        ledger.at = (0, 0, ins)
        return SEMANTICS[type(ins)].memory(ins, ledger)

    assert apply(TrainStep(0, "train", "policy", 0, 4, 1, "all")) == 7  # activations + KV cache, transient
    assert apply(Offload("policy", ("optimizer",), 40)) == 0 and ledger.held == 20
    with pytest.raises(VerifyError, match="optimizer are not on the device"):
        apply(TrainStep(1, "train", "policy", 0, 4, 2, "all"))
    apply(Onload("policy", ("optimizer",), 40))
    assert ledger.held == 60
    apply(ReshardInPlace("policy", 1, "policy", "policy/generate", "all"))
    assert ledger.held == 70  # the generator's gathered weights
    apply(ReleaseWeights("policy/generate"))
    assert ledger.held == 60
    assert apply(Send(0, "rollouts", 0, 4, 1, 100, 7)) == 0 and ledger.held == 60


def test_a_missing_duration_is_a_compiler_bug_not_a_key_error():
    with pytest.raises(VerifyError, match="no predicted duration for TrainStep:policy"):
        SEMANTICS[TrainStep].duration(TrainStep(0, "train", "policy", 0, 4, 1, "all"), Costs({}))
    assert SEMANTICS[TrainStep].duration(TrainStep(0, "train", "policy", 0, 4, 1, "all"),
                                         Costs({CostKey("TrainStep", "policy"): 2.5})) == 2.5


def test_every_instruction_field_is_described() -> None:
    """The plan format's reference covers every field of every instruction kind, and nothing stale."""
    from dataclasses import fields

    from graphrl.schemas.program import FIELD_DOCS, INSTRUCTION_TYPES

    used = {f.name for t in INSTRUCTION_TYPES.values() for f in fields(t)}
    assert used == set(FIELD_DOCS)
    assert all(FIELD_DOCS[name].strip() for name in used)


def test_every_instruction_kind_can_key_a_duration():
    """`CostKind` names every instruction kind (so adding one fails here until it does) and the two
    shared kinds, nothing else."""
    from graphrl.schemas.program import COST_KINDS

    assert COST_KINDS == set(INSTRUCTION_TYPES) | {"Forward", "Rule"}

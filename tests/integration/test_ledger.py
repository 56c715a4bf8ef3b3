"""Every rank holds what the plan charges it, for each kind of trainer layout, on 2 and 4 CPU ranks.

The plan used to divide zero1's optimizer state and zero2's gradients by the data-parallel size while the
executor ran both as DDP with replicated AdamW (grpo_tiny colocated on 2 ranks with zero1 held 1.6x its
plan), and charged every model as mixed precision. Each run here writes a ledger per rank (weights,
gradients and optimizer state measured after the last step, `RankExecutor.write_ledger`) beside the plan's
resting state for that rank; they must agree within 5%. Neither side counts activations, the KV cache,
the allocator's slack or the Python heap, nor the unsharded copies FSDP2 gathers only while it computes
(the plan reports those as `gathered`). Measured on this tree the ratios are 1.000 except ZeRO-1's, which
split the parameters by whole tensors (about 0.3% off on 2 ranks); a replicated optimizer state would
be off by 50% or more.

The sharded runs must also train exactly as DDP does (the sharding moves state, not the math): their
losses equal the `none` run's of the same rank count, to float32 summation order (see
test_every_layout_runs for why 1e-5 relative is a safe bound).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 2
LOSS_REL = 1e-5
TOLERANCE = 0.05

# kind -> (pins, the trainer wrapping the executor must use)
LAYOUTS: dict[str, tuple[tuple[str, ...], str]] = {
    "none": (("placement.roles.policy.sharding=none", "placement.roles.policy.tp=1"), "ddp"),
    "zero1": (("placement.roles.policy.sharding=zero1", "placement.roles.policy.tp=1"), "ddp"),
    "zero2": (("placement.roles.policy.sharding=zero2", "placement.roles.policy.tp=1"), "fsdp2"),
    "fsdp": (("placement.roles.policy.sharding=fsdp", "placement.roles.policy.tp=1"), "fsdp2"),
    "tp": (("placement.roles.policy.tp=2",), "tp"),
}
TP_FSDP_WRAPPING = "fsdp2+tp"  # tp 2 on 4 ranks: the fsdp axis of 2 shards the tp shards


def _run(out: Path, ranks: int, kind: str, *extra: str) -> tuple[list[dict], list[dict]]:
    sets, _ = LAYOUTS[kind]
    args = ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--cluster", f"local-cpu-{ranks}", "--strategy", "colocated",
            "--steps", str(STEPS), "--out", str(out), "-q"]
    for s in sets + extra:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    ledgers = [json.loads((out / "ledger" / f"rank{r}.json").read_text()) for r in range(ranks)]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ledgers, metrics


class Runs:
    """Each (ranks, kind) run once per module, when a test first asks for it (so no one test pays for all)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[int, str], tuple[list[dict], list[dict]]] = {}

    def __getitem__(self, key: tuple[int, str]) -> tuple[list[dict], list[dict]]:
        if key not in self.done:
            ranks, kind = key
            self.done[key] = _run(self.root / f"{kind}{ranks}", ranks, kind)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("ledger"))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_every_rank_holds_what_the_plan_charges(runs, ranks: int, kind: str) -> None:
    ledgers, _ = runs[(ranks, kind)]
    wrapping = TP_FSDP_WRAPPING if kind == "tp" and ranks == 4 else LAYOUTS[kind][1]
    for ledger in ledgers:
        assert ledger["wrappings"] == {"policy": wrapping}
        assert ledger["ratio"] == pytest.approx(1.0, abs=TOLERANCE), ledger


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", ["zero1", "zero2", "fsdp", "tp"])
def test_sharded_trainers_compute_the_same_losses_as_ddp(runs, ranks: int, kind: str) -> None:
    _, want = runs[(ranks, "none")]
    _, got = runs[(ranks, kind)]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=LOSS_REL, abs=1e-7)


def test_zero_stages_hold_less_than_ddp(runs) -> None:
    """What makes the ZeRO stages worth choosing, measured: each holds less than DDP on every rank, and
    more ranks hold less each. (Colocated, a DDP or ZeRO-1 trainer lends its replicated weights to the
    generator, while an FSDP2 one leaves it a copy of its own, so zero1 and zero2 are not ordered here.)"""
    for ranks in (2, 4):
        held = {kind: runs[(ranks, kind)][0][0]["measured_state_bytes"] for kind in ("none", "zero1", "zero2", "fsdp")}
        assert held["none"] > held["zero1"] and held["none"] > held["zero2"] == held["fsdp"]
    assert runs[(4, "zero1")][0][0]["measured_state_bytes"] < runs[(2, "zero1")][0][0]["measured_state_bytes"]


def test_a_bfloat16_model_trains_with_float32_master_weights(tmp_path: Path) -> None:
    """A bfloat16 policy is charged 2 + 2 + 12 bytes per parameter (bf16 weights and gradients, float32
    master weights and AdamW moments); the trainer used to keep AdamW's state in bf16 (2 + 2 + 4), half
    of what the plan charged, and rounded every update to bf16. Under DDP and under FSDP2 every rank
    now holds what the plan charges."""
    for kind, ranks in (("none", 2), ("fsdp", 2)):
        ledgers, metrics = _run(tmp_path / kind, ranks, kind, "models.policy.dtype=bfloat16")
        for ledger in ledgers:
            assert ledger["ratio"] == pytest.approx(1.0, abs=TOLERANCE), ledger
        assert len(metrics) == STEPS and all(abs(r["loss"]) < 10 for r in metrics)

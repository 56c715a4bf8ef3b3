"""LoRA jobs run every way a full job runs (`graphrl run`, gloo ranks on CPU): on one rank, on an FSDP2 trainer
whose generator samples from it, on a tensor-parallel trainer, with the adapters synced by DDMA into a generator on another rank, and into a
tp=2 generator's shards (each sync checked by the generator's log-probs of a probe sequence); the reference is
the policy's base with its adapters off; checkpoints hold the adapters and resume exactly.

Equal losses: as in test_every_layout_runs, a layout changes only the order of float32 sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from run_processes import cli_run
from graphrl.schemas.sharding import is_adapter

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_lora_tiny.yaml"
STEPS = 3
LOSS_REL = 1e-5
SMALL = ("nodes.prompts.batch_size=4", "nodes.rollout.samples_per_prompt=4")


def run(out: Path, *sets: str, steps: int = STEPS, resume: bool = False) -> tuple[str, list[dict]]:
    return cli_run(EXAMPLE, out, (*SMALL, *sets), steps=steps, resume=resume)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The example on one rank: what every other layout must give."""
    return run(tmp_path_factory.mktemp("single"), "cluster=local-cpu-1")[1]


def _same_run(got: list[dict], want: list[dict]) -> None:
    assert [r["reward_mean"] for r in got] == [r["reward_mean"] for r in want]
    # GRPO's loss (advantages of mean 0) and the KL (a difference of log-probs) are small here: their rounding
    # is absolute
    for key in ("loss", "kl"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=LOSS_REL, abs=1e-7), key


def test_the_reference_is_the_base_and_checkpoints_hold_the_adapters(tmp_path: Path, single: list[dict]) -> None:
    assert single[0]["kl"] == 0.0 and single[-1]["kl"] > 0  # new adapters are the base; trained ones are not
    label, fsdp = run(tmp_path / "fsdp", "placement.roles.policy.sharding=fsdp")
    assert "fsdp" in label
    _same_run(fsdp, single)
    step = tmp_path / "fsdp" / "checkpoints" / f"step_{STEPS - 1:06d}"
    meta = json.loads((step / "meta.json").read_text())["roles"]["policy"]
    assert meta["lora"]["rank"] == 8 and meta["base"] is None
    saved = load_file(str(step / "policy.safetensors"))
    assert saved and all(is_adapter(k) for k in saved)  # the frozen base is never saved
    assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)
    config = json.loads((step / "policy_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16


def test_adapters_synced_by_ddma_into_another_rank_and_into_tp_shards(tmp_path: Path, single: list[dict]) -> None:
    label, split = run(tmp_path / "split", "placement.strategy=disaggregated",
                       "placement.roles.policy/generate.devices=0-0", "placement.roles.policy.devices=1-1")
    assert "disaggregated" in label
    _same_run(split, single)
    assert max(r["mismatch_abs_max"] for r in split) < 1e-5  # the generator samples the trainer's adapters
    label, sharded = run(tmp_path / "tp", "placement.strategy=colocated", "placement.roles.policy/generate.tp=2")
    assert "tp2" in label
    _same_run(sharded, single)


def test_a_tensor_parallel_trainer_trains_its_adapters_as_one_rank_does(tmp_path: Path, single: list[dict]) -> None:
    # adapters as DTensors cut as the inventory says: A whole and B's rows under q/k/v/gate/up, A's columns and B
    # whole under o/down; their gradients reduced over tp where they are partial
    label, sharded = run(tmp_path / "tp_trainer", "placement.roles.policy.tp=2")
    assert "train[tp2" in label
    _same_run(sharded, single)


@pytest.mark.parametrize("layout", [("cluster=local-cpu-1",), ("placement.roles.policy.sharding=fsdp",)])
def test_a_resumed_lora_run_is_the_uninterrupted_one(tmp_path: Path, single: list[dict], layout: tuple[str, ...]) -> None:
    out = tmp_path / "resumed"
    run(out, *layout, "schedule.checkpoint_every=1", steps=2)
    _, resumed = run(out, *layout, resume=True)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    _same_run(resumed, single)


def test_merged_syncs_fill_plain_generators_as_the_adapters_do(tmp_path: Path, single: list[dict]) -> None:
    # `lora.sync: merged`: the trainer folds its adapters into what it sends, a staging group at a time
    for name, sets in (("split", ("placement.strategy=disaggregated", "placement.roles.policy/generate.devices=0-0",
                                  "placement.roles.policy.devices=1-1")),
                       ("tp", ("placement.strategy=colocated", "placement.roles.policy/generate.tp=2"))):
        _, merged = run(tmp_path / name, "models.policy.lora.sync=merged", *sets)
        _same_run(merged, single)
    # into an fp8 generator (which cannot hold adapters): it samples the merged weights, quantized
    label, quantized = run(tmp_path / "fp8", "models.policy.lora.sync=merged",
                           "placement.roles.policy/generate.precision=fp8")
    assert "fp8" in label
    assert max(r["mismatch_abs_max"] for r in quantized) < 0.1

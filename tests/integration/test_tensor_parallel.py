"""Tensor-parallel generation on real ranks (gloo, 4 processes, one spawn for every case).

What each case checks, against a full model built on every rank from the same seed:
- tp=2 (one group tied, one untied) and tp=4 (KV heads replicated on 2 ranks each) sample the same
  tokens as tp=1 and their log-probabilities agree within LOGPROB_ATOL; every rank of a group returns
  the same bits (the samples are drawn, not broadcast, so a rank that diverged would show here);
- an fp8 tensor-parallel generator synced in staging groups of one layer holds, bit for bit, what the
  sync in one group gives it, and stages one layer's linears at a time;
- after a DDMA weight sync planned by the compiler (`weight_sync.ddma_record`, stored as a plan stores it), from
  a full trainer and from an FSDP2-sharded one (DTensor shards), every generator shard equals the
  trainer's full tensor's region bit for bit, replicated KV heads included, and generation with the
  synced shards samples what tp=1 samples with the trainer's weights; the same from an fsdp x tp
  trainer (2-D DTensors, `parallelize_module` then `fully_shard`).

Tolerance: tp changes only the order of float32 sums (each row-parallel layer adds t partial
products instead of one; the vocabulary all-gather and the masked embedding are exact). The
reordering moves a logit by a few float32 ulps per layer (~1e-7 relative for these magnitudes);
through two layers and a log-softmax over 30 tokens the measured difference stays below 1e-6.
LOGPROB_ATOL = 1e-5 leaves that margin while a wrong shard or a missing all-reduce moves
log-probabilities by 1e-2 and more.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from graphrl.compiler import weight_sync
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.sampling import generate
from graphrl.executors.local_world import run_on_ranks
from graphrl.executors.parallel import trainer_mesh_groups, wrap_tensor_parallel_trainer, wrap_trainer
from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama
from graphrl.executors.weightsync import run_weight_sync
from graphrl.schemas.hardware import HARDWARE_PRESETS
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.schemas.model import ModelDims

WORLD = 4
# Vocabulary 30 and 90 SwiGLU features split unevenly over 4 ranks (8, 8, 8, 6 and 23, 23, 23, 21).
DIMS = ModelDims(vocab_size=30, hidden_size=64, intermediate_size=90, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_seq_len=64, rope_theta=10000.0)
TIED = DIMS.model_copy(update={"tie_embeddings": True})
INIT_SEED, TRAINED_SEED, SAMPLE_SEED = 11, 22, 33
LOGPROB_ATOL = 1e-5
TIMEOUT_S = 300  # per collective: only a hang fails by it, not a peer slowed by a busy machine


def seeded_model(dims: ModelDims, seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(dims)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 30, (6, 7), generator=gen)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[:3, :2] = False  # left padding on some rows
    return ids, mask


def sample(model: Llama) -> Any:
    ids, mask = prompts()
    return generate(model, ids, mask, 8, temperature=0.9, top_p=0.95,
                    generator=torch.Generator().manual_seed(SAMPLE_SEED), eos_id=0)


def compare_with_tp1(tp_model: TensorParallelLlama, full: Llama, tp: TensorParallelGroup) -> dict[str, float]:
    """tp generation against tp=1 on this rank, and against the other ranks of the group."""
    got, want = sample(tp_model), sample(full)
    if not torch.equal(got.response_ids, want.response_ids):
        raise AssertionError(f"tokens differ from tp=1:\n{got.response_ids}\n{want.response_ids}")
    if not torch.equal(got.response_mask, want.response_mask):
        raise AssertionError("response masks differ from tp=1")
    diff = float((got.logprobs - want.logprobs).abs().max())
    if diff > LOGPROB_ATOL:
        raise AssertionError(f"log-probabilities differ from tp=1 by {diff:.3g} > {LOGPROB_ATOL}")
    mine = torch.cat([got.response_ids.double().flatten(), got.logprobs.double().flatten()])
    everyone = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(everyone, mine, group=tp.group)
    if not all(torch.equal(x, mine) for x in everyone):
        raise AssertionError("ranks of one tensor-parallel group returned different samples")
    return {"max_logprob_diff": diff}


def check_shards(model: TensorParallelLlama, full: dict[str, torch.Tensor]) -> int:
    """Every shard (the plan's region) and every replicated KV head against the full tensors, bit for bit."""
    bad = []
    for name, (tensor, region) in model.shards().items():
        if not torch.equal(tensor, full[name][tuple(slice(a, b) for a, b in region)]):
            bad.append(f"{name}{list(region)}")
    for name, p in model.named_parameters():
        if model._replicated(name):
            a, b = model._kv_head_rows(full[name].shape[0])
            if not torch.equal(p, full[name][a:b]):
                bad.append(f"{name} (replicated head rows {a}:{b})")
    if bad:
        raise AssertionError(f"{len(bad)} shards differ from the trainer's weights: {bad[:6]}")
    return len(model.shards())


def stored_plan(src: Mesh, dst: Mesh, dims: ModelDims) -> WeightSyncRecord:
    data, _ = weight_sync.ddma_record(dims, "policy", HARDWARE_PRESETS["h100-sxm-80gb"], 8, src, dst, "bf16")
    return WeightSyncRecord.model_validate_json(data.model_dump_json())


def trainer(first: int, fsdp: int = 1) -> Mesh:
    return Mesh.contiguous([("fsdp", fsdp)], first)


def generator(first: int, tp: int) -> Mesh:
    return Mesh.contiguous([("dp", 1), ("tp", tp)], first)


# --- the cases, as each rank runs them ------------------------------------------------------------


def case_tp2_generation(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    dims = TIED if rank < 2 else DIMS
    tp = TensorParallelGroup(rank % 2, 2, groups["01"] if rank < 2 else groups["23"])
    full = seeded_model(dims, INIT_SEED)
    return compare_with_tp1(TensorParallelLlama.from_full(full, tp), full, tp)


def case_tp4_generation_replicated_kv(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    tp = TensorParallelGroup(rank, 4, groups["0123"])
    full = seeded_model(DIMS, INIT_SEED)
    model = TensorParallelLlama.from_full(full, tp)
    assert model.kv_replicas == 2
    return compare_with_tp1(model, full, tp)


def _sync_and_check(rank: int, data: WeightSyncRecord, src: torch.nn.Module | None, tp: TensorParallelGroup | None,
                    dims: ModelDims) -> dict[str, float]:
    dst = TensorParallelLlama(dims, tp, device="cpu", dtype=torch.float32) if tp is not None else None
    cpu = torch.device("cpu")
    run_weight_sync(data, rank, src, dst, SimpleNamespace(comm_device=cpu, device=cpu))
    if dst is None:
        return {}
    reference = seeded_model(dims, TRAINED_SEED)
    checked = check_shards(dst, dict(reference.named_parameters()))
    return {"shards_checked": checked, **compare_with_tp1(dst, reference, tp)}


def case_sync_full_to_tp2(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    data = stored_plan(trainer(0), generator(2, 2), DIMS)
    src = seeded_model(DIMS, TRAINED_SEED) if rank == 0 else None
    tp = TensorParallelGroup(rank - 2, 2, groups["23"]) if rank >= 2 else None
    return _sync_and_check(rank, data, src, tp, DIMS)


def case_sync_fsdp2_to_tp4_shared(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    """FSDP2 trainer on ranks 0-1 (DTensor shards), tp=4 generator on 0-3 (replicated KV heads)."""
    data = stored_plan(trainer(0, fsdp=2), generator(0, 4), TIED)
    src = None
    if rank < 2:
        src = seeded_model(TIED, TRAINED_SEED)
        wrap_trainer(src, "fsdp", groups["01"], torch.device("cpu"))
        assert all(hasattr(p, "to_local") for p in src.parameters())
    return _sync_and_check(rank, data, src, TensorParallelGroup(rank, 4, groups["0123"]), TIED)


def case_sync_fsdp2_to_tp2_shared(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    """FSDP2 trainer and tp=2 generator on ranks 0-1: `wrap_trainer` cuts o/down into the column blocks
    the generator's ranks hold (`fsdp_shard_dim`), so only the norms cross and the matrices copy in place."""
    if rank >= 2:
        return {}
    data = stored_plan(trainer(0, fsdp=2), generator(0, 2), DIMS)
    src = seeded_model(DIMS, TRAINED_SEED)
    wrap_trainer(src, "fsdp", groups["01"], torch.device("cpu"))
    layer = src.model.layers[0]
    assert layer.self_attn.o_proj.weight.placements == (Shard(1),), layer.self_attn.o_proj.weight.placements
    assert layer.mlp.down_proj.weight.placements == (Shard(1),) and layer.mlp.up_proj.weight.placements == (Shard(0),)
    crossing = {s.param for b in data.buckets() for s in b.slices}
    assert crossing and all(name.endswith("norm.weight") for name in crossing), crossing
    return _sync_and_check(rank, data, src, TensorParallelGroup(rank, 2, groups["01"]), DIMS)


def case_sync_fsdp2xtp2_to_tp2(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    """fsdp2 x tp2 trainer on ranks 0-3 (2-D DTensors: tp shards, each cut again over fsdp, unevenly
    for the 45 SwiGLU rows and 15 vocabulary rows of a tp shard), tp=2 generator on ranks 2-3."""
    trainer_ranks = (0, 1, 2, 3)
    data = stored_plan(Mesh.contiguous([("dp", 1), ("fsdp", 2), ("tp", 2), ("pp", 1)], 0), generator(2, 2), DIMS)
    src = seeded_model(DIMS, TRAINED_SEED)
    grid = trainer_mesh_groups(trainer_ranks, 2, rank, TIMEOUT_S)
    wrap_tensor_parallel_trainer(src, "fsdp", trainer_ranks, 2, grid, torch.device("cpu"))
    assert all(p.to_local().shape != p.shape for p in src.parameters() if p.dim() == 2)
    tp = TensorParallelGroup(rank - 2, 2, groups["23"]) if rank >= 2 else None
    return _sync_and_check(rank, data, src, tp, DIMS)


def case_sync_fsdp2_to_fp8_tp4_in_staging_groups(rank: int, groups: dict[str, Any]) -> dict[str, float]:
    """FSDP2 trainer on ranks 0-1, fp8 tp=4 generator on 0-3 (replicated KV heads completed per group), the
    sync planned in staging groups of one layer: every fp8 weight and scale equals what the sync in one
    group gives, bit for bit, and no rank ever stages more than one layer's linears at a time."""
    from graphrl.compiler import ddma
    from graphrl.executors import fp8
    from graphrl.schemas import sharding

    src_mesh, dst_mesh = trainer(0, fsdp=2), generator(0, 4)
    whole = ddma.sync_record(ddma.plan_llama_sync(DIMS, src_mesh, dst_mesh, "bf16"), "policy", src_mesh, dst_mesh, 0.0)
    bound = sharding.STAGING_GROUP_BYTES
    sharding.STAGING_GROUP_BYTES = 1  # one layer a group (the tiny model's layers all fit one by default)
    try:
        layers = ddma.sync_staging_layers(DIMS, dst_mesh, "fp8")
        staged_plan = ddma.plan_llama_sync(DIMS, src_mesh, dst_mesh, "fp8")
    finally:
        sharding.STAGING_GROUP_BYTES = bound
    grouped = ddma.sync_record(staged_plan, "policy", src_mesh, dst_mesh, 0.0)
    grouped = WeightSyncRecord.model_validate_json(grouped.model_dump_json())  # as a plan file stores it
    assert layers == grouped.staging_layers == 1 and len(grouped.group_rounds) == DIMS.num_layers, grouped.group_rounds
    src = None
    if rank < 2:
        src = seeded_model(DIMS, TRAINED_SEED)
        wrap_trainer(src, "fsdp", groups["01"], torch.device("cpu"))
    tp = TensorParallelGroup(rank, 4, groups["0123"])
    cpu = torch.device("cpu")
    staged_bytes: list[int] = []
    real_staging = fp8.staging_tensors

    def counting(model: Any, among: Any = None) -> dict[str, torch.Tensor]:
        tensors = real_staging(model, among)
        staged_bytes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return tensors

    synced = []
    for data in (whole, grouped):
        dst = fp8.quantize_generator(TensorParallelLlama(DIMS, tp, device="cpu", dtype=torch.float32))
        fp8.staging_tensors = counting
        try:
            run_weight_sync(data, rank, src, dst, SimpleNamespace(comm_device=cpu, device=cpu))
        finally:
            fp8.staging_tensors = real_staging
        synced.append(dst)
    one_group, in_groups = (dict(m.named_buffers()) | dict(m.named_parameters()) for m in synced)
    assert one_group.keys() == in_groups.keys()
    for name, tensor in one_group.items():
        a, b = tensor, in_groups[name]
        if a.dtype == fp8.FP8_DTYPE:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name
    whole_bytes, *group_bytes = staged_bytes
    assert len(group_bytes) == DIMS.num_layers and max(group_bytes) * DIMS.num_layers == whole_bytes, staged_bytes
    # fp8 scales are per row of each shard, so tp=4 fp8 does not sample as tp=1 fp8; the two syncs' models must
    # sample alike (the test's generation check compares them, in place of tp=1)
    got, want = sample(synced[1]), sample(synced[0])
    assert torch.equal(got.response_ids, want.response_ids)
    return {"max_logprob_diff": float((got.logprobs - want.logprobs).abs().max()), "shards_checked": len(in_groups)}


CASES = {f.__name__.removeprefix("case_"): f for f in (case_tp2_generation, case_tp4_generation_replicated_kv,
                                                        case_sync_full_to_tp2, case_sync_fsdp2_to_tp4_shared,
                                                        case_sync_fsdp2_to_tp2_shared,
                                                        case_sync_fsdp2xtp2_to_tp2,
                                                        case_sync_fsdp2_to_fp8_tp4_in_staging_groups)}


def run_cases(rank: int, world: int) -> dict[str, tuple[str | None, dict]]:
    """One rank: every case in order, with the 2-rank and 4-rank groups they use; per case, its error text
    (or None) and what it measured."""
    groups = {"01": dist.new_group([0, 1]), "23": dist.new_group([2, 3]), "0123": dist.group.WORLD}
    reports: dict[str, tuple[str | None, dict]] = {}
    for name, case in CASES.items():
        try:
            reports[name] = (None, case(rank, groups))
        except BaseException:
            reports[name] = (traceback.format_exc(), {})
        dist.barrier()  # the next case starts together, whatever happened in this one
    return reports


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[int, tuple[str | None, dict]]]:
    by_rank = run_on_ranks(WORLD, run_cases, collective_timeout_s=TIMEOUT_S)
    return {name: {r: got[name] for r, got in enumerate(by_rank)} for name in CASES}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_case(name: str, reports) -> None:
    mine = reports.get(name, {})
    problems = [f"rank {r}: {err}" for r, (err, _) in sorted(mine.items()) if err]
    problems += [f"rank {r}: never reported" for r in range(WORLD) if r not in mine]
    assert not problems, "\n".join(problems)
    diffs = [info["max_logprob_diff"] for _, info in mine.values() if "max_logprob_diff" in info]
    assert diffs, "no rank compared generation with tp=1"
    print(f"{name}: max |logprob(tp) - logprob(tp=1)| = {max(diffs):.3g}")
    if name.startswith("sync"):
        assert sum(info.get("shards_checked", 0) for _, info in mine.values()) > 0


# --- `graphrl run` with a tensor-parallel generator -----------------------------------------------


def test_run_with_tp2_generator_matches_the_tp1_run(tmp_path) -> None:
    """The async AIPO example with its generator pinned to tp=2 on ranks 2-3 (the trainer on rank 0,
    rank 1 idle): every weight version reaches the generator through DDMA into its shards, and the run
    must sample exactly what the tp=1 example samples (same rewards) and train to the same losses.
    Losses differ only through the behaviour log-probabilities in the AIPO ratio (tp moves them by
    < LOGPROB_ATOL, see the module docstring), hence rel=1e-5."""
    from click.testing import CliRunner

    from graphrl.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "aipo_async_tiny.yaml"
    text = example.read_text()
    for old, new in {"cluster: local-cpu-2": "cluster: local-cpu-4", 'policy: {devices: "1"}': 'policy: {devices: "0"}',
                     'policy/generate: {devices: "0"}': 'policy/generate: {devices: "2-3", tp: 2}'}.items():
        assert old in text, old
        text = text.replace(old, new)
    job = tmp_path / "aipo_tp2.yaml"
    job.write_text(text)
    runner = CliRunner()
    labels = []
    for path, name in ((job, "tp2"), (example, "tp1")):
        out = runner.invoke(main, ["run", str(path), "--steps", "3", "--out", str(tmp_path / name), "-q"])
        assert out.exit_code == 0, out.output
        labels.append(out.output.splitlines()[0])
    assert "gen[tp2x" in labels[0] and "gen[tp1x" in labels[1], labels
    tp2, tp1 = ([json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
                for n in ("tp2", "tp1"))
    assert [r["weight_version"] for r in tp2] == [0, 0, 1]  # a trained version was synced and used
    assert [r["reward_mean"] for r in tp2] == [r["reward_mean"] for r in tp1]
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in tp1], rel=1e-5)

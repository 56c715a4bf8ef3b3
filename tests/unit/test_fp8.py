"""fp8 generation weights (executors/fp8.py): quantization, both matmul paths, the bytes a quantized
generator holds against the cost model's charge, and log-prob agreement with the unquantized model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrl.compiler import cost
from graphrl.executors import fp8
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.sampling import generate, token_logprobs
from graphrl.executors.weightsync import module_shards
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

DIMS = MODEL_PRESETS["tiny-digits-wide"]
UNTIED = ModelDims(vocab_size=48, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def peaked_model(dims: ModelDims, seed: int = 0, std: float = 0.15) -> Llama:
    """A random Llama whose next-token distributions are far from uniform (GPT init at 0.02 gives almost
    flat ones, where any quantization looks harmless), as a trained policy's are."""
    torch.manual_seed(seed)
    model = Llama(dims)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model.eval()


def prompts(dims: ModelDims, batch: int = 16, length: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dims.vocab_size, (batch, length), generator=g)
    return ids, torch.ones_like(ids, dtype=torch.bool)


def test_rows_round_trip_within_e4m3_precision() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different size
    w[3] = 0.0  # an all-zero row stays exactly zero (no 0/0)
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (40,) and scale.dtype == torch.float32
    back = q.float() * scale[:, None]
    assert torch.equal(back[3], torch.zeros(72))
    # 3 mantissa bits: relative error <= 2^-4 for normal values, plus the subnormal step near zero.
    assert bool(((back - w).abs() <= 2**-4 * w.abs() + scale[:, None] * 2**-9).all())
    # each row's largest magnitude maps to the largest finite e4m3 value: no row saturates or wastes range
    assert torch.allclose(q.float().abs().amax(1)[torch.arange(40) != 3], torch.full((39,), fp8.FP8_MAX))


def test_expand_fp8_is_exact_for_every_finite_value() -> None:
    """The CPU path expands e4m3 bits into float16 places; every one of the 254 finite codes (zeros,
    subnormals, normals up to +-448) must come back as the same value times 2^-8."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float()
    finite = torch.isfinite(values)
    assert int(finite.sum()) == 254
    expanded = fp8.expand_fp8(codes).float() * 256
    assert torch.equal(expanded[finite], values[finite])


def test_fp8_linear_dequantize_matches_its_weights() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    layer = fp8.Fp8Linear.from_linear(linear, matmul="dequantize")
    x = torch.randn(3, 5, 64)
    assert torch.allclose(layer(x), F.linear(x, layer.dequantized()), atol=1e-5)
    rel = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert rel < 0.05, rel


def test_scaled_mm_path_agrees_with_dequantize() -> None:
    """The `torch._scaled_mm` path (fp8 activations too) run here on CPU: the same product as the
    dequantized weight up to the activations' own e4m3 rounding."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    fast = fp8.Fp8Linear.from_linear(linear, matmul="scaled_mm")
    slow = fp8.Fp8Linear.from_linear(linear, matmul="dequantize")
    assert fast.uses_scaled_mm(torch.zeros(1, 64, dtype=torch.bfloat16))
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    a, b = fast(x).float(), slow(x).float()
    assert a.shape == (2, 7, 48) and fast(x).dtype == torch.bfloat16
    assert (a - b).norm() / b.norm() < 0.08


def test_auto_picks_dequantize_off_fp8_tensor_cores() -> None:
    layer = fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16))
    assert not layer.uses_scaled_mm(torch.zeros(1, 64, dtype=torch.bfloat16))  # a CPU weight


@pytest.mark.parametrize("dims", [DIMS, UNTIED], ids=["tied", "untied"])
def test_quantized_generator_holds_what_the_cost_model_charges(dims: ModelDims) -> None:
    """Block linears fp8 (1 byte) with float32 row scales; embedding, head and norms stay at the model's
    float32: the bytes held are exactly `cost.weight_bytes(dims, 1, 4)`, the charge of a placement."""
    model = fp8.quantize_generator(peaked_model(dims))
    names = {name for name, _ in fp8.fp8_linears(model)}
    assert len(names) == 7 * dims.num_layers
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float8_e4m3fn if name in names else torch.float32), name
        assert not p.requires_grad
    fp8_bytes, rest = fp8.held_bytes(model)
    assert fp8_bytes + rest == cost.weight_bytes(dims, 1, 4)
    assert fp8_bytes == dims.num_layers * (cost.layer_linear_params(dims) + 4 * cost.block_linear_rows(dims))


def test_copy_quantized_and_staging_give_the_same_weights() -> None:
    """The colocated path (quantize from the trainer's module) and the weight-sync path (write into the
    staging, then quantize) leave identical fp8 weights and scales."""
    src = peaked_model(UNTIED, seed=3)
    by_copy = fp8.quantize_generator(peaked_model(UNTIED, seed=4))
    fp8.copy_quantized(by_copy, src)
    by_sync = fp8.quantize_generator(peaked_model(UNTIED, seed=5))
    staged = fp8.staging_tensors(by_sync)
    shards = module_shards(by_sync, staged)
    with torch.no_grad():
        for name, p in src.named_parameters():
            shards[name][0].copy_(p)  # what a sync writes: whole tensors, source dtype
    fp8.load_staged(by_sync, staged)
    for (name, a), b in zip(by_copy.state_dict().items(), by_sync.state_dict().values()):
        assert torch.equal(a.float(), b.float()), name
    assert torch.equal(by_copy.model.embed_tokens.weight, src.model.embed_tokens.weight)


def logprob_differences(dims: ModelDims, dtype: torch.dtype, seed: int = 0, std: float = 0.05) -> torch.Tensor:
    """|log pi_x - log pi| over the real tokens the float32 model samples, where pi_x is the same model
    quantized to fp8 (`dtype` float8_e4m3fn) or cast to `dtype`."""
    full = peaked_model(dims, seed, std)
    other = peaked_model(dims, seed, std)
    other = fp8.quantize_generator(other) if dtype == torch.float8_e4m3fn else other.to(dtype)
    ids, mask = prompts(dims)
    out = generate(full, ids, mask, 12, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = token_logprobs(full, ids, mask, out.response_ids, out.response_mask)
        lp = token_logprobs(other, ids, mask, out.response_ids, out.response_mask)
    return (lp.float() - ref).abs()[out.response_mask]


@pytest.mark.parametrize("dims", [DIMS, UNTIED], ids=["tiny-digits-wide", "untied"])
def test_fp8_logprobs_agree_with_the_unquantized_generator(dims: ModelDims) -> None:
    """Teacher-forced log-probs of the tokens the float32 model sampled, on weights of std 0.05 (next-token
    entropy below the uniform one): fp8 within 0.05 nats on average and 0.3 at worst (measured 0.033 /
    0.11 and 0.015 / 0.05), and no worse than 16x bf16's own rounding, the ratio of the two formats'
    relative precision (2^-4 against 2^-8; measured about 7x)."""
    diff_fp8 = logprob_differences(dims, torch.float8_e4m3fn)
    diff_bf16 = logprob_differences(dims, torch.bfloat16)
    assert 0 < float(diff_fp8.mean()) < 0.05, float(diff_fp8.mean())
    assert float(diff_fp8.max()) < 0.3, float(diff_fp8.max())
    assert float(diff_fp8.mean()) < 16 * float(diff_bf16.mean())


def test_auto_takes_scaled_mm_on_fp8_tensor_cores_and_falls_back_with_a_warning(monkeypatch) -> None:
    """On a device with fp8 tensor cores (faked here; the kernel itself runs on CPU) bf16 layers go
    through `torch._scaled_mm`; float32 ones and dims off the kernel's multiple of 16 do not. A device
    that refuses the kernel gets the dequantized product and a warning, not an error."""
    monkeypatch.setattr(fp8, "_scaled_mm_capable", lambda device: True)
    torch.manual_seed(0)
    bf16 = fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert bf16.uses_scaled_mm(x)
    assert not bf16.uses_scaled_mm(x.float())
    assert not fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 40, bias=False).to(torch.bfloat16)).uses_scaled_mm(x)
    forced = fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), matmul="scaled_mm")
    forced.load_state_dict(bf16.state_dict())
    assert torch.equal(bf16(x), forced(x))

    def refuse(*args, **kwargs):
        raise RuntimeError("row-wise scaling is not supported on this device")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.warns(UserWarning, match="dequantizes its weight at use"):
        out = bf16(x)
    assert bf16.matmul == "dequantize"
    slow = fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), matmul="dequantize")
    slow.load_state_dict(bf16.state_dict())
    assert torch.equal(out, slow(x))
    with pytest.raises(RuntimeError):
        forced(x)  # an explicit choice is not overridden


def test_a_staged_sync_on_one_rank_quantizes_every_group_and_refuses_one_that_misses_a_group(monkeypatch) -> None:
    """Trainer and fp8 generator on one rank, the sync planned in staging groups (all of it local copies):
    group by group, every fp8 weight ends as the trainer's weight quantized. A record whose groups stop short
    of the model's last layers is refused, naming the weights it would have left stale."""
    from types import SimpleNamespace

    from graphrl.compiler import ddma
    from graphrl.errors import RunError
    from graphrl.executors.weightsync import run_weight_sync
    from graphrl.schemas import sharding
    from graphrl.schemas.mesh import Mesh

    dims = UNTIED.model_copy(update={"num_layers": 6})
    mesh = Mesh.contiguous([("dp", 1), ("tp", 1)], 0)
    monkeypatch.setattr(sharding, "STAGING_GROUP_BYTES", 1)  # a group per two layers (at most 4 groups)
    record = ddma.sync_record(ddma.plan_llama_sync(dims, mesh, mesh, "fp8"), "policy", mesh, mesh, 0.0)
    assert record.staging_layers == 2 and len(record.group_rounds) == 3 and not any(record.group_rounds)
    torch.manual_seed(0)
    src = Llama(dims)
    cpu = torch.device("cpu")
    rt = SimpleNamespace(comm_device=cpu, device=cpu)
    dst = fp8.quantize_generator(Llama(dims))
    run_weight_sync(record, 0, src, dst, rt)
    expected = fp8.quantize_generator(Llama(dims))
    fp8.copy_quantized(expected, src)
    for (name, got), want in zip(dst.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(got.view(torch.uint8) if got.dtype == fp8.FP8_DTYPE else got,
                           want.view(torch.uint8) if want.dtype == fp8.FP8_DTYPE else want), name
    short = record.model_copy(update={"group_rounds": record.group_rounds[:2]})
    with pytest.raises(RunError, match="left 14 fp8 weights without new values .model.layers.4"):
        run_weight_sync(short, 0, src, fp8.quantize_generator(Llama(dims)), rt)

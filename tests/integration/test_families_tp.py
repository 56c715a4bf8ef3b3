"""The Qwen families under tensor parallelism on real ranks (gloo, 2 processes): a tp=2 generator gives the
logits of the full model (for a mixture of experts, each rank holding half the experts: ep = tp = 2, a
shared expert cut in two); a tp=2 trainer (`parallelize_llama`) of a dense family gives its
log-probabilities, and after one backward every gradient, a Qwen2's sharded q/k/v biases and a Qwen3's
replicated per-head q/k norms included, equals the full model's (the norms' partial gradients, one per
rank's heads, summed over tp).

Tolerance: tp reorders float32 sums only (see test_tensor_parallel.py), a few ulps per layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphrl.executors.local_world import run_on_ranks
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

DENSE = {"qwen2": MODEL_PRESETS["tiny-digits-qwen2"], "qwen3": MODEL_PRESETS["tiny-digits-qwen3"]}
MOE = {"qwen3_moe": MODEL_PRESETS["tiny-digits-moe"],
       "qwen2_moe": ModelDims(**{**MODEL_PRESETS["tiny-digits-qwen2"].model_dump(), "family": "qwen2_moe",
                                 "num_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 24,
                                 "shared_expert_intermediate_size": 40})}
REL_TOL = 1e-5


def _model(dims: ModelDims):  # noqa: ANN202
    from graphrl.executors.models.llama import Llama

    torch.manual_seed(7)
    model = Llama(dims)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, param in model.named_parameters():  # biases and norms drawn too, so each one shows
            noise = torch.randn(param.shape, generator=gen) * 0.3
            param.copy_(noise * 10 if name.endswith("mlp.gate.weight") else noise if param.dim() >= 2 else 1.0 + noise)
    return model


def _batch() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(9)
    prompt_ids, response_ids = torch.randint(1, 16, (3, 5), generator=gen), torch.randint(1, 16, (3, 6), generator=gen)
    prompt_mask, response_mask = torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 6, dtype=torch.bool)
    prompt_mask[0, :2] = False
    response_mask[1, 4:] = False
    return prompt_ids, prompt_mask, response_ids, response_mask


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _generator_rel(dims: ModelDims, rank: int, world: int) -> float:
    from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama

    full = _model(dims)
    ids = torch.randint(1, 16, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        tp_gen = TensorParallelLlama.from_full(full, TensorParallelGroup(rank, world, dist.group.WORLD))
        return _relative(tp_gen(ids), full(ids))


def _trainer_rels(dims: ModelDims) -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from graphrl.executors.models.sampling import token_logprobs_and_entropy
    from graphrl.executors.parallel import parallelize_llama

    full, batch = _model(dims), _batch()
    logprobs, _ = token_logprobs_and_entropy(full, *batch)
    logprobs.sum().backward()
    trained = _model(dims)
    adapter = parallelize_llama(trained, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    got, _ = adapter(*batch)
    got.sum().backward()
    rels = {"logprobs": _relative(got, logprobs.detach())}
    for (name, p), want in zip(trained.named_parameters(), full.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rels[f"grad {name}"] = _relative(grad, want.grad)
    return rels


def _on_rank(rank: int, world: int) -> dict[str, dict[str, float]]:
    out = {}
    for family, dims in {**DENSE, **MOE}.items():
        out[family] = {"generator": _generator_rel(dims, rank, world)}
        if family in DENSE:
            out[family] |= _trainer_rels(dims)
    return out


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports() -> list[dict[str, dict[str, float]]]:
    return run_on_ranks(2, _on_rank, collective_timeout_s=120)


@pytest.mark.parametrize("family", [*DENSE, *MOE])
def test_tp2_matches_the_full_model(family: str, reports) -> None:
    for rank, report in enumerate(reports):
        mine = report[family]
        if family in DENSE:
            assert any(key.endswith(("q_norm.weight", "q_proj.bias")) for key in mine)  # the family's own tensors
        worst = {key: value for key, value in mine.items() if value > REL_TOL}
        assert not worst, f"rank {rank}: {worst}"

"""The Qwen families under tensor parallelism on real ranks (gloo, 2 processes): a tp=2 generator gives the
logits of the full model; a tp=2 trainer (`parallelize_llama`) gives its log-probabilities, and after one
backward every gradient, a Qwen2's sharded q/k/v biases and a Qwen3's replicated per-head q/k norms
included, equals the full model's (the norms' partial gradients, one per rank's heads, summed over tp).

Tolerance: tp reorders float32 sums only (see test_tensor_parallel.py), a few ulps per layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphrl.executors.local_world import run_on_ranks
from graphrl.schemas.model import MODEL_PRESETS

FAMILIES = ("tiny-digits-qwen2", "tiny-digits-qwen3")
REL_TOL = 1e-5


def _model(name: str):  # noqa: ANN202
    from graphrl.executors.models.llama import Llama

    torch.manual_seed(7)
    model = Llama(MODEL_PRESETS[name])
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in model.parameters():  # biases and norms drawn too, so each one shows in the result
            noise = torch.randn(param.shape, generator=gen) * 0.3
            param.copy_(noise if param.dim() == 2 else 1.0 + noise)
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


def _on_rank(rank: int, world: int) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from graphrl.executors.models.sampling import token_logprobs_and_entropy
    from graphrl.executors.parallel import parallelize_llama
    from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama

    out = {}
    for name in FAMILIES:
        full = _model(name)
        ids = torch.randint(1, 16, (2, 9), generator=torch.Generator().manual_seed(10))
        with torch.no_grad():
            want_logits = full(ids)
            tp_gen = TensorParallelLlama.from_full(full, TensorParallelGroup(rank, world, dist.group.WORLD))
            generator_rel = _relative(tp_gen(ids), want_logits)

        batch = _batch()
        logprobs, _ = token_logprobs_and_entropy(full, *batch)
        logprobs.sum().backward()
        want_grads = {n: p.grad.clone() for n, p in full.named_parameters()}

        trained = _model(name)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        adapter = parallelize_llama(trained, mesh)
        got_logprobs, _ = adapter(*batch)
        got_logprobs.sum().backward()
        grad_rel = {}
        for n, p in trained.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad_rel[n] = _relative(grad, want_grads[n])
        out[name] = {"generator": generator_rel, "logprobs": _relative(got_logprobs, logprobs.detach()),
                     **{f"grad {n}": r for n, r in grad_rel.items()}}
    return out


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports() -> list[dict[str, dict[str, float]]]:
    return run_on_ranks(2, _on_rank, collective_timeout_s=120)


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_generator_and_trainer_match_the_full_model(name: str, reports) -> None:
    for rank, report in enumerate(reports):
        mine = report[name]
        assert any(key.endswith(("q_norm.weight", "q_proj.bias")) for key in mine)  # the family's own tensors
        worst = {key: value for key, value in mine.items() if value > REL_TOL}
        assert not worst, f"rank {rank}: {worst}"

"""Generation engines: what turns a generator role's prompts into a piece of the rollout batch.

A generator role runs on one engine, chosen in the plan (`RolePlacement.engine`): graphrl's native
KV-cache sampler, or a vLLM engine in the rank's own process (`vllm_engine.py`, imported only when a
plan asks for it). Every engine answers the same request with the same piece the rest of the executor
reads (prompt_ids, prompt_mask, response_ids, response_mask, behaviour_logprobs, version; responses
padded to `max_new_tokens`), so rewards, advantages, training and asynchronous schedules do not know
which engine sampled.

Shared semantics, whatever the engine:
- response i of a step is sampled from a seed derived from (run seed, step, i) alone, so a response is
  the same however the batch is split between replicas;
- after a stop token a response is padded (mask False, log-prob 0);
- behaviour log-probs are of the sampling distribution: log_softmax(logits / T) at the temperature T
  that sampled the token (top-p ignored; greedy T = 0 uses T = 1). The trainer recomputes the same
  quantity (`token_logprobs_and_entropy` under `sampling_temperature`), so importance ratios compare
  like with like.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor, nn

from graphrl.ops import ROUTES_FIELD as ROUTES
from graphrl.schemas.job import Engine
from graphrl.schemas.plan import RolePlacement


def response_seed(seed: int, step: int, index: int) -> int:
    """The seed of response `index` of `step` in a run seeded by `seed` (one formula for every engine)."""
    return (seed * 1_000_003 + step) * 1_048_576 + index


def response_uniforms(seeds: Sequence[int], length: int) -> Tensor:
    """The uniform numbers that sample responses of the given seeds (`GenerationRequest.seeds`), [len(seeds),
    length]: each row from a generator seeded by its own seed alone, so a response is the same on every
    layout (however many generator replicas split the batch, at whatever tensor-parallel size)."""
    rows = [torch.rand(length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for seed in seeds]
    return torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.float64)


@dataclass(frozen=True)
class GenerationRequest:
    """Responses [start, start + N) of one step: N left-padded prompts (already repeated per sample)."""

    prompt_ids: Tensor  # int64 [N, P]
    prompt_mask: Tensor  # bool [N, P]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    seed: int
    step: int
    start: int
    version: int
    row_seeds: tuple[int, ...] | None = None  # each row's own seed (an episode's turn); default from (seed, step, start + i)

    def seeds(self) -> list[int]:
        """The sampling seed of each row."""
        if self.row_seeds is not None:
            return list(self.row_seeds)
        return [response_seed(self.seed, self.step, self.start + i) for i in range(self.prompt_ids.shape[0])]


class GenerationEngine(Protocol):
    """One generator replica's sampler."""

    name: Engine

    def generate(self, request: GenerationRequest) -> dict[str, Tensor]:
        """The rollout piece of the request, every response padded to `max_new_tokens`."""
        ...

    def weights_updated(self) -> None:
        """The role's module now holds new weights (a weight sync or an in-place reshard filled it)."""
        ...

    def close(self) -> None:
        """Free what the engine holds; it is not used again."""
        ...


def pad_piece(request: GenerationRequest, response_ids: Tensor, response_mask: Tensor,
              logprobs: Tensor, routes: Tensor | None = None) -> dict[str, Tensor]:
    """The rollout piece of `request` from responses that may be shorter than `max_new_tokens`, with a
    mixture of experts' `routes` (int16 [N, P + R', layers * k], `sampling.routes_of`) when recorded."""
    pad = request.max_new_tokens - response_ids.shape[1]
    if pad > 0:
        response_ids = torch.nn.functional.pad(response_ids, (0, pad), value=request.pad_id)
        response_mask = torch.nn.functional.pad(response_mask, (0, pad), value=False)
        logprobs = torch.nn.functional.pad(logprobs, (0, pad), value=0.0)
    piece = {"prompt_ids": request.prompt_ids, "prompt_mask": request.prompt_mask, "response_ids": response_ids,
             "response_mask": response_mask, "behaviour_logprobs": logprobs.float(),
             "version": torch.tensor([request.version])}
    if routes is not None:
        width = request.prompt_ids.shape[1] + request.max_new_tokens
        piece[ROUTES] = torch.nn.functional.pad(routes, (0, 0, 0, width - routes.shape[1]), value=0)
    return piece


class NativeEngine:
    """graphrl's own sampler (`executors.models.sampling.generate`) on the role's module, which weight syncs
    update in place: nothing to reload."""

    name: Engine = "native"

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def generate(self, request: GenerationRequest) -> dict[str, Tensor]:
        from graphrl.executors.models.sampling import generate, routes_of

        device = request.prompt_ids.device
        n = request.prompt_ids.shape[0]
        uniforms = response_uniforms(request.seeds(), request.max_new_tokens).to(device)
        was_training = self.module.training
        self.module.eval()
        moe = bool(getattr(getattr(self.module, "dims", None), "is_moe", False))
        with torch.no_grad():
            out = generate(self.module, request.prompt_ids, request.prompt_mask,  # type: ignore[arg-type]
                           request.max_new_tokens, temperature=request.temperature, top_p=request.top_p,
                           uniforms=uniforms, eos_id=list(request.stop_ids) or None, pad_id=request.pad_id,
                           record_routes=moe)
        self.module.train(was_training)
        routes = None if out.routes is None else routes_of(out.routes)
        return pad_piece(request, out.response_ids, out.response_mask, out.logprobs, routes)

    def weights_updated(self) -> None:
        """The sampler reads the module's parameters directly."""

    def close(self) -> None:
        """Nothing beyond the module, which the role owns."""


@dataclass(frozen=True)
class EngineContext:
    """What an engine needs to know about the rank it runs on."""

    rank: int
    device: torch.device
    threads: int
    seed: int
    max_model_len: int
    device_memory_bytes: float = 0.0  # the plan's hardware's memory per device (a GPU engine's budget is a share of it)
    max_batch: int = 0  # the most responses one generation of the role asks for here (0: the engine's default)


def rank_cores(rank: int, threads: int) -> list[int]:
    """The CPU cores of a local rank: `threads` consecutive ones of this process's allowed cores."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    first = (rank * threads) % len(allowed)
    return [allowed[(first + i) % len(allowed)] for i in range(min(threads, len(allowed)))]


def build_engine(placement: RolePlacement, module: nn.Module, dtype: torch.dtype,
                 context: EngineContext) -> GenerationEngine:
    """The engine the plan chose for a generator role on this rank, started with `module`'s weights."""
    if placement.engine == "vllm":
        from graphrl.executors.engines.vllm_engine import VllmEngine

        return VllmEngine.start(placement, module, dtype, context)
    return NativeEngine(module)


__all__ = ["EngineContext", "GenerationEngine", "GenerationRequest", "NativeEngine", "build_engine", "pad_piece",
           "rank_cores", "response_seed", "response_uniforms"]

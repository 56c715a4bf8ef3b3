"""A stand-in for vllm's `LLM`, put on a run's PYTHONPATH by the engine fault tests so that a whole
`graphrl run` with `engine: vllm` starts, generates and fails where a test tells it to, without vllm.

It samples uniformly over the model folder's vocabulary, from each request's seed, and reports each
token's log-probability as -log(vocab). `GRAPHRL_FAKE_VLLM_FAIL` injects a failure:
`start:<rank>` (the engine of that rank refuses to start) or `generate:<rank>:<n>` (its n-th generation
raises, as an engine that dies mid-run does).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _fault() -> tuple[str, int, int]:
    parts = os.environ.get("GRAPHRL_FAKE_VLLM_FAIL", "").split(":")
    if len(parts) < 2:
        return "", -1, 0
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 0


class SamplingParams(SimpleNamespace):
    pass


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        where, rank, _ = _fault()
        if where == "start" and rank == _rank():
            raise ValueError("No available memory for the cache blocks (injected)")
        self.vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        self.kwargs = kwargs
        self.generations = 0

    def generate(self, prompts: list[Any], params: list[SamplingParams], use_tqdm: bool = False) -> list[Any]:
        self.generations += 1
        where, rank, n = _fault()
        if where == "generate" and rank == _rank() and n == self.generations:
            raise RuntimeError("EngineCore encountered an issue (injected)")
        logprob = SimpleNamespace(logprob=-math.log(self.vocab))
        out = []
        for p in params:
            rng = random.Random(p.seed)
            tokens = [rng.randrange(self.vocab) for _ in range(p.max_tokens)]
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens,
                                                                logprobs=[{t: logprob} for t in tokens])]))
        return out

    def collective_rpc(self, fn: Any, args: tuple[Any, ...] = ()) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass

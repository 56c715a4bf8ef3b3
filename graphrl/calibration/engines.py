"""Generation engines: where vllm can be imported, its generation tokens/s next to the native sampler's on
the same probe model and prompts, which costs generators placed on that engine.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from graphrl.calibration.harness import timed_once
from graphrl.engine_support import engine_available
from graphrl.schemas.hardware import EngineThroughput
from graphrl.schemas.model import ModelDims

# A probe the vLLM CPU backend runs (head_dim 64), small enough to measure in seconds.
ENGINE_PROBE = ModelDims(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                         num_kv_heads=2, max_seq_len=256, rope_theta=10000.0)


def engine_throughputs(report: Callable[[str], None] = print, batch: int = 16, prompt_len: int = 32,
                       response_len: int = 64) -> tuple[EngineThroughput, ...]:
    """Generation tokens/s of each installed engine and of the native sampler, same probe, same prompts
    (float32, no stop token, so every response is `response_len` long); best of two timed runs after a
    warm-up. Empty where no engine besides the native sampler is installed."""
    if not engine_available("vllm"):
        report("vllm is not installed: generators on engine vllm are costed as the native sampler")
        return ()
    from graphrl.executors.engines import EngineContext, GenerationRequest, NativeEngine, build_engine
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.plan import MemoryBytes, RolePlacement

    torch.manual_seed(0)
    model = Llama(ENGINE_PROBE).float().eval()
    ids = torch.randint(3, ENGINE_PROBE.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    request = GenerationRequest(ids, torch.ones_like(ids, dtype=torch.bool), response_len, 1.0, 1.0, (), 0, 0, 0, 0, 0)
    threads = torch.get_num_threads()
    probe = f"{ENGINE_PROBE.num_layers}-layer d{ENGINE_PROBE.hidden_size} Llama, {batch} x {response_len} tokens, float32, {threads} threads"

    def tokens_per_s(generate: Callable[[], Any]) -> float:
        generate()
        return batch * response_len / min(timed_once(generate) for _ in range(2))

    report(f"measuring generation engines ({probe})...")
    native = tokens_per_s(lambda: NativeEngine(model).generate(request))
    placement = RolePlacement(role="probe/generate", model="probe", kind="generate", ops=["generate"], mesh="probe",
                              engine="vllm", memory_bytes=MemoryBytes())
    engine = build_engine(placement, model, torch.float32,
                          EngineContext(0, torch.device("cpu"), threads, 0, prompt_len + response_len, max_batch=batch))
    try:
        vllm = tokens_per_s(lambda: engine.generate(request))
    finally:
        engine.close()
    report(f"  native {native:.0f} tokens/s, vllm {vllm:.0f} tokens/s ({vllm / native:.2f}x)")
    return (EngineThroughput(engine="vllm", tokens_per_s=vllm, native_tokens_per_s=native, probe=probe),)

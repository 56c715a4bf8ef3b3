"""fp8 against unquantized generation, side by side in one run: bytes held, tokens/s, log-prob agreement.

    python benchmarks/bench_fp8.py [--preset tiny-digits-wide | --hidden 256 --layers 4 ...] [--std 0.04]

One Llama (seeded, weights drawn at `--std`; the GPT init 0.02 gives near-uniform next-token
distributions, where every quantization looks harmless, so the default is 0.04), built twice on the
same device: unquantized (the model's dtype: float32 on CPU, bfloat16 on CUDA) and with its block
linears quantized by `executors/fp8.py` (CPU: dequantized at use; CUDA with fp8 tensor cores:
`torch._scaled_mm`). Both generate for the same prompts with the same per-row uniforms. Reported:

- bytes held: parameters and buffers (the fp8 scales) of each model, and the ratio;
- tokens/s: generated tokens over the median wall time of `--repeats` `generate` calls after one warm-up,
  the two models taking turns (on CPU with `--threads` torch threads, 1 by default as a rank runs);
- |logprob difference|: the unquantized model's sampled tokens, teacher-forced through both models:
  mean and max over real tokens, beside a bfloat16 copy's (CPU) as the scale of plain rounding;
- the fraction of responses the fp8 model samples identically with the same uniforms (one changed
  token changes the rest of its response, so this is the strictest of the figures).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphrl.executors import fp8
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.sampling import generate, token_logprobs
from graphrl.schemas.model import MODEL_PRESETS, ModelDims


def build(dims: ModelDims, std: float, seed: int, device: torch.device, dtype: torch.dtype) -> Llama:
    torch.manual_seed(seed)
    model = Llama(dims)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model.to(device=device, dtype=dtype).eval()


def held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def timed_generate(models: list[Llama], ids: torch.Tensor, mask: torch.Tensor, uniforms: torch.Tensor,
                   repeats: int) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """Per model (tokens/s, response ids, response mask): the median of `repeats` timed calls after a
    warm-up, the models taking turns so that a change in the machine's load hits them alike."""
    new_tokens = uniforms.shape[1]
    outs = [generate(model, ids, mask, new_tokens, uniforms=uniforms) for model in models]
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, model in enumerate(models):
            if ids.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs[i] = generate(model, ids, mask, new_tokens, uniforms=uniforms)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
    return [(ids.shape[0] * new_tokens / statistics.median(t), out.response_ids, out.response_mask)
            for t, out in zip(times, outs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default=None)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--std", type=float, default=0.04)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = parser.parse_args()
    dims = MODEL_PRESETS[args.preset] if args.preset else ModelDims(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, max_seq_len=args.prompt_len + args.new_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(args.threads)  # one thread per rank, as `graphrl run` runs them on a CPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    full = build(dims, args.std, args.seed, device, dtype)
    quantized = fp8.quantize_generator(build(dims, args.std, args.seed, device, dtype))
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, dims.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    uniforms = torch.rand(args.batch, args.new_tokens, generator=g, dtype=torch.float64).to(device)

    (full_rate, response_ids, response_mask), (fp8_rate, fp8_ids, _) = timed_generate(
        [full, quantized], ids, mask, uniforms, args.repeats)
    with torch.no_grad():
        ref = token_logprobs(full, ids, mask, response_ids, response_mask)
        diffs = {"fp8": token_logprobs(quantized, ids, mask, response_ids, response_mask)}
        if dtype == torch.float32:
            diffs["bf16"] = token_logprobs(build(dims, args.std, args.seed, device, torch.bfloat16), ids, mask,
                                           response_ids, response_mask)
    layer = next(layer for _, layer in fp8.fp8_linears(quantized))
    path = "torch._scaled_mm" if layer.uses_scaled_mm(torch.zeros(1, dims.hidden_size, dtype=dtype, device=device)) \
        else "dequantize at use"
    print(f"model: {dims.num_layers} layers, hidden {dims.hidden_size}, vocab {dims.vocab_size}, weights std {args.std}; "
          f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"unquantized dtype {str(dtype).removeprefix('torch.')}, fp8 matmul: {path}")
    print(f"batch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new tokens, median of {args.repeats}")
    full_bytes, fp8_bytes = held_bytes(full), held_bytes(quantized)
    print(f"{'':22}{'unquantized':>14}{'fp8':>14}{'fp8 / unquantized':>20}")
    print(f"{'bytes held':22}{full_bytes:>14,}{fp8_bytes:>14,}{fp8_bytes / full_bytes:>20.3f}")
    print(f"{'tokens/s':22}{full_rate:>14,.0f}{fp8_rate:>14,.0f}{fp8_rate / full_rate:>20.3f}")
    real = response_mask
    for name, lp in diffs.items():
        d = (lp.float() - ref.float()).abs()[real]
        print(f"|logprob difference| {name:>5} vs unquantized: mean {float(d.mean()):.4f}  max {float(d.max()):.4f} "
              f"(over {int(real.sum())} tokens)")
    same = ((fp8_ids == response_ids) | ~real).all(dim=1).float().mean()
    print(f"responses sampled identically with the same uniforms: {float(same):.1%}")


if __name__ == "__main__":
    main()

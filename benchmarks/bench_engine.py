"""graphrl's native sampler against the vLLM engine, side by side in one run, on SmolLM2-135M-Instruct.

    python benchmarks/bench_engine.py [--model examples/data/smollm2-135m] [--shapes 16x40 64x128] [--rl-steps 3]

Needs vllm (the CPU build: README, "Generation on vLLM") and the model folder that
`examples/arith/make_arith_data.py --model` writes. Reported, same prompts for every engine (the
arithmetic example's chat prompts, no stop token, so every response has the full length):

- tokens/s of the native sampler (float32) and of vLLM in float32 and bfloat16, at each shape
  (sequences x new tokens): generated tokens over the wall time of one `generate` after a warm-up;
- seconds of a weight sync into each vLLM engine: the whole model's named tensors reloaded in place
  (`VllmEngine.load_weights`), median of three;
- seconds per RL step of the SmolLM2 GRPO example run with each engine (`graphrl run`, the median of the
  steps after the first, which includes start-up), same seed and prompts.

The engines run in this process on `--threads` cores (default 2), as a rank does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def prompts(model_dir: Path, count: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` left-padded chat prompts of the arithmetic task, tokenized as the example's dataset does."""
    sys.path.insert(0, str(REPO / "examples" / "arith"))
    import random

    from make_arith_data import NAMES, THINGS, problem  # type: ignore[import-not-found]

    from graphrl.models.tokenizer import encode_left_padded, load_tokenizer, prompt_text

    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(0)
    texts = [prompt_text(tokenizer, problem(rng, NAMES, THINGS)["prompt"], None, True) for _ in range(count)]
    ids, mask = encode_left_padded(tokenizer, texts, prompt_len)
    return ids, mask.bool()


def timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rl_step_seconds(model_dir: Path, engine: str, steps: int, work: Path) -> float:
    """Median seconds per step after the first of the SmolLM2 example on `engine`."""
    job = (REPO / "examples" / "grpo_smollm2_arith.yaml").read_text()
    job = job.replace("data/smollm2-135m", str(model_dir.resolve()))
    data = work / "data"
    if not data.exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "arith" / "make_arith_data.py"), "--out", str(data)],
                       check=True, capture_output=True)
    job = job.replace("data/arith_train.jsonl", str(data / "arith_train.jsonl"))
    (work / "job.yaml").write_text(job)
    out = work / f"run-{engine}"
    run = subprocess.run([sys.executable, "-m", "graphrl.cli", "run", str(work / "job.yaml"), "--steps", str(steps),
                          "--out", str(out), "-q", "--set", f"placement.roles.policy/generate.engine={engine}"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"graphrl run with engine {engine} failed:\n{run.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "data" / "smollm2-135m")
    parser.add_argument("--shapes", nargs="+", default=["16x40", "64x128"], help="sequences x new tokens")
    parser.add_argument("--prompt-len", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rl-steps", type=int, default=3, help="steps per RL run (0 skips the RL runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from graphrl.executors.engines import EngineContext, GenerationRequest, NativeEngine, build_engine
    from graphrl.models import from_pretrained
    from graphrl.schemas.plan import MemoryBytes, RolePlacement

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    longest = max(r for _, r in shapes)
    model, _ = from_pretrained(args.model, dtype=torch.float32)
    batches = {n: prompts(args.model, n, args.prompt_len) for n, _ in shapes}

    def request(n: int, r: int) -> GenerationRequest:
        ids, mask = batches[n]
        return GenerationRequest(ids, mask, r, 0.8, 1.0, (), 0, seed=0, step=0, start=0, version=0)

    results: dict[str, dict[str, float]] = {}
    native = NativeEngine(model)
    native.generate(request(shapes[0][0], 4))  # warm-up
    results["native fp32"] = {f"{n}x{r}": n * r / timed(lambda: native.generate(request(n, r))) for n, r in shapes}
    syncs: dict[str, float] = {}
    for label, dtype in (("vllm fp32", torch.float32), ("vllm bf16", torch.bfloat16)):
        staged = model.to(dtype)
        placement = RolePlacement(role="policy/generate", model="policy", kind="generate", ops=["rollout"],
                                  mesh="all", engine="vllm", memory_bytes=MemoryBytes(kv_cache=1 << 30))
        engine = build_engine(placement, staged, dtype,
                              EngineContext(0, torch.device("cpu"), args.threads, 0, args.prompt_len + longest,
                                            max_batch=max(n for n, _ in shapes)))
        engine.generate(request(shapes[0][0], 4))  # warm-up
        results[label] = {f"{n}x{r}": n * r / timed(lambda: engine.generate(request(n, r))) for n, r in shapes}
        syncs[label] = statistics.median(timed(engine.weights_updated) for _ in range(3))
        engine.close()
        del engine
    model = model.float()

    print(f"tokens/s, {args.threads} threads, SmolLM2-135M-Instruct, prompts of {args.prompt_len} tokens")
    print(f"{'engine':<12}" + "".join(f"{s:>12}" for s in args.shapes))
    for label, row in results.items():
        print(f"{label:<12}" + "".join(f"{row[s]:>12.0f}" for s in args.shapes))
    for label, row in results.items():
        if label != "native fp32":
            print(f"{label} / native: " + ", ".join(f"{s} {row[s] / results['native fp32'][s]:.2f}x" for s in args.shapes))
    for label, seconds in syncs.items():
        print(f"weight sync into {label}: {seconds:.2f} s (whole model, in place)")
    if args.rl_steps:
        with tempfile.TemporaryDirectory() as tmp:
            per_step = {engine: rl_step_seconds(args.model, engine, args.rl_steps, Path(tmp))
                        for engine in ("native", "vllm")}
        for engine, seconds in per_step.items():
            print(f"RL step, SmolLM2 GRPO example on {engine}: {seconds:.1f} s (median of steps 2..{args.rl_steps})")
        print(f"RL step speed-up with vllm: {per_step['native'] / per_step['vllm']:.2f}x")


if __name__ == "__main__":
    main()

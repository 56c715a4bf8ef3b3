"""Microbenchmarks: matmul FLOP/s and memory bandwidth, the matmuls of given weight shapes, the work over
a vocabulary, the optimizer step, and the executor's per-instruction overhead.

Each measures one kind of work on its own, one process, with the threads it is given; the cost model
reads the results as rates (`HardwareSpec`'s peak, bandwidths, `matmuls`, `vocab`, `optimizer_param_s`,
`op_overhead_s`).
"""

from __future__ import annotations

from typing import Callable

import torch

from graphrl.calibration.harness import best_time
from graphrl.compiler.cost import timing
from graphrl.schemas.hardware import MatmulFit, VocabCost
from graphrl.schemas.model import ModelDims


def matmul_flops(sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)) -> dict[int, float]:
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out[n] = 2 * n**3 / best_time(lambda: torch.mm(a, b))
    return out


def memory_bandwidth(num_bytes: int = 128 * 2**20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src), repeat=3)  # read + write


MATMUL_ROWS = (1, 4, 16, 64, 256, 1024, 4096)


# Rows past which a shape is not measured (its time grows in proportion to the rows there): about
# 20 GFLOP per call, a tenth of a second on one core.
MATMUL_MAX_FLOPS = 2e10


TORCH_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def model_matmul_shapes(dims: ModelDims, tps: tuple[int, ...] = (1,)) -> set[tuple[int, int]]:
    """(k, n) of every linear of `dims` on one rank of each tp group size in `tps`: the block linears and
    the vocabulary-parallel output head."""
    shapes = set()
    for tp in tps:
        shapes.update(timing.layer_matmul_shapes(dims, tp))
        shapes.add((dims.hidden_size, -(-dims.vocab_size // tp)))
    return shapes


# Weight shapes measured for any job (a job's own shapes are measured with it, `graphrl calibrate JOB`): at
# widths from a tiny model's to a 1B model's, the square projections, the attention's narrow key and value
# projections, the MLP's wide up and down projections, and vocabulary heads. A shape not measured takes
# the rate of the nearest measured one (`timing.matmul_seconds`).
GENERAL_WIDTHS = (128, 256, 512, 1024, 2048)
GENERAL_HEADS = ((256, 32768), (1024, 32768))
GENERAL_VOCAB = 32768


def general_matmul_shapes() -> set[tuple[int, int]]:
    shapes = set(GENERAL_HEADS)
    for w in GENERAL_WIDTHS:
        shapes |= {(w, w), (w, w // 4), (w, 3 * w), (3 * w, w)}
    return shapes


def rank_thread_counts(cores: int) -> tuple[int, ...]:
    """The torch thread counts a local rank may be given on `cores` cores: one, the powers of two between,
    and all of them (a one-rank job on the whole machine)."""
    counts = {1, cores}
    t = 2
    while t < cores:
        counts.add(t)
        t *= 2
    return tuple(sorted(counts))


def measure_matmuls(shapes: set[tuple[int, int]], dtype_bytes: int, threads: int,
                    report: Callable[[str], None] = lambda s: None) -> tuple[MatmulFit, ...]:
    """Seconds of `torch.nn.functional.linear` for each (k, n) weight shape by rows (`MATMUL_ROWS`, up to
    `MATMUL_MAX_FLOPS` per call), with `threads` torch threads."""
    dtype = TORCH_DTYPES[dtype_bytes]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    fits = []
    try:
        for k, n in sorted(shapes):
            w = torch.randn(n, k, dtype=dtype)
            rows = [r for r in MATMUL_ROWS if r == 1 or 2 * r * k * n <= MATMUL_MAX_FLOPS]
            seconds = []
            for r in rows:
                x = torch.randn(r, k, dtype=dtype)
                seconds.append(best_time(lambda: torch.nn.functional.linear(x, w), repeat=3, min_time_s=0.01))
            fits.append(MatmulFit(k=k, n=n, dtype_bytes=dtype_bytes, threads=threads, rows=tuple(rows),
                                  seconds=tuple(seconds)))
            big = rows[-1]
            report(f"  {k:>6} x {n:<6} {dtype_bytes * 8}-bit, {threads} thread(s): {2 * k * n / seconds[0] / 1e9:6.1f} "
                   f"GFLOP/s at 1 row, {2 * big * k * n / seconds[-1] / 1e9:6.1f} at {big}")
    finally:
        torch.set_num_threads(previous)
    return tuple(fits)


# Vocabularies below this are not measured: their work is a few kernels' overhead, which the fitted
# per-pass host time carries.
MIN_MEASURED_VOCAB = 1024


def measure_vocab(vocab_size: int, sample_rows: int, pass_rows: int, threads: int) -> VocabCost:
    """Seconds per row and entry of the executor's work over float32 logits of `vocab_size` entries:
    sampling with one uniform per row plus the token's log-prob (`sample_rows` rows, one decode step), a
    log-prob pass's log-softmax, gather and entropy, and a training pass's forward and backward of the
    log-probs (`pass_rows` rows)."""
    from graphrl.executors.models.sampling import sample_tokens

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(sample_rows, vocab_size, generator=g)
        uniform = torch.rand(sample_rows, generator=g)

        def sample() -> None:
            token = sample_tokens(logits, 0.8, 1.0, None, uniform)
            torch.log_softmax(logits / 0.8, dim=-1).gather(-1, token[:, None])

        pass_logits = torch.randn(pass_rows, vocab_size, generator=g)
        tokens = torch.randint(0, vocab_size, (pass_rows, 1), generator=g)

        def logprobs(x: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(x, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            return logp.gather(-1, tokens).squeeze(-1).sum() + 0.0 * entropy.sum()

        def forward() -> None:
            with torch.no_grad():
                logprobs(pass_logits)

        trainable = pass_logits.clone().requires_grad_(True)

        def train() -> None:
            trainable.grad = None
            logprobs(trainable).backward()

        per_sample = best_time(sample, repeat=3, min_time_s=0.02) / (sample_rows * vocab_size)
        per_forward = best_time(forward, repeat=3, min_time_s=0.02) / (pass_rows * vocab_size)
        per_train = best_time(train, repeat=3, min_time_s=0.02) / (pass_rows * vocab_size)
    finally:
        torch.set_num_threads(previous)
    return VocabCost(vocab_size=vocab_size, threads=threads, generate=per_sample, forward=per_forward,
                     train=per_train)


def report_vocab(cost: VocabCost, report: Callable[[str], None]) -> None:
    report(f"  vocabulary of {cost.vocab_size}, {cost.threads} thread(s): {cost.generate * 1e9:.2f} ns per entry "
           f"sampling, {cost.forward * 1e9:.2f} log-prob pass, {cost.train * 1e9:.2f} training pass")


# Parameters past which the optimizer is not measured bigger (its rate is steady there).
MAX_MEASURED_OPTIMIZER_PARAMS = 64_000_000


def measure_optimizer(params: int, threads: int) -> float:
    """Seconds per parameter of gradient-norm clipping and an AdamW step over `params` float32
    parameters in eight tensors, with `threads` torch threads, as the executor builds and runs them."""
    from graphrl.executors.parallel import build_optimizer, clip_grad_norm

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = [torch.nn.Parameter(torch.randn(max(1, params // 8))) for _ in range(8)]
        for t in tensors:
            t.grad = torch.randn_like(t)
        optimizer = build_optimizer(torch.nn.ParameterList(tensors), "none", "local", None, lr=1e-4,
                                    betas=(0.9, 0.999), weight_decay=0.0)  # the executor's own optimizer

        def step() -> None:
            clip_grad_norm(tensors, 1.0)
            optimizer.step()

        return best_time(step, repeat=3, min_time_s=0.05) / (8 * max(1, params // 8))
    finally:
        torch.set_num_threads(previous)


def instruction_overhead(batch: int = 128, prompt_len: int = 6, response_len: int = 5, group_size: int = 16) -> float:
    """Seconds of an executed data instruction besides model math: the executor joins the step's rollout
    pieces, then applies a rule reward or a GRPO advantage (the mean of the two)."""
    from graphrl.executors import algorithms as alg
    from graphrl.executors.rollouts import join_rollouts
    from graphrl.tasks import REWARDS

    piece = {"prompt_ids": torch.randint(0, 10, (batch, prompt_len)),
             "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.bool),
             "response_ids": torch.randint(0, 10, (batch, response_len)),
             "response_mask": torch.ones(batch, response_len, dtype=torch.bool),
             "behaviour_logprobs": torch.zeros(batch, response_len), "version": torch.tensor([0])}
    pieces = [(0, batch, piece)]
    reward_fn = REWARDS["digits_copy"]

    def reward() -> None:
        r, _ = join_rollouts(pieces, 0, batch)
        assert r is not None
        float(reward_fn(r["prompt_ids"], r["prompt_mask"], r["response_ids"], r["response_mask"]).float().sum())

    rewards = torch.rand(batch)

    def advantage() -> None:
        r, _ = join_rollouts(pieces, 0, batch)
        assert r is not None
        alg.broadcast_to_tokens(alg.grpo_advantages(rewards, group_size), r["response_mask"]).float()

    return (best_time(reward) + best_time(advantage)) / 2

"""Response lengths: the distribution the preview costs responses by.

Real RL responses are far shorter than `max_new_tokens` on average and have a long tail. A generate
node's `response_tokens` says so ({mean, max, p90}, or the lengths a run measured); this module turns it
into a `Lengths`: a sorted grid of equally likely lengths, from which every length-dependent cost reads
what it needs:

- `mean`: tokens that exist (packed passes, the engine's total decode work);
- `longest(n)`: the expected longest of n responses (a lockstep sampler decodes until it ends; a padded
  micro-batch of n rows is that wide);
- `survival(k)`: how many responses are still decoding after how many steps, in k segments (a
  continuous-batching engine's batch shrinks as responses end).

{mean, max, p90} is read as a log-normal length clipped at `max` (the responses that reach the limit
are cut there): p90 fixes its spread; without p90 the spread is `DEFAULT_SIGMA`, a coefficient of
variation of about 0.66. Unset, every response is `max_new_tokens` long.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from graphrl.schemas.job import ResponseTokens

GRID = 2048
"""Equally likely lengths the distribution is held as."""
DEFAULT_SIGMA = 0.6
"""Spread of the log-normal when only the mean is given: a coefficient of variation of sqrt(e^0.36 - 1)."""
_NORMAL = NormalDist()
_Z90 = _NORMAL.inv_cdf(0.9)


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens as `GRID` (or a run's measured count of) equally likely values, sorted."""

    grid: tuple[float, ...]
    source: str
    """How the distribution was given, for the preview ('max_new_tokens', 'mean 795, max 4096', ...)."""

    @classmethod
    def fixed(cls, length: int) -> "Lengths":
        return cls((float(length),), f"every response {length} tokens (max_new_tokens)")

    @functools.cached_property
    def mean(self) -> float:
        return math.fsum(self.grid) / len(self.grid)

    @property
    def max(self) -> float:
        return self.grid[-1]

    @property
    def mean_square(self) -> float:
        return math.fsum(x * x for x in self.grid) / len(self.grid)

    def quantile(self, q: float) -> float:
        """The length below which a fraction `q` of responses end."""
        return _quantile(self.grid, q)

    def longest(self, n: float) -> float:
        """Expected longest of `n` responses drawn from the distribution: sum of x_i (F_i^n - F_{i-1}^n)
        over the grid, F_i = i / size (the mean for one, 0 for none)."""
        if n <= 0:
            return 0.0
        found = self._longest_by_count.get(n)
        if found is None:
            found = self._longest_by_count[n] = _longest(self.grid, float(n))
        return found

    @functools.cached_property
    def _longest_by_count(self) -> dict[float, float]:
        """`longest` by n, as asked: the placement search asks for a few counts thousands of times, and the
        module's caches key on the grid, which is hashed anew at every call."""
        return {}

    def survival(self, n: float, segments: int = 16) -> list[tuple[float, float, float]]:
        """A decode of `n` responses that all start together, as up to `segments` spans of decode steps
        (first_step, last_step, responses still decoding): span j ends where a fraction j/segments of the
        responses have ended (the last at the expected longest of n), and holds the mean count still
        decoding over its steps (exact for the grid), at least one."""
        if n <= 0:
            return []
        return [(lo, hi, max(1.0, n * alive)) for lo, hi, alive in _survival(self.grid, float(n), segments)]

    def peak_tokens(self, n: float, prompt_len: int) -> float:
        """The most KV-cache tokens `n` responses that start together hold at once, when each frees its
        cache as it ends (a paged engine): max over steps t of (responses still running) * (prompt_len + t)."""
        return _peak_tokens(self.grid, float(n), prompt_len)


def _quantile(grid: tuple[float, ...], q: float) -> float:
    return grid[min(len(grid) - 1, max(0, math.ceil(q * len(grid)) - 1))]


def _longest(grid: tuple[float, ...], n: float) -> float:
    """The expected longest of n > 0 draws (the mean for at most one)."""
    return _expected_max(grid, n) if n > 1 else math.fsum(grid) / len(grid)


@functools.lru_cache(maxsize=256)
def _survival(grid: tuple[float, ...], n: float, segments: int) -> tuple[tuple[float, float, float], ...]:
    size = len(grid)
    longest = _longest(grid, n)
    bounds = [0.0] + [min(_quantile(grid, j / segments), longest) for j in range(1, segments)] + [longest]
    spans = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        # The fraction still decoding, averaged over the span's steps: each length covers the part of
        # [lo, hi] below it.
        alive = math.fsum(min(max(x, lo), hi) - lo for x in grid) / (size * (hi - lo))
        spans.append((lo, hi, alive))
    return tuple(spans)


@functools.lru_cache(maxsize=256)
def _peak_tokens(grid: tuple[float, ...], n: float, prompt_len: int) -> float:
    longest = _longest(grid, n)
    size = len(grid)
    peak = n * prompt_len
    for i, x in enumerate(grid):
        peak = max(peak, n * (size - i) / size * (prompt_len + min(x, longest)))
    return peak


@functools.lru_cache(maxsize=256)
def _expected_max(grid: tuple[float, ...], n: float) -> float:
    size = len(grid)
    total, before = 0.0, 0.0
    for i, x in enumerate(grid, start=1):
        now = (i / size) ** n
        total += x * (now - before)
        before = now
    return total


def lengths_of(spec: ResponseTokens | None, max_new_tokens: int) -> Lengths:
    """The distribution a generate node's `response_tokens` gives (every response `max_new_tokens` long
    when unset)."""
    if spec is None:
        return Lengths.fixed(max_new_tokens)
    limit = spec.max if spec.max is not None else max_new_tokens
    if spec.measured:
        grid = tuple(sorted(float(min(max(x, 1), limit)) for x in spec.measured))
        return Lengths(grid, f"measured in {spec.from_run} ({len(grid)} responses)")
    assert spec.mean is not None  # the schema: mean or from
    given = f"mean {spec.mean:g}, max {limit}" + (f", p90 {spec.p90:g}" if spec.p90 is not None else "")
    lengths = Lengths(_clipped_lognormal(float(spec.mean), limit, spec.p90), f"assumed {given}")
    if spec.p90 is not None and abs(lengths.quantile(0.9) - min(spec.p90, limit)) > 0.05 * spec.p90:
        raise ValueError(f"no length distribution of mean {spec.mean:g} up to {limit} has its 90th percentile at "
                         f"{spec.p90:g} (the nearest: {lengths.quantile(0.9):.0f})")
    return lengths


@functools.lru_cache(maxsize=64)
def _clipped_lognormal(mean: float, limit: int, p90: float | None) -> tuple[float, ...]:
    """`GRID` equally likely lengths of min(X, limit), X log-normal, whose mean is `mean` and whose 90th
    percentile is `p90` (spread `DEFAULT_SIGMA` when None)."""
    if mean >= limit:
        return (float(limit),)
    sigma = DEFAULT_SIGMA if p90 is None else _sigma_for_p90(mean, limit, p90)
    mu = _mu_for_mean(mean, limit, sigma)
    zs = (_NORMAL.inv_cdf((i + 0.5) / GRID) for i in range(GRID))
    grid = [min(math.exp(mu + sigma * z), float(limit)) for z in zs]
    # The grid's mean differs from the distribution's by the discretisation: scale the unclipped part
    # (a few times: scaling pushes some lengths onto the limit).
    for _ in range(8):
        scale = _rescale(grid, mean, float(limit))
        grid = [max(1.0, min(x * scale, float(limit))) if x < limit else x for x in grid]
    return tuple(grid)


def _clipped_mean(mu: float, sigma: float, limit: float) -> float:
    """E[min(X, limit)] for log X ~ N(mu, sigma^2)."""
    a = (math.log(limit) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * _NORMAL.cdf(a - sigma) + limit * (1 - _NORMAL.cdf(a))


def _mu_for_mean(mean: float, limit: float, sigma: float) -> float:
    lo, hi = math.log(mean) - 10 * sigma - 10, math.log(limit) + 10 * sigma + 10
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _clipped_mean(mid, sigma, limit) < mean else (lo, mid)
    return (lo + hi) / 2


def _sigma_for_p90(mean: float, limit: float, p90: float) -> float:
    """The spread whose clipped log-normal of mean `mean` has its 90th percentile at `p90` (the
    percentile grows with the spread at a fixed mean, until it reaches the limit)."""
    if p90 >= limit:
        # p90 at the limit: a tenth of the responses reach it; the spread that puts a little more there
        # (10.5%), so that the grid's 90th percentile is on the limit.
        z = _NORMAL.inv_cdf(0.895)
        lo, hi = 0.01, 5.0
        for _ in range(60):
            mid = (lo + hi) / 2
            mu = _mu_for_mean(mean, limit, mid)
            lo, hi = (mid, hi) if math.exp(mu + mid * z) < limit else (lo, mid)
        return hi
    lo, hi = 1e-3, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        p = math.exp(_mu_for_mean(mean, limit, mid) + mid * _Z90)
        lo, hi = (mid, hi) if p < p90 else (lo, mid)
    return (lo + hi) / 2


def _rescale(grid: list[float], mean: float, limit: float) -> float:
    """The factor on the grid's unclipped lengths that makes its mean `mean`."""
    clipped = sum(limit for x in grid if x >= limit)
    free = sum(x for x in grid if x < limit)
    if free <= 0:
        return 1.0
    return max(0.0, (mean * len(grid) - clipped) / free)


def read_measured(run_dir: os.PathLike[str] | str, limit: int = 16384) -> tuple[int, ...]:
    """Response lengths recorded in a run folder's samples.jsonl (`response_tokens` of each row), the most
    recent `limit` of them; empty if the file has none."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        return ()
    found: list[int] = []
    with open(path) as f:
        for line in f:
            try:
                value = json.loads(line).get("response_tokens")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                found.append(value)
    return tuple(found[-limit:])


__all__ = ["DEFAULT_SIGMA", "GRID", "Lengths", "lengths_of", "read_measured"]

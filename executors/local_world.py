"""A function run on a world of local ranks: one process per rank, forked from the rank server
(`rank_server.rank_context`, so a world starts in milliseconds once torch is imported), joined by a gloo process
group. `graphrl calibrate` measures collectives with it and the multi-rank tests check layouts with it.

Every rank's return value comes back. A rank that raises or dies ends the world at once: the error names
it with its exception (and the others', which usually follow from it), instead of leaving the caller
waiting for a result that never comes.
"""

from __future__ import annotations

import os
import queue as queue_module
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class WorldFailed(RuntimeError):
    """A rank of a local world raised or died; `tracebacks` holds each failed rank's whole traceback."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any, collective_timeout_s: float = 300.0,
                 timeout_s: float | None = None) -> list[Any]:
    """`fn(rank, world, *args)` on `world` local processes; every rank's result, by rank. `fn` and its
    arguments must be picklable (a module-level function). `collective_timeout_s` bounds how long a
    collective waits for a peer; `timeout_s`, when given, the whole world."""
    from graphrl.executors.launcher import free_port
    from graphrl.executors.rank_server import rank_context

    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fn, args, collective_timeout_s, results))
             for r in range(world)]
    for p in procs:
        p.start()
    started = time.monotonic()
    got: dict[int, Any] = {}
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise WorldFailed(f"rank {dead[0]} ended with exit code {procs[dead[0]].exitcode} before it "
                                      "reported", {}) from None
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    raise WorldFailed(f"the world of {world} ranks did not finish within {timeout_s:.0f} s", {}) from None
                continue
            if ok:
                got[rank] = value
                continue
            failed = {rank: value}
            for p in procs:  # the others fail soon after their peer: name them too
                p.join(timeout=10)
            while not results.empty():
                other, other_ok, other_value = results.get()
                if not other_ok:
                    failed[other] = other_value
            summary = "; ".join(f"rank {r}: {_last_line(tb)}" for r, tb in sorted(failed.items()))
            raise WorldFailed(summary, failed)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


def _last_line(tb: str) -> str:
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "failed"


def _rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, collective_timeout_s: float,
          results: Any) -> None:
    from graphrl.executors.host_memory import keep_freed_host_memory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    keep_freed_host_memory()  # as a run's CPU ranks do
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout_s))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["WorldFailed", "run_on_ranks"]

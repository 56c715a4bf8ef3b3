"""The rank server: the process local ranks are forked from, which has imported torch and the executors
once (`RANK_PRELOAD`), so a rank starts in milliseconds instead of the seconds those imports take.

Torch-free on purpose: `graphrl run` starts the server first thing (`start_rank_server`), and the server
imports on the second core while the command itself imports torch and compiles the job.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

# What a rank imports before its first instruction (importing them starts no thread and touches no device,
# so forking after it is safe). torch imports some of its own on first use: DDP and FSDP2 bring in
# torch._dynamo (about 1.2 s), ZeRO-1's optimizer torch.distributed.optim (0.6 s, TorchScript), metrics the
# TensorBoard writer; imported once here, a later run's ranks start in under a second instead of three.
RANK_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.optim", "torch.utils.tensorboard",
                "graphrl.executors.executor", "graphrl.executors.launcher")


def rank_context() -> Any:
    """How local ranks start: forked from a server process that has imported `RANK_PRELOAD` once (a rank
    otherwise spends about 2 s importing torch and the executors before it does anything), where the
    platform has a forkserver; spawned afresh elsewhere. The server is started once per launching process
    and kept, so every later run's ranks start in milliseconds."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts; later calls change nothing
    return ctx


def start_rank_server() -> None:
    """Start the rank server now (it imports `RANK_PRELOAD` while the caller goes on); a no-op where ranks
    are spawned, or once it runs."""
    if "forkserver" in mp.get_all_start_methods():
        rank_context()
        from multiprocessing import forkserver

        forkserver.ensure_running()


__all__ = ["RANK_PRELOAD", "rank_context", "start_rank_server"]

"""Ending a run on request: Ctrl-C, SIGTERM (a scheduler's preemption) and a launcher that dies.

A rank takes its first SIGINT or SIGTERM as a request, not an end. Before its first instruction nothing
has been trained, so it ends there and then. Once it runs, it goes on to the end of the step it is in:
the trainer ranks agree on that step at the step's Checkpoint instruction (an all-reduce of their
requests over the trainer group, so every trainer rank stops after the same step, whichever of them was
signalled), write and verify the checkpoint of that step and end with `128 + signal`, the code a shell
gives a process ended by that signal. Ranks that hold no trained state (a disaggregated generator) are
ended by their launcher once the trainers have stopped. Later signals change nothing on a rank: the
launcher, or torchrun after its grace period, ends the ranks at once when the user insists.

A rank also ends, at once, when the process that launched it ends, however it ends (a `kill -9`, the OOM
killer): ranks left behind would go on training into a folder nobody watches.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAUNCHER_GONE_EXIT = 137  # as if killed: the rank did not choose to end


def stop_exit_code(signum: int) -> int:
    """The exit code of a process that stopped on `signum`, as a shell reports one ended by it."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}.get(signum, signal.Signals(signum).name)


class RunStopped(BaseException):
    """A rank ends on a stop request: after the checkpoint of `step`, or before its first instruction
    (`step` None). Not an `Exception`, as KeyboardInterrupt is not: code that wraps a user's errors (a task,
    a reward function) lets it through."""

    def __init__(self, signum: int, step: int | None) -> None:
        where = "before its first step" if step is None else f"after step {step}"
        super().__init__(f"stopped {where} on {signal_name(signum)}")
        self.signum = signum
        self.step = step


class StopRequests:
    """This rank's stop requests. While the rank starts (`running` False) a request ends it at once;
    afterwards it is only noted, and the trainer group agrees on it at the next step boundary."""

    def __init__(self) -> None:
        self.signum = 0
        self.running = False

    def install(self) -> None:
        """Take SIGINT and SIGTERM from now on (call on the main thread)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum:
            return  # one request is enough; ending at once is the launcher's decision
        self.signum = signum
        if not self.running:
            raise RunStopped(signum, None)

    def start_running(self) -> None:
        """The rank is about to run its first instruction: from now on a request waits for a step's end.
        A request that came while it started ends it now."""
        if self.signum:
            raise RunStopped(self.signum, None)
        self.running = True

    def agree(self, group: Any, device: torch.device) -> int:
        """The stop the ranks of `group` agree on at this point of their programs (the largest signal any
        of them received, 0 for none); a collective over `group`, or this rank's own request without one."""
        if group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        agreed = int(flag.item())
        self.signum = self.signum or agreed
        return agreed


def end_with(pid: int) -> None:
    """End this process at once when process `pid` ends (watched from a daemon thread)."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone
            os._exit(LAUNCHER_GONE_EXIT)
        except (AttributeError, OSError):  # no pidfd on this platform or kernel: look every second
            while _alive(pid):
                time.sleep(1.0)
            os._exit(LAUNCHER_GONE_EXIT)
        select.select([fd], [], [])  # readable once the process has ended
        os._exit(LAUNCHER_GONE_EXIT)

    threading.Thread(target=watch, name=f"end-with-{pid}", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["LAUNCHER_GONE_EXIT", "RunStopped", "STOP_SIGNALS", "StopRequests", "end_with", "signal_name",
           "stop_exit_code"]

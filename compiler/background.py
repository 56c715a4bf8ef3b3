"""Work the compiler hands to a second core while it goes on: a result that is ready `now`, or computed in a
forked child (`forked`) and read when first asked for (`Later.get`).

The compiler is single-threaded Python; on a large cluster its DDMA plan (one weight sync's buckets
coloured into rounds) takes about as long as everything that follows it and does not need it (the schedule,
folding the programs, the baseline's estimate). Forking lets those run side by side on a machine with
two cores or more. The child computes one pure function of its arguments, sends the pickled result (or
the exception it raised) back through a pipe and exits without running any of the parent's exit
handlers; a child that dies without a result (killed, out of memory) costs the work again in the parent,
never a wrong answer. Where fork is missing or one core is all there is, the work runs at once.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_UNSET = object()


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS): count the cores
        return os.cpu_count() or 1


def spare_core() -> bool:
    """Whether a forked child would run beside this process rather than take turns with it."""
    return hasattr(os, "fork") and usable_cores() > 1


class Later(Generic[T]):
    """A value, computed now or by a forked child; `get` returns it (waiting for the child the first time)."""

    def __init__(self, compute: Callable[[], T], *, pid: int | None = None, fd: int | None = None) -> None:
        self._compute = compute  # how to get the value here: the work itself, or the rest of a chain
        self._pid, self._fd = pid, fd
        self._value: object = _UNSET

    @classmethod
    def now(cls, value: T) -> Later[T]:
        done: Later[T] = cls(lambda: value)
        done._value = value
        return done

    @classmethod
    def forked(cls, fn: Callable[..., T], *args: object) -> Later[T]:
        """`fn(*args)` in a forked child where a spare core runs it beside this process; here otherwise."""
        if not spare_core():
            return cls.now(fn(*args))
        read, write = os.pipe()
        with warnings.catch_warnings():  # the child only computes and writes to its pipe: no lock it needs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: compute, send, leave without the parent's exit handlers or buffers
            code = 0
            try:
                os.close(read)
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it with its parent's group
                try:
                    payload = pickle.dumps((True, fn(*args)), protocol=pickle.HIGHEST_PROTOCOL)
                except BaseException as exc:  # noqa: BLE001 - the parent raises it
                    payload = pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(write, "wb") as out:
                    out.write(payload)
            except BaseException:  # noqa: BLE001 - nothing sent: the parent computes it itself
                code = 1
            finally:
                os._exit(code)
        os.close(write)
        return cls(lambda: fn(*args), pid=pid, fd=read)

    def then(self, fn: Callable[[T], U]) -> Later[U]:
        """A value made from this one by `fn` when it is asked for."""
        return Later(lambda: fn(self.get()))

    @property
    def pending(self) -> bool:
        """Whether a child is still to be read (the value is not here yet)."""
        return self._fd is not None

    def get(self) -> T:
        if self._value is _UNSET:
            self._value = self._receive() if self._fd is not None else self._compute()
        return self._value  # type: ignore[return-value]

    def _receive(self) -> T:
        assert self._fd is not None and self._pid is not None
        fd, self._fd = self._fd, None
        with os.fdopen(fd, "rb") as pipe:
            payload = pipe.read()
        os.waitpid(self._pid, 0)
        if not payload:  # the child died before sending: do the work here
            return self._compute()
        ok, result = pickle.loads(payload)
        if not ok:
            raise result
        return result

    def __del__(self) -> None:  # a value never asked for: do not leave the child blocked on its pipe
        if getattr(self, "_fd", None) is not None and sys is not None:
            try:
                os.close(self._fd)  # type: ignore[arg-type]
                os.kill(self._pid, signal.SIGKILL)  # type: ignore[arg-type]
                os.waitpid(self._pid, 0)  # type: ignore[arg-type]
            except OSError:
                pass


__all__ = ["Later", "spare_core", "usable_cores"]

"""The Python environment: the model runs code it writes in a fenced ```python block and reads the output.

Each block runs in a separate interpreter process, never in the run's own: in a fresh scratch directory that is
removed afterwards, with an environment holding nothing but a minimal PATH (no credentials of the run reach
it), under resource limits (address space, CPU time, file size, no new processes where the OS enforces it) and
a wall-clock timeout that kills the process's whole group. This bounds what a model's code can cost; it is not
a security boundary against code written to escape (that needs a container).
"""

from __future__ import annotations

import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from graphrl.envs.tools import ToolTask

FILE_LIMIT_BYTES = 1 << 20
"""Largest file the code may write, its captured output included (writing more fails with EFBIG)."""
OPEN_FILES_LIMIT = 64
"""Most file descriptors the code may hold open."""
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
"""The only environment variable the code sees."""

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

DEFAULT_INSTRUCTIONS = ("To run Python, write a fenced block:\n```python\nprint(12*7+3)\n```\nand wait for its "
                        "output; print what you need to see (only the standard library is available). When you are "
                        "done, give the final answer as a number, without a code block.")


@dataclass(frozen=True)
class CodeRun:
    """How one block ran: whether it exited with status 0, and what the model is told."""

    ok: bool
    observation: str


def run_python(code: str, *, timeout_s: float, memory_mb: int, max_output_chars: int,
               site_packages: bool = False) -> CodeRun:
    """Run `code` in a separate, limited interpreter process (the module docstring says how it is confined)."""
    argv = [sys.executable, "-I", "-u", "-X", "utf8"]  # isolated (no PYTHON* variables, no user site), unbuffered
    if not site_packages:
        argv.append("-S")  # the standard library only: faster to start, and nothing of the run's own packages
    with tempfile.TemporaryDirectory(prefix="graphrl-python-", ignore_cleanup_errors=True) as root:
        scratch = os.path.join(root, "scratch")
        os.mkdir(scratch)
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as script:
            script.write(code)
        # Output goes to a file, not a pipe, so the file-size limit bounds how much a print loop can produce.
        with open(os.path.join(root, "output"), "w+b") as output:
            process = subprocess.Popen(
                [*argv, "main.py"], cwd=scratch, env={"PATH": CHILD_PATH}, stdin=subprocess.DEVNULL,
                stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_limits(memory_mb << 20, math.ceil(timeout_s) + 1))  # noqa: PLW1509 (see _limits)
            timed_out = False
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The whole group: whatever the code started must not outlive its call.
                _kill_group(process.pid)
                process.wait()
            output.seek(0)
            text = output.read(FILE_LIMIT_BYTES).decode("utf-8", errors="replace")
    # Tracebacks name `main.py`, not the scratch directory's random path.
    text = _clipped(text.replace(scratch + os.sep, ""), max_output_chars)
    if timed_out:
        failure = f"timed out after {timeout_s:g} s"
    elif process.returncode < 0:
        failure = f"killed by {_signal_name(-process.returncode)}"
    elif process.returncode > 0:
        failure = f"exit status {process.returncode}"
    else:
        return CodeRun(True, "Output:\n" + (text or "(no output)"))
    return CodeRun(False, f"error: {failure}" + (f"\n{text}" if text else ""))


def _limits(memory_bytes: int, cpu_s: int) -> Callable[[], None]:
    """What the child runs between fork and exec: only setrlimit calls on values computed beforehand, since
    the run may have other threads at the fork."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT, OPEN_FILES_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # No new processes or threads; Linux does not enforce this for root.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _signal_name(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    reason = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)", "SIGKILL": " (memory or time limit)"}
    return name + reason.get(name, "")


def _clipped(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars`, keeping its start and its end (where a traceback's error is)."""
    text = text.rstrip()
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - max_chars} characters cut] ...\n{text[len(text) - tail:]}"


class PythonTool(ToolTask):
    """Problems solved with a Python interpreter: ```python blocks run, then a numeric answer.

    Each block is one step with reward 0 and the observation `Output:` and what the code printed, or `error: ...`
    (a non-zero exit, a signal, a timeout) followed by what it printed; only the first block of a turn runs. A
    turn without a block ends the episode with reward 1 if its final number equals the row's answer, else 0. A
    block past `max_calls` is refused with an error telling the model to answer. `site_packages` lets the code
    import the run's installed packages (large ones may need a larger `memory_mb`, and when the run is not root,
    a package that starts threads fails: the code may start no processes or threads).
    """

    calls_left_name = "Python runs"
    seconds_per_call = 0.02  # a fresh interpreter without site: about 20 ms
    observation_tokens = 40

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 600, max_calls: int = 4,
                 instructions: str | None = None, site_packages: bool = False) -> None:
        if not timeout_s > 0:
            raise ValueError(f"python option timeout_s={timeout_s!r} must be positive")
        for name, value, least in (("memory_mb", memory_mb, 32), ("max_output_chars", max_output_chars, 1),
                                   ("max_calls", max_calls, 0)):
            if value < least:
                raise ValueError(f"python option {name}={value!r} is below its least value {least}")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        super().__init__(int(max_calls))
        self.site_packages = bool(site_packages)
        self.instructions = DEFAULT_INSTRUCTIONS if instructions is None else instructions

    def reset(self, row: dict) -> str:
        self._answer = row.get("answer")
        return f"{row['prompt']}\n\n{self.instructions}"

    def find_call(self, text: str) -> str | None:
        block = _BLOCK.search(text)
        return None if block is None else block.group(1)

    def run(self, call: str) -> tuple[str, bool, float]:
        outcome = run_python(call, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                             max_output_chars=self.max_output_chars, site_packages=self.site_packages)
        return outcome.observation, outcome.ok, 0.0


__all__ = ["PythonTool", "CodeRun", "run_python"]

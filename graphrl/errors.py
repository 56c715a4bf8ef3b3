"""User-facing errors.

Every mistake a user can make (a bad job file, an impossible pin, a plan that does not fit) raises one
`GraphRLError`. It carries where the mistake is (file, line, column and the field path inside the job)
and how to fix it, so the CLI can print it on one or two lines and exit with code 2. Our own invariant
violations are plain assertions or `InternalError`, never this type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

FieldPath = tuple[str | int, ...]


def format_path(path: Sequence[str | int]) -> str:
    """Render a field path as `nodes.update.inputs.rewards` (list indices as `[3]`)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass(frozen=True)
class Location:
    """A place in a source file; line and column are 1-based."""

    file: str | None = None
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        parts = [self.file or "<job>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.column is not None:
                parts.append(str(self.column))
        return ":".join(parts)


FIX_LINE = "  fix: "  # how `render` begins the line of the remedy (the launcher reads it back from a rank's error)


class GraphRLError(Exception):
    """A user's mistake: the message, where it is, and how to fix it."""

    kind = "error"

    def __init__(
        self,
        message: str,
        *,
        path: Sequence[str | int] = (),
        fix: str | None = None,
        location: Location | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path: FieldPath = tuple(path)
        self.fix = fix
        self.location = location

    def located(self, location: Location) -> "GraphRLError":
        """Return this error with its source location filled in (if it had none)."""
        if self.location is None or self.location.line is None:
            self.location = location
        return self

    def render(self) -> str:
        """One or two lines: `place: message` and, where known, `fix: ...`."""
        place = []
        if self.location is not None:
            place.append(str(self.location))
        if self.path:
            place.append(format_path(self.path))
        head = ": ".join(place + [self.message]) if place else self.message
        return head if not self.fix else f"{head}\n{FIX_LINE}{self.fix}"

    def __str__(self) -> str:
        return self.render()


class JobError(GraphRLError):
    """The job file or Python job is malformed or inconsistent."""


class ClusterError(GraphRLError):
    """The cluster description is malformed."""


class PlacementError(GraphRLError):
    """No placement satisfies the job's pins and the devices' memory."""


class VerifyError(GraphRLError):
    """A compiled program breaks a rule (unmatched send, memory overflow, stale weights)."""


class PlanFileError(GraphRLError):
    """A plan file cannot be read (wrong format, wrong version, corrupted)."""


class RunError(GraphRLError):
    """A run failed on some rank."""


class OutputError(GraphRLError):
    """A folder graphrl would write into cannot be written, or holds what graphrl did not write there."""


class DataError(GraphRLError):
    """A file the job reads (dataset, checkpoint) is unreadable, damaged or not what it claims to be."""


class Interrupted(GraphRLError):
    """The user (Ctrl-C) or the system (SIGTERM) ended a command before it finished; nothing is wrong with
    the input. Exits with 128 + the signal's number, as a shell reports a process ended by that signal."""

    kind = "stopped"

    def __init__(self, message: str, *, signum: int, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.signum = signum
        self.exit_code = 128 + signum


class InternalError(Exception):
    """A bug in graphrl: an invariant of ours was broken. Not the user's fault."""


class GraphRLWarning(UserWarning):
    """Something graphrl ignored and went on without (a setting that does not apply, a file it cannot
    trust). The CLI prints each one once on stderr as `warning: message`."""


class CalibrationWarning(GraphRLWarning):
    """A calibration file was ignored (unreadable, of another format version or from another machine);
    the hardware preset's defaults are used instead."""

"""A one-line progress display for long work (placement search, scheduling, simulation).

On a terminal it is a transient rich status line on stderr that names the stage and its elapsed time,
and disappears when the work ends; when stderr is piped or redirected nothing is written, so JSON and
plan output stay clean and logs carry no control characters.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

Report = Callable[[str], None]


def _silent(message: str) -> None:
    return None


@contextmanager
def progress(title: str, *, enabled: bool | None = None) -> Iterator[Report]:
    """Yield `report(stage)`; each call replaces the line's stage. `enabled` defaults to stderr being a
    terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield _silent
        return
    import time

    from rich.console import Console

    console = Console(stderr=True)
    start = time.perf_counter()
    with console.status(title) as status:
        def report(stage: str) -> None:
            status.update(f"{title}: {stage} ({time.perf_counter() - start:.1f} s)")

        yield report

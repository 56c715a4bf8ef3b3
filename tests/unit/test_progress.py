"""The progress line: silent when stderr is not a terminal, and the compiler reports each pass to it."""

from __future__ import annotations

import io
from contextlib import redirect_stderr

from graphrl.compiler.compile import compile_graph
from graphrl.compiler.pipeline import PIPELINE
from graphrl.loader import job_cluster, load_job
from graphrl.progress import progress


def test_nothing_is_written_when_stderr_is_not_a_terminal() -> None:
    err = io.StringIO()
    with redirect_stderr(err), progress("compiling") as report:
        report("placement")
    assert err.getvalue() == ""


def test_the_compiler_reports_every_pass_in_order() -> None:
    job = load_job("examples/grpo_tiny.yaml")
    stages: list[str] = []
    compile_graph(job, job_cluster(job, None), progress=stages.append)
    assert stages == [p.name for p in PIPELINE]

"""Profiled runs: torch.profiler traces the TensorBoard plugin reads, and the merged timeline of all ranks."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _trace_names(path: Path) -> set[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return {e.get("name", "") for e in data["traceEvents"]}


def test_profiled_async_run_is_readable_by_the_tensorboard_plugin(tmp_path):
    run_dir, prof = tmp_path / "run", tmp_path / "prof"
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "6", "--out", str(run_dir),
                                    "--profile", str(prof), "-q"])
    assert out.exit_code == 0, out.output
    traces = sorted(prof.glob("*.pt.trace.json*"))
    assert {t.name.split(".")[0] for t in traces} == {"rank0", "rank1"}
    names = set().union(*(_trace_names(t) for t in traces))
    assert any(n.startswith("Generate step=") and " v=" in n for n in names)
    assert any(n.startswith("TrainStep step=") for n in names)

    from torch_tb_profiler.io.cache import Cache
    from torch_tb_profiler.profiler.loader import RunLoader

    with Cache() as cache:
        run = RunLoader("prof", str(prof), cache).load()
    workers = set(run.workers)
    assert {"rank0", "rank1"} <= workers
    for worker in ("rank0", "rank1"):
        span = run.get_spans(worker)[0]
        views = {v.display_name for v in run.get_profile(worker, span).views}
        assert {"Overview", "Operator", "Trace"} <= views

    timeline = json.loads((run_dir / "timeline.json").read_text())
    events = timeline["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and {e["pid"] for e in flows if e["ph"] == "s"} == {0} and {e["pid"] for e in flows if e["ph"] == "f"} == {1}
    assert any(e["name"] == "WeightSync v=1" for e in events if e["ph"] == "X")

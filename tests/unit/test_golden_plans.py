"""Golden plans: the compiled preview of every example is checked in; a change to a plan shows as a diff.

To accept intended changes: `GRAPHRL_UPDATE_GOLDEN=1 pytest tests/unit/test_golden_plans.py`, then review
`git diff tests/golden`. Floats are rounded to 6 significant digits so the files do not churn on
last-bit differences between platforms.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graphrl.compiler.compile import compile_job
from graphrl.loader import job_cluster, load_job

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


def _round(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v) for v in obj]
    return obj


def preview(name: str) -> dict:
    job = load_job(ROOT / "examples" / name)
    data = compile_job(job, job_cluster(job, None), steps=16).preview_dict()  # the window holds a steady state
    data["candidates"] = data["candidates"][:20]  # the head of the ranking is what matters
    return _round(data)


def _missing_checkpoint(name: str) -> str | None:
    """A checkpoint the example names that is made locally (e.g. by examples/arith/make_arith_data.py --model)."""
    import yaml

    models = yaml.safe_load((ROOT / "examples" / name).read_text()).get("models", {})
    for model in models.values():
        checkpoint = model.get("checkpoint")
        if checkpoint and not (ROOT / "examples" / checkpoint).exists():
            return checkpoint
    return None


@pytest.mark.parametrize("name", EXAMPLES)
def test_plan_matches_golden(name):
    if (missing := _missing_checkpoint(name)) is not None:
        pytest.skip(f"{name} needs examples/{missing}; make it with examples/arith/make_arith_data.py --model")
    path = GOLDEN / (Path(name).stem + ".plan.json")
    got = preview(name)
    if os.environ.get("GRAPHRL_UPDATE_GOLDEN") or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        if not os.environ.get("GRAPHRL_UPDATE_GOLDEN"):
            pytest.fail(f"golden file {path.name} was missing and has been written; review and commit it")
    want = json.loads(path.read_text())
    assert got == want, f"plan of {name} changed; rerun with GRAPHRL_UPDATE_GOLDEN=1 and review the diff"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_previews_phases_add_up_to_its_step_time(name):
    """One definition of the step time: the simulator's steady state, and the phases the preview lists
    (the busiest rank's, and its wait) are that simulation's, chosen layout and baseline alike."""
    if _missing_checkpoint(name) is not None:
        pytest.skip(f"{name} needs its locally made checkpoint")
    job = load_job(ROOT / "examples" / name)
    plan = compile_job(job, job_cluster(job, None), steps=4)
    for layout in (plan.chosen, plan.baseline):
        if layout is None:
            continue
        estimate = layout.estimate
        assert estimate.method == "simulated"
        assert sum(estimate.phases.values()) == pytest.approx(estimate.step_time_s, rel=1e-9)
        assert all(seconds >= 0 for seconds in estimate.phases.values())

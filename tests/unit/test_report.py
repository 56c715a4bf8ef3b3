"""The run report (graphrl.report) on synthetic run folders: a hand-written metrics.jsonl, a real compiled
plan and a hand-written timeline.json. No rank processes run."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from graphrl.compiler.preview import human_seconds
from graphrl.errors import PlanFileError, RunError
from graphrl.plan_io import save_plan
from graphrl.schemas.program import INSTRUCTION_TYPES, PHASES, TRAITS, CostKey
from graphrl.report import build_report, error_pct
from graphrl.report.charts import log_ticks, nice_ticks
from graphrl.report.compare import as_measured, simulated_spans
from graphrl.report.records import TimedSpan
from graphrl.report.spans import attribute_steps, busy_fractions, seconds_per_kind, steady_spans

ROOT = Path(__file__).resolve().parents[2]

# Steps 1-3 are the steady state; step 0 is the warm-up and must not enter any average.
STEP_TIMES_S = [3.0, 0.1, 0.2, 0.3]
MEASURED_STEP_S = 0.2
# Measured per step on both ranks in steps 1-3 (microseconds); step 0 takes far longer.
GENERATE_US, TRAIN_US, WARMUP_US = 20_000, 50_000, 1_000_000


@pytest.fixture(scope="module")
def plan():
    from graphrl.compiler.compile import compile_job
    from graphrl.loader import job_cluster, load_job

    loaded = load_job(ROOT / "examples" / "grpo_tiny.yaml")
    return compile_job(loaded, job_cluster(loaded, None), steps=4)


def metrics_rows(step_times=STEP_TIMES_S) -> list[dict]:
    return [{"step": i, "reward_mean": 0.1 + 0.05 * i, "loss": 0.5 - 0.1 * i, "kl": 0.01 * i, "entropy": 2.7,
             "step_time_s": t, "tokens_per_s": 1000.0, "weight_version": i} for i, t in enumerate(step_times)]


def timeline(num_steps: int = 4) -> dict:
    """Rank 0 and rank 1 each run, per step: WeightSync (no step in its label), Generate, TrainStep; rank 1
    then idles as long as it trained (so its busy fraction is lower than rank 0's, which sends)."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
                          for r in (0, 1)]
    t = 0.0
    for step in range(num_steps):
        gen = WARMUP_US if step == 0 else GENERATE_US
        for rank in (0, 1):
            events.append({"ph": "X", "name": f"WeightSync v={step}", "cat": "WeightSync", "pid": rank, "tid": 0,
                           "ts": t, "dur": 1_000})
            events.append({"ph": "X", "name": f"Generate step={step} v={step}", "cat": "Generate", "pid": rank,
                           "tid": 0, "ts": t + 1_000, "dur": gen})
            events.append({"ph": "X", "name": f"TrainStep step={step} v={step + 1}", "cat": "TrainStep", "pid": rank,
                           "tid": 0, "ts": t + 1_000 + gen, "dur": TRAIN_US})
        events.append({"ph": "X", "name": f"Send step={step} peer=1", "cat": "Send", "pid": 0, "tid": 0,
                       "ts": t + 1_000 + gen + TRAIN_US, "dur": TRAIN_US})
        events.append({"ph": "s", "id": step, "name": "rollouts", "cat": "transfer", "pid": 0, "tid": 0, "ts": t})
        t += 1_000 + gen + 2 * TRAIN_US
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def make_run(folder: Path, plan=None, *, rows=None, trace=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = metrics_rows() if rows is None else rows
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if plan is not None:
        save_plan(plan, folder / "plan.msgpack")
    if trace is not None:
        (folder / "timeline.json").write_text(json.dumps(trace))
    return folder


@pytest.fixture(scope="module")
def full_run(plan, tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run") / "full", plan, trace=timeline())


@pytest.fixture(scope="module")
def full_report(full_run):
    return build_report(full_run)


def _table_row(html: str, first_cell: str) -> str:
    """The HTML table row whose first cell is `first_cell`."""
    match = re.search(rf"<tr[^>]*><td[^>]*>{re.escape(first_cell)}</td>(.*?)</tr>", html)
    assert match, f"no table row {first_cell!r}"
    return match.group(1)


# ------------------------------------------------------------------------------------------------
# The page


def test_html_is_self_contained(full_report):
    html = full_report.render_html()
    assert html.startswith("<!doctype html>")
    for external in ("http:", "https:", "<script", "<link", "@import", "url(", "@font-face"):
        assert external not in html, external


def test_html_draws_every_curve_as_a_polyline_with_ticks(full_report):
    html = full_report.render_html()
    polylines = re.findall(r'<polyline [^>]*points="([^"]+)"', html)
    # reward, loss, kl, measured seconds per step, predicted seconds per step (a dashed line)
    assert len(polylines) == 5
    assert [len(p.split()) for p in polylines] == [4, 4, 4, 4, 2]
    for title in ("reward (reward_mean)", "loss", "KL (kl)", "seconds per step"):
        assert f"<h3>{title}" in html
    assert "log scale" in html  # 3 s against 0.1 s: the seconds axis is logarithmic
    assert ">warm-up</text>" in html
    assert html.count('text-anchor="end"') >= 4 * 3  # y tick labels on every chart


def test_predicted_vs_measured_per_step(full_report, plan):
    predicted = plan.chosen.estimate.step_time_s
    rows = full_report.data["step_times"]
    assert [r["warmup"] for r in rows] == [True, False, False, False]
    assert rows[2]["measured_s"] == 0.2 and rows[2]["predicted_s"] == predicted
    assert rows[2]["error_pct"] == pytest.approx(100 * (predicted - 0.2) / 0.2)
    s = full_report.data["summary"]
    assert s["measured_step_time_s"] == pytest.approx(MEASURED_STEP_S)  # warm-up step 0 (3 s) left out
    assert s["step_time_error_pct"] == pytest.approx(100 * (predicted - MEASURED_STEP_S) / MEASURED_STEP_S)

    html = full_report.render_html()
    cells = _table_row(html, "2")
    assert human_seconds(0.2) in cells and human_seconds(predicted) in cells
    assert f"{100 * (predicted - 0.2) / 0.2:+.1f}%" in cells
    assert '<tr class="warm"><td class="num">0 (warm-up)</td>' in html


def test_time_per_kind_measured_from_the_timeline(full_report, plan):
    rows = {r["kind"]: r for r in full_report.data["kinds"]["rows"]}
    # Averaged over steps 1-3 on the ranks that run each kind; the 1 s warm-up Generate is left out.
    assert rows["Generate"]["measured_s"] == pytest.approx(GENERATE_US / 1e6)
    assert rows["TrainStep"]["measured_s"] == pytest.approx(TRAIN_US / 1e6)
    assert rows["Send/Recv"]["measured_s"] == pytest.approx(TRAIN_US / 1e6)  # only rank 0 sends
    assert rows["WeightSync"]["measured_s"] == pytest.approx(0.001)

    kept, steps = steady_spans(simulated_spans(plan), 1)
    expected = seconds_per_kind(kept, len(steps))
    assert rows["Generate"]["predicted_s"] == pytest.approx(expected["Generate"])
    assert rows["TrainStep"]["predicted_s"] == pytest.approx(plan.programs.durations[CostKey("TrainStep", "policy")])
    assert rows["TrainStep"]["error_pct"] == pytest.approx(
        100 * (rows["TrainStep"]["predicted_s"] - 0.05) / 0.05)

    html = full_report.render_html()
    cells = _table_row(html, "Generate")
    assert human_seconds(GENERATE_US / 1e6) in cells and human_seconds(expected["Generate"]) in cells
    assert human_seconds(TRAIN_US / 1e6) in _table_row(html, "TrainStep")
    assert "No measured time per instruction kind" not in html


OTHER_US = 4_000  # a span that is no instruction kind (rank 0, every step)


def _phase(kind: str) -> str:
    """The phase of a report row's kind, from the instruction table (Send/Recv is the report's joint row)."""
    name = "Send" if kind == "Send/Recv" else kind
    return TRAITS[INSTRUCTION_TYPES[name]].phase if name in INSTRUCTION_TYPES else "other"


def test_time_per_phase_is_the_sum_of_its_kinds(plan, tmp_path):
    """Each phase's predicted and measured seconds are the sums of its kinds' rows, listed in PHASES order;
    a span that is no instruction kind counts to "other", and a phase with no kind on either side is left
    out. A kind mapped to the wrong phase, or a side summed from the other side's rows, fails here."""
    trace = timeline()
    for step in range(4):
        trace["traceEvents"].append({"ph": "X", "name": f"EnvReset step={step}", "cat": "EnvReset", "pid": 0,
                                     "tid": 1, "ts": step * 1e6 + 500, "dur": OTHER_US})
    report = build_report(make_run(tmp_path / "run", plan, trace=trace))
    kind_rows = report.data["kinds"]["rows"]
    phases = report.data["phases"]["rows"]

    expected: dict[str, dict[str, float | None]] = {}
    for row in kind_rows:
        sums = expected.setdefault(_phase(row["kind"]), {"predicted_s": None, "measured_s": None})
        for side in ("predicted_s", "measured_s"):
            if row[side] is not None:
                sums[side] = (sums[side] or 0.0) + row[side]
    assert [r["phase"] for r in phases] == [p for p in PHASES if p in expected]
    for row in phases:
        for side in ("predicted_s", "measured_s"):
            assert row[side] == pytest.approx(expected[row["phase"]][side]), (row["phase"], side)
        assert row["error_pct"] == pytest.approx(error_pct(row["predicted_s"], row["measured_s"]))
    by_phase = {r["phase"]: r for r in phases}
    assert by_phase["transfer"]["kinds"] == ["Send/Recv"]
    assert by_phase["transfer"]["measured_s"] == pytest.approx(TRAIN_US / 1e6)
    assert by_phase["other"] == {"phase": "other", "predicted_s": None, "measured_s": pytest.approx(OTHER_US / 1e6),
                                 "error_pct": None, "kinds": ["EnvReset"]}
    assert by_phase["generate"]["measured_s"] == pytest.approx(GENERATE_US / 1e6)
    assert by_phase["train"]["measured_s"] == pytest.approx(TRAIN_US / 1e6)
    assert "logprob" not in by_phase  # grpo_tiny computes no separate log-probs

    json.dumps(report.data)  # the JSON form carries the table as it is
    html = report.render_html()
    assert "<h2>Time per phase</h2>" in html
    cells = _table_row(html, "generate")
    assert human_seconds(GENERATE_US / 1e6) in cells
    assert human_seconds(by_phase["generate"]["predicted_s"]) in cells
    text = report.render_text(width=120)
    assert re.search(r"phase\s+predicted\s+measured\s+error\s+kinds", text)
    assert re.search(r"transfer\s+-\s+50\.00 ms\s+-\s+Send/Recv", text)  # colocated: the plan sends nothing
    assert re.search(r"other\s+-\s+4\.00 ms\s+-\s+EnvReset", text)


def test_busy_fraction_is_measured_when_the_timeline_exists(full_report):
    busy = full_report.data["busy"]
    assert busy["source"] == "measured"
    rank0, rank1 = busy["ranks"]
    assert rank0["measured"] == pytest.approx(1.0)  # sends while rank 1 idles
    assert rank1["measured"] == pytest.approx((1_000 + GENERATE_US + TRAIN_US) / (1_000 + GENERATE_US + 2 * TRAIN_US))
    assert rank0["simulated"] is not None and rank0["mesh"] == "all"
    html = full_report.render_html()
    assert "Measured from timeline.json" in html and "rank 1" in html


def test_without_a_timeline_the_page_says_so_and_busy_is_simulated(plan, tmp_path):
    report = build_report(make_run(tmp_path / "run", plan))
    assert report.data["busy"]["source"] == "simulated"
    assert all(r["measured_s"] is None and r["predicted_s"] is not None for r in report.data["kinds"]["rows"])
    html = report.render_html()
    assert "No measured time per instruction kind: the run folder has no timeline.json" in html
    assert "<b>Simulated</b>" in html
    text = report.render_text(width=120)
    assert "no measured time per instruction kind" in text
    assert "busy fraction per rank (simulated: no timeline.json)" in text


def test_metrics_only_folder_still_reports_the_curves(tmp_path):
    report = build_report(make_run(tmp_path / "run"))
    assert report.data["job"] is None and report.data["busy"]["source"] is None
    assert report.data["summary"]["predicted_step_time_s"] is None
    html = report.render_html()
    assert len(re.findall(r"<polyline ", html)) == 4
    assert "no plan.msgpack" in html


def test_text_form_has_the_tables(full_report):
    text = full_report.render_text(width=120)
    for header in ("summary", "seconds per step", "time per instruction kind", "busy fraction per rank"):
        assert header in text
    assert re.search(r"kind\s+predicted\s+measured\s+error", text)
    assert re.search(r"step\s+measured\s+predicted\s+error", text)
    assert re.search(r"rank\s+mesh\s+measured\s+simulated", text)
    assert re.search(r"Generate\s+\S+ \S+\s+20\.00 ms", text)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "\x1b[" not in text  # no colour codes


def test_long_runs_show_first_and_last_steps(tmp_path):
    report = build_report(make_run(tmp_path / "run", rows=metrics_rows([1.0] + [0.1] * 199)))
    html = report.render_html()
    assert "160 steps not shown" in html
    polyline = re.findall(r'<polyline [^>]*points="([^"]+)"', html)[0]
    assert len(polyline.split()) == 200
    assert re.search(r"\.\.\.\s+160 steps", report.render_text())


def test_a_repeated_step_keeps_its_last_row(tmp_path):
    rows = metrics_rows()
    rows.insert(3, {**rows[2], "reward_mean": -1.0})  # a resumed run wrote step 2 again
    report = build_report(make_run(tmp_path / "run", rows=rows))
    assert [r["step"] for r in report.data["metrics"]] == [0, 1, 2, 3]
    assert report.data["metrics"][2]["reward_mean"] == -1.0
    assert any("steps 2 appear more than once" in n for n in report.data["notes"])


# ------------------------------------------------------------------------------------------------
# Bad input


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


GOOD_LINE = json.dumps(metrics_rows()[0])


@pytest.mark.parametrize(
    "metrics, where, words",
    [
        ("", "metrics.jsonl", "is empty"),
        ("\n\n", "metrics.jsonl", "is empty"),
        (f"{GOOD_LINE}\n{GOOD_LINE}\n{{\"step\": 2, \"loss\": 0.\n", "metrics.jsonl:3", "not JSON"),
        (f"{GOOD_LINE}\n[1, 2]\n", "metrics.jsonl:2", "JSON object"),
        (f"{GOOD_LINE}\n{{\"loss\": 1.0}}\n", "metrics.jsonl:2", "\"step\""),
        ("{\"step\": 0, \"reward_mean\": \"high\"}\n", "metrics.jsonl:1", "reward_mean must be a number"),
    ],
)
def test_bad_metrics_name_the_file_and_line(tmp_path, metrics, where, words):
    folder = _write(tmp_path / "run", "metrics.jsonl", metrics)
    with pytest.raises(RunError) as err:
        build_report(folder)
    message = str(err.value)
    assert str(folder / where) in message and words in message
    assert "fix:" in message


def test_missing_folder_and_missing_metrics(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        build_report(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError) as err:
        build_report(tmp_path / "empty")
    assert "no metrics.jsonl" in str(err.value) and str(tmp_path / "empty" / "metrics.jsonl") in str(err.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"traceEvents": [', "timeline.json:1:"),
        ('{"events": []}', "not a Chrome trace"),
        ('{"traceEvents": [{"ph": "X", "name": "Generate step=0", "pid": 0, "ts": 0}]}', "traceEvents[0].dur"),
        ('{"traceEvents": [{"ph": "M"}, {"ph": "X", "pid": "zero", "ts": 0, "dur": 1}]}', "traceEvents[1].pid"),
    ],
)
def test_bad_timeline_names_the_file(tmp_path, text, words):
    folder = make_run(tmp_path / "run")
    (folder / "timeline.json").write_text(text)
    with pytest.raises(RunError) as err:
        build_report(folder)
    assert str(folder / "timeline.json") in str(err.value) and words in str(err.value)


def test_corrupted_plan_names_the_file(tmp_path):
    folder = make_run(tmp_path / "run")
    (folder / "plan.msgpack").write_bytes(b"\x00not a plan")
    with pytest.raises(PlanFileError) as err:
        build_report(folder)
    assert str(folder / "plan.msgpack") in str(err.value)


# ------------------------------------------------------------------------------------------------
# The pieces


def test_spans_without_a_step_take_their_version_or_their_neighbour_step():
    spans = [TimedSpan(0, "ReleaseWeights", "ReleaseWeights", 0.0, 0.1),
             TimedSpan(0, "Generate step=4 v=3", "Generate", 0.1, 0.1),
             TimedSpan(0, "ReleaseWeights", "ReleaseWeights", 0.2, 0.1),
             TimedSpan(0, "WeightSync v=5", "WeightSync", 0.3, 0.1),
             TimedSpan(1, "Offload", "Offload", 0.0, 0.1)]
    assert attribute_steps(spans) == [4, 4, 4, 5, None]


def test_busy_fraction_counts_overlapping_spans_once():
    spans = [TimedSpan(0, "a", "A", 0.0, 2.0), TimedSpan(0, "b", "B", 1.0, 2.0), TimedSpan(1, "c", "C", 0.0, 1.0),
             TimedSpan(1, "d", "D", 3.0, 1.0)]
    assert busy_fractions(spans, 3) == [pytest.approx(0.75), pytest.approx(0.5), 0.0]


@pytest.mark.parametrize("lo, hi", [(0.06, 0.11), (-0.05, -0.01), (0.0, 7.0), (-1.0, 1.0), (3e-6, 4e-6)])
def test_nice_ticks_cover_the_range_with_round_steps(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo + 1e-12 and ticks[-1] >= hi - 1e-12
    assert 3 <= len(ticks) <= 12
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1


def test_log_ticks_cover_the_range():
    ticks = log_ticks(0.015, 4.7)
    assert ticks[0] <= 0.015 and ticks[-1] >= 4.7
    assert 0.1 in ticks and 1.0 in ticks


# ------------------------------------------------------------------------------------------------
# A real browser

_spec = importlib.util.spec_from_file_location("screenshot", ROOT / "scripts" / "screenshot.py")
screenshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screenshot)  # type: ignore[union-attr]


@pytest.mark.skipif(screenshot.find_chromium() is None, reason="Chromium is not installed")
def test_report_page_renders_in_chromium(full_report, tmp_path):
    html = tmp_path / "report.html"
    html.write_text(full_report.render_html())
    png = tmp_path / "report.png"
    screenshot.screenshot(html, png, 1200, 2400)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 40_000  # a blank page compresses to a few KB; this one has four charts and tables


def test_simulated_spans_include_the_wait_for_peers_as_a_rank_measures_it() -> None:
    """The simulator starts a receive (or a collective) when its peers are there; a rank times it from
    when it reaches it. `as_measured` moves each span's start back to the end of the rank's previous span,
    so a trainer's receive holds its wait for the generator, as in timeline.json."""
    spans = [TimedSpan(0, "Generate step=0", "Generate", 0.0, 1.0),
             TimedSpan(1, "TrainStep step=0", "TrainStep", 0.0, 0.5),
             TimedSpan(1, "Recv step=1", "Recv", 1.5, 0.25),  # rank 1 idles from 0.5 until its peer sends
             TimedSpan(1, "TrainStep step=1", "TrainStep", 1.75, 0.5)]
    out = {(s.rank, s.name): s for s in as_measured(spans)}
    assert out[(1, "Recv step=1")].start_s == 0.5 and out[(1, "Recv step=1")].end_s == 1.75
    assert out[(1, "TrainStep step=1")] == spans[3] and out[(0, "Generate step=0")] == spans[0]
    assert out[(1, "TrainStep step=0")] == spans[1]  # a rank's first span keeps its start

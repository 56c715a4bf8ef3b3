"""`graphrl report` shows the rollouts of samples.jsonl: first and last steps, as text and escaped HTML."""

from __future__ import annotations

import json

from graphrl.report import build_report


def test_report_shows_first_and_last_steps_samples(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": 0.1 * s, "loss": 0.0, "step_time_s": 1.0, "tokens_per_s": 10.0}) + "\n"
        for s in range(6)))
    rows = [{"step": s, "index": 0, "weight_version": s, "reward": float(s % 2), "prompt": f"question {s}",
             "response": f"answer <b>{s}</b>"} for s in range(6)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "pro')
    report = build_report(tmp_path)
    assert [row["step"] for row in report.data["samples"]] == [0, 4, 5]  # the torn last line is skipped
    text = report.render_text(width=160)
    assert "question 5" in text and "answer <b>5</b>" in text and "question 2" not in text
    html = report.render_html()
    assert "answer &lt;b&gt;5&lt;/b&gt;" in html and "<b>5</b>" not in html

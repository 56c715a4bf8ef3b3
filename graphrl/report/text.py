"""The report as plain text for a terminal: the same tables as the HTML page, drawn by rich without
colour codes.
"""

from __future__ import annotations

import io
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from graphrl.report.formatting import (
    MAX_RANK_ROWS,
    fmt_number,
    fmt_pct,
    fmt_seconds,
    shown_rows,
)


def render_text(d: dict[str, Any], width: int = 120) -> str:
    """The report's tables for a terminal (plain text, no colour codes)."""
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(Group(*_text_parts(d)))
    return console.export_text()


def _title(d: dict[str, Any]) -> str:
    if d["job"] is None:
        return f"run {d['run_dir']}"
    return (f"run of {d['job']} on {d['cluster']} ({d['num_ranks']} x {d['hardware']}): {d['label']} [{d['mode']}]"
            f"\nfolder {d['run_dir']}")


def _steady_text(d: dict[str, Any]) -> str:
    s = d["summary"]
    if not d["warmup_steps"]:
        return f"all {s['steps']} steps"
    return f"{s['steady_steps']} steps after {d['warmup_steps']} warm-up step{'s' if d['warmup_steps'] > 1 else ''}"


def _table(title: str, show_header: bool = True) -> Table:
    # Wide enough that a title stays on one line (rich wraps titles to the table's width).
    return Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", show_header=show_header,
                 min_width=len(title) + 2)


def _text_parts(d: dict[str, Any]) -> list[Any]:
    s = d["summary"]
    parts: list[Any] = [Text(_title(d), style="bold")]

    summary = _table("summary", show_header=False)
    summary.add_column("")
    summary.add_column("", justify="right")
    rows = [
        ("steps", f"{s['steps']} (steps {s['first_step']}-{s['last_step']})"),
        ("reward_mean first -> last (best)",
         f"{fmt_number(s['reward_first'])} -> {fmt_number(s['reward_last'])} ({fmt_number(s['reward_best'])})"),
        ("loss, kl at the last step", f"{fmt_number(s['loss_last'])}, {fmt_number(s['kl_last'])}"),
        (f"seconds per step, measured ({_steady_text(d)})", fmt_seconds(s["measured_step_time_s"])),
        ("seconds per step, predicted", fmt_seconds(s["predicted_step_time_s"])),
        ("prediction error", fmt_pct(s["step_time_error_pct"], signed=True)),
        *([("machine speed against its calibration", f"{s['machine_speed']:.2f}x")] if s["machine_speed"] else []),
        ("tokens per second", fmt_number(s["tokens_per_s"])),
        ("wall time of all steps", fmt_seconds(s["wall_s"])),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    parts.append(summary)

    parts.append(Text("\nerror = (predicted - measured) / measured"))
    steps = _table("seconds per step")
    for col in ("step", "measured", "predicted", "error"):
        steps.add_column(col, justify="right")
    head, omitted, tail = shown_rows(d["step_times"])
    for row in head:
        steps.add_row(str(row["step"]) + (" (warm-up)" if row["warmup"] else ""), fmt_seconds(row["measured_s"]),
                      fmt_seconds(row["predicted_s"]), fmt_pct(row["error_pct"], signed=True))
    if omitted:
        steps.add_row("...", f"{omitted} steps", "", "")
        for row in tail:
            steps.add_row(str(row["step"]), fmt_seconds(row["measured_s"]), fmt_seconds(row["predicted_s"]),
                          fmt_pct(row["error_pct"], signed=True))
    parts.append(steps)

    kinds = d["kinds"]
    if kinds["rows"]:
        parts.append(Text(f"\ntime per instruction kind: seconds per step on a rank that runs it, averaged over "
                          f"{_steady_text(d)}" + ("; measured spans include waiting for peers" if kinds["measured"] else "")))
        table = _table("time per instruction kind")
        for col in ("kind", "predicted", "measured", "error"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        for row in kinds["rows"]:
            table.add_row(row["kind"], fmt_seconds(row["predicted_s"]), fmt_seconds(row["measured_s"]),
                          fmt_pct(row["error_pct"], signed=True))
        parts.append(table)
    if d["phases"]["rows"]:
        parts.append(Text("\ntime per phase of a step: the sum of its instruction kinds' rows above"))
        table = _table("time per phase")
        for col in ("phase", "predicted", "measured", "error", "kinds"):
            table.add_column(col, justify="left" if col in ("phase", "kinds") else "right")
        for row in d["phases"]["rows"]:
            table.add_row(row["phase"], fmt_seconds(row["predicted_s"]), fmt_seconds(row["measured_s"]),
                          fmt_pct(row["error_pct"], signed=True), ", ".join(row["kinds"]))
        parts.append(table)

    episodes = d.get("episodes")
    if episodes is not None:
        table = _table(f"episodes (mean per step over {episodes['steps']} steps)", show_header=False)
        table.add_column("")
        table.add_column("", justify="right")
        for f in episodes["figures"]:
            table.add_row(f["means"], fmt_seconds(f["value"]) if "seconds" in f["means"] else fmt_number(f["value"]))
        table.add_row("episodes by how they ended", ", ".join(f"{k} {v}" for k, v in episodes["ends"].items()) or "-")
        parts.append(table)

    busy = d["busy"]
    if busy["source"] is not None:
        per_mesh = len(busy["ranks"]) > MAX_RANK_ROWS
        table = _table(f"busy fraction per {'mesh' if per_mesh else 'rank'}"
                       f"{' (simulated: no timeline.json)' if busy['source'] == 'simulated' else ''}")
        rows = busy["meshes"] if per_mesh else busy["ranks"]
        sources = [k for k in ("measured", "simulated") if any(row[k] is not None for row in rows)]
        for col in (["mesh (ranks)"] if per_mesh else ["rank", "mesh"]) + sources:
            table.add_column(col, justify="left" if col.startswith("mesh") else "right")
        for row in rows:
            first = [f"{row['mesh']} ({row['num_ranks']})"] if per_mesh else [str(row["rank"]), row["mesh"]]
            table.add_row(*first, *(fmt_pct(None if row[k] is None else 100 * row[k]) for k in sources))
        parts.append(table)
    if d.get("samples"):
        table = _table("samples (first and last steps, from samples.jsonl)")
        for col, justify in (("step", "right"), ("version", "right"), ("reward", "right"), ("prompt", "left"),
                             ("response", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        for row in d["samples"]:
            table.add_row(str(row["step"]), str(row.get("weight_version", "-")), fmt_number(row["reward"]),
                          row["prompt_short"], row["response_short"])
        parts.append(table)
    parts += [Text(f"note: {n}") for n in d["notes"]]
    return parts

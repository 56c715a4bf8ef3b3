"""Line charts of the HTML page: every coordinate, tick and label of an SVG chart is computed here, so
the template only draws what it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from graphrl.compiler.preview import human_seconds
from graphrl.report.formatting import fmt_number
from graphrl.report.records import metric_value

CHART_W, CHART_H = 520, 250
PAD_L, PAD_R, PAD_T, PAD_B = 62, 14, 20, 38
MAX_POINTS = 1500  # longer curves are thinned to every k-th point (the last one always kept)


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = []
    t = first
    while t < hi + step * 0.999:
        ticks.append(round(t / step) * step)
        t += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Decades covering [lo, hi], with 2 and 5 between them when the range spans few decades."""
    d0, d1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1, 2, 5) if d1 - d0 <= 2 else (1, 3) if d1 - d0 <= 4 else (1,)
    ticks = [m * 10.0 ** d for d in range(d0, d1) for m in mults] + [10.0 ** d1]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo]
    above = [t for t in ticks if t > hi]
    return ([below[-1]] if below else []) + inside + ([above[0]] if above else [])


def _tick_label(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3g}"


def _seconds_tick(value: float) -> str:
    """Short axis labels: `500 ms`, `2 s`, `20 µs`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return "0" if value == 0 else f"{value * 1e9:.3g} ns"


def line_chart(title: str, series: list[dict[str, Any]], *, tick_format: Callable[[float], str] = _tick_label,
               point_format: Callable[[float], str] = fmt_number, log_y: bool | None = None,
               bands: Iterable[tuple[float, float, str]] = ()) -> dict[str, Any]:
    """An SVG line chart's geometry. Each series: name, color, points [(step, value)], dashed (bool).
    `log_y=None` picks a log axis when all values are positive and span more than 20x."""
    points = [(x, y) for s in series for x, y in s["points"]]
    chart: dict[str, Any] = {"title": title, "width": CHART_W, "height": CHART_H, "left": PAD_L,
                             "right": CHART_W - PAD_R, "top": PAD_T, "bottom": CHART_H - PAD_B,
                             "lines": [], "dots": [], "xticks": [], "yticks": [], "bands": [], "empty": not points,
                             "legend": [{"name": s["name"], "color": s["color"], "dashed": s.get("dashed", False)}
                                        for s in series if s["points"]] if len(series) > 1 else []}
    if not points:
        return chart
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    y_lo, y_hi = min(ys), max(ys)
    if log_y is None:
        log_y = y_lo > 0 and y_hi / y_lo > 20
    if log_y:
        yticks = log_ticks(y_lo, y_hi)
        ty: Callable[[float], float] = math.log10
    else:
        if y_hi == y_lo:
            pad = abs(y_lo) * 0.1 or 1.0
            y_lo, y_hi = y_lo - pad, y_hi + pad
        yticks = nice_ticks(y_lo, y_hi)
        ty = float
    y0, y1 = ty(min(yticks[0], y_lo)), ty(max(yticks[-1], y_hi))
    left, right, top, bottom = chart["left"], chart["right"], chart["top"], chart["bottom"]

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    def py(y: float) -> float:
        return bottom - (ty(y) - y0) / (y1 - y0) * (bottom - top)

    chart["log_y"] = log_y
    chart["yticks"] = [{"y": round(py(t), 1), "label": tick_format(t)} for t in yticks]
    chart["xticks"] = [{"x": round(px(t), 1), "label": _tick_label(t)}
                       for t in nice_ticks(x_lo, x_hi, target=6) if x_lo <= t <= x_hi and float(t).is_integer()]
    for x_from, x_to, label in bands:
        a, b = px(max(x_from, x_lo)), px(min(x_to, x_hi))
        if b > a:
            chart["bands"].append({"x": round(a, 1), "width": round(b - a, 1), "label": label})
    for s in series:
        pts = s["points"]
        if len(pts) > MAX_POINTS:
            stride = math.ceil(len(pts) / MAX_POINTS)
            pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        chart["lines"].append({"name": s["name"], "color": s["color"], "dashed": s.get("dashed", False),
                               "points": coords})
        if len(pts) <= 40 and not s.get("dashed", False):
            chart["dots"] += [{"x": round(px(x), 1), "y": round(py(y), 1), "color": s["color"],
                               "title": f"step {x}: {point_format(y)}"} for x, y in pts]
    return chart


def _curve(metrics: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(row["step"], v) for row in metrics if (v := metric_value(row, key)) is not None]


def charts_of(d: dict[str, Any]) -> list[dict[str, Any]]:
    metrics = d["metrics"]
    warm = [r["step"] for r in d["step_times"] if r["warmup"]]
    bands = [(min(warm) - 0.5, max(warm) + 0.5, "warm-up")] if warm else []
    step_series = [{"name": "measured", "color": "#6b8afd", "points": _curve(metrics, "step_time_s")}]
    predicted = d["summary"]["predicted_step_time_s"]
    if predicted is not None and step_series[0]["points"]:
        steps = [p[0] for p in step_series[0]["points"]]
        step_series.append({"name": "predicted", "color": "#f59e0b", "dashed": True,
                            "points": [(min(steps), predicted), (max(steps), predicted)]})
    return [
        line_chart("reward (reward_mean)", [{"name": "reward", "color": "#10b981", "points": _curve(metrics, "reward_mean")}]),
        line_chart("loss", [{"name": "loss", "color": "#6b8afd", "points": _curve(metrics, "loss")}]),
        line_chart("KL (kl)", [{"name": "kl", "color": "#a78bfa", "points": _curve(metrics, "kl")}]),
        line_chart("seconds per step", step_series, tick_format=_seconds_tick, point_format=human_seconds,
                   bands=bands),
    ]

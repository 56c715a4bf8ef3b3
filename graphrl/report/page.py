"""The report as one self-contained HTML page: the Jinja template `graphrl/templates/report.html.j2` lays out
the figures and charts computed by the other modules (inline styles and SVG, nothing fetched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from graphrl.report.charts import charts_of
from graphrl.report.formatting import (
    MAX_RANK_ROWS,
    fmt_number,
    fmt_pct,
    fmt_seconds,
    shown_rows,
)

# Past this error the page marks a prediction in red.
ERROR_PCT_FLAG = 25.0

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parents[1] / "templates")),
    autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True,
)
_TEMPLATES.filters["seconds"] = fmt_seconds
_TEMPLATES.filters["pct"] = fmt_pct
_TEMPLATES.filters["num"] = fmt_number


def render_html(d: dict[str, Any]) -> str:
    """A self-contained page: inline styles and SVG; no scripts, stylesheets or fonts from elsewhere."""
    head, omitted, tail = shown_rows(d["step_times"])
    return _TEMPLATES.get_template("report.html.j2").render(
        d=d, s=d["summary"], charts=charts_of(d), head=head, omitted=omitted, tail=tail,
        flag=ERROR_PCT_FLAG, max_rank_rows=MAX_RANK_ROWS)

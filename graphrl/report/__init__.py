"""Run report: what a run did against what the compiler predicted, as a terminal summary or one HTML page.

A run folder (`graphrl run --out DIR`) holds `metrics.jsonl` (one row per RL step), `plan.msgpack` (the
compiled plan) and, when the ranks recorded their spans, `timeline.json` (a Chrome trace of measured
instruction spans). The report reads the three, simulates the plan's programs (the same simulator as
`graphrl simulate`), and puts prediction beside measurement:

- curves of reward, loss, KL and seconds per step over the steps;
- seconds per step, predicted (`plan.chosen.estimate.step_time_s`) against measured (metrics), with the error;
- seconds per step spent in each instruction kind, on a rank that runs it: simulated spans against
  measured spans (timeline.json only);
- the same per phase of an RL step (`PHASES`: generate, logprob, ... ; a kind's phase is its
  `TRAITS[...].phase`), each phase the sum of its kinds' rows;
- each rank's busy fraction, measured (timeline.json) and simulated.

The first `warmup_steps` steps (model set-up, allocator and kernel warm-up) are left out of every average
and marked as such; the simulator has no warm-up, so including them would only measure start-up.

`build_report` returns a `Report` whose `data` is JSON-compatible; `render_text` and `render_html` show
the same tables. Every figure is computed in `build`; the views only lay them out.

One module per job, each importing only those before it:
- `records`: reading a run folder's files into rows and spans;
- `spans`: figures from spans, the same for measured and simulated ones;
- `compare`: the plan's simulated spans, and a prediction's error against a measurement;
- `formatting`: numbers, seconds and long tables as both views show them;
- `text`, `charts`, `page`: the terminal view, the HTML page's chart geometry, the HTML page;
- `build`: `build_report` and `Report`.
"""

from graphrl.report.build import Report, build_report
from graphrl.report.compare import error_pct, median_step_time
from graphrl.report.records import MACHINE_SPEED_FILE, read_machine_speed, read_metrics

__all__ = ["MACHINE_SPEED_FILE", "Report", "build_report", "error_pct", "median_step_time", "read_machine_speed",
           "read_metrics"]

"""Launch scripts for clusters (`graphrl launch --emit torchrun|slurm`), from jinja2 templates."""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

from graphrl.plan_io import save_plan
from graphrl.schemas.plan import Plan

TEMPLATES = {"torchrun": "torchrun.sh.j2", "slurm": "slurm.sbatch.j2"}
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


DEFAULT_GRACE_S = 120


def write_launch(plan: Plan, kind: str, out_dir: Path, *, run_dir: Path | None = None, port: int = 29512,
                 grace_s: int = DEFAULT_GRACE_S) -> tuple[Path, Path]:
    """Write the plan and a launch script into `out_dir`; return (plan path, script path). On SIGTERM the
    ranks stop after their step with a checkpoint; `grace_s` is how long torchrun waits for that before it
    kills them, and (SLURM) how long before the time limit the job is sent SIGTERM."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "plan.msgpack"
    save_plan(plan, plan_path)
    script = out_dir / ("launch.sh" if kind == "torchrun" else "launch.sbatch")
    text = _ENV.get_template(TEMPLATES[kind]).render(
        job=plan.job.name, world_size=plan.cluster.num_devices, num_nodes=plan.cluster.num_nodes,
        per_node=plan.cluster.devices_per_node, port=port, plan=plan_path.resolve(),
        out_dir=(run_dir or out_dir / "run").resolve(), python=sys.executable, threads=plan.job.run.threads_per_rank,
        grace_s=grace_s,
    )
    script.write_text(text)
    script.chmod(0o755)
    return plan_path, script

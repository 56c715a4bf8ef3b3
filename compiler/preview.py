"""Human views of a plan: rich tables for the terminal and a self-contained HTML page (inline SVG).

Both show the same figures as `Plan.preview_dict()` (the JSON format): meshes, role placements with
per-device memory against capacity, inserted operations, the predicted step time by phase, and the
colocated-synchronous baseline beside it with the ratio.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from graphrl.schemas.capabilities import plan_refusals
from graphrl.schemas.plan import Layout, Plan, RolePlacement
from graphrl.schemas.program import PHASES

from graphrl.compiler.simulate import WAIT_PHASE

if TYPE_CHECKING:
    import jinja2

GB = 1e9


def human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def _layout_tables(layout: Layout, title: str) -> list[Table]:
    meshes = Table(title=f"{title}: meshes", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("mesh", "devices", "axes"):
        meshes.add_column(col)
    for m in layout.meshes:
        axes = " x ".join(f"{k}={v}" for k, v in m.axis_sizes().items() if v > 1) or "single device"
        meshes.add_row(m.name, f"{m.device_range()} ({m.num_devices})", axes)

    caps = {d.mesh: d.capacity_bytes for d in layout.device_memory}
    roles = Table(title=f"{title}: roles (memory per device)", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("role", "kind", "mesh", "layout", "prec", "params", "grads", "optim", "activ", "kv", "total", "offload"):
        roles.add_column(col, no_wrap=col in ("role", "layout", "offload"), justify="right" if col in ("params", "grads", "optim", "activ", "kv", "total") else "left")
    for p in layout.placements:
        par = " ".join(f"{k}{v}" for k, v in (("dp", p.dp), ("fsdp", p.fsdp), ("tp", p.tp), ("pp", p.pp)) if v > 1) or "-"
        if p.kind == "train":
            par += f" {p.sharding}"
        m = p.memory_bytes
        kind = f"{p.kind} on {p.engine}" if p.kind == "generate" else p.kind  # which engine each generator uses
        params = human_bytes(m.params) + (f" +{human_bytes(m.engine_weights)}" if m.engine_weights else "")
        roles.add_row(p.role, kind, p.mesh, par, p.precision, params, human_bytes(m.grads),
                      human_bytes(m.optimizer), human_bytes(m.activations), human_bytes(m.kv_cache),
                      human_bytes(m.total), ",".join(p.offload) or "-")

    mem = Table(title=f"{title}: device memory at peak", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("mesh", "peak", "capacity", "used", ""):
        mem.add_column(col)
    for d in layout.device_memory:
        frac = d.peak_bytes / caps[d.mesh]
        bar = "█" * int(round(frac * 30)) + "░" * (30 - int(round(frac * 30)))
        mem.add_row(d.mesh, human_bytes(d.peak_bytes), human_bytes(d.capacity_bytes), f"{frac:.0%}",
                    Text(bar, style="red" if frac > 1 else "green"))

    ops = Table(title=f"{title}: inserted operations (per step)", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("op", "from", "to", "bytes", "time", "detail"):
        ops.add_column(col)
    for o in layout.operations:
        ops.add_row(o.kind, o.src, o.dst, human_bytes(o.num_bytes), human_seconds(o.time_s), o.detail)
    engines = [Text(f"{p.role} on {p.engine}: params +{human_bytes(p.memory_bytes.engine_weights)} is the engine's own "
                    "copy of the weights (beside the role's module, which weight syncs fill); " + _engine_phases(p, layout))
               for p in layout.placements if p.memory_bytes.engine_weights]
    return [meshes, roles, *engines, mem, *([ops] if layout.operations else [])]


def _count(n: float) -> str:
    """A parameter count the way model cards say it (30.5B, 135M, 84K)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def expert_placement(plan: Plan) -> list[str]:
    """Where each mixture-of-experts model's experts live in the chosen layout, and what combining their
    outputs costs: the trainer's copy sharded by fsdp, a generator's tp group sharing them out (ep = tp)."""
    from graphrl.compiler.cost.model import active_param_count, expert_combine_bytes, param_count
    from graphrl.ops import ROUTE_BYTES, route_width

    lines = []
    for name, spec in plan.job.models.items():
        try:
            dims = spec.resolved_dims()
        except ValueError:
            continue
        if not dims.is_moe:
            continue
        where = []
        for p in plan.chosen.placements:
            if p.model != name:
                continue
            if p.kind == "generate":
                tokens = 0.0 if plan.workload is None else plan.workload.responses * (
                    plan.workload.prompt_len + plan.workload.mean_response_tokens) / max(1, p.dp)
                where.append(f"{p.role} holds {dims.num_experts // p.tp} per rank (ep = tp = {p.tp})"
                             + (f", combining their shares with one all-reduce of [tokens, {dims.hidden_size}] per "
                                f"layer: {human_bytes(expert_combine_bytes(dims, tokens, p.tp))} per rank per step"
                                if p.tp > 1 else ", all of them on every rank"))
            else:
                where.append(f"{p.role} ({p.kind}) shards them with {p.sharding if p.kind == 'train' else 'fsdp'} "
                             f"over {p.fsdp} ranks" if p.fsdp > 1 else f"{p.role} ({p.kind}) holds all of them")
        line = (f"experts of {name} ({dims.family}): {dims.num_experts} x {dims.num_layers} layers, "
                f"{dims.experts_per_token} per token; {_count(param_count(dims))} parameters, "
                f"{_count(active_param_count(dims))} active per token; " + "; ".join(where))
        gen_model = next((p.model for p in plan.chosen.placements if p.kind == "generate"), None)
        if name == gen_model and plan.workload is not None:
            tokens = plan.workload.responses * (plan.workload.prompt_len + plan.workload.mean_response_tokens)
            use = ("replayed in training with router_replay R3" if plan.job.algorithm.router_replay == "R3"
                   else "compared with the trainer's (router_mismatch)")
            line += (f"; the generator's routes ride with the rollouts: "
                     f"{human_bytes(tokens * route_width(dims) * ROUTE_BYTES)} per step "
                     f"({dims.num_layers} x {dims.experts_per_token} experts per token), {use}")
        lines.append(line)
    return lines


def _engine_phases(p: RolePlacement, layout: Layout) -> str:
    """When a serving engine holds its copy and KV cache, as the plan charges it."""
    if p.sleeps:
        return ("it sleeps between its generations (vLLM's sleep mode, level 2): its copy and KV cache are freed "
                "while the trainer computes, and it reloads the weights from the role's module when it wakes")
    if layout.strategy == "colocated":
        return ("the engine keeps it and its KV cache in every phase, the trainer's included: vLLM's sleep mode "
                "runs on CUDA only")
    return "the engine keeps it and its KV cache on its own devices in every phase"


def _lora_table(plan: Plan) -> Table:
    """A LoRA job beside the same job trained in full, on the chosen layout."""
    lora = plan.lora
    assert lora is not None
    table = Table(title=f"LoRA rank {lora.rank} beside full training, on the chosen layout (per device)",
                  box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("", "lora", "full"):
        table.add_column(col, justify="left" if not col else "right")
    show = {"bytes": human_bytes, "seconds": human_seconds, "params": lambda n: f"{n / 1e6:,.2f} M"}
    for f in lora.figures:
        table.add_row(f.what, show[f.unit](f.lora), show[f.unit](f.full))
    base = f"the reference ({', '.join(lora.base_reference)}) is the base with the adapters off; " \
        if lora.base_reference else ""
    table.caption = (f"{base}trained in full, this layout {'fits' if lora.full_fits else 'does not fit'} "
                     f"({human_bytes(plan.hardware.usable_memory_bytes)} usable per device)")
    table.caption_justify = "left"
    return table


def _phase_table(plan: Plan) -> Table:
    table = Table(title="predicted seconds per step", box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("phase")
    table.add_column("chosen", justify="right")
    if plan.baseline is not None:
        table.add_column("baseline", justify="right")
    table.caption = ("the simulator's steady state: the phases of the busiest rank's step, and its wait "
                     "(for peers, or for the other mesh), add up to the step")
    table.caption_justify = "left"
    names = list(plan.chosen.estimate.phases)
    if plan.baseline is not None:
        names += [k for k in plan.baseline.estimate.phases if k not in names]
    order = {phase: i for i, phase in enumerate((*PHASES, WAIT_PHASE))}
    names.sort(key=lambda name: order.get(name, len(order)))
    for name in names:
        row = [name, human_seconds(plan.chosen.estimate.phases[name]) if name in plan.chosen.estimate.phases else "-"]
        if plan.baseline is not None:
            b = plan.baseline.estimate.phases
            row.append(human_seconds(b[name]) if name in b else "-")
        table.add_row(*row)
    row = ["step" + (" (async: generation overlaps training)" if plan.chosen.estimate.mode == "async" else ""),
           human_seconds(plan.chosen.estimate.step_time_s)]
    if plan.baseline is not None:
        row.append(human_seconds(plan.baseline.estimate.step_time_s))
    table.add_row(*row, style="bold")
    return table


def render_text(plan: Plan, *, explain: bool = False, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), force_terminal=False, color_system=None)
    head = (f"job {plan.job.name} on {plan.cluster.name}: {plan.cluster.num_devices} x {plan.hardware.name} "
            f"({plan.cluster.num_nodes} nodes)\nchosen: {plan.chosen.label}  [{plan.chosen.estimate.mode}]")
    parts: list = [Text(head, style="bold")]
    if plan.workload is not None:
        parts.append(Text(plan.workload.describe()))
    parts += [Text(line) for line in expert_placement(plan)]
    refusals = plan_refusals(plan)
    if refusals:
        parts.append(Text("preview only, `graphrl run` refuses this plan: "
                          + "; ".join(r.message() for r in refusals), style="bold"))
    parts += _layout_tables(plan.chosen, "chosen")
    if plan.lora is not None:
        parts.append(_lora_table(plan))
    parts.append(_phase_table(plan))
    if plan.workload is not None and plan.workload.episodes is not None:
        parts.append(Text(f"of generate, {human_seconds(plan.chosen.estimate.environment_s)} per step is the "
                          "environment: its calls on an episode's critical path (an episode waits for each)"))
    if plan.baseline is not None:
        speedup = plan.baseline.estimate.step_time_s / plan.chosen.estimate.step_time_s
        parts.append(Text(f"baseline (colocated, synchronous, DeepSpeed-Chat-like): {plan.baseline.label}\n"
                          f"predicted speed-up of the chosen plan over the baseline: {speedup:.2f}x", style="bold"))
        if explain:
            parts += _layout_tables(plan.baseline, "baseline")
    parts.append(Text(f"{plan.candidates_considered} candidates considered "
                      f"({plan.chosen.estimate.method} estimate)"))
    if explain:
        parts.append(explain_table(plan))
    console.print(Group(*parts))
    return console.export_text()


def explain_table(plan: Plan) -> Table:
    table = Table(title="candidates (best first, then rejected with the reason)", box=box.SIMPLE, title_justify="left")
    for col in ("#", "candidate", "verdict"):
        table.add_column(col)
    for i, c in enumerate(plan.candidates, 1):
        verdict = human_seconds(c.step_time_s) + "/step" if c.fits and c.step_time_s is not None else f"rejected: {c.reason}"
        table.add_row(str(i), c.label, verdict)
    return table


@functools.cache
def _templates() -> jinja2.Environment:
    """The HTML page's templates; jinja2 is imported by the one view that needs it, not by every
    command that imports this module (the terminal preview, `simulate`)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["seconds"] = human_seconds
    return env


def render_html(plan: Plan) -> str:
    """A self-contained page: no scripts, stylesheets or fonts from elsewhere."""
    data = plan.preview_dict()
    layouts = [("chosen", plan.chosen)] + ([("baseline", plan.baseline)] if plan.baseline else [])
    return _templates().get_template("plan.html.j2").render(plan=plan, data=data, layouts=layouts,
                                                            num_devices=plan.cluster.num_devices)

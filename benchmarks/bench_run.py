"""Measured runs of the tiny example, side by side in one command.

    python benchmarks/bench_run.py [--steps 30]

1. The same job on 2 CPU ranks with the colocated-synchronous plan and with the disaggregated-
   asynchronous plan (AIPO): measured seconds per step of each and the ratio, beside the simulator's
   prediction of both and its error, with the `cpu-local` preset's default figures and with a
   calibration of this machine made by `graphrl calibrate` just before each run (or the hardware file
   given with --calibration), in several rounds. Target: the median calibrated error within 20% for
   both plans.
2. Profiling overhead: the colocated plan profiled (CPU activity, `--profile`) against unprofiled;
   target ratio <= 1.15.
3. Executor overhead: the job compiled for 1 rank and run by graphrl, against a hand-written
   single-process loop doing the same computation (same model, batch, sampling and update); target
   ratio <= 1.05.

Seconds per step are the median over the steps after the first 5 (warm-up), from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The preset's defaults unless a hardware file is named: a calibration left in the home folder by an
# earlier run must not decide which figures this benchmark calls "default".
os.environ["GRAPHRL_CALIBRATION"] = "none"

import torch  # noqa: E402

from graphrl.calibration import calibrate  # noqa: E402
from graphrl.compiler.compile import compile_graph, plan_of  # noqa: E402
from graphrl.compiler.simulate import run_programs  # noqa: E402
from graphrl.executors import algorithms as alg  # noqa: E402
from graphrl.executors.launcher import launch_local  # noqa: E402
from graphrl.executors.models.llama import Llama  # noqa: E402
from graphrl.executors.models.sampling import generate, token_logprobs_and_entropy  # noqa: E402
from graphrl.loader import LoadedJob, job_cluster, load_job  # noqa: E402
from graphrl.schemas.hardware import HardwareSpec  # noqa: E402
from graphrl.schemas.job import JobSpec  # noqa: E402
from graphrl.tasks import EOS, PAD, REWARDS, TASKS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 5


def with_overrides(job: LoadedJob, **updates) -> LoadedJob:  # noqa: ANN003
    data = job.spec.model_dump()
    for dotted, value in updates.items():
        section, key = dotted.split(".")
        data[section][key] = value
    return LoadedJob(JobSpec.model_validate(data), job.source, job.path)


def measured_step_s(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[WARMUP:])


def predict(job: LoadedJob, cluster: str, hw: HardwareSpec | None = None):  # noqa: ANN201
    """(plan, simulated seconds per step) of `job` compiled for `hw` (default: the cluster's own)."""
    spec = job_cluster(job, cluster)
    if hw is not None:
        spec = spec.model_copy(update={"hardware": hw})
    graph = compile_graph(job, spec)
    plan = plan_of(graph, spec)
    placed = graph.placement
    return plan, run_programs(plan.programs, hw=placed.hardware, devices_per_node=placed.devices_per_node, timed=True).step_time_s


def run_plan(job: LoadedJob, cluster: str, out: Path, profile: Path | None = None,
             hw: HardwareSpec | None = None) -> tuple[float, float]:
    """(measured, predicted) seconds per step of `job` compiled for `hw` and run."""
    plan, predicted = predict(job, cluster, hw)
    settings = None
    if profile is not None:
        from graphrl.executors.profiling import ProfileSettings

        settings = ProfileSettings(profile)
    launch_local(plan, out, profile=settings)
    return measured_step_s(out), predicted


def handwritten_loop(job: JobSpec, steps: int) -> float:
    """The same computation as the 1-rank plan, written as one plain loop."""
    torch.set_num_threads(job.run.threads_per_rank)
    data = next(n for n in job.nodes.values() if n.op == "dataset")
    gen_spec = next(n for n in job.nodes.values() if n.op == "generate")
    reward_fn = REWARDS[next(n for n in job.nodes.values() if n.op == "reward").fn]
    task = TASKS[data.task](**data.options)
    torch.manual_seed(job.run.seed)
    model = Llama(job.models["policy"].resolved_dims())
    opt = torch.optim.AdamW(model.parameters(), lr=job.algorithm.lr, betas=job.algorithm.betas)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        prompts, mask = task.sample(torch.Generator().manual_seed(step), data.batch_size, data.prompt_len)
        prompts = prompts.repeat_interleave(gen_spec.samples_per_prompt, 0)
        mask = mask.repeat_interleave(gen_spec.samples_per_prompt, 0)
        model.eval()
        with torch.no_grad():
            out = generate(model, prompts, mask, gen_spec.max_new_tokens, temperature=gen_spec.temperature,
                           top_p=gen_spec.top_p, generator=torch.Generator().manual_seed(1000 + step), eos_id=EOS,
                           pad_id=PAD)
        model.train()
        rewards = reward_fn(prompts, mask, out.response_ids, out.response_mask)
        adv = alg.broadcast_to_tokens(alg.grpo_advantages(rewards, gen_spec.samples_per_prompt), out.response_mask)
        opt.zero_grad(set_to_none=True)
        logprobs, _ = token_logprobs_and_entropy(model, prompts, mask, out.response_ids, out.response_mask)
        loss, _ = alg.policy_loss(logprobs, out.logprobs, adv, out.response_mask, job.algorithm.clip_eps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.algorithm.max_grad_norm)
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calibration", type=Path, help="hardware file to use instead of calibrating now")
    parser.add_argument("--repeats", type=int, default=3, help="calibrate-and-run rounds (medians are reported)")
    args = parser.parse_args()
    given = HardwareSpec.model_validate_json(args.calibration.read_text()) if args.calibration else None
    base = load_job(ROOT / "examples" / "aipo_async_tiny.yaml")
    colocated = with_overrides(base, **{"schedule.mode": "sync", "schedule.steps": args.steps,
                                        "placement.strategy": "colocated", "placement.roles": {}})
    disagg = with_overrides(base, **{"schedule.steps": args.steps})
    plans = (("colocated, synchronous", colocated), ("disaggregated, asynchronous", disagg))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # This machine's speed drifts by tens of percent over minutes, and one run of a plan can differ
        # from the next by as much: each repeat calibrates, then runs both plans right after, and the
        # error reported is the median over repeats of each repeat's own error.
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in plans}
        default_s = {name: predict(job, "local-cpu-2")[1] for name, job in plans}  # machine-independent
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}: calibrating this machine (graphrl calibrate), then both runs",
                  flush=True)
            calibrated = given or calibrate(report=lambda s: None)
            for name, job in plans:
                measured, predicted = run_plan(job, "local-cpu-2", tmp / f"{name.split(',')[0]}{rep}", hw=calibrated)
                rows[name].append((measured, predicted, default_s[name]))
        print(f"\n{'plan (2 CPU ranks), medians':<30} {'measured s/step':>16} {'calibrated':>11} {'error':>7} "
              f"{'preset defaults':>16} {'error':>7}   calibrated error of each repeat")
        errors = {}
        for name, runs in rows.items():
            meas, pred, default = (statistics.median(r[i] for r in runs) for i in range(3))
            errors[name] = statistics.median((p - m) / m for m, p, _ in runs)
            default_error = statistics.median((d - m) / m for m, _, d in runs)
            each = " ".join(f"{100 * (p - m) / m:+.0f}%" for m, p, _ in runs)
            print(f"{name:<30} {meas:16.4f} {pred:11.4f} {100 * errors[name]:+6.0f}% {default:16.4f} "
                  f"{100 * default_error:+6.0f}%   {each}")
        colocated_runs, disagg_runs = rows.values()
        measured_ratio = statistics.median(c[0] / d[0] for c, d in zip(colocated_runs, disagg_runs))
        predicted_ratio = statistics.median(c[1] / d[1] for c, d in zip(colocated_runs, disagg_runs))
        worst = max(abs(e) for e in errors.values())
        print(f"ratio colocated / disaggregated: measured {measured_ratio:.2f}x, predicted {predicted_ratio:.2f}x")
        print(f"largest calibrated error {100 * worst:.0f}% (target <= 20%) {'PASS' if worst <= 0.2 else 'FAIL'}\n")

        c_meas, _ = run_plan(colocated, "local-cpu-2", tmp / "unprofiled", hw=calibrated)
        p_meas, _ = run_plan(colocated, "local-cpu-2", tmp / "profiled", profile=tmp / "prof", hw=calibrated)
        ratio = p_meas / c_meas
        print(f"profiling overhead: {p_meas:.4f} vs {c_meas:.4f} s/step, ratio {ratio:.3f} (target <= 1.15) "
              f"{'PASS' if ratio <= 1.15 else 'FAIL'}\n")

        one_rank = with_overrides(load_job(ROOT / "examples" / "grpo_tiny.yaml"), **{"schedule.steps": args.steps})
        e_meas, _ = run_plan(one_rank, "local-cpu-1", tmp / "one", hw=calibrated)
        hand = handwritten_loop(one_rank.spec, args.steps)
        ratio = e_meas / hand
        print(f"executor overhead, 1 rank: graphrl {e_meas:.4f} s/step, hand-written loop {hand:.4f} s/step, "
              f"ratio {ratio:.3f} (target <= 1.05) {'PASS' if ratio <= 1.05 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

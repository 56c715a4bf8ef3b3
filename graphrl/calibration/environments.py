"""A job's environment timed (`graphrl calibrate JOB`): a few of its episodes run on this machine with its own
model at its initial weights (the checkpoint, or the preset's seeded initialisation), on graphrl's native
sampler, so that every call the environment answers is one a run makes: the model's own text, the
environment's own work (a tool's process, a sandbox's start-up). The preview then charges the mean call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from graphrl.schemas.hardware import EnvironmentTiming

EPISODES = 8
"""Episodes run per job: enough to see each kind of call a few times, few enough to take seconds."""


def measure_environment(path: str | Path, report: Callable[[str], None] = print) -> EnvironmentTiming | None:
    """The environment of the job file at `path`, timed over its first episodes; None for a job without one."""
    from graphrl.compiler.roles import derive_workload
    from graphrl.compiler.typecheck import typecheck
    from graphrl.datasets import prompt_source
    from graphrl.executors.engines import NativeEngine
    from graphrl.executors.episodes import EpisodeRunner, EpisodeSettings, codec_of, episode_rows
    from graphrl.ir import build_graph
    from graphrl.loader import load_job
    from graphrl.ops import EPISODE_COLUMNS, EPISODE_FIELD

    job = load_job(path).spec
    graph = typecheck(build_graph(job), None, "preview")
    gen = next(n.spec for n in graph.nodes() if n.op == "generate")
    data = next(n.spec for n in graph.nodes() if n.op == "dataset")
    if gen.env is None:
        return None
    w = derive_workload(graph)
    source = prompt_source(job, data, gen)
    codec = codec_of(source, data)
    settings = EpisodeSettings(gen.env, gen.max_new_tokens, w.response_len, w.prompt_len, gen.temperature, gen.top_p,
                               tuple(source.stop_ids), source.pad_id, job.run.seed)
    n = min(EPISODES, w.responses)
    report(f"running {n} episodes of {job.name}'s environment {gen.env.cls!r} with its model...")
    ids, mask = source.prompts(0)
    ids, mask = (t.repeat_interleave(gen.samples_per_prompt, 0)[:n] for t in (ids, mask))
    with torch.no_grad():
        piece = EpisodeRunner(settings, codec).run(NativeEngine(_model(job, gen.model)), ids, mask,
                                                   episode_rows(source, codec, 0, 0, n, gen.samples_per_prompt),
                                                   step=0, start=0, version=0)
    record = piece[EPISODE_FIELD]
    column = {name: i for i, name in enumerate(EPISODE_COLUMNS)}
    calls = int((record[:, column["turns"]] + 1).sum())  # each episode's reset and its steps
    seconds = float(record[:, column["env_seconds"]].sum())
    timing = EnvironmentTiming(env=gen.env.cls, options=json.dumps(dict(gen.env.options), sort_keys=True),
                               seconds_per_call=seconds / max(calls, 1), calls=calls, episodes=n)
    report(f"  {timing.seconds_per_call * 1e3:.3g} ms per call over {calls} calls")
    return timing


def _model(job, name: str) -> torch.nn.Module:  # noqa: ANN001
    """The job's model `name` as a run starts it: its checkpoint, or its preset seeded by the run seed."""
    spec = job.models[name]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype]
    if spec.checkpoint is not None:
        from graphrl.models import from_pretrained

        model, _ = from_pretrained(spec.checkpoint, dtype=dtype)
        return model.eval()
    from graphrl.executors.models.llama import Llama

    torch.manual_seed(job.run.seed)
    return Llama(spec.resolved_dims(), dtype=dtype).eval()


__all__ = ["EPISODES", "measure_environment"]

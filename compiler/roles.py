"""Roles and the per-step workload, derived from the typed graph.

A role is one copy of a model's weights used for one purpose: a trained model's training copy (`policy`,
kind `train`), its generation copy (`policy/generate`, kind `generate`), or a frozen model used only for
forward passes (`reference`, kind `infer`). Placement assigns roles, not ops, to devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphrl.compiler.lengths import Lengths, lengths_of
from graphrl.ops import episode_width, route_width
from graphrl.errors import JobError
from graphrl.ir import JobGraph
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import GenerateNode, ScheduleMode
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.job import JobSpec
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.plan import Layout, RoleKind

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Role:
    name: str
    model: str
    kind: RoleKind
    dims: ModelDims
    ops: tuple[str, ...]
    weight_bytes: int  # bytes per parameter of the compute weights (dtype)
    forwards: bool = False  # runs forward-only passes (log-probs, values, a reward model's scores)
    lora: LoraSpec | None = None  # adapters the role holds: a trainer trains them, a generator receives them
    bases: tuple[str, ...] = ()  # frozen models whose forwards this role runs as its base, adapters off


@dataclass(frozen=True)
class EpisodeShape:
    """A generate node's episodes as the cost model charges them: every episode runs `turns` model turns
    (up to `turn_tokens` each, within the episode's room), each answered by an environment call that adds
    `reply_tokens` and takes `call_seconds`; its reset is one call more."""

    turns: int
    turn_tokens: int
    reply_tokens: float
    call_seconds: float
    columns: int  # the `episode` field's width (`ops.episode_width`)
    seconds_source: str = ""  # where `call_seconds` comes from, for the preview

    def turn_plan(self, response_len: int) -> list[tuple[int, int]]:
        """(context tokens after the prompt, model tokens) of each turn an episode of `response_len` tokens
        after its prompt holds."""
        out, used = [], 0.0
        for _ in range(self.turns):
            tokens = min(self.turn_tokens, int(response_len - used))
            if tokens <= 0:
                break
            out.append((int(used), tokens))
            used += tokens + self.reply_tokens
        return out

    def tokens(self, response_len: int) -> tuple[int, float]:
        """(model tokens, environment tokens) of one episode."""
        plan = self.turn_plan(response_len)
        model = sum(t for _, t in plan)
        return model, min(max(len(plan) - 1, 0) * self.reply_tokens, response_len - model)

    def env_seconds(self, response_len: int) -> float:
        """An episode's environment time on its critical path: its reset and one step per turn."""
        return (1 + len(self.turn_plan(response_len))) * self.call_seconds


@dataclass(frozen=True)
class Workload:
    """Sizes of one RL step (global, all ranks together)."""

    prompts: int  # B
    samples_per_prompt: int  # G
    prompt_len: int  # P
    response_len: int  # R
    micro_batch: int  # responses per forward/backward (0 = whole local batch)
    updates_per_step: int  # passes over the batch
    mini_batch: int = 0  # responses per optimizer step (0 = the whole batch)
    pack: bool = False  # log-prob and training passes pack each micro-batch's sequences
    lengths: Lengths | None = None  # response lengths (None: every response response_len long)
    routes: int = 0  # route entries per token a mixture of experts' rollouts carry (`ops.route_width`)
    episode: EpisodeShape | None = None  # a generate node with an environment: its episodes

    @property
    def responses(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens(self) -> int:
        return self.responses * self.seq_len

    @property
    def response_lengths(self) -> Lengths:
        return self.lengths if self.lengths is not None else Lengths.fixed(self.response_len)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per pass over the batch."""
        return self.responses // self.mini_batch if self.mini_batch else 1

    def sent_response_len(self, responses: float) -> int:
        """Response columns a piece of `responses` rollouts crosses a link with: up to its longest response
        (the executors cut the padding after it)."""
        return min(self.response_len, math.ceil(self.response_lengths.longest(responses)))

    def pass_sequence(self, rows_per_micro_batch: float) -> tuple[float, float]:
        """(tokens per response, keys per token) of a log-prob or training pass whose micro-batches hold
        `rows_per_micro_batch` responses: packed, the tokens that exist, each attending within its own
        sequence; padded, every row as wide as its micro-batch's longest response (the executors trim
        the columns no row of the micro-batch uses), attending over the whole row."""
        lengths = self.response_lengths
        if self.pack:
            seq = self.prompt_len + lengths.mean
            square = self.prompt_len ** 2 + 2 * self.prompt_len * lengths.mean + lengths.mean_square
            return seq, square / seq
        seq = self.prompt_len + lengths.longest(rows_per_micro_batch)
        return seq, seq


@dataclass(frozen=True)
class JobShape:
    """What every layout of one job on one cluster shares: the passes after placement read this and
    a layout, never the search's own records."""

    roles: tuple[Role, ...]
    """The job's roles, trained models first."""
    workload: Workload
    """The sizes of one RL step."""
    num_devices: int
    """Devices of the cluster."""
    devices_per_node: int
    """Devices that share one node's fast links."""
    hardware: HardwareSpec
    """The device type every mesh runs on."""

    @property
    def usable_bytes(self) -> float:
        """Memory a device may fill (capacity less the reserve)."""
        return self.hardware.usable_memory_bytes

    @property
    def policy(self) -> Role:
        """The first trained role: the one whose weights the generator samples with."""
        return next(r for r in self.roles if r.kind == "train")

    @property
    def generator(self) -> Role | None:
        """The generation role, when the job generates."""
        return next((r for r in self.roles if r.kind == "generate"), None)

    def policy_meshes(self, layout: Layout) -> tuple[Mesh, Mesh | None]:
        """(the policy trainer's mesh, the generator's mesh or None) of a layout."""
        by_role = {pl.role: pl for pl in layout.placements}
        gen = self.generator
        return layout.role_mesh(by_role[self.policy.name]), (layout.role_mesh(by_role[gen.name]) if gen else None)


def effective_mode(job_mode: str, strategy: str) -> ScheduleMode:
    """The schedule a layout runs: the job's mode when generation has devices of its own; a colocated
    layout is synchronous (its roles take turns on the same devices)."""
    return "async" if job_mode == "async" and strategy == "disaggregated" else "sync"


def generation_role(model: str) -> str:
    return f"{model}/generate"


def lora_bases(job: JobSpec) -> dict[str, str]:
    """Frozen models that run as a LoRA model's base (model -> the LoRA model): initialised from a model that
    trains adapters with `base_reference` on, and the same weights (no adapters or checkpoint of their own,
    the same architecture and dtype), they need no copy of the weights: the LoRA model's trained role runs
    their forwards with its adapters off."""
    trained = {spec.model for spec in job.nodes.values() if spec.op == "train"}
    out = {}
    for model, spec in job.models.items():
        source = job.models.get(spec.init_from) if spec.init_from else None
        if (source is not None and source.lora is not None and source.lora.base_reference and model not in trained
                and spec.init_from in trained and spec.lora is None
                and spec.checkpoint in (None, source.checkpoint) and spec.dtype == source.dtype
                and spec.resolved_dims() == source.resolved_dims()):
            out[model] = spec.init_from
    return out


def derive_roles(graph: JobGraph) -> list[Role]:
    """Roles in a stable order: trained models first (train copy, then generate copy), then frozen ones. A
    LoRA model's base (`lora_bases`) is no role: its forwards are its LoRA model's trained role's."""
    job = graph.job
    trained = {n.spec.model for n in graph.nodes() if n.op == "train"}
    bases = lora_bases(job)
    roles: list[Role] = []
    for model, mspec in job.models.items():
        if model in bases:
            continue
        ops = [n for n in graph.nodes() if n.model == model]
        if not ops:
            continue
        dims = mspec.resolved_dims()
        wbytes = _DTYPE_BYTES[mspec.dtype]
        gen_ops = tuple(n.name for n in ops if n.op == "generate")
        other_ops = tuple(n.name for n in ops if n.op != "generate")
        forwards = any(n.op not in ("generate", "train") for n in ops)
        if model in trained:
            base_of = tuple(m for m, lora_model in bases.items() if lora_model == model)
            base_ops = tuple(n.name for n in graph.nodes() if n.model in base_of)
            roles.append(Role(model, model, "train", dims, other_ops + base_ops, wbytes, forwards or bool(base_ops),
                              lora=mspec.lora, bases=base_of))
            if gen_ops:
                # a generator that receives the adapters holds them; one that receives merged weights is plain
                held = mspec.lora if mspec.lora is not None and not mspec.lora.merged else None
                roles.append(Role(generation_role(model), model, "generate", dims, gen_ops, wbytes, lora=held))
        else:
            if other_ops:
                roles.append(Role(model, model, "infer", dims, other_ops, wbytes, forwards))
            if gen_ops:
                roles.append(Role(generation_role(model), model, "generate", dims, gen_ops, wbytes))
    order = {"train": 0, "generate": 1, "infer": 2}
    return sorted(roles, key=lambda r: (order[r.kind], list(job.models).index(r.model)))


def derive_workload(graph: JobGraph) -> Workload:
    gens = [n for n in graph.nodes() if n.op == "generate"]
    if len(gens) != 1:
        raise JobError(
            f"placement supports exactly one generate node per job, found {len(gens)}",
            path=("nodes",), fix="use one generate node (several samples per prompt via samples_per_prompt)",
        )
    gen = gens[0]
    sizes = graph.node_sizes(gen.name)
    alg = graph.job.algorithm
    return Workload(
        prompts=sizes["B"], samples_per_prompt=gen.spec.samples_per_prompt, prompt_len=sizes["P"],
        response_len=sizes["R"], micro_batch=alg.micro_batch_size, updates_per_step=alg.updates_per_step,
        mini_batch=alg.mini_batch_size, pack=alg.pack_sequences,
        lengths=lengths_of(gen.spec.response_tokens, sizes["R"]),  # typecheck refused what it cannot hold
        routes=route_width(graph.job.models[gen.spec.model].resolved_dims()) if gen.spec.env is None else 0,
        episode=episode_shape(gen.spec, sizes["R"], _measured(gen.spec)),
    )


def _measured(spec: GenerateNode) -> float | None:
    if spec.env is None:
        return None
    from graphrl.compiler.hardware import measured_environment

    return measured_environment(spec.env.cls, dict(spec.env.options))


def episode_shape(spec: GenerateNode, response_len: int, measured_seconds: float | None = None) -> EpisodeShape | None:
    """The episodes of a generate node with an environment, as charged: a call's seconds from the job, else a
    `graphrl calibrate` measurement (`measured_seconds`), else the class's declaration, else none; a reply's
    tokens from the job, else the class's declaration, else an even share of the room the turns leave."""
    env = spec.env
    if env is None:
        return None
    from graphrl.envs import declared, env_class

    try:
        cls: type | None = env_class(env.cls)
    except LookupError:  # typecheck names it; a preview of a plan whose class is gone charges the job's figures
        cls = None
    seconds, source = env.seconds_per_call, "env.seconds_per_call"
    if seconds is None and measured_seconds is not None:
        seconds, source = measured_seconds, "measured by graphrl calibrate"
    if seconds is None and cls is not None and (declared_s := declared(cls, "seconds_per_call")) is not None:
        seconds, source = declared_s, f"declared by {cls.__name__}"
    reply = env.observation_tokens if env.observation_tokens is not None else \
        (declared(cls, "observation_tokens") if cls is not None else None)
    if reply is None:
        reply = max(response_len - env.max_turns * spec.max_new_tokens, 0) / max(env.max_turns - 1, 1)
    return EpisodeShape(env.max_turns, spec.max_new_tokens, float(reply), float(seconds or 0.0),
                        episode_width(env), source if seconds is not None else "not given: none charged")

"""The compiled plan: meshes, role placements, inserted operations, cost estimates (and, once scheduled,
per-rank programs). It is what `graphrl compile -o plan.msgpack` writes and what executors read.

The JSON form (`graphrl compile --plan --format json`) is `Plan.preview_dict()`; its keys are stable and
documented in the README. On disk a plan is msgpack of `model_dump(mode="json")` with a format version;
loading validates through these models and never unpickles.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PlainSerializer, PlainValidator

from graphrl.schemas.base import Frozen
from graphrl.schemas.capabilities import plan_refusals
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import Engine, JobSpec, NodeSpec, Precision, ScheduleMode, Sharding
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.program import Programs, programs_json_schema

# 7: every weight sync the executors run is stored with all its rounds, in tables (`WeightSyncRecord`): a
#    colocated tensor-parallel generator's and a sync of any size; a format-6 plan left ranks to plan those.
# 6: a weight sync into an fp8 generator runs in staging groups (`WeightSyncRecord.staging_layers`), and a
#    serving engine may sleep between its generations (`RolePlacement.sleeps`): a format-5 executor would
#    run either plan outside its memory charge.
# 5: the plan states the step sizes its costs assumed (`workload`: response lengths, mini-batches, packing).
# 4: the plan binds every node and role for the executors (`RunBindings`); WeightSync names its roles.
# 3: meshes are one type (devices and named axes); weight syncs typed records.
# 2: programs are periodic (prologue, one-step body, epilogue per rank); 1 unrolled every step.
PLAN_FORMAT_VERSION = 7

RoleKind = Literal["train", "generate", "infer"]


def _programs(value: Any) -> Programs:
    if isinstance(value, Programs):
        return value
    if isinstance(value, dict):
        return Programs.from_data(value)
    raise ValueError(f"programs must be Programs or their data form, not {type(value).__name__}")


TypedPrograms = Annotated[Programs, PlainValidator(_programs), PlainSerializer(Programs.to_data, when_used="json")]
"""Per-rank programs in a Plan: the `Programs` record in memory, its checked data form in a plan file."""


class MemoryBytes(Frozen):
    """Bytes per device by kind of state."""

    params: float = Field(default=0.0, description="Weights.")
    grads: float = Field(default=0.0, description="Gradients.")
    optimizer: float = Field(default=0.0, description="Optimizer state: AdamW moments, and the fp32 master "
                                                      "weights of a mixed-precision model trained without FSDP2.")
    activations: float = Field(default=0.0, description="Activations kept for backward (or forward working set).")
    kv_cache: float = Field(default=0.0, description="Key/value cache of generation.")
    engine_weights: float = Field(default=0.0, description="A serving engine's own copy of a generator's weights, "
                                                           "beside the role's module (which weight syncs fill and "
                                                           "the engine reloads from).")
    gathered: float = Field(default=0.0, description="Of params and grads: the unsharded copies a sharded role "
                                                     "holds only while it computes (FSDP2's gathered weights and "
                                                     "unreduced gradients); the rest is held between steps.")

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache + self.engine_weights

    @property
    def resting_state(self) -> float:
        """Weights, gradients and optimizer state held between steps: what a run's ledger measures (an
        engine's own copy lives inside the engine, out of the ledger's reach)."""
        return self.params + self.grads + self.optimizer - self.gathered

    def as_dict(self) -> dict[str, float]:
        return {**self.model_dump(), "total": self.total}


class RolePlacement(Frozen):
    """Where one role (a copy of a model's weights used for one purpose) lives and how it is laid out."""

    role: str = Field(description="Role name: the model name, or 'model/generate' for a generation copy.")
    model: str = Field(description="Model whose weights this role holds.")
    kind: RoleKind = Field(description="train: updated by an optimizer; generate: samples; infer: forward only.")
    ops: list[str] = Field(description="Op nodes this role executes.")
    mesh: str = Field(description="Mesh name.")
    dp: int = Field(default=1, gt=0, description="Replicated data-parallel size.")
    fsdp: int = Field(default=1, gt=0, description="Sharded data-parallel size.")
    tp: int = Field(default=1, gt=0, description="Tensor-parallel size.")
    pp: int = Field(default=1, gt=0, description="Pipeline-parallel size.")
    sharding: Sharding = Field(default="none", description="Training-state sharding over the data-parallel axis.")
    precision: Precision = Field(default="bf16", description="Weight precision used for compute.")
    engine: Engine = Field(default="native", description="What runs a generation role: graphrl's sampler or vLLM.")
    sleeps: bool = Field(default=False, description="A serving engine that sleeps between its generations (vLLM's "
                         "sleep mode, level 2; CUDA, colocated with the trainer): its weights and KV cache are freed "
                         "while other roles compute, and the weights reloaded from the role's module when it wakes.")
    offload: list[Literal["params", "grads", "optimizer"]] = Field(
        default_factory=list, description="State moved to host memory while the role is idle."
    )
    memory_bytes: MemoryBytes = Field(description="Peak device bytes of this role, per device.")
    host_bytes: MemoryBytes = Field(default_factory=MemoryBytes, description="Host bytes per device (offloaded).")


class Operation(Frozen):
    """An operation the compiler inserted: weight sync, data reshard, offload/onload."""

    kind: Literal["weight_sync", "reshard", "offload", "onload", "reshard_in_place"] = Field(description="Kind.")
    src: str = Field(description="Source role or mesh.")
    dst: str = Field(description="Destination role or mesh.")
    num_bytes: float = Field(ge=0, description="Bytes moved per step (all devices together).")
    time_s: float = Field(ge=0, description="Predicted seconds per step on the critical path.")
    detail: str = Field(default="", description="Human-readable detail.")


class StepEstimate(Frozen):
    """Predicted seconds per step, by phase."""

    step_time_s: float = Field(ge=0, description="Steady-state seconds per RL step.")
    phases: dict[str, float] = Field(description="Seconds per phase (generate, infer, train, weight_sync, ...).")
    mode: ScheduleMode = Field(description="Schedule the estimate assumes.")
    method: Literal["analytical", "simulated"] = Field(default="analytical", description="How it was computed.")
    environment_s: float = Field(default=0.0, ge=0, description="Of a generation, the seconds its episodes' "
                                 "environment calls take on the critical path (0: no environment).")


class CandidateSummary(Frozen):
    """One layout the placement search considered."""

    label: str = Field(description="Short description of the layout.")
    strategy: Literal["colocated", "disaggregated"] = Field(description="Family of layouts.")
    fits: bool = Field(description="Whether every device's memory fits.")
    step_time_s: float | None = Field(default=None, description="Predicted seconds per step, if it fits.")
    reason: str | None = Field(default=None, description="Why it was rejected.")


class DeviceMemory(Frozen):
    """Peak memory of the devices of one mesh (all devices of a mesh hold the same amount)."""

    mesh: str = Field(description="Mesh name.")
    peak_bytes: float = Field(description="Peak bytes per device over the step.")
    capacity_bytes: float = Field(description="Usable bytes per device.")
    roles: list[str] = Field(description="Roles whose state lives on these devices.")


class Layout(Frozen):
    """A full placement: meshes, role placements, inserted operations, its estimate."""

    strategy: Literal["colocated", "disaggregated"] = Field(description="Family of the layout.")
    label: str = Field(description="Short description.")
    meshes: list[Mesh] = Field(description="Device meshes, each a set of devices with named axes.")
    placements: list[RolePlacement] = Field(description="Where and how each role is laid out.")
    operations: list[Operation] = Field(description="Operations the compiler inserted (syncs, reshards, offloads).")
    device_memory: list[DeviceMemory] = Field(description="Peak memory per mesh.")
    estimate: StepEstimate = Field(description="Predicted seconds per step.")

    def mesh(self, name: str) -> Mesh:
        for m in self.meshes:
            if m.name == name:
                return m
        raise KeyError(f"layout {self.label!r} has no mesh {name!r}")

    def role_mesh(self, placement: RolePlacement) -> Mesh:
        """The devices of the role's mesh along the role's own axes (dp, fsdp, tp, pp): on a colocated
        layout the trainer and the generator share devices but not their axes."""
        return self.mesh(placement.mesh).view(dp=placement.dp, fsdp=placement.fsdp, tp=placement.tp, pp=placement.pp)


class PortSource(Frozen):
    """The producer of one input port: a node's output port."""

    node: str = Field(description="Producing node.")
    port: str = Field(description="Its output port.")
    op: str = Field(description="The producing node's op (a `generate` produces the step's rollouts).")


class NodeBinding(Frozen):
    """What a rank needs to run one node of the job: its settings and where each of its inputs comes from."""

    spec: NodeSpec = Field(description="The node's settings as the job states them (reward rules, loss, lr, ...).")
    inputs: dict[str, PortSource] = Field(default_factory=dict, description="Input port -> its producer.")


class RoleBinding(Frozen):
    """What a rank needs to build one role's module."""

    model: str = Field(description="The model whose weights the role holds.")
    head: Literal["lm", "value"] = Field(
        description="lm: the language-model head (policy, reference); value: a scalar head (critic, reward model).")
    lr: float | None = Field(default=None, gt=0, description="A trained role's learning rate (its train node's, "
                                                               "else algorithm.lr); None for a frozen role.")


class RunBindings(Frozen):
    """The job as the executors run it, resolved by the compiler: no rank rebuilds the job graph."""

    nodes: dict[str, NodeBinding] = Field(description="Every node by name.")
    roles: dict[str, RoleBinding] = Field(description="Every placed role by name.")
    generate_node: str = Field(description="The node that samples the rollouts.")
    dataset_node: str = Field(description="The node that yields the prompts.")
    policy_model: str = Field(description="The model the rollouts are sampled from (its training role's name).")
    last_train_node: str = Field(description="The step's last update, after which its data is no longer read.")
    bases: dict[str, str] = Field(default_factory=dict, description="Frozen models that run as a LoRA model's base "
                                  "(model -> the LoRA model): their forwards are that model's with its adapters off.")


class LoraFigure(Frozen):
    """One figure of a LoRA job beside the same job trained in full, on the same layout."""

    what: str = Field(description="What is measured (per device unless it says otherwise).")
    unit: Literal["bytes", "seconds", "params"] = Field(description="Its unit.")
    lora: float = Field(ge=0, description="With the adapters.")
    full: float = Field(ge=0, description="Trained in full: every weight trained and synced, the reference its own copy.")


class LoraSummary(Frozen):
    """What LoRA buys on the chosen layout: the trainer's state, its step and the weight sync with adapters,
    beside the same job trained in full on the same layout."""

    rank: int = Field(gt=0, description="The adapters' rank.")
    adapter_params: int = Field(ge=0, description="Trained parameters: the adapters'.")
    base_params: int = Field(ge=0, description="The frozen base's parameters.")
    base_reference: list[str] = Field(default_factory=list, description="Frozen models run as the base with the "
                                      "adapters off (no copy of their weights).")
    figures: list[LoraFigure] = Field(description="Each figure with adapters and in full.")
    full_fits: bool = Field(description="Whether the same layout holds the job trained in full.")


class EpisodeSummary(Frozen):
    """A generate node's episodes (an environment answers the model's turns) as the costs assume them."""

    turns: int = Field(ge=1, description="Model turns per episode (env.max_turns).")
    turn_tokens: int = Field(ge=1, description="Longest model turn (max_new_tokens).")
    max_total_tokens: int = Field(ge=1, description="Longest episode, the prompt included (the KV cache charged).")
    model_tokens: float = Field(ge=0, description="Model tokens of an episode, as charged.")
    env_tokens: float = Field(ge=0, description="Environment tokens of an episode (its replies), as charged.")
    call_seconds: float = Field(ge=0, description="Seconds of one environment call, as charged.")
    seconds_source: str = Field(description="Where call_seconds comes from.")

    def describe(self) -> str:
        return (f"episodes of up to {self.turns} turns of {self.turn_tokens} tokens within {self.max_total_tokens} "
                f"tokens (prompt included): per episode {self.model_tokens:.0f} model tokens and "
                f"{self.env_tokens:.0f} environment tokens, {self.turns + 1} environment calls of "
                f"{_seconds(self.call_seconds)} ({self.seconds_source})")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


class WorkloadSummary(Frozen):
    """The sizes of one step the plan's costs assume, as the preview states them."""

    responses: int = Field(ge=0, description="Responses per step (prompts x samples per prompt).")
    prompt_len: int = Field(ge=0, description="Prompt tokens per response (the longest prompt).")
    max_new_tokens: int = Field(ge=0, description="The hard limit on a response's length.")
    lengths: str = Field(description="How the response lengths were given (assumed, measured, or the limit).")
    mean_response_tokens: float = Field(ge=0, description="Mean response length the costs assume.")
    p90_response_tokens: float = Field(ge=0, description="90th percentile of the assumed lengths.")
    longest_response_tokens: float = Field(ge=0, description="The longest response of the batch, expected.")
    optimizer_steps: int = Field(ge=1, description="Optimizer steps per pass over the batch (mini-batches).")
    passes: int = Field(ge=1, description="Passes over the batch per step (updates_per_step).")
    packed: bool = Field(description="Log-prob and training passes pack sequences (no padding).")
    episodes: EpisodeSummary | None = Field(default=None, description="A generate node's episodes, when it has an "
                                                                      "environment.")

    def describe(self) -> str:
        train = (f"{self.passes} pass{'es' if self.passes > 1 else ''} of {self.optimizer_steps} optimizer "
                 f"step{'s' if self.optimizer_steps > 1 else ''}, {'packed' if self.packed else 'padded'} sequences")
        lengths = self.lengths
        if self.mean_response_tokens < self.max_new_tokens:
            lengths += (f": mean {self.mean_response_tokens:.0f}, p90 {self.p90_response_tokens:.0f}, longest of "
                        f"the batch {self.longest_response_tokens:.0f} (limit {self.max_new_tokens})")
        if self.episodes is not None:
            return (f"{self.responses} episodes per step, prompts of {self.prompt_len} tokens; "
                    f"{self.episodes.describe()}; training: {train}")
        return (f"{self.responses} responses per step, prompts of {self.prompt_len} tokens; response lengths: "
                f"{lengths}; training: {train}")


class Plan(Frozen):
    """The compiler's output."""

    format_version: int = Field(default=PLAN_FORMAT_VERSION, description="Plan file format version.")
    job: JobSpec = Field(description="The job as loaded and checked (overrides applied).")
    cluster: ClusterSpec = Field(description="The cluster it was placed on.")
    hardware: HardwareSpec = Field(description="The device model the costs were predicted with.")
    chosen: Layout = Field(description="The selected layout.")
    baseline: Layout | None = Field(default=None, description="The colocated-synchronous baseline layout.")
    candidates_considered: int = Field(ge=0, description="Number of layouts evaluated by the search.")
    candidates: list[CandidateSummary] = Field(default_factory=list, description="Best and rejected candidates.")
    programs: TypedPrograms | None = Field(default=None, description="Per-rank periodic programs, once scheduled.")
    bindings: RunBindings | None = Field(default=None, description="Nodes and roles as the executors run them.")
    lora: LoraSummary | None = Field(default=None, description="A LoRA job's costs beside the same job trained in full.")
    workload: WorkloadSummary | None = Field(default=None, description="The step sizes the costs assume.")

    def preview_dict(self) -> dict[str, Any]:
        """The documented JSON preview (`graphrl compile --plan --format json`)."""
        caps = {d.mesh: d.capacity_bytes for d in self.chosen.device_memory}
        meshes = {m.name: m for m in self.chosen.meshes}
        return {
            "format_version": self.format_version,
            "job": self.job.name,
            "cluster": {"name": self.cluster.name, "num_devices": self.cluster.num_devices,
                        "hardware": self.hardware.name},
            "strategy": self.chosen.strategy,
            "label": self.chosen.label,
            "meshes": [
                {"name": m.name, "devices": [min(m.devices), max(m.devices)],
                 "num_devices": m.num_devices, "axes": m.axis_sizes()}
                for m in self.chosen.meshes
            ],
            "placements": [
                {"model": p.model, "role": p.role, "kind": p.kind, "mesh": p.mesh,
                 "devices": meshes[p.mesh].device_range(),
                 "parallel": {"dp": p.dp, "fsdp": p.fsdp, "tp": p.tp, "pp": p.pp},
                 "sharding": p.sharding, "precision": p.precision, "offload": p.offload,
                 "memory_bytes": p.memory_bytes.as_dict(), "host_bytes": p.host_bytes.as_dict(),
                 "capacity_bytes": caps[p.mesh]}
                for p in self.chosen.placements
            ],
            "device_memory": [d.model_dump() for d in self.chosen.device_memory],
            "operations": [o.model_dump() for o in self.chosen.operations],
            "step_time_s": self.chosen.estimate.step_time_s,
            "phases": self.chosen.estimate.phases,
            "mode": self.chosen.estimate.mode,
            "estimate_method": self.chosen.estimate.method,
            "workload": None if self.workload is None else self.workload.model_dump(),
            "preview_only": [r.message() for r in plan_refusals(self)],
            "baseline": None if self.baseline is None else {
                "label": self.baseline.label,
                "step_time_s": self.baseline.estimate.step_time_s,
                "phases": self.baseline.estimate.phases,
                "speedup": self.baseline.estimate.step_time_s / self.chosen.estimate.step_time_s
                if self.chosen.estimate.step_time_s > 0 else None,
            },
            "candidates_considered": self.candidates_considered,
            "candidates": [c.model_dump() for c in self.candidates],
            "lora": None if self.lora is None else self.lora.model_dump(),
        }


def plan_json_schema() -> dict[str, Any]:
    """JSON Schema of a plan file's content (`graphrl schema --plan`): the msgpack holds `{"graphrl_plan":
    format version, "plan": the plan's records, "programs": its per-rank programs}`, the programs in their
    compact form with every instruction field described."""
    plan = Plan.model_json_schema(mode="serialization")
    defs = plan.pop("$defs")
    del plan["properties"]["programs"]  # stored beside the plan, in the compact form
    programs, program_defs = programs_json_schema()
    for name, definition in program_defs.items():
        if defs.setdefault(name, definition) != definition:
            raise AssertionError(f"two schemas named {name!r} in the plan")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "graphrl plan file",
        "description": "The content of a plan file written by `graphrl compile JOB -o PLAN` (msgpack of this).",
        "type": "object",
        "properties": {
            "graphrl_plan": {"const": PLAN_FORMAT_VERSION, "description": "Plan file format version."},
            "plan": plan,
            "programs": {"anyOf": [programs, {"type": "null"}],
                         "description": Plan.model_fields["programs"].description},
        },
        "required": ["graphrl_plan", "plan", "programs"],
        "additionalProperties": False,
        "$defs": defs,
    }

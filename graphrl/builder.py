"""The Python front end: build the same `JobSpec` a YAML file describes, with checked references.

    job = Job("grpo_tiny", cluster="local-cpu-2")
    policy = job.model("policy", preset="tiny-digits", dtype="float32")
    prompts = job.dataset("prompts", task="digits-copy", batch_size=16, prompt_len=6)
    rollout = job.generate("rollout", policy, prompts=prompts.out("prompts"), max_new_tokens=5)
    ...
    spec = job.build()

Each method returns a handle; `handle.out(port)` is a checked reference to one of its output ports.
`build()` validates through the same pydantic schemas as the YAML loader, so both forms compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from graphrl.errors import JobError
from graphrl.ops import OPS
from graphrl.schemas.job import (
    AdvantageNode,
    AlgorithmSpec,
    DatasetNode,
    GenerateNode,
    JobSpec,
    LogprobNode,
    PlacementHints,
    RewardNode,
    RunSettings,
    ScheduleSpec,
    TrainNode,
    ValueNode,
)
from graphrl.schemas.model import ModelSpec


@dataclass(frozen=True)
class ModelHandle:
    name: str


@dataclass(frozen=True)
class PortRef:
    node: str
    port: str

    def __str__(self) -> str:
        return f"{self.node}.{self.port}"


@dataclass(frozen=True)
class NodeHandle:
    name: str
    outputs: tuple[str, ...]

    def out(self, port: str) -> PortRef:
        """A reference to output `port`; an unknown port is an error naming the valid ones."""
        if port not in self.outputs:
            raise JobError(f"node {self.name!r} has no output port {port!r}", path=("nodes", self.name),
                           fix=f"use one of: {', '.join(self.outputs) or 'none'}")
        return PortRef(self.name, port)


Ref = PortRef | str


class Job:
    """Accumulates models and nodes; `build()` returns the validated, frozen `JobSpec`."""

    def __init__(self, name: str, *, description: str = "", cluster: str | None = None) -> None:
        self.name = name
        self.description = description
        self.cluster = cluster
        self._models: dict[str, dict[str, Any]] = {}
        self._nodes: dict[str, Any] = {}
        self._sections: dict[str, Any] = {}

    # -- models ------------------------------------------------------------------------------------
    def model(self, name: str, **fields: Any) -> ModelHandle:
        if name in self._models:
            raise JobError(f"model {name!r} is declared twice", path=("models", name), fix="use a new name")
        self._models[name] = fields
        return ModelHandle(name)

    # -- nodes -------------------------------------------------------------------------------------
    def _add(self, name: str, spec_type: type, inputs: dict[str, Ref], fields: dict[str, Any]) -> NodeHandle:
        if name in self._nodes:
            raise JobError(f"node {name!r} is declared twice", path=("nodes", name), fix="use a new name")
        for key in ("model",):
            if isinstance(fields.get(key), ModelHandle):
                fields[key] = fields[key].name
        refs = {port: str(ref) for port, ref in inputs.items() if ref is not None}
        try:
            spec = spec_type(inputs=refs, **fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = tuple(str(p) for p in err["loc"])
            raise JobError(err["msg"], path=("nodes", name) + loc) from None
        self._nodes[name] = spec
        outputs = tuple(OPS[spec.op].ports(spec).outputs)
        return NodeHandle(name, outputs)

    def dataset(self, name: str, *, task: str, batch_size: int, prompt_len: int, **fields: Any) -> NodeHandle:
        return self._add(name, DatasetNode, {}, dict(task=task, batch_size=batch_size, prompt_len=prompt_len, **fields))

    def generate(self, name: str, model: ModelHandle | str, *, prompts: Ref, **fields: Any) -> NodeHandle:
        return self._add(name, GenerateNode, {"prompts": prompts}, dict(model=model, **fields))

    def logprob(self, name: str, model: ModelHandle | str, *, rollouts: Ref, **fields: Any) -> NodeHandle:
        return self._add(name, LogprobNode, {"rollouts": rollouts}, dict(model=model, **fields))

    def value(self, name: str, model: ModelHandle | str, *, rollouts: Ref, **fields: Any) -> NodeHandle:
        return self._add(name, ValueNode, {"rollouts": rollouts}, dict(model=model, **fields))

    def reward(self, name: str, *, rollouts: Ref, fn: str | None = None,
               model: ModelHandle | str | None = None, env_rewards: Ref | None = None, **fields: Any) -> NodeHandle:
        return self._add(name, RewardNode, {"rollouts": rollouts, "env_rewards": env_rewards},
                         dict(fn=fn, model=model, **fields))

    def advantage(self, name: str, estimator: str, *, rewards: Ref, rollouts: Ref,
                  values: Ref | None = None, ref_logprobs: Ref | None = None, old_logprobs: Ref | None = None,
                  **fields: Any) -> NodeHandle:
        inputs = {"rewards": rewards, "rollouts": rollouts, "values": values, "ref_logprobs": ref_logprobs,
                  "old_logprobs": old_logprobs}
        return self._add(name, AdvantageNode, inputs, dict(estimator=estimator, **fields))

    def train(self, name: str, model: ModelHandle | str, *, loss: str, rollouts: Ref, advantages: Ref,
              ref_logprobs: Ref | None = None, old_logprobs: Ref | None = None,
              values: Ref | None = None, **fields: Any) -> NodeHandle:
        inputs = {"rollouts": rollouts, "advantages": advantages, "ref_logprobs": ref_logprobs,
                  "old_logprobs": old_logprobs, "values": values}
        return self._add(name, TrainNode, inputs, dict(model=model, loss=loss, **fields))

    # -- job-wide sections -------------------------------------------------------------------------
    def algorithm(self, **fields: Any) -> None:
        self._sections["algorithm"] = AlgorithmSpec(**fields)

    def schedule(self, **fields: Any) -> None:
        self._sections["schedule"] = ScheduleSpec(**fields)

    def placement(self, **fields: Any) -> None:
        self._sections["placement"] = PlacementHints(**fields)

    def run(self, **fields: Any) -> None:
        self._sections["run"] = RunSettings(**fields)

    def build(self) -> JobSpec:
        """The validated job. Graph-level checks (types, shapes) are the compiler's typecheck pass."""
        try:
            models = {name: ModelSpec(**fields) for name, fields in self._models.items()}
            return JobSpec(
                name=self.name, description=self.description, cluster=self.cluster,
                models=models, nodes=dict(self._nodes), **self._sections,
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            raise JobError(err["msg"], path=tuple(str(p) for p in err["loc"])) from None


__all__ = ["Job", "ModelHandle", "NodeHandle", "PortRef"]

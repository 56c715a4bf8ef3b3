"""Op kinds: the typed ports of every node kind, in one registry.

A port's schema is a `DataSchema` with symbolic shapes. Symbols are local to a node: every port of
one node that says `N` means the same size. The typecheck pass unifies them along data edges and
binds them from node settings (batch size, group size, response length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from graphrl.schemas.algorithms import ESTIMATORS, LOSSES
from graphrl.schemas.data import DataSchema
from graphrl.schemas.job import (
    AdvantageNode,
    DatasetNode,
    EnvSpec,
    GenerateNode,
    LogprobNode,
    RewardNode,
    TrainNode,
    ValueNode,
)
from graphrl.schemas.model import ModelDims
from graphrl.schemas.registry import Registry

# The batches that flow through an RL step. B prompts of P tokens become N = B * G responses of R tokens.
PROMPTS = DataSchema.of(prompt_ids="int64[B, P]", prompt_mask="bool[B, P]")
ROLLOUTS = DataSchema.of(
    prompt_ids="int64[N, P]",
    prompt_mask="bool[N, P]",
    response_ids="int64[N, R]",
    response_mask="bool[N, R]",
    behaviour_logprobs="float32[N, R]",
)
LOGPROBS = DataSchema.of(logprobs="float32[N, R]")
VALUES = DataSchema.of(values="float32[N, R]")
REWARDS = DataSchema.of(rewards="float32[N]")
ADVANTAGES = DataSchema.of(advantages="float32[N, R]", returns="float32[N, R]")


# A mixture of experts' routes ride with its rollouts (the native generator records them): int16
# [N, P + R, layers * k], expert + 1, 0 for none (a pad, the last response token). Not a port of the graph,
# since a dense model's jobs never carry them; the plan charges their bytes where rollouts travel.
ROUTES_FIELD = "routes"
ROUTE_BYTES = 2


def route_width(dims: ModelDims) -> int:
    """Route entries per token of a model's rollouts: layers x top-k for a mixture of experts, else 0."""
    return dims.num_layers * dims.experts_per_token if dims.is_moe else 0


# An episode's rollouts (a generate node with an environment) carry two more fields: the loss mask, True on the
# tokens the model sampled (False on the environment's, which every loss, advantage, KL and metric leaves
# out), and what the episode did: EPISODE_COLUMNS, then each model turn's reward (`max_turns` columns).
LOSS_MASK_FIELD = "loss_mask"  # bool [N, R]
EPISODE_FIELD = "episode"  # float32 [N, episode_width]
EPISODE_COLUMNS = ("env_reward", "turns", "tool_calls", "tool_errors", "env_seconds", "end", "model_tokens",
                   "env_tokens", "env_wait_s")
"""env_seconds: the episode's environment calls; env_wait_s: its share of the time its generation waited with
no episode ready (the generation's wait spread evenly over its episodes, so a batch's sum is its wait)."""
END_REASONS = ("done", "max_turns", "max_tokens", "timeout", "error", "bad_return")
"""Why an episode ended: the environment said so (or had nothing more to say), the turn or token limit, or a
failure of its environment (a call past timeout_s, an exception, a return the protocol does not allow)."""


def episode_width(env: EnvSpec | None) -> int:
    """Columns of an episode's `episode` field (0: the node has no environment)."""
    return 0 if env is None else len(EPISODE_COLUMNS) + env.max_turns


def rollout_bytes_per_response(prompt_len: int, response_len: int, routes: int = 0, episode: int = 0) -> int:
    """Bytes of one response's rollout fields as they cross a link (the executors send exactly these), with
    `routes` route entries per token (`route_width`) for a mixture of experts, and an episode's loss mask and
    `episode` columns (`episode_width`) for a node with an environment."""
    return ROLLOUTS.bytes_per("N", {"P": prompt_len, "R": response_len}) + \
        (prompt_len + response_len) * routes * ROUTE_BYTES + (response_len + 4 * episode if episode else 0)


@dataclass(frozen=True)
class InPort:
    schema: DataSchema
    required: bool = True
    doc: str = ""


@dataclass(frozen=True)
class OutPort:
    schema: DataSchema
    must_consume: bool = True
    doc: str = ""


@dataclass(frozen=True)
class Ports:
    inputs: Mapping[str, InPort]
    outputs: Mapping[str, OutPort]


@dataclass(frozen=True)
class OpKind:
    """One kind of op node: which spec class it has, its ports, and whether it reads model weights."""

    name: str
    spec_type: type
    ports: Callable[[object], Ports]
    reads_model: bool
    doc: str = ""
    bindings: Callable[[object], Mapping[str, int]] = field(default=lambda node: {})


OPS: Registry[OpKind] = Registry("op kind")


def _dataset_ports(node: DatasetNode) -> Ports:
    return Ports(inputs={}, outputs={"prompts": OutPort(PROMPTS, doc="left-padded prompt tokens")})


def _generate_ports(node: GenerateNode) -> Ports:
    outputs = {"rollouts": OutPort(ROLLOUTS, doc="prompts, sampled responses and their log-probs")}
    if node.env is not None:
        outputs["rollouts"] = OutPort(ROLLOUTS, doc="prompts and episodes (model and environment tokens, a loss mask "
                                      "over the model's)")
        outputs["env_rewards"] = OutPort(REWARDS, must_consume=False, doc="each episode's summed step rewards")
    return Ports(inputs={"prompts": InPort(PROMPTS)}, outputs=outputs)


def _logprob_ports(node: LogprobNode) -> Ports:
    return Ports(inputs={"rollouts": InPort(ROLLOUTS)}, outputs={"logprobs": OutPort(LOGPROBS)})


def _value_ports(node: ValueNode) -> Ports:
    return Ports(inputs={"rollouts": InPort(ROLLOUTS)}, outputs={"values": OutPort(VALUES)})


def _reward_ports(node: RewardNode) -> Ports:
    inputs = {"rollouts": InPort(ROLLOUTS),
              "env_rewards": InPort(REWARDS, required=False, doc="an environment's episode rewards, added")}
    return Ports(inputs=inputs, outputs={"rewards": OutPort(REWARDS)})


def _advantage_ports(node: AdvantageNode) -> Ports:
    inputs = {"rewards": InPort(REWARDS), "rollouts": InPort(ROLLOUTS, doc="masks and group structure")}
    if ESTIMATORS[node.estimator].needs_values:
        inputs["values"] = InPort(VALUES, doc=f"critic values, needed by {node.estimator}")
    if ESTIMATORS[node.estimator].token_rewards:
        inputs["ref_logprobs"] = InPort(LOGPROBS, required=False, doc="reference log-probs, for KL reward shaping "
                                        "(algorithm.kl_in: reward)")
        inputs["old_logprobs"] = InPort(LOGPROBS, required=False, doc="log-probs of the sampling policy for KL "
                                        "reward shaping (default: behaviour log-probs)")
    return Ports(inputs=inputs, outputs={"advantages": OutPort(ADVANTAGES)})


def _train_ports(node: TrainNode) -> Ports:
    if LOSSES[node.loss].trains == "critic":
        inputs = {
            "rollouts": InPort(ROLLOUTS),
            "advantages": InPort(ADVANTAGES, doc="the returns are the critic's targets"),
            "values": InPort(VALUES, required=False, doc="old values, for value clipping"),
        }
    else:
        inputs = {
            "rollouts": InPort(ROLLOUTS),
            "advantages": InPort(ADVANTAGES),
            "ref_logprobs": InPort(LOGPROBS, required=False, doc="reference log-probs, for the KL penalty"),
            "old_logprobs": InPort(
                LOGPROBS, required=False, doc="log-probs of the current policy (default: behaviour log-probs)"
            ),
        }
    return Ports(inputs=inputs, outputs={})


OPS.add("dataset", OpKind(
    "dataset", DatasetNode, _dataset_ports, reads_model=False, doc="prompts from a task",
    bindings=lambda n: {"B": n.batch_size, "P": n.prompt_len},
))
OPS.add("generate", OpKind(
    "generate", GenerateNode, _generate_ports, reads_model=True, doc="sample responses",
    bindings=lambda n: {"R": n.max_new_tokens} if n.env is None else {},  # an episode's R: typecheck, from P
))
OPS.add("logprob", OpKind("logprob", LogprobNode, _logprob_ports, reads_model=True, doc="per-token log-probs"))
OPS.add("value", OpKind("value", ValueNode, _value_ports, reads_model=True, doc="critic values"))
OPS.add("reward", OpKind("reward", RewardNode, _reward_ports, reads_model=True, doc="score responses"))
OPS.add("advantage", OpKind("advantage", AdvantageNode, _advantage_ports, reads_model=False, doc="advantages"))
OPS.add("train", OpKind("train", TrainNode, _train_ports, reads_model=True, doc="optimizer update"))


def op_kind(node: object) -> OpKind:
    return OPS[node.op]  # type: ignore[attr-defined]


def node_model(node: object) -> str | None:
    """The model whose weights a node reads, if any."""
    return getattr(node, "model", None)

"""The job: models, op nodes wired by port references, algorithm settings, schedule, placement, run.

This is exactly what a user writes in YAML (or builds with `graphrl.builder.Job`). It holds no
derived state: the graph, its types and its placement are computed by the compiler.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Union, get_args

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from graphrl.schemas.algorithms import (ESTIMATORS, LOSSES, ImportanceLevel, ImportanceMode, KLEstimatorName,
                                        KLPlacement, LossAggregation, Normalization, check_name)
from graphrl.schemas.base import Boolean, Frozen, Integer, Real
from graphrl.schemas.model import ModelSpec

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
_NAME = re.compile(NAME_PATTERN)
_REF = re.compile(r"^(?P<node>[A-Za-z_][A-Za-z0-9_\-]*)\.(?P<port>[A-Za-z_][A-Za-z0-9_]*)$")

# The one definition of each choice below; code that iterates the choices reads the tuple beside it.
Precision = Literal["bf16", "fp8"]
"""A role's weight precision for compute."""
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
# What runs a generator role: graphrl's own KV-cache sampler, or a vLLM engine in the rank's process.
Engine = Literal["native", "vllm"]
PRECISION_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}
"""Bytes per weight of the block linears a role stores at each precision."""
Sharding = Literal["none", "zero1", "zero2", "fsdp"]
"""Training-state sharding over the data-parallel axis, least sharded first: none, ZeRO-1 (optimizer state),
ZeRO-2 (and gradients), fsdp (ZeRO-3: and parameters)."""
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)
ScheduleMode = Literal["sync", "async"]
"""'sync': generate(i) uses weights v=i; 'async': any v >= i - max_staleness."""
SCHEDULE_MODES: tuple[ScheduleMode, ...] = get_args(ScheduleMode)


def parse_ref(ref: str) -> tuple[str, str]:
    """Split a port reference `node.port`; raise ValueError if malformed."""
    match = _REF.match(ref)
    if not match:
        raise ValueError(f"port reference {ref!r} is not of the form 'node.port'")
    return match["node"], match["port"]


class _Node(Frozen):
    description: str = Field(default="", description="Free text shown in graph renderings.")
    inputs: dict[str, str] = Field(
        default_factory=dict, description="Input port -> producing 'node.port'. Exactly one producer per port."
    )

    @field_validator("inputs")
    @classmethod
    def _refs(cls, inputs: dict[str, str]) -> dict[str, str]:
        for port, ref in inputs.items():
            parse_ref(ref)
        return inputs


class PromptFields(Frozen):
    """Which columns of a dataset file hold the prompt, the answer and (optionally) a system message."""

    prompt: str = Field(default="prompt", description="Column with the user's prompt text.")
    answer: str = Field(default="answer", description="Column with the reference answer the reward checks.")
    system: str | None = Field(default=None, description="Column with a per-row system message, if any.")


class DatasetNode(_Node):
    """Source of prompts: a registered task (e.g. `digits-copy`), a `module:function` factory, or a
    JSON-lines / parquet file of prompts and answers tokenized by the generating model's tokenizer."""

    op: Literal["dataset"] = Field(default="dataset", description="The node's operation.")
    task: str | None = Field(default=None, description="Registered task name or 'module:function' returning a task.")
    file: Path | None = Field(
        default=None, description="JSON lines (.jsonl) or parquet file of prompts and answers, relative to the job file."
    )
    fields: PromptFields = Field(default_factory=PromptFields, description="Column mapping of `file`.")
    chat_template: Boolean = Field(default=True, description="Render `file` prompts with the tokenizer's chat template.")
    system_prompt: str | None = Field(default=None, description="System message for rows without their own.")
    batch_size: Integer = Field(gt=0, description="Prompts per step (global).")
    prompt_len: Integer = Field(gt=0, description="Longest prompt in tokens; prompts are left-padded to it.")
    long_prompts: Literal["refuse", "truncate"] = Field(
        default="refuse",
        description="A `file` prompt longer than prompt_len: 'refuse' it when the job loads (naming the file and "
                    "row), or 'truncate' it to its last prompt_len tokens.")
    options: dict[str, Integer | Real | str | Boolean] = Field(
        default_factory=dict, description="Task-specific options (e.g. num_digits)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetNode":
        if (self.task is None) == (self.file is None):
            raise ValueError("give exactly one of 'task' (a registered task) or 'file' (JSON lines or parquet)")
        return self


class ResponseTokens(Frozen):
    """How long the responses are, for the preview: every cost that depends on lengths (decode with
    continuous batching, log-prob and training passes, rollout transfers) uses this distribution instead
    of the hard limit `max_new_tokens`. Give `mean` (optionally `max` and `p90`), or `from` a run folder
    whose samples.jsonl recorded the lengths; unset, every response is costed at `max_new_tokens`."""

    model_config = ConfigDict(populate_by_name=True)

    mean: Real | None = Field(default=None, gt=0, description="Mean response length in tokens.")
    max: Integer | None = Field(
        default=None, gt=0, description="Longest response in tokens (at most max_new_tokens; unset = max_new_tokens).")
    p90: Real | None = Field(default=None, gt=0, description="90th percentile of the lengths (shapes the tail).")
    from_run: Path | None = Field(
        default=None, alias="from",
        description="Run folder (relative to the job file) whose samples.jsonl recorded response lengths; the "
                    "preview takes their measured distribution.")
    measured: tuple[Integer, ...] = Field(
        default=(), description="The lengths read from `from` when the job loads (filled in, not written).")

    @model_validator(mode="after")
    def _consistent(self) -> "ResponseTokens":
        if self.from_run is not None:
            if self.mean is not None or self.p90 is not None:
                raise ValueError("give either 'from' (a run folder) or 'mean' (and 'p90'), not both")
            return self
        if self.mean is None:
            raise ValueError("give 'mean' (the mean response length in tokens) or 'from' (a run folder)")
        if self.max is not None and self.mean > self.max:
            raise ValueError(f"mean {self.mean:g} is above max {self.max}")
        if self.p90 is not None and self.max is not None and self.p90 > self.max:
            raise ValueError(f"p90 {self.p90:g} is above max {self.max}")
        if self.p90 is not None and self.mean < self.p90 / 10:
            raise ValueError(f"mean {self.mean:g} is below p90 / 10: a tenth of the responses at p90 {self.p90:g} or "
                             "longer alone make the mean larger")
        return self


class EnvSpec(Frozen):
    """An environment a generate node's episodes talk to: the model answers, the environment replies (a tool's
    result, the next user message) with a reward and whether the episode is over, for up to `max_turns`
    model turns. One instance per episode, built from `options`."""

    model_config = ConfigDict(**Frozen.model_config, populate_by_name=True)

    cls: str = Field(alias="class", description="Built-in environment name (calculator, python, digit-echo) or "
                     "'module:Class' with reset(row) and step(text) methods (sync or async).")
    options: dict[str, Union[str, int, float, bool, None, list, dict]] = Field(
        default_factory=dict, description="Keyword arguments of the environment's constructor.")
    max_turns: Integer = Field(default=4, gt=0, description="Most model turns of an episode.")
    max_total_tokens: Integer = Field(
        gt=0, description="Longest episode in tokens, the prompt included: the KV cache the plan charges per episode.")
    timeout_s: Real = Field(default=10.0, gt=0, description="Wall-clock limit of one environment call (reset or "
                            "step); past it the episode ends with reward 0 and reason 'timeout'.")
    seconds_per_call: Real | None = Field(
        default=None, ge=0, description="What one environment call takes, for the preview (unset: the class's "
        "`seconds_per_call` attribute, a `graphrl calibrate JOB` measurement, or 0).")
    observation_tokens: Integer | None = Field(
        default=None, ge=0, description="Tokens one environment reply adds, for the preview (unset: the class's "
        "`observation_tokens` attribute, else an even share of the episode's room).")


class GenerateNode(_Node):
    """Sample responses from a model (KV-cache autoregressive decoding)."""

    op: Literal["generate"] = Field(default="generate", description="The node's operation.")
    model: str = Field(description="Model whose weights generate.")
    samples_per_prompt: Integer = Field(default=1, gt=0, description="Responses per prompt (the GRPO group size).")
    max_new_tokens: Integer = Field(gt=0, description="Longest response in tokens.")
    temperature: Real = Field(
        default=1.0, ge=0,
        description="Sampling temperature; 0 is greedy. Every log-prob of the responses (behaviour, old, new, "
        "reference) and the entropy are of this distribution, softmax(logits / temperature) (top_p ignored); "
        "at 0 they are of softmax(logits).")
    top_p: Real = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    stop: list[str] = Field(
        default_factory=list, description="Extra stop strings (single tokens) besides the tokenizer's end tokens."
    )
    response_tokens: ResponseTokens | None = Field(
        default=None,
        description="Assumed response lengths for the preview ({mean, max, p90} or {from: RUN_DIR}); unset = "
                    "every response max_new_tokens long.")
    env: EnvSpec | None = Field(
        default=None, description="An environment the episodes talk to over several turns (`max_new_tokens` is then "
        "per turn); the node also outputs `env_rewards`, the episodes' summed step rewards.")

    def response_len(self, prompt_len: int) -> int:
        """R, the response columns of the rollouts: `max_new_tokens`, or an episode's tokens after its prompt."""
        return self.max_new_tokens if self.env is None else self.env.max_total_tokens - prompt_len

    @model_validator(mode="after")
    def _lengths_within_limit(self) -> "GenerateNode":
        lengths = self.response_tokens
        if lengths is None:
            return self
        if lengths.max is not None and lengths.max > self.max_new_tokens:
            raise ValueError(f"response_tokens.max {lengths.max} is above max_new_tokens {self.max_new_tokens}")
        for name in ("mean", "p90"):
            value = getattr(lengths, name)
            if value is not None and value > self.max_new_tokens:
                raise ValueError(f"response_tokens.{name} {value:g} is above max_new_tokens {self.max_new_tokens}")
        return self


class LogprobNode(_Node):
    """Per-token log-probabilities of the responses under a model (reference or old policy)."""

    op: Literal["logprob"] = Field(default="logprob", description="The node's operation.")
    model: str = Field(description="Model whose log-probabilities are computed.")


class ValueNode(_Node):
    """Per-token value estimates from a critic."""

    op: Literal["value"] = Field(default="value", description="The node's operation.")
    model: str = Field(description="Critic model.")


class RewardNode(_Node):
    """Score each response: a registered rule function, a `module:function`, or a reward model."""

    op: Literal["reward"] = Field(default="reward", description="The node's operation.")
    fn: str | None = Field(default=None, description="Registered reward rule name or 'module:function'.")
    model: str | None = Field(default=None, description="Reward model (instead of a rule function).")
    rules: dict[str, Real] = Field(
        default_factory=dict,
        description="Answer rules (numeric_answer, exact_match, math_equivalence, boxed_format, ... or "
        "'module:function') and their weights; the reward is the weighted sum. Needs a file dataset.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "RewardNode":
        if (self.fn is not None) + (self.model is not None) + bool(self.rules) != 1:
            raise ValueError("give exactly one of 'fn' (a rule function), 'rules' (answer rules with weights) "
                             "or 'model' (a reward model)")
        return self


class AdvantageNode(_Node):
    """Turn rewards (and values) into per-token advantages and returns."""

    op: Literal["advantage"] = Field(default="advantage", description="The node's operation.")
    estimator: str = Field(description="Advantage estimator (see graphrl.schemas.algorithms).",
                           json_schema_extra={"enum": ESTIMATORS.names()})
    gamma: Real = Field(default=1.0, ge=0, le=1, description="Discount (GAE).")
    lam: Real = Field(default=0.95, ge=0, le=1, description="GAE lambda.")
    normalize: Normalization | None = Field(
        default=None,
        description="Divide the advantages by a std: 'group' (each prompt's group, GRPO), 'batch' (the whole "
        "batch: REINFORCE++'s normalisation, GAE whitening), 'none' (Dr. GRPO). Unset: the estimator's default "
        "(grpo: group, reinforce_pp: batch, gae and rloo: none).")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return check_name(value, ESTIMATORS)

    @field_validator("normalize")
    @classmethod
    def _offered_normalization(cls, value: Normalization | None, info: ValidationInfo) -> Normalization | None:
        estimator = info.data.get("estimator")
        if value is None or estimator is None:
            return value
        offered = ESTIMATORS[estimator].normalizations
        if value not in offered:
            raise ValueError(f"estimator {estimator!r} offers normalize: {', '.join(offered)}")
        return value

    @property
    def normalization(self) -> Normalization:
        """`normalize`, or the estimator's default when unset."""
        return self.normalize if self.normalize is not None else ESTIMATORS[self.estimator].normalizations[0]


class TrainNode(_Node):
    """One optimizer update of a model per step."""

    op: Literal["train"] = Field(default="train", description="The node's operation.")
    model: str = Field(description="Model whose weights are updated.")
    loss: str = Field(description="Loss function (see graphrl.schemas.algorithms).",
                      json_schema_extra={"enum": LOSSES.names()})
    lr: Real | None = Field(default=None, gt=0, description="Learning rate; defaults to algorithm.lr.")

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        return check_name(value, LOSSES)


NodeSpec = Annotated[
    Union[DatasetNode, GenerateNode, LogprobNode, ValueNode, RewardNode, AdvantageNode, TrainNode],
    Field(discriminator="op"),
]


RouterReplay = Literal["none", "R2", "R3"]


class AlgorithmSpec(Frozen):
    """Hyper-parameters shared by the losses and the optimizer."""

    lr: Real = Field(default=1e-5, gt=0, description="Adam learning rate.")
    betas: tuple[Real, Real] = Field(default=(0.9, 0.95), description="Adam betas.")
    weight_decay: Real = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: Real = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    clip_eps: Real = Field(default=0.2, gt=0, description="PPO/GRPO ratio clip epsilon: the ratio is clipped to "
                           "[1 - clip_eps, 1 + clip_eps_high].")
    clip_eps_high: Real | None = Field(
        default=None, gt=0, description="Upper ratio clip epsilon (DAPO's clip-higher, e.g. 0.28); unset = clip_eps.")
    dual_clip_c: Real | None = Field(
        default=None, gt=1, description="Dual-clip PPO (Ye et al. 2020): on tokens with a negative advantage the "
        "objective is at least c * A, bounding the loss of a very large ratio (typically 3); unset = off.")
    loss_agg: LossAggregation = Field(
        default="token_mean",
        description="How per-token losses are averaged: 'token_mean' over every real token of the batch (DAPO), "
        "'seq_mean_token_mean' the mean over responses of their token means (GRPO paper), "
        "'seq_mean_token_sum_norm' the mean over responses of their token sums / max_new_tokens (Dr. GRPO). "
        "The same on every layout and rank count; applies to the KL, entropy and critic terms too.")
    kl_coef: Real = Field(default=0.0, ge=0, description="Weight of the KL penalty to the reference model.")
    kl_estimator: KLEstimatorName = Field(
        default="k3",
        description="Per-token KL estimator, d = ref_logp - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1, "
        "k3_is = k3 * pi / sg(pi_sampling). In the loss, the expected gradient of k2 and k3_is is that of "
        "KL(pi || ref), of k3 that of KL(ref || pi), and of k1 zero (refused there).")
    kl_in: KLPlacement = Field(
        default="loss",
        description="'loss': kl_coef * KL is a term of the policy loss (GRPO); 'reward': -kl_coef * KL is added "
        "to each token's reward before the advantage (REINFORCE++, PPO with GAE), with no gradient through it.")
    entropy_coef: Real = Field(default=0.0, ge=0, description="Entropy bonus weight.")
    aipo_rho: Real = Field(
        default=4.0, gt=1, description="AIPO truncation: importance weight min(pi/mu, rho) (typically 2..10)."
    )
    aipo_level: ImportanceLevel = Field(
        default="token", description="What AIPO's importance weight pi/mu is taken over: 'token' (each token's "
        "ratio), 'sequence' (the response's: the product of its tokens' ratios, the same weight on every token "
        "of it), 'geometric' (the response's geometric mean ratio, exp of its tokens' mean log-ratio).")
    aipo_mode: ImportanceMode = Field(
        default="truncate", description="What AIPO does with a weight outside its trust region: 'truncate' caps it "
        "at aipo_rho (min(w, rho)); 'mask' keeps the weight w where 1/rho <= w <= rho and drops its tokens from "
        "the loss otherwise (the train/inference mismatch of a serving engine, corrected by rejection).")
    micro_batch_size: Integer = Field(
        default=0, ge=0, description="Responses per forward (and backward) on each rank; gradients accumulate over "
        "a rank's micro-batches, so the step equals the whole-batch step. 0 = a rank's whole batch at once.")
    mini_batch_size: Integer = Field(
        default=0, ge=0, description="Responses per optimizer step (global): each pass over the batch takes "
        "batch / mini_batch_size optimizer steps, each on its own share of the responses; must divide the batch. "
        "0 = one optimizer step per pass on the whole batch.")
    updates_per_step: Integer = Field(
        default=1, gt=0, description="Passes over the batch per step (PPO epochs); each pass takes one optimizer step "
        "per mini-batch.")
    pack_sequences: Boolean = Field(
        default=False, description="Log-prob, value and training passes pack each micro-batch's responses (prompt "
        "and response tokens, no padding) into one sequence whose attention is block-diagonal, and cut "
        "micro-batches by a token budget (micro_batch_size x (prompt_len + max_new_tokens)) instead of by rows. The "
        "losses equal the unpacked ones.")
    value_clip: Real = Field(default=0.2, gt=0, description="Critic value clipping range.")
    router_aux_loss_coef: Real | None = Field(
        default=None, ge=0, description="Mixture-of-experts models: the weight of the load-balancing loss added to "
        "the policy's (default: the model's own, `router_aux_loss_coef` of its config, 0.001 for Qwen's). Each "
        "data-parallel rank balances the tokens of its own micro-batches, as Hugging Face's and Megatron's "
        "default does, so the term depends on the layout; 0 leaves it out.")
    router_replay: RouterReplay = Field(
        default="none", description="Mixture-of-experts models: 'R3' trains on the experts the generator routed "
        "each token to (its routes recorded per token and layer, replayed in the trainer's log-prob and update "
        "forwards; the router's probabilities of those experts still weight them, so the router keeps learning); "
        "'R2' replays the trainer's own routing of its first pass over the batch in later passes; 'none' routes "
        "every forward afresh.")


class ScheduleSpec(Frozen):
    """How steps are unrolled."""

    mode: ScheduleMode = Field(
        default="sync", description="'sync': generate(i) uses weights v=i; 'async': any v >= i - max_staleness."
    )
    max_staleness: Integer = Field(default=1, ge=0, description="Async only: how many versions a generate may lag.")
    steps: Integer = Field(default=100, gt=0, description="Number of RL steps.")
    checkpoint_every: Integer = Field(default=0, ge=0, description="Checkpoint period in steps; 0 = only at the end.")


class RoleHint(Frozen):
    """Placement pins for one role (a model's training copy `policy`, or generation copy `policy/generate`)."""

    devices: str | None = Field(
        default=None, description="Device range 'first-last' (inclusive), e.g. '0-7'; unset = search."
    )
    dp: Integer | None = Field(default=None, gt=0, description="Data-parallel (replicated) size.")
    fsdp: Integer | None = Field(default=None, gt=0, description="Sharded data-parallel size.")
    tp: Integer | None = Field(default=None, gt=0, description="Tensor-parallel size.")
    pp: Integer | None = Field(default=None, gt=0, description="Pipeline-parallel size.")
    sharding: Sharding | None = Field(
        default=None, description="Training-state sharding over the data-parallel axis."
    )
    precision: Precision | None = Field(default=None, description="Generator weight precision.")
    offload: Boolean | None = Field(default=None, description="Allow offloading this role's state to host memory.")
    engine: Engine | None = Field(
        default=None,
        description="Generation engine of a generation copy: 'native' (graphrl's sampler; unset means native) or "
                    "'vllm' (a vLLM engine per generator replica; needs the vllm package).",
    )

    memory_fraction: Real | None = Field(
        default=None, gt=0, le=1,
        description="The share of device memory a vLLM generator reserves for its weights and KV cache (vLLM's "
                    "gpu_memory_utilization): the plan charges it whole and fits the rest of the step beside it; "
                    "unset = the KV cache the responses need, within what the plan leaves free.")

    @field_validator("devices")
    @classmethod
    def _range(cls, devices: str | None) -> str | None:
        if devices is not None:
            parse_device_range(devices)
        return devices


def parse_device_range(text: str) -> tuple[int, int]:
    """Parse 'a-b' (inclusive) or 'a' into a half-open (start, stop)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise ValueError(f"device range {text!r} is not of the form 'first-last', e.g. '0-7'")
    first = int(match[1])
    last = int(match[2]) if match[2] is not None else first
    if last < first:
        raise ValueError(f"device range {text!r} ends before it starts")
    return first, last + 1


class PlacementHints(Frozen):
    """What the user pins; everything else the placement search decides."""

    strategy: Literal["auto", "colocated", "disaggregated"] = Field(
        default="auto", description="Restrict the search to one family of layouts."
    )
    colocate: list[list[str]] = Field(
        default_factory=list, description="Groups of roles that must share devices."
    )
    roles: dict[str, RoleHint] = Field(
        default_factory=dict, description="Per-role pins, keyed by 'model' or 'model/generate'."
    )


class RunSettings(Frozen):
    """Settings of `graphrl run` that do not change the plan."""

    seed: Integer = Field(default=0, description="Seed of every random number generator.")
    out_dir: str | None = Field(default=None, description="Run folder; default 'runs/<job name>'.")
    log_every: Integer = Field(default=1, gt=0, description="Print progress every N steps.")
    tensorboard: Boolean = Field(default=True, description="Write TensorBoard scalars.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where ranks compute.")
    threads_per_rank: Integer = Field(default=1, gt=0, description="torch intra-op threads per rank process.")
    samples_per_step: Integer = Field(default=4, ge=0, description="Rollouts per step written to samples.jsonl as text.")


class JobSpec(Frozen):
    """An RL job as a typed dataflow graph."""

    name: str = Field(description="Job name; names the run folder.")
    description: str = Field(default="", description="Free text.")
    cluster: str | None = Field(
        default=None,
        description="Default cluster: a preset (local-cpu-1/2/4) or a YAML file relative to the job file.",
    )
    models: dict[str, ModelSpec] = Field(description="Weights by name (policy, reference, critic, ...).")
    nodes: dict[str, NodeSpec] = Field(description="Op nodes by name, wired by their 'inputs'.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="Loss and optimizer settings.")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Step unrolling.")
    placement: PlacementHints = Field(default_factory=PlacementHints, description="Placement pins.")
    run: RunSettings = Field(default_factory=RunSettings, description="Run-time settings.")

    @field_validator("name")
    @classmethod
    def _job_name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"job name {name!r} must match {NAME_PATTERN}")
        return name

    @field_validator("models", "nodes")
    @classmethod
    def _names(cls, items: dict) -> dict:
        if not items:
            raise ValueError("must not be empty")
        for name in items:
            if not _NAME.match(name):
                raise ValueError(f"name {name!r} must match {NAME_PATTERN}")
        return items

"""What the executors run: one table, and the checks generated from it.

A plan may only charge what a rank does. This module is the one place that says which layouts,
shardings, precisions, model dtypes and generation engines the executors run, and under which
conditions. It is read by:

- the placement search: for `run` and `launch` it offers nothing outside the table (`compile` may lay
  out preview-only choices a pin asks for; the preview marks them);
- the pin checks of `validate` and `compile` (a ZeRO stage on one rank, a pinned `pp` for `run`, an fp8
  trainer are refused naming the field);
- the launcher, which refuses a plan holding anything the executors cannot run before any rank starts;
- the README's "what runs" table (a test checks it against `CAPABILITIES`).

It imports neither torch nor the compiler, so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from graphrl.schemas.base import Frozen

if TYPE_CHECKING:  # types only; the plan module imports this one
    from graphrl.schemas.hardware import HardwareSpec
    from graphrl.schemas.plan import Plan

Target = Literal["run", "preview"]
"""What a compile is for: `run` (and `launch`) may hold only choices that run; `preview` (`graphrl
compile`, `simulate`) may also lay out preview-only choices that a pin asks for."""

Support = Literal["runs", "preview_only"]
ChoiceKind = Literal["axis", "sharding", "precision", "dtype", "engine"]
RoleKindName = Literal["train", "generate", "infer"]


class Capability(Frozen):
    """One choice a plan can make for a kind of role, and whether (and how) the executors run it."""

    kind: ChoiceKind = Field(description="What is chosen: a mesh axis, a training-state sharding, a compute "
                                         "precision, a model dtype or a generation engine.")
    value: str = Field(description="The choice, as a job or plan spells it (e.g. 'zero2', 'fp8', 'bfloat16').")
    roles: tuple[RoleKindName, ...] = Field(description="The kinds of role this entry is about.")
    support: Support = Field(description="runs: the search may choose it for `run`; preview_only: compiled, "
                                         "simulated and previewed when pinned, never run.")
    how: str = Field(description="How the executors run it, or why they do not.")
    requires: str = Field(default="", description="Condition under which it runs (empty: always).")


CAPABILITIES: tuple[Capability, ...] = (
    Capability(kind="axis", value="dp", roles=("train", "infer"), support="runs",
               how="data-parallel replicas of the trainer mesh (sharded or not as `sharding` says)"),
    Capability(kind="axis", value="dp", roles=("generate",), support="runs",
               how="independent generator replicas, each sampling its share of the prompts"),
    Capability(kind="axis", value="fsdp", roles=("train", "infer"), support="runs",
               how="data-parallel ranks over which `sharding` cuts the training state"),
    Capability(kind="axis", value="tp", roles=("train", "infer"), support="runs",
               how="DTensor `parallelize_module` (q/k/v/gate/up by columns, o/down by rows, vocabulary-"
                   "parallel embedding and head)"),
    Capability(kind="axis", value="tp", roles=("generate",), support="runs",
               how="graphrl's tensor-parallel sampler (KV heads replicated when tp exceeds them)"),
    Capability(kind="axis", value="pp", roles=("train", "infer"), support="preview_only",
               how="pipeline-parallel execution is not implemented: a pinned pp is compiled, simulated and "
                   "previewed, never chosen for `run`", requires="pp > 1"),
    Capability(kind="sharding", value="none", roles=("train",), support="runs",
               how="DDP: weights, gradients and AdamW state replicated; gradients all-reduced in buckets "
                   "during backward", requires="tp 1 when there is more than one data-parallel rank"),
    Capability(kind="sharding", value="zero1", roles=("train",), support="runs",
               how="DDP with torch's ZeroRedundancyOptimizer: each data-parallel rank keeps the optimizer "
                   "state of its share of the parameters and broadcasts them after its step",
               requires="more than one data-parallel rank, tp 1"),
    Capability(kind="sharding", value="zero2", roles=("train",), support="runs",
               how="FSDP2 `fully_shard(reshard_after_forward=False)`: weights, gradients and optimizer state "
                   "rest as shards; the weights are gathered once per step and kept from forward through backward (a "
                   "colocated whole generator samples from them, gathered at its weight sync)",
               requires="more than one data-parallel rank"),
    Capability(kind="sharding", value="fsdp", roles=("train",), support="runs",
               how="FSDP2 `fully_shard` (ZeRO-3): weights, gradients and optimizer state sharded, weights "
                   "gathered unit by unit (consecutive layers up to 25 MiB; a smaller model is one unit) in forward and "
                   "again in backward",
               requires="more than one data-parallel rank"),
    Capability(kind="precision", value="bf16", roles=("train", "generate", "infer"), support="runs",
               how="compute in the model's dtype"),
    Capability(kind="precision", value="fp8", roles=("generate",), support="runs",
               how="float8_e4m3fn generator weights with per-output-channel scales, quantized as the "
                   "weight sync delivers them", requires="hardware with fp8 support"),
    Capability(kind="precision", value="fp8", roles=("train", "infer"), support="preview_only",
               how="only generation copies run in fp8"),
    Capability(kind="dtype", value="float32", roles=("train", "generate", "infer"), support="runs",
               how="float32 weights and gradients, AdamW moments in float32 (4 + 4 + 8 bytes per parameter)"),
    Capability(kind="dtype", value="bfloat16", roles=("train", "generate", "infer"), support="runs",
               how="bf16 weights and gradients, float32 master weights and AdamW moments (2 + 2 + 12 bytes "
                   "per parameter)"),
    Capability(kind="dtype", value="float16", roles=("generate", "infer"), support="runs",
               how="float16 weights for forward passes"),
    Capability(kind="dtype", value="float16", roles=("train",), support="preview_only",
               how="float16 training needs loss scaling, which the trainer does not do"),
    Capability(kind="engine", value="native", roles=("generate",), support="runs",
               how="graphrl's own KV-cache sampler (tensor-parallel when tp > 1)"),
    Capability(kind="engine", value="vllm", roles=("generate",), support="runs",
               how="a vLLM engine per replica, at the model's dtype: in the rank's process, or with tp > 1 on the "
                   "replica's first rank with a worker per rank; weights reloaded in place after every sync (a LoRA "
                   "model's adapters through vLLM's LoRA path, a new adapter id per version); "
                   "colocated with the trainer on GPUs it sleeps between its generations",
               requires="vllm installed, and pinned (the search never picks an engine)"),
)


def capability(kind: ChoiceKind, value: str, role: str) -> Capability | None:
    """The table's entry for `value` of `kind` on a role of kind `role`, or None if it has none."""
    return next((c for c in CAPABILITIES if c.kind == kind and c.value == value and role in c.roles), None)


def runs(kind: ChoiceKind, value: str, role: str) -> bool:
    """Whether the table says the executors run `value` of `kind` for a role of kind `role`."""
    entry = capability(kind, value, role)
    return entry is not None and entry.support == "runs"


@dataclass(frozen=True)
class Refusal:
    """A choice of a layout the executors do not run: the field that makes it, why, and the fix."""

    field: str
    why: str
    fix: str


def train_layout_refusal(*, dp: int, fsdp: int, tp: int, pp: int, sharding: str) -> Refusal | None:
    """Why the executors cannot run a trainer mesh of this shape and sharding, or None when they can.

    Read from `CAPABILITIES`: pp > 1 is preview-only; a ZeRO stage (zero1/zero2/fsdp) needs more than one
    data-parallel rank to shard over; a tensor-parallel trainer's data-parallel ranks go through FSDP2
    (DDP takes no DTensors), so with tp > 1 and data parallelism only zero2 and fsdp run."""
    if pp > 1 and not runs("axis", "pp", "train"):
        return Refusal("pp", f"pp {pp}: {capability('axis', 'pp', 'train').how}",  # type: ignore[union-attr]
                       "drop the pin (pp 1) to let the search choose a layout that runs")
    if not runs("sharding", sharding, "train"):
        return Refusal("sharding", f"sharding {sharding!r} does not run", "use none, zero1, zero2 or fsdp")
    data_parallel = dp * fsdp
    if sharding != "none" and data_parallel == 1:
        return Refusal("sharding", f"sharding {sharding!r} on one data-parallel rank has nothing to shard over "
                                   f"(dp {dp} x fsdp {fsdp})",
                       "use sharding: none, or give the trainer more than one data-parallel rank")
    if tp > 1 and data_parallel > 1 and sharding in ("none", "zero1"):
        return Refusal("sharding", f"sharding {sharding!r} with tp {tp} over {data_parallel} data-parallel ranks: "
                                   "a tensor-parallel trainer's data-parallel ranks are sharded by FSDP2 (DDP takes "
                                   "no DTensors), which keeps gradients sharded",
                       "use sharding: zero2 or fsdp, or tp: 1")
    return None


def precision_refusal(role_kind: str, precision: str, *, hardware_fp8: bool, moe: bool = False,
                      lora: bool = False) -> Refusal | None:
    """Why a role of `role_kind` cannot compute in `precision` on hardware with (or without) fp8 support (and
    for a mixture-of-experts model, `moe`, or a model with LoRA adapters, `lora`)."""
    if precision == "fp8" and lora:
        return Refusal("precision", "fp8 generation quantizes the block linears, which a LoRA model's adapters wrap",
                       "use precision: bf16 for this model's generation copy, or lora.sync: merged (the generator "
                       "then holds merged weights)")
    if precision == "fp8" and moe:
        return Refusal("precision", "fp8 generation quantizes dense linears; a mixture-of-experts model's stacked "
                       "experts are not quantized", "use precision: bf16 for this model's generation copy")
    if not runs("precision", precision, role_kind):
        entry = capability("precision", precision, role_kind)
        return Refusal("precision", entry.how if entry else f"precision {precision!r} does not run",
                       "use precision: bf16 (fp8 applies to a generation copy, '<model>/generate')")
    if precision == "fp8" and not hardware_fp8:
        return Refusal("precision", "this hardware has no fp8 support (peak_fp8_flops is 0)",
                       "use precision: bf16, or hardware with fp8 (e.g. h100-sxm-80gb)")
    return None


def dtype_refusal(role_kind: str, dtype: str) -> Refusal | None:
    """Why a role of `role_kind` cannot run a model of `dtype`, or None."""
    if runs("dtype", dtype, role_kind):
        return None
    entry = capability("dtype", dtype, role_kind)
    return Refusal("dtype", f"a {dtype} model cannot be trained: {entry.how}" if entry else
                   f"dtype {dtype!r} does not run", "use dtype: bfloat16 or float32 for a trained model")


def generator_reads_trainer(*, colocated: bool, gen_tp: int, precision: str, train_tp: int, sharding: str,
                            one_unit: bool) -> bool:
    """Whether a colocated generation copy samples from its trainer's own weights instead of a copy of its own.

    It does when the copy would be the trainer's weights exactly (a whole, tp-1 copy at the model's
    precision beside a tp-1 trainer) and the trainer holds them whole on every rank from the weight sync
    until its next backward: replicated (`none`, `zero1`), or gathered by FSDP2 at the sync and kept
    through the next forward and backward (`zero2`; `fsdp` when the model is one FSDP2 unit, `one_unit`,
    whose root keeps its weights through backward). The sync is then the gather, or nothing, and the
    training step's forward finds the weights gathered already. A vLLM engine keeps its own copy, filled
    from the role's module; its module is still the trainer's."""
    whole_through_backward = sharding in ("none", "zero1", "zero2") or (sharding == "fsdp" and one_unit)
    return colocated and gen_tp == 1 and train_tp == 1 and precision != "fp8" and whole_through_backward


def hardware_has_fp8(hw: "HardwareSpec") -> bool:
    """Whether fp8 generation runs on `hw` (the one place that decides it; today: hardware with an fp8
    peak, i.e. fp8 tensor cores)."""
    return hw.peak_fp8_flops > 0


@dataclass(frozen=True)
class PlanRefusal:
    """A choice of a plan's chosen layout that the executors do not run, with the plan field it sits in."""

    role: str
    refusal: Refusal

    def message(self) -> str:
        return f"role {self.role!r}: {self.refusal.why}"


def plan_refusals(plan: "Plan") -> list[PlanRefusal]:
    """Every choice of `plan.chosen` that the executors do not run (empty: the plan runs)."""
    out: list[PlanRefusal] = []
    fp8 = hardware_has_fp8(plan.hardware)
    for p in plan.chosen.placements:
        spec = plan.job.models[p.model].lora
        lora = spec is not None and (p.kind == "train" or not spec.merged)  # the role holds adapters
        found = [dtype_refusal(p.kind, plan.job.models[p.model].dtype),
                 precision_refusal(p.kind, p.precision, hardware_fp8=fp8, lora=lora)]
        if p.kind == "train":
            found.append(train_layout_refusal(dp=p.dp, fsdp=p.fsdp, tp=p.tp, pp=p.pp, sharding=p.sharding))
        elif p.pp > 1:
            found.append(Refusal("pp", f"pp {p.pp}: pipeline-parallel execution is not implemented",
                                 "drop the pin (pp 1)"))
        out += [PlanRefusal(p.role, r) for r in found if r is not None]
    return out


def what_runs_rows() -> list[tuple[str, str, str, str, str]]:
    """(choice kind, value, role kinds, how it runs, condition) of every entry that runs."""
    return [(c.kind, c.value, ", ".join(c.roles), c.how, c.requires or "always")
            for c in CAPABILITIES if c.support == "runs"]


def what_runs_markdown() -> str:
    """The README's "what runs" table, generated from `CAPABILITIES` (a test checks the README holds it):
    every choice the search can make for `run`, then the preview-only ones."""
    lines = ["| choice | value | roles | how it runs | when |", "|---|---|---|---|---|"]
    lines += [f"| {kind} | `{value}` | {roles} | {how} | {when} |" for kind, value, roles, how, when in what_runs_rows()]
    lines += ["", "Preview only (`graphrl compile` lays them out when pinned; `run` and `launch` refuse them):", "",
              "| choice | value | roles | why |", "|---|---|---|---|"]
    lines += [f"| {c.kind} | `{c.value}` | {', '.join(c.roles)} | {c.how} |"
              for c in CAPABILITIES if c.support == "preview_only"]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m graphrl.schemas.capabilities: the README table
    print(what_runs_markdown())


__all__ = ["CAPABILITIES", "Capability", "PlanRefusal", "Refusal", "Target", "capability", "dtype_refusal",
           "generator_reads_trainer", "hardware_has_fp8", "plan_refusals", "precision_refusal", "runs", "train_layout_refusal",
           "what_runs_markdown", "what_runs_rows"]

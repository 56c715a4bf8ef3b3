"""A trained policy out of a run folder, for use outside graphrl: `graphrl export`.

A checkpoint holds a LoRA-trained policy as its adapters only (`<proj>.lora_A.weight` [rank, in] and
`<proj>.lora_B.weight` [out, rank]), and a fully trained one as its whole weights. `export_run` writes either
as a Hugging Face folder that `transformers` loads (the adapters folded into their projections,
W + scaling * B A), or a LoRA policy as a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` puts on its base.

The folder is written as a temporary sibling and renamed into place, so an interrupted export leaves OUT as it
was; `force` replaces only a folder an earlier export wrote (its marker lists the files), never another.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import load_file, save_file
from torch import Tensor

from graphrl.errors import DataError, GraphRLWarning
from graphrl.executors.models.lora import merge_adapters
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.sharding import is_adapter, lora_modules, lora_params
from graphrl.writes import writable_folder, write_folder

EXPORT_MARKER = ".graphrl-export.json"
PEFT_PREFIX = "base_model.model."  # PEFT's adapter files name a tensor by its path inside the wrapped model


def check_adapters(adapters: Mapping[str, Tensor], dims: ModelDims, lora: LoraSpec) -> None:
    """Refuse adapters that are not exactly the ones `lora` gives a model of `dims` (names and shapes)."""
    expected = {p.name: tuple(p.shape) for p in lora_params(dims, lora)}
    held = {name: tuple(t.shape) for name, t in adapters.items()}
    missing, unexpected = sorted(expected.keys() - held.keys()), sorted(held.keys() - expected.keys())
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"holds {unexpected[0]}, which"
        raise DataError(f"the adapters {what} the model's LoRA (rank {lora.rank}, targets {lora.targets}) "
                        f"{'needs' if missing else 'does not have'} "
                        f"({len(missing)} missing, {len(unexpected)} unexpected)",
                        fix="export a checkpoint written by the run of this plan")
    for name, shape in expected.items():
        if held[name] != shape:
            raise DataError(f"adapter {name} has shape {list(held[name])}; the model's LoRA needs {list(shape)}",
                            fix="export a checkpoint written by the run of this plan")


def save_peft_adapter(folder: str | Path, adapters: Mapping[str, Tensor], lora: LoraSpec, dims: ModelDims,
                      base: str | None) -> Path:
    """The adapters as a PEFT LoRA folder: `adapter_config.json` and `adapter_model.safetensors`. `base` is
    the checkpoint they were trained on (None: a random init, which only this run's plan rebuilds)."""
    check_adapters(adapters, dims, lora)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    alpha = lora.scaling * lora.rank  # PEFT scales by lora_alpha / r
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, *_ in lora_modules(dims, lora)}),
        "bias": "none", "base_model_name_or_path": base, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {PEFT_PREFIX + name: t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def check_export_target(out: Path, run_dir: Path, force: bool) -> Path:
    """The absolute folder an export may write (`writes.writable_folder`)."""
    return writable_folder(out, label="OUT", command="export", marker=EXPORT_MARKER, force=force, inputs=[run_dir],
                           example="`-o exports/policy`")


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, merge: bool = True,
               force: bool = False) -> str:
    """Write the trained policy of run folder `run_dir`, at its newest intact checkpoint or after `step`,
    into `out`: a Hugging Face folder (`merge`) or a PEFT adapter folder. Returns what was written, in words."""
    from graphrl.executors.outputs import checkpoint_problem, latest_checkpoint, read_meta
    from graphrl.executors.roles import initial_module
    from graphrl.models import export_trained
    from graphrl.plan_io import load_plan

    run_dir, out = Path(run_dir), Path(out)
    target = check_export_target(out, run_dir, force)
    root = run_dir / "checkpoints"
    if step is None:
        found = latest_checkpoint(run_dir, say=lambda message: warnings.warn(message, GraphRLWarning))
        if found is None:
            raise DataError(f"run folder {run_dir} holds no intact checkpoint (in {root})",
                            fix="export a run that wrote one (schedule.checkpoint_every, or the end of the run)")
        checkpoint = found
    else:
        checkpoint = root / f"step_{step:06d}"
        if not checkpoint.is_dir():
            steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                           if p.is_dir() and p.name.removeprefix("step_").isdigit())
            raise DataError(f"run folder {run_dir} has no checkpoint after step {step}",
                            fix=f"pick one of steps {', '.join(map(str, steps))}" if steps else
                            "export a run that wrote a checkpoint")
        problem = checkpoint_problem(checkpoint)
        if problem is not None:
            raise DataError(f"checkpoint {checkpoint} is damaged: {problem}", fix="export an earlier step")
    plan = load_plan(run_dir / "plan.msgpack")
    assert plan.bindings is not None
    model = plan.bindings.policy_model
    meta = read_meta(checkpoint)
    entry = meta["roles"].get(model)
    if entry is None:
        raise DataError(f"checkpoint {checkpoint} holds no weights of the policy {model!r}",
                        fix="export a checkpoint written by the run of this plan")
    spec = plan.job.models[model]
    dims = spec.resolved_dims()
    weights = load_file(str(checkpoint / entry["file"]))
    lora = LoraSpec.model_validate(entry["lora"]) if entry.get("lora") is not None else None
    where = f"{model} after step {meta['step']}"
    if not merge and lora is None:
        raise DataError(f"checkpoint {checkpoint}: {model} was trained whole (its model declares no lora), so "
                        "there is no adapter to export",
                        fix="export the whole model: drop --adapter (--merge is the default)")
    said = ""

    def fill(folder: Path) -> None:
        nonlocal said
        if not merge:
            assert lora is not None
            save_peft_adapter(folder, weights, lora, dims, entry.get("base"))
            said = f"a PEFT LoRA adapter of {where}"
            if not entry.get("base"):
                said += " (its base is a random init: --merge writes a model that stands alone)"
        elif lora is not None:
            check_adapters(weights, dims, lora)
            base = {name: t for name, t in initial_module(plan.job, model).state_dict().items() if not is_adapter(name)}
            export_trained(folder, dims, merge_adapters(base, weights, lora), spec.checkpoint)
            said = f"a Hugging Face model of {where}, its LoRA adapters merged"
        else:
            export_trained(folder, dims, weights, spec.checkpoint)
            said = f"a Hugging Face model of {where}"

    write_folder(target, fill, EXPORT_MARKER, {"run": str(run_dir.resolve()), "checkpoint": checkpoint.name})
    return said


__all__ = ["EXPORT_MARKER", "check_adapters", "check_export_target", "export_run", "merge_adapters",
           "save_peft_adapter"]

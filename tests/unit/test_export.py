"""`graphrl export`: a run folder's trained policy as a folder other libraries load. A LoRA policy's PEFT
adapter, put by `peft` on the base saved from the run's initial model, and its merged Hugging Face folder,
loaded by `transformers`, give our adapted model's logits (fp32); a full run exports its weights; an export
refuses a run without checkpoints, --adapter of a run trained whole, and an OUT it did not write.

The run folders are built by hand (a compiled plan, a checkpoint folder with its manifest), so no rank runs.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from graphrl.cli import main
from graphrl.errors import DataError
from graphrl.executors.models.hf_checkpoint import save_hf_state
from graphrl.executors.models.lora import adapter_state, merged_state
from graphrl.executors.outputs import checkpoint_folders, finish_checkpoint
from graphrl.executors.roles import initial_module
from graphrl.models.adapters import EXPORT_MARKER, export_run, merge_adapters
from graphrl.plan_io import save_plan
from graphrl.schemas.model import LORA_TARGETS, LoraSpec
from graphrl.schemas.plan import Plan
from graphrl.schemas.sharding import is_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REL_TOL = 1e-5
STEP = 3


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _plan(folder: Path, lora: str | None) -> Plan:
    """grpo_tiny compiled as a run compiles it, its policy with `lora` added (a YAML flow mapping)."""
    from graphrl.compiler.compile import compile_job
    from graphrl.loader import job_cluster, load_job

    text = (EXAMPLES / "grpo_tiny.yaml").read_text()
    if lora is not None:
        text = text.replace("    preset: tiny-digits-tied\n", f"    preset: tiny-digits-tied\n    lora: {lora}\n")
        assert "lora:" in text
    folder.mkdir(parents=True)
    (folder / "job.yaml").write_text(text)
    loaded = load_job(folder / "job.yaml")
    return compile_job(loaded, job_cluster(loaded, None), target="run")


def _run_folder(run: Path, plan: Plan, weights: dict[str, torch.Tensor], role_extra: dict) -> Path:
    """`run` as a run leaves it after step STEP: plan.msgpack and one intact checkpoint whose policy file
    holds `weights` (its meta.json entry also holding `role_extra`), written as a run writes it."""
    import torch.distributed.checkpoint as dcp

    save_plan(plan, run / "plan.msgpack")
    partial, final = checkpoint_folders(run, STEP)
    with warnings.catch_warnings():  # single-process DCP says it assumes one process: it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {}, "optim": {"step": torch.tensor(STEP)}}, checkpoint_id=str(partial / "dcp" / "policy"))
    finish_checkpoint(partial, final, STEP, {"policy": SimpleNamespace(version=STEP)}, {"policy": weights}, seed=0,
                      inflight_steps=[], role_extra={"policy": role_extra})
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(run folder, our adapted model as trained): random adapters (B too, not zero) on the run's start."""
    root = tmp_path_factory.mktemp("lora_run")
    plan = _plan(root / "job", "{rank: 4, alpha: 6}")
    model = initial_module(plan.job, "policy")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    lora = plan.job.models["policy"].lora
    run = _run_folder(root / "run", plan, adapter_state(model),
                      {"lora": lora.model_dump(mode="json"), "base": None})
    return run, model.eval()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(2))


def test_peft_puts_the_exported_adapter_on_the_base_and_gets_our_logits(lora_run, tmp_path) -> None:
    run, ours = lora_run
    result = CliRunner().invoke(main, ["export", str(run), "--adapter", "-o", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'adapter'}: a PEFT LoRA adapter of policy after step {STEP}" in result.stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 6, None)
    assert config["target_modules"] == sorted(LORA_TARGETS)  # all-linear
    base = {name: t for name, t in ours.state_dict().items() if not is_adapter(name)}
    save_hf_state(base, ours.dims, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    # Every adapter was loaded: none of PEFT's is left at its init (B at zero).
    lora_b = [p for n, p in theirs.named_parameters() if "lora_B" in n]
    assert len(lora_b) == len(adapter_state(ours)) // 2 and all(p.abs().sum() > 0 for p in lora_b)
    ids = _ids(ours.dims.vocab_size)
    with torch.no_grad():
        want = ours(ids)
        assert _relative(theirs(input_ids=ids).logits, want) <= REL_TOL
        with theirs.disable_adapter():  # and the adapter is what makes the difference
            assert _relative(theirs(input_ids=ids).logits, want) > 100 * REL_TOL


def test_the_merged_export_loads_in_transformers_and_gets_our_logits(lora_run, tmp_path) -> None:
    run, ours = lora_run
    said = export_run(run, tmp_path / "merged")
    assert said == f"a Hugging Face model of policy after step {STEP}, its LoRA adapters merged"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = _ids(ours.dims.vocab_size)
    with torch.no_grad():
        assert _relative(hf(input_ids=ids).logits, ours(ids)) <= REL_TOL
    # The merge from files is the merge the module does.
    lora = LoraSpec(rank=4, alpha=6)
    base = {name: t for name, t in ours.state_dict().items() if not is_adapter(name)}
    merged, want = merge_adapters(base, adapter_state(ours), lora), merged_state(ours)
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)
    assert json.loads((tmp_path / "merged" / EXPORT_MARKER).read_text())["checkpoint"] == f"step_{STEP:06d}"


def test_a_run_trained_whole_exports_its_weights_and_has_no_adapter(tmp_path) -> None:
    plan = _plan(tmp_path / "job", None)
    weights = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(4))
               for k, v in initial_module(plan.job, "policy").state_dict().items()}
    run = _run_folder(tmp_path / "run", plan, weights, {})
    export_run(run, tmp_path / "out", step=STEP)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    result = CliRunner().invoke(main, ["export", str(run), "--adapter", "-o", str(tmp_path / "adapter")])
    assert result.exit_code == 2
    assert "policy was trained whole" in result.stderr and "fix: export the whole model" in result.stderr
    assert not (tmp_path / "adapter").exists()


def test_refusals_name_the_folder_and_the_fix(lora_run, tmp_path) -> None:
    run, _ = lora_run
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(DataError, match=f"run folder {bare} holds no intact checkpoint") as no_checkpoint:
        export_run(bare, tmp_path / "out")
    assert no_checkpoint.value.fix and "checkpoint_every" in no_checkpoint.value.fix
    with pytest.raises(DataError, match="no checkpoint after step 9") as no_step:
        export_run(run, tmp_path / "out", step=9)
    assert no_step.value.fix == f"pick one of steps {STEP}"
    # A folder the user filled is never written into, --force or not.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for extra in ([], ["--force"]):
        result = CliRunner().invoke(main, ["export", str(run), "-o", str(mine), *extra])
        assert result.exit_code == 2, result.output
        assert f"OUT {mine}" in result.stderr and "fix: name a new folder" in result.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # An earlier export is replaced only with --force, and then whole: no adapter file is left beside a model.
    out = tmp_path / "out"
    export_run(run, out, merge=False)
    with pytest.raises(Exception, match="not empty") as again:
        export_run(run, out)
    assert "--force" in (again.value.fix or "")
    export_run(run, out, force=True)
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()


def test_merging_refuses_adapters_that_do_not_fit() -> None:
    lora = LoraSpec(rank=2)
    state = {"layer.q_proj.weight": torch.zeros(6, 4)}
    fits = {"layer.q_proj.lora_A.weight": torch.ones(2, 4), "layer.q_proj.lora_B.weight": torch.ones(6, 2)}
    assert torch.equal(merge_adapters(state, fits, lora)["layer.q_proj.weight"], torch.full((6, 4), 2.0 * lora.scaling))
    with pytest.raises(DataError, match="adapts other.q_proj.weight, which the base weights do not have"):
        merge_adapters(state, {k.replace("layer", "other"): v for k, v in fits.items()}, lora)
    with pytest.raises(DataError, match=r"a rank-2 adapter of its \[6, 4\] weight"):
        merge_adapters(state, {**fits, "layer.q_proj.lora_A.weight": torch.ones(2, 5)}, lora)

"""Real models for graphrl: Hugging Face Llama folders and GGUF files, with their tokenizers.

    from graphrl.models import from_pretrained
    model, tokenizer = from_pretrained("path/to/SmolLM2-135M-Instruct", dtype=torch.float32)
    logits = model(input_ids)            # [batch, seq, vocab], float32

The model is graphrl's own `Llama` (the module the executors train and sample from); `save_pretrained`
writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` reads back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from graphrl.executors.models.llama import Llama, save_hf_checkpoint
from graphrl.models.checkpoints import checkpoint_dims, is_gguf, load_state
from graphrl.models.tokenizer import Tokenizer, load_tokenizer
from graphrl.schemas.model import ModelDims

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _has_tokenizer(path: Path) -> bool:
    return is_gguf(path) or any((path / name).is_file() for name in _TOKENIZER_FILES)


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> tuple[Llama, Tokenizer | None]:
    """(model, tokenizer) from a Hugging Face Llama folder or a GGUF file (dequantized once, here).

    The tokenizer is None for a folder that holds only weights.
    """
    path = Path(path)
    dims, state = load_state(path)
    model = Llama(dims, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = load_tokenizer(path) if _has_tokenizer(path) else None
    return model, tokenizer


def save_pretrained(model: Llama, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """config.json + model.safetensors (+ the tokenizer and its chat template) that `transformers` loads."""
    folder = Path(folder)
    save_hf_checkpoint(model, model.dims, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def import_checkpoint(source: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                      progress: Callable[[str], None] | None = None) -> Path:
    """Convert a GGUF file (or copy a folder) once into a safetensors folder with its tokenizer."""
    source, out_dir = Path(source), Path(out_dir)
    say = progress or (lambda _stage: None)
    say("reading weights")
    dims, state = load_state(source)
    say("building model")
    model = Llama(dims, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(dtype)
    say("reading tokenizer")
    tokenizer = load_tokenizer(source) if _has_tokenizer(source) else None
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    say("writing safetensors")
    save_pretrained(model, tmp, tokenizer)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


__all__ = ["checkpoint_dims", "export_trained", "from_pretrained", "import_checkpoint", "load_tokenizer", "save_pretrained"]


def export_trained(folder: str | Path, dims: ModelDims, weights: dict[str, torch.Tensor],
                   tokenizer_source: str | Path | None) -> Path:
    """A trained policy's weights as a Hugging Face folder, with the tokenizer of the checkpoint it began from."""
    from safetensors.torch import save_file

    from graphrl.executors.models.llama import hf_config_from_dims

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    dtype = next(iter(tensors.values())).dtype
    (folder / "config.json").write_text(json.dumps(hf_config_from_dims(dims, dtype), indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_source is not None and _has_tokenizer(Path(tokenizer_source)):
        load_tokenizer(tokenizer_source).save_pretrained(str(folder))
    return folder

"""Real models for graphrl: Hugging Face Llama folders and GGUF files, with their tokenizers.

    from graphrl.models import from_pretrained
    model, tokenizer = from_pretrained("path/to/SmolLM2-135M-Instruct", dtype=torch.float32)
    logits = model(input_ids)            # [batch, seq, vocab], float32

The model is graphrl's own `Llama` (the module the executors train and sample from); `save_pretrained`
writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` reads back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from graphrl.executors.models.llama import Llama
from graphrl.executors.models.hf_checkpoint import save_hf_checkpoint, save_hf_state
from graphrl.models.checkpoints import checkpoint_dims, is_gguf, load_state
from graphrl.models.tokenizer import Tokenizer, load_tokenizer
from graphrl.schemas.model import ModelDims
from graphrl.writes import writable_folder, write_folder

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: Path) -> bool:
    """Whether a checkpoint holds a tokenizer (a GGUF file always does)."""
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
    tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
    return model, tokenizer


def save_pretrained(model: Llama, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """config.json + model.safetensors (+ the tokenizer and its chat template) that `transformers` loads."""
    folder = Path(folder)
    save_hf_checkpoint(model, model.dims, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


IMPORT_MARKER = ".graphrl-import.json"


def check_import_target(source: Path, out_dir: Path, force: bool) -> Path:
    """The absolute folder an import may write (`writes.writable_folder`)."""
    return writable_folder(out_dir, label="OUT_DIR", command="import", marker=IMPORT_MARKER, force=force,
                           inputs=[source], example="`graphrl import SRC models/NAME`")


def import_checkpoint(source: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                      progress: Callable[[str], None] | None = None, force: bool = False) -> Path:
    """Convert a GGUF file (or copy a folder) once into a safetensors folder with its tokenizer.

    Never deletes what it did not write: `out_dir` must be new or empty, or with `force` an earlier
    import (recognised by its marker file, which lists the files it wrote). The folder is written as a
    temporary sibling and renamed into place, so an interrupted import leaves `out_dir` as it was."""
    source, out_dir = Path(source), Path(out_dir)
    target = check_import_target(source, out_dir, force)
    say = progress or (lambda _stage: None)
    say("reading weights")
    dims, state = load_state(source)
    say("building model")
    model = Llama(dims, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(dtype)
    say("reading tokenizer")
    tokenizer = load_tokenizer(source) if has_tokenizer(source) else None
    say("writing safetensors")
    write_folder(target, lambda folder: save_pretrained(model, folder, tokenizer), IMPORT_MARKER,
                 {"source": str(source.resolve()), "dtype": str(dtype)})
    return out_dir


__all__ = ["IMPORT_MARKER", "check_import_target", "checkpoint_dims", "export_trained", "from_pretrained", "has_tokenizer", "import_checkpoint", "load_tokenizer", "save_pretrained"]


def export_trained(folder: str | Path, dims: ModelDims, weights: dict[str, torch.Tensor],
                   tokenizer_source: str | Path | None) -> Path:
    """A trained policy's weights as a Hugging Face folder, with the tokenizer of the checkpoint it began from."""
    folder = Path(folder)
    save_hf_state(weights, dims, folder)
    if tokenizer_source is not None and has_tokenizer(Path(tokenizer_source)):
        load_tokenizer(tokenizer_source).save_pretrained(str(folder))
    return folder

"""Reading a Llama checkpoint from a Hugging Face folder or a GGUF file, and writing one back.

A folder (config.json + model.safetensors, or sharded with model.safetensors.index.json) is read by the
executor's own loader; a GGUF file is read through `transformers` (which dequantizes it with the `gguf`
package) once, and `import_checkpoint` writes it out as a folder so later runs start in a second.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graphrl.errors import GraphRLError
from graphrl.executors.models.llama import dims_from_hf_config, load_hf_checkpoint, param_shapes
from graphrl.schemas.model import ModelDims


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _require_exists(path: Path) -> None:
    if not path.exists():
        raise GraphRLError(f"checkpoint {path} does not exist",
                           fix="point `checkpoint` at a Hugging Face model folder or a .gguf file")


def _gguf_parts(path: Path) -> tuple[str, str]:
    return str(path.parent), path.name


@functools.lru_cache(maxsize=16)
def _gguf_config(path: Path) -> dict[str, Any]:
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise GraphRLError(f"reading {path} needs transformers and gguf ({exc})",
                           fix="pip install 'graphrl[real]'") from None
    folder, name = _gguf_parts(path)
    return AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()


@functools.lru_cache(maxsize=16)
def checkpoint_dims(path: str | Path) -> ModelDims:
    """The architecture of a checkpoint folder (its config.json) or GGUF file (its metadata)."""
    path = Path(path)
    _require_exists(path)
    if is_gguf(path):
        return dims_from_hf_config(_gguf_config(path))
    config_path = path / "config.json"
    if not config_path.is_file():
        raise GraphRLError(f"checkpoint {path} has no config.json",
                           fix="point `checkpoint` at a Hugging Face model folder or a .gguf file")
    return dims_from_hf_config(json.loads(config_path.read_text()))


def _gguf_state(path: Path) -> tuple[ModelDims, dict[str, Tensor]]:
    """Dequantized float32 weights of a GGUF Llama, with HF names and q/k in HF's rotary layout."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise GraphRLError(f"reading {path} needs transformers, gguf and accelerate ({exc})",
                           fix="pip install 'graphrl[real]'") from None
    folder, name = _gguf_parts(path)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise GraphRLError(f"checkpoint {path}: cannot read it as a GGUF Llama ({exc})",
                           fix="use a GGUF file of a Llama-architecture model") from None
    dims = dims_from_hf_config(hf_model.config.to_dict())
    state = hf_model.state_dict()
    expected = param_shapes(dims)
    missing = [k for k in expected if k not in state]
    if missing:
        raise GraphRLError(f"checkpoint {path}: weights {missing[:3]} are missing",
                           fix="use an unmodified GGUF export of a Llama model")
    return dims, {k: state[k].detach().clone() for k in expected}


def load_state(path: str | Path) -> tuple[ModelDims, dict[str, Tensor]]:
    """(dims, state_dict) of a folder or GGUF file; the state dict loads into `Llama(dims)` strictly."""
    path = Path(path)
    _require_exists(path)
    if is_gguf(path):
        return _gguf_state(path)
    return load_hf_checkpoint(path)

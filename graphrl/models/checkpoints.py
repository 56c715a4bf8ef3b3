"""Reading a checkpoint (Llama, Qwen2/2.5, Qwen3) from a Hugging Face folder or a GGUF file, and writing one back.

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

from graphrl.errors import DataError, GraphRLError
from graphrl.executors.models.llama import param_shapes
from graphrl.executors.models.hf_checkpoint import (check_hf_weights, dims_from_hf_config, load_hf_checkpoint,
                                                      stack_experts, state_mismatch)
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
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    except Exception as exc:  # noqa: BLE001 - a damaged file fails anywhere inside the gguf reader
        raise unreadable_gguf(path, exc) from None


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
    try:
        return dims_from_hf_config(read_config(config_path))
    except (KeyError, TypeError, ValueError) as exc:  # a dimension that is no number, or dims that cannot be
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{config_path} does not describe a model graphrl can build ({type(exc).__name__}: {reason})",
                        fix="restore config.json from the model's source (a Llama config names every dimension)") from None


def check_checkpoint(path: str | Path) -> ModelDims:
    """What a rank loading `path` would refuse, found without reading its weights: its config.json (or GGUF
    metadata) read into dimensions, a folder's safetensors files present (every shard its index names), and
    every tensor in their headers the shape config.json implies."""
    path = Path(path)
    dims = checkpoint_dims(path)
    if is_gguf(path):
        return dims
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"{index_path} is not a safetensors index ({type(exc).__name__}: {exc})",
                            fix="restore it from the model's source (or run `graphrl import` again)") from None
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise DataError(f"checkpoint {path} lacks the weight shards {', '.join(missing[:3])} its index names",
                            fix="download the missing shards (or the whole model again)")
    elif not any(path.glob("*.safetensors")):
        raise DataError(f"checkpoint {path} has no *.safetensors weights",
                        fix="download the weights beside config.json, or convert the model with `graphrl import`")
    check_hf_weights(path)
    return dims


REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def read_config(config_path: Path) -> dict[str, Any]:
    """A checkpoint's config.json, refused by name when it is not JSON, not an object, or lacks a key the
    model's dimensions come from."""
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{config_path} is not valid JSON ({exc})",
                        fix="restore config.json from the model's source (or run `graphrl import` again)") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_path} holds a {type(config).__name__}, not a JSON object",
                        fix="restore config.json from the model's source")
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise DataError(f"{config_path} lacks {', '.join(map(repr, missing))}",
                        fix="restore config.json from the model's source (a Llama config names every dimension)")
    return config


def unreadable_gguf(path: Path, exc: BaseException) -> DataError:
    """The error for a GGUF file its reader fails on (most often a download cut short)."""
    reason = (str(exc).strip().splitlines() or [""])[0][:200]
    return DataError(f"checkpoint {path} cannot be read as GGUF ({type(exc).__name__}: {reason})",
                     fix="the file may be truncated: download it again and compare its size or checksum")


def _gguf_state(path: Path) -> tuple[ModelDims, dict[str, Tensor]]:
    """Dequantized float32 weights of a GGUF model, with HF names and q/k in HF's rotary layout."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise GraphRLError(f"reading {path} needs transformers, gguf and accelerate ({exc})",
                           fix="pip install 'graphrl[real]'") from None
    folder, name = _gguf_parts(path)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise GraphRLError(f"checkpoint {path}: cannot read it as a GGUF model ({exc})",
                           fix="use a GGUF file of a Llama, Qwen2 or Qwen3 model; a truncated file also fails here: "
                               "download it again") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file fails anywhere inside the gguf reader
        raise unreadable_gguf(path, exc) from None
    dims = dims_from_hf_config(hf_model.config.to_dict())
    state = stack_experts(hf_model.state_dict(), dims)
    expected = param_shapes(dims)
    if dims.tie_embeddings:
        state.pop("lm_head.weight", None)
    if (problem := state_mismatch(expected, state)) is not None:
        raise GraphRLError(f"checkpoint {path}: its weights do not match its metadata: {problem}",
                           fix="use an unmodified GGUF export of the model")
    return dims, {k: state[k].detach().clone() for k in expected}


def load_state(path: str | Path) -> tuple[ModelDims, dict[str, Tensor]]:
    """(dims, state_dict) of a folder or GGUF file; the state dict loads into `Llama(dims)` strictly."""
    path = Path(path)
    _require_exists(path)
    if is_gguf(path):
        return _gguf_state(path)
    if (path / "config.json").is_file():  # refused by name here, before the loader's own json.loads
        read_config(path / "config.json")
    try:
        return load_hf_checkpoint(path)
    except GraphRLError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged safetensors file or index fails in its reader
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DataError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {reason})",
                        fix="check its *.safetensors files (a download cut short?), or import it again") from None

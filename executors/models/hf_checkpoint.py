"""Hugging Face checkpoint folders for the native model (`llama.py`): `config.json` <-> `ModelDims`, and
safetensors weights read and written under Hugging Face's parameter names, so a trained policy is a folder
`transformers` loads and a Hugging Face Llama loads into the executors' model.

Apart from the model so that file formats and the model's definition change independently.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from graphrl.errors import GraphRLError
from graphrl.schemas.model import FAMILIES, ModelDims, RopeScaling

from graphrl.executors.models.llama import Llama, LlamaCritic, param_shapes

# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def _checkpoint_error(folder: Path, message: str, fix: str) -> GraphRLError:
    return GraphRLError(f"checkpoint {folder}: {message}", fix=fix)


# Each family's Hugging Face class, by model_type.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_experts(state: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """`state` with every layer's experts as the model holds them (`mlp.experts.gate_proj` [E, width,
    hidden], ...), from a checkpoint's one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, how
    released MoE checkpoints and vLLM name them) or transformers 5's fused `mlp.experts.gate_up_proj`."""
    if not dims.is_moe:
        return dict(state)
    out = {}
    per_expert: dict[str, dict[int, Tensor]] = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        index, _, rest = tail.partition(".")
        if index.isdigit() and rest.removesuffix(".weight") in _EXPERT_PROJECTIONS:
            per_expert.setdefault(f"{head}.mlp.experts.{rest.removesuffix('.weight')}", {})[int(index)] = tensor
        elif tail == "gate_up_proj":
            out[f"{head}.mlp.experts.gate_proj"], out[f"{head}.mlp.experts.up_proj"] = tensor.chunk(2, dim=1)
        else:
            out[name] = tensor
    for name, experts in per_expert.items():
        if sorted(experts) == list(range(dims.num_experts)):
            out[name] = torch.stack([experts[e] for e in range(dims.num_experts)])
        else:  # left as they are: the shape check names the stacked tensor missing
            head, _, projection = name.rpartition(".")
            out.update({f"{head}.{e}.{projection}.weight": tensor for e, tensor in experts.items()})
    return out


def hub_tensors(state: Iterable[tuple[str, Tensor]], dims: ModelDims) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) as a released checkpoint names them: stacked experts one tensor per expert."""
    for name, tensor in state:
        head, sep, tail = name.partition(".mlp.experts.")
        if sep and dims.is_moe and tail in _EXPERT_PROJECTIONS:
            for e in range(tensor.shape[0]):
                yield f"{head}.mlp.experts.{e}.{tail}.weight", tensor[e]
        else:
            yield name, tensor


def dims_from_hf_config(config: Mapping[str, Any]) -> ModelDims:
    """ModelDims from a Hugging Face `config.json` of a family graphrl runs (`FAMILIES`: Llama, Qwen2 and
    Qwen2.5, Qwen3), transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`).

    Raises GraphRLError for a family or a variant this model cannot represent (an o_proj or MLP bias, a
    non-SiLU activation, sliding-window attention) and warns when a RoPE scaling is ignored.
    """
    model_type = config.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise GraphRLError(
            f"config.json has model_type {model_type!r}; graphrl runs the families {', '.join(FAMILIES)}",
            fix="use a checkpoint of one of those families (Llama 2/3, SmolLM, Qwen2/2.5, Qwen3 dense ...)",
        )
    # Llama's and Qwen3's `attention_bias` puts a bias on o_proj too; Qwen2 has q/k/v biases always.
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise GraphRLError(f"config.json sets {flag}=true; graphrl's {model_type} has no such biases",
                               fix="use a checkpoint without them (every released Llama and Qwen3 has none)")
    if config.get("hidden_act", "silu") != "silu":
        raise GraphRLError(
            f"config.json has hidden_act {config['hidden_act']!r}; only 'silu' (SwiGLU) is supported",
            fix="use a checkpoint with hidden_act 'silu'",
        )
    if config.get("use_sliding_window", False):
        raise GraphRLError("config.json sets use_sliding_window=true; graphrl attends over the whole context",
                           fix="set use_sliding_window to false (the released Qwen2.5 and Qwen3 models have it off)")
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or 0)
    if model_type not in ("qwen3", "qwen3_moe") and head_dim and head_dim * num_heads != hidden_size:
        raise GraphRLError(
            f"config.json has head_dim {head_dim} but hidden_size/num_attention_heads = {hidden_size // num_heads}",
            fix="use a checkpoint whose head_dim equals hidden_size / num_attention_heads",
        )

    rope = config.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        warnings.warn(
            f"RoPE scaling {rope_type!r} in config.json is ignored (only 'llama3' scaling is supported); "
            "logits will differ from Hugging Face's, mostly at long positions",
            stacklevel=2,
        )
    moe: dict[str, Any] = {}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise GraphRLError("config.json mixes dense and mixture-of-experts layers (mlp_only_layers or "
                               "decoder_sparse_step); graphrl's MoE models route in every layer",
                               fix="use a checkpoint with experts in every layer (every released Qwen MoE model)")
        moe = {"num_experts": int(config.get("num_experts") or config["num_local_experts"]), "experts_per_token": int(config["num_experts_per_tok"]),
               "expert_intermediate_size": int(config["moe_intermediate_size"]),
               "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
               if model_type == "qwen2_moe" else 0,
               "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
               "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001))}
    return ModelDims(
        **moe,
        family=model_type,
        head_dim=head_dim,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),  # HF LlamaConfig default
        rope_theta=rope_theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
    )


def hf_config_from_dims(dims: ModelDims, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A `config.json` of the dims' family that both transformers 4.x (`rope_theta`) and 5.x
    (`rope_parameters`) read."""
    dtype_name = str(dtype).removeprefix("torch.")
    rope: dict[str, Any] = {"rope_type": "default"}
    if dims.rope_scaling is not None:
        rope = {
            "rope_type": "llama3",
            "factor": dims.rope_scaling.factor,
            "low_freq_factor": dims.rope_scaling.low_freq_factor,
            "high_freq_factor": dims.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": dims.rope_scaling.original_max_seq_len,
        }
    family_keys: dict[str, Any] = {"attention_bias": False, "mlp_bias": False}
    if dims.family == "qwen2":
        family_keys = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": dims.num_layers}
    elif dims.family in ("qwen3", "qwen3_moe"):
        family_keys = {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": dims.num_layers}
    if dims.family == "qwen2_moe":
        family_keys = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": dims.num_layers,
                       "shared_expert_intermediate_size": dims.shared_expert_intermediate_size}
    if dims.is_moe:
        family_keys.update({"num_experts": dims.num_experts, "num_experts_per_tok": dims.experts_per_token,
                            "moe_intermediate_size": dims.expert_intermediate_size, "decoder_sparse_step": 1,
                            "mlp_only_layers": [], "norm_topk_prob": dims.norm_topk_prob,
                            "router_aux_loss_coef": dims.router_aux_loss_coef, "output_router_logits": False})
    return {
        "architectures": [ARCHITECTURES[dims.family]],
        "model_type": dims.family,
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "max_position_embeddings": dims.max_seq_len,
        "rope_theta": dims.rope_theta,
        "rope_parameters": {**rope, "rope_theta": dims.rope_theta},
        "rope_scaling": rope if dims.rope_scaling is not None else None,
        "rms_norm_eps": dims.norm_eps,
        "tie_word_embeddings": dims.tie_embeddings,
        "hidden_act": "silu",
        **family_keys,
        "torch_dtype": dtype_name,
    }


def load_hf_checkpoint(folder: str | Path) -> tuple[ModelDims, dict[str, Tensor]]:
    """(dims, state_dict) from a HF Llama folder: config.json + model.safetensors or sharded shards.

    The state dict loads into `Llama(dims)` (or `LlamaCritic(dims)` when it holds `value_head.weight`)
    with `strict=True`: a tied checkpoint's duplicate `lm_head.weight` and old `rotary_emb.inv_freq`
    buffers are dropped; anything missing or misshapen is an error here, not at load_state_dict.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    dims = _folder_dims(folder)
    state_dict: dict[str, Tensor] = {}
    for shard in _shard_files(folder):
        state_dict.update(load_file(str(shard)))
    return dims, _model_state(folder, dims, state_dict)


def check_hf_weights(folder: str | Path) -> None:
    """What `load_hf_checkpoint` would refuse in a folder's weights (a tensor missing, misshapen or of another
    architecture), found from the safetensors headers alone: no weight is read."""
    from safetensors import safe_open

    folder = Path(folder)
    dims = _folder_dims(folder)
    shapes: dict[str, Tensor] = {}
    for shard in _shard_files(folder):
        try:
            with safe_open(str(shard), framework="pt") as f:
                shapes.update({name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()})
        except Exception as exc:  # noqa: BLE001 - a damaged header fails inside the reader
            raise _checkpoint_error(folder, f"{shard.name} is not a readable safetensors file ({exc})",
                                    "download it again (or run `graphrl import` again)") from None
    _model_state(folder, dims, shapes)


def _folder_dims(folder: Path) -> ModelDims:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise _checkpoint_error(folder, "has no config.json", "point `checkpoint` at a Hugging Face model folder")
    return dims_from_hf_config(json.loads(config_path.read_text()))


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those its index names, or every one."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shard_files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        shard_files = sorted(folder.glob("*.safetensors"))
    if not shard_files:
        raise _checkpoint_error(
            folder, "has no *.safetensors weights", "convert the checkpoint with save_pretrained(safe_serialization=True)"
        )
    return shard_files


def _model_state(folder: Path, dims: ModelDims, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's tensors as the model names and holds them (experts stacked, a tied head and old buffers
    dropped), refused by the first tensor that differs from what config.json implies."""
    state_dict = stack_experts({k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}, dims)
    if dims.tie_embeddings:
        state_dict.pop("lm_head.weight", None)
    expected = param_shapes(dims, "value" if "value_head.weight" in state_dict else "lm")
    if (problem := state_mismatch(expected, state_dict)) is not None:
        raise _checkpoint_error(folder, f"weights do not match config.json: {problem}",
                                "use an unmodified checkpoint (its config.json and weights from the same source)")
    return {name: state_dict[name] for name in expected}


def state_mismatch(expected: Mapping[str, tuple[int, ...]], state: Mapping[str, Any]) -> str | None:
    """The first tensor (in checkpoint order) where `state` differs from the shapes the config implies,
    said with how many more differ; None when they agree."""
    problems = [f"{name} is missing" if name not in state else
                f"{name} has shape {tuple(state[name].shape)}, the config implies {shape}"
                for name, shape in expected.items()
                if name not in state or tuple(state[name].shape) != shape]
    problems += [f"{name} is not a tensor of this architecture" for name in state if name not in expected]
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def save_hf_checkpoint(model: Llama | LlamaCritic, dims: ModelDims, folder: str | Path) -> None:
    """Write config.json + model.safetensors that `transformers` and `load_hf_checkpoint` read back."""
    save_hf_state(model.state_dict(), dims, folder)


def save_hf_state(state: Mapping[str, Tensor], dims: ModelDims, folder: str | Path) -> None:
    """`save_hf_checkpoint` of named full tensors (a model whose weights were gathered from shards)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state_dict = {name: tensor.detach().contiguous().cpu() for name, tensor in hub_tensors(state.items(), dims)}
    dtype = next(iter(state_dict.values())).dtype
    (folder / "config.json").write_text(json.dumps(hf_config_from_dims(dims, dtype), indent=2) + "\n")
    # HF refuses safetensors files without format metadata.
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})

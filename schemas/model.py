"""Model architectures: published Llama 3 presets, tiny CPU presets, or explicit dimensions."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from graphrl.schemas.base import Boolean, Frozen, Integer, Real

DType = Literal["float32", "bfloat16", "float16"]


class RopeScaling(Frozen):
    """Llama 3.1's RoPE frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between (Hugging Face `rope_type: llama3`)."""

    rope_type: Literal["llama3"] = Field(default="llama3", description="The scaling rule; only 'llama3'.")
    factor: Real = Field(gt=0, description="How much the low frequencies are slowed.")
    low_freq_factor: Real = Field(gt=0, description="Wavelengths above original_max_seq_len / this are scaled.")
    high_freq_factor: Real = Field(gt=0, description="Wavelengths below original_max_seq_len / this are kept.")
    original_max_seq_len: Integer = Field(gt=0, description="Context length the model was pre-trained with.")

    @model_validator(mode="after")
    def _ordered(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("high_freq_factor must be larger than low_freq_factor")
        return self


class ModelDims(Frozen):
    """Dimensions of a Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: Integer = Field(gt=0, description="Number of tokens in the vocabulary.")
    hidden_size: Integer = Field(gt=0, description="Width of the residual stream (d_model).")
    intermediate_size: Integer = Field(gt=0, description="Width of the SwiGLU feed-forward layer.")
    num_layers: Integer = Field(gt=0, description="Number of transformer blocks.")
    num_heads: Integer = Field(gt=0, description="Number of query heads.")
    num_kv_heads: Integer = Field(gt=0, description="Number of key/value heads (grouped-query attention).")
    max_seq_len: Integer = Field(default=8192, gt=0, description="Longest sequence (prompt + response) supported.")
    rope_theta: Real = Field(default=500000.0, gt=0, description="RoPE base frequency.")
    norm_eps: Real = Field(default=1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: Boolean = Field(default=False, description="Share the input embedding and the output head.")
    rope_scaling: RopeScaling | None = Field(default=None, description="RoPE frequency scaling (Llama 3.1+).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelDims":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Published Llama 3 / 3.1 dimensions (Meta, "The Llama 3 Herd of Models", 2024, table 3).
MODEL_PRESETS: dict[str, ModelDims] = {
    "llama3-8b": ModelDims(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, max_seq_len=131072,
    ),
    "llama3-70b": ModelDims(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, max_seq_len=131072,
    ),
    "llama3-405b": ModelDims(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
        num_heads=128, num_kv_heads=8, max_seq_len=131072,
    ),
    # Tiny models that train in seconds on a laptop CPU. The vocabulary fits the digit tasks
    # (10 digits + a few special tokens, see graphrl.tasks).
    "tiny-digits": ModelDims(
        vocab_size=16, hidden_size=64, intermediate_size=176, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=64, rope_theta=10000.0,
    ),
    # The same with a tied output head: it keeps every digit reachable under GRPO (tuned recipe).
    "tiny-digits-tied": ModelDims(
        vocab_size=16, hidden_size=64, intermediate_size=176, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=64, rope_theta=10000.0, tie_embeddings=True,
    ),
    "tiny-digits-wide": ModelDims(
        vocab_size=16, hidden_size=128, intermediate_size=352, num_layers=3,
        num_heads=4, num_kv_heads=2, max_seq_len=64, rope_theta=10000.0,
    ),
}


class ModelSpec(Frozen):
    """One set of weights: its architecture, its dtype, and where to load it from (if anywhere)."""

    preset: str | None = Field(
        default=None, description=f"Architecture preset: one of {', '.join(MODEL_PRESETS)}."
    )
    dims: ModelDims | None = Field(default=None, description="Explicit architecture (instead of a preset).")
    dtype: DType = Field(default="bfloat16", description="Dtype of the weights used for compute.")
    checkpoint: Path | None = Field(
        default=None,
        description="A Hugging Face Llama folder (config.json + *.safetensors) or a .gguf file, relative to the "
        "job file; the architecture comes from it when neither 'preset' nor 'dims' is given. Random init if unset.",
    )
    init_from: str | None = Field(
        default=None,
        description="Start from the same weights as another model of this job (e.g. reference = policy).",
    )

    @model_validator(mode="after")
    def _one_architecture(self) -> "ModelSpec":
        if self.preset is not None and self.dims is not None:
            raise ValueError("give exactly one of 'preset' or 'dims'")
        if self.preset is None and self.dims is None and self.checkpoint is None:
            raise ValueError("give exactly one of 'preset' or 'dims' (or a 'checkpoint' to read them from)")
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model preset {self.preset!r}; known presets: {', '.join(MODEL_PRESETS)}"
            )
        return self

    def resolved_dims(self) -> ModelDims:
        """The architecture: given explicitly, a preset's, or its checkpoint's (filled in when the job loaded)."""
        if self.dims is not None:
            return self.dims
        if self.preset is not None:
            return MODEL_PRESETS[self.preset]
        raise ValueError(f"the architecture of checkpoint {self.checkpoint} was never read: load the job with "
                         "graphrl.loader, which fills in its dims")

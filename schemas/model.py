"""Model architectures: published Llama 3, Qwen2.5 and Qwen3 presets, tiny CPU presets, or explicit dimensions.

One decoder describes every family graphrl runs; a family is data (`ModelDims.family` and the switches it
implies), never a copy of the model: Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), Qwen2 and
Qwen2.5 (the same with biases on the q/k/v projections), Qwen3 (no biases; an RMSNorm over each query and
key head before RoPE, and a head width of its own rather than hidden / heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from graphrl.schemas.base import Boolean, Frozen, Integer, Real

DType = Literal["float32", "bfloat16", "float16"]
# The decoder families graphrl builds, by their Hugging Face `model_type`.
Family = Literal["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
# What each family switches on unless the dims say otherwise: q/k/v biases, and per-head q/k norms.
FAMILY_DEFAULTS: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "qwen2_moe": {"qkv_bias": True, "qk_norm": False},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
}


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
    """Dimensions of a decoder of one of the `FAMILIES`: RMSNorm, RoPE, grouped-query attention, SwiGLU,
    with the family's q/k/v biases and per-head q/k norms as switches."""

    vocab_size: Integer = Field(gt=0, description="Number of tokens in the vocabulary.")
    hidden_size: Integer = Field(gt=0, description="Width of the residual stream (d_model).")
    intermediate_size: Integer = Field(gt=0, description="Width of the SwiGLU feed-forward layer.")
    num_layers: Integer = Field(gt=0, description="Number of transformer blocks.")
    num_heads: Integer = Field(gt=0, description="Number of query heads.")
    num_kv_heads: Integer = Field(gt=0, description="Number of key/value heads (grouped-query attention).")
    head_dim: Integer = Field(default=0, ge=0, description="Width of one attention head; 0 (the default) means "
                              "hidden_size / num_heads, as Llama and Qwen2 have it (Qwen3 names its own).")
    max_seq_len: Integer = Field(default=8192, gt=0, description="Longest sequence (prompt + response) supported.")
    rope_theta: Real = Field(default=500000.0, gt=0, description="RoPE base frequency.")
    norm_eps: Real = Field(default=1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: Boolean = Field(default=False, description="Share the input embedding and the output head.")
    rope_scaling: RopeScaling | None = Field(default=None, description="RoPE frequency scaling (Llama 3.1+).")
    family: Family = Field(default="llama", description=f"The architecture family (Hugging Face model_type): "
                           f"one of {', '.join(FAMILIES)}. It sets the defaults of qkv_bias and qk_norm.")
    qkv_bias: Boolean | None = Field(default=None, description="Biases on the q, k and v projections "
                                     "(default: the family's; Qwen2 has them).")
    qk_norm: Boolean | None = Field(default=None, description="An RMSNorm over each query and key head before "
                                    "RoPE (default: the family's; Qwen3 has it).")
    num_experts: Integer = Field(default=0, ge=0, description="Routed experts of every layer's feed-forward block "
                                 "(mixture of experts; 0: a dense SwiGLU block of intermediate_size).")
    experts_per_token: Integer = Field(default=0, ge=0, description="Experts each token is routed to (top-k).")
    expert_intermediate_size: Integer = Field(default=0, ge=0, description="Width of one expert's SwiGLU block.")
    shared_expert_intermediate_size: Integer = Field(default=0, ge=0, description="Width of a shared expert every "
                                                     "token passes through, gated by a sigmoid (Qwen2-MoE); 0: none.")
    norm_topk_prob: Boolean = Field(default=False, description="Renormalize the top-k routing probabilities to sum "
                                    "to 1 (Qwen3-MoE's released models do).")
    router_aux_loss_coef: Real = Field(default=0.001, ge=0, description="Weight of the load-balancing loss a "
                                       "trained mixture-of-experts model adds (Switch Transformer's, as HF computes it).")

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """Fill what the family implies, so every reader sees plain values: the switches, and head_dim."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        defaults = FAMILY_DEFAULTS.get(data.get("family", "llama"))
        if defaults is not None:
            for key, value in defaults.items():
                if data.get(key) is None:
                    data[key] = value
        heads, hidden = data.get("num_heads"), data.get("hidden_size")
        if not data.get("head_dim") and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
            if hidden % heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {heads}; "
                                 "give head_dim if the model's heads have a width of their own")
            data["head_dim"] = hidden // heads
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelDims":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd; RoPE rotates pairs of features")
        if (self.family in MOE_FAMILIES) != (self.num_experts > 0):
            raise ValueError(f"family {self.family} with num_experts {self.num_experts}: the families "
                             f"{', '.join(MOE_FAMILIES)} route to experts (num_experts > 0), the others do not")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.expert_intermediate_size):
            raise ValueError(f"a mixture of {self.num_experts} experts needs experts_per_token in 1..{self.num_experts} "
                             f"and expert_intermediate_size > 0 (got {self.experts_per_token}, "
                             f"{self.expert_intermediate_size})")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        """Width of all query heads together (hidden_size unless head_dim is a width of its own)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_kv_heads * self.head_dim


def _qwen_moe(family: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, experts: int, top_k: int,
              expert_width: int, *, shared_width: int = 0, max_seq_len: int = 40960) -> ModelDims:
    return ModelDims(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_width,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=128 if family == "qwen3_moe" else 0, max_seq_len=max_seq_len, rope_theta=1e6,
                     norm_eps=1e-6, num_experts=experts, experts_per_token=top_k, expert_intermediate_size=expert_width,
                     shared_expert_intermediate_size=shared_width, norm_topk_prob=family == "qwen3_moe")


def _qwen(family: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, *,
          tie: bool = False, max_seq_len: int = 40960) -> ModelDims:
    return ModelDims(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=128 if family == "qwen3" else 0, max_seq_len=max_seq_len, rope_theta=1e6,
                     norm_eps=1e-6, tie_embeddings=tie)


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
    # Qwen2.5 (Qwen team, "Qwen2.5 Technical Report", 2024; the released config.json files): q/k/v biases,
    # RoPE theta 1e6, RMSNorm eps 1e-6; the small ones tie their embeddings.
    "qwen2.5-0.5b": _qwen("qwen2", 151936, 896, 4864, 24, 14, 2, tie=True, max_seq_len=32768),
    "qwen2.5-1.5b": _qwen("qwen2", 151936, 1536, 8960, 28, 12, 2, tie=True, max_seq_len=32768),
    "qwen2.5-7b": _qwen("qwen2", 152064, 3584, 18944, 28, 28, 4, max_seq_len=32768),
    "qwen2.5-32b": _qwen("qwen2", 152064, 5120, 27648, 64, 40, 8, max_seq_len=32768),
    "qwen2.5-72b": _qwen("qwen2", 152064, 8192, 29568, 80, 64, 8, max_seq_len=32768),
    # Qwen3 dense (Qwen team, "Qwen3 Technical Report", 2025, table 1; the released config.json files): per-head
    # q/k norms, head_dim 128 whatever the width, no biases.
    "qwen3-0.6b": _qwen("qwen3", 151936, 1024, 3072, 28, 16, 8, tie=True),
    "qwen3-1.7b": _qwen("qwen3", 151936, 2048, 6144, 28, 16, 8, tie=True),
    "qwen3-4b": _qwen("qwen3", 151936, 2560, 9728, 36, 32, 8, tie=True),
    "qwen3-8b": _qwen("qwen3", 151936, 4096, 12288, 36, 32, 8),
    "qwen3-14b": _qwen("qwen3", 151936, 5120, 17408, 40, 40, 8),
    "qwen3-32b": _qwen("qwen3", 151936, 5120, 25600, 64, 64, 8),
    # Qwen3 mixture of experts (the same report; released configs): 128 experts of which 8 per token, every layer.
    "qwen3-30b-a3b": _qwen_moe("qwen3_moe", 151936, 2048, 48, 32, 4, 128, 8, 768),
    "qwen3-235b-a22b": _qwen_moe("qwen3_moe", 151936, 4096, 94, 64, 4, 128, 8, 1536),
    # Qwen2-57B-A14B: 64 routed experts (8 per token) and a shared expert every token passes through.
    "qwen2-57b-a14b": _qwen_moe("qwen2_moe", 151936, 3584, 28, 28, 4, 64, 8, 2560, shared_width=20480,
                                max_seq_len=32768),
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
    # The digit model as the Qwen families build it: q/k/v biases (Qwen2), or per-head q/k norms with heads
    # wider than hidden / heads (Qwen3), for CPU runs of their code paths.
    "tiny-digits-qwen2": ModelDims(
        family="qwen2", vocab_size=16, hidden_size=64, intermediate_size=176, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True,
    ),
    # A Qwen3-MoE digit model: 4 experts of which 2 per token.
    "tiny-digits-moe": ModelDims(
        family="qwen3_moe", vocab_size=16, hidden_size=64, intermediate_size=88, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-6,
        tie_embeddings=True, num_experts=4, experts_per_token=2, expert_intermediate_size=88, norm_topk_prob=True,
    ),
    "tiny-digits-qwen3": ModelDims(
        family="qwen3", vocab_size=16, hidden_size=64, intermediate_size=176, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-6,
        tie_embeddings=True,
    ),
}


# The projections LoRA adapters may wrap, by their module's last name; `all-linear` is every one a model
# has (the attention's four, the dense feed-forward's three, a shared expert's three), never the output head,
# the embedding, a router or the stacked routed experts.
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(Frozen):
    """Low-rank adapters on a trained model (Hu et al., 2021): each targeted projection W x becomes
    W x + (alpha / rank) B A x with A [rank, in] and B [out, rank]; W is frozen, only A and B train."""

    rank: Integer = Field(gt=0, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: Real = Field(default=0.0, ge=0, description="Scale numerator: the update is (alpha / rank) B A x; "
                        "0 (the default) means alpha = 2 * rank.")
    dropout: Real = Field(default=0.0, ge=0, lt=1, description="Dropout on an adapter's input while training.")
    targets: Literal["all-linear"] | tuple[str, ...] = Field(
        default="all-linear", description=f"Projections that get adapters, by name ({', '.join(LORA_TARGETS)}), "
        "or 'all-linear' for every one the model has.")
    base_reference: Boolean = Field(
        default=True, description="A frozen model of this job initialised from this one (init_from) runs as this "
        "model's base with the adapters switched off: no second copy of the weights. false: it keeps its own copy.")
    sync: Literal["adapters", "merged"] = Field(
        default="adapters", description="What a weight sync moves into a generator of its own: 'adapters' (it keeps the "
        "base it loaded and applies them), or 'merged' (the trainer folds them into its weights, a staging group of "
        "layers at a time, and the generator holds a plain model: full weights cross, and fp8 generators run).")

    @model_validator(mode="after")
    def _known_targets(self) -> "LoraSpec":
        if isinstance(self.targets, tuple):
            if not self.targets:
                raise ValueError("targets is empty; name projections or use 'all-linear'")
            unknown = [t for t in self.targets if t not in LORA_TARGETS]
            if unknown:
                raise ValueError(f"unknown LoRA target {unknown[0]!r}; targets are projections: "
                                 f"{', '.join(LORA_TARGETS)}, or 'all-linear'")
        return self

    @property
    def merged(self) -> bool:
        """Whether weight syncs send the weights with the adapters folded in (a plain generator)."""
        return self.sync == "merged"

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on B A x."""
        return (self.alpha or 2.0 * self.rank) / self.rank

    def wraps(self, module: str) -> bool:
        """Whether the projection `module` (its last name, e.g. `q_proj`) gets an adapter."""
        return module in LORA_TARGETS and (self.targets == "all-linear" or module in self.targets)


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
    lora: LoraSpec | None = Field(
        default=None, description="Train low-rank adapters instead of the weights (a trained model only): the base "
        "is frozen, optimizer state is the adapters', weight syncs move the adapters alone.")

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

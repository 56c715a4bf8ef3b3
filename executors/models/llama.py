"""A native PyTorch Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) for RL on LLMs.

Why not `transformers`: an RL job needs three things from its model and they must agree to the last
bit of arithmetic: sampling with a KV cache (`generate`), teacher-forced log-probs of the sampled
tokens (`token_logprobs`) and a critic on the same trunk (`LlamaCritic`). Owning ~400 lines makes
that agreement testable and keeps the model free of framework state.

Parameter names are exactly Hugging Face `LlamaForCausalLM`'s (`model.layers.{i}.self_attn.q_proj.weight`,
...), so HF checkpoints load with `load_state_dict` and the weight-sync planner can reason about names
and shapes from `param_shapes(dims)` without building a model.

Conventions: B sequences, T tokens per forward, P prompt tokens, R response tokens, V vocabulary,
S key slots. Masks are bool, True = real token. Prompts are left-padded (the last prompt column is a
real token of every row); responses are right-padded (True up to and including EOS). Position ids
count real tokens only (`cumsum(mask) - 1`), so padding never changes a real token's result, and
scoring may drop the padding altogether (`PackedSequences`: every row's real tokens in one row).
"""

from __future__ import annotations

import json
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphrl.errors import GraphRLError
from graphrl.schemas.model import ModelDims, RopeScaling
from graphrl.schemas.sharding import Head, llama_param_count, llama_params

# `enable_gqa` lets SDPA read the un-repeated K/V heads; without it (torch < 2.5) we repeat K/V,
# which costs a copy of the whole cache per decode step.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)



# ----------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 as in HF so bf16 models match it."""

    def __init__(self, hidden_size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x_f32 = x.float()
        x_f32 = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_f32.to(input_dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """Float32 RoPE frequencies [head_dim / 2], with Llama 3.1's scaling when the checkpoint has one."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # Wavelengths longer than the pre-training context are slowed by `factor`, short ones kept, and the
    # band between blends the two linearly in (context / wavelength).
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    positions_bt: Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, head_dim] for rotate-half RoPE (HF Llama layout: frequencies repeated twice).

    Angles are computed in float32 whatever the model dtype: at long positions bf16 angles are wrong
    by whole radians.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(positions_bt.device)
    angles_btf = positions_bt.float()[..., None] * inv_freq
    angles_btd = torch.cat((angles_btf, angles_btf), dim=-1)
    return angles_btd.cos().to(dtype), angles_btd.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_bhtd: Tensor, cos_btd: Tensor, sin_btd: Tensor) -> Tensor:
    """Rotate query/key heads by their positions' angles."""
    cos = cos_btd[:, None]
    sin = sin_btd[:, None]
    return x_bhtd * cos + _rotate_half(x_bhtd) * sin


@dataclass
class KVCache:
    """A preallocated (static) key/value cache for all layers.

    `length` slots are filled; slot s of row b holds a real token iff `key_valid_bs[b, s]`.
    `num_valid_b` counts the real tokens of each row so far: the next real token's position id.
    """

    keys_lbhsd: Tensor
    values_lbhsd: Tensor
    key_valid_bs: Tensor
    num_valid_b: Tensor
    length: int = 0

    @classmethod
    def allocate(
        cls, dims: ModelDims, batch_size: int, max_len: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> "KVCache":
        shape = (dims.num_layers, batch_size, dims.num_kv_heads, max_len, dims.head_dim)
        return cls(
            keys_lbhsd=torch.zeros(shape, dtype=dtype, device=device),
            values_lbhsd=torch.zeros(shape, dtype=dtype, device=device),
            key_valid_bs=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
            num_valid_b=torch.zeros(batch_size, dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.keys_lbhsd.shape[3]


class Attention(nn.Module):
    """Grouped-query attention: num_heads query heads share num_kv_heads key/value heads."""

    def __init__(self, dims: ModelDims, layer_index: int, **factory: Any) -> None:
        super().__init__()
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.layer_index = layer_index
        h = dims.hidden_size
        self.q_proj = nn.Linear(h, dims.num_heads * dims.head_dim, bias=False, **factory)
        self.k_proj = nn.Linear(h, dims.num_kv_heads * dims.head_dim, bias=False, **factory)
        self.v_proj = nn.Linear(h, dims.num_kv_heads * dims.head_dim, bias=False, **factory)
        self.o_proj = nn.Linear(dims.num_heads * dims.head_dim, h, bias=False, **factory)

    def forward(
        self,
        x_bth: Tensor,
        cos_btd: Tensor,
        sin_btd: Tensor,
        allowed: Tensor | PackedSequences,
        kv_cache: KVCache | None,
    ) -> Tensor:
        """`allowed` is the mask [B, 1, T, S] of the keys each query sees, or, for packed sequences
        (B = 1, no cache), the packing, whose sequences each attend causally within themselves."""
        b, t, _ = x_bth.shape
        q = self.q_proj(x_bth).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_bth).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_bth).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos_btd, sin_btd)
        k = apply_rope(k, cos_btd, sin_btd)
        if kv_cache is not None:
            start, end = kv_cache.length, kv_cache.length + t
            kv_cache.keys_lbhsd[self.layer_index, :, :, start:end] = k
            kv_cache.values_lbhsd[self.layer_index, :, :, start:end] = v
            k = kv_cache.keys_lbhsd[self.layer_index, :, :, :end]
            v = kv_cache.values_lbhsd[self.layer_index, :, :, :end]
        if isinstance(allowed, PackedSequences):
            out = allowed.attend(q, k, v)
        else:
            out = _attend(q, k, v, allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def _attend(q_bhtd: Tensor, k_bhsd: Tensor, v_bhsd: Tensor, allowed_b1ts: Tensor) -> Tensor:
    """SDPA of grouped-query heads: the query heads share the fewer key/value heads in equal groups."""
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q_bhtd, k_bhsd, v_bhsd, attn_mask=allowed_b1ts, enable_gqa=True)
    group = q_bhtd.shape[1] // k_bhsd.shape[1]
    return F.scaled_dot_product_attention(q_bhtd, k_bhsd.repeat_interleave(group, dim=1),
                                          v_bhsd.repeat_interleave(group, dim=1), attn_mask=allowed_b1ts)


@dataclass(frozen=True)
class PackedSequences:
    """B sequences' real tokens laid end to end in one row of T tokens, with no padding: every token-wise
    step of a forward (embedding, projections, norms, MLP) runs on the T real tokens only.

    Attention stays within each sequence and causal there: the queries, keys and values of the T tokens
    are scattered into a padded [B, longest] layout, attended with a causal mask over real keys, and
    gathered back, so it costs B * longest^2, never T^2 (a varlen kernel would skip the padding too).
    Positions count each sequence's real tokens from 0, as the padded forward's do (pads do not
    advance them), so a packed token's result is the padded forward's for the same token.
    """

    input_ids_t: Tensor  # int64 [T]: row 0's real tokens in order, then row 1's, ...
    positions_t: Tensor  # int64 [T]: each token's position within its sequence
    slot_t: Tensor  # int64 [T]: each token's index in the flattened padded layout [B * longest]
    allowed_b1ll: Tensor  # bool [B, 1, longest, longest]: causal, and only the sequence's real keys

    @classmethod
    def of(cls, input_ids_bt: Tensor, mask_bt: Tensor) -> "PackedSequences":
        """The real tokens (`mask_bt` True) of each row of `input_ids_bt`, packed."""
        mask_bt = mask_bt.to(torch.bool)
        lengths_b = mask_bt.sum(1)
        longest = int(lengths_b.max()) if mask_bt.shape[0] else 0
        positions_bt = mask_bt.long().cumsum(1) - 1
        rows_t = mask_bt.nonzero()[:, 0]
        positions_t = positions_bt[mask_bt]
        slot_l = torch.arange(longest, device=mask_bt.device)
        causal_ll = slot_l[None, :] <= slot_l[:, None]
        # A pad query (after its sequence's end) sees the sequence's real keys: never an empty row (NaN).
        key_valid_bl = slot_l[None, :] < lengths_b[:, None]
        return cls(input_ids_bt[mask_bt], positions_t, rows_t * longest + positions_t,
                   (causal_ll[None] & key_valid_bl[:, None, :])[:, None])

    @property
    def num_seqs(self) -> int:
        return self.allowed_b1ll.shape[0]

    @property
    def longest(self) -> int:
        return self.allowed_b1ll.shape[-1]

    def attend(self, q_1htd: Tensor, k_1htd: Tensor, v_1htd: Tensor) -> Tensor:
        """Attention [1, heads, T, head_dim] of packed queries over the keys of their own sequence."""
        padded = [self._to_padded(x) for x in (q_1htd, k_1htd, v_1htd)]
        return self._to_packed(_attend(*padded, self.allowed_b1ll))

    def _to_padded(self, x_1htd: Tensor) -> Tensor:
        _, heads, _, head_dim = x_1htd.shape
        x_thd = x_1htd[0].transpose(0, 1)
        padded = x_thd.new_zeros(self.num_seqs * self.longest, heads, head_dim).index_copy(0, self.slot_t, x_thd)
        return padded.view(self.num_seqs, self.longest, heads, head_dim).transpose(1, 2)

    def _to_packed(self, x_bhld: Tensor) -> Tensor:
        b, heads, longest, head_dim = x_bhld.shape
        x_thd = x_bhld.transpose(1, 2).reshape(b * longest, heads, head_dim).index_select(0, self.slot_t)
        return x_thd.transpose(0, 1)[None]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: ModelDims, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. Submodules are declared in HF's order so state dicts list in the same order."""

    def __init__(self, dims: ModelDims, layer_index: int, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(dims, layer_index, **factory)
        self.mlp = MLP(dims, **factory)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.norm_eps, **factory)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor | PackedSequences, kv_cache: KVCache | None
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaTrunk(nn.Module):
    """Embedding, decoder layers and final norm: HF's `LlamaModel` (the `model.` prefix)."""

    def __init__(self, dims: ModelDims, **factory: Any) -> None:
        super().__init__()
        self.dims = dims
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(dims, i, **factory) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.norm_eps, **factory)

    def forward(
        self,
        input_ids_bt: Tensor,
        attention_mask_bt: Tensor,
        kv_cache: KVCache | None = None,
        positions_bt: Tensor | None = None,
    ) -> Tensor:
        """Final hidden states [B, T, hidden]. With a cache, the T tokens follow its filled slots."""
        _, t = input_ids_bt.shape
        device = input_ids_bt.device
        mask_bt = attention_mask_bt.to(torch.bool)
        start = 0 if kv_cache is None else kv_cache.length
        end = start + t
        if kv_cache is not None:
            if end > kv_cache.capacity:
                raise ValueError(f"KV cache holds {kv_cache.capacity} slots; {end} are needed")
            kv_cache.key_valid_bs[:, start:end] = mask_bt
            key_valid_bs = kv_cache.key_valid_bs[:, :end]
            valid_before_b1 = kv_cache.num_valid_b[:, None]
        else:
            key_valid_bs = mask_bt
            valid_before_b1 = torch.zeros(1, 1, dtype=torch.int64, device=device)

        if positions_bt is None:
            # Padding does not advance the position, so a left-padded row sees the same positions as
            # the same row unpadded. Pads get a harmless clamped position.
            positions_bt = (valid_before_b1 + mask_bt.long().cumsum(1) - 1).clamp(min=0)

        query_slot_t = torch.arange(start, end, device=device)
        key_slot_s = torch.arange(end, device=device)
        causal_ts = key_slot_s[None, :] <= query_slot_t[:, None]
        self_ts = key_slot_s[None, :] == query_slot_t[:, None]
        # Every query also sees itself: a pad query would otherwise attend to nothing and SDPA would
        # return NaN, which poisons gradients even where masked. Real queries never see pads.
        allowed_b1ts = ((causal_ts[None] & key_valid_bs[:, None, :]) | self_ts[None])[:, None]

        x = self.embed_tokens(input_ids_bt)
        cos, sin = rope_cos_sin(positions_bt, self.dims.head_dim, self.dims.rope_theta, x.dtype, self.dims.rope_scaling)
        for layer in self.layers:
            x = layer(x, cos, sin, allowed_b1ts, kv_cache)
        if kv_cache is not None:
            kv_cache.length = end
            kv_cache.num_valid_b += mask_bt.sum(1)
        return self.norm(x)

    def forward_packed(self, packed: PackedSequences) -> Tensor:
        """Final hidden states [T, hidden] of packed sequences' tokens."""
        x = self.embed_tokens(packed.input_ids_t[None])
        cos, sin = rope_cos_sin(packed.positions_t[None], self.dims.head_dim, self.dims.rope_theta, x.dtype,
                                self.dims.rope_scaling)
        for layer in self.layers:
            x = layer(x, cos, sin, packed, None)
        return self.norm(x)[0]


def _init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-style init (normal(0, 0.02), norms at 1); drawn from torch's global RNG so seeds reproduce it."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)


class Llama(nn.Module):
    """Llama causal LM with HF `LlamaForCausalLM` parameter names.

    With `dims.tie_embeddings` there is no `lm_head` parameter: the head reads
    `model.embed_tokens.weight`, so the state dict holds every weight exactly once.
    """

    def __init__(
        self, dims: ModelDims, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.dims = dims
        self.model = LlamaTrunk(dims, **factory)
        self.lm_head: nn.Linear | None = (
            None if dims.tie_embeddings else nn.Linear(dims.hidden_size, dims.vocab_size, bias=False, **factory)
        )
        _init_weights(self)

    def allocate_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype,
                          device: torch.device | str) -> KVCache:
        """An empty cache for this model's key/value heads (a tensor-parallel shard holds only its own)."""
        return KVCache.allocate(self.dims, batch_size, max_len, dtype=dtype, device=device)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Final-norm hidden states [B, T, hidden]; no mask means every token is real."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return self.model(input_ids, attention_mask, kv_cache, positions)

    def packed_hidden_states(self, packed: PackedSequences) -> Tensor:
        """Final-norm hidden states [T, hidden] of packed sequences' tokens."""
        return self.model.forward_packed(packed)

    def logits(self, hidden_bth: Tensor) -> Tensor:
        """Float32 logits from hidden states; callers slice first to skip unneeded vocab projections."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_bth, weight).float()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """logits [B, T, V] float32 for input_ids [B, T] and attention_mask [B, T] (bool, left padding allowed;
        default all real)."""
        return self.logits(self.hidden_states(input_ids, attention_mask, kv_cache, positions))


class LlamaCritic(nn.Module):
    """The Llama trunk with a scalar value head `value_head.weight` [1, hidden] instead of an LM head.

    The trunk keeps the `model.` names, so a critic starts from a policy checkpoint with
    `load_state_dict(..., strict=False)` (only `lm_head.weight` is extra, only `value_head` missing).
    """

    def __init__(
        self, dims: ModelDims, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.dims = dims
        self.model = LlamaTrunk(dims, **factory)
        self.value_head = nn.Linear(dims.hidden_size, 1, bias=False, **factory)
        _init_weights(self)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        return self.model(input_ids, attention_mask, kv_cache, positions)

    def packed_hidden_states(self, packed: PackedSequences) -> Tensor:
        return self.model.forward_packed(packed)

    def values(self, hidden_bth: Tensor) -> Tensor:
        return self.value_head(hidden_bth).squeeze(-1).float()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """values [B, T] float32: the value of the state that ends at each token."""
        return self.values(self.hidden_states(input_ids, attention_mask, kv_cache, positions))


# ----------------------------------------------------------------------------------------------
# Parameter shapes without building a model


def param_shapes(dims: ModelDims, head: Head = "lm") -> dict[str, tuple[int, ...]]:
    """HF-named parameter shapes in module (state-dict) order, from the model's parameter inventory
    (`schemas/sharding.py`). `head="lm"` is `Llama` (no `lm_head.weight` when embeddings are tied);
    `head="value"` is `LlamaCritic`."""
    return {p.name: p.shape for p in llama_params(dims, head)}


def count_params(dims: ModelDims, head: Head = "lm") -> int:
    """Number of distinct parameters (a tied head counts once)."""
    return llama_param_count(dims, head)


# ----------------------------------------------------------------------------------------------
# Generation and teacher-forced scoring


@dataclass(frozen=True)
class GenerationOutput:
    """Sampled responses. R = max_new_tokens, even when every row stopped early (the rest is pad).

    logprobs are log softmax(logits / T)(token), T the sampling temperature (T = 0, greedy: T = 1 is
    used), top-p ignored: the distribution the token was drawn from before truncation. The trainer
    recomputes the same quantity (`token_logprobs` under `sampling_temperature(model, T)`), so behaviour,
    old, new and reference log-probs compare like with like, and pi/mu is the ratio to the distribution
    that drew the token.
    """

    response_ids: Tensor  # int64 [B, R]
    response_mask: Tensor  # bool [B, R], True up to and including EOS
    logprobs: Tensor  # float32 [B, R], 0 where masked


def _check_left_padded(prompt_mask_bp: Tensor) -> None:
    if prompt_mask_bp.shape[1] == 0 or not bool(prompt_mask_bp[:, -1].all()):
        raise ValueError(
            "prompts must be left-padded with a real token in the last column "
            "(prompt_mask[:, -1] must be all True)"
        )


def _sample(logits_bv: Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
            uniform_b: Tensor | None = None) -> Tensor:
    """Next token [B]: argmax at temperature 0, else nucleus sampling of softmax(logits / temperature),
    drawn from `generator`, or, given one uniform number per row, by inverting each row's CDF (so a
    row's token depends on that row alone, not on the batch it was generated in)."""
    if temperature == 0.0:
        return logits_bv.argmax(-1)
    probs_bv = torch.softmax(logits_bv / temperature, dim=-1)
    if top_p < 1.0:
        # Keep the most likely tokens until their mass reaches top_p; the first is always kept.
        # A stable sort keeps ties in vocabulary order, so a seeded run is reproducible.
        sorted_probs, order = probs_bv.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs_bv = torch.zeros_like(probs_bv).scatter(-1, order, sorted_probs)
    if uniform_b is None:
        return torch.multinomial(probs_bv, 1, generator=generator).squeeze(-1)
    cdf_bv = probs_bv.double().cumsum(-1)
    target_b1 = uniform_b.to(cdf_bv)[:, None] * cdf_bv[:, -1:]
    # The first token whose CDF exceeds the target; a token of probability 0 is never chosen.
    token_b = torch.searchsorted(cdf_bv, target_b1, right=True).squeeze(-1)
    return token_b.clamp(max=probs_bv.shape[-1] - 1)


@torch.no_grad()
def generate(
    model: Llama,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
) -> GenerationOutput:
    """Sample up to max_new_tokens per left-padded prompt [B, P] with a static KV cache.

    One prefill forward over the prompts, then one forward per new token. Sampling draws only from
    `generator` (on the model's device), so a seeded generator reproduces the output; or, with
    `uniforms` [B, max_new_tokens] in [0, 1), token t of row b inverts that row's CDF at
    uniforms[b, t], so each row's sample is the same however the batch is split. After a row
    emits `eos_id` (or any of several stop ids: a chat model's end-of-turn and end-of-text) it is
    padded with `pad_id` (mask False, logprob 0); the loop stops once all rows
    have. `temperature == 0` is greedy decoding. The log-probs are of softmax(logits / temperature)
    (see `GenerationOutput`).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    _check_left_padded(prompt_mask)
    logprob_temperature = logprob_temperature_of(temperature)
    batch_size, prompt_len = prompt_ids.shape
    if uniforms is not None and tuple(uniforms.shape) != (batch_size, max_new_tokens):
        raise ValueError(f"uniforms must have shape {(batch_size, max_new_tokens)}, got {tuple(uniforms.shape)}")
    device = prompt_ids.device
    param = next(model.parameters())
    cache = model.allocate_kv_cache(batch_size, prompt_len + max_new_tokens, dtype=param.dtype, device=device)
    response_ids = torch.full((batch_size, max_new_tokens), pad_id, dtype=torch.int64, device=device)
    response_mask = torch.zeros(batch_size, max_new_tokens, dtype=torch.bool, device=device)
    logprobs = torch.zeros(batch_size, max_new_tokens, dtype=torch.float32, device=device)
    done_b = torch.zeros(batch_size, dtype=torch.bool, device=device)
    stop_ids = None if eos_id is None else torch.tensor(
        [eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.int64, device=device
    )

    hidden = model.hidden_states(prompt_ids, prompt_mask.to(torch.bool), kv_cache=cache)
    logits_bv = model.logits(hidden[:, -1])
    for step in range(max_new_tokens):
        token_b = _sample(logits_bv, temperature, top_p, generator, None if uniforms is None else uniforms[:, step])
        live_b = ~done_b
        token_b = torch.where(live_b, token_b, pad_id)
        logp_bv = torch.log_softmax(logits_bv / logprob_temperature, dim=-1)
        token_logprob_b = logp_bv.gather(-1, token_b[:, None]).squeeze(-1)
        response_ids[:, step] = token_b
        response_mask[:, step] = live_b
        logprobs[:, step] = torch.where(live_b, token_logprob_b, 0.0)
        if stop_ids is not None:
            done_b = done_b | torch.isin(token_b, stop_ids)
            if bool(done_b.all()):
                break
        if step + 1 == max_new_tokens:
            break
        # The fed token is real only for rows that were live when it was sampled, so finished rows
        # leave pads in the cache that no real query attends to.
        hidden = model.hidden_states(token_b[:, None], live_b[:, None], kv_cache=cache)
        logits_bv = model.logits(hidden[:, -1])
    return GenerationOutput(response_ids=response_ids, response_mask=response_mask, logprobs=logprobs)


def logprob_temperature_of(sampling_temperature: float) -> float:
    """The temperature log-probs are taken at: the sampling one, or 1 for greedy decoding (T = 0), which
    has no sampling distribution."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


@contextmanager
def sampling_temperature(model: nn.Module, temperature: float) -> Iterator[None]:
    """Within the block, every logit `model` computes is divided by `logprob_temperature_of(temperature)`,
    whichever way the logits are formed (an lm_head, a tied embedding, a tensor-parallel or FSDP wrapper
    around the model): the final norm's output, which every head multiplies, is scaled by 1 / T.
    Autograd records the division, so a backward after the block is that of the tempered loss. A no-op
    at T = 1 and for models without a final norm (`model.model.norm`)."""
    scale = logprob_temperature_of(temperature)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if scale == 1.0 or not isinstance(norm, nn.Module):
        yield
        return
    handle = norm.register_forward_hook(lambda module, args, output: output / scale)
    try:
        yield
    finally:
        handle.remove()


def _response_hidden(
    model: Llama | LlamaCritic,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    pack: bool,
) -> Tensor:
    """Hidden states [n, hidden] at the positions that predict the n real response tokens (response_mask's
    True entries, row by row): only those reach a head, whose vocabulary-sized work a masked token
    would waste.

    Position P-1+r predicts response token r: the last prompt column for r = 0 (prompts are
    left-padded), then the previous response token. Packed (`pack`), each row's real tokens run as one
    sequence of a single packed row (`PackedSequences`), and the predicting position is the real token
    before the response token in its sequence: the same token, at the same position.
    """
    _check_left_padded(prompt_mask)
    if not pack:
        # Padded: only the columns some row uses (pads attend to nothing and advance no position, so
        # the result is the same); at least one response column, since a wrapped model's forward runs
        # collectives the other ranks wait for.
        prompt_ids, prompt_mask, response_ids, response_mask = _used_columns(prompt_ids, prompt_mask, response_ids,
                                                                             response_mask)
    prompt_len, response_len = prompt_ids.shape[1], response_ids.shape[1]
    input_ids = torch.cat((prompt_ids, response_ids), dim=1)
    mask = torch.cat((prompt_mask.to(torch.bool), response_mask.to(torch.bool)), dim=1)
    response_mask = response_mask.to(torch.bool)
    if not pack:
        hidden = model.hidden_states(input_ids, mask)
        return hidden[:, prompt_len - 1 : prompt_len - 1 + response_len][response_mask]
    packed = PackedSequences.of(input_ids, mask)
    hidden_th = model.packed_hidden_states(packed)
    lengths_b = mask.sum(1)
    # Each token's index in the packed row: its sequence's start plus its position within it.
    index_bt = (lengths_b.cumsum(0) - lengths_b)[:, None] + mask.long().cumsum(1) - 1
    return hidden_th[index_bt[:, prompt_len:][response_mask] - 1]


def used_response_columns(response_mask: Tensor) -> int:
    """Response columns up to the last real token of any row, at least one."""
    used = response_mask.to(torch.bool).any(0).nonzero()
    return max(1, int(used[-1]) + 1) if used.numel() else 1


def _used_columns(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows without their leading prompt columns that are pad in every row and their trailing
    response columns past every row's last real token (keeping at least one)."""
    used_prompt = prompt_mask.to(torch.bool).any(0)
    first = int(used_prompt.to(torch.int8).argmax()) if prompt_mask.shape[0] else 0
    width = used_response_columns(response_mask)
    return prompt_ids[:, first:], prompt_mask[:, first:], response_ids[:, :width], response_mask[:, :width]


def _scatter_responses(values_n: Tensor, response_mask: Tensor) -> Tensor:
    """[B, R] with the values of the n real response tokens in their places and 0 where masked."""
    mask_br = response_mask.to(torch.bool)
    return values_n.new_zeros(mask_br.shape).masked_scatter(mask_br, values_n)


def token_logprobs(
    model: Llama, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False,
) -> Tensor:
    """Teacher-forced log pi(response token) [B, R] float32, differentiable, 0 where masked. `pack`: the
    rows run as packed sequences (`PackedSequences`), with the same result."""
    logprobs, _ = _logprobs_and_maybe_entropy(
        model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=False, pack=pack
    )
    return logprobs


def token_logprobs_and_entropy(
    model: Llama, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False,
) -> tuple[Tensor, Tensor]:
    """(logprobs [B, R], entropy [B, R]) where entropy = -sum_v p_v log p_v of each predicting position;
    0 where masked."""
    logprobs, entropy = _logprobs_and_maybe_entropy(
        model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True, pack=pack
    )
    assert entropy is not None
    return logprobs, entropy


def _logprobs_and_maybe_entropy(
    model: Llama,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    with_entropy: bool,
    pack: bool,
) -> tuple[Tensor, Tensor | None]:
    hidden_nh = _response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, pack=pack)
    logp_nv = torch.log_softmax(model.logits(hidden_nh), dim=-1)
    tokens_n = response_ids[response_mask.to(torch.bool)]
    logprobs_br = _scatter_responses(logp_nv.gather(-1, tokens_n[:, None]).squeeze(-1), response_mask)
    if not with_entropy:
        return logprobs_br, None
    entropy_n = -(logp_nv.exp() * logp_nv).sum(-1)
    return logprobs_br, _scatter_responses(entropy_n, response_mask)


def token_values(
    critic: LlamaCritic, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False,
) -> Tensor:
    """values [B, R] float32: V(state before response token r), aligned with `token_logprobs`; 0 where masked."""
    hidden_nh = _response_hidden(critic, prompt_ids, prompt_mask, response_ids, response_mask, pack=pack)
    return _scatter_responses(critic.values(hidden_nh), response_mask)


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def _checkpoint_error(folder: Path, message: str, fix: str) -> GraphRLError:
    return GraphRLError(f"checkpoint {folder}: {message}", fix=fix)


def dims_from_hf_config(config: Mapping[str, Any]) -> ModelDims:
    """ModelDims from a HF Llama `config.json` (transformers 4.x `rope_theta` or 5.x `rope_parameters`).

    Raises GraphRLError for architectures this model cannot represent (biases, non-SiLU, odd head_dim)
    and warns when a RoPE scaling is ignored.
    """
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise GraphRLError(
            f"config.json has model_type {model_type!r}; only 'llama' checkpoints are supported",
            fix="use a Llama-architecture checkpoint",
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise GraphRLError(f"config.json sets {flag}=true; this Llama has no biases", fix="use a bias-free checkpoint")
    if config.get("hidden_act", "silu") != "silu":
        raise GraphRLError(
            f"config.json has hidden_act {config['hidden_act']!r}; only 'silu' (SwiGLU) is supported",
            fix="use a Llama checkpoint with hidden_act 'silu'",
        )
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * num_heads != hidden_size:
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
    return ModelDims(
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
    """A `config.json` that both transformers 4.x (`rope_theta`) and 5.x (`rope_parameters`) read."""
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
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "mlp_bias": False,
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
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise _checkpoint_error(folder, "has no config.json", "point `checkpoint` at a Hugging Face model folder")
    dims = dims_from_hf_config(json.loads(config_path.read_text()))

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
    state_dict: dict[str, Tensor] = {}
    for shard in shard_files:
        state_dict.update(load_file(str(shard)))

    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if dims.tie_embeddings:
        state_dict.pop("lm_head.weight", None)
    expected = param_shapes(dims, "value" if "value_head.weight" in state_dict else "lm")
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    wrong = [
        f"{name} {tuple(state_dict[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    if missing or unexpected or wrong:
        details = "; ".join(
            part
            for part in (
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {unexpected[:3]}" if unexpected else "",
                f"wrong shapes {wrong[:3]}" if wrong else "",
            )
            if part
        )
        raise _checkpoint_error(folder, f"weights do not match config.json ({details})", "use an unmodified Llama checkpoint")
    return dims, {name: state_dict[name] for name in expected}


def save_hf_checkpoint(model: Llama | LlamaCritic, dims: ModelDims, folder: str | Path) -> None:
    """Write config.json + model.safetensors that `transformers` and `load_hf_checkpoint` read back."""
    save_hf_state(model.state_dict(), dims, folder)


def save_hf_state(state: Mapping[str, Tensor], dims: ModelDims, folder: str | Path) -> None:
    """`save_hf_checkpoint` of named full tensors (a model whose weights were gathered from shards)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state_dict = {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}
    dtype = next(iter(state_dict.values())).dtype
    (folder / "config.json").write_text(json.dumps(hf_config_from_dims(dims, dtype), indent=2) + "\n")
    # HF refuses safetensors files without format metadata.
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})

"""A native PyTorch decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) for RL on LLMs: Llama, and
the Qwen2 and Qwen3 families as data of the same model (`ModelDims.family`: q/k/v biases, per-head q/k
norms, a head width of its own), never a copy of it.

Why not `transformers`: an RL job needs three things from its model and they must agree to the last
bit of arithmetic: sampling with a KV cache (`sampling.generate`), teacher-forced log-probs of the
sampled tokens (`sampling.token_logprobs`) and a critic on the same trunk (`LlamaCritic`). Owning the
model makes that agreement testable and keeps it free of framework state. This file is the model's
definition; `sampling.py` samples and scores with it, `hf_checkpoint.py` reads and writes its files.

Parameter names are exactly Hugging Face's (`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`:
`model.layers.{i}.self_attn.q_proj.weight`, ...), so HF checkpoints load with `load_state_dict` and the
weight-sync planner can reason about names and shapes from `param_shapes(dims)` without building a model.

Conventions: B sequences, T tokens per forward, P prompt tokens, R response tokens, V vocabulary,
S key slots. Masks are bool, True = real token. Prompts are left-padded (the last prompt column is a
real token of every row); responses are right-padded (True up to and including EOS). Position ids
count real tokens only (`cumsum(mask) - 1`), so padding never changes a real token's result, and
scoring may drop the padding altogether (`PackedSequences`: every row's real tokens in one row).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
        return self.scale() * x_f32.to(input_dtype)

    def scale(self) -> Tensor:
        """The weight the normalized features are multiplied by."""
        return self.weight


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


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group. A weight every tensor-parallel
    rank holds whole but applies to its own heads only (a Qwen3's q/k norm) gets a different partial
    gradient on each rank, and its true gradient is their sum."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HeadNorm(RMSNorm):
    """RMSNorm over each head's features (Qwen3's q_norm and k_norm), one weight shared by every head.
    Under a tensor-parallel trainer each rank holds the weight whole for its own heads, and `grad_group`
    sums its gradient over the tp group."""

    grad_group: Any = None

    def scale(self) -> Tensor:
        return self.weight if self.grad_group is None else _SumGradOver.apply(self.weight, self.grad_group)


class Attention(nn.Module):
    """Grouped-query attention: num_heads query heads share num_kv_heads key/value heads; with the
    family's switches, biases on q/k/v (Qwen2) and an RMSNorm over each q and k head before RoPE (Qwen3)."""

    def __init__(self, dims: ModelDims, layer_index: int, **factory: Any) -> None:
        super().__init__()
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.layer_index = layer_index
        h, bias = dims.hidden_size, bool(dims.qkv_bias)
        self.q_proj = nn.Linear(h, dims.q_width, bias=bias, **factory)
        self.k_proj = nn.Linear(h, dims.kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(h, dims.kv_width, bias=bias, **factory)
        self.o_proj = nn.Linear(dims.q_width, h, bias=False, **factory)
        self.q_norm: HeadNorm | None = HeadNorm(dims.head_dim, dims.norm_eps, **factory) if dims.qk_norm else None
        self.k_norm: HeadNorm | None = HeadNorm(dims.head_dim, dims.norm_eps, **factory) if dims.qk_norm else None

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
        q = self.q_proj(x_bth).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x_bth).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
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
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), `width` features wide (default: the dims')."""

    def __init__(self, dims: ModelDims, width: int | None = None, **factory: Any) -> None:
        super().__init__()
        width = dims.intermediate_size if width is None else width
        self.gate_proj = nn.Linear(dims.hidden_size, width, bias=False, **factory)
        self.up_proj = nn.Linear(dims.hidden_size, width, bias=False, **factory)
        self.down_proj = nn.Linear(width, dims.hidden_size, bias=False, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class Routing:
    """What the forwards inside `routing(model, ...)` record of their mixture-of-experts layers, or impose
    on them. Tokens are the forward's own, flattened in order ([B, T] row-major, or packed).

    - `chosen[i]`: int64 [N, k], the experts layer i routed each token to, in the forward's order;
    - `router_logits[i]`: [N, E] of layer i when `keep_logits` (a trained model's load-balancing loss);
    - `replay`: int64 [L, N, k] routes to use instead of the router's top-k (routing replay); a row of -1
      (a token nobody routed before) takes the router's own choice. The weights are still the router's
      probabilities of the replayed experts, so gradients reach the router.
    - `given`: the same for one forward, declared by it (`replaying`: the generator's routes of its tokens),
      imposed with `impose_given` (R3), else only compared with the router's choice (`differing`).
    """

    keep_logits: bool = False
    replay: Tensor | None = None
    given: Tensor | None = None
    impose_given: bool = True
    chosen: list[Tensor] = field(default_factory=list)
    router_logits: list[Tensor] = field(default_factory=list)
    # Per forward that declared it (`replaying`): which of its flattened tokens are real (None: all).
    token_masks: list[Tensor | None] = field(default_factory=list)
    # Against a replay: router decisions (token, layer, slot) the replay covers, and those whose expert is
    # not among the router's own top-k (the generator/trainer routing mismatch).
    decisions: Tensor | int = 0
    differing: Tensor | int = 0

    def router_loss(self, num_experts: int, top_k: int) -> Tensor:
        """The load-balancing loss of the recorded forwards' router logits (see `load_balancing_loss`)."""
        masks = self.token_masks or [None]
        if all(m is None for m in masks):
            return load_balancing_loss(self.router_logits, num_experts, top_k)
        # one forward's mask for each of its layers
        per_layer = len(self.router_logits) // len(masks)
        flat = [m for m in masks for _ in range(per_layer)]
        joined = torch.cat([torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device) if m is None else m
                            for m, logits in zip(flat, self.router_logits)])
        return load_balancing_loss([torch.cat(self.router_logits)], num_experts, top_k, joined)


class Experts(nn.Module):
    """`num` SwiGLU experts stacked on dim 0 (`gate_proj`, `up_proj` [num, width, hidden], `down_proj`
    [num, hidden, width]): experts `start`..`start + num - 1` of the model's (a tensor-parallel rank holds
    a share of them, `TpStyle.EXPERT`)."""

    def __init__(self, num: int, hidden: int, width: int, start: int = 0, **factory: Any) -> None:
        super().__init__()
        self.start = start
        self.gate_proj = nn.Parameter(torch.empty(num, width, hidden, **factory))
        self.up_proj = nn.Parameter(torch.empty(num, width, hidden, **factory))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, width, **factory))

    def forward(self, x_nh: Tensor, experts_nk: Tensor, weights_nk: Tensor) -> Tensor:
        """Sum over each token's routed experts held here of weight * expert(token); [N, hidden]."""
        out = torch.zeros_like(x_nh)
        local_nk = experts_nk - self.start
        held = (local_nk >= 0) & (local_nk < self.gate_proj.shape[0])
        token_a, slot_a = held.nonzero(as_tuple=True)
        if token_a.numel() == 0:
            # no token here: the weights still join the graph, so data-parallel gradient hooks fire
            return out + 0.0 * (self.gate_proj.sum() + self.up_proj.sum() + self.down_proj.sum())
        expert_a = local_nk[token_a, slot_a]
        order = torch.argsort(expert_a, stable=True)
        token_a, slot_a, expert_a = token_a[order], slot_a[order], expert_a[order]
        counts = torch.bincount(expert_a, minlength=self.gate_proj.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens, slots = token_a[start:start + n], slot_a[start:start + n]
            start += n
            h = x_nh[tokens]
            y = F.linear(F.silu(F.linear(h, self.gate_proj[e])) * F.linear(h, self.up_proj[e]), self.down_proj[e])
            out.index_add_(0, tokens, y * weights_nk[tokens, slots, None].to(y.dtype))
        return out


class MoE(nn.Module):
    """A mixture-of-experts feed-forward block (Qwen2-MoE, Qwen3-MoE): a router (`gate`) picks each token's
    top-k experts from a softmax over all of them (renormalized over the k with `norm_topk_prob`), the
    token's output is the probability-weighted sum of those experts' outputs, plus, in Qwen2-MoE, a shared
    expert scaled by a sigmoid gate. On a tensor-parallel generator (`reduce` set) each rank holds some of
    the experts and its slice of the shared expert; their partial sums are all-reduced once."""

    def __init__(self, dims: ModelDims, layer_index: int, **factory: Any) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = dims.experts_per_token, dims.norm_topk_prob
        self.layer_index = layer_index  # its row of a replay (every layer of an MoE model routes)
        self.gate = nn.Linear(dims.hidden_size, dims.num_experts, bias=False, **factory)
        self.experts = Experts(dims.num_experts, dims.hidden_size, dims.expert_intermediate_size, **factory)
        shared = dims.shared_expert_intermediate_size
        self.shared_expert: MLP | None = MLP(dims, shared, **factory) if shared else None
        self.shared_expert_gate: nn.Linear | None = (nn.Linear(dims.hidden_size, 1, bias=False, **factory)
                                                     if shared else None)
        self.routing: Routing | None = None  # set by `routing(model)` for the forwards inside it
        self.reduce: Any = None  # a tensor-parallel group's all-reduce

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x_nh = x.reshape(-1, shape[-1])
        logits_ne = self.gate(x_nh)
        probs_ne = torch.softmax(logits_ne, dim=-1, dtype=torch.float32)
        top_p, top_i = torch.topk(probs_ne, self.top_k, dim=-1)
        log = self.routing
        imposed = None
        if log is not None and log.given is not None:
            given = log.given[self.layer_index].to(top_i.device)
            covered = given[:, :1] >= 0
            log.decisions = log.decisions + covered.sum() * self.top_k  # tensors: no device sync per layer
            log.differing = log.differing + ((given[:, :, None] != top_i[:, None, :]).all(-1) & covered).sum()
            imposed = given if log.impose_given else None
        if imposed is None and log is not None and log.replay is not None:
            imposed = log.replay[self.layer_index].to(top_i.device)
        if imposed is not None:
            top_i = torch.where(imposed >= 0, imposed, top_i)
            top_p = probs_ne.gather(-1, top_i)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        if log is not None:
            log.chosen.append(top_i.detach())
            if log.keep_logits:
                log.router_logits.append(logits_ne)
        out = self.experts(x_nh, top_i, top_p.to(logits_ne.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x_nh)) * self.shared_expert(x_nh)
        if self.reduce is not None:
            out = self.reduce(out)
        return out.view(shape)


def load_balancing_loss(router_logits: list[Tensor], num_experts: int, top_k: int,
                        token_mask: Tensor | None = None) -> Tensor:
    """Switch Transformer's load-balancing loss as Hugging Face computes it for Qwen-MoE: over all MoE
    layers' real tokens, num_experts * sum_e f_e * P_e, with f_e the share of top-k assignments that go to
    expert e and P_e its mean router probability (1 * top_k when perfectly balanced)."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = (torch.ones(router_logits[0].shape[0], device=device) if token_mask is None
              else token_mask.reshape(-1).float())
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p * weight[:, None]).sum(0)
        rows = rows + weight.sum()
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def _moe_blocks(model: Any) -> list[MoE]:
    """The model's mixture-of-experts blocks; a dense model's dims say it has none, without a walk of its
    modules (every scoring forward asks)."""
    if not isinstance(model, nn.Module) or not getattr(getattr(model, "dims", None), "is_moe", True):
        return []
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextmanager
def routing(model: nn.Module, *, keep_logits: bool = False, replay: Tensor | None = None,
            impose_given: bool = True) -> Iterator[Routing]:
    """Record (and with `replay`, impose) the routes of `model`'s mixture-of-experts layers in the forwards
    run inside; nothing for a dense model. Nested, the inner log sees the inner forwards."""
    log = Routing(keep_logits=keep_logits, replay=replay, impose_given=impose_given)
    blocks = _moe_blocks(model)
    before = [block.routing for block in blocks]
    for block in blocks:
        block.routing = log
    try:
        yield log
    finally:
        for block, previous in zip(blocks, before):
            block.routing = previous


@contextmanager
def replaying(model: Any, given: Tensor | None, token_mask: Tensor | None) -> Iterator[None]:
    """One forward of `model` with the routes `given` for its tokens (None: none; imposed, or compared
    where the routing log open around it says so) and its real tokens declared (`token_mask` over its
    flattened tokens, None: all real). Without a log open around it, `given` is imposed."""
    blocks = _moe_blocks(model)
    log = blocks[0].routing if blocks else None
    if log is None:
        with (routing(model, replay=given) if given is not None else nullcontext()):
            yield
        return
    log.given = given
    log.token_masks.append(token_mask)
    try:
        yield
    finally:
        log.given = None


class DecoderLayer(nn.Module):
    """Pre-norm block. Submodules are declared in HF's order so state dicts list in the same order."""

    def __init__(self, dims: ModelDims, layer_index: int, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(dims, layer_index, **factory)
        self.mlp: MLP | MoE = MoE(dims, layer_index, **factory) if dims.is_moe else MLP(dims, **factory)
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
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)
        elif isinstance(sub, Experts):
            for weight in (sub.gate_proj, sub.up_proj, sub.down_proj):
                nn.init.normal_(weight, mean=0.0, std=std)


class Llama(nn.Module):
    """The causal LM of every family (`dims.family`), with Hugging Face's parameter names for it.

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

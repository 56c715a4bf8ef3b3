"""Tensor-parallel generation: a decoder (any family) whose weights are 1/t shards over a tensor-parallel group.

A generator role with `tp = t` runs on a group of t ranks; each holds the shards below, runs the same
KV-cache generation loop as the unsharded model (`models/llama.py:generate`) and samples the same
tokens. The shards are exactly the regions the model's sharding description (`schemas/sharding.py`) gives the
generator mesh (dp x tp), cut as DTensor's `Shard` cuts (`chunk_bounds`), so a DDMA weight sync writes
straight into them:

- q/k/v/gate/up_proj: output rows split (column parallel): heads and SwiGLU features split, with a
  Qwen2's q/k/v biases;
- o/down_proj: input columns split (row parallel): a partial sum per rank, one all-reduce per layer;
- embed_tokens (and lm_head): vocabulary rows split: each rank looks up the tokens of its rows (zeros
  elsewhere) and one all-reduce sums; logits of the rank's rows are all-gathered before sampling;
- norms replicated (a Qwen3's per-head q/k norms too: each rank applies them to its own heads);
- a mixture of experts: each rank holds whole experts (expert parallelism over the group, ep = tp), the
  router replicated; every rank routes every token, runs the tokens routed to its experts, and one
  all-reduce per layer sums the shares (with a shared expert's slice, cut as the dense MLP is).

KV heads: with t <= kv_heads a rank holds kv_heads / t of them. With t > kv_heads (a multiple) each KV
head is replicated on t / kv_heads ranks, as the cost model assumes. The plan still delivers each rank
1/t of the k/v rows, a block inside the rank's own head: that block is a view into the rank's head, and
one all-gather over the group fills the rest of the head after each sync (`complete_kv_heads`).

Why explicit shards and not DTensor: decoding is a loop of forwards over one token, where per-op
dispatch would cost more than the math, and the weight sync needs plain tensors whose regions are the
plan's. Every rank of a group gets the same bits from each all-reduce and all-gather, hence the same
hidden states and logits, and draws from a generator seeded alike: all ranks sample the same tokens
and their KV caches stay consistent, with no broadcast of the samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from graphrl.schemas.sharding import (Region, chunk_bounds, is_adapter, llama_params, lora_params, region_size, to_slices,
                                      tp_region, tp_split_dim)
from graphrl.errors import RunError
from graphrl.schemas.model import LoraSpec, ModelDims

from graphrl.executors.models.llama import MLP, Experts, KVCache, Llama, MoE
from graphrl.executors.models.lora import ADAPTED, Adapted, adapt

_KV = ("k_proj", "v_proj")  # replicated over tp ranks when there are fewer KV heads than ranks


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's place in its tensor-parallel group and the group's collectives."""

    rank: int  # index within the group, 0..size-1
    size: int
    group: Any  # torch process group; None when size == 1

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor, sizes: list[int]) -> Tensor:
        """Concatenate every rank's `x` along the last dim; rank i's `x` has sizes[i] there (may differ)."""
        if self.size == 1:
            return x
        width = max(sizes)
        padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)


class RowParallelLinear(nn.Linear):
    """A linear layer holding a block of input columns: each rank's product is a partial sum of the
    full output, all-reduced over the group (the one collective of an attention or MLP block)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, **factory: Any) -> None:
        super().__init__(in_features, out_features, bias=False, **factory)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class LoraRowParallelLinear(Adapted, RowParallelLinear):
    """A row-parallel projection with its LoRA adapter's share: A's block of input columns (this rank's), B
    whole; the adapter's partial product joins the base's before the one all-reduce."""

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        delta = self.adapter(x)
        return self.tp.all_reduce(out if delta is None else out + delta)


ADAPTED[RowParallelLinear] = LoraRowParallelLinear


class VocabParallelEmbedding(nn.Module):
    """An embedding holding vocabulary rows [start, start + n): tokens outside read as zeros, and the
    all-reduce over the group adds the one rank's row that holds each token (exact: the rest are 0)."""

    def __init__(self, start: int, num_rows: int, hidden_size: int, tp: TensorParallelGroup, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size, **factory))
        self.start = start
        self.tp = tp

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        if self.weight.shape[0] == 0:
            x = self.weight.new_zeros(*ids.shape, self.weight.shape[1])
        else:
            x = F.embedding(torch.where(inside, local, 0), self.weight).masked_fill(~inside[..., None], 0.0)
        return self.tp.all_reduce(x)


class TensorParallelLlama(Llama):
    """`Llama` with the parameter names of the full model and the shapes of one tp rank's shards.

    Build it with `from_full` (a full model's weights, sliced) or empty (NaN) for a weight sync to
    fill; `shards()` gives the weight sync the plan's regions. Generation (and scoring, packed or not) goes
    through the shared code unchanged: the layers run on local heads, `logits` returns the full vocabulary.
    """

    def __init__(self, dims: ModelDims, tp: TensorParallelGroup, *, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        t, r = tp.size, tp.rank
        kv = dims.num_kv_heads
        # Heads are whole on every rank; the vocabulary and the feed-forward width may split unevenly
        # (torch.chunk), so this generator is looser than the compiler's `tp_split_problem`, which offers
        # only even splits.
        if dims.num_heads % t or (kv % t and t % kv):
            raise RunError(f"tp={t} does not divide the {dims.num_heads} attention heads, or neither divides "
                           f"the other with the {kv} KV heads", fix="pin a tp that divides the heads")
        self.kv_replicas = max(t // kv, 1)  # ranks that hold each KV head
        if dims.num_experts % t:
            raise RunError(f"tp={t} does not divide the {dims.num_experts} experts the group shares out",
                           fix="pin a tp that divides the experts")
        if (dims.head_dim * kv) % t:
            raise RunError(f"tp={t} cuts the {kv} KV heads of head_dim {dims.head_dim} inside a row block of "
                           "another head", fix="pin a tp that divides num_kv_heads * head_dim")
        super().__init__(dims, device="meta", dtype=dtype)
        self.tp = tp
        h, hd = dims.hidden_size, dims.head_dim
        heads = dims.num_heads // t
        kv_heads = max(kv // t, 1)
        factory = {"device": device, "dtype": dtype}
        self.vocab_sizes = [b - a for a, b in (chunk_bounds(dims.vocab_size, t, i) for i in range(t))]
        v_lo, v_hi = chunk_bounds(dims.vocab_size, t, r)
        i_lo, i_hi = chunk_bounds(dims.intermediate_size, t, r)
        self.model.embed_tokens = VocabParallelEmbedding(v_lo, v_hi - v_lo, h, tp, **factory)
        bias = bool(dims.qkv_bias)  # a bias is cut as its projection's rows; q/k norms stay whole
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.num_heads, attn.num_kv_heads = heads, kv_heads
            attn.q_proj = nn.Linear(h, heads * hd, bias=bias, **factory)
            attn.k_proj = nn.Linear(h, kv_heads * hd, bias=bias, **factory)
            attn.v_proj = nn.Linear(h, kv_heads * hd, bias=bias, **factory)
            attn.o_proj = RowParallelLinear(heads * hd, h, tp, **factory)
            if isinstance(mlp, MoE):  # whole experts per rank, a slice of the shared one; one all-reduce
                e_lo, e_hi = chunk_bounds(dims.num_experts, t, r)
                mlp.experts = Experts(e_hi - e_lo, h, dims.expert_intermediate_size, start=e_lo, **factory)
                if dims.shared_expert_intermediate_size:
                    s_lo, s_hi = chunk_bounds(dims.shared_expert_intermediate_size, t, r)
                    mlp.shared_expert = MLP(dims, s_hi - s_lo, **factory)
                mlp.reduce = tp.all_reduce
                continue
            mlp.gate_proj = nn.Linear(h, i_hi - i_lo, bias=False, **factory)
            mlp.up_proj = nn.Linear(h, i_hi - i_lo, bias=False, **factory)
            mlp.down_proj = RowParallelLinear(i_hi - i_lo, h, tp, **factory)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(h, v_hi - v_lo, bias=False, **factory)
        self.to_empty(device=device)  # the norms were still on the meta device
        self.requires_grad_(False)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(float("nan"))  # a shard nobody wrote can never pass for a weight

    lora: LoraSpec | None = None

    @classmethod
    def from_full(cls, full: Llama, tp: TensorParallelGroup, lora: LoraSpec | None = None) -> "TensorParallelLlama":
        """This rank's shards of an unsharded model (same dims, device and dtype), with its LoRA adapters'
        shards when `lora` says it has them."""
        param = next(full.parameters())
        model = cls(full.dims, tp, device=param.device, dtype=param.dtype)
        if lora is not None:
            adapt(model, full.dims, lora)
            model.lora = lora
        model.load_full(full.state_dict())
        return model

    # -- the plan's regions ------------------------------------------------------------------------
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full-model shape of every parameter, by name (the model's parameter inventory, adapters included)."""
        adapters = lora_params(self.dims, self.lora) if self.lora is not None else []
        return {p.name: p.shape for p in (*llama_params(self.dims), *adapters)}

    def _kv_head_rows(self, full_rows: int) -> tuple[int, int]:
        """Rows [a, b) of a full k/v weight that this rank's replicated head covers."""
        head = self.tp.rank // self.kv_replicas
        rows = full_rows // self.dims.num_kv_heads
        return head * rows, (head + 1) * rows

    def _replicated(self, name: str) -> bool:
        return self.kv_replicas > 1 and name.split(".")[-2] in _KV

    def shards(self, tensors: Mapping[str, Tensor] | None = None) -> dict[str, tuple[Tensor, Region]]:
        """Per parameter, the tensor the weight sync writes and the full-tensor region it is (the
        plan's region; for a replicated KV head, a view of the rank's block inside its head).
        `tensors` stands in for some parameters (same local shapes): an fp8 generator's staging."""
        out = {}
        for name, shape in self.full_shapes().items():
            p = tensors[name] if tensors is not None and name in tensors else self.get_parameter(name)
            region = tp_region(name, shape, self.tp.rank, self.tp.size)
            if self._replicated(name):
                (a, b), (head_a, head_b) = region[0], self._kv_head_rows(shape[0])
                assert head_a <= a <= b <= head_b, (name, region, head_a, head_b)
                out[name] = (p[a - head_a:b - head_a], region)
            else:
                assert tuple(p.shape) == tuple(b - a for a, b in region), (name, p.shape, region)
                out[name] = (p, region)
        return out

    # -- loading -----------------------------------------------------------------------------------
    @torch.no_grad()
    def load_full(self, state: Mapping[str, Tensor]) -> None:
        """Copy this rank's regions (whole heads where KV heads are replicated) out of full tensors (a LoRA
        model's version may be its adapters alone: its base stays)."""
        for name, shape in self.full_shapes().items():
            if name not in state and self.lora is not None and not is_adapter(name):
                continue
            full = state[name]
            if tuple(full.shape) != shape:
                raise RunError(f"{name}: full tensor has shape {tuple(full.shape)}, expected {shape}")
            if self._replicated(name):
                a, b = self._kv_head_rows(shape[0])
                self.get_parameter(name).copy_(full[a:b])
            else:
                region = tp_region(name, shape, self.tp.rank, self.tp.size)
                self.get_parameter(name).copy_(full[to_slices(region)])

    @torch.no_grad()
    def complete_kv_heads(self, tensors: Mapping[str, Tensor] | None = None,
                          among: Callable[[str], bool] | None = None) -> None:
        """After a weight sync wrote each rank's block of k/v rows: fill the rest of every replicated
        KV head from the group's other ranks (one all-gather of all layers' blocks, or of those whose
        name `among` accepts). A collective over the group; a no-op when every rank holds whole heads.
        `tensors` as for `shards`."""
        if self.kv_replicas == 1:
            return
        shards = self.shards(tensors)
        names = [n for n in shards if self._replicated(n) and (among is None or among(n))]
        if not names:
            return
        blocks = [shards[n][0] for n in names]
        sizes = [b.numel() for b in blocks]
        mine = torch.cat([b.reshape(-1) for b in blocks])
        gathered = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(gathered, mine, group=self.tp.group)
        head = self.tp.rank // self.kv_replicas
        peers = range(head * self.kv_replicas, (head + 1) * self.kv_replicas)
        offset = 0
        for name, block, n in zip(names, blocks, sizes):
            head_rows = torch.cat([gathered[q][offset:offset + n].view(block.shape) for q in peers])
            target = tensors[name] if tensors is not None and name in tensors else self.get_parameter(name)
            target.copy_(head_rows)
            offset += n

    @torch.no_grad()
    def gather_full(self) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) of every parameter, assembled on the group's first rank from every rank's
        region, one gather per parameter (a serving engine whose workers cut their own shards reloads
        whole tensors). A collective over the group: every rank iterates it to the end; the others get
        nothing. Replicated norms come from the first rank itself."""
        first = dist.get_process_group_ranks(self.tp.group)[0] if self.tp.size > 1 else None
        blocks = self.shards() if self.kv_replicas > 1 else {}  # a replicated head sends its own block
        for name, shape in self.full_shapes().items():
            own = self.get_parameter(name)
            if self.tp.size == 1 or tp_split_dim(name) is None:
                if self.tp.rank == 0:
                    yield name, own.detach()
                continue
            regions = [tp_region(name, shape, r, self.tp.size) for r in range(self.tp.size)]
            shard = blocks[name][0] if self._replicated(name) else own
            largest = max(region_size(region) for region in regions)
            sent = torch.zeros(largest, dtype=own.dtype, device=own.device)
            sent[:shard.numel()] = shard.reshape(-1)
            received = [torch.empty_like(sent) for _ in regions] if self.tp.rank == 0 else None
            dist.gather(sent, received, dst=first, group=self.tp.group)
            if received is None:
                continue
            full = torch.empty(shape, dtype=own.dtype, device=own.device)
            for region, flat in zip(regions, received):
                full[to_slices(region)] = flat[:region_size(region)].view(tuple(b - a for a, b in region))
            yield name, full

    # -- generation --------------------------------------------------------------------------------
    def allocate_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype,
                          device: torch.device | str) -> KVCache:
        d = self.dims
        shape = (d.num_layers, batch_size, self.model.layers[0].self_attn.num_kv_heads, max_len, d.head_dim)
        return KVCache(
            keys_lbhsd=torch.zeros(shape, dtype=dtype, device=device),
            values_lbhsd=torch.zeros(shape, dtype=dtype, device=device),
            key_valid_bs=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
            num_valid_b=torch.zeros(batch_size, dtype=torch.int64, device=device),
        )

    def logits(self, hidden_bth: Tensor) -> Tensor:
        """Float32 logits over the full vocabulary: this rank's rows, all-gathered over the group."""
        return self.tp.all_gather_last(super().logits(hidden_bth), self.vocab_sizes)


__all__ = ["RowParallelLinear", "TensorParallelGroup", "TensorParallelLlama", "VocabParallelEmbedding"]

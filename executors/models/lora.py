"""LoRA adapters on the decoder's projections (Hu et al., 2021): a targeted projection computes
W x + b + (alpha / rank) * B A dropout(x), with W (and b) frozen and only A [rank, in] and B [out, rank]
trained. A starts as PyTorch's default linear init (Kaiming-uniform, a = sqrt(5)), B at zero, so a new
adapter leaves the model unchanged.

Which projections get adapters, and their shapes, come from the model's parameter inventory
(`schemas/sharding.py:lora_modules`), so the compiler's counts, the weight-sync plan and the modules built
here name the same tensors: `<projection>.lora_A.weight` and `<projection>.lora_B.weight`, as the PEFT
library saves them. A projection is adapted in place (`adapt`): the module keeps its own weight and bias
parameters under their names (a base checkpoint still loads), and gains the two adapter linears. A
tensor-parallel generator's projections hold their shard of W and the matching shard of the adapter
(`lora_A` cut by columns under a row-parallel W, `lora_B` by rows under a column-parallel one); a
row-parallel layer adds its adapter's partial product before its all-reduce (`tensor_parallel.py`).

`adapters_off(model)` runs the base model: a reference initialised from the trained model is its base, so
it needs no weights of its own.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphrl.errors import DataError, RunError
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.sharding import LORA_A, LORA_B, is_adapter, lora_modules


class Adapted:
    """What an adapted projection adds to its own class: the adapter pair and its switch. Mixed into a
    linear class ahead of it (`LoraLinear`, `LoraRowParallelLinear`)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    adapters_on: bool

    def init_adapters(self, rank: int, in_features: int, out_features: int, *, scaling: float, dropout: float,
                      device: torch.device, dtype: torch.dtype) -> None:
        assert isinstance(self, nn.Module)
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = scaling
        self.adapters_on = True

    def adapter(self, x: Tensor) -> Tensor | None:
        """The adapter's term for input `x`, or None with the adapters switched off."""
        if not self.adapters_on:
            return None
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LoraLinear(Adapted, nn.Linear):
    """A projection with an adapter beside its frozen weight."""

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        delta = self.adapter(x)
        return out if delta is None else out + delta


# The adapted class of each projection class; `tensor_parallel.py` adds its row-parallel linear.
ADAPTED: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: LoraLinear}


def adapt(model: nn.Module, dims: ModelDims, lora: LoraSpec, *, seed: int | None = None) -> nn.Module:
    """Give `model`'s targeted projections adapters, in place (the projections keep their weights), and freeze
    everything else. With `seed`, the adapters' initial values are drawn from it, the same on every rank
    and every copy of the model built with it. Returns `model`."""
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]) if seed is not None else nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        for name, *_ in lora_modules(dims, lora):
            module = model.get_submodule(name)
            adapted = ADAPTED.get(type(module))
            if adapted is None:
                raise RunError(f"{name} is a {type(module).__name__}, which LoRA adapters cannot wrap",
                               fix="train this model without lora, or with an engine and precision that adapt it")
            weight = module.weight
            # On a tensor-parallel shard the adapter takes the shard's shape: it acts on what the shard sees
            # (its input columns or output rows), and a weight sync fills it with the matching region.
            in_f, out_f = weight.shape[1], weight.shape[0]
            module.__class__ = adapted  # the same module, its parameters under their names, plus the adapters
            module.init_adapters(lora.rank, in_f, out_f, scaling=lora.scaling, dropout=lora.dropout,  # type: ignore[attr-defined]
                                 device=weight.device, dtype=weight.dtype)
    return model


def fold(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """W + scaling * B A, computed in float32 and returned in W's dtype: an adapter merged into its weight (or
    into the region of it `weight` is, with B's rows and A's columns of that region)."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def _whole(t: Tensor) -> Tensor:
    """A parameter whole: a DTensor gathered (a collective over its mesh), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def merged_shards(model: nn.Module, among: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Per adapted projection of `model` (whose weight's name `among` accepts): the weight as this rank holds
    it (its local shard, a DTensor of the same placements where the weight is one) with the adapter folded in,
    W + scaling * B A over the shard's region, computed in float32: what a sync that merges the adapters sends
    for it. Every rank that holds the model calls this (the adapters are gathered whole where sharded)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, module in model.named_modules():
        key = f"{name}.weight"
        if not isinstance(module, Adapted) or (among is not None and not among(key)):
            continue
        weight = module.weight  # type: ignore[attr-defined]
        a, b = _whole(module.lora_A.weight), _whole(module.lora_B.weight)
        if isinstance(weight, DTensor):
            shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            rows, cols = (slice(o, o + n) for o, n in zip(offset, shape))
            merged = fold(weight.to_local(), a[:, cols], b[rows], module.scaling)
            out[key] = DTensor.from_local(merged, weight.device_mesh, weight.placements, shape=weight.shape,
                                          stride=weight.stride())
        else:
            out[key] = fold(weight, a, b, module.scaling)
    return out


def merged_weights(weights: Iterable[tuple[str, Tensor]], model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) pairs of `model` (as `parallel.full_weights` gives them) with each adapter folded into
    its projection's weight and the adapters left out: the weights of the merged model, under the base's names.
    A projection's weight and its A come before its B, so they are held (copied) until B has passed."""
    scaling = {f"{name}.weight": m.scaling for name, m in model.named_modules() if isinstance(m, Adapted)}
    held: dict[str, Tensor] = {}
    for name, tensor in weights:
        if name in scaling or name.endswith(f".{LORA_A}.weight"):
            held[name] = tensor.detach().clone()
        elif name.endswith(f".{LORA_B}.weight"):
            projection = name.rsplit(".", 2)[0]
            key = f"{projection}.weight"
            yield key, fold(held.pop(key), held.pop(f"{projection}.{LORA_A}.weight"), tensor, scaling[key])
        else:
            yield name, tensor


def generator_version(state: dict[str, Tensor], lora: LoraSpec | None) -> dict[str, Tensor]:
    """What a generator of a model takes of the trainer's full weights `state` as one version: everything (no
    adapters), the adapters alone (`lora.sync: adapters`: it keeps its base), or the weights with the adapters
    merged (`lora.sync: merged`)."""
    if lora is None:
        return state
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    if not lora.merged:
        return adapters
    return merge_adapters({k: v for k, v in state.items() if not is_adapter(k)}, adapters, lora)


@torch.no_grad()
def merge_adapters(state: Mapping[str, Tensor], adapters: Mapping[str, Tensor], lora: LoraSpec) -> dict[str, Tensor]:
    """`state` (base-named weights) with each adapted projection's weight W replaced by W + scaling * B A,
    computed in float32 and cast back to W's dtype."""
    out = dict(state)
    for name in sorted(adapters):
        if not is_adapter(name):
            raise DataError(f"{name} is not an adapter tensor (<projection>.{LORA_A}.weight or .{LORA_B}.weight)",
                            fix="pass the adapters alone, apart from the base weights")
    for projection in sorted({name.rsplit(".", 2)[0] for name in adapters}):
        key = f"{projection}.weight"
        a, b = adapters.get(f"{projection}.{LORA_A}.weight"), adapters.get(f"{projection}.{LORA_B}.weight")
        if key not in state:
            raise DataError(f"an adapter adapts {key}, which the base weights do not have",
                            fix="merge the adapters into the weights of the model they were trained on")
        if a is None or b is None:
            raise DataError(f"the adapter of {projection} has no {LORA_B if b is None else LORA_A}",
                            fix="pass both halves of every adapter")
        rows, cols = state[key].shape
        if a.shape != (lora.rank, cols) or b.shape != (rows, lora.rank):
            raise DataError(f"the adapter of {projection} is {LORA_B} {list(b.shape)} x {LORA_A} {list(a.shape)}; "
                            f"a rank-{lora.rank} adapter of its [{rows}, {cols}] weight is [{rows}, {lora.rank}] x "
                            f"[{lora.rank}, {cols}]", fix="merge the adapters into the model they were trained on, "
                            "with the LoRA settings they were trained with")
        out[key] = fold(state[key], a, b, lora.scaling)
    return out


def lora_spec_of(model: nn.Module) -> LoraSpec | None:
    """The adapters `model` holds, as a declaration (rank, alpha, the projections adapted), or None."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, Adapted)]
    if not modules:
        return None
    rank = modules[0][1].lora_A.weight.shape[0]
    return LoraSpec(rank=rank, alpha=modules[0][1].scaling * rank, targets=tuple(sorted({n.split(".")[-1] for n, _ in modules})))


def adapted_modules(model: nn.Module) -> list[Adapted]:
    return [m for m in model.modules() if isinstance(m, Adapted)]


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base: every adapter switched off inside the block, restored after."""
    modules = adapted_modules(model)
    before = [m.adapters_on for m in modules]
    for m in modules:
        m.adapters_on = False
    try:
        yield
    finally:
        for m, on in zip(modules, before):
            m.adapters_on = on


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by their inventory names (what a checkpoint and a weight sync move)."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights with every adapter folded into its projection (W + scaling * B A), under the base
    model's names: what a plain checkpoint of the trained model holds."""
    out = {name: p.detach().clone() for name, p in model.named_parameters() if not is_adapter(name)}
    for name, module in model.named_modules():
        if isinstance(module, Adapted):
            key = f"{name}.weight"
            out[key] = fold(out[key], module.lora_A.weight, module.lora_B.weight, module.scaling)
    return out


__all__ = ["ADAPTED", "Adapted", "LoraLinear", "adapt", "fold", "adapted_modules", "adapter_state", "adapters_off",
           "generator_version", "lora_spec_of", "merge_adapters", "merged_shards", "merged_state", "merged_weights"]

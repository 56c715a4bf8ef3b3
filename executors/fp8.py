"""fp8 generation weights: the transformer-block linears of a generator stored as `float8_e4m3fn`.

A generator role placed with `precision: fp8` holds each block linear (q/k/v/o, gate/up/down) as an fp8
weight with one float32 scale per output channel (row): `weight ~= fp8.float() * scale[:, None]`, the
scale being the row's absolute maximum over the largest finite e4m3 value (448), so no row saturates.
The embedding, the output head and the norms stay at the model's dtype, as the cost model's weight
accounting (`compiler/cost/model.py:weight_bytes`) charges them.

A matmul runs one of two ways (`Fp8Linear.matmul`):
- `scaled_mm`: activations are quantized per token (row) to e4m3 as well and `torch._scaled_mm` multiplies
  the two fp8 operands with both scale vectors (row-wise scaling), bf16 out. The default for bf16
  activations on CUDA devices of compute capability 9.0 or higher (Hopper: fp8 tensor cores with the
  row-wise scaled kernel) when both dims are multiples of 16, as the kernel needs. A device that still
  refuses the call falls back to `dequantize` for that layer, with a warning;
- `dequantize`: the weight is expanded to the activations' dtype at use, multiplied as usual and the
  product scaled per output channel. Every other case: CPU ranks, older GPUs, float32 models. It saves
  memory, not time; the cost model charges a CPU's fp8 generation at its unquantized rate for that reason.

Weights arrive in full precision (the trainer's dtype on the wire) and are quantized where they land:
`staging_tensors` gives a weight sync full-precision tensors to write the quantized weights into, and
`load_staged` quantizes them into the module once every region has arrived. A sync into fp8 runs in
staging groups of layers (`graphrl.schemas.sharding.staging_layers`): its peak holds one group's
staging beside the fp8 copy, not the whole model's. The colocated copy path (`copy_quantized`) quantizes
tensor by tensor from the trainer's module and needs no staging.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterator, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphrl.executors.tensor_parallel import RowParallelLinear, TensorParallelGroup

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: the largest finite e4m3 value
# A row of zeros would give a zero scale and 0/0 on quantizing; any positive floor keeps it exact zeros.
_MIN_AMAX = 1e-12
# The block linears quantized for generation; embedding, head and norms are not.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Matmul = Literal["auto", "scaled_mm", "dequantize"]


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(fp8 weight, float32 scale per row) of a 2-D weight, `weight ~= fp8.float() * scale[:, None]`."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# e4m3fn's bits shifted into float16's places are the same value over 2^8 (float16's exponent bias is 8
# more), subnormals included: an exact expansion that costs two integer passes, where CPU torch's own
# fp8 -> float conversion runs element by element (measured about 16x slower on a 704 x 256 weight).
_EXPANDED_SCALE = 2.0**8


def expand_fp8(weight: Tensor) -> Tensor:
    """An e4m3fn tensor as float16 values 2^-8 times its own, exactly (multiply by `_EXPANDED_SCALE`)."""
    bits = weight.view(torch.int8).to(torch.int16)  # sign-extended: bits 8-15 repeat the sign
    # sign at bit 15, exponent and mantissa at 7-13; bit 14 (a copy of the sign) cleared: 0xBFFF
    return bits.bitwise_left_shift_(7).bitwise_and_(-16385).view(torch.float16)


def _scaled_mm_capable(device: torch.device) -> bool:
    """fp8 tensor cores with row-wise scaled `_scaled_mm`: CUDA compute capability 9.0 (Hopper) or higher."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Linear(nn.Module):
    """A linear layer whose weight is fp8 with per-output-channel float32 scales (a bias, a Qwen2's q/k/v
    one, stays in the compute dtype: it is added once per output, not multiplied).

    `weight` keeps the parameter name of the `nn.Linear` it replaces (so checkpoint and weight-sync names
    do not change) and never trains; `weight_scale` is a buffer. `compute_dtype` is the model's dtype:
    what activations come in and go out as, and what a weight sync writes before quantizing.
    """

    def __init__(self, in_features: int, out_features: int, *, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None, matmul: Matmul = "auto", bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.matmul: Matmul = matmul
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, matmul: Matmul = "auto") -> "Fp8Linear":
        """The quantized copy of `linear` (same device; its dtype becomes the compute dtype)."""
        out = cls(linear.in_features, linear.out_features, compute_dtype=linear.weight.dtype,
                  device=linear.weight.device, matmul=matmul, bias=linear.bias is not None)
        out.load_(linear.weight)
        if linear.bias is not None and out.bias is not None:
            with torch.no_grad():
                out.bias.copy_(linear.bias)
        return out

    @torch.no_grad()
    def load_(self, weight: Tensor) -> None:
        """Quantize a full-precision weight of this layer's shape into it, in place."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit {tuple(self.weight.shape)}")
        q, scale = quantize_rows(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight expanded to `dtype` (default: the compute dtype)."""
        w = self.weight.float() * self.weight_scale[:, None]
        return w.to(dtype or self.compute_dtype)

    def uses_scaled_mm(self, x: Tensor) -> bool:
        """Whether a forward on `x` runs `torch._scaled_mm` (see the module docstring)."""
        if self.matmul != "auto":
            return self.matmul == "scaled_mm"
        return (x.dtype == torch.bfloat16 and self.in_features % 16 == 0
                and self.out_features % 16 == 0 and _scaled_mm_capable(self.weight.device))

    def forward(self, x: Tensor) -> Tensor:
        out = self._product(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _product(self, x: Tensor) -> Tensor:
        if self.uses_scaled_mm(x):
            try:
                return self._scaled_mm(x)
            except RuntimeError as exc:  # a device or build without the row-wise fp8 kernel
                if self.matmul == "scaled_mm":
                    raise
                warnings.warn(f"torch._scaled_mm is unavailable here ({str(exc).splitlines()[0]}); this fp8 "
                              "layer dequantizes its weight at use instead", stacklevel=2)
                self.matmul = "dequantize"
        return self._dequantized_mm(x)

    def _dequantized_mm(self, x: Tensor) -> Tensor:
        # The scale is per output channel, so it scales the product instead of the weight: the weight
        # is only expanded (exactly), and the multiply is the size of the output.
        if self.weight.device.type == "cpu":
            weight, scale = expand_fp8(self.weight).to(x.dtype), self.weight_scale * _EXPANDED_SCALE
        else:
            weight, scale = self.weight.to(x.dtype), self.weight_scale
        return F.linear(x, weight) * scale.to(x.dtype)

    def _scaled_mm(self, x: Tensor) -> Tensor:
        x_2d = x.reshape(-1, self.in_features).float()
        x_scale = x_2d.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
        x_q = (x_2d / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                               out_dtype=torch.bfloat16)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, matmul={self.matmul}"


class Fp8RowParallelLinear(Fp8Linear):
    """`RowParallelLinear` in fp8: this rank's block of input columns (its own per-row scales, over its
    block only), the partial sums all-reduced over the tensor-parallel group in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, **kwargs: object) -> None:
        super().__init__(in_features, out_features, **kwargs)  # type: ignore[arg-type]
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(super().forward(x))


def quantize_generator(model: nn.Module, matmul: Matmul = "auto") -> nn.Module:
    """Replace every block linear of a Llama generator (full or tensor-parallel) by its fp8 copy, in
    place, and return the model. The full-precision weights are freed layer by layer as they go."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name not in QUANTIZED_LINEARS or isinstance(child, Fp8Linear):
                    continue
                if isinstance(child, RowParallelLinear):
                    quantized: Fp8Linear = Fp8RowParallelLinear(
                        child.in_features, child.out_features, child.tp, compute_dtype=child.weight.dtype,
                        device=child.weight.device, matmul=matmul)
                    quantized.load_(child.weight)
                else:
                    quantized = Fp8Linear.from_linear(child, matmul)
                setattr(parent, name, quantized)
    model.requires_grad_(False)
    return model


def fp8_linears(model: nn.Module | None) -> Iterator[tuple[str, Fp8Linear]]:
    """(parameter name of the weight, layer) of every fp8 layer in `model`."""
    if model is None:
        return
    for prefix, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            yield f"{prefix}.weight", module


def is_quantized(model: nn.Module | None) -> bool:
    return next(fp8_linears(model), None) is not None


def staging_tensors(model: nn.Module | None, among: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Per fp8 weight of `model` (those whose name `among` accepts, if given), an empty full-precision
    tensor of its (local) shape in the compute dtype: where a weight sync writes that weight before
    `load_staged` quantizes it."""
    return {name: torch.empty(layer.weight.shape, dtype=layer.compute_dtype, device=layer.weight.device)
            for name, layer in fp8_linears(model) if among is None or among(name)}


def load_staged(model: nn.Module, staged: Mapping[str, Tensor]) -> None:
    """Quantize every staged weight into its fp8 layer."""
    layers = dict(fp8_linears(model))
    unknown = sorted(set(staged) - set(layers))
    if unknown:
        raise ValueError(f"staged weights that are not fp8 layers: {unknown[:3]}")
    for name, tensor in staged.items():
        layers[name].load_(tensor)


@torch.no_grad()
def copy_quantized(dst: nn.Module, src: nn.Module, wrapper: nn.Module | None = None) -> None:
    """`dst` (a quantized generator with whole tensors) := `src` (an unquantized model of the same
    architecture, maybe FSDP2-sharded inside `wrapper`), gathered by `full_weights`: the block linears
    quantized, everything else copied. Every rank of a sharded `src` calls this (the gathers are collectives)."""
    from graphrl.executors.parallel import weights_for

    layers = dict(fp8_linears(dst))
    target = {name: p for name, p in dst.named_parameters()}
    weights, names = weights_for(target, src, wrapper)  # a LoRA trainer's with its adapters merged
    if set(target) != names:
        raise RuntimeError(f"weights differ: {sorted(set(target) ^ names)[:4]}")
    for name, full in weights:
        if name in layers:
            layers[name].load_(full)
        else:
            target[name].copy_(full)


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the fp8 weights with their scales, bytes of every other parameter) of `model`."""
    quantized = {id(layer.weight) for _, layer in fp8_linears(model)}
    fp8 = sum(layer.weight.numel() * layer.weight.element_size()
              + layer.weight_scale.numel() * layer.weight_scale.element_size() for _, layer in fp8_linears(model))
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized)
    return fp8, rest


__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Linear", "Fp8RowParallelLinear", "QUANTIZED_LINEARS", "copy_quantized",
           "expand_fp8", "fp8_linears", "held_bytes", "is_quantized", "load_staged", "quantize_generator", "quantize_rows",
           "staging_tensors"]

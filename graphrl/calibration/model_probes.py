"""Probes of the executor's own model code: generation, a log-prob forward and a training step timed on
probe models, alone, side by side on local processes, and in the sharded and tensor-parallel layouts.

The host model (`graphrl.calibration.fit`) is fitted to these timings, so they run the executor's code
as a rank runs it, not a stand-in.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from graphrl.calibration.harness import phase_times, spawn, typical_time
from graphrl.calibration.microbench import TORCH_DTYPES
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

Phase = Literal["generate", "forward", "train"]


@dataclass(frozen=True)
class Probe:
    """One timed call of the executor's model code on a probe model."""

    phase: Phase
    dims: ModelDims
    batch: int  # sequences
    prompt_len: int
    response_len: int
    seconds: float
    dtype_bytes: int = 4
    threads: int = 1
    ranks: int = 1  # processes side by side; a training probe is data-parallel over all of them
    sharding: str = "none"  # a training probe's sharding over its ranks (DDP, or FSDP2 for fsdp)
    tp: int = 1  # a generation probe's tensor-parallel size (one replica over that many ranks)


def _probe_trainer(model: Any, sharding: str, group: Any) -> Any:
    """`model` as the executor trains it on a probe: wrapped for `sharding` over `group` (none: alone),
    with its optimizer, in a role state `training.update` takes."""
    from graphrl.executors.parallel import build_optimizer, wrap_trainer
    from graphrl.executors.roles import RoleState
    from graphrl.schemas.plan import MemoryBytes, RolePlacement

    wrapped, wrapping = wrap_trainer(model, sharding, group, torch.device("cpu"))
    optimizer = build_optimizer(wrapped, sharding, wrapping, group, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    placement = RolePlacement(role="probe", model="probe", kind="train", ops=["train"], mesh="probe",
                              memory_bytes=MemoryBytes())
    return RoleState(placement, model, wrapped, wrapping, optimizer)


def _probe_generate(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, uniforms: torch.Tensor) -> Any:
    """The executor's sampler on a probe: eos_id -1 never occurs, so every call runs all passes; one
    uniform number per row and token, as the executor draws them."""
    from graphrl.executors.models.sampling import generate
    from graphrl.tasks import PAD

    return generate(model, prompt_ids, prompt_mask, uniforms.shape[1], temperature=1.0, top_p=1.0,
                    uniforms=uniforms, eos_id=-1, pad_id=PAD)


def _probe_update(role: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, out: Any,
                  advantages: torch.Tensor, group: Any) -> Callable[[], None]:
    """One call of the executor's own update (loss weights, GRPO loss, clipping, AdamW) on `out`."""
    from graphrl.executors import training
    from graphrl.schemas.job import AlgorithmSpec

    rollouts = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out.response_ids,
                    response_mask=out.response_mask, behaviour_logprobs=out.logprobs, version=torch.tensor([0]))
    algorithm = AlgorithmSpec()

    def update() -> None:
        training.update(role, "grpo", algorithm, rollouts, {"advantages": advantages}, None, None,
                        temperature=1.0, group=group, rt=_PROBE_RUNTIME, node="probe", step=0)

    return update


def probe_model_code(
    dims: ModelDims = MODEL_PRESETS["tiny-digits"],
    layers: tuple[int, ...] = (1, 4),
    batches: tuple[int, ...] = (8, 128),
    prompt_len: int = 6,
    response_len: int = 5,
    dtype_bytes: int = 4,
) -> list[Probe]:
    """Time generation, a log-prob forward and a training step (GRPO/PPO loss, gradient clipping,
    AdamW) as the executor runs them, on `dims` at every depth in `layers` and batch in `batches`, in
    the dtype of `dtype_bytes` bytes, with this process's torch threads."""
    from graphrl.executors.models.llama import Llama
    from graphrl.executors.models.sampling import token_logprobs_and_entropy

    # Side by side on several processes, the probe trains data-parallel over all of them (DDP on gloo), as
    # the ranks of a run do: its step includes the gradient reduction and the loss's all-reduces.
    group = dist.group.WORLD if dist.is_initialized() else None
    probes = []
    for num_layers, batch in itertools.product(layers, batches):
        d = dims.model_copy(update=dict(num_layers=num_layers))
        torch.manual_seed(0)
        model = Llama(d).to(TORCH_DTYPES[dtype_bytes])
        role = _probe_trainer(model, "none", group)
        prompt_ids = torch.randint(3, d.vocab_size, (batch, prompt_len))
        prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)
        uniforms = torch.rand(batch, response_len, generator=torch.Generator().manual_seed(0))

        out = _probe_generate(model, prompt_ids, prompt_mask, uniforms)
        train = _probe_update(role, prompt_ids, prompt_mask, out, torch.randn(batch, response_len), group)

        def generate() -> None:
            _probe_generate(model, prompt_ids, prompt_mask, uniforms)

        def forward() -> None:
            with torch.no_grad():
                token_logprobs_and_entropy(model, prompt_ids, prompt_mask, out.response_ids, out.response_mask)

        times = phase_times({"generate": generate, "forward": forward, "train": train})
        for phase, seconds in times.items():
            probes.append(Probe(phase, d, batch, prompt_len, response_len, seconds, dtype_bytes,  # type: ignore[arg-type]
                                torch.get_num_threads(), dist.get_world_size() if group is not None else 1))
    return probes


@dataclass(frozen=True)
class _ProbeRuntime:
    """What the executor's update reads of a rank's runtime in a probe: where collective buffers live."""

    comm_device: torch.device = torch.device("cpu")


_PROBE_RUNTIME = _ProbeRuntime()


def probe_layouts(dims: ModelDims = MODEL_PRESETS["tiny-digits"], layers: tuple[int, ...] = (1, 4),
                  batch: int = 128, prompt_len: int = 6, response_len: int = 5) -> list[Probe]:
    """On the processes of a gloo group: a training step with FSDP2 (`sharding: fsdp`) and one with ZeRO-1
    (DDP and ZeroRedundancyOptimizer) over all of them, a log-prob forward of a frozen model sharded over
    them, and generation on one tensor-parallel replica over all of them, as the executor runs them."""
    from torch.distributed.device_mesh import DeviceMesh

    from graphrl.executors.models.llama import Llama
    from graphrl.executors.models.sampling import token_logprobs_and_entropy
    from graphrl.executors.parallel import shard_frozen
    from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama

    world = dist.get_world_size()
    probes = []
    for num_layers in layers:
        d = dims.model_copy(update=dict(num_layers=num_layers))
        torch.manual_seed(0)
        model = Llama(d)
        prompt_ids = torch.randint(3, d.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
        prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)
        uniforms = torch.rand(batch, response_len, generator=torch.Generator().manual_seed(1))
        sharded = TensorParallelLlama.from_full(model, TensorParallelGroup(dist.get_rank(), world, dist.group.WORLD))
        sharded.eval()
        out = _probe_generate(sharded, prompt_ids, prompt_mask, uniforms)
        t_gen = typical_time(lambda: _probe_generate(sharded, prompt_ids, prompt_mask, uniforms))
        probes.append(Probe("generate", d, batch, prompt_len, response_len, t_gen, 4, torch.get_num_threads(), world,
                            tp=world))
        advantages = torch.randn(batch, response_len, generator=torch.Generator().manual_seed(2))
        train = _probe_update(_probe_trainer(model, "fsdp", dist.group.WORLD), prompt_ids, prompt_mask, out,
                              advantages, dist.group.WORLD)
        probes.append(Probe("train", d, batch, prompt_len, response_len, typical_time(train), 4,
                            torch.get_num_threads(), world, sharding="fsdp"))
        train = _probe_update(_probe_trainer(Llama(d), "zero1", dist.group.WORLD), prompt_ids, prompt_mask, out,
                              advantages, dist.group.WORLD)
        probes.append(Probe("train", d, batch, prompt_len, response_len, typical_time(train), 4,
                            torch.get_num_threads(), world, sharding="zero1"))
        frozen = Llama(d).requires_grad_(False)
        shard_frozen(frozen, DeviceMesh.from_group(dist.group.WORLD, "cpu"))

        def forward() -> None:
            with torch.no_grad():
                token_logprobs_and_entropy(frozen, prompt_ids, prompt_mask, out.response_ids, out.response_mask)

        probes.append(Probe("forward", d, batch, prompt_len, response_len, typical_time(forward), 4,
                            torch.get_num_threads(), world, sharding="fsdp"))
    return probes


def _probe_times(rank: int, world: int) -> list[Probe]:
    return probe_model_code() + probe_layouts()


def probe_side_by_side(num_processes: int) -> list[Probe]:
    """`probe_model_code` on `num_processes` local processes at once (rank 0's timings): ranks of a run
    compute side by side, and on shared cores and caches each is slower than it would be alone."""
    if num_processes <= 1:
        return probe_model_code()
    return spawn(num_processes, _probe_times)

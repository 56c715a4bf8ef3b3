"""A vLLM engine as a generator replica: started in the rank's own process, fed the role's weights.

Imported only when a plan places a generator on `engine: vllm`. One engine per generator replica, run
in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and eager (`enforce_eager=True`); a replica of tp ranks
runs it on its first rank with `tensor_parallel_size` tp and vLLM's worker processes, one per rank of the
replica, on that rank's cores or device (see `VllmEngine`), with the KV-cache bytes the plan charged (raised to what one full-length
sequence needs) instead of vLLM's default share of the device, on a GPU a share of the device that the
plan's charge fits in (`gpu_memory_share`: vLLM refuses to start where its share is not free, as beside a
colocated trainer), and on CPU its OpenMP threads bound to the rank's own cores.

Weights: at start the engine loads an HF folder written from the role's module (which holds the job's
checkpoint, a GGUF file already converted by graphrl's loader, or the preset's seeded initialisation),
so the engine samples from exactly the weights the native sampler would. After every update the role's
module (the staging tensors the DDMA rounds or the in-place reshard filled, with the checkpoint's
names) is reloaded into the running engine with `model_runner.reload_weights(weights_iterator=...,
is_checkpoint_format=True)`: every tensor at once, so fused projections (q/k/v, gate/up) get all their
parts together; then the prefix cache is reset, since cached blocks hold keys of the old weights. No
files, no restart. On the CPU backend `model.load_weights` cannot be used (linear weights are repacked
for oneDNN); the in-place reload handles that.

LoRA: a generator of a LoRA model keeps its base in the engine as loaded at start and samples with the
adapters through vLLM's own LoRA path (`enable_lora`, at the smallest rank vLLM offers that holds the model's):
after every sync the adapters the sync delivered into the role's module are written as a PEFT folder and
named by a `LoRARequest` of an id of their own, so vLLM loads each version once and its prefix cache, keyed by
the adapter's id, never serves blocks computed under an older version.

Sleep: a plan whose generator shares its devices with the trainer on GPUs marks the engine to sleep
(`RolePlacement.sleeps`). It is started with vLLM's sleep mode and sleeps at level 2 whenever it is not
generating: its weights and KV cache are freed, not copied to the host. On waking it takes the weights
from the role's module (which every weight sync keeps current) and then its KV cache, so a sync while it
sleeps moves nothing into it. vLLM's sleep mode runs on CUDA only; a CPU plan never sets it.

Sampling follows the native sampler (see `executors/engines/__init__.py`): per-request seeds from
(seed, step, response index), temperature, top_p, max_new_tokens, the job's stop tokens (and nothing
else: the model's own EOS is ignored unless it is one of them), behaviour log-probs of the sampled
token from `SamplingParams(logprobs=0)` in vLLM's `processed_logprobs` mode: of the sampling distribution,
logits / T (with top_p < 1 vLLM also renormalizes over the nucleus, where graphrl's convention ignores
top-p; the mismatch metrics show that difference).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from graphrl.errors import RunError
from graphrl.schemas.job import Engine
from graphrl.schemas.plan import RolePlacement

from graphrl.executors.engines import EngineContext, GenerationRequest, pad_piece, rank_cores
from graphrl.executors.models.lora import adapter_state, lora_spec_of
from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama
from graphrl.schemas.sharding import is_adapter

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# vLLM needs room for at least one sequence of the model's length; blocks round it up.
_KV_MARGIN_TOKENS = 256


def kv_cache_bytes(module: nn.Module, dtype: torch.dtype, max_model_len: int, planned_bytes: float) -> int:
    """The engine's KV-cache bytes: what the plan charged, at least what one full-length sequence needs."""
    dims = module.dims  # type: ignore[attr-defined]
    per_token = 2 * dims.num_layers * dims.kv_width * torch.empty((), dtype=dtype).element_size()
    return int(max(planned_bytes, per_token * (max_model_len + _KV_MARGIN_TOKENS)))


# Beyond its weights and KV cache, a GPU engine's share of the device leaves room for its activations and
# workspace (its profile run's peak).
GPU_ENGINE_HEADROOM = 0.05


def gpu_memory_share(placement: RolePlacement, kv_bytes: float, device_memory_bytes: float) -> float:
    """vLLM's `gpu_memory_utilization` for a GPU engine: the share of the device the plan charges it (its
    weights and KV cache) plus `GPU_ENGINE_HEADROOM`. vLLM refuses to start where less than that share is
    free, so an engine beside a resident trainer must not ask for its default 90%."""
    if device_memory_bytes <= 0:
        return 0.9  # no budget to go by: vLLM's default
    return min(0.95, (placement.memory_bytes.engine_weights + kv_bytes) / device_memory_bytes + GPU_ENGINE_HEADROOM)


def _reload(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Run on the engine's worker: reload every named tensor in place.

    A tied output head reads the embedding, which the reload fills; but vLLM's CPU backend packs the
    head's view of it for its GEMM once, after loading, and an in-place reload re-processes only the
    layers whose weights it loaded (a tied head has none of its own). Left alone, the head would keep
    the first weights for the whole run, so it is tied again and re-processed here (on GPUs, where
    nothing is packed, this reads the same tensor)."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    config = getattr(model, "config", None)
    if head is not None and embed is not None and getattr(config, "tie_word_embeddings", False):
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


class VllmEngine:
    """One vLLM `LLM` per generator replica, sampling token ids (no tokenizer: prompts arrive tokenized).

    A replica of one rank runs the engine in its own process. A tensor-parallel replica (tp ranks, each
    holding its shards of the role's module, `TensorParallelLlama`) runs one engine on its first rank with
    `tensor_parallel_size` = tp: vLLM's worker processes, one per rank of the replica, each bound to that
    rank's cores (on CUDA, its device). The replica's ranks gather their shards into whole tensors on the
    first rank to start and to reload the engine (one gather per tensor; vLLM's workers cut their own
    shards), and receive the first rank's responses (one broadcast), so every rank of the replica holds
    the piece the native tensor-parallel sampler would have given it."""

    name: Engine = "vllm"

    def __init__(self, llm: Any, module: nn.Module, role: str, rank: int, *, sleeps: bool = False,
                 group: TensorParallelGroup | None = None) -> None:
        self.llm = llm  # None on a tensor-parallel replica's other ranks
        self.module = module
        self.role = role
        self.rank = rank
        self.sleeps = sleeps
        self.group = group
        self.asleep = False
        self.last_sync_s = 0.0
        self.lora = lora_spec_of(module)  # the adapters the module holds: sampled through vLLM's LoRA path
        self.lora_request: Any = None
        self.adapter_root: Path | None = None
        self.versions = 0

    @property
    def leads(self) -> bool:
        """Whether this rank runs the replica's engine (the only rank of a tp-1 replica, else the first)."""
        return self.group is None or self.group.rank == 0

    @classmethod
    def start(cls, placement: RolePlacement, module: nn.Module, dtype: torch.dtype,
              context: EngineContext) -> "VllmEngine":
        """Start the engine on the weights `module` holds now (a collective over a tensor-parallel replica);
        a failure names the role, rank and cause."""
        group = _replica_group(placement, module, context)
        if placement.sleeps and context.device.type != "cuda":
            raise RunError(f"rank {context.rank}: the plan puts the vLLM engine of role {placement.role} to sleep "
                           f"between generations, but vLLM's sleep mode runs on CUDA only (this rank runs on "
                           f"{context.device.type})", fix="compile the job for the hardware it runs on")
        members = _replica_members(group, context)
        weights = dict(module.gather_full()) if group is not None else None  # type: ignore[operator]
        engine = cls(None, module, placement.role, context.rank, sleeps=placement.sleeps, group=group)
        if not engine.leads:
            if engine.sleeps:
                engine.asleep = True
            return engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if context.device.type == "cpu":  # each worker on its rank's cores ("|" between workers)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, rank_cores(r, context.threads)))
                                                            for r, _ in members)
        elif group is not None:  # the workers of a tp replica, one per device of the replica, in its order
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(device) for _, device in members)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RunError(f"rank {context.rank}: role {placement.role} runs on vLLM, which cannot be imported ({exc})",
                           fix="install vllm in the environment that runs the ranks, or use engine: native") from None
        kv_bytes = kv_cache_bytes(module, dtype, context.max_model_len, placement.memory_bytes.kv_cache)
        folder = Path(tempfile.mkdtemp(prefix=f"graphrl-vllm-rank{context.rank}-"))
        try:
            from graphrl.executors.models.hf_checkpoint import save_hf_state

            state = weights if weights is not None else module.state_dict()
            save_hf_state({k: v for k, v in state.items() if not is_adapter(k)}, module.dims, folder)  # type: ignore[arg-type]
            parallel = ({"tensor_parallel_size": placement.tp, "distributed_executor_backend": "mp"}
                        if group is not None else {"tensor_parallel_size": 1})
            if group is not None:
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # never fork a rank's threads
            del weights
            llm = LLM(model=str(folder), skip_tokenizer_init=True, enforce_eager=True, dtype=_DTYPE_NAMES[dtype],
                      kv_cache_memory_bytes=kv_bytes, max_model_len=context.max_model_len,
                      seed=context.seed, disable_log_stats=True, logprobs_mode="processed_logprobs", **parallel,
                      # as many sequences as one generation asks for, not vLLM's default (its per-sequence
                      # buffers: 96 MiB less held beside SmolLM2-135M on CPU, in fp32 and bf16 alike)
                      **({"max_num_seqs": context.max_batch} if context.max_batch else {}),
                      **({"enable_sleep_mode": True} if placement.sleeps else {}),
                      **({"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_lora_rank(engine.lora.rank)}
                         if engine.lora is not None else {}),
                      **({"gpu_memory_utilization": gpu_memory_share(placement, kv_bytes, context.device_memory_bytes)}
                         if context.device.type == "cuda" else {}))
        except RunError:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM fails in many ways at start; each is reported the same way
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise RunError(f"rank {context.rank}: the vLLM engine of role {placement.role} failed to start "
                           f"({type(exc).__name__}: {reason})",
                           fix=f"check that the model's architecture is one vLLM runs and that {_size(kv_bytes)} of KV "
                               "cache fit next to the weights; or use engine: native") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        engine.llm = llm
        if engine.sleeps:
            engine.sleep()  # until its first generation
        return engine

    def generate(self, request: GenerationRequest) -> dict[str, Tensor]:
        if self.asleep:
            self.wake_up()
        n, length = request.prompt_ids.shape[0], request.max_new_tokens
        response_ids = torch.full((n, length), request.pad_id, dtype=torch.int64)
        response_mask = torch.zeros(n, length, dtype=torch.int64)
        logprobs = torch.zeros(n, length, dtype=torch.float32)
        if self.leads:
            for i, completion in enumerate(self._sample(request)):
                tokens = list(completion.token_ids)[:length]
                response_ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
                response_mask[i, :len(tokens)] = 1
                logprobs[i, :len(tokens)] = torch.tensor(
                    [step[tok].logprob for tok, step in zip(tokens, completion.logprobs)], dtype=torch.float32)
            if self.sleeps:
                self.sleep()
        elif self.sleeps:
            self.asleep = True
        if self.group is not None:  # the replica's other ranks receive what its engine sampled
            first = dist.get_process_group_ranks(self.group.group)[0]
            for t in (response_ids, response_mask, logprobs):
                dist.broadcast(t, src=first, group=self.group.group)
        device = request.prompt_ids.device
        return pad_piece(request, response_ids.to(device), response_mask.to(device, torch.bool), logprobs.to(device))

    def _sample(self, request: GenerationRequest) -> list[Any]:
        """The engine's completion of each prompt of `request` (on the rank that runs it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = request.prompt_ids.shape[0]
        ids, mask = request.prompt_ids.cpu(), request.prompt_mask.cpu().bool()
        prompts = [TokensPrompt(prompt_token_ids=ids[i][mask[i]].tolist()) for i in range(n)]
        seeds = request.seeds()
        params = [SamplingParams(n=1, temperature=request.temperature, top_p=request.top_p,
                                 max_tokens=request.max_new_tokens, seed=seeds[i],
                                 logprobs=0, stop_token_ids=list(request.stop_ids), ignore_eos=True, detokenize=False)
                  for i in range(n)]
        try:
            adapter = {"lora_request": self.lora_request} if self.lora_request is not None else {}
            outputs = self.llm.generate(prompts, params, use_tqdm=False, **adapter)
        except Exception as exc:  # noqa: BLE001 - an engine that dies mid-run ends the rank with its cause
            raise RunError(f"rank {self.rank}: the vLLM engine of role {self.role} failed while generating step "
                           f"{request.step} ({type(exc).__name__}: {str(exc)[:300]})",
                           fix="the last checkpoint is intact: resume from it, or use engine: native") from None
        return [out.outputs[0] for out in outputs]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> float:
        """Reload named full tensors (checkpoint names) into the running engine; seconds it took."""
        from graphrl.executors.models.hf_checkpoint import hub_tensors

        started = time.perf_counter()
        # checkpoint names: a mixture of experts' stacked experts one tensor per expert
        named = [(name, t.detach()) for name, t in hub_tensors(((n, t) for n, t in weights if not is_adapter(n)),
                                                               self.module.dims)]  # type: ignore[arg-type]
        try:
            self.llm.collective_rpc(_reload, args=(named,))
            self.llm.reset_prefix_cache()
        except Exception as exc:  # noqa: BLE001
            raise RunError(f"rank {self.rank}: reloading weights into the vLLM engine of role {self.role} failed "
                           f"({type(exc).__name__}: {str(exc)[:300]})",
                           fix="check that the trainer's parameter names are the checkpoint's") from None
        self.last_sync_s = time.perf_counter() - started
        return self.last_sync_s

    def _reload_module(self) -> None:
        """Reload the role's module into the engine: its tensors, or on a tensor-parallel replica the whole
        tensors gathered from every rank's shards (a collective over the replica)."""
        if self.group is None:
            self.load_weights(self.module.state_dict().items())
            return
        started = time.perf_counter()
        weights = self.module.gather_full()  # type: ignore[operator]
        if self.leads:
            self.load_weights(list(weights))
            self.last_sync_s = time.perf_counter() - started
        else:
            for _ in weights:
                pass

    def weights_updated(self) -> None:
        """Reload the role's module (the staging tensors the sync filled) into the engine; an engine asleep
        takes them when it wakes. A LoRA model's sync changed its adapters alone: they become the engine's
        next adapter."""
        if self.lora is not None:
            self._next_adapter()
        elif not self.asleep:
            self._reload_module()

    def _next_adapter(self) -> None:
        """Write the adapters the role's module holds (gathered whole on a tensor-parallel replica: a
        collective) as a PEFT folder and sample with them from now on, under an id of their own."""
        from graphrl.models.adapters import save_peft_adapter

        started = time.perf_counter()
        adapters = ({n: t for n, t in self.module.gather_full() if is_adapter(n)}  # type: ignore[operator]
                    if self.group is not None else adapter_state(self.module))
        if not self.leads:
            return
        from vllm.lora.request import LoRARequest

        if self.adapter_root is None:
            self.adapter_root = Path(tempfile.mkdtemp(prefix=f"graphrl-vllm-adapters-rank{self.rank}-"))
        self.versions += 1
        folder = self.adapter_root / f"v{self.versions}"
        assert self.lora is not None
        save_peft_adapter(folder, {n: t.detach().float() for n, t in adapters.items()}, self.lora,
                          self.module.dims, None)  # type: ignore[arg-type]
        # vLLM reads the folder when the id is first used; the folder before it is no longer read
        shutil.rmtree(self.adapter_root / f"v{self.versions - 2}", ignore_errors=True)
        self.lora_request = LoRARequest(f"graphrl-{self.role}-v{self.versions}", self.versions, str(folder))
        self.last_sync_s = time.perf_counter() - started

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (level 2: nothing kept on the host)."""
        self._call("sleep", lambda: self.llm.sleep(level=2))
        self.asleep = True

    def wake_up(self) -> None:
        """Allocate the weights, fill them from the role's module, then allocate the KV cache (every rank of
        a tensor-parallel replica takes part in the fill)."""
        if self.leads:
            self._call("wake", lambda: self.llm.wake_up(tags=["weights"]))
        self.asleep = False
        self._reload_module()
        if self.leads:
            self._call("wake", lambda: self.llm.wake_up(tags=["kv_cache"]))

    def _call(self, what: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            raise RunError(f"rank {self.rank}: the vLLM engine of role {self.role} failed to {what} "
                           f"({type(exc).__name__}: {str(exc)[:300]})",
                           fix="the last checkpoint is intact: resume from it, or use engine: native") from None

    def close(self) -> None:
        """Drop the engine (in process: its memory goes with the last reference). A tensor-parallel
        engine's workers end with this process: vLLM's explicit shutdown would also destroy the rank's
        own default process group, which the run still uses."""
        self.llm = None
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)


# The ranks vLLM's LoRA path is started with (`LoRAConfig.max_lora_rank`); an adapter of a smaller rank fits.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM starts its LoRA path with that holds adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise RunError(f"LoRA rank {rank} is larger than vLLM's largest ({VLLM_LORA_RANKS[-1]})",
                   fix=f"use a rank of at most {VLLM_LORA_RANKS[-1]}, or engine: native")


def _replica_group(placement: RolePlacement, module: nn.Module, context: EngineContext) -> TensorParallelGroup | None:
    """The tensor-parallel group of this rank's replica (None for a replica of one rank)."""
    if placement.tp == 1:
        return None
    if not isinstance(module, TensorParallelLlama) or module.tp.size != placement.tp:
        raise RunError(f"rank {context.rank}: role {placement.role} runs on vLLM with tp={placement.tp}, but its "
                       "module is not cut into that many tensor-parallel shards", fix="recompile the plan")
    return module.tp


def _replica_members(group: TensorParallelGroup | None, context: EngineContext) -> list[tuple[int, int]]:
    """(global rank, device index) of every rank of the replica, in its order: the cores and devices its
    engine's workers use (a collective over a tensor-parallel replica)."""
    device = context.device.index if context.device.index is not None else 0
    if group is None:
        return [(context.rank, device)]
    members: list[Any] = [None] * group.size
    dist.all_gather_object(members, (context.rank, device), group=group.group)
    return [tuple(m) for m in members]


__all__ = ["VLLM_LORA_RANKS", "VllmEngine", "kv_cache_bytes", "vllm_lora_rank"]

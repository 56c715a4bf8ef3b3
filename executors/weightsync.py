"""Executing a DDMA weight sync: the plan's transfer rounds, as batched point-to-point copies.

Each side holds SHARDS: per parameter, a local tensor and the region of the full tensor it covers
(a full copy is the shard whose region is the whole tensor). A bucket carries slices (regions of
parameters, in full-tensor coordinates, shifted by each side's shard offset) from a trainer rank to
a generator rank. Bytes on the wire are the sender's (`wire_dtype`); the receiver casts to its
shards' dtype, so a precision change happens on the receiving side.

A bucket goes as a few messages, cut the same way on both sides from the plan alone: a large
slice travels alone, straight from and into the shards where they are contiguous and of the wire
dtype (no staging copy, no staging memory); runs of small slices share one packed buffer. All of a
rank's messages of a round go out in one `batch_isend_irecv`; in a round no rank sends or receives
more than one bucket. Two rounds are in flight at a time: the next round is packed and posted while
the current one's bytes move, so a rank stages at most two rounds' packed buffers. Every rank posts
its rounds in plan order, so the messages between two ranks match in order. Where trainer and
generator share a rank, the part of the weights that stays on it is copied shard to shard while the
first round's messages are in flight (the plan gives the two disjoint regions of the destination).

Each rank reads the plan once per shard layout into its messages and local copies as index tuples
(`RankSync`), so a sync of every step spends its host time slicing and posting, not re-reading the
plan (a few hundred microseconds otherwise, on the critical path before the first byte moves).

`execute_weight_sync` runs the stored plan (what `compiler/weight_sync.py:ddma_record` writes) on shards, all
of it or one staging group;
`run_weight_sync` is the executor's entry point for whole modules: full, FSDP2-sharded (DTensor) or
tensor-parallel generators (`tensor_parallel.py`), whose shards are the plan's regions, in the model's
dtype or in fp8 (`fp8.py`: received into full-precision staging, quantized on arrival).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from graphrl.errors import RunError
from graphrl.schemas.sharding import Region, staging_group
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.executors import fp8
from graphrl.executors.models.lora import merged_shards
from graphrl.executors.tensor_parallel import TensorParallelLlama

ShardMap = Mapping[str, tuple[Tensor, Region]]  # param name -> (local tensor, region of the full tensor it holds)

# A slice of at least this many elements is a message of its own (direct when its shard allows);
# below it, per-message latency outweighs a staging copy, so neighbouring small slices are packed.
DIRECT_MIN_ELEMS = 1 << 16


def execute_weight_sync(
    data: WeightSyncRecord,
    rank: int,
    src_shards: ShardMap,
    dst_shards: ShardMap,
    comm_device: torch.device,
    device: torch.device,
    *,
    wire_dtype: torch.dtype,
    group: int | None = None,
) -> None:
    """This rank's part of every round of one stored weight sync (sender, receiver, or both); with `group`,
    of that staging group's rounds and local copies only (`WeightSyncRecord.group_rounds`).

    `src_shards` are the trainer shards this rank holds, `dst_shards` the generator shards it fills
    (either may be empty). `wire_dtype` is the senders' dtype, what crosses the link; every rank of
    the sync must pass the same one (a receiver cannot infer it). Buffers live on `comm_device`;
    received bytes are unpacked on `device`.

    The plan is read once per (plan, rank, group, shard layout) into this rank's messages and local copies
    as index tuples into its shards (`_rank_sync`); a sync then only slices, posts and copies.
    """
    program = _rank_sync(data, rank, src_shards, dst_shards, wire_dtype, group)
    src = {name: tensor for name, (tensor, _) in src_shards.items()}
    dst = {name: tensor for name, (tensor, _) in dst_shards.items()}

    def copy_local() -> None:  # one foreach launch: a fraction of the per-tensor dispatch of a loop
        if program.local:
            torch._foreach_copy_([_at(dst[name], into) for name, into, _ in program.local],
                                 [_at(src[name], out_of) for name, _, out_of in program.local])

    def post(k: int) -> tuple[list, list]:  # round k's transfers in flight, and what to unpack after
        sends, recvs = program.rounds[k]
        ops = [dist.P2POp(dist.isend, _pack([_at(src[n], i) for n, i in pieces], wire_dtype, comm_device), peer)
               for peer, pieces, _ in sends]
        unpacks = []
        for peer, pieces, numel in recvs:
            targets = [_at(dst[n], i) for n, i in pieces]
            buf = _direct(targets, wire_dtype, comm_device)
            if buf is None:
                buf = torch.empty(numel, dtype=wire_dtype, device=comm_device)
                unpacks.append((targets, buf))
            ops.append(dist.P2POp(dist.irecv, buf, peer))
        return (dist.batch_isend_irecv(ops) if ops else []), unpacks

    with torch.no_grad():
        pending = [post(0)] if program.rounds else []
        copy_local()  # the rank-local copies overlap the first round's transfers
        for k in range(len(program.rounds)):
            if k + 1 < len(program.rounds):  # two rounds in flight: packing and posting overlap transfers
                pending.append(post(k + 1))
            works, unpacks = pending.pop(0)
            for work in works:
                work.wait()
            for targets, buf in unpacks:
                _unpack(targets, buf.to(device))

Index = tuple[slice, ...] | None  # a region as an index into one rank's shard; None: the whole shard
Message = tuple[int, tuple[tuple[str, Index], ...], int]  # peer, (shard name, index) pieces, elements


class RankSync(NamedTuple):
    """One rank's part of a stored weight sync, resolved against the shards it holds."""

    rounds: tuple[tuple[tuple[Message, ...], tuple[Message, ...]], ...]  # per round: (sends, receives)
    local: tuple[tuple[str, Index, Index], ...]  # shard name, index into the destination, into the source


_RANK_SYNCS: dict[tuple[int, int, int | None], tuple[WeightSyncRecord, Any, RankSync]] = {}


def _rank_sync(data: WeightSyncRecord, rank: int, src_shards: ShardMap, dst_shards: ShardMap,
               wire_dtype: torch.dtype, group: int | None = None) -> RankSync:
    """This rank's messages and local copies (of staging group `group`, or of all), checked against its
    shards (each shard's shape is its region's, the plan's regions lie inside the shards, sources are of
    the wire dtype), and kept for the next sync of the same plan on the same shard layout. Only index tuples
    are kept, never views: a view would hold on to memory that offloading or resharding a parameter means to
    free."""
    layout = (wire_dtype, _layout(src_shards), _layout(dst_shards))
    cached = _RANK_SYNCS.get((id(data), rank, group))
    if cached is not None and cached[0] is data and cached[1] == layout:
        return cached[2]
    src = _checked(src_shards, "source", rank)
    dst = _checked(dst_shards, "destination", rank)
    for name, (tensor, _) in src.items():
        if tensor.dtype != wire_dtype:
            raise RunError(f"rank {rank}: source shard {name} is {tensor.dtype}, but the wire dtype is {wire_dtype}",
                           fix="pass the senders' dtype as wire_dtype; the receiver casts")
    first, stop = 0, len(data.rounds)
    if group is not None:
        first = sum(data.group_rounds[:group])
        stop = first + data.group_rounds[group]
    rounds = []
    for k in range(first, stop):
        sends: list[Message] = []
        recvs: list[Message] = []
        for b_src, b_dst, _, slices in data.round_buckets(k, rank):
            for mine, shards, side, peer, out in ((b_src == rank, src, "source", b_dst, sends),
                                                  (b_dst == rank, dst, "destination", b_src, recvs)):
                if mine:
                    for message in _messages(slices):
                        pieces = tuple((name, _index(shards, name, region, rank, side)) for name, region in message)
                        out.append((peer, pieces, sum(_numel(region) for _, region in message)))
        rounds.append((tuple(sends), tuple(recvs)))
    local = tuple((name, _index(dst, name, region, rank, "destination"), _index(src, name, region, rank, "source"))
                  for _, _, slices in data.local_copies(rank) for name, region in slices
                  if group is None or staging_group(name, data.staging_layers) == group)
    mine = RankSync(tuple(rounds), local)
    if len(_RANK_SYNCS) >= 64:  # a run holds a few plans; never let stale ones pile up
        _RANK_SYNCS.clear()
    _RANK_SYNCS[(id(data), rank, group)] = (data, layout, mine)
    return mine


def _layout(shards: ShardMap) -> tuple:
    """What a `RankSync` depends on in a shard map: each shard's name, region, shape and dtype."""
    return tuple((name, region, t.shape, t.dtype) for name, (t, region) in shards.items())


def run_weight_sync(data: WeightSyncRecord, rank: int, src: nn.Module | None, dst: nn.Module | None, rt: Any, *,
                    merge: bool = False) -> None:
    """`execute_weight_sync` for whole modules, each side's shards as `module_shards` finds them (`rt`
    gives `comm_device` and `device`). The trainer and generator copies of a model share its dtype,
    so a pure receiver takes its own as the wire dtype. A tensor-parallel generator whose KV heads are
    replicated then completes them over its group.

    An fp8 generator (`fp8.py`) receives its quantized weights into full-precision staging tensors of
    the wire dtype, completes its KV heads there, and quantizes them into its fp8 layers: the wire
    carries the trainer's bytes, the destination keeps fp8 and scales. A plan made in staging groups
    (`WeightSyncRecord.staging_layers`) runs group by group, staging, quantizing and freeing one group's
    linears before the next group's first round; a record whose groups leave an fp8 weight unstaged is
    refused after its last group, as a sync that left stale weights.

    With `merge`, the trainer sends its LoRA adapters folded into its weights, a staging group at a time
    (`lora.merged_shards`: each group's merged linears exist only while that group is sent)."""
    src_shards = module_shards(src)
    wire_dtype = None
    quantized: set[str] = set()
    for group, member in _staging_groups(data):
        if merge and src is not None:
            src_shards = module_shards(src, merged_shards(src, member))
        staged = fp8.staging_tensors(dst, member)
        quantized.update(staged)
        dst_shards = module_shards(dst, staged)
        if wire_dtype is None:
            held = next(iter(src_shards.values()), None) or next(iter(dst_shards.values()), None)
            wire_dtype = held[0].dtype if held is not None else torch.float32
        execute_weight_sync(data, rank, src_shards, dst_shards, rt.comm_device, rt.device, wire_dtype=wire_dtype,
                            group=group)
        if isinstance(dst, TensorParallelLlama):
            dst.complete_kv_heads(staged, member)
        if staged:
            fp8.load_staged(dst, staged)  # type: ignore[arg-type]
        del staged, dst_shards  # this group's staging is freed before the next one's is allocated
        if merge:
            src_shards = {}
    missed = sorted({name for name, _ in fp8.fp8_linears(dst)} - quantized) if quantized else []
    if missed:
        raise RunError(f"rank {rank}: the weight sync of {data.model} left {len(missed)} fp8 weights without new "
                       f"values ({', '.join(missed[:3])}): its staging groups do not cover the model's layers",
                       fix="recompile the plan with this graphrl")


Group = Callable[[str], bool] | None  # the parameters of one staging group; None: every parameter


def _staging_groups(data: WeightSyncRecord) -> list[tuple[int | None, Group]]:
    """A staged plan's groups in order: each group's index (`execute_weight_sync`'s `group`) and which
    parameters it fills. A plan in one group is its own single part (None, None)."""
    if len(data.group_rounds) <= 1:
        return [(None, None)]
    layers = data.staging_layers

    def member(g: int) -> Group:
        return lambda name: staging_group(name, layers) == g

    return [(g, member(g)) for g in range(len(data.group_rounds))]


def module_shards(module: nn.Module | None, staged: Mapping[str, Tensor] | None = None
                  ) -> dict[str, tuple[Tensor, Region]]:
    """What a module holds of each full parameter: a tensor-parallel generator's shards (the plan's
    regions), a DTensor parameter's local piece (FSDP2) with the region DTensor says it covers, or a
    plain parameter whole. `staged` stands in for some parameters (an fp8 generator's staging)."""
    if module is None:
        return {}
    if isinstance(module, TensorParallelLlama):
        return module.shards(staged)
    out: dict[str, tuple[Tensor, Region]] = {}
    for name, p in _params(module).items():
        if staged is not None and name in staged:
            p = staged[name]
        if isinstance(p, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = (p.to_local(), tuple((o, o + n) for o, n in zip(offset, local_shape)))
        else:
            out[name] = (p, tuple((0, n) for n in p.shape))
    return out


def _params(module: nn.Module) -> dict[str, Tensor]:
    params = dict(module.named_parameters())
    if "lm_head.weight" not in params and "model.embed_tokens.weight" in params:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]  # tied embeddings
    return params


def _checked(shards: ShardMap, side: str, rank: int) -> dict[str, tuple[Tensor, Region]]:
    """Shards as (detached tensor, tuple region), each tensor's shape the size of its region."""
    out = {}
    for name, (tensor, region) in shards.items():
        region = tuple((int(a), int(b)) for a, b in region)
        if tuple(tensor.shape) != tuple(b - a for a, b in region):
            raise RunError(f"rank {rank}: {side} shard {name} has shape {tuple(tensor.shape)}, "
                           f"but its region {region} has shape {tuple(b - a for a, b in region)}")
        out[name] = (tensor.detach(), region)
    return out


def _index(shards: dict[str, tuple[Tensor, Region]], name: str, region: list[list[int]], rank: int,
           side: str) -> Index:
    """`region` (full-tensor coordinates) of `name`, as an index into this rank's shard of it (None: all of it)."""
    held = shards.get(name)
    if held is None:
        raise RunError(f"rank {rank}: the weight-sync plan needs {side} {name}{_fmt(region)}, but this rank holds "
                       f"no {side} shard of {name}")
    _, within = held
    if len(region) != len(within) or any(not (wa <= a <= b <= wb) for (a, b), (wa, wb) in zip(region, within)):
        raise RunError(f"rank {rank}: the weight-sync plan needs {side} {name}{_fmt(region)}, outside the "
                       f"shard {_fmt(within)} this rank holds",
                       fix="give each rank the shards of the layout the plan was compiled for")
    if all(a == wa and b == wb for (a, b), (wa, wb) in zip(region, within)):
        return None  # the common aligned case: no view to build on every sync
    return tuple(slice(a - wa, b - wa) for (a, b), (wa, _) in zip(region, within))


def _at(tensor: Tensor, index: Index) -> Tensor:
    """The part of a shard an `Index` names."""
    return tensor if index is None else tensor[index]


def _messages(slices: list) -> list[list]:
    """A bucket's slices cut into messages: each large slice alone, each run of small ones together."""
    messages: list[list] = []
    run: list = []
    for piece in slices:
        if _numel(piece[1]) < DIRECT_MIN_ELEMS:
            run.append(piece)
            continue
        if run:
            messages.append(run)
            run = []
        messages.append([piece])
    if run:
        messages.append(run)
    return messages


def _numel(region: list[list[int]]) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def _fmt(region: Any) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def _direct(views: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The bucket's one slice as a flat tensor sharing its shard's memory, when it can go on the wire as is."""
    if len(views) != 1:
        return None
    (v,) = views
    return v.view(-1) if v.is_contiguous() and v.dtype == dtype and v.device == device else None


def _pack(views: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The views as one flat message buffer (the sources are of the wire dtype). One copy kernel per
    message: a sync's small pieces run right after megabytes of copying, with cold caches, where each
    further op dispatch costs tens of microseconds."""
    flat = _direct(views, dtype, device)
    if flat is not None:
        return flat
    if len(views) == 1:
        flat = views[0].contiguous().view(-1)
    else:
        flat = torch.cat([v.reshape(-1) for v in views])  # reshape: a view for the small contiguous pieces
    return flat.to(device=device, dtype=dtype)


def _unpack(targets: list[Tensor], flat: Tensor) -> None:
    torch._foreach_copy_(targets, _pieces(flat, targets))  # casts to the shards' dtype


def _pieces(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """`flat` cut into consecutive views shaped like `like`'s tensors."""
    return [piece if t.dim() == 1 else piece.view(t.shape)
            for piece, t in zip(flat.split([t.numel() for t in like]), like)]


# ---------------------------------------------------------------------------------------------
# Delivery check: the generator samples what the trainer holds

# A probe reads every weight once whatever its length (a forward over a few tokens is bound by reading the
# weights): a few tokens suffice to see adapters that did not arrive, and cost little more than one decode step.
PROBE_TOKENS = 4
PROBE_TAG = 1 << 29  # apart from the rollouts' tags (`schedule.TAG_STRIDE` per step)


def probe_logprobs(module: nn.Module, wrapped: nn.Module | None = None) -> Tensor:
    """Float32 log-probs of a fixed response of `PROBE_TOKENS` tokens after a fixed prompt, under `module` (through
    `wrapped`, a trainer's forward, where it has one: FSDP2 gathers there). A collective where the module is
    sharded, so every rank that holds it calls this."""
    from graphrl.executors.models.sampling import token_logprobs_and_entropy

    vocab = module.dims.vocab_size  # type: ignore[union-attr]
    device = next(module.parameters()).device
    ids = (torch.arange(1, 2 * PROBE_TOKENS + 1, device=device) * 7919 % vocab)[None]
    prompt, response = ids[:, :PROBE_TOKENS], ids[:, PROBE_TOKENS:]
    masks = torch.ones_like(prompt, dtype=torch.bool), torch.ones_like(response, dtype=torch.bool)
    with torch.no_grad():
        if wrapped is not None:
            lp, _ = wrapped(prompt, masks[0], response, masks[1])
        else:
            lp, _ = token_logprobs_and_entropy(module, prompt, masks[0], response, masks[1])  # type: ignore[arg-type]
    return lp[0].float()


def probe_tolerance(generator: nn.Module) -> float:
    """How far a generator's probe log-probs may be from the trainer's on the same weights (differently sharded
    matmuls round differently): 1e-3 in float32, 0.1 in 16-bit types, 0.5 for an fp8 generator (its weights
    are quantized: only adapters that change log-probs by more than that are seen missing there)."""
    if fp8.is_quantized(generator):
        return 0.5
    return 1e-3 if next(generator.parameters()).dtype == torch.float32 else 0.1


def check_delivery(data: WeightSyncRecord, rank: int, src: nn.Module | None, dst: nn.Module | None, version: int,
                   rt: Any, src_wrapped: nn.Module | None = None) -> None:
    """After a weight sync into a generator of its own: every trainer rank scores the probe (a collective over
    the trainer), the trainer's first rank sends it to each generator rank, and each generator rank scores
    it with what it received and compares. A sync that delivered nothing, or stale or misplaced values,
    leaves the generator sampling from other weights than the trainer's: an error, not a silent staleness.
    (A rank that holds both copies compares them itself.)"""
    trainer = src is not None
    want = probe_logprobs(src, src_wrapped) if trainer else None
    first = min(data.src.devices)
    if trainer and rank == first:
        for peer in sorted(set(data.dst.devices) - {rank}):
            dist.send(want.to(rt.comm_device), peer, tag=PROBE_TAG + version % PROBE_TAG)  # type: ignore[union-attr]
    if dst is None:
        return
    if want is None:  # received before scoring: the two sides' forwards never compete for the same cores
        want = torch.empty(PROBE_TOKENS, dtype=torch.float32, device=rt.comm_device)
        dist.recv(want, first, tag=PROBE_TAG + version % PROBE_TAG)
    problem = probe_mismatch(dst, want)
    if problem is not None:
        raise RunError(f"rank {rank}: after the weight sync of {data.model} to version {version}, {problem}",
                       fix="recompile the plan with this graphrl; if it persists, report the plan file")


def probe_mismatch(generator: nn.Module, want: Tensor) -> str | None:
    """Why `generator` does not sample from the weights whose probe log-probs are `want` (the trainer's), or
    None when its own probe agrees within `probe_tolerance`."""
    gap = float((probe_logprobs(generator).to(want.device) - want).abs().max())
    tolerance = probe_tolerance(generator)
    if gap <= tolerance:
        return None
    return (f"the generator's log-probs of a probe sequence differ from the trainer's by up to {gap:.3g} (tolerance "
            f"{tolerance:g}): the generator does not sample from the weights the trainer synced")

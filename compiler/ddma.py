"""DDMA weight sync: plan the point-to-point copies from the trainer's shards to the generator's.

After a training step the trainer holds the new weights in its layout (say fsdp x tp); every
generator copy needs them in its own layout (say dp x tp), maybe on other devices. The planner
intersects, per parameter, every destination rank's region with the source shards and emits
direct rank-to-rank copies: each byte a destination lacks crosses a link exactly once, bytes a
destination already holds are copied locally, and nothing is gathered or broadcast first.

How it stays fast at 405B scale (~1,140 parameters, 512 -> 512 ranks): parameters with the same
shape, placements and pp stages form one geometry class (all `q_proj` of a stage, ...). The
intersection geometry is computed once per class on distinct regions, not per parameter or
rank, and a (sender, receiver) pair's bucket contents are built once per distinct content and
shared between the pairs that carry the same slices (the dp replicas of a generator).

Choices, all deterministic:
- Senders: where several source ranks hold a piece (replicas), the least-loaded one sends it
  (bytes sent so far, then lowest rank), largest items first. A class's parameters are dealt
  out in up to `ceil(#holders / #receivers)` groups so that few receivers still spread over all
  replicas.
- Buckets: flat buffers of one (src, dst) pair, at most `bucket_bytes` each. A pair of T bytes
  gets about ceil(T / bucket_bytes) buckets of similar size; slices go in class by class, in
  parameter order within a class; a slice longer than a bucket is cut (outer dims first).
- Rounds: a bucket is an edge of the bipartite multigraph senders x receivers; a proper edge
  colouring (König; alternating-path recolouring) gives exactly Δ rounds, Δ = the most buckets
  one rank sends or receives: the fewest possible when no rank sends or receives two buckets at
  once. Largest buckets are coloured first, so big buckets share rounds and small ones fill gaps.
- Bytes on the wire are source bytes: a precision change (bf16 -> fp8) happens on the receiver.
"""

from __future__ import annotations

import functools
import gc
import heapq
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain, groupby, product
from math import ceil, prod
from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterator, Sequence

from graphrl.schemas.job import PRECISION_BYTES
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.sharding import (
    LayoutFn,
    Mesh,
    MeshAxis,
    ParamInfo,
    Region,
    normalize_layout,
    pp_stage,
    staging_group,
    staging_layers,
    region_of,
    region_size,
    llama_layout_on,
    llama_params,
    lora_params,
)
from graphrl.schemas.weightsync import (Bucket, Contents, LocalCopy, LocalCopyRef, Round, Slice, SliceRun,
                                       WeightSyncRecord, WeightSyncSummary)
from graphrl.errors import JobError, PlacementError


@dataclass(frozen=True)
class TransferRound:
    """Buckets that move at once: no rank sends two of them, no rank receives two of them."""

    buckets: tuple[Bucket, ...]

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    @functools.cached_property
    def max_bucket_bytes(self) -> int:
        """The round's largest bucket (what its time follows); read by the summary and the timing alike."""
        return max((b.num_bytes for b in self.buckets), default=0)


@dataclass(frozen=True)
class DdmaPlan:
    """Every copy one weight sync makes. Its buckets and local copies are the plan file's own named tuples
    (`graphrl.schemas.weightsync`), so its record (`sync_record`) takes them as they are. Dicts are read-only
    by convention."""

    rounds: tuple[TransferRound, ...]
    local_copies: tuple[LocalCopy, ...]  # one per rank that keeps some of its own bytes
    total_bytes: int  # bytes over links, summed over buckets
    bytes_per_src: dict[int, int]  # link bytes sent, per rank that sends any
    bytes_per_dst: dict[int, int]  # link bytes received, per rank that receives any
    # Sum over destination ranks and parameters of the bytes of the rank's region it does not
    # hold itself in the source layout: what must cross a link at least once. A plan that moves
    # each byte once has total_bytes == lower_bound_bytes.
    lower_bound_bytes: int
    local_bytes: int  # bytes copied rank-locally (no link)
    src_bytes_per_elem: int
    dst_bytes_per_elem: int
    bucket_bytes: int  # the bucket size limit the plan was made with
    num_pairs: int = 0  # (sender, receiver) pairs with at least one bucket
    # Rounds of each staging group, in order (`plan_weight_sync`'s `group_of`); empty: one group.
    group_rounds: tuple[int, ...] = ()
    # Layers per staging group where the groups are `staging_group`'s (`plan_llama_sync` into fp8); 0: none.
    staging_layers: int = 0

    @property
    def is_noop(self) -> bool:
        """Nothing crosses a link: same layout on the same devices (an in-place reshard)."""
        return not self.rounds

    @property
    def num_buckets(self) -> int:
        return sum(len(r.buckets) for r in self.rounds)

    def buckets(self) -> Iterator[Bucket]:
        """Every link bucket, round by round."""
        for r in self.rounds:
            yield from r.buckets

    def balance(self) -> float:
        """max / mean link bytes over the ranks that send anything (1.0 = perfectly even; 1.0 if none)."""
        loads = [b for b in self.bytes_per_src.values() if b > 0]
        return max(loads) / (sum(loads) / len(loads)) if loads else 1.0


# ---------------------------------------------------------------------------------------------
# Planning


# A piece of one geometry class: (class index, box, first param, end param), the params being
# positions in the class's parameter list. Interned as ints while planning.
_Entry = tuple[int, Region, int, int]


@dataclass
class _Class:
    """Parameters that share shape, placements and pp stages, hence all intersection geometry."""

    shape: tuple[int, ...]
    param_ids: list[int]
    src_groups: dict[Region, tuple[int, ...]]  # distinct source region -> ranks that hold it
    dst_groups: dict[Region, tuple[int, ...]]  # distinct destination region -> ranks that need it
    group: int = 0  # the staging group of its parameters


class _Entries:
    """Interned entries, and the slices of each built once (shared by every bucket that carries it)."""

    def __init__(self, classes: list[_Class], params: Sequence[ParamInfo]) -> None:
        self._names = [[params[pid].name for pid in cls.param_ids] for cls in classes]
        self._groups = [cls.group for cls in classes]
        self._ids: dict[_Entry, int] = {}
        self.entries: list[_Entry] = []
        self._slices: dict[int, tuple[Slice, ...]] = {}

    def intern(self, entry: _Entry) -> int:
        eid = self._ids.get(entry)
        if eid is None:
            eid = self._ids[entry] = len(self.entries)
            self.entries.append(entry)
        return eid

    def group(self, eid: int) -> int:
        return self._groups[self.entries[eid][0]]

    def slices(self, eid: int) -> tuple[Slice, ...]:
        made = self._slices.get(eid)
        if made is None:
            ci, box, lo, hi = self.entries[eid]
            made = self._slices[eid] = tuple([Slice(name, box) for name in self._names[ci][lo:hi]])
        return made


def plan_weight_sync(
    params: Sequence[ParamInfo],
    *,
    src_mesh: Mesh,
    src_layout: LayoutFn,
    dst_mesh: Mesh,
    dst_layout: LayoutFn,
    src_bytes_per_elem: int = 2,
    dst_bytes_per_elem: int | None = None,
    bucket_bytes: int = 1 << 30,
    group_of: Callable[[ParamInfo], int] | None = None,
) -> DdmaPlan:
    """Plan one weight sync from the source (trainer) layout to the destination (generator) layout.

    `src_layout` / `dst_layout` give each parameter's placement on its mesh (e.g.
    `llama_param_layout`); `bucket_bytes` caps one (src, dst) buffer. `group_of` cuts the sync into
    groups that run one after the other, in group order: every parameter of a group arrives whole before
    the next group's first round (an fp8 destination stages and quantizes one group at a time). See the
    module docstring for the choices made; the output is the same for the same input.
    """
    dst_bytes_per_elem = src_bytes_per_elem if dst_bytes_per_elem is None else dst_bytes_per_elem
    if src_bytes_per_elem < 1 or dst_bytes_per_elem < 1:
        raise JobError(f"bytes per element must be >= 1 (got {src_bytes_per_elem}, {dst_bytes_per_elem})")
    if bucket_bytes < src_bytes_per_elem:
        raise JobError(
            f"weight sync bucket size {bucket_bytes} B is smaller than one element ({src_bytes_per_elem} B)",
            fix="use a bucket size of at least a few MiB",
        )
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise PlacementError(f"weight sync: parameter names repeat: {dup[:5]}")

    with gc_paused():
        return _plan(params, src_mesh, src_layout, dst_mesh, dst_layout, src_bytes_per_elem, dst_bytes_per_elem,
                     bucket_bytes, group_of)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Planning builds ~10^6 small acyclic objects (slices, buckets); cyclic GC passes over them
    are pure overhead (~25% of the time at 405B scale). Restores the previous GC state. A caller that
    keeps only a record of the plan pauses around both, so the collector never walks the plan at all."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    params: Sequence[ParamInfo],
    src_mesh: Mesh,
    src_layout: LayoutFn,
    dst_mesh: Mesh,
    dst_layout: LayoutFn,
    src_bytes_per_elem: int,
    dst_bytes_per_elem: int,
    bucket_bytes: int,
    group_of: Callable[[ParamInfo], int] | None,
) -> DdmaPlan:
    classes = _classify(params, src_mesh, src_layout, dst_mesh, dst_layout, group_of)
    eb = src_bytes_per_elem
    book = _Entries(classes, params)
    overlapping = not set(src_mesh.devices).isdisjoint(dst_mesh.devices)

    local: dict[int, list[int]] = defaultdict(list)  # rank -> entries it copies from itself
    sends: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # src -> dst -> entries
    load: dict[int, int] = defaultdict(int)  # link bytes per sender
    choices: list[tuple[int, int, int, int, tuple[int, ...]]] = []  # (-bytes, seq, entry, dst, holders)
    lower_bound = 0

    for ci, cls in enumerate(classes):
        n = len(cls.param_ids)
        own = {r: reg for reg, ranks in cls.src_groups.items() for r in ranks} if overlapping else {}
        for dreg, dranks in cls.dst_groups.items():
            dsize = region_size(dreg)
            lower_bound += dsize * n * eb * len(dranks)
            for r in dranks if own else ():
                if r in own:
                    lower_bound -= _overlap_size(dreg, own[r]) * n * eb
            if dsize == 0:
                continue
            for sreg, box in _pieces(dreg, cls.src_groups):
                holders = cls.src_groups[sreg]
                need: Sequence[int] = dranks
                if overlapping:
                    holder_set = set(holders)
                    keep = [r for r in dranks if r in holder_set]
                    if keep:
                        eid = book.intern((ci, box, 0, n))
                        for r in keep:
                            local[r].append(eid)
                        need = [r for r in dranks if r not in holder_set]
                        if not need:
                            continue
                elems = region_size(box)
                if len(holders) == 1:
                    (s,) = holders
                    eid = book.intern((ci, box, 0, n))
                    out = sends[s]
                    for r in need:
                        out[r].append(eid)
                    load[s] += elems * n * eb * len(need)
                    continue
                # Few receivers for many holders: deal the piece out in parts (runs of the
                # class's parameters, then row blocks of the box) so every holder can take some.
                parts = ceil(len(holders) / len(need))
                num_groups = min(n, parts)
                for g in range(num_groups):
                    lo, hi = (n * g) // num_groups, (n * (g + 1)) // num_groups
                    for part in _split_box(box, ceil(parts / num_groups)):
                        eid = book.intern((ci, part, lo, hi))
                        item_bytes = region_size(part) * (hi - lo) * eb
                        for r in need:
                            choices.append((-item_bytes, len(choices), eid, r, holders))

    _assign_senders(choices, load, sends)
    buckets, groups = _bucketize(sends, book, eb, bucket_bytes)
    local_copies = _local_copies(local, book, eb)
    by_group: dict[int, list[Bucket]] = defaultdict(list)
    for bucket, group in zip(buckets, groups):
        by_group[group].append(bucket)
    rounds = [_schedule(by_group[g]) for g in sorted({cls.group for cls in classes})]

    bytes_per_src: dict[int, int] = defaultdict(int)
    bytes_per_dst: dict[int, int] = defaultdict(int)
    for bucket in buckets:
        bytes_per_src[bucket.src] += bucket.num_bytes
        bytes_per_dst[bucket.dst] += bucket.num_bytes
    total = sum(bytes_per_src.values())
    assert total == lower_bound, (total, lower_bound)
    return DdmaPlan(
        rounds=tuple(chain.from_iterable(rounds)),
        local_copies=local_copies,
        total_bytes=total,
        bytes_per_src=dict(bytes_per_src),
        bytes_per_dst=dict(bytes_per_dst),
        lower_bound_bytes=lower_bound,
        local_bytes=sum(b.num_bytes for b in local_copies),
        src_bytes_per_elem=src_bytes_per_elem,
        dst_bytes_per_elem=dst_bytes_per_elem,
        bucket_bytes=bucket_bytes,
        num_pairs=sum(len(receivers) for receivers in sends.values()),
        group_rounds=tuple(len(r) for r in rounds) if group_of is not None else (),
    )


def _bucketize(sends: dict[int, dict[int, list[int]]], book: _Entries, eb: int,
               limit: int) -> tuple[list[Bucket], list[int]]:
    """Every pair's buckets, pairs in (src, dst) order, each bucket within one staging group; and each
    bucket's group (`plan_weight_sync`'s `group_of`). Pairs with the same entries share slices."""
    packed: dict[tuple[int, ...], list[tuple[int, tuple[tuple[Slice, ...], int]]]] = {}
    buckets: list[Bucket] = []
    groups: list[int] = []
    for s in sorted(sends):
        for r in sorted(sends[s]):
            key = tuple(sends[s][r])
            chunks = packed.get(key)
            if chunks is None:
                by_group: dict[int, list[int]] = defaultdict(list)
                for eid in key:
                    by_group[book.group(eid)].append(eid)
                chunks = packed[key] = [(g, chunk) for g in sorted(by_group)
                                        for chunk in _pack(tuple(by_group[g]), book, eb, limit)]
            buckets.extend(Bucket(s, r, num_bytes, slices) for _, (slices, num_bytes) in chunks)
            groups.extend(g for g, _ in chunks)
    return buckets, groups


def _local_copies(local: dict[int, list[int]], book: _Entries, eb: int) -> tuple[LocalCopy, ...]:
    """One unbounded copy per rank that keeps bytes it already holds."""
    packed: dict[tuple[int, ...], tuple[Slice, ...]] = {}
    out = []
    for r in sorted(local):
        key = tuple(local[r])
        if key not in packed:
            ((packed[key], _),) = _pack(key, book, eb, None)
        slices = packed[key]
        out.append(LocalCopy(r, sum(region_size(sl.region) for sl in slices) * eb, slices))
    return tuple(out)


def _classify(
    params: Sequence[ParamInfo], src_mesh: Mesh, src_layout: LayoutFn, dst_mesh: Mesh, dst_layout: LayoutFn,
    group_of: Callable[[ParamInfo], int] | None = None,
) -> list[_Class]:
    """Group parameters by geometry (and staging group) and compute each class's distinct regions on both
    meshes. Classes come in staging-group order, then in order of their first parameter."""
    by_key: dict[tuple, list[int]] = {}
    for pid, p in enumerate(params):
        key = (
            0 if group_of is None else group_of(p),
            tuple(p.shape),
            normalize_layout(src_layout(p), src_mesh, p.shape, p.name),
            normalize_layout(dst_layout(p), dst_mesh, p.shape, p.name),
            pp_stage(p, src_mesh.size(MeshAxis.PP)),
            pp_stage(p, dst_mesh.size(MeshAxis.PP)),
        )
        by_key.setdefault(key, []).append(pid)
    groups_memo: dict[tuple, dict[Region, tuple[int, ...]]] = {}

    def groups(
        side: str, mesh: Mesh, shape: tuple[int, ...], dim_axes: tuple, stage: int
    ) -> dict[Region, tuple[int, ...]]:
        memo_key = (side, shape, dim_axes, stage)
        if memo_key not in groups_memo:
            groups_memo[memo_key] = _rank_groups(mesh, shape, dim_axes, stage)
        return groups_memo[memo_key]

    return [
        _Class(shape, pids, groups("src", src_mesh, shape, sa, ss), groups("dst", dst_mesh, shape, da, ds), g)
        for (g, shape, sa, da, ss, ds), pids in sorted(by_key.items(), key=lambda item: item[0][0])
    ]


def _rank_groups(mesh: Mesh, shape: tuple[int, ...], dim_axes: tuple, stage: int) -> dict[Region, tuple[int, ...]]:
    """Distinct regions of one geometry on `mesh`, each with the ranks (of pp stage `stage`) holding it."""
    sizes = [s for _, s in mesh.axes]
    pp_pos = mesh.axis_position(MeshAxis.PP)
    relevant = sorted(pos for positions in dim_axes for pos in positions)
    memo: dict[tuple[int, ...], Region] = {}
    out: dict[Region, list[int]] = {}
    for rank, coords in mesh.coord_table():
        if pp_pos is not None and coords[pp_pos] != stage:
            continue
        key = tuple(coords[p] for p in relevant)
        region = memo.get(key)
        if region is None:
            region = memo[key] = region_of(shape, dim_axes, sizes, coords)
        out.setdefault(region, []).append(rank)
    return {region: tuple(ranks) for region, ranks in out.items()}


def _pieces(dst_region: Region, src_groups: dict[Region, tuple[int, ...]]) -> Iterator[tuple[Region, Region]]:
    """(source region, dst_region ∩ source region) for every non-empty overlap.

    The source regions of one geometry form a grid (each dim is cut independently), so overlaps
    are found per dim and combined.
    """
    per_dim = []
    for d, (a, b) in enumerate(dst_region):
        cuts = sorted({reg[d] for reg in src_groups})
        per_dim.append([((s, e), (max(a, s), min(b, e))) for s, e in cuts if s < e and s < b and e > a])
    for combo in product(*per_dim):
        sreg = tuple(c[0] for c in combo)
        if sreg in src_groups:
            yield sreg, tuple(c[1] for c in combo)


def _even_bounds(length: int, num_pieces: int, index: int) -> tuple[int, int]:
    """(start, stop) of piece `index` when a bucket's box of `length` is cut into `num_pieces` near-equal
    pieces (the first length % num_pieces one longer). This cuts transfers, never shards."""
    q, r = divmod(length, num_pieces)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def _split_box(box: Region, parts: int) -> list[Region]:
    """`box` cut into up to `parts` blocks along its outermost dim longer than 1 (tensor_split)."""
    for d, (a, b) in enumerate(box):
        if b - a > 1 and parts > 1:
            k = min(parts, b - a)
            cuts = [_even_bounds(b - a, k, i) for i in range(k)]
            return [box[:d] + ((a + lo, a + hi),) + box[d + 1 :] for lo, hi in cuts]
    return [box]


def _overlap_size(a: Region, b: Region) -> int:
    return prod(max(0, min(y, q) - max(x, p)) for (x, y), (p, q) in zip(a, b))


# A holder that already sends to a receiver is preferred over the least-loaded holder when its
# load is within this fraction of the least: one bucket fewer, nearly no imbalance (small items
# such as norms come last and would otherwise open a new pair each).
AFFINITY_SLACK = 0.02


def _assign_senders(
    choices: list[tuple[int, int, int, int, tuple[int, ...]]],
    load: dict[int, int],
    sends: dict[int, dict[int, list[int]]],
) -> None:
    """Greedy least-loaded sender per item, largest items first (LPT); ties go to the lowest rank."""
    choices.sort(key=itemgetter(0, 1))
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for neg_bytes, _, eid, r, holders in choices:
        heap = heaps.get(holders)
        if heap is None:
            heap = heaps[holders] = [(load[s], s) for s in holders]
            heapq.heapify(heap)
        # Entries may be stale (another holder set raised a load): loads only grow, so refresh
        # the top until it is current; then it is the true minimum.
        while heap[0][0] != load[heap[0][1]]:
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        least, s = heap[0]
        if r not in sends.get(s, ()):
            limit = least * (1 + AFFINITY_SLACK)
            paired = [h for h in holders if r in sends.get(h, ()) and load[h] <= limit]
            if paired:
                s = min(paired, key=lambda h: (load[h], h))
        load[s] -= neg_bytes
        sends[s][r].append(eid)


def _pack(entries: tuple[int, ...], book: _Entries, eb: int, limit: int | None) -> list[tuple[tuple[Slice, ...], int]]:
    """One pair's slices packed into buckets of at most `limit` bytes (one bucket if None).

    Slices go in class by class (classes in order of their first parameter), parameters in order
    within a class. A pair of T bytes gets about ceil(T / limit) buckets of similar size (so the
    rounds they land in are even): a bucket closes once it reaches T / ceil(T / limit) or when
    the next slice would pass the limit. A slice longer than a bucket is cut to fill buckets.
    """
    order = sorted(entries, key=lambda eid: (book.entries[eid][0], book.entries[eid][2]))
    sizes = {eid: region_size(book.entries[eid][1]) * eb for eid in order}
    total = sum(sizes[eid] * (book.entries[eid][3] - book.entries[eid][2]) for eid in order)
    if limit is None:
        return [(tuple(chain.from_iterable(book.slices(eid) for eid in order)), total)]
    target = ceil(total / ceil(total / limit))

    chunks: list[tuple[tuple[Slice, ...], int]] = []
    current: list[Sequence[Slice]] = []
    filled = 0

    def close() -> None:
        nonlocal current, filled
        if current:
            chunks.append((tuple(chain.from_iterable(current)), filled))
        current, filled = [], 0

    for eid in order:
        slices, nb = book.slices(eid), sizes[eid]
        if nb <= limit:
            i = 0
            while i < len(slices):
                k = min(len(slices) - i, (limit - filled) // nb, -((filled - target) // nb))
                if k <= 0:
                    close()
                    continue
                current.append(slices[i : i + k])
                filled += k * nb
                i += k
            continue
        for whole in slices:  # each longer than a bucket: cut it to fill buckets to the target
            todo = deque([whole.region])
            while todo:
                part = todo.popleft()
                pb = region_size(part) * eb
                room = target - filled
                if pb <= room:
                    current.append((Slice(whole.param, part),))
                    filled += pb
                elif room < eb:
                    close()
                    todo.appendleft(part)
                else:
                    head, tails = _carve(part, room // eb)
                    todo.extendleft(reversed(tails))
                    todo.appendleft(head)
    close()
    return chunks


def _carve(box: Region, max_elems: int) -> tuple[Region, list[Region]]:
    """Split `box` into a leading box of at most `max_elems` (>= 1) elements and boxes for the rest.

    The head takes as many whole rows of the outermost dim as fit; if not even one fits, it fixes
    that dim and recurses inward. The rest is the usual staircase of at most ndim boxes.
    """
    extents = [b - a for a, b in box]
    d = 0
    inner = prod(extents[1:])
    while inner > max_elems:
        d += 1
        inner = prod(extents[d + 1 :])
    k = min(extents[d], max_elems // inner)
    fixed = [(a, a + 1) for a, _ in box[:d]]
    a_d, b_d = box[d]
    head = tuple(fixed) + ((a_d, a_d + k),) + box[d + 1 :]
    tails = []
    if a_d + k < b_d:
        tails.append(tuple(fixed) + ((a_d + k, b_d),) + box[d + 1 :])
    for j in range(d - 1, -1, -1):
        a_j, b_j = box[j]
        if a_j + 1 < b_j:
            tails.append(tuple(fixed[:j]) + ((a_j + 1, b_j),) + box[j + 1 :])
    return head, tails


def _schedule(buckets: list[Bucket]) -> tuple[TransferRound, ...]:
    """Colour buckets into rounds: Δ rounds, Δ = most buckets any rank sends or receives (König).

    `buckets` come sorted by (src, dst); rounds keep that order. Pairs are coloured largest bucket
    first, so big buckets tend to share the early rounds and small ones the late rounds.
    """
    if not buckets:
        return ()
    # Largest first; the sort is stable, so equal sizes keep (src, dst) order.
    neg_sizes = [-b.num_bytes for b in buckets]
    order = sorted(range(len(buckets)), key=neg_sizes.__getitem__)
    colours = _edge_colouring([(b.src, b.dst) for b in buckets], order)
    rounds: list[list[Bucket]] = [[] for _ in range(max(colours) + 1)]
    for b, c in zip(buckets, colours):
        rounds[c].append(b)
    return tuple(TransferRound(tuple(r)) for r in rounds if r)


def _edge_colouring(edges: list[tuple[int, int]], order: Sequence[int]) -> list[int]:
    """Colour (sender, receiver) edges so that no two edges at a sender or at a receiver share a
    colour, with Δ colours (the most edges at one sender or receiver), as König's theorem allows.

    Edges are coloured in `order`; Δ' is the max degree of the edges coloured so far, so every
    prefix of `order` uses exactly its own Δ' colours (coloured largest first, the big buckets
    share the first rounds and the small ones fill the gaps). For edge (u, v): the smallest
    colour free at both ends, if below Δ' (first fit, on bitmasks). Otherwise take a free at u
    and b free at v (both < Δ'); if neither is free at the other end, swap a and b along the
    a/b alternating path that starts at v (it cannot reach u: the graph is bipartite), after
    which a is free at both -- or along the b/a path from u, freeing b, whichever is shorter.
    """
    # Senders and receivers are separate vertices even when one rank is both: sender u is vertex u,
    # receiver v is vertex `size + v`.
    size = 1 + max(map(max, edges), default=0)
    ends = [(u, size + v) for u, v in edges]
    at: list[dict[int, int]] = [{} for _ in range(2 * size)]  # vertex -> colour -> edge
    used = [0] * (2 * size)  # vertex -> bitmask of colours in use
    degree = [0] * (2 * size)  # of the edges coloured so far
    cap = 0  # max degree of the edges coloured so far: colours stay below it
    colour = [-1] * len(edges)

    def lowest_free(mask: int) -> int:
        return ((mask + 1) & ~mask).bit_length() - 1

    # The common case inline (first fit): ~10^5 edges at 405B scale.
    for e, (u, v) in zip(order, map(ends.__getitem__, order)):
        du = degree[u] = degree[u] + 1
        dv = degree[v] = degree[v] + 1
        if du > cap or dv > cap:
            cap = du if du > dv else dv
        both = used[u] | used[v]
        c = ((both + 1) & ~both).bit_length() - 1
        if c >= cap:
            # No common free colour below cap, so a (free at u) is used at v and b (free at
            # v) is used at u. Two ways out: free a at v (swap the a/b path from v) or free b
            # at u (swap the b/a path from u). Walk both in step and swap the shorter.
            a, b = lowest_free(used[u]), lowest_free(used[v])
            walks: list[list[Any]] = [[v, a, []], [u, b, []]]  # [at vertex, next colour, path]
            done: list[Any] | None = None
            while done is None:
                for walk in walks:
                    x, want, path = walk
                    f = at[x].get(want)
                    if f is None:
                        done = walk
                        break
                    path.append(f)
                    fu, fv = ends[f]
                    walk[0] = fv if fu == x else fu
                    walk[1] = b if want == a else a
            x, _, path = done
            for f in path:
                fu, fv = ends[f]
                del at[fu][colour[f]], at[fv][colour[f]]
            for f in path:
                fu, fv = ends[f]
                colour[f] = b if colour[f] == a else a
                at[fu][colour[f]] = at[fv][colour[f]] = f
            # Interior vertices keep both colours; each end trades one for the other.
            swap = (1 << a) | (1 << b)
            start = v if done is walks[0] else u
            used[start] ^= swap
            used[x] ^= swap
            c = a if done is walks[0] else b
        colour[e] = c
        at[u][c] = at[v][c] = e
        bit = 1 << c
        used[u] |= bit
        used[v] |= bit
    return colour


# ---------------------------------------------------------------------------------------------
# Reporting


def plan_summary(plan: DdmaPlan) -> dict[str, Any]:
    """JSON-able numbers that describe a plan (for previews and benchmarks)."""
    loads = [b for b in plan.bytes_per_src.values() if b > 0]
    recv = [b for b in plan.bytes_per_dst.values() if b > 0]
    round_max = [r.max_bucket_bytes for r in plan.rounds]  # read per round, not per bucket (~10^5)
    return {
        "num_rounds": len(plan.rounds),
        "num_buckets": plan.num_buckets,
        "num_pairs": plan.num_pairs,
        "num_senders": len(loads),
        "num_receivers": len(recv),
        "total_bytes": plan.total_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "local_bytes": plan.local_bytes,
        "max_bytes_per_src": max(loads, default=0),
        "mean_bytes_per_src": sum(loads) / len(loads) if loads else 0.0,
        "max_bytes_per_dst": max(recv, default=0),
        "mean_bytes_per_dst": sum(recv) / len(recv) if recv else 0.0,
        "balance": plan.balance(),
        "max_bucket_bytes": max(round_max, default=0),
        "bucket_bytes_limit": plan.bucket_bytes,
        # Each round lasts about as long as its largest bucket: a serial-time proxy in bytes.
        "sum_round_max_bytes": sum(round_max),
        "is_noop": plan.is_noop,
        "src_bytes_per_elem": plan.src_bytes_per_elem,
        "dst_bytes_per_elem": plan.dst_bytes_per_elem,
    }


# ---------------------------------------------------------------------------------------------
# The plan's records


# A policy's weights cross links in bf16 whatever the destination stores (it quantizes on receipt).
WIRE_BYTES_PER_ELEM = 2
DDMA_BUCKET_BYTES = 256 << 20


def plan_llama_sync(dims: ModelDims, src: Mesh, dst: Mesh, precision: str,
                    bucket_bytes: int = DDMA_BUCKET_BYTES, *, lora: LoraSpec | None = None,
                    merged: bool = False) -> DdmaPlan:
    """The DDMA plan of a Llama model's trainer -> generator copy, from the model's sharding description.
    Into an fp8 generator, and from a trainer that folds its LoRA adapters into what it sends (`merged`), in
    staging groups of layers (`sync_staging_layers`). With `lora`, of the adapters alone: the generator keeps
    the base weights it loaded."""
    layers = None if lora is not None else sync_staging_layers(dims, dst, precision, merged=merged, src=src)
    params = llama_params(dims) if lora is None else lora_params(dims, lora)
    plan = plan_weight_sync(params, src_mesh=src, src_layout=llama_layout_on(src), dst_mesh=dst,
                            dst_layout=llama_layout_on(dst), src_bytes_per_elem=WIRE_BYTES_PER_ELEM,
                            dst_bytes_per_elem=PRECISION_BYTES[precision], bucket_bytes=bucket_bytes,
                            group_of=None if layers is None else lambda p: staging_group(p.name, layers))
    return plan if layers is None else replace(plan, staging_layers=layers)


def sync_staging_layers(dims: ModelDims, dst: Mesh, precision: str, *, merged: bool = False,
                        src: Mesh | None = None) -> int | None:
    """Layers per staging group of a sync into a generator stored at `precision`: an fp8 generator stages
    its block linears at the wire's dtype before quantizing them (`staging_layers`), and a trainer that
    merges its adapters stages its shards of the merged linears (`merged`, on `src`); None for a sync that
    moves weights as they are held."""
    parts = [staging_layers(dims, dst.size(MeshAxis.TP))] if PRECISION_BYTES[precision] < WIRE_BYTES_PER_ELEM else []
    if merged and src is not None:
        parts.append(staging_layers(dims, src.size(MeshAxis.TP) * src.size(MeshAxis.FSDP)))
    return min(parts) if parts else None


_REGION = attrgetter("region")


def sync_record(plan: DdmaPlan, model: str, src: Mesh, dst: Mesh, predicted_s: float) -> WeightSyncRecord:
    """The record a plan stores of `plan`: every round, in the tables of `graphrl.schemas.weightsync` (each
    parameter name, region, bucket content and round column once), so that no rank plans its part."""
    params: list[str] = []
    param_ids: dict[str, int] = {}
    regions: list[Region] = []
    region_ids: dict[Region, int] = {}
    contents: list[Contents] = []
    content_ids: dict[int, int] = {}  # id of a planned slice tuple -> its contents (pairs share the tuples)
    kept = []  # the tuples whose ids are keys above, alive until the record is made
    columns: list[tuple[int, ...]] = []
    column_ids: dict[tuple[int, ...], int] = {}

    def content(slices: tuple[Slice, ...], num_bytes: int) -> int:
        c = content_ids.get(id(slices))
        if c is not None:
            return c
        runs = []
        # Slices of one region in a row are mostly a planned run of consecutive parameters: read them whole.
        for region, same in groupby(slices, key=_REGION):
            names = [sl.param for sl in same]
            ids = list(map(param_ids.get, names))
            if None in ids:
                for name in names:
                    if name not in param_ids:
                        param_ids[name] = len(params)
                        params.append(name)
                ids = list(map(param_ids.__getitem__, names))
            r = region_ids.get(region)
            if r is None:
                r = region_ids[region] = len(regions)
                regions.append(region)
            if ids == list(range(ids[0], ids[0] + len(ids))):
                runs.append(SliceRun(ids[0], len(ids), r))
                continue
            start = 0
            for k in range(1, len(ids) + 1):
                if k == len(ids) or ids[k] != ids[k - 1] + 1:
                    runs.append(SliceRun(ids[start], k - start, r))
                    start = k
        kept.append(slices)
        c = content_ids[id(slices)] = len(contents)
        contents.append(Contents(num_bytes, tuple(runs)))
        return c

    def column(values: tuple[int, ...]) -> int:
        k = column_ids.get(values)
        if k is None:
            k = column_ids[values] = len(columns)
            columns.append(values)
        return k

    rounds = []
    for r in plan.rounds:
        srcs, dsts, sizes, slices = zip(*r.buckets)
        found = list(map(content_ids.get, map(id, slices)))  # mostly contents read already: no call each
        for i in (i for i, c in enumerate(found) if c is None):
            found[i] = content(slices[i], sizes[i])
        rounds.append(Round(column(srcs), column(dsts), column(tuple(found))))
    local = [LocalCopyRef(c.rank, content(c.slices, c.num_bytes)) for c in plan.local_copies]
    return WeightSyncRecord(
        model=model, src=src, dst=dst, staging_layers=plan.staging_layers, group_rounds=list(plan.group_rounds),
        src_bytes_per_elem=plan.src_bytes_per_elem, dst_bytes_per_elem=plan.dst_bytes_per_elem,
        bucket_bytes=plan.bucket_bytes, summary=WeightSyncSummary(**plan_summary(plan)), predicted_s=predicted_s,
        params=params, regions=regions, contents=contents, columns=columns, rounds=rounds, local=local,
    )

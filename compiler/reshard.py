"""The reshard stage: how one step's responses move from the generator replicas to the trainer ranks.

Responses are split over the generator replicas and over the trainer's data-parallel ranks in ranges
aligned to prompt groups (so group-relative advantages stay local) and balanced by tokens (every
response has the same padded length). Every overlap between what a replica produced and what a trainer
rank needs becomes one transfer, or nothing when both are the same rank. All ranks run a step's
transfers in one global (src, dst) order, which cannot deadlock under blocking semantics: the smallest
pending pair is always next on both of its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from graphrl.schemas.mesh import Mesh




def split_range(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """Range `index` of `total` items cut into `parts` pieces of whole `unit`s (torch.tensor_split rule)."""
    units = total // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return start * unit, stop * unit


class RolloutTransfer(NamedTuple):
    """Responses [start, stop) of a step, copied from rank `src` to rank `dst`."""

    src: int
    dst: int
    start: int
    stop: int


@dataclass(frozen=True)
class ReshardPlan:
    """The reshard stage's result: one step's transfers, the same every step."""

    transfers: tuple[RolloutTransfer, ...]
    """Every cross-rank copy, in the global (src, dst) order all ranks follow."""
    responses: int
    """Responses per step."""
    group: int
    """Responses per prompt: ranges never split a group."""
    bytes_per_response: int
    """Bytes one response occupies on the wire (padded sequence)."""

    def num_bytes(self, t: RolloutTransfer) -> int:
        return (t.stop - t.start) * self.bytes_per_response


def plan_reshard(gen: Mesh | None, train: Mesh, responses: int, group: int, bytes_per_response: int) -> ReshardPlan:
    """Each generator replica's range goes to the trainer ranks whose data-parallel range overlaps it;
    the replica's ranks share the sending (round robin). No generator: nothing moves."""
    transfers: list[RolloutTransfer] = []
    if gen is not None:
        gen_ranges = [split_range(responses, gen.data_parallel, j, group) for j in range(gen.data_parallel)]
        for d in range(train.data_parallel):
            need = split_range(responses, train.data_parallel, d, group)
            for j, have in enumerate(gen_ranges):
                lo, hi = max(need[0], have[0]), min(need[1], have[1])
                if lo >= hi:
                    continue
                senders = list(gen.ranks_of_data_index(j))
                for k, dst in enumerate(train.ranks_of_data_index(d)):
                    src = dst if dst in senders else senders[(d + k) % len(senders)]
                    if src != dst:
                        transfers.append(RolloutTransfer(src, dst, lo, hi))
    return ReshardPlan(tuple(sorted(transfers)), responses, group, bytes_per_response)


def check_reshard(plan: ReshardPlan, gen: Mesh | None, train: Mesh) -> list[str]:
    """The stage's spec: transfers are in global order and cross ranks; every trainer rank ends up
    with exactly its data-parallel range, each response once (from its own replica shard or one copy),
    and every copy comes from a rank of the replica that generated it."""
    problems = []
    if list(plan.transfers) != sorted(plan.transfers):
        problems.append("transfers are not in global (src, dst) order")
    if gen is None:
        return problems + ([f"{len(plan.transfers)} transfers without a generator"] if plan.transfers else [])
    owner = {}
    for j in range(gen.data_parallel):
        lo, hi = split_range(plan.responses, gen.data_parallel, j, plan.group)
        owner.update({i: set(gen.ranks_of_data_index(j)) for i in range(lo, hi)})
    got: dict[int, list[int]] = {r: [] for r in train.ranks()}
    for t in plan.transfers:
        if t.src == t.dst:
            problems.append(f"transfer {t} copies a rank to itself")
        if t.dst not in got:
            problems.append(f"transfer {t} goes to rank {t.dst}, which does not train")
            continue
        if any(t.src not in owner.get(i, ()) for i in range(t.start, t.stop)):
            problems.append(f"transfer {t} sends responses rank {t.src} did not generate")
        got[t.dst].extend(range(t.start, t.stop))
    for d in range(train.data_parallel):
        lo, hi = split_range(plan.responses, train.data_parallel, d, plan.group)
        for r in train.ranks_of_data_index(d):
            have = sorted(got[r] + [i for i in range(lo, hi) if r in owner.get(i, ())])
            if have != list(range(lo, hi)):
                problems.append(f"trainer rank {r} needs responses [{lo}, {hi}) and gets {len(have)} of them "
                                f"({len(have) - len(set(have))} twice)")
    return problems


__all__ = ["ReshardPlan", "RolloutTransfer", "check_reshard", "plan_reshard", "split_range"]

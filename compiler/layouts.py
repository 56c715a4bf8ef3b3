"""The layouts the placement search enumerates: tp degrees, trainer mesh shapes, generator shapes and
disaggregated device splits.

One enumeration serves the search (`compiler/placement.py`) and the up-front pin checks
(`compiler/candidates.py`, `check_pins`), so a pin the checks accept is one the search can lay out.
"""

from __future__ import annotations

from graphrl.schemas.job import RoleHint, parse_device_range
from graphrl.schemas.sharding import tp_split_problem

from graphrl.compiler.roles import Role


def pow2_upto(n: int) -> list[int]:
    """1, 2, 4, ... up to n."""
    return [1 << k for k in range(n.bit_length()) if 1 << k <= n]


def tp_choices(role: Role, hint: RoleHint, num_devices: int, devices_per_node: int) -> list[int]:
    """The tp degrees tried for `role` on `num_devices` devices: the pinned one, or every power of two
    up to two nodes' worth; either only where it splits the model evenly."""
    tried = [hint.tp] if hint.tp else pow2_upto(min(num_devices, 2 * devices_per_node))
    return [t for t in tried if tp_split_problem(role.dims, t, role.kind) is None]


def train_shapes(role: Role, hint: RoleHint, num_devices: int, devices_per_node: int) -> list[tuple[int, int, int, int]]:
    """(tp, pp, dp, fsdp) of every trainer mesh over `num_devices` devices that honours the pins."""
    # The executors do not run pipeline parallelism yet, so the search never proposes it: a plan the
    # search chooses must run. A pinned pp is still laid out and costed (the preview shows it), and
    # `graphrl run` refuses it up front.
    pps = [hint.pp] if hint.pp else [1]
    out = []
    for tp in tp_choices(role, hint, num_devices, devices_per_node):
        for pp in pps:
            if num_devices % (tp * pp) or pp > role.dims.num_layers:  # a stage holds at least one layer
                continue
            d = num_devices // (tp * pp)
            if hint.dp and hint.fsdp:  # both pinned: both honoured (their product must fill the mesh)
                splits = [(hint.dp, hint.fsdp)]
            elif hint.fsdp:
                splits = [(d // hint.fsdp, hint.fsdp)]
            else:
                splits = [(hint.dp, d // hint.dp)] if hint.dp else [(1, d)]
            out += [(tp, pp, dp, fsdp) for dp, fsdp in splits if dp * fsdp == d and dp >= 1 and fsdp >= 1]
    return out


def generate_shapes(role: Role, hint: RoleHint, num_devices: int, devices_per_node: int) -> list[int]:
    """tp of every generator layout (replicas of tp shards) over `num_devices` devices that honours the pins."""
    return [tp for tp in tp_choices(role, hint, num_devices, devices_per_node)
            if num_devices % tp == 0 and (not hint.dp or hint.dp * tp == num_devices)]


def device_splits(num_devices: int, devices_per_node: int, gen_range: str | None,
                  train_range: str | None) -> list[tuple[int, int, int, int]]:
    """(gen_first, gen_n, train_first, train_n) of every disaggregated device split: the pinned ranges
    (one range implies the other), or every split at node granularity."""
    n = num_devices
    if gen_range or train_range:
        g = parse_device_range(gen_range) if gen_range else None
        t = parse_device_range(train_range) if train_range else None
        if g is None:
            assert t is not None
            g = (t[1], n) if t[0] == 0 else (0, t[0])
        if t is None:
            t = (g[1], n) if g[0] == 0 else (0, g[0])
        return [(g[0], g[1] - g[0], t[0], t[1] - t[0])] if g[1] > g[0] and t[1] > t[0] else []
    unit = devices_per_node if n >= 2 * devices_per_node else 1
    return [(0, g, g, n - g) for g in range(unit, n, unit)]


__all__ = ["device_splits", "generate_shapes", "pow2_upto", "tp_choices", "tp_split_problem", "train_shapes"]

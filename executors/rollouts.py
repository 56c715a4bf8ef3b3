"""The rollout batch as ranks hold and move it, derived from the rollout schema (`graphrl.ops.ROLLOUTS`).

A step's responses live on a rank as pieces `(start, stop, fields)` (from one or several generator
replicas, or received), joined when a consumer reads a range. On the wire a piece is the number of
response columns it uses (up to its longest response: the rest is padding), then its schema's fields in
schema order cut to that width, then its weight version; a bool field crosses as uint8 (what every
backend sends), and the receiver pads the response columns back. A field added to the schema is
generated, sent, received and joined without another edit here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphrl.ops import EPISODE_FIELD, LOSS_MASK_FIELD, ROLLOUTS, ROUTES_FIELD

from graphrl.executors.models.sampling import used_response_columns

ROLLOUT_FIELDS: tuple[str, ...] = tuple(ROLLOUTS.fields)
_TORCH_DTYPES = {"int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}

Piece = tuple[int, int, dict[str, Tensor]]
# Fields some jobs' rollouts carry beyond the schema's: a mixture of experts' routes, an episode's loss mask and record.
EXTRA_FIELDS = (ROUTES_FIELD, LOSS_MASK_FIELD, EPISODE_FIELD)
# The fields with a response-length axis: cut to a piece's used width on the wire.
_RESPONSE_FIELDS = frozenset(name for name, f in ROLLOUTS.fields.items() if "R" in f.shape)


def join_rollouts(pieces: list[Piece], lo: int, hi: int) -> tuple[dict[str, Tensor] | None, int]:
    """Responses [lo, hi) of one step joined from the pieces (start, stop, fields) a rank holds, and
    how far they reach: (None, reach) when a gap leaves part of the range missing."""
    parts, cursor = [], lo
    for a, b, data in sorted(pieces, key=lambda p: p[0]):
        if b <= cursor or a >= hi:
            continue
        if a > cursor:
            break
        take = slice(cursor - a, min(b, hi) - a)
        parts.append({k: v[take] for k, v in data.items() if k != "version"} | {"version": data["version"]})
        cursor = min(b, hi)
    if cursor < hi:
        return None, cursor
    out = {k: torch.cat([p[k] for p in parts]) for k in ROLLOUT_FIELDS}
    for extra in EXTRA_FIELDS:
        if all(extra in p for p in parts):
            out[extra] = torch.cat([p[extra] for p in parts])
    out["version"] = torch.tensor([max(int(p["version"].item()) for p in parts)])
    return out, cursor


def wire_layout(num_responses: int, prompt_len: int, response_len: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, wire dtype) of each tensor of a piece of `num_responses` responses, in send order."""
    sizes = {"N": num_responses, "P": prompt_len, "R": response_len}
    out = []
    for name, f in ROLLOUTS.fields.items():
        shape = tuple(d if isinstance(d, int) else sizes[d] for d in f.shape)
        out.append((name, shape, torch.uint8 if f.dtype == "bool" else _TORCH_DTYPES[f.dtype]))
    out.append(("version", (1,), torch.int64))
    return out


def send_piece(rt: Any, piece: dict[str, Tensor], peer: int) -> None:
    """Send a piece's used response width, then its tensors cut to it, to `peer` in wire order (a mixture
    of experts' routes last, the prompt's and the used response columns')."""
    width = used_response_columns(piece["response_mask"])
    rt.send(torch.tensor([width], dtype=torch.int64, device=rt.comm_device), peer)
    for name in (*ROLLOUT_FIELDS, "version"):
        tensor = piece[name]
        if name in _RESPONSE_FIELDS:
            tensor = tensor[:, :width].contiguous()
        rt.send(tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor, peer)
    if ROUTES_FIELD in piece:
        rt.send(piece[ROUTES_FIELD][:, :piece["prompt_ids"].shape[1] + width].contiguous(), peer)
    if LOSS_MASK_FIELD in piece:
        rt.send(piece[LOSS_MASK_FIELD][:, :width].contiguous().to(torch.uint8), peer)
        rt.send(piece[EPISODE_FIELD].contiguous(), peer)


def recv_piece(rt: Any, peer: int, num_responses: int, prompt_len: int, response_len: int,
               pad_id: int = 0, route_width: int = 0, episode_width: int = 0) -> dict[str, Tensor]:
    """Receive a piece from `peer` (its sizes known from the plan, its width from the wire), on this rank's
    device, its response columns padded back to `response_len` (ids with `pad_id`, masks False, 0); with
    `route_width` (a mixture of experts' `ops.route_width`), its routes too, and with `episode_width`
    (`ops.episode_width`), its episodes' loss mask and record."""
    width = torch.empty(1, dtype=torch.int64, device=rt.comm_device)
    rt.recv(width, peer)
    used = int(width.item())
    piece = {}
    for name, shape, dtype in wire_layout(num_responses, prompt_len, used):
        buf = torch.empty(shape, dtype=dtype, device=rt.comm_device)
        rt.recv(buf, peer)
        if name in _RESPONSE_FIELDS and used < response_len:
            fill = pad_id if name == "response_ids" else 0
            buf = torch.nn.functional.pad(buf, (0, response_len - used), value=fill)
        piece[name] = buf.to(rt.device).bool() if dtype == torch.uint8 else buf.to(rt.device)
    if route_width:
        buf = torch.empty((num_responses, prompt_len + used, route_width), dtype=torch.int16, device=rt.comm_device)
        rt.recv(buf, peer)
        piece[ROUTES_FIELD] = torch.nn.functional.pad(buf, (0, 0, 0, response_len - used)).to(rt.device)
    if episode_width:
        mask = torch.empty((num_responses, used), dtype=torch.uint8, device=rt.comm_device)
        rt.recv(mask, peer)
        piece[LOSS_MASK_FIELD] = torch.nn.functional.pad(mask, (0, response_len - used)).to(rt.device).bool()
        record = torch.empty((num_responses, episode_width), dtype=torch.float32, device=rt.comm_device)
        rt.recv(record, peer)
        piece[EPISODE_FIELD] = record.to(rt.device)
    return piece


__all__ = ["EXTRA_FIELDS", "Piece", "ROLLOUT_FIELDS", "join_rollouts", "recv_piece", "send_piece", "wire_layout"]

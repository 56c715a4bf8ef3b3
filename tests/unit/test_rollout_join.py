"""The executor joins a step's rollout pieces (from one or several generator replicas) into the range
a consumer reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import torch

from graphrl.executors.rollouts import ROLLOUT_FIELDS, join_rollouts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _piece(start: int, stop: int, version: int) -> tuple[int, int, dict[str, torch.Tensor]]:
    n = stop - start
    rows = torch.arange(start, stop)
    data = {name: rows[:, None].expand(n, 3).clone() for name in ROLLOUT_FIELDS}
    data["version"] = torch.tensor([version])
    return start, stop, data


def test_pieces_out_of_order_join_into_the_requested_range():
    pieces = [_piece(8, 16, 3), _piece(0, 8, 2)]
    out, reach = join_rollouts(pieces, 4, 12)
    assert out is not None and reach == 12
    for name in ROLLOUT_FIELDS:
        assert out[name][:, 0].tolist() == list(range(4, 12))
    assert int(out["version"]) == 3  # the newest weights that produced any of the responses


def test_a_gap_reports_how_far_the_pieces_reach():
    out, reach = join_rollouts([_piece(0, 4, 0), _piece(8, 12, 0)], 0, 12)
    assert out is None and reach == 4


def test_a_resume_on_another_layout_reads_every_ranks_rollouts_once(tmp_path):
    """Each rank saves the rollouts it holds; on another layout every rank reads them all, each range of
    a step once (replicas that both received [0:4) of step 3 give one piece), and joins what it needs."""
    from graphrl.executors.checkpointing import load_inflight, save_inflight

    save_inflight(tmp_path, 0, {3: [_piece(0, 4, 2)], 4: [_piece(0, 4, 3)]})
    save_inflight(tmp_path, 1, {3: [_piece(4, 8, 2)]})
    save_inflight(tmp_path, 2, {3: [_piece(0, 4, 2)]})
    cpu = torch.device("cpu")
    assert [(a, b) for a, b, _ in load_inflight(tmp_path, 1, cpu)[3]] == [(4, 8)]
    merged = load_inflight(tmp_path, None, cpu)
    assert sorted((a, b) for a, b, _ in merged[3]) == [(0, 4), (4, 8)] and len(merged[4]) == 1
    out, reach = join_rollouts(merged[3], 2, 8)
    assert out is not None and reach == 8 and out["response_ids"][:, 0].tolist() == list(range(2, 8))


def test_step_lag_is_zero_for_sync_and_grows_with_staleness():
    """How far behind its newest step a rank's instruction can be, which bounds the rollouts it keeps."""
    from graphrl.cli import compile_loaded, load_with_sets
    from graphrl.executors.executor import step_lag

    def lags(example: str, *sets: str) -> list[int]:
        plan = compile_loaded(load_with_sets(str(EXAMPLES / example), sets), None)
        assert plan.programs is not None
        return [step_lag(plan.programs, r) for r in range(plan.programs.num_ranks)]

    assert lags("grpo_tiny.yaml") == [0, 0]
    assert lags("aipo_async_tiny.yaml", "schedule.max_staleness=2") == [0, 1]


@pytest.mark.parametrize("n, prompt_len, response_len", [(1, 3, 5), (8, 16, 32), (5, 1, 1)])
def test_the_wire_carries_the_bytes_the_plan_charges(n: int, prompt_len: int, response_len: int) -> None:
    """The executors' wire format and the compiler's transfer bytes both come from the rollout schema: a
    field added to one and not the other would make the reshard's predicted bytes wrong."""
    from math import prod

    from graphrl.executors.rollouts import wire_layout
    from graphrl.ops import rollout_bytes_per_response

    layout = wire_layout(n, prompt_len, response_len)
    assert [name for name, _, _ in layout] == [*ROLLOUT_FIELDS, "version"]
    data = sum(prod(shape) * torch.empty(0, dtype=dtype).element_size() for name, shape, dtype in layout
               if name != "version")
    assert data == n * rollout_bytes_per_response(prompt_len, response_len)


def test_a_piece_crosses_the_wire_cut_to_its_longest_response_and_arrives_whole() -> None:
    """The sender sends the response columns up to its longest response; the receiver pads them back, so
    the piece it holds is the one that was sent (pads as the pad id, masks False, log-probs 0)."""
    from graphrl.executors.models.sampling import used_response_columns
    from graphrl.executors.rollouts import recv_piece, send_piece

    class Wire:
        comm_device = device = torch.device("cpu")

        def __init__(self) -> None:
            self.sent: list[torch.Tensor] = []

        def send(self, tensor: torch.Tensor, peer: int) -> None:
            self.sent.append(tensor.clone())

        def recv(self, tensor: torch.Tensor, peer: int) -> None:
            tensor.copy_(self.sent.pop(0))

    pad = 7
    mask = torch.tensor([[True, True, False, False, False, False], [True, True, True, False, False, False]])
    piece = {"prompt_ids": torch.arange(8).view(2, 4), "prompt_mask": torch.ones(2, 4, dtype=torch.bool),
             "response_ids": torch.where(mask, torch.arange(12).view(2, 6), pad), "response_mask": mask,
             "behaviour_logprobs": torch.where(mask, -torch.rand(2, 6), 0.0), "version": torch.tensor([3])}
    assert used_response_columns(mask) == 3 and used_response_columns(torch.zeros(2, 6, dtype=torch.bool)) == 1
    wire = Wire()
    send_piece(wire, piece, peer=1)
    assert sum(t.numel() * t.element_size() for t in wire.sent[1:-1]) == 2 * rollout_bytes(4, 3)
    got = recv_piece(wire, 0, 2, 4, 6, pad_id=pad)
    assert not wire.sent
    for name, tensor in piece.items():
        assert torch.equal(got[name], tensor), name


def rollout_bytes(prompt_len: int, response_len: int) -> int:
    from graphrl.ops import rollout_bytes_per_response
    return rollout_bytes_per_response(prompt_len, response_len)

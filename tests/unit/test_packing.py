"""Packed sequences (`algorithm.pack_sequences`): each row's real tokens run as one sequence of a single
packed row, attention causal within each sequence only, and the results equal the padded forward's.

The rows below cover what packing must get right: left-padded prompts of different lengths (positions
restart at 0 per sequence and pads do not advance them), responses of different lengths, one response
with no real token and one of full length. Both paths run in float32; packing changes only which
padding the attention's reductions skip, so the results agree to float32 rounding (ATOL).
"""

from __future__ import annotations

import pytest
import torch

from graphrl.executors import loss as loss_fns
from graphrl.executors import training
from graphrl.executors.models.llama import Llama, LlamaCritic, PackedSequences
from graphrl.executors.models.sampling import token_logprobs_and_entropy, token_values
from graphrl.schemas.job import AlgorithmSpec
from graphrl.schemas.model import MODEL_PRESETS

DIMS = MODEL_PRESETS["tiny-digits"]  # untied head, 4 query heads over 2 KV heads, vocab 16
ATOL = 1e-5


def spread_model(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that attention is far from uniform (a leak across sequences would show)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return model


def ragged_rows() -> dict[str, torch.Tensor]:
    """Five rows: prompts of 6, 2, 4, 1 and 5 real tokens (left-padded, junk pad ids), responses of 3, 0
    (mask all False), 7 (full length), 1 and 5 real tokens."""
    g = torch.Generator().manual_seed(3)
    prompt_real, response_real = [6, 2, 4, 1, 5], [3, 0, 7, 1, 5]
    prompt_mask = torch.tensor([[i >= 6 - n for i in range(6)] for n in prompt_real])
    response_mask = torch.tensor([[i < n for i in range(7)] for n in response_real])
    return {"prompt_ids": torch.randint(0, 16, (5, 6), generator=g), "prompt_mask": prompt_mask,
            "response_ids": torch.randint(0, 16, (5, 7), generator=g), "response_mask": response_mask}


def args(r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(r[key] for key in training.ROW_FIELDS)


def test_packing_lays_real_tokens_end_to_end_with_positions_from_zero() -> None:
    r = ragged_rows()
    ids = torch.cat((r["prompt_ids"], r["response_ids"]), 1)
    mask = torch.cat((r["prompt_mask"], r["response_mask"]), 1)
    packed = PackedSequences.of(ids, mask)
    lengths = [9, 2, 11, 2, 10]
    assert packed.input_ids_t.tolist() == ids[mask].tolist()
    assert packed.positions_t.tolist() == [p for n in lengths for p in range(n)]
    assert (packed.num_seqs, packed.longest) == (5, 11)
    # Token j of sequence b sits at slot b * longest + j of the padded attention layout.
    assert packed.slot_t.tolist() == [b * 11 + p for b, n in enumerate(lengths) for p in range(n)]


def test_packed_logprobs_and_entropy_equal_the_padded_ones() -> None:
    torch.manual_seed(0)
    model = spread_model(Llama(DIMS))
    r = ragged_rows()
    with torch.no_grad():
        want_lp, want_ent = token_logprobs_and_entropy(model, *args(r))
        got_lp, got_ent = token_logprobs_and_entropy(model, *args(r), pack=True)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=ATOL)
    assert bool((got_lp[1] == 0).all() and (got_ent[~r["response_mask"]] == 0).all())
    assert bool((want_lp[r["response_mask"]] < 0).all())


def test_packed_values_equal_the_padded_ones() -> None:
    torch.manual_seed(1)
    critic = spread_model(LlamaCritic(DIMS))
    r = ragged_rows()
    with torch.no_grad():
        want, got = token_values(critic, *args(r)), token_values(critic, *args(r), pack=True)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert bool((got[~r["response_mask"]] == 0).all())


def test_packed_gradients_equal_the_padded_ones() -> None:
    torch.manual_seed(2)
    model = spread_model(Llama(DIMS))
    r = ragged_rows()
    weights = torch.randn(r["response_mask"].shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for pack in (False, True):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs_and_entropy(model, *args(r), pack=pack)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=ATOL, msg=name)


def test_the_packed_forward_runs_on_real_tokens_and_the_head_on_response_tokens_only() -> None:
    """The padded forward used to run the vocabulary head on all B x R positions, masked ones included;
    now both paths feed it only the positions that predict a real response token, and the packed trunk
    sees only the real tokens, in one row."""
    torch.manual_seed(0)
    model = Llama(DIMS)
    r = ragged_rows()
    seen: dict[str, list[tuple[int, ...]]] = {"embed": [], "head": []}
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen["embed"].append(tuple(i[0].shape)))
    logits = model.logits

    def recorded_logits(hidden: torch.Tensor) -> torch.Tensor:
        seen["head"].append(tuple(hidden.shape))
        return logits(hidden)

    model.logits = recorded_logits  # type: ignore[method-assign]
    num_real = int(r["prompt_mask"].sum() + r["response_mask"].sum())
    with torch.no_grad():
        token_logprobs_and_entropy(model, *args(r))
        token_logprobs_and_entropy(model, *args(r), pack=True)
    assert seen["embed"] == [(5, 13), (1, num_real)]
    n = int(r["response_mask"].sum())
    assert seen["head"] == [(n, DIMS.hidden_size), (n, DIMS.hidden_size)]


# ---- micro-batches of packed sequences: a token budget


def test_packed_micro_batches_hold_at_most_the_budget_and_agree_on_a_count() -> None:
    tokens = [6, 4, 6, 4, 9, 1, 3]
    assert loss_fns.num_packed_micro_batches(tokens, 10) == 4  # greedy: [6 4] [6 4] [9 1] [3]
    assert loss_fns.num_packed_micro_batches(tokens, 0) == 1
    for num_micro in (4, 5, 7, 9):
        slices = loss_fns.packed_micro_batch_slices(tokens, num_micro)
        assert len(slices) == num_micro
        assert [i for s in slices for i in range(len(tokens))[s]] == list(range(len(tokens)))
        assert max(sum(tokens[s]) for s in slices) <= 10
    # A rank that needs fewer micro-batches than its group cuts its rows into balanced ones.
    for few, num_micro, sums in (([5, 5, 5, 5], 2, [10, 10]), ([1, 9, 9, 1], 3, [1, 9, 10])):
        assert [sum(few[s]) for s in loss_fns.packed_micro_batch_slices(few, num_micro)] == sums
    assert loss_fns.packed_micro_batch_slices([], 2) == [slice(0, 0), slice(0, 0)]


def test_a_rank_cuts_packed_micro_batches_by_its_rows_real_tokens() -> None:
    """Budget = micro_batch_size x (P + R) = 2 x 13 = 26 tokens; the rows hold 9, 2, 11, 2 and 10 real
    tokens, so packing takes two micro-batches (greedy: 24 + 10 tokens; balanced: 22 + 12) where rows
    alone take three: the count comes from the tokens, not the rows."""
    r = ragged_rows()
    packed = AlgorithmSpec(micro_batch_size=2, pack_sequences=True)
    slices = training.micro_batches(r, packed, None, None)  # type: ignore[arg-type]
    assert slices == [slice(0, 3), slice(3, 5)]
    assert len(training.micro_batches(r, AlgorithmSpec(micro_batch_size=2), None, None)) == 3  # type: ignore[arg-type]
    whole = training.micro_batches(r, AlgorithmSpec(pack_sequences=True), None, None)  # type: ignore[arg-type]
    assert whole == [slice(0, 5)]
    r_long = {k: torch.cat([v] * 3) for k, v in r.items()}  # 15 rows, 102 tokens: greedy needs 5
    assert len(training.micro_batches(r_long, packed, None, None)) == 5  # type: ignore[arg-type]
    assert len(training.micro_batches(r_long, AlgorithmSpec(micro_batch_size=2), None, None)) == 8  # type: ignore[arg-type]


@pytest.mark.parametrize("critic", [False, True])
def test_an_empty_micro_batch_runs_packed(critic: bool) -> None:
    """A rank with fewer rows than its group's micro-batch count runs empty ones (their forwards still
    take part in the group's collectives)."""
    torch.manual_seed(0)
    r = {k: v[:0] for k, v in ragged_rows().items()}
    if critic:
        assert token_values(LlamaCritic(DIMS), *args(r), pack=True).shape == (0, 7)
    else:
        logprobs, entropy = token_logprobs_and_entropy(Llama(DIMS), *args(r), pack=True)
        assert logprobs.shape == entropy.shape == (0, 7)


def test_padded_scoring_cuts_the_columns_no_row_uses_without_changing_a_result() -> None:
    """The padded path runs only the prompt columns some row uses and the response columns up to the last
    real token: the same rows with four more pad columns on each side score the same."""
    model = spread_model(Llama(DIMS))
    r = ragged_rows()
    wide = dict(r)
    wide["prompt_ids"] = torch.cat((torch.full((5, 4), 7), r["prompt_ids"]), 1)
    wide["prompt_mask"] = torch.cat((torch.zeros(5, 4, dtype=torch.bool), r["prompt_mask"]), 1)
    wide["response_ids"] = torch.cat((r["response_ids"], torch.full((5, 4), 9)), 1)
    wide["response_mask"] = torch.cat((r["response_mask"], torch.zeros(5, 4, dtype=torch.bool)), 1)
    logprobs, entropy = token_logprobs_and_entropy(model, *args(r))
    wide_logprobs, wide_entropy = token_logprobs_and_entropy(model, *args(wide))
    assert wide_logprobs.shape == (5, 11) and not wide_logprobs[:, 7:].any()
    torch.testing.assert_close(wide_logprobs[:, :7], logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(wide_entropy[:, :7], entropy, atol=ATOL, rtol=0)

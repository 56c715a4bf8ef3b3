"""Sampling and teacher-forced scoring on the native model (`llama.py`): `generate` samples responses with a KV
cache, `token_logprobs` / `token_logprobs_and_entropy` score sampled tokens, `token_values` runs a critic, and
`sampling_temperature` makes scoring use the temperature the tokens were sampled at.

Apart from the model so that what an RL step asks of a model (sample, score, value) reads in one place, and
the model itself stays a plain module. Conventions as in `llama.py` (B, T, P, R, V; left-padded prompts,
right-padded responses, bool masks).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from graphrl.executors.models.llama import Llama, LlamaCritic, PackedSequences, replaying, routing

# ----------------------------------------------------------------------------------------------
# Generation and teacher-forced scoring


@dataclass(frozen=True)
class GenerationOutput:
    """Sampled responses. R = max_new_tokens, even when every row stopped early (the rest is pad).

    logprobs are log softmax(logits / T)(token), T the sampling temperature (T = 0, greedy: T = 1 is
    used), top-p ignored: the distribution the token was drawn from before truncation. The trainer
    recomputes the same quantity (`token_logprobs` under `sampling_temperature(model, T)`), so behaviour,
    old, new and reference log-probs compare like with like, and pi/mu is the ratio to the distribution
    that drew the token.
    """

    response_ids: Tensor  # int64 [B, R]
    response_mask: Tensor  # bool [B, R], True up to and including EOS
    logprobs: Tensor  # float32 [B, R], 0 where masked
    # A mixture of experts' routes with `record_routes`: int64 [B, P + R, layers, k], the experts each prompt and
    # response token was routed to as it went through the model; -1 for pads and the last response token (never
    # fed back). None for a dense model or without `record_routes`.
    routes: Tensor | None = None


def _check_left_padded(prompt_mask_bp: Tensor) -> None:
    if prompt_mask_bp.shape[1] == 0 or not bool(prompt_mask_bp[:, -1].all()):
        raise ValueError(
            "prompts must be left-padded with a real token in the last column "
            "(prompt_mask[:, -1] must be all True)"
        )


def sample_tokens(logits_bv: Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
            uniform_b: Tensor | None = None) -> Tensor:
    """Next token [B]: argmax at temperature 0, else nucleus sampling of softmax(logits / temperature),
    drawn from `generator`, or, given one uniform number per row, by inverting each row's CDF (so a
    row's token depends on that row alone, not on the batch it was generated in)."""
    if temperature == 0.0:
        return logits_bv.argmax(-1)
    probs_bv = torch.softmax(logits_bv / temperature, dim=-1)
    if top_p < 1.0:
        # Keep the most likely tokens until their mass reaches top_p; the first is always kept.
        # A stable sort keeps ties in vocabulary order, so a seeded run is reproducible.
        sorted_probs, order = probs_bv.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs_bv = torch.zeros_like(probs_bv).scatter(-1, order, sorted_probs)
    if uniform_b is None:
        return torch.multinomial(probs_bv, 1, generator=generator).squeeze(-1)
    cdf_bv = probs_bv.double().cumsum(-1)
    target_b1 = uniform_b.to(cdf_bv)[:, None] * cdf_bv[:, -1:]
    # The first token whose CDF exceeds the target; a token of probability 0 is never chosen.
    token_b = torch.searchsorted(cdf_bv, target_b1, right=True).squeeze(-1)
    return token_b.clamp(max=probs_bv.shape[-1] - 1)


@torch.no_grad()
def generate(
    model: Llama,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    record_routes: bool = False,
) -> GenerationOutput:
    """Sample up to max_new_tokens per left-padded prompt [B, P] with a static KV cache.

    One prefill forward over the prompts, then one forward per new token. Sampling draws only from
    `generator` (on the model's device), so a seeded generator reproduces the output; or, with
    `uniforms` [B, max_new_tokens] in [0, 1), token t of row b inverts that row's CDF at
    uniforms[b, t], so each row's sample is the same however the batch is split. After a row
    emits `eos_id` (or any of several stop ids: a chat model's end-of-turn and end-of-text) it is
    padded with `pad_id` (mask False, logprob 0); the loop stops once all rows
    have. `temperature == 0` is greedy decoding. The log-probs are of softmax(logits / temperature)
    (see `GenerationOutput`).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    _check_left_padded(prompt_mask)
    logprob_temperature = logprob_temperature_of(temperature)
    batch_size, prompt_len = prompt_ids.shape
    if uniforms is not None and tuple(uniforms.shape) != (batch_size, max_new_tokens):
        raise ValueError(f"uniforms must have shape {(batch_size, max_new_tokens)}, got {tuple(uniforms.shape)}")
    device = prompt_ids.device
    param = next(model.parameters())
    cache = model.allocate_kv_cache(batch_size, prompt_len + max_new_tokens, dtype=param.dtype, device=device)
    response_ids = torch.full((batch_size, max_new_tokens), pad_id, dtype=torch.int64, device=device)
    response_mask = torch.zeros(batch_size, max_new_tokens, dtype=torch.bool, device=device)
    logprobs = torch.zeros(batch_size, max_new_tokens, dtype=torch.float32, device=device)
    done_b = torch.zeros(batch_size, dtype=torch.bool, device=device)
    stop_ids = None if eos_id is None else torch.tensor(
        [eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.int64, device=device
    )

    with _maybe_routing(model, record_routes) as log:  # one log for the whole generation
        hidden = model.hidden_states(prompt_ids, prompt_mask.to(torch.bool), kv_cache=cache)
        routes_btlk = None
        if log is not None and log.chosen:
            num_moe, k = len(log.chosen), log.chosen[0].shape[-1]
            routes_btlk = torch.full((batch_size, prompt_len + max_new_tokens, num_moe, k), -1, dtype=torch.int64,
                                     device=device)
            prefill = torch.stack(log.chosen, 1).view(batch_size, prompt_len, num_moe, k)
            routes_btlk[:, :prompt_len] = torch.where(prompt_mask.to(torch.bool)[:, :, None, None], prefill, -1)
            log.chosen.clear()
        logits_bv = model.logits(hidden[:, -1])
        for step in range(max_new_tokens):
            token_b = sample_tokens(logits_bv, temperature, top_p, generator,
                                    None if uniforms is None else uniforms[:, step])
            live_b = ~done_b
            token_b = torch.where(live_b, token_b, pad_id)
            logp_bv = torch.log_softmax(logits_bv / logprob_temperature, dim=-1)
            token_logprob_b = logp_bv.gather(-1, token_b[:, None]).squeeze(-1)
            response_ids[:, step] = token_b
            response_mask[:, step] = live_b
            logprobs[:, step] = torch.where(live_b, token_logprob_b, 0.0)
            if stop_ids is not None:
                done_b = done_b | torch.isin(token_b, stop_ids)
                if bool(done_b.all()):
                    break
            if step + 1 == max_new_tokens:
                break
            # The fed token is real only for rows that were live when it was sampled, so finished rows
            # leave pads in the cache that no real query attends to.
            hidden = model.hidden_states(token_b[:, None], live_b[:, None], kv_cache=cache)
            if routes_btlk is not None and log is not None:
                fed = torch.stack(log.chosen, 1)  # [B, layers, k]: this forward's routes
                routes_btlk[:, prompt_len + step] = torch.where(live_b[:, None, None], fed, -1)
                log.chosen.clear()
            logits_bv = model.logits(hidden[:, -1])
    return GenerationOutput(response_ids=response_ids, response_mask=response_mask, logprobs=logprobs,
                            routes=routes_btlk)


def _maybe_routing(model: nn.Module, record: bool) -> Any:
    """`routing(model)` when routes are recorded, else a context that yields None."""
    return routing(model) if record else nullcontext(None)


def logprob_temperature_of(sampling_temperature: float) -> float:
    """The temperature log-probs are taken at: the sampling one, or 1 for greedy decoding (T = 0), which
    has no sampling distribution."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


@contextmanager
def sampling_temperature(model: nn.Module, temperature: float) -> Iterator[None]:
    """Within the block, every logit `model` computes is divided by `logprob_temperature_of(temperature)`,
    whichever way the logits are formed (an lm_head, a tied embedding, a tensor-parallel or FSDP wrapper
    around the model): the final norm's output, which every head multiplies, is scaled by 1 / T.
    Autograd records the division, so a backward after the block is that of the tempered loss. A no-op
    at T = 1 and for models without a final norm (`model.model.norm`)."""
    scale = logprob_temperature_of(temperature)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if scale == 1.0 or not isinstance(norm, nn.Module):
        yield
        return
    handle = norm.register_forward_hook(lambda module, args, output: output / scale)
    try:
        yield
    finally:
        handle.remove()


def _response_hidden(
    model: Llama | LlamaCritic,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    pack: bool,
    routes: Tensor | None = None,
) -> Tensor:
    """Hidden states [n, hidden] at the positions that predict the n real response tokens (response_mask's
    True entries, row by row): only those reach a head, whose vocabulary-sized work a masked token
    would waste.

    Position P-1+r predicts response token r: the last prompt column for r = 0 (prompts are
    left-padded), then the previous response token. Packed (`pack`), each row's real tokens run as one
    sequence of a single packed row (`PackedSequences`), and the predicting position is the real token
    before the response token in its sequence: the same token, at the same position.
    """
    _check_left_padded(prompt_mask)
    full_prompt_len = prompt_ids.shape[1]
    if not pack:
        # Padded: only the columns some row uses (pads attend to nothing and advance no position, so
        # the result is the same); at least one response column, since a wrapped model's forward runs
        # collectives the other ranks wait for.
        prompt_ids, prompt_mask, response_ids, response_mask = _used_columns(prompt_ids, prompt_mask, response_ids,
                                                                             response_mask)
    prompt_len, response_len = prompt_ids.shape[1], response_ids.shape[1]
    input_ids = torch.cat((prompt_ids, response_ids), dim=1)
    mask = torch.cat((prompt_mask.to(torch.bool), response_mask.to(torch.bool)), dim=1)
    response_mask = response_mask.to(torch.bool)
    if routes is not None:  # the same columns of the rollouts' routes, as the forward lays its tokens out
        first = full_prompt_len - prompt_len
        routes = routes[:, first:full_prompt_len + response_len]
        routes = routes.reshape(-1, routes.shape[-1]) if not pack else routes[mask]
    replay = None if routes is None else replay_of(routes, model.dims.experts_per_token)
    if not pack:
        with replaying(model, replay, mask.reshape(-1)):
            hidden = model.hidden_states(input_ids, mask)
        return hidden[:, prompt_len - 1 : prompt_len - 1 + response_len][response_mask]
    packed = PackedSequences.of(input_ids, mask)
    with replaying(model, replay, None):
        hidden_th = model.packed_hidden_states(packed)
    lengths_b = mask.sum(1)
    # Each token's index in the packed row: its sequence's start plus its position within it.
    index_bt = (lengths_b.cumsum(0) - lengths_b)[:, None] + mask.long().cumsum(1) - 1
    return hidden_th[index_bt[:, prompt_len:][response_mask] - 1]


def routes_of(routes_btlk: Tensor) -> Tensor:
    """A generation's routes (`GenerationOutput.routes`, -1 for none) as rollouts carry them: int16
    [B, T, layers * k] of expert + 1, so that 0, the padding every rollout field gets, means none."""
    b, t = routes_btlk.shape[:2]
    return (routes_btlk + 1).to(torch.int16).reshape(b, t, -1)


def replay_of(routes_nm: Tensor, top_k: int) -> Tensor:
    """Rollout routes of a forward's N tokens, [N, layers * k] (expert + 1), as `routing`'s replay:
    int64 [layers, N, k], -1 for none."""
    return (routes_nm.long() - 1).view(routes_nm.shape[0], -1, top_k).permute(1, 0, 2)


def used_response_columns(response_mask: Tensor) -> int:
    """Response columns up to the last real token of any row, at least one."""
    used = response_mask.to(torch.bool).any(0).nonzero()
    return max(1, int(used[-1]) + 1) if used.numel() else 1


def _used_columns(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows without their leading prompt columns that are pad in every row and their trailing
    response columns past every row's last real token (keeping at least one)."""
    used_prompt = prompt_mask.to(torch.bool).any(0)
    first = int(used_prompt.to(torch.int8).argmax()) if prompt_mask.shape[0] else 0
    width = used_response_columns(response_mask)
    return prompt_ids[:, first:], prompt_mask[:, first:], response_ids[:, :width], response_mask[:, :width]


def _scatter_responses(values_n: Tensor, response_mask: Tensor) -> Tensor:
    """[B, R] with the values of the n real response tokens in their places and 0 where masked."""
    mask_br = response_mask.to(torch.bool)
    return values_n.new_zeros(mask_br.shape).masked_scatter(mask_br, values_n)


def token_logprobs(
    model: Llama, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False, routes: Tensor | None = None,
) -> Tensor:
    """Teacher-forced log pi(response token) [B, R] float32, differentiable, 0 where masked. `pack`: the
    rows run as packed sequences (`PackedSequences`), with the same result; `routes` replayed (R3)."""
    logprobs, _ = _logprobs_and_maybe_entropy(
        model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=False, pack=pack, routes=routes
    )
    return logprobs


def token_logprobs_and_entropy(
    model: Llama, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False, routes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [B, R], entropy [B, R]) where entropy = -sum_v p_v log p_v of each predicting position;
    0 where masked. `routes` (the rollouts' int16 [B, P + R, layers * k]): a mixture of experts replays
    them (R3)."""
    logprobs, entropy = _logprobs_and_maybe_entropy(
        model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True, pack=pack, routes=routes
    )
    assert entropy is not None
    return logprobs, entropy


def _logprobs_and_maybe_entropy(
    model: Llama,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    with_entropy: bool,
    pack: bool,
    routes: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    hidden_nh = _response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, pack=pack,
                                 routes=routes)
    logp_nv = torch.log_softmax(model.logits(hidden_nh), dim=-1)
    tokens_n = response_ids[response_mask.to(torch.bool)]
    logprobs_br = _scatter_responses(logp_nv.gather(-1, tokens_n[:, None]).squeeze(-1), response_mask)
    if not with_entropy:
        return logprobs_br, None
    entropy_n = -(logp_nv.exp() * logp_nv).sum(-1)
    return logprobs_br, _scatter_responses(entropy_n, response_mask)


def token_values(
    critic: LlamaCritic, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
    pack: bool = False,
) -> Tensor:
    """values [B, R] float32: V(state before response token r), aligned with `token_logprobs`; 0 where masked."""
    hidden_nh = _response_hidden(critic, prompt_ids, prompt_mask, response_ids, response_mask, pack=pack)
    return _scatter_responses(critic.values(hidden_nh), response_mask)



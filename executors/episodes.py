"""Multi-turn episodes: a generate node with an environment (`env:`), run on any generation engine.

An episode is its prompt (the environment's first message, rendered with the chat template, or the dataset's
prompt) and then, turn after turn, the tokens the model sampled and the tokens of the environment's reply.
Token in, token out: the model's tokens are kept exactly as sampled (never decoded and encoded again), the
reply's tokens are appended after them (the chat template's text between the end of the model's turn and
the start of the next one, rendered for the reply alone), and the rollouts carry a loss mask that is True on
the model's tokens only: environment tokens get no behaviour log-prob (0), no loss, no KL, no entropy.

The episodes of a generate instruction run together. Environment calls (construct + reset, step) run each
in a daemon thread of the host with the node's `timeout_s`, while the episodes that are not waiting keep
generating: each round samples one turn for every episode ready for one, as one batch on the engine, and
then waits only if no episode is ready. A call that times out, raises or returns what the protocol does
not allow ends its episode with reward 0 and a counted reason; a thread stuck in a hung call is abandoned
(a daemon, it does not keep the process alive). Turn t of response i of a step is sampled from a seed of
(run seed, step, i, t) alone, so an episode does not depend on which others share its batch.

What a step records per episode rides with its rollouts as the `episode` field (`graphrl.ops.EPISODE_COLUMNS`
and then each turn's reward): the trainer's rank reports it as metrics, the reward node writes the turns
into samples.jsonl.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from graphrl.datasets import left_padded
from graphrl.envs import EnvProtocolError, Message, class_mismatch, env_class, messages_of, step_result
from graphrl.ops import END_REASONS, EPISODE_COLUMNS, EPISODE_FIELD, LOSS_MASK_FIELD, episode_width
from graphrl.schemas.job import EnvSpec

from graphrl.executors.engines import GenerationEngine, GenerationRequest, response_seed

_COLUMN = {name: i for i, name in enumerate(EPISODE_COLUMNS)}


def turn_seed(seed: int, step: int, index: int, turn: int) -> int:
    """The seed of turn `turn` of response `index` of `step`: turn 0 the single-turn response's seed, later turns
    that seed mixed with the turn (splitmix64), so that every bit of the seed differs (a generator may read
    only its low bits)."""
    base = response_seed(seed, step, index)
    if turn == 0:
        return base
    z = (base + turn * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) % (1 << 63)


# ----------------------------------------------------------------------------------------------
# Text <-> tokens


class TurnCodec(Protocol):
    """How an episode's messages become tokens and the model's tokens become text."""

    def prompt(self, messages: list[Message]) -> list[int]:
        """The tokens of an episode's first message(s), ending where the model's first turn starts."""
        ...

    def reply(self, messages: list[Message], ended: bool) -> list[int]:
        """The tokens appended after a model turn for the environment's reply: whatever closes the model's
        turn (when it did not end with a stop token, `ended` False), the reply's turn, and the opening of
        the model's next turn."""
        ...

    def text(self, ids: Sequence[int]) -> str:
        """A model turn's text, as the environment reads it."""
        ...


class ChatCodec:
    """A tokenizer and its chat template. A reply is rendered on its own: the template's text after a
    finished assistant turn, from a two-message conversation rendered with and without the reply (a template
    that is not append-only is refused by name)."""

    _USER, _ASSISTANT = "\x00graphrl-user\x00", "\x00graphrl-assistant\x00"

    def __init__(self, tokenizer: Any, *, chat_template: bool, system: str | None) -> None:
        self.tokenizer, self.chat_template, self.system = tokenizer, chat_template, system
        self.stop_text = ""
        if chat_template:
            base = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT}]
            rendered = self._render(base, generation_prompt=False)
            tail = rendered[rendered.rindex(self._ASSISTANT) + len(self._ASSISTANT):]
            self._base, self._tail = rendered, tail
            # The stop token the model ends its turn with is part of the template's tail: the model sampled it.
            from graphrl.models.tokenizer import stop_token_ids

            eos = tokenizer.convert_ids_to_tokens(stop_token_ids(tokenizer))
            self.stop_text = next((t for t in eos if t and tail.startswith(t)), "")

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt(self, messages: list[Message]) -> list[int]:
        if not self.chat_template:
            text = "\n\n".join(([self.system] if self.system else []) + [m["content"] for m in messages])
        else:
            system = [{"role": "system", "content": self.system}] if self.system and messages[0]["role"] != "system" else []
            text = self._render(system + messages, generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reply(self, messages: list[Message], ended: bool) -> list[int]:
        if not self.chat_template:
            return self.tokenizer.encode("\n" + "\n".join(m["content"] for m in messages) + "\n", add_special_tokens=False)
        full = self._render([{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT},
                             *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise EnvProtocolError("the chat template renders a conversation differently once a reply follows "
                                   "(it is not append-only), so the reply cannot be appended to the sampled tokens")
        tail = self._tail[len(self.stop_text):] if ended else self._tail
        return self.tokenizer.encode(tail + full[len(self._base):], add_special_tokens=False)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class DigitCodec:
    """The digit tasks' vocabulary as words (`graphrl.envs.games.digit_text`; an id without a word is `<id>`)."""

    def prompt(self, messages: list[Message]) -> list[int]:
        from graphrl.envs.games import digit_ids

        return [t for m in messages for t in digit_ids(m["content"])]

    def reply(self, messages: list[Message], ended: bool) -> list[int]:
        return self.prompt(messages)

    def text(self, ids: Sequence[int]) -> str:
        from graphrl.envs.games import DIGIT_WORDS

        return " ".join(str(i) if 0 <= i <= 9 else DIGIT_WORDS.get(i, f"<{i}>") for i in ids)


# ----------------------------------------------------------------------------------------------
# Environment calls


class EnvCalls:
    """Environment calls, each in its own daemon thread (an `async` method's coroutine runs on the process's one
    environment event loop, so an episode's coroutines share a loop from its reset to its last step);
    finished calls are collected with `results`."""

    def __init__(self) -> None:
        self._done: queue.Queue[tuple[int, int, Any, BaseException | None, float]] = queue.Queue()

    def submit(self, episode: int, call_id: int, fn: Callable[[], Any]) -> None:
        def run() -> None:
            start = time.perf_counter()
            try:
                value = resolved(fn())
                self._done.put((episode, call_id, value, None, time.perf_counter() - start))
            except BaseException as exc:  # noqa: BLE001 - the user's environment: its failure is the episode's
                self._done.put((episode, call_id, None, exc, time.perf_counter() - start))

        threading.Thread(target=run, name=f"graphrl-env-{episode}", daemon=True).start()

    def results(self, timeout: float, linger: float = 0.002) -> list[tuple[int, int, Any, BaseException | None, float]]:
        """Calls that finished: at least one if one finishes within `timeout` seconds, then every one that
        finishes less than `linger` seconds after the last (calls answered together go on in one batch)."""
        out = []
        try:
            out.append(self._done.get(timeout=max(timeout, 0.0)))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._done.get(timeout=linger))
            except queue.Empty:
                return out


async def _awaited(value: Any) -> Any:
    return await value


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def resolved(value: Any) -> Any:
    """`value`, or what it awaits to when it is awaitable (run on the environment event loop, from the calling
    thread, which waits for it)."""
    if not inspect.isawaitable(value):
        return value
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:  # one loop for every environment of the process, in a daemon thread
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="graphrl-env-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(_awaited(value), _LOOP).result()


# ----------------------------------------------------------------------------------------------
# Episodes


@dataclass
class Episode:
    index: int  # the response's index within its step
    row: dict[str, Any]
    prompt: list[int]
    env: Any = None
    tokens: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    model: list[bool] = field(default_factory=list)  # True where the model sampled the token
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # one per model turn
    turns: int = 0
    env_seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    reason: str | None = None  # why it ended (END_REASONS); None while it runs
    error: str = ""
    calls: int = 0  # environment calls made: a late result of an abandoned call is ignored
    deadline: float | None = None  # of the call in flight

    @property
    def ready(self) -> bool:
        return self.reason is None and self.deadline is None

    def end(self, reason: str, error: str = "") -> None:
        self.reason, self.error, self.deadline = reason, error, None
        if reason in FAILURES:
            self.rewards = [0.0] * len(self.rewards)


FAILURES = frozenset({"timeout", "error", "bad_return"})


@dataclass(frozen=True)
class EpisodeSettings:
    env: EnvSpec
    turn_tokens: int  # max_new_tokens: one model turn
    response_len: int  # R: the episode's tokens after the prompt
    prompt_len: int  # P
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    seed: int


# The fields of the episodes a replica's first rank sends its other ranks.
_SHARED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", LOSS_MASK_FIELD, "behaviour_logprobs",
           EPISODE_FIELD)


@dataclass(frozen=True)
class Replica:
    """A generator replica of several ranks: which rank runs the environments, and a broadcast from it."""

    group: Any  # its torch process group
    leads: bool  # this rank is its first
    comm_device: torch.device

    def broadcast(self, t: Tensor) -> Tensor:
        """`t` from the replica's first rank (bools cross as uint8), on the CPU."""
        import torch.distributed as dist

        wire = t.to(self.comm_device, torch.uint8 if t.dtype == torch.bool else t.dtype).contiguous()
        dist.broadcast(wire, src=dist.get_process_group_ranks(self.group)[0], group=self.group)
        return wire.cpu().to(t.dtype)


class EpisodeRunner:
    """Runs a generate instruction's episodes on an engine and lays them out as a rollout piece."""

    def __init__(self, settings: EpisodeSettings, codec: TurnCodec) -> None:
        self.s, self.codec = settings, codec
        self.failures: list[dict[str, Any]] = []  # the last run's failed episodes: why each ended
        self.cls = env_class(settings.env.cls)
        problem = class_mismatch(self.cls, dict(settings.env.options))
        if problem is not None:  # validate refuses this: a plan made without it still fails by name
            raise ValueError(f"environment {settings.env.cls!r}: {problem}")

    def run(self, engine: GenerationEngine, prompt_ids: Tensor, prompt_mask: Tensor, rows: list[dict[str, Any]],
            *, step: int, start: int, version: int, replica: Replica | None = None) -> dict[str, Tensor]:
        """Episodes [start, start + N) of `step`: `prompt_ids`/`prompt_mask` [N, P] are the dataset's prompts
        (kept where `reset` returns None), `rows` the dataset rows. A generator replica of several ranks
        (`replica`) runs the environments on its first rank, which sends every turn's batch to the others (their
        engine generates with it) and then the episodes."""
        if replica is not None and not replica.leads:
            return self._follow(engine, replica, len(rows), step=step, version=version, device=prompt_ids.device)
        s, calls, waited = self.s, EnvCalls(), 0.0
        episodes = [Episode(start + i, row, prompt_ids[i][prompt_mask[i].bool()].tolist()) for i, row in enumerate(rows)]
        options = dict(s.env.options)
        for e in episodes:
            self._call(calls, e, lambda row=e.row: _reset(self.cls, options, row))
        while any(e.reason is None for e in episodes):
            ready = [e for e in episodes if e.ready]
            if ready:
                self._turn(engine, ready, calls, replica, step=step, version=version, device=prompt_ids.device)
                continue
            now = time.perf_counter()
            deadline = min(e.deadline for e in episodes if e.deadline is not None)
            returned = calls.results(deadline - now)
            waited += time.perf_counter() - now
            for episode, call_id, value, exc, seconds in returned:
                e = episodes[episode - start]
                if e.reason is None and call_id == e.calls:
                    self._returned(e, value, exc, seconds)
            now = time.perf_counter()
            for e in episodes:
                if e.deadline is not None and now > e.deadline:
                    e.env_seconds += s.env.timeout_s
                    e.end("timeout", f"an environment call took longer than timeout_s {s.env.timeout_s:g} s")
        piece = self._piece(episodes, version, prompt_ids.device, waited)
        self.failures = [{"step": step, "index": e.index, "end": e.reason, "error": e.error} for e in episodes
                         if e.reason in FAILURES]
        if replica is not None:
            replica.broadcast(torch.zeros(2, dtype=torch.int64))  # no more turns
            for name in _SHARED:
                replica.broadcast(piece[name])
        return piece

    def _follow(self, engine: GenerationEngine, replica: Replica, n: int, *, step: int, version: int,
                device: torch.device) -> dict[str, Tensor]:
        """A replica's other rank: generate each turn its first rank sends, then take the episodes from it."""
        s = self.s
        while True:
            header = replica.broadcast(torch.zeros(2, dtype=torch.int64))
            rows, width = int(header[0]), int(header[1])
            if rows == 0:
                break
            ids = replica.broadcast(torch.zeros((rows, width), dtype=torch.int64))
            mask = replica.broadcast(torch.zeros((rows, width), dtype=torch.bool))
            seeds = replica.broadcast(torch.zeros(rows, dtype=torch.int64))
            engine.generate(GenerationRequest(ids.to(device), mask.to(device), s.turn_tokens, s.temperature, s.top_p,
                                              s.stop_ids, s.pad_id, s.seed, step, 0, version,
                                              row_seeds=tuple(seeds.tolist())))
        empty = self._piece([], version, device)
        shapes = {"prompt_ids": s.prompt_len, "prompt_mask": s.prompt_len, "response_ids": s.response_len,
                  "response_mask": s.response_len, LOSS_MASK_FIELD: s.response_len,
                  "behaviour_logprobs": s.response_len, EPISODE_FIELD: episode_width(s.env)}
        piece = {"version": torch.tensor([version])}
        for name in _SHARED:
            piece[name] = replica.broadcast(torch.zeros((n, shapes[name]), dtype=empty[name].dtype)).to(device)
        return piece

    def _call(self, calls: EnvCalls, e: Episode, fn: Callable[[], Any]) -> None:
        e.calls += 1
        e.deadline = time.perf_counter() + self.s.env.timeout_s
        calls.submit(e.index, e.calls, fn)

    def _returned(self, e: Episode, value: Any, exc: BaseException | None, seconds: float) -> None:
        """An environment call of `e` came back: its reset (no turn yet) or its step."""
        e.deadline = None
        e.env_seconds += seconds
        if exc is not None:
            return e.end("error", f"{type(exc).__name__}: {str(exc).strip()[:200]}")
        try:
            if e.env is None:  # reset
                e.env, first = value
                if first is not None:
                    prompt = self.codec.prompt(messages_of(first, "reset"))
                    if not 0 < len(prompt) <= self.s.prompt_len:
                        raise EnvProtocolError(f"reset's first message is {len(prompt)} tokens; prompt_len is "
                                               f"{self.s.prompt_len}")
                    e.prompt = prompt
                return None
            result = step_result(value)
            e.tool_calls = int(getattr(e.env, "tool_calls", e.tool_calls) or 0)
            e.tool_errors = int(getattr(e.env, "tool_errors", e.tool_errors) or 0)
            e.rewards.append(result.reward)
            if result.done or result.observation is None:
                return e.end("done")
            if e.turns >= self.s.env.max_turns:
                return e.end("max_turns")
            ended = bool(e.tokens) and e.tokens[-1] in self.s.stop_ids
            reply = self.codec.reply(result.observation, ended)
            if len(e.tokens) + len(reply) >= self.s.response_len:  # no room for the reply and a model token
                return e.end("max_tokens")
            e.tokens += reply
            e.model += [False] * len(reply)
            e.logprobs += [0.0] * len(reply)
        except EnvProtocolError as exc:
            e.end("bad_return", str(exc))
        except Exception as exc:  # noqa: BLE001 - a reply the template or tokenizer cannot take
            e.end("bad_return", f"{type(exc).__name__}: {str(exc).strip()[:200]}")
        return None

    def _turn(self, engine: GenerationEngine, ready: list[Episode], calls: EnvCalls, replica: Replica | None, *,
              step: int, version: int, device: torch.device) -> None:
        """One model turn of every ready episode, sampled as one batch; then each one's environment step."""
        s = self.s
        contexts = [e.prompt + e.tokens for e in ready]
        width = max(len(c) for c in contexts)
        ids, mask = left_padded(contexts, width, s.pad_id)
        seeds = tuple(turn_seed(s.seed, step, e.index, e.turns) for e in ready)
        if replica is not None:  # the replica's other ranks generate the same turn
            replica.broadcast(torch.tensor([len(ready), width], dtype=torch.int64))
            for t in (ids, mask, torch.tensor(seeds, dtype=torch.int64)):
                replica.broadcast(t)
        request = GenerationRequest(ids.to(device), mask.to(device), s.turn_tokens, s.temperature, s.top_p, s.stop_ids,
                                    s.pad_id, s.seed, step, 0, version, row_seeds=seeds)
        piece = engine.generate(request)
        out_ids, out_mask, out_lp = (piece[k].cpu() for k in ("response_ids", "response_mask", "behaviour_logprobs"))
        for i, e in enumerate(ready):
            n = min(int(out_mask[i].sum()), s.response_len - len(e.tokens))
            turn = out_ids[i, :n].tolist()
            e.tokens += turn
            e.model += [True] * n
            e.logprobs += out_lp[i, :n].tolist()
            e.turns += 1
            text = self.codec.text([t for t in turn if t not in s.stop_ids])
            # Every turn is scored, the last one too (`_returned` ends an episode that has no room left).
            self._call(calls, e, lambda env=e.env, text=text: env.step(text))

    def _piece(self, episodes: list[Episode], version: int, device: torch.device,
               waited: float = 0.0) -> dict[str, Tensor]:
        s, n = self.s, len(episodes)
        prompt_ids, prompt_mask = left_padded([e.prompt for e in episodes], s.prompt_len, s.pad_id)
        response_ids = torch.full((n, s.response_len), s.pad_id, dtype=torch.int64)
        response_mask = torch.zeros((n, s.response_len), dtype=torch.bool)
        loss_mask = torch.zeros((n, s.response_len), dtype=torch.bool)
        logprobs = torch.zeros((n, s.response_len), dtype=torch.float32)
        stats = torch.zeros((n, episode_width(s.env)), dtype=torch.float32)
        for i, e in enumerate(episodes):
            t = len(e.tokens)
            if t:
                response_ids[i, :t] = torch.tensor(e.tokens, dtype=torch.int64)
                response_mask[i, :t] = True
                loss_mask[i, :t] = torch.tensor(e.model, dtype=torch.bool)
                logprobs[i, :t] = torch.tensor(e.logprobs, dtype=torch.float32)
            model_tokens = sum(e.model)
            row = {"env_reward": sum(e.rewards), "turns": e.turns, "tool_calls": e.tool_calls,
                   "tool_errors": e.tool_errors, "env_seconds": e.env_seconds,
                   "end": END_REASONS.index(e.reason or "done"), "model_tokens": model_tokens,
                   "env_tokens": t - model_tokens, "env_wait_s": waited / n}
            for name, value in row.items():
                stats[i, _COLUMN[name]] = float(value)
            rewards = e.rewards[:s.env.max_turns]
            stats[i, len(EPISODE_COLUMNS):len(EPISODE_COLUMNS) + len(rewards)] = torch.tensor(rewards)
        return {"prompt_ids": prompt_ids.to(device), "prompt_mask": prompt_mask.to(device),
                "response_ids": response_ids.to(device), "response_mask": response_mask.to(device),
                "behaviour_logprobs": logprobs.to(device), "version": torch.tensor([version]),
                LOSS_MASK_FIELD: loss_mask.to(device), EPISODE_FIELD: stats.to(device)}


# ----------------------------------------------------------------------------------------------
# What the executor asks of episodes


def codec_of(source: Any, dataset: Any) -> TurnCodec:
    """The codec of a prompt source: a file dataset's tokenizer (and chat template), or the digit words."""
    tokenizer = getattr(source, "tokenizer", None)
    if tokenizer is None:
        return DigitCodec()
    return ChatCodec(tokenizer, chat_template=dataset.chat_template, system=dataset.system_prompt)


def episode_rows(source: Any, codec: TurnCodec, step: int, start: int, stop: int,
                 group_size: int) -> list[dict[str, Any]]:
    """The dataset row of each episode [start, stop) of `step` (prompt, answer, system, index), as `reset` gets it."""
    examples = source.examples(step)
    if examples is None:  # a task: its prompts in the codec's words
        ids, mask = source.prompts(step)
        return [{"prompt": codec.text(ids[i // group_size][mask[i // group_size].bool()].tolist()), "answer": None,
                 "system": None, "index": i} for i in range(start, stop)]
    return [{"prompt": ex.prompt, "answer": ex.answer, "system": ex.system, "index": i}
            for i in range(start, stop) for ex in (examples[i // group_size],)]


def runs(mask: Tensor) -> Tensor:
    """Each position's run number within its row: runs of equal values counted from 1 ([B, T] int64)."""
    change = torch.ones_like(mask, dtype=torch.int64)
    change[:, 1:] = (mask[:, 1:] != mask[:, :-1]).long()
    return change.cumsum(1)


def last_turn_mask(loss_mask: Tensor) -> Tensor:
    """The model's last turn in each episode: the last run of True in each row of the loss mask."""
    run = runs(loss_mask) * loss_mask
    return loss_mask & (run == run.max(1, keepdim=True).values)


def episode_samples(source: Any, r: dict[str, Tensor], n: int) -> list[dict[str, Any]]:
    """The first `n` episodes of rollouts as samples.jsonl shows them: the turns (who, text, tokens, the model
    turn's reward), why the episode ended and its environment's figures."""
    out = []
    for i in range(n):
        real = r["response_mask"][i].bool().cpu()
        model = r[LOSS_MASK_FIELD][i].bool().cpu() & real
        record = r[EPISODE_FIELD][i].cpu().tolist()
        run = runs(model[None])[0]
        turns, rewards = [], record[len(EPISODE_COLUMNS):]
        for k in sorted(set(run[real].tolist())):
            at = (run == k) & real
            by_model = bool(model[at][0])
            turn = {"role": "assistant" if by_model else "environment",
                    "text": source.decode(r["response_ids"][i:i + 1], at[None])[0], "tokens": int(at.sum())}
            if by_model:
                done = sum(t["role"] == "assistant" for t in turns)
                turn["reward"] = rewards[done] if done < len(rewards) else 0.0
            turns.append(turn)
        figures = dict(zip(EPISODE_COLUMNS, record))
        out.append({"turns": turns, "end": END_REASONS[int(figures["end"])], "env_reward": figures["env_reward"],
                    "tool_calls": int(figures["tool_calls"]), "tool_errors": int(figures["tool_errors"]),
                    "env_seconds": round(figures["env_seconds"], 4)})
    return out


def episode_sums(record: Tensor) -> dict[str, float]:
    """A batch's episode figures summed (the trainer group adds them up): episodes, each column of
    EPISODE_COLUMNS but `end`, how many ended for each reason, and the rewards of their last turns (a tool-using
    episode's final answer)."""
    sums = {"episodes": float(record.shape[0])}
    for name in EPISODE_COLUMNS:
        if name != "end":
            sums[name] = float(record[:, _COLUMN[name]].sum())
    ends = record[:, _COLUMN["end"]].long()
    for code, reason in enumerate(END_REASONS):
        sums[f"end_{reason}"] = float((ends == code).sum())
    turns = record[:, _COLUMN["turns"]].long()
    last = (len(EPISODE_COLUMNS) + turns - 1).clamp(min=len(EPISODE_COLUMNS))[:, None]
    sums["final_reward"] = float(torch.where(turns > 0, record.gather(1, last)[:, 0], 0.0).sum())
    return sums


def episode_metrics(sums: dict[str, float], replicas: int) -> dict[str, float]:
    """metrics.jsonl's episode figures of a step from `episode_sums` over its whole batch, sampled by `replicas`
    generator replicas (env_wait_s: the seconds one of them waited for environments with no episode ready)."""
    n = max(sums["episodes"], 1.0)
    return {"env_reward_mean": sums["env_reward"] / n, "env_final_reward_mean": sums["final_reward"] / n,
            "turns_mean": sums["turns"] / n,
            "tool_calls": sums["tool_calls"], "tool_errors": sums["tool_errors"],
            "env_seconds": sums["env_seconds"], "env_seconds_per_episode": sums["env_seconds"] / n,
            "model_tokens_mean": sums["model_tokens"] / n, "env_tokens_mean": sums["env_tokens"] / n,
            "env_wait_s": sums["env_wait_s"] / max(replicas, 1),
            **{f"episodes_{reason}": sums[f"end_{reason}"] for reason in END_REASONS}}


def _reset(cls: type, options: dict[str, Any], row: dict[str, Any]) -> Any:
    """Build an episode's environment and reset it (in the call's thread: a constructor may hang too)."""
    env = cls(**options)
    return env, resolved(env.reset(dict(row)))


__all__ = ["ChatCodec", "DigitCodec", "EnvCalls", "Episode", "EpisodeRunner", "EpisodeSettings", "Replica", "TurnCodec",
           "codec_of", "episode_metrics", "episode_rows", "episode_sums", "episode_samples", "last_turn_mask", "turn_seed"]

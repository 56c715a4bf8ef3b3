"""Episodes (`executors/episodes.py`): the tokens trained on are the tokens sampled plus the environment's
appended tokens, environment tokens take no part in a loss, and an environment that hangs, raises or returns
garbage costs only its own episode."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrl.executors import algorithms as alg
from graphrl.executors import loss as loss_fns
from graphrl.executors.engines import GenerationRequest, NativeEngine
from graphrl.executors.episodes import (ChatCodec, DigitCodec, EpisodeRunner, EpisodeSettings, episode_samples,
                                        last_turn_mask, turn_seed)
from graphrl.executors.models.llama import Llama
from graphrl.ops import END_REASONS, EPISODE_COLUMNS, EPISODE_FIELD, LOSS_MASK_FIELD
from graphrl.schemas.job import AlgorithmSpec, EnvSpec
from graphrl.schemas.model import ModelSpec
from graphrl.tasks import EOS, PAD, SEP

P, R, TURN = 6, 30, 5


def tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelSpec(preset="tiny-digits-tied").resolved_dims())


class Recording:
    """An engine that remembers what it sampled each turn."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.turns, self.batches = engine, [], []

    def generate(self, request: GenerationRequest) -> dict[str, torch.Tensor]:
        piece = self.engine.generate(request)
        self.batches.append(set(request.seeds()))
        for i, seed in enumerate(request.seeds()):
            mask = piece["response_mask"][i]
            self.turns.append((seed, piece["response_ids"][i][mask].tolist(), piece["behaviour_logprobs"][i][mask]))
        return piece


def settings(env: dict[str, Any], **overrides: Any) -> EpisodeSettings:
    values = dict(env=EnvSpec.model_validate({"max_total_tokens": P + R, "timeout_s": 5.0, **env}), turn_tokens=TURN,
                  response_len=R, prompt_len=P, temperature=1.0, top_p=1.0, stop_ids=(EOS,), pad_id=PAD, seed=3)
    return EpisodeSettings(**(values | overrides))


def digit_prompts(n: int) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    ids = torch.full((n, P), PAD)
    ids[:, 1:] = torch.tensor([10, 1, 2, 3, 4, SEP])[:P - 1]
    mask = ids != PAD
    codec = DigitCodec()
    rows = [{"prompt": codec.text(ids[i][mask[i]].tolist()), "answer": None, "system": None, "index": i}
            for i in range(n)]
    return ids, mask, rows


def run(runner: EpisodeRunner, engine: Any, n: int, step: int = 0) -> dict[str, torch.Tensor]:
    ids, mask, rows = digit_prompts(n)
    return runner.run(engine, ids, mask, rows, step=step, start=0, version=0)


def figures(piece: dict[str, torch.Tensor], i: int) -> dict[str, float]:
    return dict(zip(EPISODE_COLUMNS, piece[EPISODE_FIELD][i].tolist()))


def test_the_tokens_trained_on_are_those_sampled_and_the_replies_appended() -> None:
    """Each episode's response columns are, in order, exactly its turns' sampled tokens and the environment's
    reply tokens between them (the digit words of its next target); the loss mask and the behaviour log-probs
    mark the sampled ones only; later turns are sampled from seeds of their own."""
    engine = Recording(NativeEngine(tiny_model()))
    runner = EpisodeRunner(settings({"class": "digit-echo", "options": {"turns": 3}, "max_turns": 3}), DigitCodec())
    piece = run(runner, engine, 4)
    by_seed = {seed: (tokens, lp) for seed, tokens, lp in engine.turns}
    for i in range(4):
        f = figures(piece, i)
        real = piece["response_mask"][i]
        tokens, model = piece["response_ids"][i][real].tolist(), piece[LOSS_MASK_FIELD][i][real].tolist()
        expected, expected_model, expected_lp = [], [], []
        for turn in range(int(f["turns"])):
            sampled, lp = by_seed[turn_seed(3, 0, i, turn)]
            sampled = sampled[:R - len(expected)]
            expected += sampled
            expected_model += [True] * len(sampled)
            expected_lp += lp[:len(sampled)].tolist()
            if turn + 1 < f["turns"]:  # the target rotated: <bos> 2 3 4 1 <sep>, then 3 4 1 2 ...
                digits = [1, 2, 3, 4][turn + 1:] + [1, 2, 3, 4][:turn + 1]
                reply = [10, *digits, SEP]
                expected += reply
                expected_model += [False] * len(reply)
                expected_lp += [0.0] * len(reply)
        assert tokens == expected and model == expected_model
        assert piece["behaviour_logprobs"][i][real].tolist() == pytest.approx(expected_lp)
        assert f["model_tokens"] == sum(model) and f["env_tokens"] == len(model) - sum(model)
        assert f["end"] == END_REASONS.index("done") and f["turns"] == 3
    assert len({seed for seed, _, _ in engine.turns}) == len(engine.turns)


def test_environment_tokens_take_no_part_in_the_loss() -> None:
    """The policy loss, its entropy and KL terms, and the advantages, over an episode's loss mask: the gradient
    of the loss is zero at every environment token and not at the model's."""
    mask = torch.tensor([[True, True, False, False, True, False], [True, False, False, True, True, True]])
    logprobs = torch.randn(mask.shape, requires_grad=True)
    behaviour = torch.where(mask, torch.randn(mask.shape), 0.0)
    a = AlgorithmSpec(kl_coef=0.1, entropy_coef=0.01)
    adv = alg.broadcast_to_tokens(torch.tensor([1.0, -1.0]), mask)
    assert bool((adv[~mask] == 0).all())
    weights = alg.token_weights(mask, a.loss_agg, alg.batch_counts(mask))
    batch = loss_fns.PolicyBatch(logprobs, torch.rand(mask.shape), None, behaviour, torch.randn(mask.shape),
                                 adv.float(), mask, weights)
    loss, _ = loss_fns.policy_objective(batch, "grpo", a)
    loss.backward()
    assert bool((logprobs.grad[~mask] == 0).all()) and bool((logprobs.grad[mask] != 0).all())


class Faulty:
    """Episode 0 hangs, 1 raises, 2 returns garbage, 3 fails to construct, the rest play two turns."""

    def __init__(self) -> None:
        self.tool_calls = self.tool_errors = 0

    def reset(self, row: dict[str, Any]) -> None:
        self.index = row["index"]
        if self.index == 3:
            raise RuntimeError("no sandbox")

    def step(self, text: str) -> Any:
        self.tool_calls += 1
        if self.index == 0:
            time.sleep(3600)
        if self.index == 1:
            raise ValueError("tool crashed")
        if self.index == 2:
            return "not a tuple"
        return ("<bos> 5 <sep>", 0.25, False) if self.tool_calls < 2 else (None, 0.5, True)


class Slow:
    """Async (reset and step on one event loop), and slow for episode 0 only: the others play their turns while
    it waits."""

    async def reset(self, row: dict[str, Any]) -> str:
        self.index, self.turn = row["index"], 0
        self.loop = asyncio.get_running_loop()  # as a client session would be bound to it
        return "<bos> 1 2 <sep>"

    async def step(self, text: str) -> tuple[str | None, float, bool]:
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("step runs on another event loop than reset")
        self.turn += 1
        if self.index == 0:
            await asyncio.sleep(0.3)
        return (None, 1.0, True) if self.turn == 3 else ("<bos> 7 <sep>", 0.0, False)


@pytest.fixture()
def user_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    module = types.ModuleType("user_envs_for_tests")
    module.Faulty, module.Slow = Faulty, Slow  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_envs_for_tests", module)


def test_a_hanging_raising_or_garbage_environment_costs_only_its_episode(user_envs: None) -> None:
    runner = EpisodeRunner(settings({"class": "user_envs_for_tests:Faulty", "timeout_s": 0.5}), DigitCodec())
    piece = run(runner, NativeEngine(tiny_model()), 6)
    ends = [END_REASONS[int(figures(piece, i)["end"])] for i in range(6)]
    assert ends == ["timeout", "error", "bad_return", "error", "done", "done"]
    for i in range(4):  # every failure: reward 0, counted, and nothing of the others changed
        assert figures(piece, i)["env_reward"] == 0.0
    assert figures(piece, 3)["turns"] == 0 and not piece["response_mask"][3].any()  # never constructed
    for i in (4, 5):
        f = figures(piece, i)
        assert f["env_reward"] == 0.75 and f["turns"] == 2 and f["tool_calls"] == 2
    assert 0.5 <= figures(piece, 0)["env_seconds"] < 60


def test_episodes_waiting_for_their_environment_do_not_hold_the_others(user_envs: None) -> None:
    """While episode 0's (async) environment sleeps, the others are sampled their later turns without it: it
    takes some turns alone."""
    engine = Recording(NativeEngine(tiny_model()))
    runner = EpisodeRunner(settings({"class": "user_envs_for_tests:Slow", "max_turns": 3}), DigitCodec())
    piece = run(runner, engine, 4)
    assert all(figures(piece, i)["turns"] == 3 and figures(piece, i)["env_reward"] == 1.0 for i in range(4))
    others_last = {turn_seed(3, 0, i, 2) for i in (1, 2, 3)}
    first = next(k for k, batch in enumerate(engine.batches) if turn_seed(3, 0, 0, 1) in batch)
    assert others_last <= set().union(*engine.batches[:first]), engine.batches  # done before 0's second turn
    assert len(engine.turns) == 12


def test_a_reply_that_overflows_the_episode_ends_it_at_the_token_limit() -> None:
    runner = EpisodeRunner(settings({"class": "digit-echo", "options": {"turns": 4}, "max_turns": 4,
                                     "max_total_tokens": P + 12}, response_len=12), DigitCodec())
    piece = run(runner, NativeEngine(tiny_model()), 3)
    for i in range(3):
        f = figures(piece, i)
        assert END_REASONS[int(f["end"])] in ("max_tokens", "done") and f["model_tokens"] + f["env_tokens"] <= 12
    assert piece["response_ids"].shape == (3, 12)


def test_the_last_turn_and_the_samples_show_the_episode() -> None:
    runner = EpisodeRunner(settings({"class": "digit-echo", "options": {"turns": 2}, "max_turns": 2}), DigitCodec())
    piece = run(runner, NativeEngine(tiny_model()), 2)

    class Source:
        def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
            return [" ".join(str(int(t)) for t in row[m]) for row, m in zip(ids, mask.bool())]

    samples = episode_samples(Source(), piece, 2)
    for i, sample in enumerate(samples):
        roles = [t["role"] for t in sample["turns"]]
        assert roles == ["assistant", "environment", "assistant"]
        assert sum(t["tokens"] for t in sample["turns"]) == int(piece["response_mask"][i].sum())
        assert sample["end"] == "done" and sample["env_reward"] == pytest.approx(sum(t.get("reward", 0) for t in
                                                                                     sample["turns"]))
        json.dumps(sample)
        last = last_turn_mask(piece[LOSS_MASK_FIELD])[i]
        assert int(last.sum()) == sample["turns"][-1]["tokens"]


# -- chat templates -------------------------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(template: str = CHATML) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "\n", "user", "assistant", "system", "tool", "what", "is",
             "2+2", "4", "Result:", "calc", "ok", "answer"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"\n| "), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = template
    return fast


def test_a_reply_is_the_templates_text_between_two_assistant_turns() -> None:
    """Appending a reply's tokens after a sampled turn that ended with the end-of-turn token gives exactly the
    tokens of the whole conversation rendered by the template (ChatML: the newline after <|im_end|> is the
    environment's, the <|im_end|> the model's)."""
    tok = chat_tokenizer()
    codec = ChatCodec(tok, chat_template=True, system=None)
    first = [{"role": "user", "content": "what is 2+2"}]
    prompt = codec.prompt(first)
    turn = tok.encode("calc", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    reply = codec.reply([{"role": "user", "content": "Result: 4"}], ended=True)
    whole = tok.apply_chat_template(first + [{"role": "assistant", "content": "calc"},
                                             {"role": "user", "content": "Result: 4"}],
                                    tokenize=False, add_generation_prompt=True)
    assert prompt + turn + reply == tok.encode(whole, add_special_tokens=False)
    unended = codec.reply([{"role": "user", "content": "Result: 4"}], ended=False)
    assert unended == [tok.convert_tokens_to_ids("<|im_end|>")] + reply
    assert codec.text(turn) == "calc"


def test_a_template_that_is_not_append_only_is_refused_by_name() -> None:
    from graphrl.envs import EnvProtocolError

    # Drops the content of an assistant turn once another message follows it (as templates that strip earlier
    # reasoning do): a reply re-renders the sampled turn instead of extending it.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] == 'assistant' and not loop.last %}ok{% else %}{{ m['content'] }}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    codec = ChatCodec(chat_tokenizer(template), chat_template=True, system=None)
    with pytest.raises(EnvProtocolError, match="append-only"):
        codec.reply([{"role": "user", "content": "ok"}], ended=True)


# -- planned and costed ---------------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_echo_tiny.yaml"


def compiled(monkeypatch: pytest.MonkeyPatch, *sets: str) -> Any:
    from graphrl.compiler.compile import compile_job
    from graphrl.loader import job_cluster, load_job, parse_override

    loaded = load_job(EXAMPLE, [parse_override(s) for s in sets])
    return compile_job(loaded, job_cluster(loaded, None))


def test_the_plan_charges_an_episode_its_turns_tokens_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV cache at max_total_tokens, one generation per turn, and the environment's calls: the job's estimate
    adds (turns + 1) calls to each episode's critical path, and the preview says so."""
    monkeypatch.setenv("GRAPHRL_CALIBRATION", "none")
    from graphrl.compiler.preview import render_text

    free = compiled(monkeypatch)
    slow = compiled(monkeypatch, "nodes.rollout.env.seconds_per_call=0.25")
    e = slow.workload.episodes
    assert (e.turns, e.turn_tokens, e.max_total_tokens, e.seconds_source) == (2, 5, 24, "env.seconds_per_call")
    assert e.model_tokens == 10 and e.env_tokens == 6  # digit-echo declares 6 tokens a reply
    assert slow.chosen.estimate.environment_s == pytest.approx(3 * 0.25)
    gen = lambda plan: plan.chosen.estimate.phases["generate"]  # noqa: E731
    assert gen(slow) - gen(free) == pytest.approx(0.75, rel=1e-3)  # the phases are rounded
    text = render_text(slow)
    assert "16 x 16" not in text and "256 episodes per step" in text and "episodes of up to 2 turns" in text
    assert "750.00 ms per step is the environment" in text
    longer = compiled(monkeypatch, "nodes.rollout.env.max_total_tokens=48")
    assert longer.chosen.placements[1].memory_bytes.kv_cache > slow.chosen.placements[1].memory_bytes.kv_cache


def test_calibrate_times_a_jobs_environment_and_the_preview_charges_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from graphrl.calibration import write_calibration
    from graphrl.calibration.environments import measure_environment
    from graphrl.compiler.hardware import this_machine
    from graphrl.schemas.hardware import HARDWARE_PRESETS

    timing = measure_environment(EXAMPLE, report=lambda line: None)
    assert timing is not None and timing.env == "digit-echo" and timing.options == '{"turns": 2}'
    assert timing.calls == 8 * 3 and timing.seconds_per_call > 0  # 8 episodes: a reset and two steps each
    path = tmp_path / "cpu-local.json"
    write_calibration(HARDWARE_PRESETS["cpu-local"].model_copy(update={
        "machine": this_machine(), "environments": (timing.model_copy(update={"seconds_per_call": 0.125}),)}), path)
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(path))
    plan = compiled(monkeypatch)
    assert plan.workload.episodes.seconds_source == "measured by graphrl calibrate"
    assert plan.chosen.estimate.environment_s == pytest.approx(3 * 0.125)
    other = compiled(monkeypatch, "nodes.rollout.env.options.turns=3", "nodes.rollout.env.max_turns=3")
    assert other.workload.episodes.seconds_source.startswith("declared by DigitEcho")  # other options: not measured


def test_a_steps_episode_metrics_from_the_records() -> None:
    from graphrl.executors.episodes import episode_metrics, episode_sums

    width = len(EPISODE_COLUMNS) + 3
    record = torch.zeros(3, width)
    column = {name: i for i, name in enumerate(EPISODE_COLUMNS)}
    for i, (turns, rewards, end, wait) in enumerate([(2, [0.2, 1.0], "done", 0.1), (3, [0.2, 0.2, 0.0], "max_turns", 0.1),
                                                     (0, [], "timeout", 0.1)]):
        record[i, column["turns"]], record[i, column["end"]] = turns, END_REASONS.index(end)
        record[i, column["env_reward"]], record[i, column["env_wait_s"]] = sum(rewards), wait
        record[i, len(EPISODE_COLUMNS):len(EPISODE_COLUMNS) + turns] = torch.tensor(rewards)
    m = episode_metrics(episode_sums(record), replicas=1)
    assert m["turns_mean"] == pytest.approx(5 / 3) and m["env_reward_mean"] == pytest.approx(1.6 / 3)
    assert m["env_final_reward_mean"] == pytest.approx(1.0 / 3)  # last turns: 1.0, 0.0 and none
    assert (m["episodes_done"], m["episodes_max_turns"], m["episodes_timeout"]) == (1, 1, 1)
    assert m["env_wait_s"] == pytest.approx(0.3)
    assert episode_metrics(episode_sums(record), replicas=3)["env_wait_s"] == pytest.approx(0.1)


def test_the_python_builder_declares_the_same_agent_job() -> None:
    from graphrl.builder import Job
    from graphrl.loader import load_job

    job = Job("agent_echo_tiny", cluster="local-cpu-1",
              description="GRPO over two-turn episodes with an environment, tiny policy, digit-echo game, one CPU rank")
    policy = job.model("policy", preset="tiny-digits-tied", dtype="float32")
    prompts = job.dataset("prompts", task="digits-copy", batch_size=16, prompt_len=6, options={"num_digits": 4})
    rollout = job.generate("rollout", policy, prompts=prompts.out("prompts"), samples_per_prompt=16, max_new_tokens=5,
                           env={"class": "digit-echo", "options": {"turns": 2}, "max_turns": 2,
                                "max_total_tokens": 24, "timeout_s": 5})
    assert rollout.outputs == ("rollouts", "env_rewards")
    adv = job.advantage("adv", "grpo", rewards=rollout.out("env_rewards"), rollouts=rollout.out("rollouts"))
    job.train("update", policy, loss="grpo", rollouts=rollout.out("rollouts"), advantages=adv.out("advantages"))
    job.algorithm(lr=1.0e-3, clip_eps=0.2)
    job.schedule(mode="sync", steps=200)
    job.run(seed=0)
    assert job.build() == load_job(EXAMPLE).spec


def test_token_level_estimators_run_over_the_models_tokens_laid_end_to_end() -> None:
    """GAE and REINFORCE++ on an episode (environment tokens masked between the model's turns) give the model's
    tokens what they give the same tokens without the environment's between them: the final reward reaches
    the first turn."""
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, False, False, True, True, False], [True, False, True, True, True, False, False]])
    values, kl, rewards = torch.randn(mask.shape), torch.rand(mask.shape), torch.tensor([1.0, -0.5])
    gapped = alg.gae(rewards, values, mask, 0.9, 0.8, kl=kl, kl_coef=0.1)
    gapped_pp = alg.reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.1, gamma=0.9, normalize="none")
    for i in range(2):
        keep = mask[i]
        n = int(keep.sum())
        dense = torch.ones(1, n, dtype=torch.bool)
        adv, ret = alg.gae(rewards[i:i + 1], values[i:i + 1, keep], dense, 0.9, 0.8, kl=kl[i:i + 1, keep], kl_coef=0.1)
        assert torch.allclose(gapped[0][i, keep], adv[0]) and torch.allclose(gapped[1][i, keep], ret[0])
        pp = alg.reinforce_pp_advantages(rewards[i:i + 1], dense, kl=kl[i:i + 1, keep], kl_coef=0.1, gamma=0.9,
                                         normalize="none")
        assert torch.allclose(gapped_pp[i, keep], pp[0])
    assert bool((gapped[0][~mask] == 0).all()) and gapped[0][0, 0] != 0

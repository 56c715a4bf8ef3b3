"""Response lengths: the distribution the preview costs responses by, and what the job says about it.

- `lengths_of` holds the given mean exactly, puts the 90th percentile where `p90` says, never exceeds the
  limit, and without `response_tokens` is every response at `max_new_tokens` (the old costs, unchanged);
- `longest(n)` grows with n toward the limit; `survival` decodes exactly the mean's tokens;
- a lockstep sampler pays for its batch's longest response, a continuous-batching engine for the tokens
  that exist; both equal the fixed-length cost when every response has the same length;
- padded passes cost the micro-batch's longest row, packed ones the tokens that exist; mini-batches are
  optimizer steps each over its share;
- bad lengths, a mini-batch that does not divide the batch, and `from:` a folder without lengths exit 2
  naming the field; `from:` a run folder reads the lengths its samples.jsonl recorded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.cost import timing
from graphrl.compiler.lengths import GRID, Lengths, lengths_of, read_measured
from graphrl.compiler.roles import Workload
from graphrl.loader import apply_overrides, job_cluster, load_job, parse_override
from graphrl.schemas.hardware import HARDWARE_PRESETS
from graphrl.schemas.job import ResponseTokens
from graphrl.schemas.model import MODEL_PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
H100 = HARDWARE_PRESETS["h100-sxm-80gb"]
LLAMA8B = MODEL_PRESETS["llama3-8b"]


@pytest.mark.parametrize("mean,limit,p90", [(795, 4096, None), (795, 4096, 1600), (30, 64, None), (300, 512, 500),
                                            (1000, 4096, 4096)])
def test_the_distribution_keeps_the_mean_the_p90_and_the_limit(mean: float, limit: int, p90: float | None) -> None:
    lengths = lengths_of(ResponseTokens(mean=mean, max=limit, p90=p90), limit)
    assert len(lengths.grid) == GRID
    assert lengths.mean == pytest.approx(mean, rel=1e-6)
    assert lengths.max <= limit and min(lengths.grid) >= 1
    assert list(lengths.grid) == sorted(lengths.grid)
    if p90 is not None:
        assert lengths.quantile(0.9) == pytest.approx(p90, rel=0.01)


def test_without_response_tokens_every_response_is_max_new_tokens_long() -> None:
    lengths = lengths_of(None, 128)
    assert lengths.grid == (128.0,) and lengths.mean == 128 and lengths.longest(64) == 128
    assert lengths.survival(16) == [(0.0, 128.0, 16.0)]


def test_a_mean_at_the_limit_is_every_response_at_the_limit() -> None:
    assert lengths_of(ResponseTokens(mean=64), 64).grid == (64.0,)


def test_the_longest_of_more_responses_is_longer_and_within_the_limit() -> None:
    lengths = lengths_of(ResponseTokens(mean=300, max=2048), 2048)
    longest = [lengths.longest(n) for n in (1, 2, 8, 64, 512, 4096)]
    assert longest[0] == pytest.approx(300)
    assert all(a < b for a, b in zip(longest, longest[1:]))
    assert longest[-1] <= 2048


def test_the_longest_of_n_is_the_expected_maximum_of_the_grid() -> None:
    """Two equally likely lengths 10 and 20: the longest of two is 20 unless both are 10 (p = 1/4)."""
    lengths = Lengths((10.0, 20.0), "two")
    assert lengths.longest(2) == pytest.approx(10 * 0.25 + 20 * 0.75)


def test_the_survival_spans_decode_the_mean_tokens_and_end_at_the_longest() -> None:
    lengths = lengths_of(ResponseTokens(mean=795, max=4096), 4096)
    spans = lengths.survival(256)
    assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(lengths.longest(256))
    assert all(prev[1] == pytest.approx(nxt[0]) for prev, nxt in zip(spans, spans[1:]))
    running = [rows for _, _, rows in spans]
    assert all(a >= b for a, b in zip(running, running[1:])) and running[-1] >= 1
    decoded = sum((hi - lo) * rows for lo, hi, rows in spans)
    assert decoded == pytest.approx(256 * lengths.mean, rel=0.01)


def test_the_peak_of_a_paged_cache_is_below_every_sequence_at_full_length() -> None:
    lengths = lengths_of(ResponseTokens(mean=200, max=1024), 1024)
    peak = lengths.peak_tokens(64, prompt_len=100)
    assert 64 * 100 < peak < 64 * (100 + 1024)
    fixed = Lengths.fixed(1024)
    assert fixed.peak_tokens(64, 100) == 64 * (100 + 1024)


def test_generation_cost_follows_the_lengths() -> None:
    """A lockstep sampler decodes its batch until the longest response ends; an engine with continuous
    batching decodes only what still runs, so it is cheaper on the same lengths; with every response the
    same length both are the old fixed-length cost (before the engine's step floor)."""
    short = lengths_of(ResponseTokens(mean=512, max=4096), 4096)
    args = (LLAMA8B, 128, 256, 4096, 1, "bf16", H100)
    fixed = timing.generation_time(*args)
    lockstep = timing.generation_time(*args, lengths=short)
    continuous = timing.generation_time(*args, lengths=short, continuous=True)
    assert continuous < lockstep < fixed
    no_floor = H100.model_copy(update={"serving_step_floor_s": 0.0})
    same = timing.generation_time(LLAMA8B, 128, 256, 4096, 1, "bf16", no_floor, continuous=True)
    assert same == pytest.approx(timing.generation_time(LLAMA8B, 128, 256, 4096, 1, "bf16", no_floor))


def test_an_engine_step_is_never_shorter_than_its_floor() -> None:
    """One response of 1000 tokens on an 8B model: the device's work per step is about 6 ms on an H100,
    the engine's host side 13 ms; the decode takes the host side's pace."""
    lengths = Lengths.fixed(1000)
    t = timing.generation_time(LLAMA8B, 1, 16, 1000, 1, "bf16", H100, lengths=lengths, continuous=True)
    assert t >= 999 * H100.serving_step_floor_s
    without = timing.generation_time(LLAMA8B, 1, 16, 1000, 1, "bf16", H100.model_copy(update={"serving_step_floor_s": 0.0}),
                                     lengths=lengths, continuous=True)
    assert without < t


def _workload(**kw) -> Workload:  # noqa: ANN003
    base = dict(prompts=8, samples_per_prompt=8, prompt_len=100, response_len=1000, micro_batch=4,
                updates_per_step=1, lengths=lengths_of(ResponseTokens(mean=200, max=1000), 1000))
    return Workload(**{**base, **kw})


def test_padded_passes_cost_the_micro_batchs_longest_row_and_packed_ones_the_tokens_that_exist() -> None:
    padded = _workload()
    tokens, keys = padded.pass_sequence(4)
    assert tokens == keys == pytest.approx(100 + padded.response_lengths.longest(4))
    packed = _workload(pack=True)
    tokens, keys = packed.pass_sequence(4)
    assert tokens == pytest.approx(100 + 200)
    lengths = packed.response_lengths
    assert keys == pytest.approx((100 ** 2 + 2 * 100 * 200 + lengths.mean_square) / 300)
    assert packed.pass_sequence(4)[0] < padded.pass_sequence(4)[0]


def test_mini_batches_are_optimizer_steps_over_their_share() -> None:
    assert _workload().optimizer_steps == 1
    assert _workload(mini_batch=16).optimizer_steps == 4


# --- the job file ------------------------------------------------------------------------------------


def _validate(*sets: str):  # noqa: ANN202
    args = ["validate", str(EXAMPLES / "grpo_tiny.yaml")]
    for s in sets:
        args += ["--set", s]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("sets,field,words", [
    (("nodes.rollout.response_tokens={mean: 4, max: 3}",), "nodes.rollout", "mean 4 is above max 3"),
    (("nodes.rollout.response_tokens={mean: 2, max: 9}",), "nodes.rollout", "max 9 is above max_new_tokens 5"),
    (("nodes.rollout.response_tokens={mean: 7}",), "nodes.rollout", "mean 7 is above max_new_tokens 5"),
    (("nodes.rollout.response_tokens={max: 4}",), "nodes.rollout.response_tokens", "give 'mean'"),
    (("nodes.rollout.response_tokens={mean: 0.2, p90: 4}",), "nodes.rollout.response_tokens", "below p90 / 10"),
    (("algorithm.mini_batch_size=100",), "algorithm.mini_batch_size", "does not divide the batch of 256"),
])
def test_bad_lengths_and_mini_batches_exit_2_naming_the_field(sets: tuple[str, ...], field: str, words: str) -> None:
    result = _validate(*sets)
    assert result.exit_code == 2, result.output
    assert field in result.output and words in result.output, result.output
    assert "Traceback" not in result.output


def test_from_a_folder_without_lengths_exits_2_naming_the_field(tmp_path: Path) -> None:
    missing = _validate(f"nodes.rollout.response_tokens={{from: {tmp_path / 'nope'}}}")
    assert missing.exit_code == 2 and "nodes.rollout.response_tokens.from" in missing.output
    assert "does not exist" in missing.output
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 0, "response": "x"}) + "\n")
    empty = _validate(f"nodes.rollout.response_tokens={{from: {tmp_path}}}")
    assert empty.exit_code == 2 and "records no response lengths" in empty.output


def test_from_a_run_folder_takes_its_measured_lengths(tmp_path: Path) -> None:
    rows = [{"step": i // 4, "index": i % 4, "response_tokens": 1 + i % 5} for i in range(40)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    assert read_measured(tmp_path) == tuple(r["response_tokens"] for r in rows)
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"),
                          [parse_override(f"nodes.rollout.response_tokens={{from: {tmp_path}}}")])
    spec = job.spec.nodes["rollout"].response_tokens
    assert spec is not None and len(spec.measured) == 40
    lengths = lengths_of(spec, 5)
    assert lengths.mean == pytest.approx(3.0) and lengths.max == 5

    from graphrl.compiler.compile import compile_job
    plan = compile_job(job, job_cluster(job, None), steps=2, analytical_only=True)
    assert plan.workload is not None and plan.workload.mean_response_tokens == pytest.approx(3.0)
    assert "measured in" in plan.workload.describe()


def test_the_preview_states_the_lengths_it_assumed() -> None:
    result = CliRunner().invoke(main, ["compile", str(EXAMPLES / "llama3_8b.yaml"), "--plan"])
    assert result.exit_code == 0, result.output
    assert "assumed mean 1024, max 4096, p90 2048" in result.output
    plain = CliRunner().invoke(main, ["compile", str(EXAMPLES / "grpo_tiny.yaml"), "--plan"])
    assert "every response 5 tokens (max_new_tokens)" in plain.output
    page = CliRunner().invoke(main, ["compile", str(EXAMPLES / "llama3_8b.yaml"), "--plan", "--format", "html"])
    assert page.exit_code == 0 and "assumed mean 1024, max 4096, p90 2048" in page.output


def test_shorter_responses_make_a_cheaper_plan() -> None:
    """The 8B example's preview with its assumed lengths against every response at the limit."""
    from graphrl.compiler.compile import compile_job
    job = load_job(EXAMPLES / "llama3_8b.yaml")
    at_limit = apply_overrides(job, [parse_override("nodes.rollout.response_tokens=null")])
    assumed = compile_job(job, job_cluster(job, None), steps=2, analytical_only=True)
    limit = compile_job(at_limit, job_cluster(at_limit, None), steps=2, analytical_only=True)
    assert assumed.chosen.estimate.step_time_s < limit.chosen.estimate.step_time_s
    assert math.isclose(limit.workload.mean_response_tokens, 4096)


def test_a_p90_no_distribution_of_that_mean_reaches_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="90th percentile"):
        lengths_of(ResponseTokens(mean=500, p90=4096), 4096)
    result = CliRunner().invoke(main, ["validate", str(EXAMPLES / "llama3_8b.yaml"), "--set",
                                       "nodes.rollout.response_tokens={mean: 500, p90: 4096}"])
    assert result.exit_code == 2 and "nodes.rollout.response_tokens.p90" in result.output, result.output


def test_a_trainer_never_has_more_data_parallel_ranks_than_a_mini_batch_has_responses() -> None:
    """Every data-parallel rank holds rows of every mini-batch: the search keeps to layouts where it can,
    and pins that leave none are refused naming mini_batch_size."""
    from graphrl.compiler.compile import compile_job
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override("algorithm.mini_batch_size=1")])
    plan = compile_job(job, job_cluster(job, None), steps=2, analytical_only=True)
    trainer = next(p for p in plan.chosen.placements if p.role == "policy")
    assert trainer.dp * trainer.fsdp == 1
    result = _validate("algorithm.mini_batch_size=1", "placement.roles.policy.fsdp=2")
    assert result.exit_code == 2 and "algorithm.mini_batch_size" in result.output, result.output


def test_an_engine_with_a_memory_fraction_holds_exactly_that_share() -> None:
    """vLLM reserves its gpu_memory_utilization whole: the plan charges the generator that share of the
    device (weights and KV cache), and fits the rest of the step beside it."""
    from graphrl.compiler.compile import compile_job
    sets = ["placement.roles.policy/generate.engine=vllm", "placement.roles.policy/generate.tp=1",
            "placement.roles.policy/generate.memory_fraction=0.5", "placement.strategy=colocated"]
    job = apply_overrides(load_job(EXAMPLES / "llama3_8b.yaml"), [parse_override(s) for s in sets])
    plan = compile_job(job, job_cluster(job, None), steps=2, analytical_only=True)
    generator = next(p for p in plan.chosen.placements if p.kind == "generate")
    capacity = plan.hardware.memory_bytes
    assert generator.memory_bytes.total == pytest.approx(0.5 * capacity, rel=0.01)
    assert all(d.peak_bytes <= d.capacity_bytes for d in plan.chosen.device_memory)

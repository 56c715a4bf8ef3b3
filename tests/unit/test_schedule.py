"""Schedules, verification and simulation of per-rank programs."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.compile import compile_graph, compile_job
from graphrl.compiler.reshard import split_range
from graphrl.compiler.schedule import version_for
from graphrl.compiler.simulate import chrome_trace, run_programs
from graphrl.compiler.verify import check_memory, check_staleness
from graphrl.errors import VerifyError
from graphrl.loader import job_cluster, load_job, load_job_text
from graphrl.plan_io import load_plan, save_plan
from graphrl.schemas.program import Generate, Programs, Recv, Send, WeightSync

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden"


def graph_of(name: str, cluster: str | None = None, **options):
    job = load_job(EXAMPLES / name)
    return compile_graph(job, job_cluster(job, cluster), **options)


def test_split_range_keeps_groups_whole_and_covers_everything():
    ranges = [split_range(40, 3, i, unit=8) for i in range(3)]
    assert ranges == [(0, 16), (16, 32), (32, 40)]
    assert all((b - a) % 8 == 0 for a, b in ranges)


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_async_versions_respect_the_bound_and_are_deterministic(staleness):
    text = (EXAMPLES / "aipo_async_tiny.yaml").read_text().replace("max_staleness: 1", f"max_staleness: {staleness}")
    job = load_job_text(text, "job.yaml")
    graphs = [compile_graph(job, job_cluster(job, None), steps=9) for _ in range(2)]
    a, b = (g.programs for g in graphs)
    assert a == b  # the same job always yields the same schedule
    gens = [i for i in a.streams[0] if isinstance(i, Generate)]
    assert [g.version for g in gens] == [version_for(g.step, "async", staleness) for g in gens]
    assert all(g.step - staleness <= g.version <= g.step for g in gens)
    check_staleness(a, "async", staleness)


def test_sync_generates_with_the_current_version():
    g = graph_of("grpo_tiny.yaml", steps=5)
    gens = [i for s in g.programs.streams for i in s if isinstance(i, Generate)]
    assert gens and all(i.version == i.step for i in gens)


def test_swapped_send_and_recv_order_is_a_deadlock():
    """A program whose trainer receives step 1's batch before step 0's while the generator sends them in
    order must be rejected: with blocking semantics neither rank can move. The verifier names the rank."""
    programs = graph_of("aipo_async_tiny.yaml", steps=4).programs
    trainer = list(programs.streams[1])
    recvs = [k for k, ins in enumerate(trainer) if isinstance(ins, Recv)]
    trainer[recvs[0]], trainer[recvs[1]] = trainer[recvs[1]], trainer[recvs[0]]
    broken = dataclasses.replace(programs, ranks=Programs.unrolled(
        programs.steps, [programs.streams[0], trainer], programs.groups, {}, {}).ranks)
    with pytest.raises(VerifyError) as info:
        run_programs(broken)
    assert "deadlock: rank" in str(info.value) and "instruction" in str(info.value)


def test_missing_weight_sync_breaks_staleness():
    programs = graph_of("aipo_async_tiny.yaml", steps=6).programs
    streams = [[i for i in s if not (isinstance(i, WeightSync) and i.version == 2)] for s in programs.streams]
    with pytest.raises(VerifyError) as info:
        check_staleness(dataclasses.replace(programs, ranks=Programs.unrolled(6, streams, {}, {}, {}).ranks),
                        "async", 1)
    assert "holds" in str(info.value)


def test_every_send_has_its_receive():
    programs = graph_of("aipo_async_tiny.yaml", steps=5).programs
    sends = {(i.tag, r, i.peer) for r, s in enumerate(programs.streams) for i in s if isinstance(i, Send)}
    recvs = {(i.tag, i.peer, r) for r, s in enumerate(programs.streams) for i in s if isinstance(i, Recv)}
    assert sends and sends == recvs


def test_memory_overflow_is_reported_with_rank_and_instruction():
    g = graph_of("grpo_tiny.yaml", steps=2)
    layout = g.placement.chosen
    with pytest.raises(VerifyError) as info:
        check_memory(g.programs, layout, usable_bytes=1000.0)
    assert "rank 0 instruction" in str(info.value) and "exceeds" in str(info.value)


OFFLOAD_JOB = """
name: offload_fit
cluster: {cluster}
models:
  policy:
    dims: {{vocab_size: 128256, hidden_size: 3072, intermediate_size: 8192, num_layers: 28, num_heads: 24, num_kv_heads: 8}}
  reference:
    dims: {{vocab_size: 128256, hidden_size: 3072, intermediate_size: 8192, num_layers: 28, num_heads: 24, num_kv_heads: 8}}
    init_from: policy
  reward_model: {{preset: llama3-8b}}
nodes:
  prompts: {{op: dataset, task: synthetic-tokens, batch_size: 8, prompt_len: 512}}
  rollout: {{op: generate, model: policy, samples_per_prompt: 4, max_new_tokens: 512, inputs: {{prompts: prompts.prompts}}}}
  ref: {{op: logprob, model: reference, inputs: {{rollouts: rollout.rollouts}}}}
  score: {{op: reward, model: reward_model, inputs: {{rollouts: rollout.rollouts}}}}
  adv: {{op: advantage, estimator: grpo, inputs: {{rewards: score.rewards, rollouts: rollout.rollouts}}}}
  update: {{op: train, model: policy, loss: grpo, inputs: {{rollouts: rollout.rollouts, advantages: adv.advantages, ref_logprobs: ref.logprobs}}}}
algorithm: {{micro_batch_size: 1, kl_coef: 0.01}}
schedule: {{steps: 3}}
placement:
  roles:
    policy: {{offload: {offload}}}
"""


def test_offload_makes_a_colocated_plan_fit(tmp_path):
    """A ~3.6B policy (16 B/param of training state = 57.6 GB), its reference (7.2 GB) and an 8B reward
    model (16 GB) on one A100 (72 GB usable): while the policy trains, the frozen models' weights must
    leave the device. Without offload nothing fits; with it the plan fits and verifies, and the bytes the
    Offload instructions move are the hand-computed ones."""
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: a100-1\nnum_nodes: 1\ndevices_per_node: 1\nhardware: a100-sxm-80gb\n")
    no = load_job_text(OFFLOAD_JOB.format(cluster=cluster, offload="false"), "no.yaml")
    with pytest.raises(Exception) as info:
        compile_job(no, job_cluster(no, None))
    assert "no layout fits" in str(info.value)
    yes = load_job_text(OFFLOAD_JOB.format(cluster=cluster, offload="true"), "yes.yaml")
    graph = compile_graph(yes, job_cluster(yes, None))
    layout = graph.placement.chosen
    roles = {p.role: p for p in layout.placements}
    assert roles["policy"].offload == ["grads", "optimizer"]
    assert roles["reference"].offload == ["params"] and roles["reward_model"].offload == ["params"]
    # Hand-computed parameter count of the policy: embed + lm_head 2*V*H, per layer q,o 2*H*H,
    # k,v 2*H*(8*128), MLP 3*H*I, norms 2*H; final norm H.
    v, h, i, layers = 128256, 3072, 8192, 28
    params = 2 * v * h + layers * (2 * h * h + 2 * h * 1024 + 3 * h * i + 2 * h) + h
    assert roles["policy"].memory_bytes.grads == pytest.approx(params * 2)
    assert roles["policy"].memory_bytes.optimizer == pytest.approx(params * 12)
    assert roles["reference"].memory_bytes.params == pytest.approx(params * 2)
    from graphrl.schemas.program import Offload
    moved = {ins.role: ins.num_bytes for ins in graph.programs.streams[0] if isinstance(ins, Offload)}
    assert moved["policy"] == int(params * 14)
    assert moved["reward_model"] == int(8_030_261_248 * 2)
    assert graph.verified.peak_bytes <= graph.placement.usable_bytes


def test_simulated_async_beats_sync_on_disaggregated_tiny():
    out = CliRunner().invoke(main, ["simulate", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "8", "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    for key in ("step_time_s", "baseline", "speedup", "sync_step_time_s", "async_step_time_s"):
        assert key in data
    assert data["async_step_time_s"] < data["sync_step_time_s"]
    assert 0 < data["busy_fraction"]["trainer"] <= 1


def test_chrome_trace_has_spans_and_flows(tmp_path):
    g = graph_of("aipo_async_tiny.yaml", steps=3)
    result = run_programs(g.programs, hw=g.placement.hardware, devices_per_node=2, timed=True, trace_ranks={0, 1})
    trace = chrome_trace(result)
    phases = {e["ph"] for e in trace["traceEvents"]}
    assert {"X", "s", "f", "M"} <= phases
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "Generate step=2 v=1" in names


def test_plan_file_round_trip_keeps_programs(tmp_path):
    job = load_job(EXAMPLES / "ppo_tiny.yaml")
    plan = compile_job(job, job_cluster(job, None), steps=4)
    save_plan(plan, tmp_path / "p.msgpack")
    again = load_plan(tmp_path / "p.msgpack")
    assert again.programs == plan.programs and again == plan


def test_inspect_and_simulate_accept_plan_files(tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["compile", str(EXAMPLES / "aipo_async_tiny.yaml"), "-o", str(tmp_path / "p.msgpack")])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["inspect", str(tmp_path / "p.msgpack"), "--rank", "1", "--limit", "12"])
    assert out.exit_code == 0 and "WeightSync" in out.output and "TrainStep" in out.output
    out = runner.invoke(main, ["inspect", str(tmp_path / "p.msgpack"), "--rank", "9"])
    assert out.exit_code == 2 and "does not exist" in out.output


@pytest.mark.parametrize("name, mode", [("grpo_tiny.yaml", "sync"), ("aipo_async_tiny.yaml", "async")])
def test_programs_match_golden(name, mode):
    """The sync and async programs of the CPU examples, as `graphrl inspect` prints them, are checked in."""
    out = CliRunner().invoke(main, ["inspect", str(EXAMPLES / name), "--all-ranks", "--limit", "0"])
    assert out.exit_code == 0, out.output
    path = GOLDEN / f"{Path(name).stem}.{mode}.programs.txt"
    if os.environ.get("GRAPHRL_UPDATE_GOLDEN"):
        path.write_text(out.output)
    # A lost golden file fails (it used to be written anew and pass, hiding the loss).
    assert path.exists(), f"{path} is missing; write it with GRAPHRL_UPDATE_GOLDEN=1 and review it"
    assert out.output == path.read_text()

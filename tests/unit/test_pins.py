"""Pins the hardware cannot hold are refused at typecheck, naming the field; the rest leave the search a layout.

Before, a pin such as `tp: 4` on two devices or `dp: 1, fsdp: 1, tp: 1, pp: 1` on a colocated two-device
mesh passed `graphrl validate` and left the search without a candidate ("no candidate layout exists",
naming no field), and `dp` pins were silently dropped when `fsdp` was pinned too. The property test
below walks a grid of pins on 2- and 4-device clusters: typecheck refuses a pin set exactly when the
search, run without the pin checks, finds no layout for it, and every layout it finds honours every pin.
The pin checks are one function (`graphrl.compiler.candidates.check_pins`) that typecheck and the search
both call; the tests after the property test hold it to that.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner

import graphrl.compiler.candidates as candidates_module
from graphrl.cli import main
from graphrl.compiler.compile import compile_job
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.candidates import Problem, make_problem
from graphrl.compiler.roles import derive_roles, derive_workload
from graphrl.compiler.placement import search
from graphrl.compiler.typecheck import typecheck
from graphrl.schemas.sharding import tp_split_problem
from graphrl.errors import PlacementError
from graphrl.ir import build_graph
from graphrl.loader import apply_overrides, job_cluster, load_job, load_job_text, parse_override
from graphrl.schemas.cluster import CLUSTER_PRESETS, ClusterSpec
from graphrl.schemas.job import parse_device_range
from graphrl.schemas.model import MODEL_PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = load_job(EXAMPLES / "grpo_tiny.yaml")


def _pins(strategy: str, policy: dict[str, int], generator: dict[str, int]) -> list[str]:
    sets = [f"placement.strategy={strategy}"]
    sets += [f"placement.roles.policy.{k}={v}" for k, v in policy.items()]
    sets += [f"placement.roles.policy/generate.{k}={v}" for k, v in generator.items()]
    return sets


def _grid():  # noqa: ANN202
    axes = {"dp": (1, 2), "fsdp": (1, 2, 4), "tp": (2, 4)}
    policies = [{}] + [dict(zip(keys, values)) for r in (1, 2, 3) for keys in itertools.combinations(axes, r)
                       for values in itertools.product(*(axes[k] for k in keys))]
    generators = [{}, {"tp": 2}, {"dp": 1, "tp": 2}, {"dp": 4}, {"devices": "'0'"}, {"devices": "'0-1'", "dp": 1}]
    for cluster in ("local-cpu-2", "local-cpu-4"):
        for strategy in ("auto", "colocated", "disaggregated"):
            for policy, generator in itertools.product(policies, generators):
                yield cluster, strategy, policy, generator


def _unchecked_problem(graph, cluster, hw) -> Problem:  # noqa: ANN001
    """The search's problem as `make_problem` builds it, without its pin checks."""
    return Problem(roles=tuple(derive_roles(graph)), cluster=cluster, hw=hw, hints=graph.job.placement,
                   target="preview", mini_batch=graph.job.algorithm.mini_batch_size, workload=derive_workload(graph),
                   mode=graph.job.schedule.mode)


def test_typecheck_refuses_exactly_the_pins_no_layout_holds() -> None:
    refused = placed = 0
    for cluster_name, strategy, policy, generator in _grid():
        job = apply_overrides(TINY, [parse_override(s) for s in _pins(strategy, policy, generator)]).spec
        cluster = CLUSTER_PRESETS[cluster_name]
        hw = resolve_hardware(cluster)
        graph = build_graph(job)
        try:
            typed = typecheck(graph, cluster)
        except PlacementError as exc:
            refused += 1
            assert exc.path[:2] == ("placement", "roles"), exc.render()
            with pytest.raises(PlacementError):  # the search, without the pin checks, finds nothing either
                search(_unchecked_problem(typecheck(graph), cluster, hw))
            continue
        placed += 1
        result = search(make_problem(typed, cluster, hw), exhaustive=True)
        for ev in result.ranked:
            assert all(getattr(ev.train, k) == v for k, v in policy.items()), (policy, ev.label)
            if ev.gen is not None:
                assert all(getattr(ev.gen, k) == v for k, v in generator.items() if k != "devices"), (generator, ev.label)
                if "devices" in generator and ev.strategy == "disaggregated":  # colocated layouts use every device
                    assert (ev.gen.first, ev.gen.n) == (0, len(generator["devices"].strip("'").split("-"))), ev.label
    assert refused > 20 and placed > 20, (refused, placed)


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_tp_rule_agrees_with_the_shapes_it_splits(preset: str) -> None:
    dims = MODEL_PRESETS[preset]
    for tp in range(1, 33):
        ok = tp_split_problem(dims, tp) is None
        kv_ok = dims.num_kv_heads % tp == 0 or tp % dims.num_kv_heads == 0
        assert ok == (dims.num_heads % tp == 0 and dims.intermediate_size % tp == 0 and kv_ok), (preset, tp)


def test_pins_a_layout_does_not_read_are_warned_about() -> None:
    text = (EXAMPLES / "ppo_tiny.yaml").read_text()
    job = load_job_text(text + "\nplacement:\n  roles:\n    reference: {tp: 2}\n    policy/generate: {pp: 2}\n", "j.yaml")
    graph = typecheck(build_graph(job.spec))
    assert any(w.startswith("placement.roles.reference: ignored") for w in graph.warnings), graph.warnings
    assert any(w.startswith("placement.roles.policy/generate: pp ignored") for w in graph.warnings), graph.warnings


def test_validate_checks_pins_against_the_jobs_cluster() -> None:
    """validate knows the job's default cluster, so a pin it cannot hold fails there, not at compile."""
    result = CliRunner().invoke(main, ["validate", str(EXAMPLES / "grpo_tiny.yaml"), "--set", "placement.roles.policy.fsdp=4"])
    assert result.exit_code == 2
    assert "placement.roles.policy.fsdp: fsdp 4 needs 4 devices" in result.stderr, result.stderr


# --- one table: per pinned field, a value the search lays out and one it cannot ----------------------

class Pin(NamedTuple):
    role: str
    field: str
    good: str  # as --set reads it (YAML)
    bad: str
    words: str  # in the refusal of `bad`
    sets: tuple[str, ...] = ()  # other overrides both values are tried with
    fp8_less: bool = False  # on a cluster of GPUs without fp8 (a100-sxm-80gb)


PIN_TABLE = [
    Pin("policy", "dp", "2", "4", "dp 4 needs 4 devices"),
    Pin("policy", "fsdp", "2", "4", "fsdp 4 needs 4 devices"),
    Pin("policy", "tp", "2", "3", "tp 3 does not divide the 4 attention heads"),
    Pin("policy", "pp", "1", "2", "pp 2: pipeline-parallel execution is not implemented"),
    # tp 2 over both devices leaves one data-parallel rank: nothing for a ZeRO stage to shard over.
    Pin("policy", "sharding", "none", "zero1", "sharding 'zero1' on one data-parallel rank",
        sets=("placement.roles.policy.tp=2",)),
    Pin("policy", "devices", "'1'", "'0-7'", "outside the cluster's 2 devices", sets=("placement.strategy=disaggregated",)),
    Pin("policy/generate", "tp", "2", "3", "tp 3 does not divide the 4 attention heads"),
    Pin("policy/generate", "dp", "2", "3", "dp 3 needs 3 devices"),
    Pin("policy/generate", "devices", "'0'", "'2-3'", "outside the cluster's 2 devices",
        sets=("placement.strategy=disaggregated",)),
    Pin("policy/generate", "precision", "bf16", "fp8", "no fp8 support", fp8_less=True),
    Pin("policy/generate", "engine", "native", "vllm", "not installed here"),
]


def _pin_sets(pin: Pin, value: str, tmp_path: Path) -> list[str]:
    sets = [*pin.sets, f"placement.roles.{pin.role}.{pin.field}={value}"]
    if pin.fp8_less:
        cluster = tmp_path / "a100.yaml"
        cluster.write_text("name: a100-2\nnum_nodes: 1\ndevices_per_node: 2\nhardware: a100-sxm-80gb\n")
        sets.append(f"cluster={cluster}")
    return sets


def _compile_for_run(sets: list[str]):  # noqa: ANN202
    job = apply_overrides(TINY, [parse_override(s) for s in sets])
    return compile_job(job, job_cluster(job, None), target="run", steps=2, analytical_only=True)


@pytest.mark.parametrize("pin", PIN_TABLE, ids=lambda pin: f"{pin.role}.{pin.field}")
def test_a_pin_is_accepted_exactly_when_the_search_lays_it_out(pin: Pin, tmp_path: Path, monkeypatch) -> None:
    """For each field a user can pin: `validate` and a compile for `run` accept a value the search
    enumerates (and the plan holds it), and both refuse one it cannot, naming the field. Before, the
    pins were checked twice (typecheck and the search) and the two copies disagreed: validate passed fp8
    generation on GPUs without fp8 (it did not know the hardware), which compile then refused.
    (`offload` has no value the search cannot take: both are enumerated.)"""
    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: engine == "native")
    field = f"placement.roles.{pin.role}.{pin.field}"

    good = _pin_sets(pin, pin.good, tmp_path)
    result = CliRunner().invoke(main, ["validate", str(EXAMPLES / "grpo_tiny.yaml"), *_cli(good)])
    assert result.exit_code == 0, result.output
    plan = _compile_for_run(good)
    placed = {p.role: p for p in plan.chosen.placements}[pin.role]
    if pin.field == "devices":
        first, stop = parse_device_range(pin.good.strip("'"))
        assert plan.chosen.role_mesh(placed).devices == tuple(range(first, stop))
    else:
        assert str(getattr(placed, pin.field)) == pin.good, placed

    bad = _pin_sets(pin, pin.bad, tmp_path)
    result = CliRunner().invoke(main, ["validate", str(EXAMPLES / "grpo_tiny.yaml"), *_cli(bad)])
    assert result.exit_code == 2, result.output
    assert f"{field}: " in result.stderr and pin.words in result.stderr, result.stderr
    assert "Traceback" not in result.output
    with pytest.raises(PlacementError) as refused:
        _compile_for_run(bad)
    assert refused.value.path == ("placement", "roles", pin.role, pin.field)
    assert pin.words in str(refused.value)


def _cli(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


# --- what the two copies of the pin checks used to disagree on ---------------------------------------

def test_validate_knows_the_hardware_fp8_generation_runs_on() -> None:
    """typecheck had no HardwareSpec, so `validate` passed fp8 generation on a cluster of GPUs without fp8
    and only the search, at compile, refused it; the pin checks now resolve the cluster's hardware."""
    job = apply_overrides(TINY, [parse_override("placement.roles.policy/generate.precision=fp8")])
    graph = build_graph(job.spec)
    a100 = ClusterSpec(name="a100-2", num_nodes=1, devices_per_node=2, hardware="a100-sxm-80gb")
    with pytest.raises(PlacementError, match="no fp8 support") as refused:
        typecheck(graph, a100)
    assert refused.value.path == ("placement", "roles", "policy/generate", "precision")
    typecheck(graph, CLUSTER_PRESETS["local-cpu-2"])  # cpu-local runs fp8 generation (dequantized at use)


def test_a_colocate_group_under_a_disaggregated_strategy_is_refused_by_validate() -> None:
    """Only the search knew that a colocate group of the policy and its generator contradicts
    `strategy: disaggregated`; validate passed the job. Both now read the same `strategies`."""
    sets = ["placement.strategy=disaggregated", "placement.colocate=[[policy, policy/generate]]"]
    result = CliRunner().invoke(main, ["validate", str(EXAMPLES / "grpo_tiny.yaml"), *_cli(sets)])
    assert result.exit_code == 2, result.output
    assert "placement.colocate: colocate group" in result.stderr and "strategy is disaggregated" in result.stderr


@pytest.mark.parametrize("example, sets, target, warning", [
    ("ppo_tiny.yaml", ["placement.roles.reference.tp=3"], "preview",
     "placement.roles.reference: ignored: 'reference' runs on the trainer's mesh"),
    ("ppo_tiny.yaml", ["placement.roles.critic.pp=2"], "run",
     "placement.roles.critic: ignored: 'critic' runs on the trainer's mesh"),
    ("grpo_tiny.yaml", ["placement.roles.policy/generate.pp=5"], "preview",
     "placement.roles.policy/generate: pp ignored: a generate role's layout has no pp"),
])
def test_a_pin_the_search_does_not_read_is_a_warning_in_validate_and_compile(example: str, sets: list[str],
                                                                            target: str, warning: str) -> None:
    """A pin on a role the search does not lay out (a frozen model and a second trainer run on the
    policy's mesh) or of a field its layout has none of is ignored, and STYLE.md makes an ignored setting
    a warning. validate warned; the search's copy of the checks refused the same pins at compile when
    their value did not fit the model (tp 3 on the reference, pp 5 on the generator), and typecheck
    refused a second trainer's pp for `run`. Now both warn, and the plan ignores the pin."""
    job = apply_overrides(load_job(EXAMPLES / example), [parse_override(s) for s in sets])
    graph = typecheck(build_graph(job.spec), job_cluster(job, None), target)  # type: ignore[arg-type]
    assert warning in "\n".join(graph.warnings), graph.warnings
    plan = compile_job(job, job_cluster(job, None), target=target, steps=2, analytical_only=True)  # type: ignore[arg-type]
    assert all(p.pp == 1 for p in plan.chosen.placements)


def test_the_search_refuses_what_validate_refuses() -> None:
    """The search's own copy accepted a bf16 precision pinned on a frozen model (a precision is a choice of
    generation copies) and named roles in other words; `make_problem` now runs validate's checks."""
    job = load_job_text((EXAMPLES / "ppo_tiny.yaml").read_text() +
                        "\nplacement:\n  roles:\n    reference: {precision: bf16}\n", "job.yaml")
    cluster = job_cluster(job, None)
    graph = build_graph(job.spec)
    for check in (lambda: typecheck(graph, cluster), lambda: make_problem(graph, cluster, resolve_hardware(cluster))):
        with pytest.raises(PlacementError, match="only generation copies have a precision") as refused:
            check()
        assert refused.value.path == ("placement", "roles", "reference", "precision")


# --- graphrl run refuses before a rank starts ----------------------------------------------------------

@pytest.mark.parametrize("pin, words", [
    ("placement.roles.policy.sharding=zero2", "one data-parallel rank"),
    ("placement.roles.policy.pp=2", "pipeline-parallel"),
    ("placement.roles.policy.precision=fp8", "only generation copies"),
])
def test_run_refuses_a_pin_the_executors_cannot_run_before_starting_a_rank(pin: str, words: str, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """`graphrl run` compiles for `run`, so a pin the executors cannot run (a ZeRO stage on one rank, a pp,
    an fp8 trainer) stops it at the pin check: no rank is launched and the run folder is not created."""
    import graphrl.executors.launcher as launcher

    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: pytest.fail("a rank was launched"))
    out = tmp_path / "run"
    sets = ["placement.roles.policy.tp=2", pin] if "sharding" in pin else [pin]
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "1", "--quiet",
                                       "--out", str(out), *_cli(sets)])
    assert result.exit_code == 2, result.output
    field = pin.split("=")[0]
    assert f"{field}: " in result.stderr and words in result.stderr, result.stderr
    assert not out.exists()

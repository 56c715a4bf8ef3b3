"""Pins the hardware cannot hold are refused at typecheck, naming the field; the rest leave the search a layout.

Before, a pin such as `tp: 4` on two devices or `dp: 1, fsdp: 1, tp: 1, pp: 1` on a colocated two-device
mesh passed `graphrl validate` and left the search without a candidate ("no candidate layout exists",
naming no field), and `dp` pins were silently dropped when `fsdp` was pinned too. The property test
below walks a grid of pins on 2- and 4-device clusters: typecheck refuses a pin set exactly when the
search, run without the typecheck, finds no layout for it, and every layout it finds honours every pin.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.candidates import Problem, make_problem
from graphrl.compiler.roles import derive_roles, derive_workload
from graphrl.compiler.placement import search
from graphrl.compiler.typecheck import typecheck
from graphrl.schemas.sharding import tp_split_problem
from graphrl.errors import PlacementError
from graphrl.ir import build_graph
from graphrl.loader import apply_overrides, load_job, load_job_text, parse_override
from graphrl.schemas.cluster import CLUSTER_PRESETS
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
                   target="preview", workload=derive_workload(graph), mode=graph.job.schedule.mode)


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

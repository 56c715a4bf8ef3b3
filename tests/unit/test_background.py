"""Work on a second core (`graphrl.compiler.background`): a forked child's value is the value, its
exception is raised here, a child that dies costs the work again here (never a wrong answer), a value never
read leaves no process behind; and a compile that plans its weight sync beside the schedule makes the same
plan as one that plans it first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from graphrl.compiler import weight_sync
from graphrl.compiler.background import Later, spare_core
from graphrl.compiler.compile import compile_job

from graphrl.loader import job_cluster, load_job
from graphrl.plan_io import plan_to_bytes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
forks = pytest.mark.skipif(not spare_core(), reason="one core: the work runs at once, nothing is forked")


def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value * 2


def _refuse(message: str) -> None:
    raise ValueError(message)


def _die_unless_in(parent: int) -> str:
    if os.getpid() != parent:
        os._exit(3)  # killed before it sends anything
    return "made here"


@forks
def test_a_forked_value_is_made_in_a_child_and_read_once() -> None:
    later = Later.forked(_pid_and, 21)
    assert later.pending
    pid, value = later.get()
    assert value == 42 and pid != os.getpid()
    assert not later.pending and later.get() == (pid, 42)
    assert later.then(lambda made: made[1] + 1).get() == 43


@forks
def test_the_childs_exception_is_raised_here() -> None:
    with pytest.raises(ValueError, match="no such layout"):
        Later.forked(_refuse, "no such layout").get()


@forks
def test_a_child_that_dies_costs_the_work_again_here() -> None:
    assert Later.forked(_die_unless_in, os.getpid()).get() == "made here"


@forks
def test_a_value_never_read_leaves_no_child_behind() -> None:
    later = Later.forked(_pid_and, 1)
    pid = later._pid
    del later
    with pytest.raises(ChildProcessError):  # reaped: not even a zombie is left
        os.waitpid(pid, os.WNOHANG)


def test_without_a_spare_core_the_work_runs_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("graphrl.compiler.background.spare_core", lambda: False)
    later = Later.forked(_pid_and, 5)
    assert not later.pending and later.get() == (os.getpid(), 10)


@forks
@pytest.mark.parametrize("name", ["aipo_async_tiny.yaml", "llama3_70b.yaml"])
def test_planning_the_sync_beside_the_schedule_makes_the_same_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job = load_job(str(EXAMPLES / name))
    cluster = job_cluster(job, None)
    made = []
    for min_pairs in (10**9, 1):  # at once, then forked however small
        weight_sync.ddma_record_later.cache_clear()
        monkeypatch.setattr(weight_sync, "BACKGROUND_MIN_PAIRS", min_pairs)
        made.append(plan_to_bytes(compile_job(job, cluster)))
    weight_sync.ddma_record_later.cache_clear()
    assert made[0] == made[1]

"""A run survives what users and clusters do to it: Ctrl-C, SIGTERM, a second Ctrl-C, a killed launcher,
a second run into the same folder. Each run is a real `graphrl run` in a session of its own, so that a
signal to its process group is what a terminal's Ctrl-C sends; the signals that must land inside a step
or while ranks start are sent by the ranks themselves (`faulty_rewards.py`), at a known point. Every wait
is on an event (a line said, a file written, a process gone), never on a margin of time."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.executors.outputs import checkpoint_problem, latest_checkpoint

from run_processes import no_rank_processes_left

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HERE = Path(__file__).resolve().parent
# Only a run that hangs for good fails by these (a healthy one is done in a fraction of them).
PATIENCE_S = 300


class Run:
    """`graphrl run` as a user starts it, its stderr read as it comes."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "graphrl.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
        self.lines: list[str] = []
        self._said = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._said:
                self.lines.append(line)
                self._said.notify_all()
        with self._said:
            self._said.notify_all()

    def wait_for_line(self, text: str) -> None:
        with self._said:
            ok = self._said.wait_for(lambda: any(text in line for line in self.lines) or self.proc.poll() is not None,
                                     timeout=PATIENCE_S)
        assert ok and any(text in line for line in self.lines), self.stderr

    def wait_for(self, condition, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + PATIENCE_S
        while not condition():
            assert self.proc.poll() is None, f"ended before {what}: {self.stderr}"
            assert time.monotonic() < deadline, f"no {what}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def end(self) -> int:
        code = self.proc.wait(timeout=PATIENCE_S)
        self._reader.join(timeout=PATIENCE_S)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def in_process(*args: str) -> tuple[int, str]:
    """A command that needs no signal of its own, run in this process (its ranks still are processes)."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def tiny(out: Path, *extra: str, job: str = "grpo_tiny.yaml") -> list[str]:
    return ["run", str(EXAMPLES / job), "--out", str(out), "-q", *extra]


def steps_of(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def resume_command(stderr: str) -> list[str]:
    """The command the run said continues it (between backticks, after `continue with`)."""
    said = stderr.split("continue with `", 1)[1].split("`", 1)[0]
    words = shlex.split(said)
    assert words[:2] == ["graphrl", "run"], said
    return words[1:]


def test_ctrl_c_in_a_step_stops_after_it_and_the_command_it_gives_continues_exactly(tmp_path: Path) -> None:
    """Ctrl-C lost every step since the last checkpoint (here: none is due before step 4), and the run's
    advice disagreed with what --resume then said. Now every rank finishes step 2, that step is
    checkpointed although none was due, the run ends with 130 naming the step and the command, and that
    command continues to the same metrics as a run never interrupted."""
    job = ["--steps", "5", "--set", "nodes.score.fn=faulty_rewards:signal_in_step_two"]
    stopped = Run(*tiny(tmp_path / "run", *job), env={"GRAPHRL_TEST_SIGNAL": "SIGINT"})
    assert stopped.end() == 130, stopped.stderr
    assert "ended the run after step 2" in stopped.stderr and "written and verified" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert checkpoints(tmp_path / "run") == ["step_000002"] and steps_of(tmp_path / "run") == [0, 1, 2]
    assert checkpoint_problem(tmp_path / "run" / "checkpoints" / "step_000002") is None
    assert no_rank_processes_left(tmp_path / "run")
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["runs"][-1]["outcome"] == "stopped" and record["runs"][-1]["last_step"] == 2

    code, said = in_process(*resume_command(stopped.stderr), "-q")
    assert code == 0 and "resuming from" in said and "step_000002 at step 3" in said, said
    code, said = in_process(*tiny(tmp_path / "whole", *job))
    assert code == 0, said
    keys = ("step", "reward_mean", "loss", "weight_version")
    rows = lambda out: [[json.loads(line)[k] for k in keys] for line in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert rows(tmp_path / "run") == rows(tmp_path / "whole")


def test_sigterm_to_the_launcher_alone_checkpoints_an_asynchronous_run(tmp_path: Path) -> None:
    """SIGTERM (a scheduler's preemption; `kill` to the launcher only) ended the ranks with nothing saved
    since the last due checkpoint. Now the trainer stops after its step and checkpoints it, with the
    rollouts it already holds for later steps; the generator rank, which holds nothing to save, is ended;
    the run exits 143, and resuming it runs on."""
    out = tmp_path / "run"
    run = Run(*tiny(out, "--steps", "400", job="aipo_async_tiny.yaml"))
    run.wait_for(lambda: (out / "metrics.jsonl").exists() and len(steps_of(out)) >= 2, "second step")
    run.proc.send_signal(signal.SIGTERM)
    assert run.end() == 143, run.stderr
    assert "SIGTERM ended the run after step" in run.stderr and "Traceback" not in run.stderr
    assert no_rank_processes_left(out)
    (ckpt,) = checkpoints(out)
    step = int(ckpt.removeprefix("step_"))
    assert steps_of(out) == list(range(step + 1))
    meta = json.loads((out / "checkpoints" / ckpt / "meta.json").read_text())
    assert meta["inflight_steps"] == [step + 1]  # generated one step ahead, already received
    code, said = in_process(*resume_command(run.stderr)[:-1], "--steps", str(step + 3), "--resume", "-q")
    assert code == 0, said
    assert steps_of(out) == list(range(step + 3))


def test_a_second_ctrl_c_ends_at_once_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """A step that does not end (a hung reward) kept the run alive after Ctrl-C. The first Ctrl-C waits for
    the step; the second ends every rank at once, without a traceback, and the last complete checkpoint
    (step 1) is intact."""
    out = tmp_path / "run"
    run = Run(*tiny(out, "--steps", "6", "--set", "schedule.checkpoint_every=1",
                    "--set", "nodes.score.fn=faulty_rewards:ctrl_c_then_hang_in_step_two"))
    run.wait_for_line("stopping after the step in progress")
    run.ctrl_c()
    assert run.end() == 130, run.stderr
    assert "ended at once on a second Ctrl-C" in run.stderr and "Traceback" not in run.stderr
    assert "continue from step_000001" in run.stderr
    assert no_rank_processes_left(out)
    assert latest_checkpoint(out) == out / "checkpoints" / "step_000001"


def test_ctrl_c_while_ranks_start_leaves_a_folder_the_same_command_starts_again(tmp_path: Path) -> None:
    """Ctrl-C while the ranks started printed a KeyboardInterrupt traceback per rank, and the folder then
    counted as holding a run. Now the run ends with one message, no checkpoint, and the same command
    (without --resume or --overwrite) starts the run again there."""
    out = tmp_path / "run"
    run = Run(*tiny(out, "--steps", "2", "--set", "nodes.prompts.task=faulty_rewards:ctrl_c_while_starting"))
    assert run.end() == 130, run.stderr
    assert "ended the run before a step ended" in run.stderr and "starts the run again at step 0" in run.stderr
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    assert no_rank_processes_left(out) and not checkpoints(out)
    code, said = in_process(*tiny(out, "--steps", "2"))
    assert code == 0, said
    assert steps_of(out) == [0, 1]


def test_one_writer_per_folder_and_a_killed_launcher_takes_its_ranks_with_it(tmp_path: Path) -> None:
    """A second `graphrl run --resume` into a live run's folder was accepted (both wrote), and one with
    --overwrite deleted the live run's files under it; after `kill -9` of `graphrl run` (the OOM killer) its
    ranks and their fork server trained on, writing into the folder. Now the second run is refused while
    the first lives, naming it; the first run's processes all end with it; and its lock, left behind by
    the killed process, is taken over by the next run without a word."""
    out = tmp_path / "run"
    first = Run(*tiny(out, "--steps", "400", "--set", "schedule.checkpoint_every=1"))
    first.wait_for(lambda: latest_checkpoint(out) is not None, "first checkpoint")
    for flag in ("--resume", "--overwrite"):
        code, said = in_process(*tiny(out, "--steps", "400", flag))
        assert code == 2, said
        assert f"run folder {out} is in use" in said and f"pid {first.proc.pid}" in said
    assert first.proc.poll() is None and (out / "plan.msgpack").exists()

    first.proc.kill()
    first.end()

    def group() -> list[str]:  # the ranks, the fork server, multiprocessing's resource tracker
        return subprocess.run(["pgrep", "-g", str(first.proc.pid)], capture_output=True, text=True).stdout.split()

    deadline = time.monotonic() + PATIENCE_S
    while group() or not no_rank_processes_left(out):
        assert time.monotonic() < deadline, f"processes of the run outlived their launcher: {group()}"
        time.sleep(0.1)
    assert (out / "run.lock").exists()  # nobody removed it: its holder was killed
    done = steps_of(out)
    code, said = in_process(*tiny(out, "--steps", str(len(done) + 1), "--resume"))
    assert code == 0 and "resuming from" in said, said
    assert not (out / "run.lock").exists()


def test_a_two_node_torchrun_launch_stops_on_sigterm_and_the_same_script_continues(tmp_path: Path) -> None:
    """Under torchrun (the script `graphrl launch` writes for clusters, here two nodes on loopback) SIGTERM,
    what SLURM sends before a time limit or a preemption, ended the ranks with nothing saved, and running
    the script again started the run over. Now SIGTERM on one node stops the ranks of both after step 2
    (they agree on the step), step 2 is checkpointed, and the same scripts, started again as a scheduler
    requeues a job, continue from it to the end."""
    from graphrl.executors.launcher import free_port

    cluster = tmp_path / "two_nodes.yaml"
    cluster.write_text("name: two-nodes\nnum_nodes: 2\ndevices_per_node: 1\nhardware: cpu-local\nbackend: gloo\n")
    out = tmp_path / "run"
    code, said = in_process("launch", str(EXAMPLES / "grpo_tiny.yaml"), "--emit", "torchrun", "-c", str(cluster),
                            "-o", str(tmp_path / "launch"), "--out", str(out), "--steps", "5", "--port",
                            str(free_port()), "--grace-period", "60",
                            "--set", "nodes.score.fn=faulty_rewards:signal_in_step_two")
    assert code == 0, said
    script = tmp_path / "launch" / "launch.sh"
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-60" in script.read_text()

    def nodes(**env: str) -> list[subprocess.CompletedProcess]:
        procs = [subprocess.Popen(["bash", str(script)], env={**os.environ, "PYTHONPATH": str(HERE), "NODE_RANK": str(n),
                                                               **env},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for n in range(2)]
        return [subprocess.CompletedProcess(p.args, p.wait(timeout=PATIENCE_S), p.stdout.read() if p.stdout else "")
                for p in procs]

    stopped = nodes(GRAPHRL_TEST_SIGNAL="SIGTERM")  # the first rank signals its own node only
    assert all(n.returncode != 0 for n in stopped), [n.stdout[-2000:] for n in stopped]
    assert checkpoints(out) == ["step_000002"] and steps_of(out) == [0, 1, 2], stopped[0].stdout[-3000:]
    assert checkpoint_problem(out / "checkpoints" / "step_000002") is None
    again = nodes()
    assert [n.returncode for n in again] == [0, 0], [n.stdout[-2000:] for n in again]
    assert "resuming from" in again[0].stdout and steps_of(out) == [0, 1, 2, 3, 4]

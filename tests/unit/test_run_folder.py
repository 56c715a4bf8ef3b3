"""A run folder belongs to one job (executors/runfolder.py): identity, refusal, overwrite, rewinding the
records, and checkpoint checks (executors/outputs.py). No processes: the folders are made by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graphrl.errors import GraphRLError, OutputError, RunError
from graphrl.executors.outputs import checkpoint_problem, json_line, latest_checkpoint
from graphrl.executors.runfolder import (differences, job_identity, prepare_run_folder, record_run,
                                         rewind_records)
from graphrl.loader import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def spec():  # noqa: ANN201
    return load_job(EXAMPLES / "grpo_tiny.yaml").spec


def test_a_used_folder_is_refused_without_resume_or_overwrite(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """Running again into a run folder truncated its metrics.jsonl and left the old checkpoints beside
    the new ones."""
    prepare_run_folder(tmp_path, spec, resume=False, overwrite=False)  # an empty folder is fine
    record_run(tmp_path, spec, steps=4, start_step=0, resumed_from=None)
    (tmp_path / "metrics.jsonl").write_text(json_line({"step": 0}))
    with pytest.raises(RunError, match="already holds a run") as info:
        prepare_run_folder(tmp_path, spec, resume=False, overwrite=False)
    assert "--resume" in info.value.fix and "--overwrite" in info.value.fix
    assert (tmp_path / "metrics.jsonl").exists()


def test_overwrite_deletes_only_what_runs_write(tmp_path: Path, spec) -> None:  # noqa: ANN001
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "my_notes.md").write_text("mine")
    prepare_run_folder(tmp_path, spec, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_notes.md"]


def test_resume_of_another_job_names_what_differs(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """--resume of a different job was accepted when the shapes matched, mixing its metrics in."""
    record_run(tmp_path, spec, steps=4, start_step=0, resumed_from=None)
    other = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"lr": 0.5}),
                                    "run": spec.run.model_copy(update={"seed": 7})})
    with pytest.raises(RunError) as info:
        prepare_run_folder(tmp_path, other, resume=True, overwrite=False)
    assert "algorithm.lr" in info.value.message and "run.seed" in info.value.message
    # what a resume may change: more steps, another cluster or layout
    longer = spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"steps": 999}),
                                     "cluster": "local-cpu-4"})
    prepare_run_folder(tmp_path, longer, resume=True, overwrite=False)
    assert differences(job_identity(spec), job_identity(longer)) == []


def test_resume_and_overwrite_together_are_refused(tmp_path: Path, spec) -> None:  # noqa: ANN001
    with pytest.raises(GraphRLError, match="contradict"):
        prepare_run_folder(tmp_path, spec, resume=True, overwrite=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_out_is_a_user_error(tmp_path: Path, spec) -> None:  # noqa: ANN001
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="cannot be written"):
            prepare_run_folder(locked / "run", spec, resume=False, overwrite=False)
    finally:
        locked.chmod(0o700)


def test_an_out_that_is_a_file_is_a_user_error(tmp_path: Path, spec) -> None:  # noqa: ANN001
    (tmp_path / "run").write_text("")
    with pytest.raises(OutputError, match="is a file"):
        prepare_run_folder(tmp_path / "run", spec, resume=False, overwrite=False)


def test_rewind_drops_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    """Resuming after an interruption repeated the steps between the checkpoint and the interruption
    in metrics.jsonl and samples.jsonl; a torn last line (a killed writer) is dropped too."""
    (tmp_path / "metrics.jsonl").write_text("".join(json_line({"step": s}) for s in range(5)) + '{"step": 5, "lo')
    (tmp_path / "samples.jsonl").write_text("".join(json_line({"step": s, "index": i}) for s in range(4) for i in range(2)))
    dropped = rewind_records(tmp_path, 2)
    assert dropped == {"metrics.jsonl": 4, "samples.jsonl": 4}
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [0, 0, 1, 1]


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint folder as finish_checkpoint leaves it, without DCP state (no trained role)."""
    from graphrl.executors.outputs import finish_checkpoint

    partial = root / "checkpoints" / f".step_{step:06d}.partial"
    partial.mkdir(parents=True)
    (partial / "inflight.rank0.pt").write_bytes(b"x" * 100)
    return finish_checkpoint(partial, root / "checkpoints" / f"step_{step:06d}", step, {}, {}, 0, [])


def test_a_damaged_checkpoint_is_named_and_passed_over(tmp_path: Path) -> None:
    """A checkpoint with a file missing or cut short failed deep in DCP naming no file; the newest intact
    one is used instead, and each damaged one is reported with its file and reason."""
    first, second, third = (_fake_checkpoint(tmp_path, s) for s in (1, 3, 5))
    assert (tmp_path / "checkpoints" / "latest").read_text() == third.name
    assert checkpoint_problem(third) is None
    (third / "inflight.rank0.pt").write_bytes(b"x" * 10)  # cut short
    (second / "inflight.rank0.pt").unlink()  # lost
    said: list[str] = []
    assert latest_checkpoint(tmp_path, say=said.append) == first
    assert "step_000005" in said[0] and "inflight.rank0.pt has 10 bytes, 100 were written" in said[0]
    assert "step_000003" in said[1] and "inflight.rank0.pt is missing" in said[1]
    (first / "meta.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) is None
    assert "meta.json is not a checkpoint's metadata" in checkpoint_problem(first)


def test_no_partial_checkpoint_is_ever_named_latest(tmp_path: Path) -> None:
    """`latest` is written after the rename; a partial folder (a rank still writing) is never a candidate."""
    _fake_checkpoint(tmp_path, 1)
    (tmp_path / "checkpoints" / ".step_000002.partial").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000001"
    manifest = json.loads((tmp_path / "checkpoints" / "step_000001" / "manifest.json").read_text())
    assert manifest["files"] == {"inflight.rank0.pt": 100, "meta.json": manifest["files"]["meta.json"]}


def test_run_with_an_unwritable_out_exits_2(tmp_path: Path) -> None:
    """An --out that cannot be created ended in a traceback (exit 1); it is a user error naming it."""
    from click.testing import CliRunner

    from graphrl.cli import main

    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--out", str(tmp_path / "afile" / "run")])
    assert result.exit_code == 2, result.output
    assert "cannot be written" in result.output and "Traceback" not in result.output

"""A run folder belongs to one job (executors/runfolder.py): identity, refusal, overwrite, rewinding the
records, and checkpoint checks (executors/outputs.py). No processes: the folders are made by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graphrl.errors import GraphRLError, OutputError, RunError
from graphrl.executors.outputs import checkpoint_problem, json_line, latest_checkpoint
from graphrl.executors.runfolder import (LOCK_FILE, RunFolderLock, claim_run_folder, differences, job_identity,
                                         read_record, record_run, record_written, rewind_records)
from graphrl.loader import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def spec():  # noqa: ANN201
    return load_job(EXAMPLES / "grpo_tiny.yaml").spec


def claim(out: Path, spec, *, resume: bool = False, overwrite: bool = False):  # noqa: ANN001, ANN201
    return claim_run_folder(out, spec, resume=resume, overwrite=overwrite, command="graphrl run test")


def start(out: Path, spec, steps: int = 4, **flags: bool):  # noqa: ANN001, ANN201
    """Claim `out` for a run of `steps` steps, begin it and give the folder up again; where it starts."""
    with claim(out, spec, **flags) as folder:
        return folder.begin(spec, steps, say=lambda line: None)


def test_a_used_folder_is_refused_without_resume_or_overwrite(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """Running again into a run folder truncated its metrics.jsonl and left the old checkpoints beside
    the new ones."""
    start(tmp_path, spec)  # an empty folder is fine
    (tmp_path / "metrics.jsonl").write_text(json_line({"step": 0}))
    with pytest.raises(RunError, match="already holds a run") as info:
        claim(tmp_path, spec)
    assert "--resume" in info.value.fix and "--overwrite" in info.value.fix
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / LOCK_FILE).exists()


def test_overwrite_deletes_only_what_runs_wrote(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """`--overwrite` deleted a user's own checkpoints/my_model.pt and report.html, because it removed
    whole folders and every name a run might write. Now it deletes the run's own files by name, and a
    report.html only where `graphrl report` wrote it (run.json says so)."""
    start(tmp_path, spec)
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "my_model.pt").write_text("mine")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.host.2.0").write_text("")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "report.html").write_text("my own page")
    (tmp_path / "my_notes.md").write_text("mine")
    start(tmp_path, spec, overwrite=True)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "checkpoints", "checkpoints/my_model.pt", "my_notes.md", "report.html", "run.json"]
    assert len(read_record(tmp_path)["runs"]) == 1  # the new run's record only
    record_written(tmp_path, tmp_path / "report.html")  # now graphrl's: `graphrl report` wrote it
    start(tmp_path, spec, overwrite=True)
    assert not (tmp_path / "report.html").exists() and (tmp_path / "checkpoints" / "my_model.pt").exists()


def test_a_folder_that_is_not_a_run_folder_is_never_written_over(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """A folder counted as holding a run when it merely held `checkpoints/` or `metrics.jsonl`, and
    --overwrite then deleted them. Without graphrl's run.json a folder is the user's: a run may use it
    beside the user's files, but not where a run writes, with or without --overwrite."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "my_model.pt").write_text("mine")
    assert start(tmp_path, spec).step == 0  # nothing where a run writes: fine
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metrics.jsonl").write_text("their numbers")
    for flags in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match="not a graphrl run folder") as info:
            claim(theirs, spec, **flags)
        assert "metrics.jsonl" in info.value.message
    assert (theirs / "metrics.jsonl").read_text() == "their numbers"
    with pytest.raises(RunError, match="holds no run to resume"):
        claim(tmp_path / "new", spec, resume=True)
    assert not (tmp_path / "new").exists()  # made for the lock, and removed again


def test_a_run_that_did_nothing_starts_again_and_resume_without_a_checkpoint_starts_at_zero(tmp_path: Path, spec) -> None:  # noqa: ANN001, E501
    """A run stopped while its ranks started left run.json, and the folder then refused the same command
    ("already holds a run") while --resume said "no intact checkpoint ... run without --resume". Now the
    same command starts it again, and --resume of a run with steps but no checkpoint starts at step 0 with
    its records emptied, saying so."""
    start(tmp_path, spec)
    assert start(tmp_path, spec).step == 0  # no step done, no checkpoint: no run to protect
    (tmp_path / "metrics.jsonl").write_text(json_line({"step": 0}))
    with claim(tmp_path, spec, resume=True) as folder:
        begun = folder.begin(spec, 4, say=lambda line: None)
    assert begun.step == 0 and begun.checkpoint is None and "starts again from step 0" in begun.notes[0]
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_of_another_job_names_what_differs(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """--resume of a different job was accepted when the shapes matched, mixing its metrics in."""
    record_run(tmp_path, spec, steps=4, start_step=0, resumed_from=None)
    other = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"lr": 0.5}),
                                    "run": spec.run.model_copy(update={"seed": 7})})
    with pytest.raises(RunError) as info:
        claim(tmp_path, other, resume=True)
    assert "algorithm.lr" in info.value.message and "run.seed" in info.value.message
    # what a resume may change: more steps, another cluster or layout
    longer = spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"steps": 999}),
                                     "cluster": "local-cpu-4"})
    claim(tmp_path, longer, resume=True).release()
    assert differences(job_identity(spec), job_identity(longer)) == []


def test_resume_and_overwrite_together_are_refused(tmp_path: Path, spec) -> None:  # noqa: ANN001
    with pytest.raises(GraphRLError, match="contradict"):
        claim(tmp_path, spec, resume=True, overwrite=True)


def test_one_writer_at_a_time_and_a_dead_writers_lock_is_taken_over(tmp_path: Path, spec) -> None:  # noqa: ANN001
    """Two runs into one folder both wrote. The lock refuses the second while the first holds it, naming
    the first; a lock file left by a process that died (no one holds its flock) is taken over."""
    first = claim(tmp_path, spec)
    try:
        with pytest.raises(RunError, match="is in use") as info:
            claim(tmp_path, spec, resume=True)
        assert f"pid {os.getpid()}" in info.value.message and "graphrl run test" in info.value.message
    finally:
        first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "since": "yesterday"}))
    lock = RunFolderLock.take(tmp_path, "graphrl run again")
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_out_is_a_user_error(tmp_path: Path, spec) -> None:  # noqa: ANN001
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="cannot be written"):
            claim(locked / "run", spec)
    finally:
        locked.chmod(0o700)


def test_an_out_that_is_a_file_is_a_user_error(tmp_path: Path, spec) -> None:  # noqa: ANN001
    (tmp_path / "run").write_text("")
    with pytest.raises(OutputError, match="is a file"):
        claim(tmp_path / "run", spec)


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
    assert sorted(manifest["files"]) == ["inflight.rank0.pt", "meta.json"]
    assert manifest["files"]["inflight.rank0.pt"]["bytes"] == 100


def test_damage_that_keeps_a_files_size_is_found_by_its_checksum(tmp_path: Path) -> None:
    """The manifest held sizes only: a checkpoint whose shard changed in place (a bad block, a stray
    write) passed as intact and failed deep in loading, or loaded wrong numbers. Each file's sha256 is
    checked now, and the checkpoint before it is used, named."""
    first, second = (_fake_checkpoint(tmp_path, s) for s in (1, 2))
    (second / "inflight.rank0.pt").write_bytes(b"y" * 100)  # same size, other bytes
    said: list[str] = []
    assert latest_checkpoint(tmp_path, say=said.append) == first
    assert "step_000002" in said[0] and "does not match its checksum" in said[0]
    manifest = second / "manifest.json"
    manifest.write_text(json.dumps({"files": {"inflight.rank0.pt": 100, "meta.json": 1}}))  # an older graphrl's
    assert "meta.json has" in checkpoint_problem(second)


def test_run_with_an_unwritable_out_exits_2(tmp_path: Path) -> None:
    """An --out that cannot be created ended in a traceback (exit 1); it is a user error naming it."""
    from click.testing import CliRunner

    from graphrl.cli import main

    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--out", str(tmp_path / "afile" / "run")])
    assert result.exit_code == 2, result.output
    assert "cannot be written" in result.output and "Traceback" not in result.output

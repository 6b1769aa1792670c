"""Asynchronous checkpoints (worker/saver.py): the loop only captures and copies the state, a
writer thread publishes it; at most one write in flight, the wait counted; a failed write
named at the next step; a run killed at any phase of a save resumes, bit for bit, from a
complete checkpoint. Real files and real processes."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import time
from pathlib import Path

import psutil
import pytest
from tests.worker import helpers as h

from gpuherd.checkpoint_layout import list_checkpoints
from gpuherd.checkpoint_manifest import read_manifest
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import StatusWriter
from worker.save_phases import PAUSE_VAR, PHASES
from worker.train import run

IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)
SAVES = ["training.save_every=2", "training.keep_last=1", "training.max_steps=6"]


def checkpoints(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "checkpoint"]


def test_periodic_saves_are_written_in_the_background_and_the_final_one_before_the_end(tmp_path: Path, capfd):
    cfg = h.tiny_config(tmp_path, *SAVES)
    status = tmp_path / "status.jsonl"
    code = run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(status, 0), install_signals=False,
               run_id="r1")
    assert code == 0
    records = h.read_status(status)
    saves = checkpoints(records)
    assert [(r["step"], r["mode"]) for r in saves] == [(2, "async"), (4, "async"), (6, "blocking")]
    assert all(r["stall_s"] >= 0 and r["write_s"] > 0 and r["wait_s"] >= 0 for r in saves)
    # each write's CPU seconds where it ran: the writer process's (async), the loop's (blocking)
    assert all(0 < r["write_cpu_s"] < 60 for r in saves)
    writes = [r for r in records if r["type"] == "checkpoint_write"]
    assert [(r["state"], r["step"]) for r in writes if r["state"] != "accounted"] == [("started", 2), ("started", 4)]
    # each save's whole cost to the loop, once its write ended: step 2's by step 4's save at the latest
    accounted = [r for r in writes if r["state"] == "accounted"]
    assert [r["step"] for r in accounted] == [2, 4, 6] and all(isinstance(r["cost_s"], float) for r in accounted)
    assert accounted[-1]["steps"] == 0  # the final save: no step follows it
    assert records.index(accounted[0]) < records.index(saves[1])
    # each async checkpoint is announced only once it is published, manifest included
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [6]  # keep_last=1
    assert read_manifest(tmp_path / "ckpt" / "step_0000006.pt").step == 6
    err = capfd.readouterr().err
    assert re.search(r"Step \[2/6\] .* \| Ckpt: stall \d+\.\d\ds", err), err
    assert re.search(r"checkpoint saved: .*step_0000002\.pt \(written in the background in \d+\.\d\d s, "
                     r"the loop blocked \d+\.\d\d s\)", err), err
    assert "checkpoints: 3 saved, the loop blocked" in err and "(2 in the background)" in err
    assert re.search(r"s per write \(\d+\.\d\d s of CPU\)", err), err
    assert re.search(r"measured on the step times, 3 cost the loop -?\d+\.\d\d s in all", err), err


def test_async_save_off_blocks_every_save(tmp_path: Path, capfd):
    cfg = h.tiny_config(tmp_path, *SAVES, "training.async_save=false")
    status = tmp_path / "status.jsonl"
    assert run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(status, 0), install_signals=False) == 0
    assert {r["mode"] for r in checkpoints(h.read_status(status))} == {"blocking"}
    assert "written while the loop waits" not in capfd.readouterr().err  # asked for: nothing to explain


class _SecondSaveSignal(StatusWriter):
    """Creates `second_save` (a file: the write runs in a forked child, which shares no event
    with the loop) when the loop starts its second save (its `phase checkpoint` record)."""

    def __init__(self, path: Path, second_save: Path) -> None:
        super().__init__(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 0)
        self.second_save, self._saves = second_save, 0

    def send(self, type_: str, **fields) -> None:
        super().send(type_, **fields)
        if type_ == "phase" and fields.get("name") == "checkpoint":
            self._saves += 1
            if self._saves == 2:
                self.second_save.touch()


def test_a_save_waits_for_the_write_in_flight_and_the_wait_is_counted(tmp_path: Path, capfd, monkeypatch):
    """The first write is held until the loop reaches the next save: that save must wait for it."""
    import worker.engines.torch_engine as torch_engine

    status = _SecondSaveSignal(tmp_path / "status.jsonl", tmp_path / "second_save")
    real = torch_engine.save_checkpoint_file

    def held_write(obj, path):
        if obj["meta"]["step"] == 2:
            deadline = time.monotonic() + 120
            while not status.second_save.exists():
                assert time.monotonic() < deadline, "the loop never reached its second save"
                time.sleep(0.01)
        real(obj, path)

    monkeypatch.setattr(torch_engine, "save_checkpoint_file", held_write)
    cfg = h.tiny_config(tmp_path, *SAVES, "training.keep_last=3")
    assert run(cfg, IDENTITY, data=h.bundle(cfg), status=status, install_signals=False) == 0
    saves = checkpoints(h.read_status(tmp_path / "status.jsonl"))
    assert [r["step"] for r in saves] == [2, 4, 6]
    assert saves[0]["wait_s"] == 0 and saves[1]["wait_s"] > 0  # the save of step 4 waited for step 2's write
    err = capfd.readouterr().err
    assert re.search(r"waited \d+\.\d\d s for the checkpoint of step 2 to be written before going on", err), err
    # step 4's save waited; the final save may wait for step 4's write too, as the machine's speed has it
    waited = re.search(r"; (\d+) waited \d+\.\d\d s in all for the previous write", err)
    assert waited and int(waited.group(1)) >= 1, err


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, 128 * 1024))


def _spec(tmp: Path, name: str, overrides: list[str]) -> Path:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"tmp": str(tmp), "status_dir": str(tmp), "overrides": overrides,
                                "runs": [{"name": name, "port": h.free_port()}]}))
    return spec


def test_a_full_disk_during_a_background_write_is_exit_7_at_the_next_step(tmp_path: Path):
    spec = _spec(tmp_path, "full", [*SAVES, "training.max_steps=4"])
    proc = h.Watched(["tests/worker/helpers.py", "train", str(spec)], h.worker_env(0, 1, 0),
                     preexec_fn=_limit_file_size)
    assert proc.finish(timeout=180) == ExitCode.STORAGE, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot save checkpoint to" in errors[0] and "file too large" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "ckpt").iterdir()) == []  # no half-written checkpoint, no temp file
    started = [r for r in h.read_status(tmp_path / "full-rank0.jsonl")
               if r["type"] == "checkpoint_write" and r["state"] != "accounted"]
    assert [r["state"] for r in started] == ["started", "failed"]  # it was the background write that failed


# --------------------------------------------------------------------------- killed mid-save


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of an uninterrupted run (blocking saves: the one thing async must not change)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = _spec(tmp, "ref", [*SAVES, "training.async_save=false"])
    [done] = h.spawn(["tests/worker/helpers.py", "train", str(spec)], [h.worker_env(0, 1, 0)], timeout=300)
    assert done.returncode == 0, done.stderr
    return h.step_losses(tmp / "ref-rank0.jsonl")


@pytest.mark.parametrize("phase", PHASES)
def test_a_run_killed_at_any_phase_of_an_async_save_resumes_bit_exactly(tmp_path: Path, phase: str,
                                                                         reference: list[float]):
    """SIGKILL while the save of step 4 is at `phase` (step 2's is complete; keep_last=1 must not
    have removed it): --resume auto takes the newest complete checkpoint and ends where an
    uninterrupted run ends, loss for loss."""
    spec = _spec(tmp_path, "killed", SAVES)
    proc = h.Watched(["tests/worker/helpers.py", "train", str(spec)],
                     h.worker_env(0, 1, 0, **{PAUSE_VAR: f"{phase}:4"}))
    try:
        proc.wait_for(f"checkpoint save paused at {phase} (step 4)", timeout=240)
    finally:
        proc.kill()
    published = phase == "published"
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == ([2, 4] if published else [2])

    spec = _spec(tmp_path, "resumed", [*SAVES, "training.resume=auto"])
    [done] = h.spawn(["tests/worker/helpers.py", "train", str(spec)], [h.worker_env(0, 1, 0)], timeout=300)
    assert done.returncode == 0, done.stderr
    start = 4 if published else 2
    assert f"step_000000{start}.pt at step {start}" in done.stderr
    assert "WARNING" not in done.stderr  # nothing damaged was even looked at
    assert h.step_losses(tmp_path / "resumed-rank0.jsonl") == reference[start:]


def test_the_writer_is_a_process_of_its_own_and_its_death_is_named_at_the_next_step(tmp_path: Path,
                                                                                    reference: list[float]):
    """SIGKILL of the writer process while its file is complete but unpublished: the loop names the
    writer's death at its next step (exit 1, one line, the loop's own pid alive until then),
    nothing of that save is visible, and --resume auto continues bit-exactly from the older one."""
    spec = _spec(tmp_path, "writer", SAVES)
    proc = h.Watched(["tests/worker/helpers.py", "train", str(spec)],
                     h.worker_env(0, 1, 0, **{PAUSE_VAR: "written:4"}))
    try:
        line = proc.wait_for("checkpoint save paused at written (step 4)", timeout=240)
        writer = int(re.search(r"pid (\d+)\]", line).group(1))
        assert writer != proc.proc.pid and psutil.Process(writer).ppid() == proc.proc.pid
        os.kill(writer, signal.SIGKILL)
        assert proc.finish(timeout=120) == ExitCode.FAILURE, proc.stderr
    finally:
        proc.kill()
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"the checkpoint writer process (pid {writer}) was killed by SIGKILL before it " \
        "published the checkpoint of step 4" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2]

    spec = _spec(tmp_path, "resumed", [*SAVES, "training.resume=auto"])
    [done] = h.spawn(["tests/worker/helpers.py", "train", str(spec)], [h.worker_env(0, 1, 0)], timeout=300)
    assert done.returncode == 0, done.stderr
    assert "step_0000002.pt at step 2" in done.stderr and "WARNING" not in done.stderr  # the temp file: no damage
    assert h.step_losses(tmp_path / "resumed-rank0.jsonl") == reference[2:]


def test_staging_larger_than_half_the_available_memory_is_refused_in_words():
    from worker.staging import memory_problem

    assert memory_problem(0) is None
    problem = memory_problem(10**15)
    assert problem is not None and problem.startswith("a host copy of this rank's checkpoint state takes ~1000.0 TB")
    half = psutil.virtual_memory().available // 2
    assert memory_problem(half // 2 - 2**20, copies=2) is None
    problem = memory_problem(half // 2 + 2**30, copies=2)
    assert problem is not None and problem.startswith("2 host copies of this rank's checkpoint state")


def test_save_stats_say_what_the_saves_cost_since_the_last_step_line():
    from worker.save_stats import SaveStats

    stats = SaveStats()
    assert stats.step_note() is None and stats.summary() is None
    stats.staged(0.05, 0.0)
    assert stats.step_note() == "Ckpt: stall 0.05s"
    stats.published(0.05, 0.0, 2.5, background=True)
    stats.staged(1.25, 1.0)  # waited 1 s for the previous write
    assert stats.step_note() == "Ckpt: stall 1.25s, waited 1.00s, write 2.50s"
    stats.published(0.5, 0.0, 0.5, background=False)  # the final, blocking save
    assert stats.summary() == ("checkpoints: 3 saved, the loop blocked 1.80 s in all (0.600 s per save, at most "
                               "1.250 s); 2 written by this rank (1 in the background), 1.50 s per write; 1 waited "
                               "1.00 s in all for the previous write")


def _two_ranks(tmp: Path, name: str, overrides: list[str], **env: str) -> list[h.Watched]:
    spec = _spec(tmp, name, overrides)
    port = json.loads(spec.read_text())["runs"][0]["port"]
    return [h.Watched(["tests/worker/helpers.py", "train", str(spec)], h.worker_env(rank, 2, port, **env))
            for rank in (0, 1)]


def test_fsdp_killed_between_its_manifest_and_the_rename_resumes_bit_exactly_from_the_older_one(tmp_path: Path):
    """Every FSDP rank writes its shards in the background; the ranks are killed while the
    step-4 directory is complete, manifest included, but not yet renamed: --resume auto takes
    step 2 and both ranks end where an uninterrupted (blocking) run ends."""
    fsdp = [*SAVES, "training.strategy=fsdp"]
    for proc in _two_ranks(tmp_path, "ref", [*fsdp, "training.async_save=false", "system.checkpoint_dir=ref"]):
        assert proc.finish(timeout=300) == 0, proc.stderr
    killed = _two_ranks(tmp_path, "killed", fsdp, **{PAUSE_VAR: "manifest:4"})
    try:
        killed[0].wait_for("checkpoint save paused at manifest (step 4)", timeout=240)
    finally:
        for proc in killed:
            proc.kill()
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2]
    assert read_manifest(tmp_path / "ckpt" / "step_0000002").step == 2

    resumed = _two_ranks(tmp_path, "resumed", [*fsdp, "training.resume=auto"])
    for proc in resumed:
        assert proc.finish(timeout=300) == 0, proc.stderr
    assert "step_0000002 at step 2" in resumed[0].stderr
    for rank in (0, 1):
        reference = h.step_losses(tmp_path / f"ref-rank{rank}.jsonl")
        assert h.step_losses(tmp_path / f"resumed-rank{rank}.jsonl") == reference[2:], rank

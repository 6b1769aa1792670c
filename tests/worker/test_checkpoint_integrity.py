"""Checkpoints that survive anything: a manifest with the run id and every file's digest,
verified on resume; a corrupt newest checkpoint skipped for the newest valid one;
another run's checkpoint refused on a restart; a killed save's temp files removed at
the next start, never a live writer's; a full disk named in one line with its own exit
code. Real files and real processes throughout."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
import xxhash
from tests.worker import helpers as h

from gpuherd.checkpoint_layout import list_checkpoints
from gpuherd.checkpoint_manifest import manifest_path, read_manifest
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from worker.distributed import WorkerError
from worker.train import run

RUN = "run-a"
IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)


def train(tmp: Path, *extra: str, run_id: str = RUN, status_name: str = "status.jsonl") -> tuple[int, list[dict]]:
    cfg = h.tiny_config(tmp, *extra)
    path = tmp / status_name
    code = run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(path, 0), install_signals=False,
               run_id=run_id)
    return code, h.read_status(path)


def steps_of(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if r["type"] == "step"]


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "WARNING" in line]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One run's checkpoints after steps 2, 4 and 6."""
    tmp = tmp_path_factory.mktemp("saved")
    code, _ = train(tmp, "training.save_every=2", "training.keep_last=3")
    assert code == 0
    return tmp / "ckpt"


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A private copy of the saved checkpoints, where tiny_config(tmp_path) looks for them."""
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_every_checkpoint_records_its_run_step_and_digest(saved: Path):
    found = list_checkpoints(saved)
    assert [step for step, _ in found] == [2, 4, 6]
    for step, path in found:
        manifest = read_manifest(path)
        assert (manifest.run_id, manifest.step) == (RUN, step)
        digest = manifest.files[path.name]
        assert list(manifest.files) == [path.name]
        assert digest.size == path.stat().st_size
        assert (digest.algorithm, digest.hexdigest) == ("xxh3_128", xxhash.xxh3_128(path.read_bytes()).hexdigest())
        assert b'"format": "gpuherd/manifest-v2"' in manifest_path(path).read_bytes()
        assert torch.load(path, weights_only=True)["meta"]["run_id"] == RUN
    assert not [p for p in saved.iterdir() if p.name.endswith(".tmp")]


def _truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return rf"checkpoint {re.escape(str(path))} is truncated \({size // 2} of {size} bytes\)"


def _empty(path: Path) -> str:
    path.write_bytes(b"")
    return rf"checkpoint {re.escape(str(path))} is empty"


def _overwrite_middle(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2 - 8192)
        handle.write(os.urandom(16 * 1024))
    assert path.stat().st_size == size
    return rf"checkpoint {re.escape(str(path))}: checksum mismatch \(its bytes changed after it was saved\)"


@pytest.mark.parametrize("damage", [_truncate, _empty, _overwrite_middle], ids=["truncated", "empty", "overwritten"])
def test_resume_auto_skips_a_damaged_newest_checkpoint_with_one_warning(ckpt: Path, tmp_path: Path, capfd, damage):
    newest = ckpt / "step_0000006.pt"
    reason = damage(newest)
    capfd.readouterr()
    code, records = train(tmp_path, "training.resume=auto", "training.max_steps=8")
    assert code == 0
    assert steps_of(records) == [4, 5, 6, 7]  # from the newest valid checkpoint, step 4
    warnings = warnings_in(capfd.readouterr().err)
    assert len(warnings) == 1 and re.search(reason + ": skipped$", warnings[0]), warnings
    with pytest.raises(WorkerError, match="^" + reason) as info:  # named explicitly: refused, same words
        train(tmp_path, f"training.resume={newest}", "training.max_steps=8", status_name="explicit.jsonl")
    assert info.value.exit_code == ExitCode.USAGE


def _as_v1(path: Path) -> None:
    """Rewrite the checkpoint's manifest as the previous format wrote it: sha256 digests."""
    raw = json.loads(manifest_path(path).read_bytes())
    raw["format"] = "gpuherd/manifest-v1"
    raw["files"] = {name: {"bytes": entry["bytes"], "sha256": hashlib.sha256((path.parent / name).read_bytes()).hexdigest()}
                    for name, entry in raw["files"].items()}
    manifest_path(path).write_text(json.dumps(raw))


def test_a_checkpoint_with_a_sha256_manifest_of_the_previous_format_still_verifies(ckpt: Path, tmp_path: Path, capfd):
    newest = ckpt / "step_0000006.pt"
    _as_v1(newest)
    code, records = train(tmp_path, "training.resume=auto", "training.max_steps=8")
    assert code == 0 and steps_of(records) == [6, 7]
    assert not warnings_in(capfd.readouterr().err)
    reason = _overwrite_middle(newest)  # the old digest still catches changed bytes
    with pytest.raises(WorkerError, match="^" + reason) as info:
        train(tmp_path, f"training.resume={newest}", "training.max_steps=8", status_name="damaged.jsonl")
    assert info.value.exit_code == ExitCode.USAGE


def test_a_garbage_file_is_not_a_gpuherd_checkpoint(ckpt: Path, tmp_path: Path, capfd):
    garbage = ckpt / "step_0000008.pt"
    garbage.write_bytes(os.urandom(50_000))
    capfd.readouterr()
    code, records = train(tmp_path, "training.resume=auto", "training.max_steps=8")
    assert code == 0 and steps_of(records) == [6, 7]
    warnings = warnings_in(capfd.readouterr().err)
    assert len(warnings) == 1 and warnings[0].endswith(f"{garbage} is not a gpuherd checkpoint: skipped"), warnings
    assert "weights_only" not in "".join(warnings)


def test_resume_auto_refuses_when_no_checkpoint_is_usable(ckpt: Path, tmp_path: Path):
    for _, path in list_checkpoints(ckpt):
        _truncate(path)
    with pytest.raises(WorkerError, match=r"none of the 3 checkpoint\(s\) in .* can be resumed; the newest: "
                                          r"checkpoint .*step_0000006.pt is truncated") as info:
        train(tmp_path, "training.resume=auto", "training.max_steps=8")
    assert info.value.exit_code == ExitCode.USAGE


def _restart(tmp: Path, handed: Path, run_id: str) -> h.subprocess.CompletedProcess:
    """A restarted attempt of `run_id` as the supervisor starts it: GPUHERD_RESUME set."""
    spec = tmp / f"restart-{run_id}.json"
    port = h.free_port()
    spec.write_text(json.dumps({"tmp": str(tmp), "status_dir": str(tmp),
                                "runs": [{"name": "restart", "port": port, "overrides": ["training.max_steps=8"]}]}))
    env = h.worker_env(0, 1, port, TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="1",
                       GPUHERD_RESUME=str(handed))
    return h.spawn(["tests/worker/helpers.py", "train", str(spec)], [env], timeout=120)[0]


def test_a_restart_refuses_the_checkpoint_of_another_run_sharing_the_directory(tmp_path: Path):
    code, _ = train(tmp_path, "training.save_every=2", "training.max_steps=2", run_id="run-a")
    assert code == 0
    code, _ = train(tmp_path, "training.save_every=4", "training.max_steps=4", run_id="run-b",
                    status_name="b.jsonl")
    assert code == 0
    theirs = tmp_path / "ckpt" / "step_0000004.pt"
    res = _restart(tmp_path, theirs, "run-a")  # the supervisor saw a new checkpoint: run B's
    assert res.returncode == ExitCode.USAGE, res.stderr
    errors = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert errors == [f"CPU0:ERROR | checkpoint {theirs} was written by run run-b, not by this run (run-a): another "
                      f"run shares system.checkpoint_dir {tmp_path / 'ckpt'}; refusing to resume its weights (give "
                      "each run its own checkpoint_dir)"]
    assert "Traceback" not in res.stderr and "resumed from" not in res.stderr


def test_a_multi_node_restart_checks_the_run_id_global_rank_0_recorded(tmp_path: Path):
    """Nodes started without --run-id each name their own run; the job's checkpoints
    carry rank 0's id, and every rank judges a restart's checkpoint by that one."""
    def two_ranks(name: str, overrides: list[str], handed: str = "") -> list:
        port = h.free_port()
        spec = tmp_path / f"{name}.json"
        spec.write_text(json.dumps({"tmp": str(tmp_path), "status_dir": str(tmp_path),
                                    "runs": [{"name": name, "port": port, "overrides": overrides}]}))
        resume = {"GPUHERD_RESUME": handed, "TORCHELASTIC_RESTART_COUNT": "1"} if handed else {}
        envs = [h.worker_env(rank, 2, port, TORCHELASTIC_RUN_ID=f"job-node{rank}", **resume) for rank in (0, 1)]
        return h.spawn(["tests/worker/helpers.py", "train", str(spec)], envs, timeout=180)

    first = two_ranks("first", ["training.save_every=2", "training.max_steps=2"])
    assert [r.returncode for r in first] == [0, 0], first[1].stderr
    saved = tmp_path / "ckpt" / "step_0000002.pt"
    assert read_manifest(saved).run_id == "job-node0"
    again = two_ranks("again", ["training.max_steps=4"], handed=str(saved))
    assert [r.returncode for r in again] == [0, 0], again[1].stderr
    assert steps_of(h.read_status(tmp_path / "again-rank1.jsonl")) == [2, 3]


def test_a_restart_falls_back_to_an_older_checkpoint_of_its_own_run(ckpt: Path, tmp_path: Path, capfd, monkeypatch):
    newest = ckpt / "step_0000006.pt"
    reason = _overwrite_middle(newest)
    monkeypatch.setenv("GPUHERD_RESUME", str(newest))
    capfd.readouterr()
    code, records = train(tmp_path, f"training.resume={newest}", "training.max_steps=8")
    assert code == 0 and steps_of(records) == [4, 5, 6, 7]
    err = capfd.readouterr().err
    assert re.search(reason + ": skipped, looking for an older checkpoint of this run", err)
    assert f"resumed from {ckpt / 'step_0000004.pt'} at step 4" in err


# A real save that stalls while pickling: its temp file exists, named and locked, as in
# a save of a large model that is killed (or still running) midway.
STALLED_SAVE = """
import sys, time
from pathlib import Path
from worker.checkpoint_io import save_checkpoint_file

class Stall:
    def __reduce__(self):
        print("saving", file=sys.stderr, flush=True)
        time.sleep(600)

save_checkpoint_file({"meta": {"step": 8, "run_id": sys.argv[2]}, "stall": Stall()}, Path(sys.argv[1]))
"""


def _stalled_save(path: Path, run_id: str) -> h.Watched:
    proc = h.Watched(["-c", STALLED_SAVE, str(path), run_id], h.worker_env(0, 1, 0))
    proc.wait_for("saving")
    return proc


def test_temp_files_of_killed_saves_are_removed_at_start_but_never_a_live_one(ckpt: Path, tmp_path: Path, capfd):
    killed = _stalled_save(ckpt / "step_0000008.pt", RUN)
    live = _stalled_save(ckpt / "step_0000008.pt", "run-b")  # another run, saving right now
    try:
        killed.kill()
        dead_tmp, live_tmp = (next(ckpt.glob(f".step_0000008.pt.{run}.*.tmp")) for run in (RUN, "run-b"))
        assert dead_tmp.name.startswith(f".step_0000008.pt.{RUN}.{killed.proc.pid}.")  # says whose it is
        legacy = ckpt / "step_0000010.tmp"  # an older gpuherd's sharded temp directory
        legacy.mkdir()
        (legacy / "__0_0.distcp").write_bytes(b"x" * 1000)
        capfd.readouterr()
        code, records = train(tmp_path, "training.resume=auto", "training.max_steps=7")
        assert code == 0 and steps_of(records) == [6]
        assert not dead_tmp.exists() and not legacy.exists()
        assert live_tmp.exists()  # a live writer's save is never touched
        removed = [line for line in capfd.readouterr().err.splitlines() if "interrupted checkpoint saves" in line]
        assert len(removed) == 1 and dead_tmp.name in removed[0] and legacy.name in removed[0]
        assert live_tmp.name not in removed[0]
    finally:
        live.kill()
    from gpuherd.checkpoint_layout import remove_orphans

    assert [path for path, _ in remove_orphans(ckpt)] == [live_tmp]  # once its writer is gone


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, 128 * 1024))


def test_a_full_disk_while_saving_is_one_line_and_exit_code_storage(tmp_path: Path):
    port = h.free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "status_dir": str(tmp_path),
                                "runs": [{"name": "full", "port": port, "overrides": ["training.max_steps=2"]}]}))
    proc = h.Watched(["tests/worker/helpers.py", "train", str(spec)], h.worker_env(0, 1, port),
                     preexec_fn=_limit_file_size)
    code = proc.finish(timeout=120)
    assert code == ExitCode.STORAGE, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, proc.stderr
    assert re.fullmatch(rf"CPU0:ERROR \| cannot save checkpoint to {re.escape(str(tmp_path / 'ckpt'))}: file too "
                        r"large for this process's file-size limit \(ulimit -f\) or the filesystem "
                        r"\(needs ~\d+\.\d (KB|MB), \d+\.\d (MB|GB|TB) free\)", errors[0]), errors[0]
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "ckpt").iterdir()) == []  # no half-written checkpoint, no temp file


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoints_follow_the_umask(tmp_path: Path, umask: int, mode: int):
    from worker.checkpoint_io import publish_dir, save_checkpoint_file

    meta = {"step": 1, "run_id": RUN}
    old = os.umask(umask)
    try:
        save_checkpoint_file({"meta": meta, "w": torch.zeros(4)}, tmp_path / "step_0000001.pt")
        publish_dir(tmp_path / "step_0000002", dict(meta, step=2), 0,
                    lambda tmp: torch.save({"w": torch.ones(4)}, tmp / "__0_0.distcp"))
    finally:
        os.umask(old)
    files = [tmp_path / "step_0000001.pt", tmp_path / "step_0000001.pt.manifest.json",
             *(tmp_path / "step_0000002").iterdir()]
    assert {p.name for p in (tmp_path / "step_0000002").iterdir()} == {"__0_0.distcp", "meta.pt", "manifest.json"}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}
    manifest = read_manifest(tmp_path / "step_0000002")
    assert sorted(manifest.files) == ["__0_0.distcp", "meta.pt"] and manifest.step == 2


def test_a_checkpoint_file_is_written_without_zip_crc32s_and_reads_back_the_same(tmp_path: Path):
    """The manifest's sha256 vouches for the bytes: the zip records' own CRC32s (about as much CPU
    as the rest of the save) are left out, torch.load reads the file as any other, and torch's
    global switch is as it was afterwards."""
    import zipfile

    from worker.checkpoint_io import atomic_torch_save

    state = {"w": torch.randn(64, 64), "step": 3}
    before = torch.serialization.get_crc32_options()
    digest = atomic_torch_save(state, tmp_path / "c.pt")
    assert torch.serialization.get_crc32_options() == before
    assert {info.CRC for info in zipfile.ZipFile(tmp_path / "c.pt").infolist()} == {0}
    back = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    assert digest.size == (tmp_path / "c.pt").stat().st_size

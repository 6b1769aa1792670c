"""A SLURM job started again continues its run (supervisor/requeue.py): which start it is,
where its logs go, what it remembers of the earlier starts, and which checkpoint it resumes.
Files only, no processes (tests/supervisor/test_resubmission.py runs the supervisor)."""

from __future__ import annotations

from pathlib import Path

import orjson

from supervisor import requeue
from supervisor.restarts import RunCheckpoints


def _saved(path: Path, step: int, rank: int = 0) -> bytes:
    return orjson.dumps({"type": "checkpoint", "rank": rank, "time": 1.0, "step": step, "path": str(path)})


def test_each_start_logs_in_its_own_directory(tmp_path):
    assert requeue.log_dir(tmp_path, 0) == tmp_path
    assert requeue.log_dir(tmp_path, 2) == tmp_path / "requeue-2"


def test_resume_point_is_the_newest_checkpoint_the_run_saved_still_as_saved(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    older, newer, foreign = ckpt / "step_0000004.pt", ckpt / "step_0000008.pt", ckpt / "step_0000009.pt"
    for path in (older, newer, foreign):
        path.write_bytes(path.name.encode())
    lines = [_saved(older, 4), orjson.dumps({"type": "step", "rank": 0, "step": 5}), _saved(newer, 8),
             _saved(newer, 8, rank=1), b'{"type": "checkpoint", "rank": 0, "st']  # cut by a SIGKILL mid-write
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert requeue.replay_checkpoints(tmp_path, RunCheckpoints()) == newer  # never another run's step 9
    newer.unlink()  # pruned meanwhile: the next newest of this run
    assert requeue.replay_checkpoints(tmp_path, RunCheckpoints()) == older


def test_no_metrics_means_no_resume_point(tmp_path):
    assert requeue.replay_checkpoints(tmp_path, RunCheckpoints()) is None


def test_earlier_starts_accumulate_from_each_summary(tmp_path):
    assert requeue.earlier_starts(tmp_path, 1) == []  # the first start died before writing a summary
    first = {"started_at": "t0", "duration_s": 9.5, "exit_code": 143, "outcome": "terminated", "final_save": "saved",
             "root_cause": {"message": "stopped by SLURM: requeue"}, "slurm_restart_count": 0, "requeues": []}
    (tmp_path / "summary.json").write_bytes(orjson.dumps(first))
    starts = requeue.earlier_starts(tmp_path, 1)
    assert starts == [{"requeue": 0, "slurm_restart_count": 0, "started_at": "t0", "duration_s": 9.5,
                       "exit_code": 143, "outcome": "terminated", "final_save": "saved", "slurm_job_id": None,
                       "root_cause": "stopped by SLURM: requeue"}]
    second = {"started_at": "t1", "duration_s": 3.0, "exit_code": 143, "outcome": "terminated", "final_save": "saved",
              "root_cause": None, "slurm_restart_count": 1, "requeues": starts, "start": 1, "slurm_job_id": "7"}
    (tmp_path / "summary.json").write_bytes(orjson.dumps(second))
    starts = requeue.earlier_starts(tmp_path, 2)
    assert [s["requeue"] for s in starts] == [0, 1] and starts[1]["slurm_job_id"] == "7"
    third = {**second, "start": 2, "slurm_restart_count": 0, "slurm_job_id": "8", "requeues": starts}  # resubmitted
    (tmp_path / "summary.json").write_bytes(orjson.dumps(third))
    starts = requeue.earlier_starts(tmp_path, 3)
    assert [(s["requeue"], s["slurm_restart_count"], s["slurm_job_id"]) for s in starts] == \
        [(0, 0, None), (1, 1, "7"), (2, 0, "8")]
    (tmp_path / "summary.json").write_bytes(b"{not json")
    assert requeue.earlier_starts(tmp_path, 4) == []


def test_next_start_follows_the_newest_start_that_logged(tmp_path):
    assert requeue.next_start(tmp_path) == 1  # the directory exists: the first start was there
    (tmp_path / "requeue-1").mkdir()
    (tmp_path / "requeue-3").mkdir()  # start 2 died before logging: its number is not reused past 3
    (tmp_path / "requeue-x").mkdir()
    (tmp_path / "requeue-7.log").write_text("")  # a file, not a start
    assert requeue.next_start(tmp_path) == 4

"""A requeued SLURM job continues its run (`--slurm`, SLURM_RESTART_COUNT >= 1).

`scontrol requeue`, a preemption with PreemptMode=REQUEUE and SLURM's own requeue after a
node failure start the job again under the same job id, so under the same run id
(`slurm-<jobid>`) and run directory. That start is the same run going on, not a clash:

- the run directory is reused; this start's worker logs go to `requeue-<N>/` (its restarts
  to `requeue-<N>/attempt-<k>/`), so nothing an earlier start wrote is overwritten;
- `summary.json` is rewritten at the end with every earlier start in `requeues` (each one's
  outcome, exit code, root cause and final save, as its own summary said), and
  `metrics.jsonl` gets a `requeue` record;
- the workers resume from the newest checkpoint this run reported saving (the `checkpoint`
  records in its `metrics.jsonl`, still as they were saved: restarts.RunCheckpoints),
  handed to them as on a restart, whatever `--resume` says. Without one, the workers start
  as configured (`--resume auto`, a path, or step 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from supervisor.restarts import RunCheckpoints

SUMMARY_KEYS = ("started_at", "duration_s", "exit_code", "outcome", "final_save")


def log_dir(run_dir: Path, requeue: int) -> Path:
    """Where start `requeue` (0: the first) writes its worker logs."""
    return run_dir / f"requeue-{requeue}" if requeue else run_dir


def earlier_starts(run_dir: Path, requeue: int) -> list[dict[str, Any]]:
    """What the earlier starts of this job left in `summary.json`, oldest first; a start that
    died before writing one (SIGKILLed with its node) is not there."""
    try:
        previous = orjson.loads((run_dir / "summary.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    if not isinstance(previous, dict):
        return []
    earlier = [s for s in previous.get("requeues") or [] if isinstance(s, dict)]
    cause = previous.get("root_cause") if isinstance(previous.get("root_cause"), dict) else None
    earlier.append({"requeue": previous.get("slurm_restart_count", requeue - 1),
                    **{key: previous.get(key) for key in SUMMARY_KEYS},
                    "root_cause": cause.get("message") if cause else None})
    return earlier


def replay_checkpoints(run_dir: Path, checkpoints: RunCheckpoints) -> Path | None:
    """Feed the `checkpoint` records of the run's `metrics.jsonl` to `checkpoints`; the newest
    one still as it was saved, or None."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return None
    for line in lines:
        if b'"checkpoint"' not in line:
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:  # the last line of a start that was killed mid-write
            continue
        if isinstance(record, dict):
            checkpoints.observe(record)
    return checkpoints.newest_of_this_run()

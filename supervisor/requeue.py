"""A SLURM job that starts again continues its run (`--slurm`, the run directory exists).

Two ways bring a job back to a run it already started:
- a requeue (`scontrol requeue`, a preemption with PreemptMode=REQUEUE, SLURM's own requeue
  after a node failure) starts it again under the same job id, so under the same run id
  (`slurm-<jobid>`, or the --run-id its script gives), with SLURM_RESTART_COUNT + 1;
- a resubmission (`sbatch` of the same script again, e.g. after the time limit, or a chain of
  `--dependency=afterany` jobs) has a new job id; its script's --run-id (`gpuherd sbatch`
  writes one into every script) names the run it continues.
Either start is the same run going on, not a clash:

- the run directory is reused; start N's worker logs go to `requeue-<N>/` (its restarts to
  `requeue-<N>/attempt-<k>/`), N counting the starts of this run (1: the second), so nothing
  an earlier start wrote is overwritten;
- `summary.json` is rewritten at the end with every earlier start in `requeues` (each one's
  outcome, exit code, root cause and final save, as its own summary said), and
  `metrics.jsonl` gets a `requeue` record;
- the workers resume from the newest checkpoint this run reported saving (the `checkpoint`
  records in its `metrics.jsonl`, still as they were saved: restarts.RunCheckpoints),
  handed to them as on a restart, whatever `--resume` says. Without one, the workers start
  as configured (`--resume auto`, a path, or step 0).
A start holds the run directory's lock (run_dir.hold) for its life: a second job running
the same script at the same time is refused, never mixed into the run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson

from gpuherd.config import Config
from gpuherd.errors import ConfigError
from gpuherd.status_records import Refusal, decode
from supervisor.restarts import RunCheckpoints

SUMMARY_KEYS = ("started_at", "duration_s", "exit_code", "outcome", "final_save", "slurm_job_id")
START_DIR = re.compile(r"requeue-([0-9]+)")


def log_dir(run_dir: Path, start: int) -> Path:
    """Where start `start` (0: the first) writes its worker logs."""
    return run_dir / f"requeue-{start}" if start else run_dir


def next_start(run_dir: Path) -> int:
    """The number of a start of the run whose directory exists: one past the newest start that
    made its log directory (a start SIGKILLed before that leaves no trace, and its number is
    taken again)."""
    taken = [int(m.group(1)) for p in run_dir.iterdir() if p.is_dir() and (m := START_DIR.fullmatch(p.name))]
    return max(taken, default=0) + 1


def changed_model(run_dir: Path, cfg: Config) -> str | None:
    """What a start of the run changes in the model its checkpoints hold (the model section
    and the tokenizer, which sizes the embeddings), against the config its first start wrote:
    "model.dim 64 -> 128", or None. Such a start could only fail in its workers, after its
    files were rewritten; an unreadable config.json leaves the judgement to them."""
    try:
        before = Config.load(run_dir / "config.json").to_dict()
    except ConfigError:
        return None
    now = cfg.to_dict()
    keys = [("model", k) for k in now["model"]] + [("data", "tokenizer")]
    diff = [f"{a}.{b} {before[a].get(b)} -> {now[a][b]}" for a, b in keys if before[a].get(b) != now[a][b]]
    return ", ".join(diff) or None


def earlier_starts(run_dir: Path, start: int) -> list[dict[str, Any]]:
    """What the earlier starts of this run left in `summary.json`, oldest first; a start that
    died before writing one (SIGKILLed with its node) is not there."""
    try:
        previous = orjson.loads((run_dir / "summary.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    if not isinstance(previous, dict):
        return []
    earlier = [s for s in previous.get("requeues") or [] if isinstance(s, dict)]
    cause = previous.get("root_cause") if isinstance(previous.get("root_cause"), dict) else None
    number = previous.get("start", previous.get("slurm_restart_count", start - 1))  # "start": since resubmission
    earlier.append({"requeue": number, "slurm_restart_count": previous.get("slurm_restart_count"),
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
        record = decode(line, supervisor=True)
        if not isinstance(record, Refusal):  # a refusal: the last line of a start killed mid-write
            checkpoints.observe(record)
    return checkpoints.newest_of_this_run()

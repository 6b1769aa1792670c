"""What periodic saves cost a real multi-rank run, read from its step records: the 2-rank
DDP run of the built-in trainer under `gpuherd` (gloo, CPU), a save every SAVE_EVERY steps,
blocking or async, and the trainer's own account of each save (its `checkpoint_write`
`accounted` records, worker/save_cost.py) beside it.

The loss of one save, from rank 0's records (rank 0 writes; the other rank waits for it at
every all-reduce): the window from the save's `phase checkpoint` record to the first step
record after the save was published (a blocking save: to its publication; a write still in
flight when the next save begins: to that save, which waits for it), minus the steps
recorded in it at the typical step before it (the median of the last QUIET step intervals
before the save that lie outside every window, the first two steps left out; a trailing
median, as the load of a shared machine drifts; none yet: the steps count as free):

    loss = (window end - save start) - (steps in the window) x median quiet interval

These are the trainer's own windows and typical step (worker/save_cost.py), read off the
records instead of its clock: its marks are the times those records carry, so the two differ
only where a step ends between a write's `checkpoint` record and the loop seeing it ended.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import orjson

from bench.launchers import kill_tree, worker_env

SAVE_EVERY = 6
WARMUP = 2  # the first steps' intervals (allocation, first all-reduce) are nobody's typical step
QUIET = 32


def run_ddp(work: Path, model: list[str], steps: int, mode: str, cap: float = 900) -> list[dict]:
    """One 2-rank CPU run; its metrics.jsonl records (empty: it failed)."""
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "r", "--nproc", "2",
           "--spares", "0", "--set", "system.device=cpu", "--set", f"system.run_root={work / 'logs'}",
           "--set", f"system.checkpoint_dir={work / 'ckpt'}"]
    for item in [*model, "data.dataset=dummy", f"training.max_steps={steps}", f"training.save_every={SAVE_EVERY}",
                 "training.eval_every=0", "training.log_every=1", "training.keep_last=2",
                 f"training.async_save={'true' if mode == 'async' else 'false'}"]:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        if proc.wait(timeout=cap) != 0:
            return []
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return []
    out = []
    for line in (work / "logs" / "r" / "metrics.jsonl").read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out


def save_losses(records: list[dict], rank: int = 0) -> dict:
    """Per periodic save of `rank`: the loss read from its step records, the trainer's own
    account of it (`cost_s`) and its write's CPU seconds (`write_cpu_s`), and the typical step."""
    times = {r["step"]: r["time"] for r in records if r.get("type") == "step" and r.get("rank") == rank}
    published = {r["step"]: r["time"] for r in records if r.get("type") == "checkpoint" and r.get("rank") == rank}
    write_cpu = {r["step"]: r.get("write_cpu_s") for r in records if r.get("type") == "checkpoint" and r.get("rank") == rank}
    blocking = {r["step"] for r in records if r.get("type") == "checkpoint" and r.get("rank") == rank
                and r.get("mode") == "blocking"}
    started = sorted(r["time"] for r in records
                     if r.get("type") == "phase" and r.get("name") == "checkpoint" and r.get("rank") == rank)
    accounted = {r["step"]: r["cost_s"] for r in records
                 if r.get("type") == "checkpoint_write" and r.get("state") == "accounted" and r.get("rank") == rank}
    last = max(times)
    windows = []  # (step, start, end, the step records in it)
    for step, when in sorted(published.items()):
        before = step - 1  # the step record right before the save of step `step` (records count from 0)
        start = min((t for t in started if t > times.get(before, float("inf"))), default=None)
        if start is None or step > last:
            continue
        if step in blocking:  # written while the loop waited
            windows.append((step, start, when, []))
            continue
        end = min((t for t in times.values() if t > when), default=None)
        following = min((t for t in started if t > start), default=None)
        if following is not None and (end is None or following < end):
            end = following  # the next save waits for this write: that wait is the next save's own
        if end is not None:
            windows.append((step, start, end, [k for k, t in times.items() if start < t <= end]))
    inside = {k for *_, steps in windows for k in steps} | {step for step, *_ in windows}
    quiet = {k: times[k] - times[k - 1] for k in sorted(times) if k - 1 in times and k > WARMUP and k not in inside}

    def typical(before: int) -> float:
        recent = [v for k, v in quiet.items() if k <= before][-QUIET:]
        return statistics.median(recent) if recent else 0.0  # the trainer cannot know later steps either

    rows = [{"step": step, "records_s": (end - start) - len(steps) * typical(step - 1),
             "trainer_s": accounted.get(step), "write_cpu_s": write_cpu.get(step)} for step, start, end, steps in windows]
    return {"typical_step_s": statistics.median(quiet.values()), "saves": rows}

"""Shared by the end-to-end runs: reading a run's files while it runs."""

from __future__ import annotations

import orjson
import psutil


def records(run_dir, kind: str) -> list[dict]:
    """Every `kind` record of the run's metrics.jsonl so far (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line being written right now
        if record.get("type") == kind:
            out.append(record)
    return out


def cut_short(run_dirs, resumed: int) -> set[int]:
    """The ranks that were still in step `resumed - 1`'s all-reduce when a peer died while others
    completed it: gloo's ring hands the sum to some ranks first, and the rebuilt group goes on from
    the furthest rank's step, so these ranks never logged that step. Each one's `lost_peer` record
    says so (its `step` counts completed steps)."""
    return {r["rank"] for d in run_dirs for r in records(d, "live")
            if r.get("event") == "lost_peer" and r.get("step") == resumed - 1}


def every_spare(supervisor_pid: int) -> list[psutil.Process]:
    """The pool's processes, oldest first: its spare source and the spares it forked. Every one
    carries GPUHERD_SPARE=1 in its initial environment (a promoted one too: `used` sets apart)."""
    marked = []
    for p in psutil.Process(supervisor_pid).children():
        try:
            if p.environ().get("GPUHERD_SPARE") == "1":
                marked.append(p)
        except psutil.Error:
            continue
    return sorted(marked, key=lambda p: p.create_time())


def forked_spares(supervisor_pid: int) -> list[psutil.Process]:
    """The warm spares the pool's spare source forked, oldest first (the source is started first);
    the pool hands a lost rank a fork before the source (supervisor/processes/spares.py)."""
    return every_spare(supervisor_pid)[1:]


def next_spare(supervisor_pid: int, timeout: float = 240) -> psutil.Process:
    """The spare the next lost rank goes to: the source's first fork (it forks once warm)."""
    from tests.supervisor.helpers import wait_for

    found: list[psutil.Process] = []
    assert wait_for(lambda: bool(found.extend(forked_spares(supervisor_pid)) or found), timeout=timeout,
                    interval=0.05), "no warm spare forked by the spare source"
    return found[0]


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie, reaped or not, is not)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return alive

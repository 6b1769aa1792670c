"""Running the parts: each in a process session of its own, under its limit and the budget left,
its output appended to one log; a part that fails, times out or dies is said and the next runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson
import psutil

from bench.acceptance.plan import LAST_START_S, Part
from bench.launchers import ROOT, tree_pids, worker_env


@dataclass
class PartResult:
    part: Part
    status: str  # passed | failed | timed out | skipped | not run
    seconds: float = 0.0
    limit_s: float = 0.0
    detail: str = ""  # a skip's reason, a failure's checks, why it was not run
    outcome: dict | None = None  # the part's own record (bench/acceptance/outcome.py)

    def to_json(self) -> dict:
        return {"name": self.part.name, "title": self.part.title, "status": self.status,
                "seconds": round(self.seconds, 1), "limit_s": self.limit_s, "detail": self.detail,
                "outcome": self.outcome}


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the part and everything below it (a gpuherd run tears its workers down), then
    SIGKILL what is left after `grace` seconds: the GPU must be free for the next part."""
    pids = tree_pids(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def run_part(part: Part, gpu: bool, left_s: float, work: Path, log: IO[bytes]) -> PartResult:
    """One part under min(its limit, the budget left)."""
    if not gpu and part.gpu_only:
        return PartResult(part, "skipped", detail=f"no CUDA GPU here: {part.gpu_only}")
    if left_s < LAST_START_S:
        return PartResult(part, "not run", detail=f"the budget ran out ({left_s:.0f} s left)")
    limit = min(part.limit(gpu), left_s)
    result = work / f"{part.name}.json"
    cmd = part.command(sys.executable, "cuda" if gpu else "cpu", str(result))
    log.write(f"\n===== {part.name}: {part.title} (limit {limit:.0f} s)\n===== {' '.join(cmd)}\n".encode())
    log.flush()
    print(f"acceptance: {part.name} (limit {limit:.0f} s) ...", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout=limit)
        status = "passed" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        stop_tree(proc)
        code, status = None, "timed out"
    seconds = time.monotonic() - started
    outcome = orjson.loads(result.read_bytes()) if result.exists() else None
    failures = (outcome or {}).get("failures") or []
    detail = "; ".join(failures) if failures else (
        f"after {limit:.0f} s" if status == "timed out" else "" if code == 0 else f"exit {code}, no record")
    log.write(f"===== {part.name}: {status} in {seconds:.1f} s{': ' + detail if detail else ''}\n".encode())
    log.flush()
    print(f"acceptance: {part.name}: {status} in {seconds:.0f} s{': ' + detail if detail else ''}", flush=True)
    return PartResult(part, status, seconds, limit, detail, outcome)

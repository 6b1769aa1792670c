"""One run as `top` shows it: per-rank progress and health, the run's header numbers.

Built from the records `RunFiles` reads; `verdicts()` judges each rank:
failed (its exit in summary.json, or an `error` record), stopped (its process is
in state T: SIGSTOP, a debugger), silent (no status record for a while during
training), slow (a straggler: behind the others, or a step time well above theirs).
Process states are read from /proc via psutil, which never disturbs the worker.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from gpuherd.status_records import Done, Error, Gpu, Host, Phase, Ready, Record, Restart, Step
from supervisor.views.events import Event, EventLog, error_line
from supervisor.views.goodput_panel import GoodputTrack
from supervisor.views.report_data import tokens_per_step
from supervisor.views.run_files import RunFiles

SILENT_AFTER_S = 15.0  # workers send a record at least every 5 s while training: 3 missed
BUSY_PHASES = frozenset({"init", "rendezvous", "compile", "checkpoint", "eval"})  # long silences are normal here
SLOW_FACTOR = 1.5  # step time this many times the other ranks' median: a straggler
BEHIND_STEPS = 2  # this many steps behind the leading rank: a straggler
ABANDONED_AFTER_S = 30.0  # no worker alive and no file written for this long, yet no summary.json


@dataclass
class RankView:
    rank: int
    device: str = "?"
    pid: int | None = None
    phase: str | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time: float | None = None  # seconds per optimizer step, pauses excluded
    last_record: float | None = None  # unix time of its newest status record
    done: bool = False
    error: str | None = None
    gpu: Gpu | None = None  # newest GPU sample of its device
    host: Host | None = None  # newest host sample (CPU %, RSS) of its process


@dataclass(frozen=True)
class RankVerdict:
    level: str  # ok | done | ended | slow | silent | stopped | failed
    reason: str = ""

    @property
    def bad(self) -> bool:
        return self.level in ("slow", "silent", "stopped", "failed")


@dataclass
class RunState:
    files: RunFiles
    ranks: dict[int, RankView] = field(default_factory=dict)
    restarts: int = 0
    log: EventLog = field(default_factory=EventLog)  # the run's events, read once each
    _warned: int = 0  # how many of files.warnings are in `log`
    goodput: GoodputTrack = field(default_factory=GoodputTrack)

    def refresh(self) -> None:
        for record in self.files.poll_each():
            self._apply(record)
            self.log.add(record)
            self.goodput.observe(record)
        self.log.add_warnings(self.files.warnings[self._warned:])
        self._warned = len(self.files.warnings)
        for rank, device in self.files.devices.items():
            self._rank(rank).device = device

    def _rank(self, rank: int) -> RankView:
        if rank not in self.ranks:
            self.ranks[rank] = RankView(rank)
        return self.ranks[rank]

    def _apply(self, r: Record) -> None:
        if isinstance(r, Restart):
            self.restarts = max(self.restarts, r.attempt or 0)
            for view in self.ranks.values():  # a new attempt: old errors and done flags are history
                view.done, view.error = False, None
                view.phase = None if view.phase == "done" else view.phase
            return
        if r.rank is None:
            return
        view = self._rank(r.rank)
        match r:
            case Gpu():
                view.gpu = r
            case Host():
                view.host, view.pid = r, r.pid or view.pid
            case _:
                self._status(view, r)

    def _status(self, view: RankView, r: Record) -> None:
        view.last_record = r.time if r.time is not None else view.last_record
        match r:
            case Ready():
                view.pid = r.pid or view.pid
            case Phase():
                view.phase = r.name
            case Step():
                view.step = r.step if r.step is not None else view.step
                view.max_steps = r.max_steps if r.max_steps is not None else view.max_steps
                if r.loss is not None:
                    view.loss, view.tokens_per_s, view.mfu = r.loss, r.tokens_per_s, r.mfu
                    view.step_time = self._step_time(view.tokens_per_s)
            case Done():
                # A finished rank's last phase is often its final save's `checkpoint` (no phase
                # record follows it): left standing, it reads as if the rank were still saving.
                view.done, view.step, view.phase = True, r.step if r.step is not None else view.step, "done"
            case Error():
                view.error = error_line(r)

    def _step_time(self, tokens_per_s: Any) -> float | None:
        """tokens per optimizer step (from the run's config) / tokens/s: eval and
        checkpoint pauses are already left out of the worker's tokens/s."""
        per_step = tokens_per_step(self.files.config or {})
        if not per_step or not isinstance(tokens_per_s, (int, float)) or tokens_per_s <= 0:
            return None
        return per_step / tokens_per_s

    # ------------------------------------------------------------------ judging

    @property
    def finished(self) -> bool:
        return self.files.summary is not None

    def verdicts(self, now: float | None = None) -> dict[int, RankVerdict]:
        now = time.time() if now is None else now
        peers = _Peers(self.ranks.values())  # once a frame: judging N ranks stays O(N log N)
        return {rank: self._verdict(view, now, peers) for rank, view in sorted(self.ranks.items())}

    def _verdict(self, view: RankView, now: float, peers: _Peers) -> RankVerdict:
        ended = self._ended(view)
        if ended is not None:
            return ended
        if view.error:
            return RankVerdict("failed", view.error)
        if view.done:
            return RankVerdict("done")
        if not self.finished and _stopped(view.pid, view.last_record):
            return RankVerdict("stopped", f"pid {view.pid} stopped (SIGSTOP or a debugger)")
        age = None if view.last_record is None else now - view.last_record
        if not self.finished and age is not None and age >= SILENT_AFTER_S and view.phase not in BUSY_PHASES:
            return RankVerdict("silent", f"no heartbeat for {age:.0f} s (last: step {view.step}, phase {view.phase})")
        return _straggler(view, peers) or RankVerdict("ok")

    def _ended(self, view: RankView) -> RankVerdict | None:
        """How summary.json says this rank ended: the root cause's rank failed, the
        supervisor stopped the others; None while the run goes on."""
        summary = self.files.summary
        if summary is None:
            return None
        cause = summary.get("root_cause") or {}
        if cause.get("rank") == view.rank:
            return RankVerdict("failed", str(cause.get("message", "failed")))
        for worker in summary.get("workers", []):
            if worker.get("rank") == view.rank:
                if worker.get("role") == "first-failure":
                    return RankVerdict("failed", str(worker.get("ended")))
                if worker.get("role") in ("victim", "interrupted"):
                    return RankVerdict("ended", f"stopped by the supervisor ({worker.get('ended')})")
        return None

    # ------------------------------------------------------------------ header

    def events(self) -> list[Event]:
        return self.log.events()

    def elapsed(self, now: float | None = None) -> float:
        summary = self.files.summary
        if summary and isinstance(summary.get("duration_s"), (int, float)):
            return float(summary["duration_s"])
        return (time.time() if now is None else now) - self.files.started()

    def eta(self) -> float | None:
        """The slowest rank's remaining steps at its current step time."""
        left = [(v.max_steps - v.step - 1) * v.step_time for v in self.ranks.values()
                if not v.done and None not in (v.step, v.max_steps, v.step_time)]
        return max(left) if left and not self.finished else None

    def abandoned(self, now: float | None = None) -> bool:
        """No summary.json, no worker process left and nothing written for a while:
        the supervisor itself died (SIGKILL, the machine), nobody will finish the files."""
        if self.finished:
            return False
        now = time.time() if now is None else now
        if any(_alive(v.pid) for v in self.ranks.values()):
            return False
        newest = max((p.stat().st_mtime for p in self.files.run_dir.iterdir() if p.is_file()), default=0.0)
        return now - newest > ABANDONED_AFTER_S

    def outcome(self, now: float | None = None) -> str:
        summary = self.files.summary
        if summary is None:
            return "ended without summary.json (was the supervisor killed?)" if self.abandoned(now) else "running"
        code = summary.get("exit_code")
        if code == 0:
            return "finished: success"
        if code is None:  # summary.json is there (the run ended), its exit code unreadable or absent
            return "ended: summary.json does not say how"
        cause = (summary.get("root_cause") or {}).get("message") or summary.get("outcome")
        return f"FAILED with exit code {code}: {cause}"


class _Peers:
    """Every rank's step and step time, sorted once: "the other ranks" of each rank in O(log N)."""

    def __init__(self, views: Iterable[RankView]) -> None:
        views = list(views)
        self.steps = sorted(v.step for v in views if v.step is not None)
        self.times = sorted(v.step_time for v in views if v.step_time)

    def lead(self, view: RankView) -> int | None:
        """The leading step among the other ranks."""
        steps = self.steps
        if view.step is not None and steps and steps[-1] == view.step and (len(steps) < 2 or steps[-2] < view.step):
            return steps[-2] if len(steps) > 1 else None  # this rank alone leads: the next one counts
        return steps[-1] if steps else None

    def median(self, view: RankView) -> float | None:
        """The median step time of the other ranks."""
        times = self.times
        if not view.step_time:
            return statistics.median(times) if times else None
        skip = bisect.bisect_left(times, view.step_time)  # this rank's own entry is left out
        n = len(times) - 1
        if n <= 0:
            return None
        at = lambda k: times[k] if k < skip else times[k + 1]  # noqa: E731 - the k-th of the others
        return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _straggler(view: RankView, peers: _Peers) -> RankVerdict | None:
    lead = peers.lead(view)
    if view.step is not None and lead is not None and lead - view.step >= BEHIND_STEPS:
        return RankVerdict("slow", f"{lead - view.step} steps behind the leading rank")
    median = peers.median(view)
    if view.step_time and median and view.step_time >= SLOW_FACTOR * median:
        return RankVerdict("slow", f"step time {view.step_time:.2f} s vs {median:.2f} s on the other ranks")
    return None


def _alive(pid: int | None) -> bool:
    try:
        return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stopped(pid: int | None, since: float | None) -> bool:
    """The worker's process is in state T (stopped). A pid newer than the rank's
    records belongs to some other process: not ours to judge."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if since is not None and proc.create_time() > since + 1:
            return False
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False

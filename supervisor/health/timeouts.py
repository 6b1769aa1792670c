"""Hang timeouts per phase, learned from the run itself (docs/design/hangs.md).

A fixed timeout is either slow (a 60 s default finds a stuck 0.2 s step after a
minute) or wrong (a 10 s one kills a healthy 30 s checkpoint). Instead, for each
timed phase (step, eval, checkpoint):

    before warm-up    the initial allowance: learned values an earlier attempt (or a run
                      with the same settings, on --resume) left in hang_timeouts.json,
                      else the preset's step default / the startup allowance
    after warm-up     max(floor, factor x p99 of the durations observed)

Warm-up is `WARMUP[phase]` observations. Durations come from the ranks' `alive`
records only (`took`: the longest of each phase since the previous record, so the p99 is
one of per-second maxima: it errs long, the safe side for a timeout). A script without
liveness records keeps its initial allowance: the intervals between its step records
would hide an evaluation or a reshuffle that it has not yet done, and the first one
would be called a hang.
`system.hang_timeout` > 0 (`--hang-timeout S`) fixes the step allowance at S and
learns nothing. Startup phases (init, rendezvous, compile, before the first step) get
the startup allowance.
"""

from __future__ import annotations

import datetime
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import orjson

from gpuherd.files import write_bytes_atomic

TIMED = ("step", "eval", "checkpoint")
WARMUP = {"step": 5, "eval": 1, "checkpoint": 1}
HISTORY = 1000  # observations kept per phase
FILE_NAME = "hang_timeouts.json"
FILE_VERSION = 1


@dataclass(frozen=True)
class HangPolicy:
    """The config's side: preset step default, startup allowance, factor, floor, override."""

    step_default: float
    startup: float
    factor: float
    floor: float
    override: float = 0.0  # > 0: --hang-timeout, a fixed step allowance


class _Phase:
    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=HISTORY)
        self.seen = 0
        self._p99: float | None = None

    def observe(self, seconds: float, count: int) -> None:
        self.samples.append(seconds)
        self.seen += count
        self._p99 = None

    @property
    def p99(self) -> float:
        if self._p99 is None:
            ordered = sorted(self.samples)
            self._p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return self._p99


class LearnedTimeouts:
    def __init__(self, policy: HangPolicy, initial: dict[str, float] | None = None, fingerprint: str = "") -> None:
        self.policy = policy
        self.initial = {k: v for k, v in (initial or {}).items() if k in TIMED}
        self.fingerprint = fingerprint
        self._phases = {phase: _Phase() for phase in TIMED}

    def observe(self, phase: str, seconds: float, count: int = 1) -> None:
        if phase in self._phases and seconds >= 0 and count > 0:
            self._phases[phase].observe(seconds, count)

    def longest(self, phase: str) -> float | None:
        """The longest recent instance of `phase` seen (None: none timed yet)."""
        samples = self._phases[phase].samples if phase in self._phases else ()
        return max(samples, default=None)

    def warmed_up(self, phase: str) -> bool:
        return self._phases[phase].seen >= WARMUP[phase]

    def allowance(self, phase: str) -> float:
        """Seconds a rank may stay in one instance of `phase` (anything untimed: startup)."""
        p = self.policy
        if phase not in self._phases:
            return p.startup
        if phase == "step" and p.override > 0:
            return p.override
        if p.override <= 0 and self.warmed_up(phase):
            return max(p.floor, p.factor * self._phases[phase].p99)
        if phase in self.initial:
            return self.initial[phase]
        return p.step_default if phase == "step" else p.startup

    def explain(self, phase: str) -> str:
        """Where `allowance(phase)` comes from, for the verdict."""
        p = self.policy
        allowance = f"{phase} allowance {self.allowance(phase):.0f} s"
        if phase not in self._phases:
            return f"{allowance} (startup)"
        if phase == "step" and p.override > 0:
            return f"{allowance} (--hang-timeout)"
        if p.override <= 0 and self.warmed_up(phase):
            return f"{allowance} (learned: max({p.floor:g} s, {p.factor:g} x p99 {self._phases[phase].p99:.2f} s))"
        return f"{allowance} ({'learned earlier' if phase in self.initial else 'initial'}; warming up)"

    def learned(self) -> dict[str, float]:
        """The allowances worth handing on: phases past warm-up, else what was handed to us."""
        out = dict(self.initial)
        if self.policy.override <= 0:
            out.update({phase: self.allowance(phase) for phase in TIMED if self.warmed_up(phase)})
        return out

    def save(self, run_dir: Path) -> None:
        phases = {phase: {"timeout_s": round(seconds, 3),
                          "p99_s": round(self._phases[phase].p99, 4) if self._phases[phase].samples else None,
                          "observed": self._phases[phase].seen}
                  for phase, seconds in self.learned().items()}
        if not phases:
            return
        doc = {"version": FILE_VERSION, "fingerprint": self.fingerprint, "factor": self.policy.factor,
               "floor_s": self.policy.floor, "phases": phases,
               "updated": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        write_bytes_atomic(run_dir / FILE_NAME, orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


def read_learned(path: Path, fingerprint: str) -> dict[str, float] | None:
    """The timeouts a run left in `path`, if it trained the same thing (else None)."""
    try:
        doc = orjson.loads(path.read_bytes())
        if doc.get("version") != FILE_VERSION or doc.get("fingerprint") != fingerprint:
            return None
        return {phase: float(v["timeout_s"]) for phase, v in doc["phases"].items() if phase in TIMED}
    except (OSError, orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return None


def previous_learned(run_root: Path, fingerprint: str, exclude: Path) -> dict[str, float] | None:
    """On --resume: the newest run under `run_root` with the same settings that learned timeouts."""
    try:
        files = sorted(run_root.glob(f"*/{FILE_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for path in files:
        if path.parent != exclude:
            found = read_learned(path, fingerprint)
            if found:
                return found
    return None

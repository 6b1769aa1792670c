"""The recovery cases on one shared GPU: the built-in trainer's debug preset, 2 ranks on one CUDA
device (`system.shared_gpu_for_tests`, gloo), each case one `gpuherd` run checked from its own
files (summary.json, metrics.jsonl). In a rehearsal the same runs go to 2 CPU workers.

    python -m bench.acceptance.cases live|fsdp|sdc|shrink|async-save --device cuda|cpu --result FILE

- live: rank 1 SIGKILLed mid-run; the warm spare takes it, rank 0 keeps its process; the kill to
  rank 1's next step, and the first step after the rebuilt group against the median step (goal
  <= 1.3x, bench/bench_live_recovery.py's measure).
- fsdp: the same with training.strategy=fsdp: the lost shard comes from rank 0's copy of it.
- sdc: one bit flipped in rank 1's parameters at step 3 (GPUHERD_INJECT_BITFLIP): caught at that
  step, rank 1 named, healed without a restart.
- shrink: rank 1 SIGKILLed with no spare (--spares 0 --min-replicas 1): rank 0 goes on alone.
- async-save: periodic async saves: what each blocked the loop, and the background write.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

from bench.acceptance.outcome import Outcome, part_main
from bench.bench_live_recovery import first_step
from bench.launchers import kill_tree, worker_env

BASE = ["data.dataset=dummy", "data.tokenizer=byte", "training.log_every=1", "training.eval_every=0",
        "training.save_every=0", "training.warmup_steps=2"]
STEPS = {"cuda": 120, "cpu": 30}  # a run without a kill (sdc, async-save); GPU steps of the debug model take ms
UNTIL_STOPPED = {"cuda": 20000, "cpu": 400}  # with a kill: a bound (ms steps); stopped AFTER steps past it
AFTER = {"cuda": 40, "cpu": 10}  # steps of the rank that trains on after the kill, for the median after it
MIN_KILL_STEP = 10
SPARE_QUIET_S = 1.0  # a spare whose CPU time stood still this long waits on its stdin: its warm-up ended
FIRST_STEP_GOAL = 1.3


def command(run_id: str, device: str, overrides: list[str], *flags: str, nproc: int = 2, steps: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--skip-checks", "--run-id", run_id,
           "--nproc", str(nproc), *flags]
    # --force: a process some earlier part left on the GPU must not turn every case into "GPU busy"
    cmd += ["--force", "--set", "system.shared_gpu_for_tests=true"] if device == "cuda" else [
        "--set", "system.device=cpu"]
    for item in [*BASE, f"training.max_steps={steps or STEPS[device]}", *overrides]:
        cmd += ["--set", item]
    return cmd


class Run:
    """One gpuherd run in a directory of its own, its metrics.jsonl read as it grows. With a kill:
    rank 1 is SIGKILLed once the run is past MIN_KILL_STEP and (`spare`) the warm spare's warm-up
    ended, and the run is stopped (SIGTERM, exit 143) once the rank that trains on did `after`
    steps past the kill."""

    def __init__(self, work: Path, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.work, self.cmd, self.env = work, cmd, env or worker_env()
        self.run_dir = work / "logs" / cmd[cmd.index("--run-id") + 1]
        self.killed: float | None = None
        self.stopped = False
        self._seen: list[dict] = []
        self._offset = 0
        self._spare_cpu: tuple[int, float, float] | None = None  # pid, its CPU seconds, since when unchanged

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            with open(path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            self._seen += [orjson.loads(line) for line in complete.splitlines() if line.strip()]
        return self._seen

    def summary(self) -> dict:
        return orjson.loads((self.run_dir / "summary.json").read_bytes())

    def go(self, cap: float, kill: bool = False, spare: bool = True, after: int = 0) -> int:
        print(f"acceptance: {' '.join(self.cmd)}", flush=True)
        proc = subprocess.Popen(self.cmd, cwd=self.work, env=self.env, start_new_session=True)
        deadline = time.monotonic() + cap
        try:
            if kill:
                self._wait(proc, deadline, "a step past the start and a warm spare",
                           lambda: self._steps(0) >= MIN_KILL_STEP and (not spare or self._spare_warm(proc.pid)))
                victim = [r["pid"] for r in self.records() if r.get("type") == "ready" and r["rank"] == 1][-1]
                self.killed = time.time()
                os.kill(victim, signal.SIGKILL)
                self._wait(proc, deadline, f"{after} steps after the kill",
                           lambda: self._steps(1 if spare else 0, since=self.killed) >= after)
                self.stopped = True
                proc.send_signal(signal.SIGTERM)  # enough steps measured: a graceful stop ends the run
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                kill_tree(proc)

    def _wait(self, proc: subprocess.Popen, deadline: float, what: str, done) -> None:
        while not done():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run never got to {what} (exit {proc.poll()})")
            time.sleep(0.02)

    def _steps(self, rank: int, since: float = 0.0) -> int:
        return sum(1 for r in self.records() if r.get("type") == "step" and r["rank"] == rank and r["time"] > since)

    def _spare_warm(self, supervisor: int) -> bool:
        for child in psutil.Process(supervisor).children():
            try:
                if child.environ().get("GPUHERD_SPARE") != "1":
                    continue
                cpu = sum(child.cpu_times()[:2])
            except psutil.Error:
                continue
            now = time.monotonic()
            if self._spare_cpu is None or self._spare_cpu[:2] != (child.pid, cpu):
                self._spare_cpu = (child.pid, cpu, now)
            return now - self._spare_cpu[2] >= SPARE_QUIET_S
        return False

    def next_step_after_kill(self, rank: int = 1) -> float | None:
        """Seconds from the kill to `rank`'s first step record after it (a replacement's)."""
        after = [r["time"] for r in self.records() if r.get("type") == "step" and r["rank"] == rank
                 and self.killed is not None and r["time"] > self.killed]
        return min(after) - self.killed if after else None

    def ended_well(self, code: int) -> bool:
        return code == 0 or (self.stopped and code == 143)


def _recovered(run: Run, out: Outcome, code: int, action: str) -> dict | None:
    """The run's one recovery, checked: exit 0 (143: stopped once measured), nobody restarted, the lost
    rank taken over."""
    out.check(run.ended_well(code), f"the run ended with exit {code}")
    if not (run.run_dir / "summary.json").exists():
        out.check(False, "no summary.json")
        return None
    summary = run.summary()
    out.check(summary["restarts"] == 0, f"{summary['restarts']} restart(s) instead of a live recovery")
    recs = summary.get("recoveries") or []
    if not out.check(len(recs) == 1, f"{len(recs)} recoveries recorded, not 1"):
        return None
    rec = recs[0]
    out.check(rec.get("outcome") == "recovered" and rec.get("action", "replaced") == action,
              f"recovery {rec.get('action')} ended {rec.get('outcome')}")
    if run.stopped:
        out.note(f"{run.run_dir.name}: stopped (SIGTERM, exit {code}) once the steps after the kill were measured; "
                 f"rank 1 was killed at step {rec.get('step', '?')}")
    out.figure("recovery, gpuherd's account (summary.json `seconds`)", f"{rec.get('seconds', float('nan')):.2f} s")
    out.figure("completed steps trained again", str(rec.get("steps_redone")))
    return rec


def live(work: Path, device: str, out: Outcome, strategy: str = "ddp") -> None:
    overrides = ["training.strategy=fsdp"] if strategy == "fsdp" else []
    run = Run(work, command(strategy, device, overrides, "--max-restarts", "1", steps=UNTIL_STOPPED[device]))
    code = run.go(cap=600, kill=True, after=AFTER[device])
    rec = _recovered(run, out, code, "replaced")
    if rec is None:
        return
    if strategy == "fsdp":
        out.check(rec.get("source_rank") == 0, f"the shard came from rank {rec.get('source_rank')}, not rank 0's copy")
    out.check(rec.get("checkpoint_reads") == 0, f"{rec.get('checkpoint_reads')} checkpoint read(s)")
    seconds = run.next_step_after_kill()
    out.figure("SIGKILL of rank 1 -> its replacement's first step", "n/a" if seconds is None else f"{seconds:.2f} s")
    measured = first_step(run.records())
    if not out.check(measured is not None, "no first step after the rebuilt group in the records"):
        return
    first, before, after = measured
    for which, median in (("before the kill", before), ("after the recovery", after)):
        ratio = first / median
        out.figure(f"first step after the rebuilt group / median step {which}",
                   f"{ratio:.2f}x ({first * 1000:.1f} ms / {median * 1000:.1f} ms)", f"<= {FIRST_STEP_GOAL}x",
                   ratio <= FIRST_STEP_GOAL)


def sdc(work: Path, device: str, out: Outcome) -> None:
    env = {**worker_env(), "GPUHERD_INJECT_BITFLIP": "1:3:param"}
    run = Run(work, command("sdc", device, [], steps=20), env)
    code = run.go(cap=600)
    out.check(code == 0, f"the run ended with exit {code}")
    found = [(r["step"], r["culprits"], r.get("blamed_by")) for r in run.records() if r.get("type") == "sdc"]
    out.check([(s, c) for s, c, _ in found] == [(3, [1])], f"SDC records {found}, not one at step 3 naming rank 1")
    out.figure("the flipped bit (rank 1, step 3, parameters): detected at", ", ".join(
        f"step {s}, rank(s) {c} named by {b}" for s, c, b in found) or "never")
    if (run.run_dir / "summary.json").exists():
        summary = run.summary()
        out.check(summary["restarts"] == 0, f"{summary['restarts']} restart(s): not healed in place")


def shrink(work: Path, device: str, out: Outcome) -> None:
    run = Run(work, command("shrink", device, [], "--max-restarts", "1", "--spares", "0", "--min-replicas", "1",
                            steps=UNTIL_STOPPED[device]))
    code = run.go(cap=600, kill=True, spare=False, after=AFTER[device])
    _recovered(run, out, code, "shrink")


def async_save(work: Path, device: str, out: Outcome) -> None:
    every = STEPS[device] // 6
    run = Run(work, command("saves", device, [f"training.save_every={every}", "training.keep_last=2"]))
    code = run.go(cap=600)
    out.check(code == 0, f"the run ended with exit {code}")
    saves = [r for r in run.records() if r.get("type") == "checkpoint" and r.get("rank", 0) == 0
             and r["step"] < STEPS[device]]
    modes = sorted({r.get("mode") for r in saves})
    out.check(bool(saves) and modes == ["async"], f"periodic saves {len(saves)}, modes {modes}")
    if saves:
        stalls = [r["stall_s"] for r in saves]
        writes = [r["write_s"] for r in saves]
        out.figure(f"the loop blocked per async save, rank 0 ({len(saves)} saves, every {every} steps)",
                   f"median {statistics.median(stalls):.3f} s (max {max(stalls):.3f} s)")
        out.figure("the background write per save", f"median {statistics.median(writes):.3f} s")


CASES = {"live": live, "fsdp": lambda w, d, o: live(w, d, o, "fsdp"), "sdc": sdc, "shrink": shrink,
         "async-save": async_save}


def _run(args: argparse.Namespace, out: Outcome) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"acceptance-{args.case}-"))
    try:
        CASES[args.case](work, args.device, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(part_main(_run, __doc__.splitlines()[0],
                               lambda p: p.add_argument("case", choices=sorted(CASES))))

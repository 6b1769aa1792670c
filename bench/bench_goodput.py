#!/usr/bin/env python3
"""Goodput under one fixed, seeded fault schedule, launcher by launcher.

The same torchrun-style DDP script (bench/goodput_worker.py: 2 ranks, gloo, a checkpoint
every 20 steps, resume from the newest; STEPS steps of STEP_S) under torchrun
(`--max-restarts 8`), NVIDIA's ft_launcher 0.4.1 (`--max-restarts 8`, its rank-monitor
heartbeats from the script, no NIC monitor on CPU) and `gpuherd run` (`--max-restarts 8`),
plus gpuherd's built-in trainer (a tiny Llama) with restarts (`--spares 0`) and with live
recovery at the default settings (one warm spare, refilled after each recovery), given as
many steps as make its training last as long as the script's, and a checkpoint as often in
seconds (a probe run measures its step first). Each launcher runs once undisturbed, then once under the schedule,
interleaved round by round. The schedule, in fractions of that launcher's undisturbed
training time (seeded jitter, the same for every launcher of a round), each fault to whatever process is rank 1 by then:

    SIGKILL, SIGSTOP for good (a hang), SIGSTOP + SIGCONT 2 s later (a stop-and-continue:
    slow, not dead), SIGKILL

A preemption is not in it: a SIGTERM reaching a process ends every launcher's run by design
(gpuherd's built-in trainer saves and stops the whole job, exit 143), and what follows, the
scheduler's requeue continuing the run, needs SLURM; the accounting of a requeued run is
tested on a made-up timeline (tests/supervisor/test_goodput.py).

A run that has not finished by its cap (4x its undisturbed wall time, at least 120 s) is
killed and counted at the cap. Goodput, badput by cause and steps redone come from the
benchmark's own accounting (bench/goodput_accounting.py); for gpuherd's runs summary.json's
goodput block is shown beside it (they must agree within a few percent). Writes
bench/results/goodput.md.

    python3 bench/bench_goodput.py [--quick] [--rounds N]

--quick halves the training, so its faults come twice as often as the full run's (one
every ~6 s of training instead of ~12 s): its kept shares are the harsher figure.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.goodput_accounting import Kept, fault_cost, from_metrics, from_steps_log, kept  # noqa: E402
from bench.launchers import Launchers, kill_tree, worker_env  # noqa: E402

WORKER = ROOT / "bench" / "goodput_worker.py"
SEED = 32
SCHEDULE = (("kill", 1 / 5), ("hang", 2 / 5), ("stop-continue", 3 / 5), ("kill", 4 / 5))
CONTINUE_AFTER_S = 2.0
STEP_S = 0.1
KINDS = ("gpuherd built-in live", "gpuherd built-in restarts", "gpuherd run", "ft_launcher", "torchrun")
BUILTIN = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
           "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
           "training.grad_accum_nums=1", "training.warmup_steps=5", "training.log_every=1", "training.eval_every=0"]
SAVE_EVERY = 20  # the script's steps between checkpoints; the built-in saves as often in seconds
PROBE_STEPS = 400  # the built-in's calibration run


@dataclass
class Run:
    kind: str
    work: Path
    steps: int
    save_every: int = SAVE_EVERY

    @property
    def builtin(self) -> bool:
        return self.kind.startswith("gpuherd built-in")

    @property
    def run_dir(self) -> Path:
        return self.work / "logs" / "g"

    def command(self, ln: Launchers) -> list[str]:
        args = (str(self.work), str(self.steps), f"{STEP_S:g}")
        restarts = ("--max-restarts", "8")
        if self.kind == "torchrun":
            return ln.torchrun(2, *args, flags=("--standalone", *restarts))
        if self.kind == "ft_launcher":
            return ln.ft_launcher(2, *args, flags=("--standalone", *restarts))
        if self.kind == "gpuherd run":
            return ln.gpuherd(2, *args, flags=("--run-id", "g", *restarts))
        spares = () if self.kind.endswith("live") else ("--spares", "0")  # live: the default pool of one
        cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "g", *restarts, *spares,
               "--nproc", "2",
               "--set", "system.device=cpu", "--set", f"system.run_root={self.work / 'logs'}",
               "--set", f"system.checkpoint_dir={self.work / 'ckpt'}", "--set", f"training.max_steps={self.steps}",
               "--set", f"training.save_every={self.save_every}"]
        for item in BUILTIN:
            cmd += ["--set", item]
        return cmd

    def completions(self) -> tuple[list, float]:
        if self.builtin:
            return from_metrics(self.run_dir / "metrics.jsonl"), 0.0
        return from_steps_log(self.work / "steps.log")

    def rank1(self, launcher_pid: int, hung: set[int]) -> psutil.Process | None:
        """The process that is rank 1 now (the newest one: a restart's or a spare's). A warm spare
        has no RANK in its environment (the built-in worker's `ready` record names it), nor has a
        restart standby of `gpuherd run` (the supervisor's host samples name each rank's pid). A
        process the schedule hung is no target until the launcher replaced it: a later fault must
        not undo the hang (a stop-and-continue's SIGCONT) nor end it (a kill)."""
        if self.builtin:
            return _newest_alive(_pids(self.run_dir / "metrics.jsonl", "ready"), hung)
        if self.kind == "gpuherd run":
            return _newest_alive(_pids(self.run_dir / "metrics.jsonl", "host"), hung)
        found = []
        try:
            tree = psutil.Process(launcher_pid).children(recursive=True)
        except psutil.Error:
            return None
        for p in tree:
            try:
                line = " ".join(p.cmdline())
                if WORKER.name in line and p.environ().get("RANK") == "1" and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                continue
        newest = max(found, key=lambda p: p.create_time(), default=None)
        return None if newest is None or newest.pid in hung else newest


def _newest_alive(pids: list[int], hung: set[int]) -> psutil.Process | None:
    for pid in reversed(pids):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                return None if pid in hung else p
        except psutil.Error:
            continue
    return None


def _pids(metrics: Path, kind: str, rank: int = 1) -> list[int]:
    """The pids that `kind` records (`ready`: a built-in worker's; `host`: the supervisor's samples,
    the first of an attempt taken as its workers start) gave `rank`, oldest first."""
    pids: list[int] = []
    tag = f'"{kind}"'.encode()
    for line in metrics.read_bytes().splitlines() if metrics.exists() else []:
        if tag in line:
            try:
                r = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if r.get("type") == kind and r.get("rank") == rank and isinstance(r.get("pid"), int) \
                    and r["pid"] not in pids:
                pids.append(r["pid"])
    return pids


def _summary_goodput(run: Run) -> dict | None:
    try:
        return orjson.loads((run.run_dir / "summary.json").read_bytes()).get("goodput")
    except (OSError, orjson.JSONDecodeError):
        return None


Costs = list[tuple[str, float | None]]  # per fault fired, in order: (what, seconds it cost; None: never got past)


def once(ln: Launchers, run: Run, faults: list[tuple[str, float]],
         cap: float) -> tuple[Kept, float, dict | None, Costs]:
    """(the benchmark's accounting, training seconds from the first step to the exit, gpuherd's
    goodput block, what each fault cost)."""
    ln = Launchers(run.work, ln.script, grace_period=ln.grace)  # its own logs: two runs never share a run id
    started = time.time()
    proc = subprocess.Popen(run.command(ln), cwd=run.work, env=worker_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    first = None
    pending = list(faults)
    resume: list[tuple[float, psutil.Process]] = []
    hung: set[int] = set()
    fired: list[tuple[str, float]] = []
    try:
        while proc.poll() is None and time.time() - started < cap:
            time.sleep(0.05)
            now = time.time()
            if first is None:
                done = run.completions()[0]
                first = done[0].time if done else None
                continue
            for at, p in list(resume):
                if now >= at:
                    resume.remove((at, p))
                    _signal(p, signal.SIGCONT)
            while pending and now - first >= pending[0][1]:
                what, _ = pending.pop(0)
                victim = run.rank1(proc.pid, hung)
                if victim is None:
                    pending.insert(0, (what, now - first + 0.5))  # rank 1 is being replaced: a little later
                    break
                sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "stop-continue": signal.SIGSTOP}[what]
                _signal(victim, sig)
                fired.append((what, now))
                if what == "hang":
                    hung.add(victim.pid)
                if what == "stop-continue":
                    resume.append((now + CONTINUE_AFTER_S, victim))
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        for _, p in resume:
            _signal(p, signal.SIGCONT)
    ended = time.time()
    completions, saves = run.completions()
    return kept(completions, ended - started, saves), ended - (first or started), \
        _summary_goodput(run) if run.kind.startswith("gpuherd") else None, \
        [(what, fault_cost(completions, at)) for what, at in fired]


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def schedule(training_s: float, rng: random.Random) -> list[tuple[str, float]]:
    return [(what, training_s * (share + rng.uniform(-0.03, 0.03))) for what, share in SCHEDULE]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 300 steps instead of 2 of 600")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (overrides --quick's)")
    args = parser.parse_args()
    rounds, steps = (1, 300) if args.quick else (2, 600)
    rounds = args.rounds or rounds
    rng = random.Random(SEED)
    results: dict[str, list[tuple[Kept, Kept, dict | None, Costs]]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        ln = Launchers(Path(tmp), WORKER, grace_period=2)
        per_step = builtin_step_s(ln, Path(tmp))
        builtin_steps = max(PROBE_STEPS, round(steps * STEP_S / per_step))
        builtin_save = max(1, round(SAVE_EVERY * STEP_S / per_step))
        print(f"the built-in trainer: {per_step * 1000:.1f} ms a step: {builtin_steps} steps, a save every "
              f"{builtin_save}", flush=True)
        for i in range(rounds):
            faults_for = None
            draw = rng.random()  # one schedule per round, the same for every launcher: its faults land at the
            # same share of each one's training, so where they fall between checkpoints is no launcher's luck
            for kind in KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]:
                def fresh() -> Run:
                    if kind.startswith("gpuherd built-in"):
                        return Run(kind, Path(tempfile.mkdtemp(dir=tmp)), builtin_steps, builtin_save)
                    return Run(kind, Path(tempfile.mkdtemp(dir=tmp)), steps)
                calm, training_s, _, _ = once(ln, fresh(), [], 900)
                faults_for = schedule(training_s, random.Random(draw))
                cap = max(120.0, 4 * calm.wall_s)
                faulted, _, block, costs = once(ln, fresh(), faults_for, cap)
                results[kind].append((calm, faulted, block, costs))
                print(f"{kind}: undisturbed {calm.ratio:.3f}, faulted {faulted.ratio:.3f} "
                      f"(gpuherd's own: {block.get('ratio') if block else '-'})", flush=True)
    _write(results, rounds, steps, builtin_steps, builtin_save)
    return 0


def builtin_step_s(ln: Launchers, tmp: Path) -> float:
    """The built-in trainer's step on this machine (an undisturbed probe run, first step to exit
    over its steps): every launcher then trains about as long, so the faults come as often."""
    _, training_s, _, _ = once(ln, Run("gpuherd built-in restarts", Path(tempfile.mkdtemp(dir=tmp)), PROBE_STEPS), [],
                               900)
    return training_s / PROBE_STEPS


def _write(results: dict[str, list[tuple[Kept, Kept, dict | None, Costs]]], rounds: int, steps: int,
           builtin_steps: int, builtin_save: int) -> None:
    kept_share = {k: Side(k, [f.ratio / c.ratio for c, f, _, _ in v if c.ratio]) for k, v in results.items()}
    comparisons = [Comparison(f"faulted goodput / its own undisturbed goodput: {ours} vs {theirs}", "x",
                              kept_share[ours], kept_share[theirs], lower_is_better=False)
                   for ours in ("gpuherd built-in live", "gpuherd run") for theirs in ("ft_launcher", "torchrun")]
    rows = ["", "| launcher | goodput undisturbed | goodput faulted | kept | productive s | redone s (steps) | "
            "saves s | startup, detection, restarts, stops s | wall s | gpuherd's summary.json ratio |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, runs in results.items():
        for calm, f, block, _ in runs:
            rows.append(f"| {kind} | {calm.ratio:.3f} | {f.ratio:.3f} | {f.ratio / calm.ratio if calm.ratio else 0:.2f} "
                        f"| {f.productive_s:.1f} | {f.redone_s:.1f} ({f.steps_redone}) | {f.checkpoint_s:.1f} | "
                        f"{f.rest_s:.1f} | {f.wall_s:.1f} | {block['ratio'] if block else '-'} |")
    rows += _per_fault(results)
    causes = {}
    for kind, runs in results.items():
        for _, _, block, _ in runs:
            if block:
                causes[kind] = ", ".join(f"{c} {s:.1f} s" for c, s in block["badput_s"].items() if s >= 0.05)
    write_results("goodput", "Goodput under one fault schedule (2 ranks, gloo)", comparisons, notes=[
        f"{rounds} interleaved round(s); the script: {steps} steps of {STEP_S:g} s, a checkpoint every {SAVE_EVERY}; "
        f"the built-in trainer: {builtin_steps} steps of its tiny Llama, a checkpoint every {builtin_save} (as long "
        "a training and as often a save in seconds, from a probe run); faults at 1/5..4/5 of each launcher's undisturbed training time: "
        "SIGKILL, SIGSTOP (hang), SIGSTOP+SIGCONT after 2 s, SIGKILL, each to rank 1; capped at 4x the "
        "undisturbed wall (at least 120 s).",
        *(f"gpuherd's badput by cause, {k}: {v}" for k, v in causes.items()),
    ], extra_rows=rows)


def _per_fault(results: dict[str, list[tuple[Kept, Kept, dict | None, Costs]]]) -> list[str]:
    """Per launcher and fault: seconds from the fault until training was two steps past where it was
    (less two steps), each round's figure."""
    rows = ["", "Per fault: seconds from the fault until training completed the second step past the one it had reached "
            "(less two undisturbed steps): detection + restart or recovery + steps trained again; "
            "`never`: the run did not get past it before its end or cap.", "",
            "| launcher | " + " | ".join(f"{i + 1}. {what}" for i, (what, _) in enumerate(SCHEDULE)) + " |",
            "|---|" + "---|" * len(SCHEDULE)]
    for kind, runs in results.items():
        cells = [[] for _ in SCHEDULE]
        for *_, costs in runs:
            for i, (_, cost) in enumerate(costs[:len(SCHEDULE)]):
                cells[i].append("never" if cost is None else f"{cost:.1f} s")
        rows.append(f"| {kind} | " + " | ".join(", ".join(c) or "not fired" for c in cells) + " |")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

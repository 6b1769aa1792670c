#!/usr/bin/env python3
"""A user's own DDP script recovered live: gpuherd.live (examples/live_ddp.py) against torchft on
the same loop (bench/torchft_live_ddp.py), one of 2 data-parallel workers SIGKILLed at step
KILL_AT, the sides rotating round by round.

Per side: the lines that differ from the plain loop (the example without gpuherd.live's three
lines), seconds from the kill to the next step at the full global batch (and, for torchft, to
its surviving group's next step alone, on half the batch), steps done again, and samples never
trained. Seen from outside: gpuherd's rank-0 lines with the time each arrived; torchft's per-step
records (time.time() after each optimizer step). Writes bench/results/script_live.md (+ .json).

    python3 bench/bench_script_live.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery_torchft import (INSTALL, LIGHTHOUSE, lighthouse, recovery,  # noqa: E402
                                               torchft_available)
from bench.compare import Comparison, Tally, rotated, write_results  # noqa: E402
from bench.launchers import Launchers, kill_tree, run_records, worker_env  # noqa: E402

EXAMPLE = ROOT / "examples" / "live_ddp.py"
TORCHFT_SCRIPT = ROOT / "bench" / "torchft_live_ddp.py"
STEPS, KILL_AT, BATCH = 60, 20, 32
STEP = re.compile(r"^CPU\d+:step (\d+) loss (\S+)$")
GPUHERD_LINES = ("import gpuherd.live as live", "session = live.attach(", "for step in session.steps(")


def plain_loop() -> list[str]:
    """The example without gpuherd.live: its import and attach dropped, the loop over the range."""
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        if line.strip().startswith(GPUHERD_LINES[:2]):
            continue
        lines.append(line.replace("for step in session.steps(range(args.steps)):", "for step in range(args.steps):"))
    return lines


def lines_changed(script: Path) -> int:
    """Lines added or changed in `script` against the plain loop (its docstring, comments and the
    benchmark's own record lines, marked `# bench`, left out)."""
    def code(lines: list[str]) -> list[str]:
        text = "\n".join(lines)
        text = re.sub(r'^""".*?"""\n', "", text, flags=re.S)
        return [ln.split("  #")[0].rstrip() for ln in text.splitlines()
                if ln.strip() and not ln.strip().startswith("#") and not ln.rstrip().endswith("# bench")]
    diff = difflib.ndiff(code(plain_loop()), code(script.read_text().splitlines()))
    return sum(1 for d in diff if d.startswith("+ "))


def start_example(work: Path, ranks: int) -> tuple[subprocess.Popen, list[tuple[float, int]], threading.Thread]:
    """`gpuherd run --nproc RANKS --max-restarts 2` of the example, and a thread that notes the time
    each of its step lines arrives on stdout, as (time, step)."""
    cmd = Launchers(work, EXAMPLE, grace_period=2).gpuherd(ranks, "--steps", str(STEPS), flags=("--max-restarts", "2"))
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    printed: list[tuple[float, int]] = []
    reader = threading.Thread(target=lambda: [printed.append((time.time(), int(m.group(1))))
                                              for line in proc.stdout if (m := STEP.match(line.rstrip("\n")))],
                              daemon=True)
    reader.start()
    return proc, printed, reader


def gpuherd_side(work: Path, ranks: int = 2) -> dict | None:
    """One `gpuherd run --nproc RANKS --max-restarts 2` of the example; rank 1 SIGKILLed once rank
    0 printed step KILL_AT. None if it never got there or did not exit 0."""
    proc, printed, reader = start_example(work, ranks)
    try:
        deadline = time.monotonic() + 300
        while not any(s >= KILL_AT for _, s in printed):
            if proc.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        rank1 = next(c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1")
        killed = time.time()
        rank1.send_signal(signal.SIGKILL)
        if proc.wait(timeout=300) != 0:
            return None
    finally:
        kill_tree(proc)
        reader.join(timeout=10)
    [summary] = (work / "logs").glob("*/summary.json")
    [rec] = orjson.loads(summary.read_bytes())["recoveries"]
    # the rebuilt group's first step: its line is the last of that step's after the kill (rank 0 may
    # have completed the step in flight before the kill cut the others' all-reduce, and its line,
    # held briefly by the console, may arrive after the kill too: no recovery, and done again)
    after = [(t, s) for t, s in printed if t > killed]
    nxt = [t for t, s in after if s == rec["resumed_step"]]
    if not nxt:
        return None
    steps = sorted({s for _, s in printed})
    return {"next": max(nxt) - killed, "redone": rec["steps_redone"], "dropped": BATCH * (STEPS - len(steps)),
            "recovery_s": rec["seconds"]}  # a step never completed at the full batch


def torchft_side(work: Path) -> dict | None:
    """2 replica groups of torchft_live_ddp.py, each under `torchrun --max-restarts 1`; group 1's
    worker SIGKILLed once both committed step KILL_AT together."""
    out = work / "out"
    out.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        env = {**worker_env(), "TORCHFT_LIGHTHOUSE": stack.enter_context(lighthouse(work)), "NUM_REPLICA_GROUPS": "2"}
        stack.callback(lambda: [kill_tree(p) for p in procs if p.poll() is None])
        for group in (0, 1):
            cmd = Launchers(work / f"group{group}", TORCHFT_SCRIPT, grace_period=2).torchrun(
                1, str(out), "--steps", str(10 * STEPS), flags=("--standalone", "--max-restarts", "1"))
            with (work / f"group{group}.log").open("wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=work, env={**env, "REPLICA_GROUP_ID": str(group)},
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        steps = lambda: [r for g in (0, 1) for r in run_records(out / f"group{g}.jsonl") if r["type"] == "step"]  # noqa: E731
        if not _until(procs, lambda: any(r["group"] == 1 and r["step"] >= KILL_AT and r["participants"] == 2
                                         and r["committed"] for r in steps())):
            return None
        victim = [r["pid"] for r in run_records(out / "group1.jsonl") if r["type"] == "ready"][-1]
        killed = time.time()
        psutil.Process(victim).send_signal(signal.SIGKILL)
        if not _until(procs, lambda: any(r["group"] == 1 and r["attempt"] > 0 and r["committed"]
                                         and r["participants"] == 2 for r in steps())):
            return None
        got = recovery(steps(), killed)
    if got is None:
        return None
    return {"next": got.full, "survivor": got.survivor, "redone": 0, "dropped": BATCH * got.shrunk_steps}


def _until(procs: list[subprocess.Popen], done, cap: float = 300) -> bool:
    deadline = time.monotonic() + cap
    while not done():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.02)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 4")
    args = parser.parse_args()
    rounds, with_torchft = (2 if args.quick else 4), torchft_available()
    if not with_torchft:
        print(f"bench: {INSTALL}", file=sys.stderr)
    tally, seen = Tally(), {"gpuherd": [], "torchft": []}

    def side(name: str, run) -> None:
        with tempfile.TemporaryDirectory(prefix=f"bench-script-live-{name}-") as tmp:
            got = run(Path(tmp))
        tally.add(f"{name} full batch", None if got is None else got["next"])
        if got is not None:
            seen[name].append(got)
            if "survivor" in got:
                tally.add(f"{name} survivor", got["survivor"])

    sides = [lambda: side("gpuherd", gpuherd_side)] + ([lambda: side("torchft", torchft_side)] if with_torchft else [])
    load = rotated(sides, rounds)
    _write(tally, seen, rounds, load, with_torchft)
    return 0


def _write(tally: Tally, seen: dict[str, list[dict]], rounds: int, load: list[float], with_torchft: bool) -> None:
    what = f"cpu, 2 ranks, examples/live_ddp.py's loop, kill at step {KILL_AT} -> next step"
    ours = tally.side("gpuherd full batch")
    comparisons = [Comparison(f"{what} at the full global batch", "s", ours, tally.side("torchft full batch"))]
    if with_torchft:
        comparisons.append(Comparison(f"{what}, vs torchft's survivor alone (half the global batch)", "s", ours,
                                      tally.side("torchft survivor")))

    def each(name: str, key: str) -> str:
        return ", ".join(str(r[key]) for r in seen[name]) or "n/a"
    notes = [
        f"{rounds} rounds, the sides rotating; runs that did not finish: {tally.unfinished()}; 1-minute load "
        f"average over the run (2 cores, shared): {min(load):.1f}-{max(load):.1f}.",
        f"Lines differing from the plain loop (the example without gpuherd.live; docstrings and comments left out): "
        f"gpuherd.live {lines_changed(EXAMPLE)}, torchft {lines_changed(TORCHFT_SCRIPT)}.",
        f"Steps done again after the kill, per run: gpuherd {each('gpuherd', 'redone')}; torchft "
        f"{each('torchft', 'redone')} (the restarted group heals to the survivor's step).",
        f"Samples never trained (the lost worker's slice of each step the job took without it, {BATCH} a step): "
        f"gpuherd {each('gpuherd', 'dropped')}; torchft {each('torchft', 'dropped')}.",
        "gpuherd: `gpuherd run --nproc 2 --max-restarts 2` (one warm spare); the figure is the arrival, at the "
        "reader of its stdout, of rank 0's last line for the step the rebuilt group resumed at (summary.json's "
        "`resumed_step`; a line for it that came earlier was rank 0's before the loss cut the step short).",
    ]
    if with_torchft:
        notes.append(f"torchft-nightly {importlib.metadata.version('torchft-nightly')}: 2 replica groups of 1 rank, "
                     f"each under `torchrun --standalone --max-restarts 1`, a lighthouse with {LIGHTHOUSE} (its "
                     "README) and its default 5 s heartbeat timeout; the generator's state is in the manager's "
                     "state dict, so a healed group takes the survivor's data position too.")
    else:
        notes.append(INSTALL + ".")
    write_results("script_live", "A user's DDP script recovered live: gpuherd.live vs torchft (1 of 2 SIGKILLed)",
                  comparisons, notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())

"""gpuherd's supervisor vs torchrun on the same tiny worker script, interleaved in one run.

- launch overhead (`--script` mode, a plain torchrun-style script): launcher start ->
  every worker's first line on the launcher's stdout.
- log forwarding: 8 workers print L lines each as fast as they can. Two rows from the
  same runs: lines/s delivered (8L / first worker's first write -> the last line on
  the launcher's stdout), and the slowdown the launcher causes the workers (the
  slowest worker's write time under the launcher / the same 8 workers started
  directly with stdout to /dev/null, measured right before, so both see the same
  machine load). torchrun runs with `--tee 3` (prefixed lines, console + files), the
  closest match to what gpuherd always does.

    python bench/bench_supervisor.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import Comparison, Side, interleaved, write_results  # noqa: E402
from bench.launchers import Launchers, worker_env  # noqa: E402

WORKER = r'''
import os, sys, time
mode, arg = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "launch":
    print(f"first line from rank {rank}", flush=True)
elif mode == "flood":
    n = int(sys.argv[3])
    line = "x" * 60 + "\n"
    out = sys.stdout
    t0 = time.monotonic()
    for i in range(n):
        out.write(line)
    out.flush()
    with open(f"{arg}.{rank}", "w") as f:
        f.write(f"{t0!r} {time.monotonic() - t0!r}")
'''
FLOOD_LINE = b"x" * 60 + b"\n"


def launch(cmd_for, n: int, work: Path) -> float:
    started = time.monotonic()
    proc = subprocess.Popen(cmd_for(n, "launch", "-"), env=worker_env(), cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    seen = set()
    last = None
    for line in proc.stdout:
        if "first line from rank" in line:
            seen.add(line.rsplit(" ", 1)[1].strip())
            if len(seen) == n:
                last = time.monotonic()
                break
    proc.stdout.read()
    proc.wait(timeout=180)
    return (last - started) * 1000


def _write_times(stamp: Path, n: int) -> tuple[float, float]:
    """(when the first worker started writing, the slowest worker's write time), as the workers timed it."""
    marks = [Path(f"{stamp}.{rank}").read_text().split() for rank in range(n)]
    return min(float(m[0]) for m in marks), max(float(m[1]) for m in marks)


def flood_alone(script: Path, n: int, lines: int, work: Path) -> float:
    """The slowest worker's write time with no launcher: n workers started directly, stdout to /dev/null."""
    stamp = work / f"alone-{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, str(script), "flood", str(stamp), str(lines)],
                              env={**worker_env(), "RANK": str(rank)}, cwd=work, stdout=subprocess.DEVNULL)
             for rank in range(n)]
    for proc in procs:
        proc.wait(timeout=300)
    return _write_times(stamp, n)[1]


def flood(cmd_for, n: int, lines: int, work: Path) -> tuple[float, float]:
    """(the slowest worker's write time, lines/s delivered on the launcher's stdout)."""
    stamp = work / f"flood-{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd_for(n, "flood", str(stamp), str(lines)), env=worker_env(), cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    want, seen, tail, delivered_at = n * lines, 0, b"", None
    while chunk := os.read(proc.stdout.fileno(), 1 << 16):
        data = tail + chunk
        seen += data.count(FLOOD_LINE)  # the tail is one byte too short to hold a whole line: none counted twice
        tail = data[1 - len(FLOOD_LINE):]
        if delivered_at is None and seen >= want:
            delivered_at = time.monotonic()
    proc.wait(timeout=300)
    if delivered_at is None:
        raise RuntimeError(f"{cmd_for.__name__}: {seen:,} of {want:,} lines reached its stdout")
    started, slowest = _write_times(stamp, n)
    return slowest, want / (delivered_at - started)


class Forwarding:
    """Each sample: the workers alone, then under a launcher; the slowdown is the ratio of
    that pair, lines/s delivered is kept per launcher for a second row."""

    def __init__(self, script: Path, n: int, lines: int, work: Path) -> None:
        self.script, self.n, self.lines, self.work = script, n, lines, work
        self.delivered: dict[str, list[float]] = {}

    def slowdown(self, cmd_for) -> float:
        alone = flood_alone(self.script, self.n, self.lines, self.work)
        under, rate = flood(cmd_for, self.n, self.lines, self.work)
        self.delivered.setdefault(cmd_for.__name__, []).append(rate)
        return under / alone

    def delivered_row(self, what: str) -> Comparison:
        return Comparison(what, "lines/s", Side("gpuherd", self.delivered["gpuherd"]),
                          Side("torchrun", self.delivered["torchrun"]), lower_is_better=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a few minutes on 2 cores)")
    args = parser.parse_args()
    reps = 3 if args.quick else 10
    flood_reps = 3 if args.quick else 5
    flood_workers, flood_lines = 8, 200_000 if args.quick else 500_000
    with tempfile.TemporaryDirectory(prefix="bench-supervisor-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        ln = Launchers(work, script)
        ours, theirs = ln.gpuherd, ln.torchrun
        comparisons = []
        comparisons.append(interleaved(
            "launch overhead, `--script` mode, 2 workers (launcher start -> every worker's first line)", "ms",
            ("gpuherd", lambda: launch(ours, 2, work)), ("torchrun", lambda: launch(theirs, 2, work)), repeats=reps))
        logs = Forwarding(script, flood_workers, flood_lines, work)
        slowdown = interleaved(
            f"worker slowdown from log forwarding, {flood_workers} workers x {flood_lines:,} lines "
            "(write time under the launcher / alone to /dev/null)", "×",
            ("gpuherd", lambda: logs.slowdown(ours)), ("torchrun", lambda: logs.slowdown(theirs)), repeats=flood_reps)
        comparisons.append(logs.delivered_row(
            f"log forwarding, {flood_workers} workers x {flood_lines:,} lines, delivered to the launcher's stdout"))
        comparisons.append(slowdown)
    notes = [
        f"{reps} interleaved repetitions for launch, {flood_reps} for the log rows ({'quick' if args.quick else 'full'} "
        "mode); ratios >1 mean gpuherd is better",
        "torchrun: default monitor interval, `--tee 3 --log-dir` for prefixed console + file logs like gpuherd's",
        "gpuherd's launch includes binding its rendezvous port and starting its store process; torchrun's includes "
        "importing torch in the launcher itself",
        "log rows: workers write unbuffered (PYTHONUNBUFFERED=1, one write per line); gpuherd's workers write into "
        "pipes it reads, torchrun's (`--tee 3`) into files that its tail threads poll every 0.1 s and copy to its "
        "console; the bench reads each launcher's stdout through a pipe",
    ]
    write_results("supervisor", "Supervisor vs torchrun (tiny CPU workers, same script)", comparisons, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

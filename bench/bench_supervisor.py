"""gpuherd's supervisor vs torchrun on the same tiny worker script, interleaved in one run.

- launch overhead: launcher start -> the last worker's first line on the launcher's stdout.
- log throughput: 2 workers print L lines each as fast as they can; lines/s is
  2L / the slower worker's write time, so a launcher that reads slowly (and blocks
  the workers) scores lower. torchrun runs with `--tee 3` (prefixed lines, console + files),
  the closest match to what gpuherd always does.

    python bench/bench_supervisor.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import interleaved, write_results  # noqa: E402
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
    t0 = time.perf_counter()
    for i in range(n):
        out.write(line)
    out.flush()
    with open(f"{arg}.{rank}", "w") as f:
        f.write(repr(time.perf_counter() - t0))
'''


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


def throughput(cmd_for, lines: int, work: Path) -> float:
    stamp = work / f"flood-{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd_for(2, "flood", str(stamp), str(lines)), env=worker_env(), cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.wait(timeout=300)
    slowest = max(float(Path(f"{stamp}.{r}").read_text()) for r in (0, 1))
    return 2 * lines / slowest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a few minutes on 2 cores)")
    args = parser.parse_args()
    reps = 3 if args.quick else 10
    flood_lines = 100_000 if args.quick else 500_000
    with tempfile.TemporaryDirectory(prefix="bench-supervisor-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        ln = Launchers(work, script)
        ours, theirs = ln.gpuherd, ln.torchrun
        comparisons = []
        comparisons.append(interleaved(
            "launch overhead, 2 workers (start -> last worker's first line)", "ms",
            ("gpuherd", lambda: launch(ours, 2, work)), ("torchrun", lambda: launch(theirs, 2, work)), repeats=reps))
        comparisons.append(interleaved(
            f"log forwarding, 2 workers x {flood_lines:,} lines", "lines/s",
            ("gpuherd", lambda: throughput(ours, flood_lines, work)),
            ("torchrun", lambda: throughput(theirs, flood_lines, work)),
            repeats=max(2, reps // 3), lower_is_better=False))
    notes = [
        f"{reps} interleaved repetitions per row ({'quick' if args.quick else 'full'} mode); ratios >1 mean gpuherd is better",
        "torchrun: default monitor interval, `--tee 3 --log-dir` for prefixed console + file logs like gpuherd's",
        "gpuherd's launch includes binding its rendezvous port and starting its store process; torchrun's includes "
        "importing torch in the launcher itself",
    ]
    write_results("supervisor", "Supervisor vs torchrun (tiny CPU workers, same script)", comparisons, notes)
    for c in comparisons:
        print(c.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Teardown latency: one worker dies -> the launcher exits; gpuherd vs torchrun, interleaved.

Both launchers run the same script (bench/teardown_worker.py) with 2 and 8 workers;
rank 1 dies in one of four ways, once every rank is up: an uncaught exception,
os._exit(1), SIGKILL, or os._exit(1) while every other rank ignores SIGTERM, so the
launcher has to escalate to SIGKILL; and, 2 workers only, SIGKILL once every rank imported
torch and joined a gloo group (a training script's processes take longer to die). Both get the same grace period (gpuherd
`--grace-period G`, torchrun `--shutdown-timeout G`). Measured: the time rank 1 wrote
right before dying -> the launcher's exit; and whether every process of the launcher's tree
(noted once every rank was up) was gone and reaped when its exit code came. A launcher still
running --cap seconds after the death is killed with its workers and counted as the cap (a
lower bound).
Ctrl-C rows: every rank up and sleeping (nothing to save) and the launcher's process tree
quiet (no CPU for 0.2 s: nothing still starting), SIGINT to the launcher -> its exit. Both
launchers run with their default settings otherwise.

    python bench/bench_teardown.py [--quick] [--grace 2] [--cap S]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import interleaved, write_results  # noqa: E402
from bench.launchers import (Launchers, exit_after, kill_tree, still_there, tree_processes,  # noqa: E402
                             wait_quiet, worker_env)

WORKER = ROOT / "bench" / "teardown_worker.py"
HOW = {  # teardown_worker.py's argv[1] -> how the row names it
    "exception": "an uncaught exception",
    "exit": "os._exit(1)",
    "sigkill": "SIGKILL",
    "ignore-sigterm": "os._exit(1); the others ignore SIGTERM",
    "sigkill-torch": "SIGKILL, every rank with torch imported and a gloo group formed",
}
TWO_ONLY = ("sigkill-torch",)  # a torch import per rank: 8 of them take a while on 2 cores
SANE_CAP = 60.0  # seconds: a launcher that honours SIGTERM-able workers and still runs this long is broken


def teardown_ms(cmd_for, n: int, how: str, cap: float, work: Path, left: dict[str, int] | None = None) -> float:
    """Rank 1's death -> the launcher's exit; `left[launcher]` counts the processes of its tree
    (noted once every rank was up) still there, running or unreaped, when its exit code came."""
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.Popen(cmd_for(n, how, str(out)), env=worker_env(), cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    died, deadline = out / "died", time.monotonic() + SANE_CAP
    while len(list(out.glob("up*"))) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            raise RuntimeError(f"{cmd_for.__name__}: the ranks never came up (launcher exit code {proc.returncode})")
        time.sleep(0.005)
    tree = tree_processes(proc.pid)
    (out / "go").touch()
    while not died.exists():
        if (proc.poll() is not None or time.monotonic() > deadline) and not died.exists():
            kill_tree(proc)
            raise RuntimeError(f"{cmd_for.__name__}: rank 1 never died (launcher exit code {proc.returncode})")
        time.sleep(0.005)
    ms = exit_after(proc, float(died.read_text()), cap) * 1000
    if left is not None and ms < cap * 1000:  # a capped launcher's tree was killed by the bench: not counted
        left[cmd_for.__name__] = left.get(cmd_for.__name__, 0) + len(still_there(tree))
    return ms


def ctrl_c_ms(cmd_for, n: int, work: Path) -> float:
    """SIGINT to the launcher once every rank is up -> the launcher's exit."""
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.Popen(cmd_for(n, "ctrl-c", str(out)), env=worker_env(), cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + SANE_CAP
    while len(list(out.glob("up*"))) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            raise RuntimeError(f"{cmd_for.__name__}: the ranks never came up (launcher exit code {proc.returncode})")
        time.sleep(0.005)
    # Interrupted the way a running training is: once nothing in either launcher's tree is
    # still starting. (This toy rank imports no torch; gpuherd's store helper does, and 0.2 s
    # after `up` it was still importing on one of the two cores while the ranks exited.)
    wait_quiet(proc)
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    return exit_after(proc, sent, SANE_CAP) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (the suite in a few minutes)")
    parser.add_argument("--grace", type=int, default=2, help="SIGTERM -> SIGKILL seconds, both launchers")
    parser.add_argument("--cap", type=float, default=None,
                        help="seconds after the death before a launcher is stopped (default 10; 6 with --quick)")
    args = parser.parse_args()
    reps = 2 if args.quick else 8
    args.cap = args.cap or (6.0 if args.quick else 10.0)
    escalation_reps = 2 if args.quick else 4
    with tempfile.TemporaryDirectory(prefix="bench-teardown-") as tmp:
        work = Path(tmp)
        ln = Launchers(work, WORKER, grace_period=args.grace)
        comparisons, left = [], {}
        for how, label in HOW.items():
            cap = args.cap if how == "ignore-sigterm" else SANE_CAP
            for n in (2,) if how in TWO_ONLY else (2, 8):
                comparisons.append(interleaved(
                    f"{n} workers, rank 1 dies by {label}", "ms",
                    ("gpuherd", lambda n=n, how=how, cap=cap: teardown_ms(ln.gpuherd, n, how, cap, work, left)),
                    ("torchrun", lambda n=n, how=how, cap=cap: teardown_ms(ln.torchrun, n, how, cap, work, left)),
                    repeats=escalation_reps if how == "ignore-sigterm" else reps))
        for n in (2, 8):
            comparisons.append(interleaved(
                f"{n} workers, Ctrl-C (SIGINT to the launcher, nothing to save)", "ms",
                ("gpuherd", lambda n=n: ctrl_c_ms(ln.gpuherd, n, work)),
                ("torchrun", lambda n=n: ctrl_c_ms(ln.torchrun, n, work)), repeats=reps))
    notes = [
        f"{reps} interleaved repetitions per row ({escalation_reps} where the others ignore SIGTERM; "
        f"{'quick' if args.quick else 'full'} mode); ratios >1 mean gpuherd exits sooner",
        "measured from the time rank 1 wrote right before dying to the launcher's exit; the other ranks sleep",
        "every process reaped: the launcher's process tree, noted once every rank was up, checked the moment its "
        "exit code came (a process still running, or exited and not reaped, is left over): "
        + ", ".join(f"{name} {count}" for name, count in sorted(left.items()))
        + " left over in all the death rows (a launcher stopped at the cap is not counted: the bench killed its tree)",
        "default settings on both sides (gpuherd renders no report on the exit path: the summary names "
        "`gpuherd report RUN`); Ctrl-C rows: from the SIGINT to the launcher to its exit",
        f"grace period {args.grace} s on both sides: gpuherd `--grace-period {args.grace}`, "
        f"torchrun `--shutdown-timeout {args.grace}`",
        "torchrun ignores `--shutdown-timeout` (and TORCH_ELASTIC_SHUTDOWN_TIMEOUT) when a worker fails: its agent "
        "stops the others via `_stop_workers()` -> `_shutdown()` with the default timeout of 30 s "
        "(torch/distributed/elastic/agent/server/local_elastic_agent.py), so workers that ignore SIGTERM get "
        f"30 s before SIGKILL; it is stopped {args.cap:g} s after the death and counted as {args.cap:g} s, "
        "a lower bound",
    ]
    write_results("teardown", "Teardown latency: a worker dies -> launcher exit (tiny CPU workers, same script)",
                  comparisons, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Cross-node teardown: a worker dies on one node; seconds until the *other* node's
launcher has exited, gpuherd (`--nnodes 2`) vs torchrun (`--nnodes 2 --rdzv-backend c10d`).

Two launchers on localhost stand for two nodes, one worker each, one gloo process
group (bench/multinode_worker.py), interleaved A B A B. torchrun's agents share only
the rendezvous: the surviving node learns of the death when its own worker fails on
the dead peer, or never (capped, reported as the cap: a lower bound). gpuherd
publishes the failure through the job store and the other node tears down.
Writes bench/results/multinode.md.

    python3 bench/bench_multinode.py [--quick] [--cap 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import interleaved, write_results  # noqa: E402
from bench.launchers import TORCHRUN, kill_tree  # noqa: E402

WORKER = ROOT / "bench" / "multinode_worker.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(kind: str, out: Path, mode: str, work: Path) -> list[list[str]]:
    port = _port()
    if kind == "gpuherd":
        return [[sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--nproc", "1", "--nnodes", "2",
                 "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--run-id", out.name, "--grace-period", "5", "--set", f"system.run_root={work / 'logs'}",
                 "--script", str(WORKER), str(out), mode] for r in (0, 1)]
    return [[TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out.name, "--rdzv-conf", f"is_host={r == 0}",
             "--max-restarts", "0", str(WORKER), str(out), mode] for r in (0, 1)]


def seconds_to_other_node_exit(kind: str, mode: str, cap: float, work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    logs = [open(out / f"launcher-node{r}.log", "wb") for r in (0, 1)]  # noqa: SIM115 - closed below
    procs = [subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for cmd, log in zip(_commands(kind, out, mode, work), logs, strict=True)]
    for log in logs:
        log.close()  # the launchers hold their own copies
    exited: dict[int, float] = {}

    def wait(node: int) -> None:
        procs[node].wait()
        exited[node] = time.time()

    waiters = [threading.Thread(target=wait, args=(n,), daemon=True) for n in (0, 1)]
    for w in waiters:
        w.start()
    marker = out / "died"
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text().strip():
        if len(exited) == 2 or time.monotonic() > deadline:
            for p in procs:
                kill_tree(p)
            tail = (out / "launcher-node0.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{kind}: the job ended before the planned death; node 0's launcher said:\n{tail}")
        time.sleep(0.02)
    time.sleep(0.05)
    died_at, node = marker.read_text().split()
    other = 1 - int(node)
    waiters[other].join(timeout=max(0.0, float(died_at) + cap - time.time()))
    seconds = exited[other] - float(died_at) if other in exited else cap
    for p in procs:
        if p.poll() is None:
            kill_tree(p)
    for w in waiters:
        w.join(timeout=10)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions and a 10 s cap instead of 4 and 30 s")
    parser.add_argument("--cap", type=float, default=None)
    args = parser.parse_args()
    reps = 2 if args.quick else 4
    cap = args.cap or (10.0 if args.quick else 30.0)
    comparisons = []
    with tempfile.TemporaryDirectory(prefix="bench-multinode-") as tmp:
        work = Path(tmp)
        for mode, what in (("collective", "survivor in gloo collectives (fails fast on the dead peer)"),
                           ("blocked", "survivor busy, not talking to the peer (as in an NCCL wait)")):
            comparisons.append(interleaved(
                f"worker dies on one node -> other node's launcher exits; {what}", "s",
                ("gpuherd", lambda mode=mode: seconds_to_other_node_exit("gpuherd", mode, cap, work)),
                ("torchrun", lambda mode=mode: seconds_to_other_node_exit("torchrun", mode, cap, work)),
                repeats=reps))
    write_results("multinode", "Cross-node teardown (2 launchers on localhost, 1 worker each)", comparisons, notes=[
        f"{reps} interleaved repetitions; a launcher still running {cap:g} s after the death is stopped and "
        "counted as the cap (a lower bound: under NCCL it would wait for the 10-minute watchdog).",
        "gpuherd: the failing node publishes the root cause through the job store; the other node's agent polls "
        "every 50 ms, then SIGTERM to its workers. torchrun: agents share only the c10d rendezvous.",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

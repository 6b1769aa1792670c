#!/usr/bin/env python3
"""An ordinary worker failure's `alive` checks, several rounds per size: N simulated nodes
(bench/scale_sim.py), each round a join, an abort and every node's check at once, nobody dead.
Prints, per N, each round's seconds until every node had its answer, the reads of node 0's
verdict and the bytes they brought back per node, and the answers that named a node.

    python3 bench/verdict_rounds.py 64 256 [1024] [--rounds 4]

Side by side with the former pace (a node beating once a second during its check too): set
`CHECK_BEAT_S = 1.0` in supervisor/rendezvous/beat_watch.py and run it again (bench/RESULTS.md,
"an `alive` check answered in half a second")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scale_sim import GpuherdJob, roomy  # noqa: E402


def rounds(n: int, count: int) -> list[dict]:
    job = GpuherdJob(n)
    try:
        out = []
        for k in range(count):
            job.join(k, 120)
            if k == 0:
                job.steady(3.0)
            job.abort_fanout(k)
            out.append(job.verdict_fanout(k))
        return out
    finally:
        job.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", nargs="+", type=int)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    roomy(0)
    for n in args.nodes:
        got = rounds(n, args.rounds)
        print(f"{n} nodes: answered after {[round(r['verdict_s'], 2) for r in got]} s; verdict reads per node "
              f"{[round(r['verdict_reads_per_node'], 1) for r in got]}; bytes per node "
              f"{[round(r['verdict_bytes_per_node']) for r in got]}; answers naming a node "
              f"{sum(r['verdict_false'] for r in got)}", flush=True)


if __name__ == "__main__":
    main()

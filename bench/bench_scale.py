#!/usr/bin/env python3
"""The multi-node control plane at scale: N simulated nodes (bench/scale_sim.py: the real node
agent per node, ranks replaced by nothing, processes of 64 nodes each, one real TCPStore
server in a process of its own), gpuherd vs torchrun's c10d rendezvous, for N = 8 ... 1,024.

Per N: join time, store requests per node per second in a steady attempt, and (gpuherd;
torchrun has no such path) abort fan-out (one node publishes a failure -> every node's agent
has it), a node whose processes died (its sockets closed) and one that vanished without
closing anything: seconds until every survivor names it, and false verdicts in the steady
window; an ordinary worker failure's verdict fan-out (every node's `alive` check at once,
nobody dead): seconds until every node has its answer, reads of node 0's verdict and the
bytes they bring back per node. torchrun's c10d side runs where it fits this machine (its
per-node state grows with N and every simulated node decodes it in one shared process).
Writes bench/results/scale.md/json.

    python3 bench/bench_scale.py [--quick] [--nodes 8,64,256,1024] [--c10d-max 64] [--steady 600]
        [--long-steady 600]   (the largest N only: a steady window this long)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_sim import NODES_PER_SHARD, roomy, run_c10d, run_gpuherd  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a 20 s steady window instead of 10 minutes")
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--c10d-max", type=int, default=64,
                        help="the largest N torchrun's side runs at (at 256 its join had not completed after 5 min "
                             "here: every simulated node decodes the growing state in one process)")
    parser.add_argument("--steady", type=float, default=None, help="seconds of steady state per N")
    parser.add_argument("--long-steady", type=float, default=None,
                        help="seconds of steady state at the largest N only (the 10-minute run, once)")
    args = parser.parse_args()
    roomy(0)  # torchrun's side: its N store clients in this process (up to --c10d-max, under the soft limit)
    steady = args.steady if args.steady is not None else (20.0 if args.quick else 600.0)
    sizes = [int(n) for n in args.nodes.split(",")]
    rows = []
    for n in sizes:
        started = time.monotonic()
        ours = run_gpuherd(n, args.long_steady if args.long_steady is not None and n == max(sizes) else steady)
        theirs = run_c10d(n, min(steady, 60.0)) if n <= args.c10d_max else None
        rows.append({"nodes": n, "gpuherd": ours, "c10d": theirs, "seconds": time.monotonic() - started})
        print(f"bench scale: {n} nodes done in {time.monotonic() - started:.0f} s", flush=True)
    lines = [
        f"Simulated nodes in processes of up to {NODES_PER_SHARD} (gpuherd; torchrun's side in one process), "
        "each node with its own store connection(s) and agent state; one TCPStore server (libuv) in its own "
        f"process. Steady window per row (torchrun's side: {min(steady, 60.0):g} s). Requests: store calls "
        "counted by one wrapper around every node's client, both sides alike.",
        "",
        "| nodes | join s (gpuherd / c10d) | rejoin s | store requests per node per s (gpuherd / c10d) | "
        "abort fan-out ms | died (sockets closed): all named s | vanished: all named s | steady window s | "
        "false verdicts |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        o, t = row["gpuherd"], row["c10d"] or {}
        lines.append(
            f"| {row['nodes']} | {_fmt(o['join_s'])} / {_fmt(t.get('join_s'))} | {_fmt(o['rejoin_s'])} | "
            f"{_fmt(o['requests_per_node_s'])} / {_fmt(t.get('requests_per_node_s'))} | "
            f"{o['abort_fanout_s'] * 1000:.0f} | {o['closed_named_s']:.1f}{'' if o['closed_named_ok'] else ' (WRONG NODE)'} | "
            f"{o['vanished_named_s']:.1f}{'' if o['vanished_named_ok'] else ' (WRONG NODE)'} | {o['steady_s']:g} | "
            f"{o['false_verdicts']} |")
    lines += ["", "After a worker failure, every node's `alive` check at once (nobody dead):", "",
              "| nodes | every node answered s | verdict reads per node | store requests per node | "
              "verdict bytes per node | answers naming a node |", "|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        o = row["gpuherd"]
        lines.append(f"| {row['nodes']} | {o['verdict_s']:.1f} | {o['verdict_reads_per_node']:.1f} | "
                     f"{o['verdict_requests_per_node']:.1f} | {o['verdict_bytes_per_node']:.0f} | "
                     f"{o['verdict_false']} |")
    lines.append("")
    lines.append("Store calls by operation in the whole gpuherd run (join, steady, abort, alive checks, two rejoins, "
                 "two deaths):")
    lines.append("")
    for row in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(row["gpuherd"]["requests_by_op"].items()))
        lines.append(f"- {row['nodes']} nodes: {ops}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "scale.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Live recovery where the failures happen, against ft_launcher's restart and torchft's recovery:
seconds from a SIGKILL to the next completed training step, and completed steps trained again,
for each case gpuherd recovers without a restart.

The gpuherd cases (the built-in trainer, bench_live_recovery.py's tiny model, gloo on CPU,
`--max-restarts 1`, the kill at step KILL_AT; nodes are supervisors on this machine):

- multi-node: 2 nodes x 1 rank; rank 1 (node 1) is lost, node 1's warm spare takes it, node 0's
  worker keeps its process.
- spare node: 3 nodes x 1 rank and `--spare-nodes 1` (a fourth node standing by); node 2's
  whole process tree (supervisor, node agent, orphan guard, worker, spare) is SIGKILLed at once,
  the spare node's warm worker takes rank 2.
- shrink: 4 ranks on one node, `--spares 0 --min-replicas 2`; rank 1 is lost, the 3 survivors
  train on with the same global batch (one carries rank 1's data slot).
- multi-node shrink: 2 nodes x 2 ranks, `--spares 0 --min-replicas 2`; rank 3 (node 1) is lost,
  the job's 3 survivors train on across both nodes.
- fsdp: 3 ranks of FSDP2 on one node; rank 1 is lost, the warm spare takes its shard from its
  neighbour's host copy, the survivors go back to that copy's step.

"The next completed step" is the first step record any rank of the job writes after the rebuilt
group formed (the last `live` `rejoined` record after the kill): the group's first step at the
full global batch. The peers, as bench_live_recovery_torchft.py runs them: ft_launcher
restarting every worker of a 2-rank job (bench_restart.py's worker), torchft's 2 replica
groups (the surviving group's next step on half the batch, and the restarted group's first
step contributing again). Rounds rotate the sides. Writes bench/results/recovery_cases.md.

    python3 bench/bench_recovery_cases.py [--quick] [--only CASE ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery import KILL_AT, TINY, _records  # noqa: E402
from bench.bench_live_recovery_torchft import INSTALL, prepare_data, torchft_available, torchft_side  # noqa: E402
from bench.bench_multinode import _port  # noqa: E402
from bench.bench_restart import restart as launcher_restart  # noqa: E402
from bench.compare import Comparison, Tally, rotated, write_results  # noqa: E402
from bench.launchers import Launchers, kill_tree, tree_pids, worker_env  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    nnodes: int  # training nodes (1: a plain one-node run)
    nproc: int  # ranks per node
    flags: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    spare_nodes: int = 0
    lost_node: int | None = None  # this node's whole process tree is killed; else one rank
    lost_rank: int = 1

    @property
    def ranks(self) -> int:
        return self.nnodes * self.nproc


CASES = (
    Case("multi-node", nnodes=2, nproc=1),
    Case("spare node", nnodes=3, nproc=1, spare_nodes=1, flags=("--spare-nodes", "1"), lost_node=2, lost_rank=2),
    Case("shrink", nnodes=1, nproc=4, flags=("--spares", "0", "--min-replicas", "2")),
    Case("multi-node shrink", nnodes=2, nproc=2, flags=("--spares", "0", "--min-replicas", "2"), lost_rank=3),
    Case("fsdp", nnodes=1, nproc=3, overrides=("training.strategy=fsdp",)),
)


def commands(case: Case, work: Path) -> list[list[str]]:
    """One supervisor's command line per node (training nodes first, then spare nodes)."""
    base = [sys.executable, "-m", "supervisor", "--no-report", "--run-id", "r", "--max-restarts", "1",
            "--set", "system.device=cpu", "--nproc", str(case.nproc), "--set", f"system.run_root={work / 'logs'}",
            "--set", f"system.checkpoint_dir={work / 'ckpt'}", *case.flags]
    for item in (*TINY, *case.overrides):
        base += ["--set", item]
    if case.nnodes == 1:
        return [base]
    port = _port()
    return [[*base, "--nnodes", str(case.nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
             "--master-port", str(port)] for node in range(case.nnodes + case.spare_nodes)]


def _all_records(work: Path) -> list[dict]:
    return [r for path in sorted((work / "logs").glob("*/metrics.jsonl")) for r in _records(path)]


def _first_step(records: list[dict], killed: float, lost_rank: int) -> tuple[float, int] | None:
    """(seconds from `killed` to the next completed step, completed steps trained again). After a
    live recovery the next step is the rebuilt group's first (the first step record after the
    last `live` `rejoined` record); after a restart, the lost rank's first (its replacement's:
    a survivor's step in flight may still complete after the kill, which is no recovery)."""
    rebuilt = [r["time"] for r in records if r.get("type") == "live" and r.get("event") == "rejoined"
               and r["time"] > killed]
    steps = [r for r in records if r.get("type") == "step" and "loss" in r]
    after = [r for r in steps if r["time"] > max(rebuilt)] if rebuilt else [
        r for r in steps if r["time"] > killed and r["rank"] == lost_rank]
    if not after:
        return None
    before = max(r["step"] + 1 for r in steps if r["time"] < killed)
    first = min(after, key=lambda r: r["time"])
    return first["time"] - killed, max(0, before - first["step"])


def recovered(case: Case, work: Path, cap: float = 400) -> tuple[float, int] | None:
    """`_first_step` of one run of `case` (a restart too, where the case has no spare), or None
    when the run did not get there or a survivor's node did not end with 0."""
    procs = [subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for cmd in commands(case, work)]
    try:
        deadline = time.monotonic() + cap
        while not any(r.get("type") == "step" and r.get("step", -1) >= KILL_AT for r in _all_records(work)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return None
            time.sleep(0.01)
        if case.lost_node is not None:
            victims = tree_pids(procs[case.lost_node].pid)  # gathered first, then killed together: the machine is gone
        else:
            victims = [[r["pid"] for r in _all_records(work) if r.get("type") == "ready"
                        and r["rank"] == case.lost_rank][-1]]
        killed = time.time()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        survivors = [p for i, p in enumerate(procs) if i != case.lost_node]
        if any(p.wait(timeout=cap) != 0 for p in survivors):
            return None
        return _first_step(_all_records(work), killed, case.lost_rank)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 4")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CASES], help="these gpuherd cases only")
    args = parser.parse_args()
    rounds, with_torchft = (2 if args.quick else 4), torchft_available()
    cases = [c for c in CASES if not args.only or c.name in args.only]
    if not with_torchft:
        print(f"bench: {INSTALL}", file=sys.stderr)
    tally = Tally()
    redone: dict[str, list[int]] = {}

    with tempfile.TemporaryDirectory(prefix="bench-recovery-cases-") as tmp:
        cache = prepare_data(Path(tmp)) if with_torchft else None
        ln = Launchers(Path(tmp), ROOT / "bench" / "blame_worker.py", grace_period=2)

        def gpuherd(case: Case) -> Callable[[], None]:
            def run() -> None:
                got = recovered(case, Path(tempfile.mkdtemp(dir=tmp)))
                tally.add(case.name, None if got is None else got[0])
                if got is not None:
                    redone.setdefault(case.name, []).append(got[1])
            return run

        sides = [gpuherd(c) for c in cases] + [lambda: tally.add("ft_launcher", launcher_restart(ln, "ft_launcher", 120.0))]
        sides += [lambda: torchft_side(Path(tempfile.mkdtemp(dir=tmp)), cache, tally)] if with_torchft else []
        load = rotated(sides, rounds)
    _write(cases, tally, redone, rounds, with_torchft, load)
    return 0


def _write(cases: list[Case], tally: Tally, redone: dict[str, list[int]], rounds: int, with_torchft: bool,
           load: list[float]) -> None:
    peers = [("ft_launcher", "ft_launcher's restart of every worker (2 ranks)")]
    if with_torchft:
        peers += [("torchft full batch", "torchft's restarted group contributing again (2 groups)"),
                  ("torchft survivor", "torchft's surviving group's next step (half the batch: lossy)")]
    comparisons = [Comparison(f"{case.name}, {case.ranks} ranks: kill -> next completed step, vs {text}", "s",
                              tally.side(case.name), tally.side(peer))
                   for case in cases for peer, text in peers]
    notes = [
        f"{rounds} rounds, the sides rotating; runs that did not finish: {tally.unfinished()}.",
        "completed steps trained again: " + "; ".join(f"{key} {sorted(v)}" for key, v in sorted(redone.items()))
        + " (ft_launcher's worker keeps no checkpoint and trains its 40 steps again).",
        f"1-minute load average over the run (2 cores): {min(load):.1f}–{max(load):.1f}.",
        f"gpuherd: the built-in trainer, tiny model, kill at step {KILL_AT}, nodes on one machine; "
        "no gpuherd case reads a checkpoint.",
    ]
    if not with_torchft:
        notes.append(INSTALL + ".")
    write_results("recovery_cases", "Live recovery where the failures happen, vs ft_launcher and torchft",
                  comparisons, notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())

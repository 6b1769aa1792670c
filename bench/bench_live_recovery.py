#!/usr/bin/env python3
"""Live recovery vs restarts: rank 1 of N is killed (SIGKILL) mid-run; seconds from the kill to the
next completed training step, and completed steps trained again.

- gpuherd live: the built-in trainer (tiny Llama, DDP over gloo), `--max-restarts 1` (one warm
  spare by default): the spare takes rank 1, the others keep running, no checkpoint read.
- gpuherd restart: the same run with `--spares 0`, a checkpoint every 10 steps: every worker
  restarts and resumes the newest checkpoint.
- ft_launcher restart: NVIDIA's launcher (`--max-restarts 1`) restarting the worker of
  bench_restart.py (gloo all_reduce steps; it keeps no checkpoint, so it trains its 40 steps again).

Rounds alternate the sides. Writes bench/results/live_recovery.md.

`--first-step`: the debug preset (2 ranks), rank 1 SIGKILLed at step 30 and recovered live:
the first step after the rebuilt group formed (from each rank's `live` `rejoined` record to
its next step record, the slower rank's) against the median step before the kill. Goal:
<= 1.3x (the spare rehearsed that step before it was needed: worker/spare.py).

    python3 bench/bench_live_recovery.py [--quick] [--gpu-only] [--first-step]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_restart import restart as launcher_restart  # noqa: E402
from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.launchers import Launchers, kill_tree, worker_env  # noqa: E402

KILL_AT = 25  # a step between two checkpoints (every 10): the restart redoes 5
TINY = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
        "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", "training.max_steps=45", "training.warmup_steps=5", "training.log_every=1",
        "training.eval_every=0", "training.save_every=10"]
DEBUG_PRESET = ["data.dataset=dummy", "training.max_steps=40", "training.log_every=1", "training.eval_every=0",
                "training.save_every=0"]
DEBUG_KILL_AT = 30
FT_STEPS_REDONE = 40  # bench/blame_worker.py is killed at step 40 and starts again from 0


def _records(path: Path) -> list[dict]:
    out = []
    for line in (path.read_bytes().splitlines() if path.exists() else []):
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out


def _command(work: Path, n: int, device: str, live: bool, overrides: list[str] = TINY) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "r", "--max-restarts", "1",
           "--set", f"system.run_root={work / 'logs'}", "--set", f"system.checkpoint_dir={work / 'ckpt'}"]
    cmd += ["--set", "system.device=cpu", "--nproc", str(n)] if device == "cpu" else ["--gpus", ",".join(
        map(str, range(n)))]
    if not live:
        cmd += ["--spares", "0"]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def trained(work: Path, n: int, device: str, live: bool, cap: float = 300, overrides: list[str] = TINY,
            kill_at: int = KILL_AT) -> tuple[float, int, list[dict]] | None:
    """(seconds from the kill to the next completed step, completed steps trained again, the
    run's records), or None."""
    metrics = work / "logs" / "r" / "metrics.jsonl"
    proc = subprocess.Popen(_command(work, n, device, live, overrides), cwd=work, env=worker_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + cap
        while not any(r.get("type") == "step" and r.get("step", -1) >= kill_at for r in _records(metrics)):
            if time.monotonic() > deadline or proc.poll() is not None:
                return None
            time.sleep(0.01)
        victim = [r["pid"] for r in _records(metrics) if r.get("type") == "ready" and r["rank"] == 1][-1]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        if proc.wait(timeout=cap) != 0:
            return None
        steps = [r for r in _records(metrics) if r.get("type") == "step"]
        before = max(r["step"] + 1 for r in steps if r["time"] < killed)
        # rank 1's process is dead: a rank-1 step after the kill is its replacement's (a survivor's
        # step in flight may still complete after the kill, which is no recovery)
        after = [r for r in steps if r["time"] > killed and r["rank"] == 1]
        first = min(after, key=lambda r: r["time"])
        return first["time"] - killed, max(0, before - first["step"]), _records(metrics)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def first_step(records: list[dict]) -> tuple[float, float, float] | None:
    """(the first step after the rebuilt group formed, the slower rank's; the median step before
    the failure; the median step after that first one), from a live recovery's records. Both
    medians: on a shared machine the load drifts over a run."""
    rejoined = {r["rank"]: r["time"] for r in records if r.get("type") == "live" and r.get("event") == "rejoined"}
    steps = [r for r in records if r.get("type") == "step" and "loss" in r]
    if not rejoined or not steps:
        return None
    firsts = [min((r["time"] for r in steps if r["rank"] == rank and r["time"] > t), default=None)
              for rank, t in rejoined.items()]
    if None in firsts:
        return None
    rank0 = sorted(r["time"] for r in steps if r["rank"] == 0)
    before = [t for t in rank0 if t < min(rejoined.values())]
    after = [t for t in rank0 if t >= max(firsts)]
    ahead = [b - a for a, b in zip(before[2:], before[3:])]  # the first steps are no typical step
    behind = [b - a for a, b in zip(after, after[1:])]
    if not ahead or not behind:
        return None
    first = max(f - rejoined[rank] for f, rank in zip(firsts, rejoined, strict=True))
    return first, statistics.median(ahead), statistics.median(behind)


def first_step_rows(device: str, rounds: int) -> None:
    seconds: dict[str, list[float]] = {"first": [], "before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench-live-first-") as tmp:
        for _ in range(rounds):
            got = trained(Path(tempfile.mkdtemp(dir=tmp)), 2, device, True, cap=900, overrides=DEBUG_PRESET,
                          kill_at=DEBUG_KILL_AT)
            measured = None if got is None else first_step(got[2])
            if measured is not None:
                for key, value in zip(seconds, measured, strict=True):
                    seconds[key].append(value)
    ratios = [(f / b, f / a) for f, b, a in zip(seconds["first"], seconds["before"], seconds["after"], strict=True)]
    write_results("live_recovery_first_step", "Live recovery: the first step after the rebuilt group", [
        Comparison(f"{device}, debug preset, 2 ranks, rank 1 SIGKILLed at step {DEBUG_KILL_AT}: the first step "
                   f"after the rebuilt group vs the median step {which}", "s",
                   Side("first step", seconds["first"] or [float("nan")]),
                   Side(f"median step {which}", seconds[key] or [float("nan")]))
        for key, which in (("before", "before the kill"), ("after", "after the recovery"))],
        notes=[f"{rounds} runs, {len(ratios)} measured; first step / median step (before the kill, after the "
               f"recovery) per run: {', '.join(f'{b:.2f}, {a:.2f}' for b, a in ratios)} (goal <= 1.3)",
               "first step: from each rank's `live` `rejoined` record (group formed, state handed over) to its next "
               "step record, the slower rank's; medians: rank 0's step intervals before the kill (the first two "
               "left out) and after the first step that followed the recovery."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 4")
    parser.add_argument("--gpu-only", action="store_true", help="the GPU rows: NCCL on 2 GPUs (needs 2 CUDA GPUs)")
    parser.add_argument("--first-step", action="store_true", help="only the first step after a recovery (debug preset)")
    args = parser.parse_args()
    rounds, device = (2 if args.quick else 4), ("cuda" if args.gpu_only else "cpu")
    if args.first_step:
        first_step_rows(device, rounds)
        return 0
    sizes = (2,) if args.gpu_only else (2, 4)
    seconds: dict[str, list[float]] = {}
    redone: dict[str, list[int]] = {}
    failed: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        ln = Launchers(Path(tmp), ROOT / "bench" / "blame_worker.py", grace_period=2)
        for i in range(rounds):
            for n in sizes:
                for live in ((True, False) if i % 2 == 0 else (False, True)):
                    key = f"gpuherd {'live' if live else 'restart'} x{n}"
                    got = trained(Path(tempfile.mkdtemp(dir=tmp)), n, device, live)
                    failed[key] = failed.get(key, 0) + (got is None)
                    if got is not None:
                        seconds.setdefault(key, []).append(got[0])
                        redone.setdefault(key, []).append(got[1])
            if device == "cpu":
                got_ft = launcher_restart(ln, "ft_launcher", 120.0)
                failed["ft_launcher"] = failed.get("ft_launcher", 0) + (got_ft is None)
                if got_ft is not None:
                    seconds.setdefault("ft_launcher", []).append(got_ft)
    _write(seconds, redone, failed, rounds, sizes, device)
    return 0


def _side(name: str, seconds: dict[str, list[float]]) -> Side:
    return Side(name, seconds.get(name) or [float("nan")])


def _write(seconds: dict[str, list[float]], redone: dict[str, list[int]], failed: dict[str, int], rounds: int,
           sizes: tuple[int, ...], device: str) -> None:
    comparisons = []
    for n in sizes:
        live = Side("gpuherd live", seconds.get(f"gpuherd live x{n}") or [float("nan")])  # the row names the ranks
        comparisons.append(Comparison(f"{device}, {n} ranks: kill -> next completed step, vs gpuherd's restart", "s",
                                      live, _side(f"gpuherd restart x{n}", seconds)))
        if device == "cpu":
            comparisons.append(Comparison(f"{device}, {n} ranks: kill -> next completed step, vs ft_launcher's "
                                          "restart (2 ranks)", "s", live, _side("ft_launcher", seconds)))
    steps = "; ".join(f"{key}: {sorted(values)}" for key, values in sorted(redone.items()))
    write_results("live_recovery", "Live recovery vs restarts (rank 1 SIGKILLed)", comparisons, notes=[
        f"{rounds} alternating rounds; runs that did not finish: "
        + ", ".join(f"{key} {count}" for key, count in sorted(failed.items())) + ".",
        f"completed steps trained again: {steps}; ft_launcher: {FT_STEPS_REDONE} (its worker keeps no checkpoint).",
        "checkpoint reads: gpuherd live 0 (the spare takes the survivors' state by broadcast); gpuherd restart 1.",
        f"gpuherd: built-in trainer, tiny model, checkpoint every 10 steps, kill at step {KILL_AT}; ft_launcher: "
        "bench_restart.py's worker and measure (SIGKILL -> first step of the restarted workers).",
    ])


if __name__ == "__main__":
    raise SystemExit(main())

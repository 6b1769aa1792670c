#!/usr/bin/env python3
"""What the liveness bookkeeping behind hang blame and straggler detection costs a step.

Two measures, both on the built-in worker's code:

1. per step, in microseconds: the calls the training loop makes on gpuherd.liveness
   (step, three `doing`, a collective begin/end, the stop vote's collective) with the
   reporting thread running and writing its records to a pipe, against the same loop
   without them; best of several rounds (a disturbance only ever slows a round down).
2. end to end: `worker.train.run` (strategy single, the CPU model of bench_worker.py)
   with the liveness on versus a no-op stand-in, interleaved; steps/s.

The supervisor's side (the straggler windows) runs in the supervisor's process, not in
the workers: it takes nothing from a step. Writes bench/results/straggler.md.

    python3 bench/bench_straggler.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_worker import time_worker  # noqa: E402
from bench.compare import Comparison, Side, write_results  # noqa: E402
from gpuherd.liveness import Liveness  # noqa: E402
from gpuherd.status_channel import StatusWriter  # noqa: E402

CALLS_PER_STEP = 7


class NoLiveness(Liveness):
    """The worker's liveness with every call a no-op and no thread: the "off" side."""

    def start(self) -> Liveness:
        return self

    def at(self, *_a, **_k) -> None: ...
    def step(self, *_a, **_k) -> None: ...
    def doing(self, *_a, **_k) -> None: ...
    def collective_begin(self, *_a, **_k) -> None: ...
    def collective_end(self, *_a, **_k) -> None: ...


def per_step_us(steps: int, rounds: int) -> float:
    """Best-of-rounds cost of one step's liveness calls, thread running, in microseconds."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    live = Liveness(StatusWriter(write_fd, 0), interval=0.05).start()
    best = float("inf")
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for n in range(steps):
                live.step(n)
                with live.collective("all_reduce (stop vote)"):
                    pass
                live.doing("data loading")
                live.doing("forward/backward")
                live.collective_begin("all_reduce (gradients)")
                live.collective_end()
                live.doing("optimizer step")
            best = min(best, (time.perf_counter() - start) / steps)
            try:
                while os.read(read_fd, 1 << 16):
                    pass
            except BlockingIOError:
                pass
    finally:
        live.stop()
        os.close(read_fd)
        os.close(write_fd)
    return best * 1e6


def end_to_end(repeats: int, steps: int) -> tuple[list[float], list[float]]:
    import worker.train as train

    on, off = [], []
    real = train.Liveness
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for _ in range(repeats):  # interleaved: the machine's load hits both alike
            train.Liveness = real
            on.append(time_worker(tmp, steps, "debug.nan_detection=false"))
            train.Liveness = NoLiveness
            off.append(time_worker(tmp, steps, "debug.nan_detection=false"))
    train.Liveness = real
    return on, off


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 interleaved repeats of 30 steps instead of 6 of 40")
    args = parser.parse_args()
    repeats, steps = (4, 30) if args.quick else (6, 40)
    # One intra-op thread: OpenMP threads spin while they wait, and on a machine busier than its
    # cores that spinning, not the code under test, decides the step time.
    torch.set_num_threads(1)
    micro = per_step_us(20_000, 5)
    on, off = end_to_end(repeats, steps)
    comparison = Comparison("built-in worker, strategy single, CPU model of bench_worker", "steps/s",
                            Side("liveness on", on), Side("liveness off", off), lower_is_better=False)
    step_ms = 1000 / max(max(on), max(off))  # the least disturbed step of this model on this machine
    write_results("straggler", "Liveness cost (hang blame + straggler detection)", [comparison], notes=[
        f"per step: {micro:.1f} us for the loop's {CALLS_PER_STEP} liveness calls with the reporting thread "
        f"running (best of 5 rounds of 20,000 steps): {100 * micro / 1000 / step_ms:.4f}% of this model's "
        f"{step_ms:.0f} ms CPU step, {100 * micro / 1000 / 10:.2f}% of a 10 ms step; the goal is under 1%.",
        f"end to end, best run of each side (a disturbance only ever slows a run down): on/off = "
        f"{max(on) / max(off):.3f}; {repeats} interleaved repeats of {steps} steps, first 6 untimed. On this "
        "shared 2-core machine runs of one side differ by more than the cost being measured: the per-step "
        "figure above is the one to trust.",
        "the supervisor's straggler windows run in the supervisor, not in the workers.",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""A test tool: slow one process down by a factor from outside, without touching its code.

A stop/continue duty cycle: every `period` seconds the process gets SIGCONT, runs for
`period / factor`, then SIGSTOP for the rest (each stop sized from the times measured so far,
so that the process runs 1/factor of the wall time even when the sleeps overshoot on a loaded
host). A CPU-bound process (a CPU rank of the built-in
trainer, a `--script` on CPU) then makes progress at 1/factor of its speed; its peers wait
for it in every collective, as for a throttled GPU or a degraded link. The period is jittered
(+-20%) so that nothing sampling the process at a fixed rate (the supervisor reads /proc every
0.5 s) always lands in the same phase of the cycle.

What it slows is the *process*: a new process (a warm spare) on the same machine runs at full
speed, so on CPU this shows the move-out's mechanism. On a GPU the cause is usually the device
(a thermal or power cap, a bad link), and only a replacement on another device helps.

On a host whose cores are shared by more processes than it has, a process stopped part of the
time gets more of the CPU while it runs (the scheduler favours a process that slept), so a
wall-time cycle slows it by less than the factor (about 2x for a factor of 4 with 4 ranks on 2
loaded cores). With `--measure S` it first measures the process's own CPU rate for S seconds,
then holds it at 1/factor of that (stops of at most 0.5 s): its progress, not its wall time.

It stops when the process is gone, and leaves it running (SIGCONT) when stopped itself.

    python bench/slow_rank.py PID FACTOR [--measure SECONDS] [--for SECONDS] [--period SECONDS]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time

import psutil

PERIOD_S = 0.05
MAX_STOP_S = 0.5  # --measure: the longest stop (a rank stopped 3 s is a hang verdict)


class SlowDown:
    """The duty cycle on `pid`, on a thread of its own (`start`, `stop`). With `measure` seconds,
    the cycle holds its CPU rate at 1/factor of what it was over those seconds instead of its wall
    time."""

    def __init__(self, pid: int, factor: float, period: float = PERIOD_S, measure: float = 0.0) -> None:
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.pid, self.factor, self.period, self.measure = pid, factor, period, measure
        self.rate: float | None = None  # `measure`: its CPU rate before (CPU seconds per second)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slow-{pid}", daemon=True)
        self.cycles = 0

    def start(self) -> SlowDown:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        (self._by_cpu if self.measure > 0 else self._by_wall)()

    def _by_cpu(self) -> None:
        """Its own CPU rate measured for `measure` s (unhindered), then held at 1/factor of it: it is
        stopped whenever its CPU time since then is over that, for at most MAX_STOP_S at a time
        (never a stop that looks like a hang, and no wait on peers that wait for it)."""
        proc = psutil.Process(self.pid)
        t0, c0 = time.monotonic(), _cpu(proc)
        self._stop.wait(self.measure)
        t1, c1 = time.monotonic(), _cpu(proc)
        rate = (c1 - c0) / max(1e-6, t1 - t0)
        self.rate = rate
        stopped_at = None
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                ahead = _cpu(proc) - c1 > rate * (now - t1) / self.factor
                if stopped_at is not None and (not ahead or now - stopped_at > MAX_STOP_S):
                    os.kill(self.pid, signal.SIGCONT)
                    stopped_at = None
                    self._stop.wait(self.period / self.factor)  # it runs a little at least
                    continue
                if stopped_at is None and ahead:
                    os.kill(self.pid, signal.SIGSTOP)
                    stopped_at = now
                    self.cycles += 1
                self._stop.wait(self.period / 5)
        except (ProcessLookupError, psutil.NoSuchProcess):
            return
        finally:
            _release(self.pid)

    def _by_wall(self) -> None:
        """Each stop lasts what keeps the stopped share of the time at 1 - 1/factor, measured: on a
        loaded host a sleep overshoots, and a cycle that only slept its nominal lengths would drift
        toward half and half (a slowdown near 2x whatever the factor)."""
        ran = stopped = 0.0
        try:
            while not self._stop.is_set():
                period = self.period * random.uniform(0.8, 1.2)
                t0 = time.monotonic()
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(period / self.factor)
                t1 = time.monotonic()
                os.kill(self.pid, signal.SIGSTOP)
                ran += t1 - t0
                self.cycles += 1
                self._stop.wait(max(0.0, ran * (self.factor - 1) - stopped))
                stopped += time.monotonic() - t1
        except ProcessLookupError:
            return
        finally:
            _release(self.pid)


def _release(pid: int) -> None:
    """Leave it running."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _cpu(p: psutil.Process) -> float:
    times = p.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("factor", type=float, help="4: a quarter of its speed")
    parser.add_argument("--for", dest="seconds", type=float, default=None,
                        help="then let it run (default: until it exits)")
    parser.add_argument("--period", type=float, default=PERIOD_S)
    parser.add_argument("--measure", type=float, default=0.0,
                        help="seconds to measure its CPU rate first; then that rate is held at 1/factor")
    args = parser.parse_args()
    slow = SlowDown(args.pid, args.factor, args.period, args.measure).start()
    try:
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while slow.running and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        slow.stop()


if __name__ == "__main__":
    main()

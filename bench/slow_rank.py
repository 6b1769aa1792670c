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
loaded cores). Given its peers' pids (`--peers`), the cycle holds its CPU time at 1/factor of
the peers' median instead: its progress, not its wall time.

It stops when the process is gone, and leaves it running (SIGCONT) when stopped itself.

    python bench/slow_rank.py PID FACTOR [--peers PID ...] [--for SECONDS] [--period SECONDS]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time

import psutil

PERIOD_S = 0.05


class SlowDown:
    """The duty cycle on `pid`, on a thread of its own (`start`, `stop`). With `peers` (the pids of
    the processes it is compared with), the cycle holds its CPU time at 1/factor of theirs (the
    median's) instead of its wall time."""

    def __init__(self, pid: int, factor: float, period: float = PERIOD_S, peers: list[int] = ()) -> None:
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.pid, self.factor, self.period, self.peers = pid, factor, period, list(peers)
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
        (self._by_cpu if self.peers else self._by_wall)()

    def _by_cpu(self) -> None:
        """Stopped whenever its CPU time since the start is over 1/factor of its peers' median: on a
        host whose cores are shared, a process stopped part of the time gets more of the CPU while
        it runs (the scheduler favours it after its sleep), so a wall-time cycle slows it by less
        than the factor; this holds its progress, not its wall time, at 1/factor."""
        procs = [psutil.Process(p) for p in (self.pid, *self.peers)]
        start = [_cpu(p) for p in procs]
        stopped = False
        try:
            while not self._stop.is_set():
                now = [_cpu(p) - s for p, s in zip(procs, start)]
                ahead = now[0] > statistics.median(now[1:]) / self.factor
                if ahead != stopped:
                    os.kill(self.pid, signal.SIGSTOP if ahead else signal.SIGCONT)
                    stopped = ahead
                    self.cycles += ahead
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
    parser.add_argument("--for", dest="seconds", type=float, default=None, help="then let it run (default: until it exits)")
    parser.add_argument("--period", type=float, default=PERIOD_S)
    parser.add_argument("--peers", type=int, nargs="*", default=[],
                        help="pids it is compared with: its CPU time is held at 1/factor of theirs")
    args = parser.parse_args()
    slow = SlowDown(args.pid, args.factor, args.period, args.peers).start()
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

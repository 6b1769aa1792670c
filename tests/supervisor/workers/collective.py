"""A torchrun-style gloo worker with gpuherd's liveness thread; each test picks every rank's behaviour.

    python collective.py STEPS BEHAVIOUR_RANK0 BEHAVIOUR_RANK1 ...   (missing ranks: "train")

Each step: about 20 ms of compute, then an all_reduce marked as a collective in the
liveness whereabouts, then a step record. Behaviours:

    train        just that
    stop@N       at step N, in its compute, the rank SIGSTOPs itself (state T)
    sleep@N      at step N the rank sleeps before the all_reduce it never enters
    dstate@N     at step N the rank's main thread goes into uninterruptible sleep (state D):
                 posix_spawn's vfork waits for a child that blocks opening a FIFO nobody writes
    slow:S       S seconds more compute every step: a straggler
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpuherd.liveness import Liveness
from gpuherd.status_channel import StatusWriter
from worker.collectives import dump_collective_trace

RANK = int(os.environ["RANK"])
STEPS = int(sys.argv[1])
SPEC = sys.argv[2 + RANK] if len(sys.argv) > 2 + RANK else "train"
NAME, _, ARG = SPEC.replace("@", ":").partition(":")
COMPUTE_S = 0.02


def compute(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def uninterruptible_sleep() -> None:
    fifo = Path(tempfile.mkdtemp(prefix="gpuherd-dstate-")) / "fifo"
    os.mkfifo(fifo)
    os.posix_spawn("/bin/true", ["true"], os.environ,
                   file_actions=[(os.POSIX_SPAWN_OPEN, 3, str(fifo), os.O_RDONLY, 0)])


def misbehave(step: int, live: Liveness) -> None:
    if NAME not in ("stop", "sleep", "dstate") or step != int(ARG):
        return
    print(f"rank {RANK}: {NAME} at step {step}", file=sys.stderr, flush=True)
    if NAME == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif NAME == "sleep":
        live.doing("preparing the next batch")
        time.sleep(600)
    else:
        uninterruptible_sleep()


def main() -> int:
    status = StatusWriter.from_env(RANK)
    trace_dir = os.environ.get("GPUHERD_TRACE_DIR")
    live = Liveness(status, trace_dir=Path(trace_dir) if trace_dir else None, dump=dump_collective_trace).start()
    live.at("rendezvous")
    dist.init_process_group("gloo")
    total = torch.zeros(1)
    for step in range(STEPS):
        live.step(step)
        live.doing("compute")
        compute(COMPUTE_S + (float(ARG) if NAME == "slow" else 0.0))
        misbehave(step, live)
        with live.collective("all_reduce"):
            dist.all_reduce(total)
        status.send("step", step=step, max_steps=STEPS)
    live.at("shutdown")
    status.send("done", step=STEPS)
    live.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

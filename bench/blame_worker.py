"""The worker of the side-by-side hang and restart benchmarks, the same script under
gpuherd, NVIDIA's ft_launcher and torchrun: gloo all_reduce steps of about 20 ms,
gpuherd's liveness thread (a no-op outside gpuherd) and ft's RankMonitorClient
heartbeats (only under ft_launcher, which learns its timeouts in-run from them after
LEARN_AT steps, as its documentation suggests).

    python blame_worker.py OUT_DIR hang      rank 1 stops itself (SIGSTOP) at step STOP_AT;
                                             OUT_DIR/hung holds the time just before
    python blame_worker.py OUT_DIR restart   attempt 0: rank 1 kills itself (SIGKILL) at step
                                             STOP_AT (OUT_DIR/killed); attempt 1: rank 0 writes
                                             OUT_DIR/first-step after its first step, then all exit 0
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpuherd.liveness import Liveness
from ft_heartbeat import ft_client
from gpuherd.status_channel import StatusWriter

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STOP_AT, LEARN_AT, STEP_S = 40, 30, 0.02


def mark(name: str) -> None:
    (OUT / name).write_text(repr(time.time()))


def main() -> int:
    status = StatusWriter.from_env(RANK)
    live = Liveness(status).start()
    ft = ft_client()
    dist.init_process_group("gloo")
    total = torch.zeros(1)
    steps = STOP_AT + 10 if MODE == "restart" and ATTEMPT > 0 else 10**6
    for step in range(steps):
        live.step(step)
        time.sleep(STEP_S)  # the "compute"
        if step == STOP_AT and RANK == 1 and ATTEMPT == 0:
            mark("hung" if MODE == "hang" else "killed")
            os.kill(os.getpid(), signal.SIGSTOP if MODE == "hang" else signal.SIGKILL)
        with live.collective("all_reduce"):
            dist.all_reduce(total)
        if step == 0 and RANK == 0 and ATTEMPT > 0:
            mark("first-step")
        status.send("step", step=step, max_steps=steps)
        if ft is not None:
            ft.send_heartbeat()
            if step == LEARN_AT:
                ft.calculate_and_set_hb_timeouts()
    status.send("done", step=steps)
    live.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

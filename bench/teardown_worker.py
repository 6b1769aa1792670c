"""A torchrun-style worker for bench_teardown.py.

Every rank marks itself up; once all are (and the bench wrote OUT/go: it noted every process of
the launcher's tree), rank 1 writes the time of its death to
OUT/died and dies as argv[1] says: `exception` (an uncaught RuntimeError), `exit`
(os._exit(1)), `sigkill` (SIGKILL to itself; `sigkill-torch`: once every rank imported torch
and joined a gloo process group), or `ignore-sigterm` (os._exit(1)
while every other rank ignores SIGTERM, so the launcher has to escalate to SIGKILL).
The other ranks sleep until the launcher ends them. `ctrl-c`: nobody dies, every rank
sleeps (Python's default SIGINT handler, nothing to save) until the bench sends the
launcher SIGINT.

    teardown_worker.py HOW OUT
"""

import os
import signal
import sys
import time
from pathlib import Path

how, out = sys.argv[1], Path(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if how.endswith("-torch"):  # as a training script is when it dies: torch imported, its process group formed
    import torch.distributed as dist

    dist.init_process_group("gloo")
    how = how.removesuffix("-torch")
if how == "ignore-sigterm" and rank != 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(out / f"up{rank}").touch()
if rank != 1 or how == "ctrl-c":
    time.sleep(600)
    sys.exit(0)
while len(list(out.glob("up*"))) < world or not (out / "go").exists():  # go: the bench noted every process
    time.sleep(0.01)
(out / "died.tmp").write_text(repr(time.time()))
os.replace(out / "died.tmp", out / "died")
if how == "exception":
    raise RuntimeError("rank 1 fails")
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(1)

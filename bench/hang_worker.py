"""A torchrun-style worker for bench_hang.py: heartbeats through gpuherd's status
channel (a no-op under torchrun), then rank 1 stops as if stuck in a collective
and records when; the other ranks keep training."""

import os
import sys
import time
from pathlib import Path

from gpuherd.status_channel import StatusWriter

rank = int(os.environ["RANK"])
status = StatusWriter.from_env(rank)
for step in range(10):
    status.send("step", step=step, max_steps=1000)
    time.sleep(0.1)
if rank == 1:
    (Path(sys.argv[1]) / "hung").write_text(repr(time.time()))
    time.sleep(3600)
for step in range(10, 100000):
    status.send("step", step=step, max_steps=1000)
    time.sleep(0.1)

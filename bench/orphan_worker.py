"""A torchrun-style worker for bench_orphans.py: forks one child (a data-loader
stand-in), records both pids, then sleeps until killed."""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
if os.fork() == 0:
    (out / f"child-{os.getpid()}").touch()
    time.sleep(3600)
    os._exit(0)
(out / f"worker-{os.getpid()}").touch()
time.sleep(3600)

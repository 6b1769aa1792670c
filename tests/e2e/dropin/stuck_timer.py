"""A rank stuck inside a torch.distributed.elastic.timer scope: the launcher's file timer server
(TORCHELASTIC_ENABLE_FILE_TIMER=1) must kill it. Rank 0 finishes at once; rank 1 hangs."""

import os
import sys
import time

import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=60, scope="fast step"):
    pass  # a timer that ends in time is released, and nothing happens
if os.environ["RANK"] == "1":
    with timer.expires(after=1, scope="stuck step"):
        time.sleep(120)
sys.stdout.write(f"rank {os.environ['RANK']} done, timers on {os.environ['TORCHELASTIC_TIMER_FILE']}\n")

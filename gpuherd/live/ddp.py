"""A script's DistributedDataParallel wrapper and optimizer, made to live through a lost peer.

- The gradient all-reduce goes through a communication hook (`SafeReduce`) that does what DDP's
  own does (each gradient times 1/world, then a sum) but does not raise when the group breaks:
  the error is kept (`broken`), this rank's connections of the group are shut down at once (so a
  survivor waiting on this one in a collective is freed: gloo gives a rank waiting on a live peer
  no error), and backward ends. The loop's `loss.backward()` returns as usual. It also tells the
  rank's pace (gpuherd/live/pace.py) when a bucket is handed over and when its all-reduce is done.
- `optimizer.step()` does nothing while the group is broken: the model and the optimizer stay
  as they were after the last completed step, which is what the rebuilt group goes on from.
- `rebuild` makes the same wrapper object (the one the script holds) anew over the rebuilt
  default group: its constructor's own arguments, no broadcast, the gradient buckets of the
  group's source (gpuherd/ddp_buckets.py: else the sums of 3+ ranks differ in their last bits).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpuherd.broken_group import is_peer_loss
from gpuherd.ddp_buckets import Buckets, starting_buckets
from gpuherd.live.pace import StepPace

INIT_ARGS = "_gpuherd_init_args"  # on a wrapper: the (args, kwargs) its constructor was called with


class SafeReduce:
    """DDP's all-reduce, which keeps a lost peer's error instead of raising it."""

    def __init__(self, on_lost: Callable[[str], None], pace: StepPace | None = None) -> None:
        """`pace`: told when a bucket is handed over and when its all-reduce completes (gpuherd/live/pace.py)."""
        self.on_lost, self.pace = on_lost, pace
        self.broken: str | None = None  # what the collective raised, one line
        self.keep = True  # False: this rank cannot be recovered live after all, a lost peer raises as without gpuherd
        self._lock = threading.Lock()

    def install(self, ddp: Any) -> None:
        ddp.register_comm_hook(None, self._hook)

    def _hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self.broken is not None:
            return _done(buffer)
        if self.pace is not None:
            self.pace.ready()
        world = dist.get_world_size()
        buffer.mul_(1.0 / world)  # as DDP's reducer scales a gradient when it copies it into its bucket
        try:
            future = dist.all_reduce(buffer, async_op=True).get_future()
        except Exception as exc:  # noqa: BLE001 - a peer loss is kept; anything else is raised
            self._failed(exc)
            return _done(buffer)

        def reduced(fut: torch.futures.Future) -> torch.Tensor:
            try:
                value = fut.value()[0]
                if self.pace is not None:
                    self.pace.reduced()
                return value
            except Exception as exc:  # noqa: BLE001 - a peer loss is kept; anything else is raised
                self._failed(exc)
                return buffer
        return future.then(reduced)

    def _failed(self, exc: BaseException) -> None:
        if not self.keep or not is_peer_loss(exc):
            raise exc
        with self._lock:
            first = self.broken is None
            if first:
                self.broken = " ".join(str(exc).split())[:200]
        if first:
            self.on_lost(self.broken)


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__ import annotations`)
SafeReduce._hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def skip_when_broken(optimizer: Any, reduce: SafeReduce) -> None:
    """`optimizer.step()` is skipped while the group is broken (its gradients are not the group's)."""
    step = optimizer.step

    def step_unless_broken(*args: Any, **kwargs: Any) -> Any:
        if reduce.broken is not None:
            return None
        return step(*args, **kwargs)
    optimizer.step = step_unless_broken


def drop_group(ddp: Any) -> None:
    """Let go of the broken group: the reducer, its logger and the wrapper hold it (as the
    trainer's DDP engine does, worker/engines/ddp.py)."""
    for attr in ("reducer", "logger", "process_group"):
        if hasattr(ddp, attr):
            delattr(ddp, attr)


def rebuild(ddp: Any, buckets: Buckets | None) -> None:
    """The script's wrapper, made anew in place over the (rebuilt) default group."""
    from torch.nn.parallel import DistributedDataParallel

    args, kwargs = getattr(ddp, INIT_ARGS, ((), {}))
    kwargs = {k: v for k, v in kwargs.items() if k not in ("process_group", "device_mesh", "init_sync")}
    training, sync = ddp.training, getattr(ddp, "require_backward_grad_sync", True)
    with starting_buckets(buckets):
        DistributedDataParallel.__init__(ddp, ddp.module, *args, init_sync=False, **kwargs)
    ddp.train(training)
    ddp.require_backward_grad_sync = sync

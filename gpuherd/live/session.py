"""A script's live recovery inside one rank (gpuherd/live/__init__.py is the script's door).

The script's loop runs `for step in session.steps(range(...))`; between two steps the session
marks where the rank stands (the step, the script's position, every RNG: a few KB, no device
sync). A peer lost inside a step does not raise in the script: the gradient all-reduce keeps
the error and the optimizer step is skipped (gpuherd/live/ddp.py), so the step ends with the
model and optimizer as they were after the last completed step. At the next step boundary the
rank leaves the broken group, joins the rebuilt one (the same store, prefix
`gpuherd-live/<generation>`, a warm spare in the lost rank's place), and the group agrees on a
source (the lowest rank among those with the most completed steps, as the built-in trainer's
recovery: worker/live_recovery.py), whose model, optimizer, position and RNG every other rank
takes by broadcast (gpuherd/state_broadcast.py). The loop then goes on at the source's step: the
step in flight is done again, at most one completed step is redone. A newcomer (the spare)
runs the script from its start; its `init_process_group` joined the rebuilt group and its DDP
constructor made no broadcast (gpuherd/live/hooks.py), and `attach` takes the source's state.

The supervisor hears the same status records as from the built-in trainer (`live` able,
lost_peer, rejoined, first_step; `step`; `phase`), so it decides, accounts and says the same.
The `step` records carry the rank's compute per step (gpuherd/live/pace.py), so a rank slower
than its peers is named and moved out live to a warm spare as the trainer's is
(supervisor/health/straggler_moves.py).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from gpuherd import contract
from gpuherd.broken_group import connections, leave_broken_group, sever_peer_connections
from gpuherd.ddp_buckets import gradient_buckets
from gpuherd.live import ddp as live_ddp
from gpuherd.live import position as pos
from gpuherd.broken_group import join_rebuilt
from gpuherd.live.hooks import HOOKS, rendezvous_timeout
from gpuherd.live.pace import StepPace
from gpuherd.state_broadcast import broadcast_state
from gpuherd.status_channel import StatusWriter

STEP_RECORD_EVERY = 0.5  # seconds between `step` records (the script bootstrap's heartbeat pace)


def say(line: str, level: str = "WARNING") -> None:
    """One line on the rank's stderr, as the script bootstrap's own (the supervisor prefixes it)."""
    print(f"{level} | gpuherd: {line}", file=sys.stderr, flush=True)


def _source(infos: list[dict[str, Any] | None]) -> int:
    best = max(info["step"] for info in infos if info is not None)
    return min(r for r, info in enumerate(infos) if info is not None and info["step"] == best)


class LiveSession:
    """One rank of a script under gpuherd with live recovery on."""

    def __init__(self, model: Any, optimizer: Any, position: dict[str, Any] | None) -> None:
        self.model, self.optimizer, self.position = model, optimizer, position
        self.rank, self.world, self.backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        self.status = StatusWriter.from_env(int(os.environ.get("RANK", self.rank)), automatic=True)
        StatusWriter.explicit_steps = True  # this session numbers the steps (the bootstrap's heartbeat stops)
        self.device = self._device()
        self.tag = f"[{'CPU' if self.device.type == 'cpu' else 'GPU'} {os.environ.get(contract.DEVICE_ID, self.rank)}]"
        self.generation = HOOKS.generation
        self.step = 0
        self._mark: dict[str, Any] | None = None
        self._joined_at: int | None = None  # a newcomer: the step it joined at, until its first step after
        self._sent = 0.0
        self.shared: set[str] = set()  # the parts of a mark every rank had alike at attach (a newcomer: the source's)
        self.why_not = self._why_not()
        self.pace = StepPace()  # compute per step, for the supervisor's straggler check
        self.reduce = live_ddp.SafeReduce(self._lost, self.pace)
        if self.why_not is None:
            self.reduce.install(model)
            live_ddp.skip_when_broken(optimizer, self.reduce)

    def _device(self) -> torch.device:
        param = next(iter(self.model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    def _why_not(self) -> str | None:
        from torch.nn.parallel import DistributedDataParallel

        if self.world < 2:
            return "a single worker has no peer to take the state from"
        if not isinstance(self.model, DistributedDataParallel):
            return "gpuherd.live.attach was given a model that is not a DistributedDataParallel wrapper"
        return None

    def attach(self) -> None:
        """An original rank: check that every rank stands at the same position (a newcomer takes
        the source's); a newcomer: take the source's state. Then say whether a lost peer of this
        rank can be replaced live."""
        if HOOKS.joined:
            self._join_as_newcomer()
        elif self.why_not is None:
            self._compare_positions()
            gc.collect()  # out of the collector's way from now on: what the script built (and torch's
            gc.freeze()  # imports); a recovery's collection of the broken group then walks only what came after
        self.announce()

    def _compare_positions(self) -> None:
        """Which parts of a mark every rank has alike (a newcomer takes only those from the source);
        the position and torch's generators must be."""
        everyone = self._exchange(pos.fingerprints(pos.capture(self.position, self.device)))
        self.shared = {name for name in everyone[0] if all(f.get(name) == everyone[0][name] for f in everyone)}
        differ = [name for name in pos.MUST_BE_SHARED if name in everyone[0] and name not in self.shared]
        if differ:
            what = " and ".join("the position" if name == "position" else f"{name}'s RNG state" for name in differ)
            self.why_not = (f"{what} differ(s) between the ranks (a per-rank seed?): a newcomer takes it from a "
                            "survivor, so it must be the same on every rank (each rank taking its own slice of one "
                            "seeded global draw)")

    def announce(self) -> None:
        """Say whether a lost peer of this rank can be replaced live; where not, a lost peer raises in
        the script as without gpuherd (the supervisor restarts the run)."""
        self.reduce.keep = self.why_not is None
        self.status.send("live", event="able", able=self.why_not is None, why=self.why_not, no_shrink=None)

    def steps(self, steps: range) -> Iterator[int]:
        if not isinstance(steps, range) or steps.step != 1:
            self.why_not = "session.steps() was given something other than a range of steps"
            self.announce()
            yield from steps
            return
        if self._joined_at is None:
            self.step = steps.start
        self.mark()
        while self.step < steps.stop:
            self.pace.begin()
            yield self.step
            self.pace.end(counted=self.reduce.broken is None)
            if self.reduce.broken is not None:
                self._recover(self.reduce.broken)
                continue
            self.step += 1
            self.mark()
            self._report()
        self._report(last=True)

    def mark(self) -> None:
        self._mark = {"step": self.step, **pos.capture(self.position, self.device)}

    def _report(self, last: bool = False) -> None:
        now = time.monotonic()
        if self.step > 0 and (last or self._sent == 0.0 or now - self._sent >= STEP_RECORD_EVERY):
            self.status.send("step", step=self.step - 1, **self.pace.take())
            self._sent = now
        if self._joined_at is not None and self.step > self._joined_at:
            self._joined_at = None  # the supervisor's clock of this recovery stops here
            self.status.send("live", event="first_step", generation=self.generation, step=self.step)

    def _lost(self, what: str) -> None:
        """Called from the all-reduce's completion (any thread): free the peers at once."""
        sever_peer_connections(HOOKS.group_connections)

    def _recover(self, lost: str) -> None:
        started = time.perf_counter()
        self.generation += 1
        say(f"{self.tag} lost a peer at step {self._mark['step']} ({lost}); rejoining rebuilt group "
            f"{self.generation} with a spare in its place")
        self.status.send("live", event="lost_peer", generation=self.generation, step=self._mark["step"])
        self.status.send("phase", name="rendezvous")
        buckets = gradient_buckets(self.model)
        live_ddp.drop_group(self.model)
        self.optimizer.zero_grad(set_to_none=True)  # gradients were views into the old reducer's buckets
        leave_broken_group(HOOKS.group_connections)
        gc.collect()
        self._join(self.rank)
        infos = self._exchange({"step": self._mark["step"], "buckets": buckets})
        source = _source(infos)
        self._rebuild(infos[source]["buckets"])
        self._take_state(source, behind=infos[self.rank]["step"] < infos[source]["step"])
        self._rejoined(started, source, "source" if self.rank == source else "survivor")

    def _join(self, rank: int) -> None:
        before = connections()
        join_rebuilt(self.backend, rendezvous_timeout(), rank, self.world, self.device, self.generation,
                     init=HOOKS.init)
        HOOKS.group_connections = connections() - before

    def _exchange(self, mine: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        infos: list[Any] = [None] * self.world
        dist.all_gather_object(infos, mine)
        return infos

    def _rebuild(self, buckets: Any) -> None:
        live_ddp.rebuild(self.model, buckets)
        self.reduce.broken = None
        self.reduce.install(self.model)

    def _join_as_newcomer(self) -> None:
        started = time.perf_counter()
        infos = self._exchange(None)
        source = _source(infos)
        if infos[source]["buckets"] is not None:
            live_ddp.drop_group(self.model)
            self._rebuild(infos[source]["buckets"])
        else:
            self.reduce.install(self.model)
        live_ddp.skip_when_broken(self.optimizer, self.reduce)
        self._take_state(source, behind=True)
        self._joined_at = self.step
        self._rejoined(started, source, "newcomer")

    def _take_state(self, source: int, behind: bool) -> None:
        mine = None
        if self.rank == source:
            mine = {**self._mark, "model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "shared": sorted(self.shared)}
        state = broadcast_state(mine, source, self.device)
        self.shared = set(state["shared"])
        if behind:
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            pos.restore(self.position, state, self.device, self.shared)
        else:
            pos.restore(self.position, self._mark, self.device)
        self.step = state["step"]
        self.mark()

    def _rejoined(self, started: float, source: int, role: str) -> None:
        seconds = time.perf_counter() - started
        self.status.send("live", event="rejoined", generation=self.generation, step=self.step, source=source,
                         role=role, seconds=round(seconds, 4), replicas=self.world, slots=[self.rank])
        self.status.send("phase", name="train")
        if self.rank == source:
            say(f"{self.tag} rebuilt group {self.generation} formed: continuing from step {self.step} with this "
                f"rank's state ({seconds:.2f} s, no checkpoint read)", level="INFO")

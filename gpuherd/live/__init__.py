"""Live recovery for your own DDP script: a lost rank is replaced by a warm spare while the other
ranks keep their processes, and the loop goes on at the step it was in.

    import gpuherd.live as live
    ...
    model = DDP(model)
    session = live.attach(model, optimizer, position={"data": generator})
    for step in session.steps(range(start, args.steps)):
        ...                                       # the step, unchanged

Under `gpuherd run` with live recovery on (--max-restarts N > 0, warm spares by default) the
session marks every step boundary and rebuilds the group after a lost peer
(gpuherd/live/session.py). Anywhere else (plain torchrun, python, gpuherd with --spares 0) it
does nothing: `steps` is the range itself and `attach` touches neither model nor optimizer.

`position`: what, besides the step, says where the script is: a dict of torch.Generators,
objects with state_dict()/load_state_dict() (a sampler, an LR scheduler) and plain values. The
global RNGs (Python's, numpy's, torch's, the device's) are taken by gpuherd. A newcomer takes
the position of a survivor, so it must be the same on every rank (the rank picks its slice of
one seeded draw); a script whose ranks stand elsewhere is told so and restarts as before.
docs/guide/live-script.md says what else it needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from gpuherd import contract


def enabled() -> bool:
    """Under gpuherd, with a warm spare standing by (GPUHERD_LIVE_RECOVERY=1)."""
    return os.environ.get(contract.LIVE_RECOVERY) == "1" and bool(os.environ.get(contract.STATUS_FD))


class PlainSession:
    """Outside gpuherd's live recovery: the loop as it was."""

    step = 0

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        for self.step in steps:
            yield self.step


def attach(model: Any, optimizer: Any, position: dict[str, Any] | None = None) -> Any:
    """Hand gpuherd the DDP-wrapped `model`, its `optimizer` and `position` (above), after the
    process group and the wrapper are made and before the loop; returns the session whose
    `steps(range)` the loop iterates. A collective (every rank calls it)."""
    if not enabled():
        return PlainSession()
    from gpuherd.live.hooks import install
    from gpuherd.live.session import LiveSession

    install()  # done already by the script bootstrap once torch was imported (gpuherd/live/hooks.py)
    session = LiveSession(model, optimizer, position)
    session.attach()
    return session


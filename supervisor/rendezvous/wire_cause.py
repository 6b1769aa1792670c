"""The wire form of a root cause, decoded once where it reaches the supervisor (the job link).

A node publishes its failure as `dataclasses.asdict(RootCause)` with its node and host
(multi.py); node 0's agent writes a dead node's cause (agent_causes.py) with, where its
connection closed, `stop_after_s`: how long each survivor waits before it stops its workers.
Everything after the job link holds a `RootCause` and that delay, never the dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuherd.exit_codes import ExitCode
from supervisor.summary import RootCause


@dataclass(frozen=True)
class HeardCause:
    cause: RootCause
    stop_after_s: float | None = None  # stop this node's workers this long after it came (None: at once)


def decode_cause(value: Any) -> HeardCause:
    """The root cause in `value` (the agent checked its kind, exit code and message are there);
    one gpuherd cannot read (a kind it does not know) is named as such, never a crash."""
    try:
        cause = RootCause.from_dict(value)
    except (AttributeError, TypeError, ValueError):
        return HeardCause(RootCause("store", ExitCode.FAILURE, f"the job's root cause came in a form this gpuherd "
                                                               f"cannot read: {str(value)[:200]}"))
    delay = value.get("stop_after_s")
    return HeardCause(cause, float(delay) if isinstance(delay, int | float) and not isinstance(delay, bool) else None)

"""The root causes a node agent writes on the job store or emits, each built here from what it is
given (never the agent): the wire form every node reads, {kind, exit_code, node, host, rank,
device, stderr_tail, message}: supervisor/summary.py's `RootCause` as multi.py reads it."""

from __future__ import annotations

from typing import Any

from gpuherd.exit_codes import ExitCode
from supervisor.rendezvous.beat_watch import SILENT_S
from supervisor.rendezvous.store_calls import json_or_none


def cause(kind: str, exit_code: int, node: int | None, host: Any, message: str) -> dict[str, Any]:
    return {"kind": kind, "exit_code": exit_code, "node": node, "host": host, "rank": None, "device": None,
            "stderr_tail": [], "message": message}


def read(where: str, key: str, raw: bytes) -> dict[str, Any]:
    """A root cause read from the store (`key`); a value that is not one becomes a cause naming it."""
    found = json_or_none(raw)
    if isinstance(found, dict) and isinstance(found.get("message"), str) and isinstance(found.get("kind"), str) \
            and isinstance(found.get("exit_code"), int):
        return found
    return malformed(where, key, raw, "a root cause, written by the node that failed first")


def malformed(where: str, key: str, raw: bytes, expected: str) -> dict[str, Any]:
    """The root cause for a value read back that no gpuherd node of this job writes (`expected`:
    what `key` should hold): it names the key, the value and why, never a crash."""
    shown = raw[:80].decode("utf-8", "backslashreplace") + ("..." if len(raw) > 80 else "")
    return cause("store", 1, None, None,
                 f"malformed data on the job store at {where}: key {key} holds {shown!r}, not {expected}; no "
                 "gpuherd node of this job wrote it (another program reached the store: it has no authentication, "
                 "as under torchrun)")


def silent(r: int, host: str, why: str) -> dict[str, Any]:
    """Node 0 found node r (on `host`) dead: `why` (its beat stood still, its connection closed)."""
    return cause("node", 1, r, host, f"node {r} ({host}) stopped responding: {why} (its machine, its supervisor or "
                                     "its node agent died; see that node's logs)")


def stalled(host0: str, r: int, stall: float, silent_s: float = SILENT_S) -> dict[str, Any]:
    """Node 0's own stall (`stall` s) as the job's cause: the nodes that ended meanwhile gave node 0 up
    after `silent_s` unanswered (system.node_silence_timeout)."""
    return cause("node", 1, 0, host0,
                 f"node 0 ({host0}) stopped responding: its node agent did not run for {stall:.1f} s (stopped, a "
                 f"frozen machine, or starved of CPU), so every node's store calls went unanswered and the nodes "
                 f"gave it up after {silent_s:g} s (system.node_silence_timeout; node {r}'s connection closed then: a "
                 "consequence, not a cause)")


def rank_taken(r: int, host: Any, owner: bytes) -> dict[str, Any]:
    """This node's --node-rank r is held by another live agent (`owner`, its claim)."""
    shown = owner.decode("utf-8", "backslashreplace")[:120]
    return cause("rendezvous", int(ExitCode.USAGE), r, host,
                 f"--node-rank {r} is already taken in this job, by {shown}: give each node its own --node-rank "
                 "(0..N-1)")


def not_admitted(r: int, host: Any, problem: str) -> dict[str, Any]:
    """Node 0 of an elastic job refuses waiting node r alone: its settings differ (`problem`)."""
    return cause("rendezvous", int(ExitCode.USAGE), r, host,
                 f"{problem}; it was not admitted, the job goes on without it")


def admitting(who: str) -> dict[str, Any]:
    """Node 0 of an elastic job restarts every node's workers so that waiting nodes (`who`) join."""
    return cause("membership", 0, None, None,
                 f"{who} asked to join: restarting every node's workers to admit it (a membership change, not "
                 "counted against --max-restarts)")

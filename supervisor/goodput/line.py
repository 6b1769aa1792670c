"""The one console line of the end-of-run summary: `goodput 0.93 (badput: 3% restarts, 2% checkpoints, 2% startup)`."""

from __future__ import annotations

from supervisor.goodput.account import Goodput

# what a reader acts on: the causes folded into the groups an operator knows
GROUPS = {"startup": ("launch", "dataset", "rendezvous", "warmup"),
          "checkpoints": ("checkpoint_save", "checkpoint_restore"), "eval": ("eval",),
          "failure detection": ("failure_detection",), "restarts": ("restart",), "steps redone": ("redone",),
          "silent data corruption": ("sdc",), "stopped": ("stopped",), "straggler pace": ("straggler",),
          "other": ("other",)}


def shares(g: Goodput) -> list[tuple[str, float]]:
    """(group, share of the wall time), largest first, zeros left out."""
    if not g.wall_s:
        return []
    out = [(name, sum(g.badput_s.get(c, 0.0) for c in causes) / g.wall_s) for name, causes in GROUPS.items()]
    return sorted([s for s in out if s[1] > 0], key=lambda s: -s[1])


def console_line(g: Goodput, most: int = 3) -> str:
    worst = [f"{share * 100:.0f}% {name}" for name, share in shares(g)[:most] if share >= 0.005]
    shrunk = f"; {g.shrunk_s:.1f} s of it trained shrunk (a lost rank's data slot carried)" if g.shrunk_s else ""
    return f"goodput {g.ratio:.2f}" + (f" (badput: {', '.join(worst)})" if worst else "") + shrunk

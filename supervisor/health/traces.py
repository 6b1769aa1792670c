"""Collective traces on a hang: PyTorch's flight recorder, asked for and read back.

On a hang verdict the supervision creates `<trace_dir>/request`; each worker's liveness
thread (gpuherd/liveness.py) dumps its flight recorder within about a second
(worker/collectives.py): the full dump as `fr/rank<r>`, for torch's own analyser
(`python -m torch.distributed.flight_recorder.fr_trace --prefix rank <trace_dir>/fr`),
and a compact `rank<r>.json`, read here. A stopped or wedged rank cannot answer; its
missing trace is evidence too.

Per process group each dump says how far the rank got: the last collective it entered
(`last_enqueued_collective`) and the last that completed. The furthest any rank got is
the collective the others wait in; a rank whose last entered one is before it never
joined. One line per rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from gpuherd.files import write_bytes_atomic

REQUEST = "request"
WAIT_S = 3.0  # liveness threads look for the request every second; a dump takes milliseconds
NO_RECORDER = ("no rank wrote a collective trace (torch without a flight recorder for this backend, or no rank "
               "could answer): the liveness evidence above is all there is")


def request(trace_dir: Path) -> None:
    trace_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(trace_dir / REQUEST, repr(time.time()).encode())


def answered(trace_dir: Path, ranks: set[int]) -> set[int]:
    return {r for r in ranks if (trace_dir / f"rank{r}.json").is_file()}


def _load(trace_dir: Path, ranks: list[int]) -> dict[int, dict[str, Any]]:
    found = {}
    for r in ranks:
        try:
            found[r] = orjson.loads((trace_dir / f"rank{r}.json").read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
    return found


def _group_names(dumps: dict[int, dict[str, Any]]) -> dict[str, str]:
    names: dict[str, str] = {}
    for doc in dumps.values():
        for pg, entries in doc.get("last", {}).items():
            for e in entries:
                group = e.get("group") or []
                names.setdefault(pg, group[1] if len(group) > 1 and group[1] else f"group {pg}")
    return names


def _op(dumps: dict[int, dict[str, Any]], pg: str, seq: int) -> str:
    for doc in dumps.values():
        for e in doc.get("last", {}).get(pg, []):
            if e.get("seq") == seq:
                return str(e.get("op"))
    return "a collective"


def _rank_line(rank: int, doc: dict[str, Any], furthest: dict[str, int], dumps: dict[int, dict[str, Any]],
               names: dict[str, str]) -> str:
    calm = None
    for pg, status in sorted(doc.get("pg_status", {}).items()):
        entered = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
        where = names.get(pg, f"group {pg}")
        if entered < furthest.get(pg, entered):
            top = furthest[pg]
            return (f"rank {rank}: never joined {_op(dumps, pg, top)} #{top} of {where} "
                    f"(last entered #{entered} {_op(dumps, pg, entered)})")
        if completed < entered:
            return f"rank {rank}: inside {_op(dumps, pg, entered)} #{entered} of {where}, not completed"
        calm = calm or f"rank {rank}: every collective it entered completed (last #{entered} of {where})"
    return calm or f"rank {rank}: no collective recorded"


def analyse(trace_dir: Path, ranks: list[int]) -> list[str]:
    """One line per rank from the dumps in `trace_dir` (a single line when there are none)."""
    dumps = _load(trace_dir, ranks)
    if not dumps:
        return [NO_RECORDER]
    furthest: dict[str, int] = {}
    for doc in dumps.values():
        for pg, status in doc.get("pg_status", {}).items():
            furthest[pg] = max(furthest.get(pg, -1), int(status.get("last_enqueued_collective", -1)))
    names = _group_names(dumps)
    lines = []
    for r in ranks:
        if r in dumps:
            lines.append(_rank_line(r, dumps[r], furthest, dumps, names))
        else:
            lines.append(f"rank {r}: no trace (it could not answer: stopped, wedged or gone)")
    return [f"collective trace: {line}" for line in lines]

"""`suspect` status records -> the devices of an attempt blamed for transient faults.

A rank whose replayed step came out clean (policy `rerun`) sends `suspect` with the
device label it sees (`cuda:0 (GPU 3)`: under isolation every worker sees its GPU as
cuda:0), so the physical GPU is taken from the attempt's device plan by rank, the one
mapping that holds with and without isolation. Each rank sends one record per fault;
its latest one carries its count, so that is the one kept.
"""

from __future__ import annotations

import socket
from typing import Any

from gpuherd.status_records import Record, Sdc, Suspect
from supervisor.gpus import DevicePlan
from supervisor.summary import SDC_CAUSE as SDC
from supervisor.summary import STRAGGLER_CAUSE as STRAGGLER
from supervisor.summary import SuspectDevice

EXCLUDE_HINT = "exclude it with --exclude-suspect-gpus (with --max-restarts)"


class SuspectWatch:
    def __init__(self, plan: DevicePlan, attempt: int) -> None:
        """`plan`: the attempt's slots with global ranks (the ranks records carry)."""
        self.attempt = attempt
        self._gpu_of = {s.rank: s.device_id for s in plan.slots if s.kind == "cuda"}
        self._slot_of = {s.rank: (s.device_id, s.uuid) for s in plan.slots}
        self._latest: dict[int, SuspectDevice] = {}
        self._earlier: list[SuspectDevice] = []  # a rank's device before a warm spare took the rank
        # silent data corruption: the latest `sdc` record's step and lines, by culprit rank
        self._evidence: dict[int, tuple[int | None, list[str]]] = {}

    def observe(self, record: Record) -> None:
        """Any status record; `suspect` ones are kept, `sdc` ones lend them their evidence. One
        without its rank, count or limit (a user script's, or a field of the wrong type: dropped at
        decoding) is ignored: it must not break the supervision loop."""
        match record:
            case Sdc(culprits=culprits):
                for rank in culprits:
                    self._evidence[rank] = (record.step, list(record.evidence))
                    if rank in self._latest and record.step == self._latest[rank].step:
                        self._latest[rank].evidence = list(record.evidence)
            case Suspect(rank=int(rank), transient_faults=int(faults), limit=int(limit)):
                before = self._latest.get(rank)
                if before is not None and faults <= before.transient_faults:
                    self._earlier.append(before)  # a count that starts over: another process holds the rank now
                    before = None
                slot, uuid = self._slot_of.get(rank, (None, ""))
                step, evidence = self._evidence.get(rank, (None, []))
                evidence = evidence if record.cause == SDC and step == record.step else []
                self._latest[rank] = SuspectDevice(
                    attempt=self.attempt, rank=rank, device=record.device or "?", gpu=self._gpu_of.get(rank),
                    host=record.host or "?", transient_faults=faults, limit=limit, step=record.step,
                    cause=record.cause or "transient fault", slot=slot, uuid=uuid, evidence=evidence,
                    steps=(before.steps if before is not None else [])
                    + ([record.step] if record.step is not None else []))

    def moved_out(self, recoveries: list[dict[str, Any]]) -> None:
        """A straggler moved out live in this attempt (a recovery of kind `straggler`): its device,
        as a second strike of silent data corruption puts it, goes on the host's suspect list."""
        for rec in recoveries:
            if (rec.get("kind"), rec.get("attempt"), rec.get("outcome")) != ("straggler", self.attempt, "recovered"):
                continue
            rank, ev = rec["rank"], rec.get("straggler") or {}
            slot, uuid = self._slot_of.get(rank, (None, ""))
            self._earlier.append(SuspectDevice(
                attempt=self.attempt, rank=rank, device=rec.get("device") or "?", gpu=self._gpu_of.get(rank),
                host=socket.gethostname(), transient_faults=1, limit=0, step=rec.get("resumed_step"), cause=STRAGGLER,
                slot=slot, uuid=uuid, evidence=[f"{ev.get('slowdown')}x the other ranks' compute per step for "
                                                f"{ev.get('held_s')} s"] if ev else []))

    def devices(self, exclusion_on: bool) -> list[SuspectDevice]:
        """Every suspect of the attempt, by rank. A GPU over the limit gets the hint to exclude
        it unless `--exclude-suspect-gpus` is on (then the restart says what it did); a device
        struck out by silent data corruption is left out of a restart whatever the flag says."""
        found = sorted([*self._earlier, *self._latest.values()], key=lambda d: d.rank)
        for d in found:
            if d.gpu is not None and d.over_limit and not exclusion_on and d.cause != SDC:
                d.then = EXCLUDE_HINT
        return found


def mark_moved(devices: list[SuspectDevice], recoveries: list[dict[str, Any]]) -> None:
    """What came of a device struck out by silent data corruption within its attempt: the live
    recovery that took its rank (summary.json's `then`, `gpuherd report`)."""
    for d in devices:
        if d.cause not in (SDC, STRAGGLER) or not d.over_limit:
            continue
        rec = next((r for r in recoveries if r.get("rank") == d.rank and r.get("attempt") == d.attempt
                    and r.get("outcome") == "recovered"), None)
        if rec is None:
            continue
        d.then = (f"the group went on without it (live recovery {rec['number']}: {rec.get('replicas')} replicas)"
                  if rec.get("action") == "shrink" else
                  f"its rank moved to a warm spare (live recovery {rec['number']})")

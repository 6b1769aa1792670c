"""`suspect` status records -> the devices of an attempt blamed for transient faults.

A rank whose replayed step came out clean (policy `rerun`) sends `suspect` with the
device label it sees (`cuda:0 (GPU 3)`: under isolation every worker sees its GPU as
cuda:0), so the physical GPU is taken from the attempt's device plan by rank, the one
mapping that holds with and without isolation. Each rank sends one record per fault;
its latest one carries its count, so that is the one kept.
"""

from __future__ import annotations

from gpuherd.status_records import Record, Suspect
from supervisor.gpus import DevicePlan
from supervisor.summary import SuspectDevice

EXCLUDE_HINT = "exclude it with --exclude-suspect-gpus (with --max-restarts)"


class SuspectWatch:
    def __init__(self, plan: DevicePlan, attempt: int) -> None:
        """`plan`: the attempt's slots with global ranks (the ranks records carry)."""
        self.attempt = attempt
        self._gpu_of = {s.rank: s.device_id for s in plan.slots if s.kind == "cuda"}
        self._latest: dict[int, SuspectDevice] = {}

    def observe(self, record: Record) -> None:
        """Any status record; `suspect` ones are kept. One without its rank, count or limit (a
        user script's, or a field of the wrong type: dropped at decoding) is ignored: it must
        not break the supervision loop."""
        match record:
            case Suspect(rank=int(rank), transient_faults=int(faults), limit=int(limit)):
                self._latest[rank] = SuspectDevice(
                    attempt=self.attempt, rank=rank, device=record.device or "?", gpu=self._gpu_of.get(rank),
                    host=record.host or "?", transient_faults=faults, limit=limit, step=record.step)

    def devices(self, exclusion_on: bool) -> list[SuspectDevice]:
        """Every suspect of the attempt, by rank. A GPU over the limit gets the hint to exclude
        it unless `--exclude-suspect-gpus` is on (then the restart says what it did)."""
        found = sorted(self._latest.values(), key=lambda d: d.rank)
        for d in found:
            if d.gpu is not None and d.over_limit and not exclusion_on:
                d.then = EXCLUDE_HINT
        return found

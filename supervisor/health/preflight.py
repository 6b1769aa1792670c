"""`gpuherd check`: the pre-flight checks, GPU and host, as one PASS/WARN/FAIL table.

    report = run_checks(cfg, gpu_ids)          # gpu_ids: the planned GPUs ([] on CPU, None: all)
    print(report.table())
    if report.failed_exit_code is not None:    # 4: a device FAIL, 2: a host FAIL
        ...stop before anything is spawned

GPU items come from NVML (`supervisor/gpus/device_health.py`, judged in
`gpu_checks.py`), host items from `host_checks.py`. Without NVML there are no GPU
items, only one line saying why (no driver, no GPU) - unless GPUs were asked for.
Everything is read, nothing is changed, and it takes well under a second.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field

from gpuherd.config import Config
from gpuherd.exit_codes import ExitCode
from supervisor.gpus import NvmlUnavailable, read_device_health
from supervisor.health.gpu_checks import gpu_items
from supervisor.health.host_checks import host_items, judged
from supervisor.health.items import FAIL, NA, PASS, WARN, CheckItem


@dataclass
class CheckReport:
    items: list[CheckItem] = field(default_factory=list)
    seconds: float = 0.0
    judged: str = ""  # the run the items are about: preset, model, workers

    def of(self, status: str) -> list[CheckItem]:
        return [item for item in self.items if item.status == status]

    @property
    def failed_exit_code(self) -> int | None:
        """4 when a GPU failed (the hardware is the cause), else 2 for a host failure, else None."""
        failed = self.of(FAIL)
        if any(item.device for item in failed):
            return int(ExitCode.DEVICE)
        return int(ExitCode.USAGE) if failed else None

    def first_failure(self) -> CheckItem | None:
        failed = sorted(self.of(FAIL), key=lambda item: not item.device)
        return failed[0] if failed else None

    def counts(self) -> str:
        return ", ".join(f"{len(self.of(s))} {s}" for s in (PASS, WARN, FAIL, NA)) + f" in {self.seconds:.2f} s"

    def table(self) -> str:
        """scope | item | status | detail, plain text (it goes to logs as well as terminals)."""
        header = ("where", "check", "status", "detail")
        rows = [(i.scope, i.name, i.status, i.detail) for i in self.items]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(3)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
                         for r in [header, *rows])

    def to_dict(self) -> dict:
        return {"judged": self.judged, "items": [asdict(i) for i in self.items], "seconds": self.seconds,
                "failed_exit_code": self.failed_exit_code}


def run_checks(cfg: Config, gpu_ids: Sequence[int] | None, *, master: tuple[str, int] | None = None,
               node_rank: int = 0, ours: Collection[int] = (), script: bool = False,
               cpu_workers: int | None = None, master_bound: bool = False) -> CheckReport:
    """Every check for a run of `cfg` on `gpu_ids` (NVML indices; [] for a CPU run, None
    for every GPU NVML sees). `master`: (addr, port) of a multi-node job, None on one node;
    `ours`: pids whose GPU memory is ours; `script`: a user's script runs, not the built-in
    trainer; `cpu_workers`: the CPU workers of a run without GPUs (default system.nproc);
    `master_bound`: the caller holds the master port already. Raises DeviceError (exit 2)
    for an unknown id."""
    started = time.monotonic()
    report = CheckReport()
    if gpu_ids is None or list(gpu_ids):
        items, planned = _gpus(cfg, gpu_ids, ours)
    else:
        items, planned = [CheckItem("host", "gpus", NA, "no GPU planned: the run uses CPU workers")], 0
    workers = 0 if planned else (cfg.system.nproc if cpu_workers is None else cpu_workers)
    report.items = items + host_items(cfg, planned, master, node_rank, script, workers, master_bound)
    report.judged = judged(cfg, planned, workers, script)
    report.seconds = time.monotonic() - started
    return report


def _gpus(cfg: Config, gpu_ids: Sequence[int] | None, ours: Collection[int]) -> tuple[list[CheckItem], int]:
    """(items, GPUs checked)."""
    try:
        readings = read_device_health(gpu_ids)
    except NvmlUnavailable as exc:
        asked = gpu_ids is not None or cfg.system.device == "cuda"
        return [CheckItem("host", "gpus", FAIL if asked else NA,
                          f"no GPU: NVML unavailable ({exc})" + ("; GPUs were asked for" if asked else
                                                                   "; the run uses CPU workers"))], 0
    if not readings:
        return [CheckItem("host", "gpus", NA, "no GPU on this machine: the run uses CPU workers")], 0
    items = [CheckItem("host", "gpus", PASS, ", ".join(f"GPU {r.index} {r.info.name}" for r in readings))]
    for reading in readings:
        items += gpu_items(reading, ours)
    return items, len(readings)

"""NVML readings -> PASS/WARN/FAIL per GPU, with what to do about each problem.

FAIL (exit 4, nothing is spawned): a lost GPU; volatile uncorrectable ECC errors;
a failed row remap; a fatal XID during the check; hardware slowdown, hardware
thermal slowdown or a power brake right now; a recovery action the driver asks
for (reset, drain, reboot); MIG mode on (CUDA would not see the whole GPU).
WARN: ECC off or a pending ECC/MIG change; corrected ECC errors; pages waiting to
be retired or rows waiting to be remapped (both need a GPU reset); an application
XID; software thermal slowdown or power capping; NVLink links down; a PCIe link
narrower than its maximum; other processes on the GPU or memory in use.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from supervisor.gpus import NA as UNKNOWN
from supervisor.gpus import DeviceHealth
from supervisor.gpus import nvml_meaning
from supervisor.health.items import FAIL, NA, PASS, WARN, CheckItem

GIB = 1024**3
HARDWARE_SLOWDOWN = 0x8 | 0x40 | 0x80  # hw_slowdown | hw_thermal | hw_power_brake
SOFTWARE_SLOWDOWN = 0x4 | 0x20  # sw_power_cap | sw_thermal
RECOVERY = {1: "a GPU reset", 2: "a node reboot", 3: "draining peer-to-peer traffic", 4: "a drain and GPU reset",
            5: "recovering the IMEX domain", 6: "a PCIe bus reset", 7: "a system reboot"}
MEMORY_IN_USE = 0.10  # of the total, held by processes NVML does not list (another container)


def gpu_items(health: DeviceHealth, ours: Collection[int] = ()) -> list[CheckItem]:
    scope = f"GPU {health.index}"
    if health.info.lost:
        return [CheckItem(scope, "present", FAIL, f"GPU is lost ({health.info.lost}): it fell off the bus or "
                                                  "needs a reset; check `nvidia-smi` and dmesg for XID 79")]
    items = []
    for name, read, unknown, judge in RULES:
        value = read(health)
        status, detail = (NA, unknown) if value == UNKNOWN else judge(value)
        items.append(CheckItem(scope, name, status, detail))
    return items + [CheckItem(scope, "processes", *_processes(health, ours))]


def _ecc_mode(mode: tuple[int, int]) -> tuple[str, str]:
    current, pending = mode
    if current != pending:
        return WARN, f"ECC {_on(current)} now, {_on(pending)} after the next reboot"
    if not current:
        return WARN, "ECC is off: memory errors go undetected (nvidia-smi -e 1, then reboot)"
    return PASS, "ECC on"


def _ecc_errors(counts: tuple[int, int]) -> tuple[str, str]:
    corrected, uncorrected = counts
    if uncorrected:
        return FAIL, (f"{uncorrected} uncorrectable (double-bit) ECC errors since the driver loaded: "
                      "results cannot be trusted; reset the GPU or drain the node")
    if corrected:
        return WARN, f"{corrected} corrected (single-bit) ECC errors since the driver loaded"
    return PASS, "no ECC errors since the driver loaded"


def _retired_pages(pages: tuple[int, int, bool]) -> tuple[str, str]:
    single, double, pending = pages
    counts = f"{single} pages retired for single-bit, {double} for double-bit errors"
    return (WARN, f"page retirement pending: reset the GPU to apply it ({counts})") if pending else (PASS, counts)


def _row_remap(rows: tuple[int, int, bool, bool]) -> tuple[str, str]:
    corrected, uncorrected, pending, failure = rows
    counts = f"{corrected} rows remapped for correctable, {uncorrected} for uncorrectable errors"
    if failure:
        return FAIL, f"row remapping failed: the memory cannot be repaired, replace the GPU ({counts})"
    return (WARN, f"row remap pending: reset the GPU to apply it ({counts})") if pending else (PASS, counts)


def _xids(xids: list[int]) -> tuple[str, str]:
    fatal = [x for x in xids if nvml_meaning.xid_is_fatal(x)]
    if fatal:
        return FAIL, (f"hardware XID {', '.join(map(str, fatal))} during the check; see "
                      "https://docs.nvidia.com/deploy/xid-errors/ and `dmesg | grep -i xid`")
    if xids:
        return WARN, f"XID {', '.join(map(str, xids))} during the check (application or informational)"
    return PASS, "no XID event during the check"


def _throttle(mask: int) -> tuple[str, str]:
    names = ", ".join(nvml_meaning.clock_event_names(mask)) or "none"
    if mask & HARDWARE_SLOWDOWN:
        return FAIL, (f"clocks held back by the hardware now ({names}): check cooling, power "
                      "supply and `nvidia-smi -q -d PERFORMANCE`")
    if mask & SOFTWARE_SLOWDOWN:
        return WARN, f"clocks capped by the driver now ({names})"
    return PASS, f"clock-event reasons: {names}"


def _nvlink(links: tuple[int, list[int]]) -> tuple[str, str]:
    active, down = links
    if down:
        return WARN, (f"NVLink {', '.join(map(str, down))} down ({active} of {active + len(down)} up): "
                      "NCCL loses bandwidth or falls back to PCIe")
    return PASS, f"{active} links up"


def _pcie(link: tuple[int, int, int, int]) -> tuple[str, str]:
    gen, max_gen, width, max_width = link
    now = f"gen {gen} x{width} (max gen {max_gen} x{max_width})"
    if width < max_width:
        return WARN, f"link narrower than it can be: {now}; reseat the card or check the slot"
    return PASS, now + ("; the generation drops while idle" if gen < max_gen else "")


def _recovery(action: int) -> tuple[str, str]:
    if action:
        wanted = RECOVERY.get(action, f"recovery action {action}")
        return FAIL, f"the driver asks for {wanted} before this GPU is used again"
    return PASS, "none needed"


def _mig(mode: tuple[int, int]) -> tuple[str, str]:
    current, pending = mode
    if current:
        return FAIL, "MIG mode is on: CUDA sees MIG instances, not this GPU (nvidia-smi -i N -mig 0)"
    return (WARN, "MIG mode turns on at the next GPU reset") if pending else (PASS, "MIG off")


RULES: list[tuple[str, Callable[[DeviceHealth], Any], str, Callable[[Any], tuple[str, str]]]] = [
    # (item, its reading, what n/a means here, the judgement)
    ("ecc mode", lambda h: h.ecc_mode, "ECC not supported on this board", _ecc_mode),
    ("ecc errors", lambda h: h.ecc_volatile, "ECC counters not available", _ecc_errors),
    ("retired pages", lambda h: h.retired_pages, "no page retirement on this board (row remapping instead)",
     _retired_pages),
    ("row remapping", lambda h: h.remapped_rows, "no row remapping on this board (pre-Ampere)", _row_remap),
    ("xid", lambda h: h.xids if h.xid_events else UNKNOWN, "XID events not reported by this board or driver", _xids),
    ("throttle", lambda h: h.clock_events, "clock-event reasons not available", _throttle),
    ("nvlink", lambda h: h.nvlinks, "no NVLink on this board", _nvlink),
    ("pcie link", lambda h: h.pcie, "PCIe link state not available", _pcie),
    ("recovery action", lambda h: h.recovery_action, "not reported by this driver", _recovery),
    ("mig", lambda h: h.mig_mode, "no MIG on this board", _mig),
]


def _processes(h: DeviceHealth, ours: Collection[int]) -> tuple[str, str]:
    info = h.info
    if info.processes is None:
        return NA, "compute processes not reported by this driver"
    foreign = info.foreign_processes(frozenset(ours))
    if foreign:
        return WARN, "other processes on this GPU: " + "; ".join(p.describe() for p in foreign)
    if info.memory_total and info.memory_used > MEMORY_IN_USE * info.memory_total:
        return WARN, (f"{info.memory_used / GIB:.1f} of {info.memory_total / GIB:.0f} GiB in use by "
                      "processes not visible here (another container?)")
    return PASS, f"no other process; {info.memory_used / GIB:.1f} GiB in use"


def _on(flag: int) -> str:
    return "on" if flag else "off"

"""What NVML's numbers mean for a training run: XIDs and clock-event reasons.

Memory use is not judged: PyTorch's caching allocator keeps what it once needed, so
a healthy run routinely shows > 95% of a GPU's memory used; an OOM is the worker's
own error, named in its log."""

from __future__ import annotations

# Application XIDs: the GPU is fine, a program faulted (13 graphics engine exception,
# 31 MMU fault, 43 channel stopped, 45 preemptive cleanup, 68 video processor
# exception). The training process on that GPU dies by itself and the supervisor
# sees its exit; the GPU needs no attention.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
# Bookkeeping XIDs: recorded for the next reset, nothing failed now
# (63 ECC page retirement / row remapping recorded, 92 high single-bit ECC rate).
INFORMATIONAL_XIDS = frozenset({63, 92})


def xid_is_fatal(xid: int) -> bool:
    """Every other XID is hardware/driver trouble (79 fell off the bus, 48 double-bit
    ECC, 74 NVLink, 94/95 contained/uncontained ECC, 119/120 GSP...): stop the run."""
    return xid not in APPLICATION_XIDS and xid not in INFORMATIONAL_XIDS


# nvmlClocksEventReason* bits (same values as the older ThrottleReason names)
CLOCK_EVENT_NAMES = {
    0x1: "idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
THERMAL = 0x20 | 0x40
# Only the hardware power brake (an external signal, e.g. a failing PSU) is trouble.
# sw_power_cap (0x4) is how an H100 at full load normally holds its power limit: it is
# recorded in metrics.jsonl but never warned about, or every healthy run would warn.
POWER = 0x80
SLOWDOWN = THERMAL | POWER | 0x8  # reasons worth a warning: the GPU runs slower than it should


def clock_event_names(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_EVENT_NAMES.items() if mask & bit]


def slowdown_kind(mask: int) -> str | None:
    """'thermal' / 'power' / 'hardware' slowdown, or None when clocks are not held back."""
    if mask & THERMAL:
        return "thermal"
    if mask & POWER:
        return "power"
    if mask & 0x8:
        return "hardware"
    return None


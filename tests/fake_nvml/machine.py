"""The state a fake libnvidia-ml serves: GPUs, links, processes, driver age, faults.

Plain dataclasses so a test can build a machine in one line, tweak it while a
monitor runs (utilization, lost GPUs, XIDs), and serialize it to JSON for a
subprocess (see `sitecustomize.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# Topology levels as NVML numbers them (nvmlGpuTopologyLevel_t).
PIX, PXB, PHB, NODE, SYS = 10, 20, 30, 40, 50

# Functions an R470-era driver lacks; the adapter must fall back or degrade.
OLD_DRIVER_MISSING = (
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlEventSetWait_v2",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
)


@dataclass
class FakeProcess:
    pid: int
    used_memory: int


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    pci_bus_id: str = ""
    memory_total: int = 80 * GIB
    memory_used: int = 512 * 1024**2
    utilization: int = 0  # percent
    temperature: int = 35  # C
    slowdown_temperature: int = 87
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    clocks_event_reasons: int = 0x1  # GpuIdle
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    lost: bool = False
    unsupported: list[str] = field(default_factory=list)  # NVML symbols -> NOT_SUPPORTED here
    supported_events: int = 0x2 | 0x8  # double-bit ECC | XID critical
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    # Fault modes for the pre-flight check (healthy by default)
    ecc_mode: tuple[int, int] = (1, 1)  # (current, pending): 1 enabled
    retired_pages: tuple[int, int] = (0, 0)  # pages retired for (multiple single-bit, double-bit) errors
    retired_pages_pending: bool = False
    remapped_rows: tuple[int, int] = (0, 0)  # rows remapped for (correctable, uncorrectable) errors
    remap_pending: bool = False
    remap_failure: bool = False
    nvlink_down: list[int] = field(default_factory=list)  # links (of the machine's nvlinks[i]) reading inactive
    pcie: tuple[int, int, int, int] = (5, 5, 16, 16)  # (generation, max generation, width, max width)
    recovery_action: int = 0  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0 none, 1 GPU reset, 2 node reboot, ...
    mig_mode: tuple[int, int] = (0, 0)  # (current, pending): 1 enabled (CUDA then sees only MIG instances)
    # nvmlDeviceGetHandleByIndex fails with this NVML error: NVML_ERROR_UNKNOWN (999), what a
    # GPU off the bus often answers, or NVML_ERROR_NO_PERMISSION (4), a cgroup-restricted device
    handle_error: int = 0
    # True: the driver writes v3 process entries 8 bytes longer than nvidia-ml-py reads them
    # (the struct changed between driver branches): entries past the first come out as garbage
    wide_process_struct: bool = False


@dataclass
class FakeMachine:
    gpus: list[FakeGpu] = field(default_factory=list)
    # level[i][j] = NVML topology level between GPU i and j (diagonal ignored)
    topology: list[list[int]] = field(default_factory=list)
    # nvlinks[i] = remote PCI bus id of each active link of GPU i
    nvlinks: list[list[str]] = field(default_factory=list)
    p2p_read_ok: list[list[bool]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # symbols the "driver" lacks
    driver_version: str = "550.54.15"
    init_error: int = 0  # e.g. NVML_ERROR_DRIVER_NOT_LOADED (9)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FakeMachine:
        tuples = {f.name for f in dataclasses.fields(FakeGpu) if str(f.type).startswith("tuple")}
        gpus = [FakeGpu(**{**g, **{k: tuple(g[k]) for k in tuples & g.keys()},
                           "processes": [FakeProcess(**p) for p in g["processes"]]}) for g in raw["gpus"]]
        return cls(**{**raw, "gpus": gpus})


def machine(
    count: int,
    *,
    nvlink: bool = False,
    level: int = PXB,
    name: str = "NVIDIA H100 80GB HBM3",
    links_per_pair: int = 4,
    nvswitch: bool = False,
    sockets: int = 1,
) -> FakeMachine:
    """`count` identical GPUs. `nvlink`: every pair joined by `links_per_pair` links.
    Pairs are `level` apart; with `sockets=2`, GPUs 0..n/2-1 and n/2..n-1 sit on two
    CPU sockets: `level` inside a socket, SYS across (a typical dual-socket PCIe box). `nvswitch`: HGX-style,
    18 links per GPU into switches."""
    gpus = []
    for i in range(count):
        bus = 0x18 + 0x10 * i
        gpus.append(FakeGpu(
            name=name,
            uuid=f"GPU-{i:08x}-1111-2222-3333-{bus:012x}",
            pci_bus_id=f"00000000:{bus:02X}:00.0",
        ))
    half = max(1, count // sockets)
    topology = [[level if i // half == j // half else SYS for j in range(count)] for i in range(count)]
    nvlinks: list[list[str]] = [[] for _ in range(count)]
    if nvlink:
        for i in range(count):
            for j in range(count):
                if i != j:
                    nvlinks[i] += [gpus[j].pci_bus_id] * links_per_pair
    if nvswitch:  # HGX: every GPU's 18 links go to NVSwitches, never straight to a GPU
        for i in range(count):
            nvlinks[i] = [f"00000000:{0xC0 + i % 4:02X}:00.0" for _ in range(18)]
        nvlink = True
    p2p = [[nvlink or topology[i][j] < NODE for j in range(count)] for i in range(count)]
    return FakeMachine(gpus=gpus, topology=topology, nvlinks=nvlinks, p2p_read_ok=p2p)

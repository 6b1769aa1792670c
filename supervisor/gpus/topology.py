"""GPU-to-GPU topology of the planned GPUs, checked before a multi-GPU run.

The matrix reads like `nvidia-smi topo -m`: NV# (NVLink links between the pair),
PIX (one PCIe switch), PXB (several switches), PHB (the CPU's host bridge),
NODE (between host bridges in one NUMA node), SYS (across CPU sockets). P2P read
status comes from nvmlDeviceGetP2PStatus. NODE/SYS pairs or missing P2P are
where the seed saw multi-GPU training fall far behind a single GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from supervisor.gpus import nvml

LEVEL_NAMES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}  # 0: same board
SLOW_LEVELS = ("NODE", "SYS")
P2P_NAMES = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}
P2P_MEANING = {
    "CNS": "chipset not supported", "GNS": "GPU not supported", "TNS": "topology not supported",
    "DR": "disabled by regkey", "NS": "not supported", "U": "unknown",
}
LEGEND = """Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g. QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
P2P read: OK, CNS chipset / GNS GPU / TNS topology not supported, DR disabled by regkey, NS not supported, U unknown"""


def _p2p_read_index(pynvml: ModuleType) -> int:
    """pynvml defines NVML_P2P_CAPS_INDEX_READ = 0, (a stray comma makes it a tuple);
    the C function takes an int, so unwrap it whatever the version."""
    value = pynvml.NVML_P2P_CAPS_INDEX_READ
    return int(value[0] if isinstance(value, tuple) else value)


@dataclass
class Topology:
    gpus: list[int]  # physical ids, in matrix order
    link: dict[tuple[int, int], str] = field(default_factory=dict)  # (a, b) -> "NV4" / "PIX" / ... / "n/a"
    p2p: dict[tuple[int, int], str] = field(default_factory=dict)  # (a, b) -> "OK" / "CNS" / ... / "n/a"
    unopened: dict[int, str] = field(default_factory=dict)  # GPU -> why NVML could not open it (n/a pairs)

    def pairs(self) -> list[tuple[int, int]]:
        return list(itertools.combinations(self.gpus, 2))

    def warnings(self) -> list[str]:
        """Advice for every slow pair (through the CPU or the network) and every pair without P2P."""
        out = [f"GPU {g}: links unknown, NVML could not open it ({why})" for g, why in self.unopened.items()]
        slow = [(a, b, self.link[a, b]) for a, b in self.pairs() if self.link.get((a, b)) in SLOW_LEVELS]
        if slow:
            listed = ", ".join(f"GPU{a}-GPU{b} {kind}" for a, b, kind in slow)
            out.append(
                f"slow GPU interconnect: {listed}. NODE crosses host bridges, SYS crosses CPU sockets; the seed "
                "measured such multi-GPU runs far slower than one GPU (~0.01 vs ~12 it/s on RTX 4090s) and NCCL "
                "timeouts. A single GPU (./train_gpu.sh N) may be faster; prefer GPUs on one PCIe switch "
                "(PIX/PXB) or NVLink (--gpus); if you go on, consider NCCL_P2P_LEVEL=SYS and a longer timeout.")
        no_p2p = [(a, b, self.p2p[a, b]) for a, b in self.pairs() if self.p2p.get((a, b)) not in ("OK", "n/a", None)]
        if no_p2p:
            listed = ", ".join(f"GPU{a}-GPU{b} ({P2P_MEANING.get(s, s)})" for a, b, s in no_p2p)
            out.append(f"no GPU peer-to-peer access for {listed}: NCCL will copy through host memory (SHM), "
                       "which is slower; single-GPU training may be faster than this set.")
        return out

    def format(self) -> str:
        """`nvidia-smi topo -m` style: the link matrix, then the P2P read matrix."""
        names = [f"GPU{g}" for g in self.gpus]
        width = max(6, *(len(n) for n in names)) + 2

        def matrix(cells: dict[tuple[int, int], str]) -> list[str]:
            lines = [" " * width + "".join(n.ljust(width) for n in names)]
            for a in self.gpus:
                row = [" X" if a == b else cells.get((min(a, b), max(a, b)), "n/a") for b in self.gpus]
                lines.append(f"GPU{a}".ljust(width) + "".join(c.ljust(width) for c in row))
            return [line.rstrip() for line in lines]

        return "\n".join(matrix(self.link) + ["", "P2P read:"] + matrix(self.p2p) + ["", LEGEND])


def read_topology(gpu_ids: list[int]) -> Topology:
    """Topology of these GPUs (physical ids). Raises nvml.NvmlUnavailable without NVML."""
    with nvml.session() as pynvml:
        handles, failed = nvml.handles(pynvml)  # a lost or forbidden GPU leaves its pairs n/a
        unopened = {i: e.reason for i, e in failed.items()}
        bus_of = _buses(pynvml, handles, unopened)
        reader = nvml.FieldReader(pynvml)
        links = {i: _nvlinks(pynvml, reader, i, handles[i], bus_of) for i in gpu_ids if i in handles}
        topo = Topology(gpus=list(gpu_ids), unopened={i: unopened[i] for i in gpu_ids if i in unopened})
        read_index = _p2p_read_index(pynvml)
        for a, b in topo.pairs():
            if a not in handles or b not in handles:
                topo.link[a, b] = topo.p2p[a, b] = nvml.NA
                continue
            ha, hb = handles[a], handles[b]
            count = links[a]["gpu"].get(b, 0)
            if not count and links[a]["switch"] and links[b]["switch"]:
                count = min(links[a]["switch"], links[b]["switch"])  # NVSwitch: all-to-all
            if count:
                topo.link[a, b] = f"NV{count}"
            else:
                level = reader.read(a, "topology", lambda ha=ha, hb=hb: pynvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
                topo.link[a, b] = LEVEL_NAMES.get(level, nvml.NA) if level != nvml.NA else nvml.NA
            status = reader.read(a, "P2P status", lambda ha=ha, hb=hb: pynvml.nvmlDeviceGetP2PStatus(ha, hb, read_index))
            topo.p2p[a, b] = P2P_NAMES.get(status, "U") if status != nvml.NA else nvml.NA
        return topo


def _buses(pynvml: ModuleType, handles: dict[int, Any], unopened: dict[int, str]) -> dict[int, str]:
    """PCI bus id of every GPU; one lost since its handle was opened moves to `unopened`."""
    out = {}
    for index, handle in list(handles.items()):
        try:
            out[index] = _bus(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        except pynvml.NVMLError as exc:
            if not nvml.is_lost(pynvml, exc):
                raise
            unopened[index] = f"lost (NVML: {exc})"
            del handles[index]
    return out


def _nvlinks(pynvml: ModuleType, reader: nvml.FieldReader, index: int, handle: Any,
             bus_of: dict[int, str]) -> dict[str, Any]:
    """Active links of one GPU: {"gpu": {peer: count}, "switch": count}. A link whose far
    end is no GPU of this machine goes to an NVSwitch (HGX boards)."""
    gpu_of_bus = {bus.lower(): i for i, bus in bus_of.items()}
    peers: dict[int, int] = {}
    switch = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
            remote = _bus(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
        except Exception as exc:
            if nvml.is_lost(pynvml, exc):
                raise nvml.GpuLost(index, f"NVML: {exc}") from None
            if not (nvml.is_unsupported(pynvml, exc) or isinstance(exc, pynvml.NVMLError)):
                raise
            break  # past the last link, or no NVLink on this board/driver: PCIe levels decide
        peer = gpu_of_bus.get(remote)
        if peer is None:
            switch += 1
        else:
            peers[peer] = peers.get(peer, 0) + 1
    return {"gpu": peers, "switch": switch}


def _bus(bus_id: Any) -> str:
    return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

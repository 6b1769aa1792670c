"""torchrun's `--numa-binding`: each GPU worker on the CPUs (and memory) near its GPU.

On a multi-socket GPU server a worker whose threads and pages sit on the other socket
pays the inter-socket link for every host-to-device copy and every data-loader batch.
The modes are torch's (torch.numa.binding.AffinityMode):

  node          every CPU of the GPU's NUMA node
  socket        every CPU of every NUMA node on the GPU's socket
  exclusive     the GPU's NUMA node split between the workers whose GPUs share it: whole
                physical cores (all their hyperthreads), disjoint, in local-rank order
  core-complex  one last-level-cache group (an AMD CCX, say) of the GPU's node per worker

Memory is bound to the same node(s). The GPU's node is the kernel's (sysfs `numa_node` of
its PCI device); where the kernel does not know (-1), NVML's CPU affinity of the GPU says
which CPUs are near it. Only CPUs this process may run on are used. `bind_gpus` is the
pure policy (tests feed it a made-up host); `read_host` reads /sys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode

MODES = ("node", "socket", "exclusive", "core-complex")


@dataclass(frozen=True)
class Host:
    """The CPU side of the machine, as far as binding needs it."""

    node_cpus: dict[int, frozenset[int]]  # NUMA node -> its usable CPUs
    cpu_socket: dict[int, int]  # CPU -> physical package
    cpu_core: dict[int, tuple[int, int]]  # CPU -> (socket, core id): hyperthreads share it
    cpu_cache: dict[int, frozenset[int]]  # CPU -> the CPUs sharing its last-level cache


@dataclass(frozen=True)
class Binding:
    cpus: frozenset[int]
    nodes: frozenset[int]

    def describe(self) -> str:
        return f"CPUs {ranges(self.cpus)}, memory on node {ranges(self.nodes)}"

    def numactl(self) -> list[str]:
        return ["numactl", f"--physcpubind={ranges(self.cpus)}", f"--membind={ranges(self.nodes)}"]


def bind_gpus(mode: str, gpu_nodes: list[int], host: Host) -> list[Binding]:
    """One binding per local rank, whose GPU sits on NUMA node `gpu_nodes[rank]`."""
    out = []
    for rank, node in enumerate(gpu_nodes):
        if node not in host.node_cpus or not host.node_cpus[node]:
            raise DeviceError(f"--numa-binding: NUMA node {node} of local rank {rank}'s GPU has no CPU "
                              "this process may use", ExitCode.USAGE)
        sharing = [r for r, n in enumerate(gpu_nodes) if n == node]  # ranks whose GPUs share the node
        if mode == "node":
            out.append(Binding(host.node_cpus[node], frozenset({node})))
        elif mode == "socket":
            socket = host.cpu_socket[min(host.node_cpus[node])]
            nodes = frozenset(n for n, cpus in host.node_cpus.items()
                              if cpus and host.cpu_socket[min(cpus)] == socket)
            out.append(Binding(frozenset().union(*(host.node_cpus[n] for n in nodes)), nodes))
        elif mode == "exclusive":
            out.append(Binding(_exclusive(host, node, sharing, rank), frozenset({node})))
        elif mode == "core-complex":
            groups = sorted({host.cpu_cache[c] & host.node_cpus[node] for c in host.node_cpus[node]}, key=min)
            if len(groups) < len(sharing):
                raise DeviceError(f"--numa-binding core-complex: NUMA node {node} has {len(groups)} cache "
                                  f"group(s) for {len(sharing)} workers", ExitCode.USAGE)
            out.append(Binding(groups[sharing.index(rank)], frozenset({node})))
        else:
            raise ValueError(f"unknown NUMA binding mode {mode!r}")
    return out


def _exclusive(host: Host, node: int, sharing: list[int], rank: int) -> frozenset[int]:
    cores = sorted({host.cpu_core[c] for c in host.node_cpus[node]})
    if len(cores) < len(sharing):
        raise DeviceError(f"--numa-binding exclusive: NUMA node {node} has {len(cores)} physical core(s) for "
                          f"{len(sharing)} workers", ExitCode.USAGE)
    share, extra = divmod(len(cores), len(sharing))
    i = sharing.index(rank)
    start = i * share + min(i, extra)
    mine = set(cores[start:start + share + (1 if i < extra else 0)])
    return frozenset(c for c in host.node_cpus[node] if host.cpu_core[c] in mine)


def read_host(root: Path = Path("/sys"), allowed: set[int] | None = None) -> Host:
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    node_cpus = {}
    for node_dir in sorted((root / "devices/system/node").glob("node[0-9]*")):
        cpus = parse_ranges((node_dir / "cpulist").read_text()) & allowed
        node_cpus[int(node_dir.name[4:])] = frozenset(cpus)
    if not node_cpus:  # no NUMA in this kernel: one node with every CPU
        node_cpus = {0: frozenset(allowed)}
    socket, core, cache = {}, {}, {}
    for cpu in sorted(allowed):
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        socket[cpu] = _read_int(topo / "physical_package_id", 0)
        core[cpu] = (socket[cpu], _read_int(topo / "core_id", cpu))
        cache[cpu] = _last_level_cache(root / f"devices/system/cpu/cpu{cpu}/cache", cpu) & allowed
    return Host(node_cpus, socket, core, {c: frozenset(s) for c, s in cache.items()})


def gpu_node(pci_bus_id: str, near_cpus: set[int] | None, host: Host, root: Path = Path("/sys")) -> int:
    """The GPU's NUMA node: the kernel's for its PCI device, else the node holding most of the
    CPUs NVML calls near it, else node 0."""
    domain, _, rest = pci_bus_id.lower().partition(":")
    node = _read_int(root / f"bus/pci/devices/{domain[-4:]}:{rest}/numa_node", -1)
    if node >= 0:
        return node
    if near_cpus:
        return max(host.node_cpus, key=lambda n: (len(host.node_cpus[n] & near_cpus), -n))
    return min(host.node_cpus)


def _last_level_cache(cache_dir: Path, cpu: int) -> set[int]:
    best, cpus = -1, {cpu}
    for index in cache_dir.glob("index[0-9]*"):
        level = _read_int(index / "level", -1)
        if level > best:
            try:
                best, cpus = level, parse_ranges((index / "shared_cpu_list").read_text())
            except OSError:
                continue
    return cpus


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def parse_ranges(text: str) -> set[int]:
    """`0-3,8,10-11` (the kernel's cpulist format) -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            out.update(range(int(low), int(high or low) + 1))
    return out


def ranges(values: frozenset[int] | set[int]) -> str:
    """The inverse of parse_ranges, as numactl reads it."""
    ordered, parts = sorted(values), []
    for value in ordered:
        if parts and parts[-1][1] == value - 1:
            parts[-1][1] = value
        else:
            parts.append([value, value])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def numa_bindings(mode: str, gpus: list[tuple[int, str]], root: Path = Path("/sys")) -> list[Binding]:
    """One binding per local rank, whose GPU is (nvidia-smi index, PCI bus id) `gpus[rank]`."""
    host = read_host(root)
    nodes = [gpu_node(bus, _nvml_near_cpus(index, os.cpu_count() or 1), host, root) for index, bus in gpus]
    return bind_gpus(mode, nodes, host)


def _nvml_near_cpus(index: int, cpu_count: int) -> set[int] | None:
    """nvmlDeviceGetCpuAffinity: the CPUs NVML calls ideal for the GPU (64 per word), None where
    NVML cannot say."""
    from supervisor.gpus import nvml

    try:
        with nvml.session() as pynvml:
            words = pynvml.nvmlDeviceGetCpuAffinity(nvml.handle_by_index(pynvml, index), (cpu_count + 63) // 64)
    except Exception:  # noqa: BLE001 - no NVML, an old driver: the kernel's node (or node 0) decides
        return None
    return {64 * w + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1}

"""All NVML access of the supervisor goes through this package (the GPU adapter).

Public API (what the supervisor and the CLIs call):
  plan_gpus(requested, allowed_env, force) -> list[GpuInfo]     plan.py
  DeviceError(message, code)  .code: 2 usage / 4 device          errors.py
  format_device_table(gpus, rank_of_gpu) -> str                 table.py
  GpuMonitor(gpus, rank_of_gpu, worker_pids, sink, warn, fatal, interval, verbose)   monitor.py
  select_least_used(window_s, allowed_env, force=...) -> Selection   selection.py
  read_topology(gpu_ids) -> Topology (.format(), .warnings())   topology.py
  NcclTransportWatch: warns when same-node pairs fall back to SHM/NET   nccl_transport.py
  read_inventory() -> list[GpuInfo]                              inventory.py
"""

from supervisor.gpus.errors import DeviceError
from supervisor.gpus.inventory import GpuInfo, GpuProcess, read_inventory
from supervisor.gpus.monitor import GpuMonitor
from supervisor.gpus.nvml import GpuLost, NvmlUnavailable
from supervisor.gpus.plan import plan_gpus, release_claims
from supervisor.gpus.selection import Selection, select_least_used
from supervisor.gpus.table import format_device_table
from supervisor.gpus.topology import Topology, read_topology

__all__ = [
    "DeviceError", "GpuInfo", "GpuLost", "GpuMonitor", "GpuProcess", "NvmlUnavailable", "Selection", "Topology",
    "format_device_table", "plan_gpus", "read_inventory", "read_topology", "release_claims",
    "select_least_used",
]

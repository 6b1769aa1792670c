"""Devices: every NVML call of the supervisor, and the plan of which device each worker gets.

Everything outside this package imports from here, never from the modules below.

  plan_devices(system, cuda_visible_devices, nproc_explicit, force, avoid) -> DevicePlan   devices.py
  DevicePlan / DeviceSlot: the workers' devices in rank order                         devices.py
  exclude_gpus(plan, gpu_ids) -> DevicePlan: a restart without suspect GPUs            devices.py
  plan_gpus(requested, allowed_env, force, first=, avoid=) -> list[GpuInfo]           plan.py
  DeviceError(message, exit_code): 2 usage (ExitCode.BUSY_GPU too) / 4 device         gpuherd/errors.py
  format_device_table(gpus, rank_of_gpu) -> str                                       table.py
  GpuMonitor(gpus, rank_of_gpu, worker_pids, sink, warn, fatal, interval, verbose)    monitor.py
  select_least_used(window_s, allowed_env, force=...) -> Selection                    selection.py
  read_topology(gpu_ids) -> Topology (.format(), .warnings())                         topology.py
  read_inventory() -> list[GpuInfo]; allowed_gpus(inventory, CUDA_VISIBLE_DEVICES)    inventory.py, visible.py
  CLAIM_FDS_ENV: the variable that hands a GPU claim through exec                     claim.py
  read_device_health(index) -> DeviceHealth: pre-flight readings (ECC, XID, links)    device_health.py
  NA: what a reading is when the board or driver cannot answer                        nvml.py
  numa_bindings(mode, [(index, pci bus id)]) -> [Binding]: --numa-binding's CPUs/nodes numa.py
  whose process an NVML pid is (host pids seen from a container)                     pids.py
"""

from gpuherd.errors import DeviceError
from supervisor.gpus.claim import CLAIM_FDS_ENV
from supervisor.gpus.device_health import DeviceHealth, read_device_health
from supervisor.gpus.devices import DevicePlan, DeviceSlot, exclude_gpus, plan_devices
from supervisor.gpus.inventory import GpuInfo, GpuProcess, read_inventory
from supervisor.gpus.monitor import GpuMonitor
from supervisor.gpus.numa import Binding, numa_bindings
from supervisor.gpus.nvml import NA, GpuLost, NvmlUnavailable
from supervisor.gpus.plan import plan_gpus, release_claims
from supervisor.gpus.selection import Selection, select_least_used
from supervisor.gpus.table import format_device_table
from supervisor.gpus.topology import Topology, read_topology
from supervisor.gpus.visible import allowed_gpus

__all__ = [
    "CLAIM_FDS_ENV", "NA", "Binding", "DeviceError", "DeviceHealth", "DevicePlan", "DeviceSlot", "GpuInfo", "GpuLost", "GpuMonitor", "GpuProcess",
    "NvmlUnavailable", "Selection", "Topology", "allowed_gpus", "exclude_gpus", "format_device_table", "numa_bindings",
    "plan_devices",
    "plan_gpus",
    "read_device_health", "read_inventory", "read_topology", "release_claims", "select_least_used",
]

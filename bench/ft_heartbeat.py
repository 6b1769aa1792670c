"""NVIDIA's rank-monitor client for the benchmark workers, only under ft_launcher (None elsewhere).

Imported by the workers from their own directory (they run as scripts: `from ft_heartbeat import ...`)."""

import os


def ft_client():
    if "FT_RANK_MONITOR_IPC_SOCKET" not in os.environ:
        return None
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client

"""Is the run healthy: heartbeats per rank (hangs, early exits, a group that never
forms), run watchers that may end it (the GPU watch), NCCL transport warnings, and
the metrics.jsonl sink every record goes to."""

from supervisor.health.gpu_watch import announce_devices, gpu_watcher
from supervisor.health.heartbeat import Heartbeats, Verdict, hang_timeouts
from supervisor.health.metrics import MetricsSink
from supervisor.health.nccl_transport import NcclTransportWatch
from supervisor.health.watchers import FatalCause, RunContext, RunWatcher

__all__ = [
    "FatalCause", "Heartbeats", "MetricsSink", "NcclTransportWatch", "RunContext", "RunWatcher", "Verdict",
    "announce_devices", "gpu_watcher", "hang_timeouts",
]

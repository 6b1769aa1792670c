"""Is the run healthy: heartbeats per rank (hangs, early exits, a group that never
forms), run watchers that may end it (the GPU watch), NCCL transport warnings, the
devices blamed for transient faults (`suspect` records), the metrics.jsonl sink every
record goes to, and the pre-flight checks before a run."""

from supervisor.health.gpu_watch import announce_devices, gpu_watcher
from supervisor.health.heartbeat import Heartbeats, Verdict, hang_timeouts
from supervisor.health.metrics import MetricsSink
from supervisor.health.nccl_transport import NcclTransportWatch
from supervisor.health.items import FAIL, PASS, WARN
from supervisor.health.preflight import CheckReport, run_checks
from supervisor.health.suspects import SuspectWatch
from supervisor.health.watchers import FatalCause, RunContext, RunWatcher

__all__ = [
    "FAIL", "PASS", "WARN", "CheckReport", "FatalCause", "Heartbeats", "MetricsSink", "NcclTransportWatch", "RunContext", "RunWatcher", "SuspectWatch",
    "Verdict",
    "announce_devices", "gpu_watcher", "hang_timeouts", "run_checks",
]

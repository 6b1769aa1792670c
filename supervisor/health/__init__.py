"""Is the run healthy: progress and liveness per rank (hangs blamed by evidence, early
exits, a group that never forms), hang timeouts learned per phase, stragglers, collective
traces on a hang, run watchers that may end it (the GPU watch), NCCL transport warnings,
and the metrics.jsonl sink every record goes to."""

from supervisor.health import traces
from supervisor.health.gpu_watch import announce_devices, gpu_watcher
from supervisor.health.heartbeat import Heartbeats, Verdict, hang_timeouts
from supervisor.health.metrics import MetricsSink
from supervisor.health.nccl_transport import NcclTransportWatch
from supervisor.health.stragglers import Stragglers
from supervisor.health.timeouts import HangPolicy, LearnedTimeouts, previous_learned
from supervisor.health.watchers import FatalCause, RunContext, RunWatcher

__all__ = [
    "FatalCause", "HangPolicy", "Heartbeats", "LearnedTimeouts", "MetricsSink", "NcclTransportWatch", "RunContext",
    "RunWatcher", "Stragglers", "Verdict", "announce_devices", "gpu_watcher", "hang_timeouts", "previous_learned",
    "traces",
]

"""Is the run healthy: progress and liveness per rank (hangs blamed by evidence, early
exits, a group that never forms), hang timeouts learned per phase, stragglers, collective
traces on a hang, run watchers that may end it (the GPU watch), NCCL transport warnings,
the devices blamed for transient faults or silent data corruption (`suspect` records, and
the per-host list that outlives the run), the metrics.jsonl sink every
record goes to, and the pre-flight checks before a run."""

from supervisor.health import traces
from supervisor.health.gpu_watch import announce_devices, gpu_watcher
from supervisor.health.heartbeat import HangVerdict, Heartbeats, hang_timeouts
from supervisor.health.items import FAIL, PASS, WARN
from supervisor.health.metrics import MetricsSink
from supervisor.health.nccl_transport import NcclTransportWatch
from supervisor.health.node_stragglers import NodeStragglers, pace_record, read_pace
from supervisor.health.preflight import CheckReport, run_checks
from supervisor.health.proc_state import MEANING, PROC_SAMPLE_S, ProcReader, ProcSample, ProcTracker, cannot_run
from supervisor.health.straggler_moves import Due, MoveOut
from supervisor.health.stragglers import Stragglers
from supervisor.health.suspect_list import StartExclusion, SuspectList, at_start, avoid_listed, list_path, remember
from supervisor.health.suspects import SuspectWatch, mark_moved
from supervisor.health.timeouts import HangPolicy, LearnedTimeouts, previous_learned
from supervisor.health.watchers import FatalCause, RunContext, RunWatcher

__all__ = [
    "FAIL", "MEANING", "PASS", "PROC_SAMPLE_S", "WARN", "CheckReport", "Due", "FatalCause", "MoveOut", "HangPolicy",
    "HangVerdict", "Heartbeats",
    "LearnedTimeouts", "MetricsSink", "NcclTransportWatch", "NodeStragglers", "ProcReader", "ProcSample", "ProcTracker", "RunContext",
    "RunWatcher", "StartExclusion", "Stragglers", "SuspectList", "SuspectWatch", "announce_devices", "at_start",
    "avoid_listed", "cannot_run", "gpu_watcher", "hang_timeouts", "list_path", "mark_moved", "previous_learned", "remember",
    "pace_record", "read_pace", "run_checks", "traces",
]

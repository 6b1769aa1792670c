"""The worker processes of an attempt: started so they can never outlive the supervisor,
watched by one event loop, and torn down together.

  Supervision (supervision.py): the event loop: pipes, reaping, events for the policy, its actions done;
    its parts: WakeUps (wakeups.py), Announcer (announcing.py), HangWatch (hang_watch.py), LiveRanks
    (live_ranks.py), worker_cause (worker_causes.py), answer_requests (spare_answers.py)
  Phase, decide (policy.py): the supervision policy, a pure function of events and time
  spawn, WorkerProcess (spawn.py): one worker in its own process group, death signal set;
    helper_preexec: a helper's death signal, and stop signals ignored
  worker_env, RunEnv, python_env, script_env (worker_env.py): the environment contract
  error_file_for, read_error_file (error_file.py): TORCHELASTIC_ERROR_FILE per rank, read back
  StopRules, GracefulStop, SAVE_AND_STOP, stop_exit_code, within_kill_wait (stopping.py): a graceful
    stop's rules (which signal, how long) and its outcome (was the final checkpoint saved?)
  LiveRecovery (live_recovery.py): a lost rank replaced by a warm spare, the group shrunk, or why not, as
    live_policy.py decides (restarts_used: what an attempt's recoveries used of --max-restarts);
    Recovery (recovery_record.py): one recovery as recorded
  live_for_attempt, AttemptLive, discard_spares, LIVE_ENV, why_off (live_setup.py): an attempt's live
    recovery put together, and why none
  SparePool (spares.py): warm spare workers (--spares), promoted to a lost rank
  SpareNodeWorkers (spare_node_workers.py): a spare node's (--spare-nodes) warm workers, handed a dead node's ranks
  Standbys (standbys.py): a --script's next attempt, its interpreters importing torch while this one trains
  SpareDesk, write_request, read_answer, request_path, device_name (spare_requests.py): a spare
    asked of a running supervisor (`gpuherd spare`), through requests/ in the run directory
  OrphanGuard, sweep_children (orphan_guard.py -> orphan_guard_main.py, a helper process)
  take_inherited_markers, markers_notice (inherited_markers.py): gpuherd's own markers found in the
    supervisor's environment, removed and named
  STOP_SIGNALS, StopSignal, stops_raise, stops_recorded, honoured, inherited_ignored, ignored_notice (signal_rules.py):
    one rule per signal for the whole run (inherited-ignored stays ignored; the build stops too)
"""

from supervisor.processes.error_file import ERROR_FILE_VAR, RankError, error_file_for, read_error_file
from supervisor.processes.inherited_markers import markers_notice, take_inherited_markers
from supervisor.processes.live_policy import restarts_used
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.recovery_record import Recovery
from supervisor.processes.live_setup import LIVE_ENV, AttemptLive, discard_spares, live_for_attempt, why_off
from supervisor.processes.orphan_guard import OrphanGuard, sweep_children
from supervisor.processes.signal_rules import (
    STOP_SIGNALS,
    StopSignal,
    honoured,
    ignored_notice,
    inherited_ignored,
    stops_raise,
    stops_recorded,
)
from supervisor.processes.spare_requests import SpareDesk, device_name, read_answer, request_path, write_request
from supervisor.processes.spare_node_workers import SpareNodeWorkers
from supervisor.processes.spares import SparePool
from supervisor.processes.standbys import Standbys, standby_env
from supervisor.processes.spawn import WorkerProcess, become_subreaper, die_with_parent, helper_preexec, spawn
from supervisor.processes.stopping import SAVE_AND_STOP, GracefulStop, StopRules, stop_exit_code, within_kill_wait
from supervisor.processes.policy import Phase
from supervisor.processes.supervision import Supervision
from supervisor.processes.worker_env import RunEnv, python_env, script_env, worker_env

__all__ = [
    "ERROR_FILE_VAR",
    "SAVE_AND_STOP", "STOP_SIGNALS", "GracefulStop", "StopSignal", "honoured", "ignored_notice",
    "inherited_ignored", "stops_raise", "stops_recorded", "OrphanGuard", "Phase", "RankError", "RunEnv", "StopRules", "Supervision",
    "LIVE_ENV", "AttemptLive", "LiveRecovery", "Recovery", "SpareDesk", "SpareNodeWorkers", "SparePool", "Standbys", "device_name", "read_answer",
    "request_path", "restarts_used", "write_request", "discard_spares", "live_for_attempt",
    "WorkerProcess", "become_subreaper", "die_with_parent", "error_file_for", "helper_preexec", "python_env",
    "read_error_file",
    "script_env", "spawn", "standby_env", "stop_exit_code", "sweep_children", "within_kill_wait",
    "worker_env", "why_off", "markers_notice", "take_inherited_markers",
]

"""The worker processes of an attempt: started so they can never outlive the supervisor,
watched by one event loop, and torn down together.

  Supervision, Phase (supervision.py): the event loop and its teardown state machine
  spawn, WorkerProcess (spawn.py): one worker in its own process group, death signal set
  worker_env, RunEnv, python_env, script_env (worker_env.py): the environment contract
  error_file_for, read_error_file (error_file.py): TORCHELASTIC_ERROR_FILE per rank, read back
  StopRules, GracefulStop, SAVE_AND_STOP, stop_exit_code, within_kill_wait (stopping.py): a graceful
    stop's rules (which signal, how long) and its outcome (was the final checkpoint saved?)
  OrphanGuard, sweep_children (orphan_guard.py -> orphan_guard_main.py, a helper process)
  STOP_SIGNALS, StopSignal, stops_raise, honoured, inherited_ignored, ignored_notice (signal_rules.py):
    one rule per signal for the whole run (inherited-ignored stays ignored; the build stops too)
"""

from supervisor.processes.error_file import ERROR_FILE_VAR, RankError, error_file_for, read_error_file
from supervisor.processes.orphan_guard import OrphanGuard, sweep_children
from supervisor.processes.signal_rules import (
    STOP_SIGNALS,
    StopSignal,
    honoured,
    ignored_notice,
    inherited_ignored,
    stops_raise,
)
from supervisor.processes.spawn import WorkerProcess, become_subreaper, die_with_parent, spawn
from supervisor.processes.stopping import SAVE_AND_STOP, GracefulStop, StopRules, stop_exit_code, within_kill_wait
from supervisor.processes.supervision import Phase, Supervision
from supervisor.processes.worker_env import RunEnv, python_env, script_env, worker_env

__all__ = [
    "ERROR_FILE_VAR",
    "SAVE_AND_STOP", "STOP_SIGNALS", "GracefulStop", "StopSignal", "honoured", "ignored_notice",
    "inherited_ignored", "stops_raise", "OrphanGuard", "Phase", "RankError", "RunEnv", "StopRules", "Supervision",
    "WorkerProcess", "become_subreaper", "die_with_parent", "error_file_for", "python_env", "read_error_file",
    "script_env", "spawn", "stop_exit_code", "sweep_children", "within_kill_wait",
    "worker_env",
]

"""A rank's root cause as the supervision loop (supervision.py) builds it: complete when made
(RootCause is immutable), with the rank's stderr tail so far; for a worker that exited, its own
account first (torch's @record error file), else its status record's error.
"""

from __future__ import annotations

from gpuherd.exit_codes import ExitCode
from supervisor.output import WorkerLog
from supervisor.processes.error_file import error_file_for, read_error_file
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import RootCause, how_it_ended


def worker_cause(kind: str, code: int, message: str, w: WorkerProcess, log: WorkerLog, **more: object) -> RootCause:
    """`w`'s cause: its stderr tail so far (`log`: its log), and `more`."""
    return RootCause(kind, int(code), message, rank=w.slot.rank, device=w.slot.tag,
                     stderr_tail=[line.decode(errors="replace") for line in log.stderr_tail], **more)


def exit_failure(w: WorkerProcess, code: int, now: float, log: WorkerLog, status_error: str | None,
                 script: bool) -> RootCause:
    """A worker's failed exit as the root cause: its own account first (torch's @record error
    file), else `status_error` (its status record's). `script`: its exit code is a user's script's."""
    message = (f"{w.slot.tag} (rank {w.slot.rank}) {how_it_ended(w.returncode, script)} "
               f"after {now - w.started:.1f} s")
    error = read_error_file(error_file_for(w.log_path))
    if error is not None or status_error:
        message += f": {error.message if error is not None else status_error}"
    return worker_cause("worker-exit", code, message, w, log,
                        script_code=script and w.returncode > 0,  # a signal's death: nobody's code
                        traceback=list(error.traceback) if error is not None else [])


def suspect_gpu(w: WorkerProcess, cause: RootCause) -> bool:
    """The rank left over its own GPU (exit 8, a suspect device; a straggler moved out): never
    replaced on the same GPU."""
    return w.slot.kind == "cuda" and (cause.exit_code == ExitCode.DEVICE_SUSPECT and not cause.script_code
                                      or cause.kind == "straggler")

"""The launcher's own TORCHELASTIC_ERROR_FILE: the job's root cause, where schedulers read it.

A scheduler that starts torchrun (TorchX, Kubernetes' PyTorchJob tooling) sets
TORCHELASTIC_ERROR_FILE on the launcher and reads the root cause back from it when the job
fails. torchrun (its `@record` on main) copies the first failed rank's error file there,
with `message.errorCode` set to that rank's exit code (negative: the signal that killed it).
gpuherd writes the same copy. Where no rank left an error file (a script without `@record`,
a hang, a signal), torchrun writes nothing; gpuherd writes the root cause in torch's format,
`{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}, "errorCode"}}`, its
callstack the failing rank's last stderr lines or the hang evidence
(docs/guide/torchrun.md). Nothing is written for a run that succeeded. Written atomically; the workers
never see the launcher's path (each rank has its own).
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson
from loguru import logger

from gpuherd.files import write_bytes_atomic
from supervisor.processes import ERROR_FILE_VAR, error_file_for
from supervisor.summary import RootCause, WorkerReport


def write_launcher_error_file(environ: dict[str, str], cause: RootCause | None, workers: list[WorkerReport]) -> None:
    target = environ.get(ERROR_FILE_VAR)
    if not target or cause is None:
        return
    failed = next((w for w in workers if cause.rank is not None and w.rank == cause.rank), None)
    data = _copy_of_rank_file(failed) if failed is not None else None
    if data is None:
        data = {"message": {"message": cause.message,
                            "extraInfo": {"py_callstack": "\n".join(cause.traceback or cause.stderr_tail
                                                                    or cause.evidence),
                                          "timestamp": str(int(time.time()))},
                            "errorCode": _torch_exit_code(failed) if failed is not None else cause.exit_code}}
    try:
        write_bytes_atomic(Path(target), orjson.dumps(data))
    except OSError as exc:  # the run's outcome stands; the scheduler gets no file, and the log says why
        logger.warning(f"cannot write {ERROR_FILE_VAR}={target}: {exc.strerror or exc}")


def _copy_of_rank_file(worker: WorkerReport) -> dict | None:
    """The rank's own error file as torchrun copies it: errorCode set where `message` is a dict."""
    try:
        data = orjson.loads(error_file_for(Path(worker.log)).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("message"), dict):
        data["message"]["errorCode"] = _torch_exit_code(worker)
    return data


def _torch_exit_code(worker: WorkerReport) -> int | None:
    """The exit code as torch reports it: negative for a signal (-9), not the shell's 128+N."""
    if worker.exit_code is None:
        return None
    if worker.ended.startswith("killed by") and worker.exit_code > 128:
        return -(worker.exit_code - 128)
    return worker.exit_code

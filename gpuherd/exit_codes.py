"""Exit codes: the one place that gives a failure its number.

The supervisor exits with the first failing worker's own code, so a worker that
knows *why* it failed exits with one of these and the cause survives all the
way to the user's shell. docs/reference/exit-codes.md is generated from this file.
"""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # unclassified failure (an exception in a worker, ...)
    USAGE = 2  # bad command line or config: nothing was started or written
    DATA = 3  # the dataset cache could not be built, fetched or verified
    DEVICE = 4  # GPU lost, hardware XID / ECC error, device mismatch
    # A GPU another process or gpuherd run holds: the user must pick another one or pass
    # --force; nothing is wrong with the hardware, so it is a usage error, not a device error.
    BUSY_GPU = 2
    RENDEZVOUS = 5  # a rank (or, multi-node, a node) never joined in time
    NAN = 6  # non-finite loss or gradient (or a loss spike) stopped by policy `stop` or too many skips
    # Cannot write: no space, quota, file too large, read-only filesystem. A restart
    # would only fail the same way, so this is never restarted.
    STORAGE = 7
    DEVICE_SUSPECT = 8  # one device kept producing transient faults (replays came out clean), or corrupted its replica
    DATA_MODEL = 9  # a suspicious step reproduced on replay: the batch or the model, not the device
    # A request to a running run (`gpuherd spare`) that its state refuses: the run is not
    # running, not shrunk, stopping, or a spare already starts; nothing was changed.
    REFUSED = 10
    HANG = 124  # a worker stopped sending heartbeats (same number as timeout(1))
    SIGINT = 130  # 128 + SIGINT: the user pressed Ctrl-C
    SIGTERM = 143  # 128 + SIGTERM: the supervisor was asked to stop


def from_signal(signum: int) -> int:
    """Shell convention for a process killed by signal N."""
    return 128 + int(signum)


def describe(code: int, script: bool = False) -> str:
    """Human words for an exit code, for summaries and error blocks. `script`: the code of a
    user's script, which means what the script means by it; only signal deaths have names."""
    if code < 0:  # subprocess returncode for "killed by signal -code"
        return f"killed by {_signal_name(-code)}"
    if script and code <= 128:
        return f"exit code {code}"
    try:
        return {
            ExitCode.OK: "success",
            ExitCode.FAILURE: "failure",
            ExitCode.USAGE: "usage or config error",
            ExitCode.DATA: "dataset cache error",
            ExitCode.DEVICE: "device error",
            ExitCode.RENDEZVOUS: "process group never formed",
            ExitCode.NAN: "non-finite loss or gradient, or a loss spike",
            ExitCode.STORAGE: "cannot write: disk full, quota, file too large or read-only",
            ExitCode.DEVICE_SUSPECT: "suspect device: repeated transient faults",
            ExitCode.DATA_MODEL: "data or model fault: the suspicious step reproduced",
            ExitCode.REFUSED: "request refused: the run's state does not allow it now",
            ExitCode.HANG: "hang detected",
            ExitCode.SIGINT: "interrupted (SIGINT)",
            ExitCode.SIGTERM: "terminated (SIGTERM)",
        }[ExitCode(code)]
    except ValueError:
        if code > 128:
            return f"killed by {_signal_name(code - 128)}"
        return f"exit code {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

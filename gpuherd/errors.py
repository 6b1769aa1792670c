"""Every failure that ends a process with a known exit code, one class per cause.

Every layer raises one of these (config, dataset, device, a launch's checks; the rest
subclass `GpuherdError`); entry points catch `GpuherdError` once, print its one line and
exit with `exit_code`. Classification is by type, never by class-name strings or
duck-typed attributes, so a rename cannot silently turn a known cause into "failure".
The numbers themselves are gpuherd/exit_codes.py's.
"""

from __future__ import annotations

from gpuherd.exit_codes import ExitCode


class GpuherdError(Exception):
    """A failure phrased as one line for the user, with the exit code that names its cause."""

    exit_code: int = ExitCode.FAILURE  # subclasses set their default

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = int(exit_code)

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(GpuherdError, ValueError):
    """A config problem (gpuherd/config/), phrased as one line for the user; nothing was
    started or written. Its message may end with `text.did_you_mean`'s hint."""

    exit_code = ExitCode.USAGE


class LaunchError(GpuherdError):
    """Something the run would trip over later (a bad path, too many workers), found by a
    launch's checks (supervisor/validation/): said now, before anything is written or spawned."""

    exit_code = ExitCode.USAGE


class DeviceError(GpuherdError):
    """Why the planned GPUs cannot be used (supervisor/gpus/), in one line. Its code:
    USAGE (2) when the user must choose differently: an id that does not exist, an id
    outside CUDA_VISIBLE_DEVICES, a malformed CUDA_VISIBLE_DEVICES, GPUs requested where
    there is no GPU/NVML; also BUSY_GPU (the same number): a busy GPU (another process
    holds memory, or another gpuherd run claimed it) without --force. DEVICE (4, the
    default) when the hardware is broken: a lost GPU."""

    exit_code = ExitCode.DEVICE


class DatasetError(GpuherdError):
    """The dataset cache (dataset_cache/) could not be built, fetched or verified.

    The message is one line naming the culprit (a file, a package, a setting) and,
    where there is one, the fix. Entry points print it and exit with
    `ExitCode.DATA` (3), never with a traceback.
    """

    exit_code = ExitCode.DATA


class CacheCorruptError(DatasetError):
    """A published cache does not match its own metadata (truncated, flipped bytes,
    missing files). `prepare_cache` reports it and rebuilds; a worker that opens
    such a cache directly stops with exit code 3 instead of training on it."""

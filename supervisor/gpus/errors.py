"""DeviceError: why the planned GPUs cannot be used, in one line, with its exit code.

Codes (gpuherd/exit_codes.py):
  2 USAGE  - the request cannot be right on this machine: an id that does not
             exist, an id outside CUDA_VISIBLE_DEVICES, a malformed
             CUDA_VISIBLE_DEVICES, GPUs requested where there is no GPU/NVML.
  4 DEVICE - the request is right but the hardware cannot serve it now: a GPU
             that is lost, busy (another process holds memory, or another
             gpuherd run claimed it) without --force.
"""

from __future__ import annotations

from gpuherd.exit_codes import ExitCode


class DeviceError(RuntimeError):
    def __init__(self, message: str, code: int = ExitCode.DEVICE) -> None:
        super().__init__(message)
        self.code = int(code)

"""DeviceError: why the planned GPUs cannot be used, in one line, with its exit code.

Codes (gpuherd/exit_codes.py):
  2 USAGE  - the user must choose differently: an id that does not
             exist, an id outside CUDA_VISIBLE_DEVICES, a malformed
             CUDA_VISIBLE_DEVICES, GPUs requested where there is no GPU/NVML;
             also ExitCode.BUSY_GPU (the same number): a busy GPU (another
             process holds memory, or another gpuherd run claimed it) without --force.
  4 DEVICE - the hardware is broken: a lost GPU.
"""

from __future__ import annotations

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode


class DeviceError(GpuherdError):
    exit_code = ExitCode.DEVICE

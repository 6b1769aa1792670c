"""The one base class for failures that end a process with a known exit code.

Every layer raises a subclass (config, dataset, device, rendezvous, worker, ...);
entry points catch `GpuherdError` once, print its one line and exit with
`exit_code`. Classification is by type, never by class-name strings or duck-typed
attributes, so a rename cannot silently turn a known cause into "failure".
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

"""One line of `gpuherd check`'s table: what was checked, where, the verdict and why."""

from __future__ import annotations

from dataclasses import dataclass

PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "n/a"  # n/a: this board, driver or run has no such thing


@dataclass(frozen=True)
class CheckItem:
    scope: str  # "GPU 3" for a device item, "host" for the machine
    name: str  # ecc errors, pcie link, checkpoint disk, ...
    status: str  # PASS | WARN | FAIL | n/a
    detail: str  # one line: the numbers, and for WARN/FAIL what to do

    @property
    def device(self) -> bool:
        return self.scope != "host"

    def line(self) -> str:
        return f"{self.scope}: {self.name}: {self.detail}"

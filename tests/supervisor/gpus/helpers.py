"""Shared pieces of the GPU tests: a recorder for the monitor's callbacks, loguru capture."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from loguru import logger


class Recorder:
    """Collects what GpuMonitor hands to sink / warn / fatal / console."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.warnings: list[str] = []
        self.fatals: list[tuple[str, int]] = []
        self.lines: list[str] = []
        self.fatal_event = threading.Event()

    def sink(self, record: dict) -> None:
        self.records.append(record)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def fatal(self, message: str, code: int) -> None:
        self.fatals.append((message, code))
        self.fatal_event.set()

    def console(self, line: str) -> None:
        self.lines.append(line)

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in list(self.records) if r["type"] == kind]


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(handler)

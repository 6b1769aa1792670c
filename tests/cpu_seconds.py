"""CPU seconds per test, the suite's cost on a machine whose cores it keeps busy (wall time says
as much about the other jobs). Opt-in, one file at a time:

    .venv/bin/python -m pytest -p tests.cpu_seconds -n 0 tests/e2e/test_sdc_run.py

Each test's user + system time of the pytest process and of every process it waited for (a
supervisor counts its workers, which it waits for) goes to the end of the output, the costliest
first; with GPUHERD_CPU_SECONDS=PATH, also a JSON line per test appended to PATH. A process
nobody waits for (an orphan reaped by init) is not counted.
"""

from __future__ import annotations

import os
import resource
import time

import orjson
import pytest

_ROWS: list[tuple[str, float, float]] = []


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    yield
    _ROWS.append((item.nodeid, _cpu() - cpu, time.monotonic() - wall))


def pytest_terminal_summary(terminalreporter) -> None:
    if path := os.environ.get("GPUHERD_CPU_SECONDS"):
        with open(path, "ab") as out:
            for nodeid, cpu, wall in _ROWS:
                out.write(orjson.dumps({"test": nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}) + b"\n")
    terminalreporter.section(f"CPU seconds: {sum(cpu for _, cpu, _ in _ROWS):.1f} over {len(_ROWS)} tests")
    for nodeid, cpu, wall in sorted(_ROWS, key=lambda row: -row[1]):
        terminalreporter.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall  {nodeid}")

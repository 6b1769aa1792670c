"""CPU seconds per test, the suite's cost on a machine whose cores it keeps busy (wall time says
as much about the other jobs). Opt-in, for a file (or folder):

    .venv/bin/python -m pytest -p tests.cpu_seconds -n 0 tests/e2e/test_sdc_run.py

or for the whole suite as CI runs it (under xdist), with GPUHERD_CPU_SECONDS set: each xdist
worker appends its own tests' lines, and the summary below is printed only where tests ran.

Each test's user + system time of the pytest process and of every process it waited for (a
supervisor counts its workers, which it waits for) goes to the end of the output, the costliest
first; with GPUHERD_CPU_SECONDS=PATH, also a JSON line per test appended to PATH. A process
nobody waits for (an orphan reaped by init, a pool that outlives the test such as inductor's
compile workers) is not counted.

The ranked tables of files and tests (markdown, as in bench/RESULTS.md) from such lines:

    .venv/bin/python -m tests.cpu_seconds PATH [--top N]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterable

import orjson
import pytest

_ROWS: list[tuple[str, float, float]] = []


def _cpu() -> tuple[float, float]:
    """(all, the pytest process's own): a test's own share is what it spends watching its runs."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = own.ru_utime + own.ru_stime
    return mine + children.ru_utime + children.ru_stime, mine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (cpu, own), wall = _cpu(), time.monotonic()
    yield
    (cpu_after, own_after), wall_after = _cpu(), time.monotonic()
    row = (item.nodeid, cpu_after - cpu, wall_after - wall)
    _ROWS.append(row)
    if path := os.environ.get("GPUHERD_CPU_SECONDS"):
        # Written as each test ends, by the process that ran it: under xdist the workers run the
        # tests and only the controller prints a summary (of nothing). One short append per line.
        with open(path, "ab") as out:
            out.write(orjson.dumps({"test": row[0], "cpu_s": round(row[1], 2), "wall_s": round(row[2], 2),
                                    "own_cpu_s": round(own_after - own, 2)}) + b"\n")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _ROWS:  # xdist's controller: its workers ran the tests (their lines are in the file)
        return
    terminalreporter.section(f"CPU seconds: {sum(cpu for _, cpu, _ in _ROWS):.1f} over {len(_ROWS)} tests")
    for nodeid, cpu, wall in sorted(_ROWS, key=lambda row: -row[1]):
        terminalreporter.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall  {nodeid}")


def tables(rows: Iterable[dict], top: int = 30) -> str:
    """Markdown: every file ranked by its tests' CPU seconds, then the `top` costliest tests. A
    test measured more than once (a piece run again) counts with its last line."""
    tests = {row["test"]: row for row in rows}
    files: dict[str, list[dict]] = defaultdict(list)
    for nodeid, row in tests.items():
        files[nodeid.split("::")[0]].append(row)
    total = sum(row["cpu_s"] for row in tests.values())
    lines = [f"{total:.0f} CPU s over {len(tests)} tests in {len(files)} files", "",
             "| file | tests | CPU s | share | costliest test (CPU s) |", "|---|---:|---:|---:|---|"]
    for name, members in sorted(files.items(), key=lambda item: -sum(r["cpu_s"] for r in item[1])):
        cpu = sum(r["cpu_s"] for r in members)
        worst = max(members, key=lambda r: r["cpu_s"])
        lines.append(f"| {name} | {len(members)} | {cpu:.1f} | {cpu / total:.1%} | "
                     f"{worst['test'].split('::', 1)[1]} ({worst['cpu_s']:.1f}) |")
    lines += ["", "| test | CPU s | wall s |", "|---|---:|---:|"]
    for row in sorted(tests.values(), key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"| {row['test']} | {row['cpu_s']:.1f} | {row['wall_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cpu_seconds", description=tables.__doc__)
    parser.add_argument("paths", nargs="+", help="JSON lines written under GPUHERD_CPU_SECONDS")
    parser.add_argument("--top", type=int, default=30, help="how many tests in the second table (30)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.paths:
        with open(path, "rb") as lines:
            rows += [orjson.loads(line) for line in lines if line.strip()]
    print(tables(rows, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

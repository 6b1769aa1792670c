"""`pytest -m gpu` over the test files that hold GPU tests (collecting the whole suite would import
every test's packages, which a lent machine need not have), in one process, and its tally.
Without a GPU the tests skip themselves, each with its reason: the rehearsal of this part.

    python -m bench.acceptance.pytest_gpu --device cuda|cpu --result FILE
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from bench.acceptance.outcome import Outcome, part_main
from bench.launchers import ROOT, worker_env

MARK = re.compile(r"pytest\.mark\.gpu\b|mark\.gpu\b")
TALLY = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
PER_TEST_S = 150


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if MARK.search(p.read_text()))


def tally(output: str) -> dict[str, int]:
    """pytest's last summary line as counts: {'passed': 22, 'skipped': 4, ...}."""
    lines = [line for line in output.splitlines() if re.search(r"\b(passed|failed|skipped|error)", line)
             and " in " in line]
    found = TALLY.findall(lines[-1]) if lines else []
    return {("errors" if kind.startswith("error") else kind): int(n) for n, kind in found}


def _run(args: argparse.Namespace, out: Outcome) -> None:
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-ra", "-p", "no:cacheprovider",
           f"--timeout={PER_TEST_S}", *files]
    print(f"acceptance: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True)
    print(done.stdout[-20000:] + done.stderr[-5000:], flush=True)
    counts = tally(done.stdout)
    out.figure(f"`pytest -m gpu` ({len(files)} files)", ", ".join(f"{n} {kind}" for kind, n in counts.items())
               or f"no tally (exit {done.returncode})")
    skipped = sorted({line.split(": ", 1)[-1] for line in done.stdout.splitlines() if line.startswith("SKIPPED")})
    for reason in skipped[:8]:
        out.note(f"skipped: {reason}")
    out.check(done.returncode in (0, 5) and not counts.get("failed") and not counts.get("errors"),
              f"pytest exit {done.returncode}: {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors")


if __name__ == "__main__":
    raise SystemExit(part_main(_run, __doc__.splitlines()[0]))

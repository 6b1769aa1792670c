"""Run every benchmark that fits this machine and record the results.

Each benchmark is a script `bench/bench_<name>.py` that compares two things side by
side in one run and writes `bench/results/<name>.md` (a table, ratios first) and
`bench/results/<name>.json`. This runner runs them one after another in fresh
processes (so one benchmark's warm caches never flatter the next), then appends a
dated section to `bench/RESULTS.md` and writes `bench/RESULTS.json`.

    python -m bench --quick            # the whole suite in a few minutes on 2 cores
    python -m bench --only supervisor  # one benchmark
    python -m bench --gpu              # tokens/s, MFU, peak memory: 124M and 1B, sdpa/flash_attn, eager/compile;
                                       # blocking vs async checkpoints of the 1B model
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench.machine import ROOT, describe

BENCH_DIR = ROOT / "bench"
RESULTS_DIR = BENCH_DIR / "results"


def available() -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def main(argv: list[str] | None = None) -> int:
    benches = available()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: the suite in a few minutes")
    parser.add_argument("--only", action="append", choices=sorted(benches), help="run just this benchmark (repeatable)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--gpu", action="store_true",
                        help="only the GPU rows of the worker and checkpoint benchmarks, and live recovery over "
                             "NCCL (needs CUDA GPUs)")
    args = parser.parse_args(argv)

    chosen = ["worker", "checkpoint", "live_recovery"] if args.gpu else args.only or sorted(benches)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    machine = describe()
    outcomes: dict[str, dict] = {}
    for name in chosen:
        cmd = [sys.executable, str(benches[name])] + (["--quick"] if args.quick else []) + (
            ["--gpu-only"] if args.gpu else [])
        print(f"bench: {name}: {shlex.join(cmd)}", flush=True)
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env())
        seconds = time.monotonic() - started
        md, js = RESULTS_DIR / f"{name}.md", RESULTS_DIR / f"{name}.json"
        ok = proc.returncode == 0 and md.is_file()
        outcomes[name] = {
            "ok": ok, "exit_code": proc.returncode, "seconds": round(seconds, 1), "command": shlex.join(cmd),
            "results": orjson.loads(js.read_bytes()) if ok and js.is_file() else None,
            "table": md.read_text() if ok else None,
        }
        print(f"bench: {name}: {'ok' if ok else f'FAILED (exit {proc.returncode})'} in {seconds:.0f}s", flush=True)

    if not args.no_record:
        _record(machine, outcomes, quick=args.quick)
    failed = [n for n, o in outcomes.items() if not o["ok"]]
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _nested(table: str) -> str:
    """A benchmark's own headings, three levels down, so they sit inside its `### name` section."""
    return re.sub(r"^(#{1,3}) ", lambda m: "###" + m.group(1) + " ", table, flags=re.MULTILINE)


def _record(machine: dict[str, str], outcomes: dict[str, dict], quick: bool) -> None:
    mode = "quick" if quick else "full"
    lines = [
        f"## {machine['date']} — commit {machine['commit']} ({mode} run)",
        "",
        f"- machine: {machine['cpu']}; GPU: {machine['gpu']} (driver {machine['driver']})",
        f"- python {machine['python']}, torch {machine['torch']}",
        "",
    ]
    for name, outcome in outcomes.items():
        lines.append(f"### {name}")
        lines.append("")
        lines.append(f"`{outcome['command']}` ({outcome['seconds']} s)")
        lines.append("")
        lines.append(_nested(outcome["table"].strip()) if outcome["ok"] else f"FAILED with exit code {outcome['exit_code']}")
        lines.append("")
    results_md = BENCH_DIR / "RESULTS.md"
    header = "# Benchmark results\n\nAppended by `python -m bench`; newest last. Ratios compare both sides measured interleaved in one run.\n\n"
    existing = results_md.read_text() if results_md.is_file() else header
    results_md.write_text(existing.rstrip("\n") + "\n\n" + "\n".join(lines))
    (BENCH_DIR / "RESULTS.json").write_bytes(
        orjson.dumps({"machine": machine, "mode": mode, "benchmarks": outcomes}, option=orjson.OPT_INDENT_2)
    )


if __name__ == "__main__":
    raise SystemExit(main())

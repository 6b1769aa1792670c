"""`python -m bench.acceptance` (what `bash bench/gpu_acceptance.sh` runs after installing carried wheels).

    python -m bench.acceptance [--only PART]... [--budget S] [--plan] [--rehearse] [--no-record]

Writes gpu_acceptance.log, .json and .md to $OUT when set (a lent machine sends those back), else
to bench/results/; a GPU run also appends its section to bench/RESULTS.md. Exit 0 when every part
that ran passed (a rehearsal's skipped parts included), 1 otherwise, 2 for a wrong request.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench.acceptance.plan import BUDGET_S, REHEARSAL_BUDGET_S, chosen
from bench.acceptance.record import section, summary_table
from bench.acceptance.run_parts import run_part
from bench.launchers import ROOT, worker_env
from bench.machine import describe


def cuda_here() -> bool:
    """Whether torch sees a CUDA GPU, asked in a child process: this one never holds a CUDA context."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           env=worker_env(), capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


def out_dir() -> Path:
    where = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    where.mkdir(parents=True, exist_ok=True)
    return where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="PART", help="run this part (repeatable); default: all")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for every part together ({BUDGET_S:g} on a GPU, {REHEARSAL_BUDGET_S:g} rehearsing)")
    parser.add_argument("--plan", action="store_true", help="say what would run, and where, then stop")
    parser.add_argument("--rehearse", action="store_true", help="rehearse on the CPU even where a GPU is")
    parser.add_argument("--no-record", action="store_true", help="leave bench/RESULTS.md alone")
    args = parser.parse_args(argv)
    try:
        parts = chosen(args.only)
    except ValueError as exc:
        print(f"python -m bench.acceptance: {exc}", file=sys.stderr)
        return 2
    gpu = not args.rehearse and cuda_here()
    args.budget = args.budget if args.budget is not None else BUDGET_S if gpu else REHEARSAL_BUDGET_S
    if args.plan:
        for part in parts:
            where = f"skipped: {part.gpu_only}" if not gpu and part.gpu_only else f"limit {part.limit(gpu):.0f} s"
            print(f"{part.name:<12} {where}  ({part.title})")
        return 0
    return _run_all(parts, gpu, args)


def _run_all(parts, gpu: bool, args: argparse.Namespace) -> int:
    where = out_dir()
    started = time.monotonic()
    print(f"acceptance: {'a GPU run' if gpu else 'a rehearsal on the CPU (no CUDA GPU)'}, {len(parts)} part(s), "
          f"budget {args.budget:.0f} s; output in {where}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="acceptance-") as tmp, open(where / "gpu_acceptance.log", "wb") as log:
        for part in parts:
            results.append(run_part(part, gpu, args.budget - (time.monotonic() - started), Path(tmp), log))
    seconds = time.monotonic() - started
    command = "bash bench/gpu_acceptance.sh " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "bash bench/gpu_acceptance.sh"
    text = section(describe(), results, gpu, command.strip(), args.budget, seconds)
    (where / "gpu_acceptance.md").write_text(text + "\n")
    (where / "gpu_acceptance.json").write_bytes(orjson.dumps(
        {"gpu": gpu, "seconds": round(seconds, 1), "parts": [r.to_json() for r in results]}, option=orjson.OPT_INDENT_2))
    if gpu and not args.no_record:
        results_md = ROOT / "bench" / "RESULTS.md"
        results_md.write_text(results_md.read_text().rstrip("\n") + "\n\n" + text + "\n")
    print(summary_table(results), flush=True)
    bad = [r for r in results if r.status in ("failed", "timed out", "not run")]
    print(f"acceptance: {len(results) - len(bad)} of {len(results)} part(s) passed or skipped"
          + (f"; not passed: {', '.join(r.part.name for r in bad)}" if bad else "") + f"; {seconds:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The machine the figures come from: torch and CUDA, the device, the packages gpuherd needs (a lent
machine has some of them only as carried wheels), karpathy/nanoGPT's files, and `gpuherd check`'s
verdict on this host (the recovery cases start with --skip-checks, so one check is made here).

    python -m bench.acceptance.environment --device cuda|cpu --result FILE
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys

from bench.acceptance.nanogpt_files import missing_files, nanogpt_dir
from bench.acceptance.outcome import Outcome, part_main
from bench.launchers import ROOT, worker_env

NEEDED = ("torch", "numpy", "psutil", "pynvml", "loguru", "orjson", "xxhash")


def _run(args: argparse.Namespace, out: Outcome) -> None:
    import torch

    out.figure("python, torch", f"{platform.python_version()}, {torch.__version__}")
    out.figure("CUDA as torch sees it", f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}"
               if torch.cuda.is_available() else "none (a rehearsal: the GPU-only parts are skipped)")
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.figure("the device", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                                 f"{props.major}.{props.minor}, {props.multi_processor_count} SMs")
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    out.check(not missing, f"not importable: {', '.join(missing)} (carry them as wheels: bench/gpu_acceptance.sh)")
    absent = missing_files()
    out.figure("karpathy/nanoGPT's train.py, model.py, configurator.py", f"found in {nanogpt_dir()}" if not absent
               else f"absent ({', '.join(absent)} not in {nanogpt_dir()}): the nanogpt part will fail; "
                    "`bash bench/gpu_acceptance.sh --prepare` copies them")
    # judged for the recovery cases' runs (the debug preset), not for the production model's
    where = ["--debug", *(["--gpus", "0"] if args.device == "cuda" else ["--set", "system.device=cpu"])]
    check = subprocess.run([sys.executable, "-c", "from supervisor.commands.check import main; raise SystemExit(main())",
                            *where],
                           cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=120)
    print(check.stdout + check.stderr, flush=True)
    verdict = {0: "no FAIL", 2: "the host FAILED", 4: "a GPU FAILED"}.get(check.returncode, f"exit {check.returncode}")
    said = [line for line in (check.stdout + check.stderr).splitlines() if line.startswith("gpuherd check:")]
    out.figure("`gpuherd check --debug` on this host", f"{verdict}: {said[-1] if said else 'no tally'} "
                                                        "(the table is in the log)")


if __name__ == "__main__":
    raise SystemExit(part_main(_run, __doc__.splitlines()[0]))

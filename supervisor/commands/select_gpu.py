"""`python -m supervisor.commands.select_gpu`: pick the least-used GPU and print the table it chose from.

  python -m supervisor.commands.select_gpu                 show the choice (nothing is claimed)
  python -m supervisor.commands.select_gpu --run -- ARGS   claim it, print `Using GPU N (lowest utilization)`,
                                                   exec ./train_gpu.sh N ARGS holding the claim
                                                   (what ./train_auto_gpu.sh does)

The claim is an flock on an inherited descriptor named in GPUHERD_GPU_CLAIM_FDS:
it lives exactly as long as the training run (supervisor/gpus/claim.py).
Exit 2: no GPU at all, or every GPU is busy or claimed (--force takes a busy one); 4: every GPU is lost.
"""

from __future__ import annotations

import os
import sys

from gpuherd.cli import OneLineParser, die
from supervisor import REPO_ROOT
from supervisor.gpus import CLAIM_FDS_ENV, DeviceError, select_least_used

PROG = "train_auto_gpu.sh"
TRAIN_GPU = REPO_ROOT / "train_gpu.sh"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    prog = prog or (PROG if "--run" in ours else "python -m supervisor.commands.select_gpu")
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("--run", action="store_true", help="claim the GPU and exec ./train_gpu.sh N -- ARGS")
    parser.add_argument("--window", type=float, default=float(os.environ.get("GPUHERD_SELECT_WINDOW", "1.0")),
                        help="seconds to average utilization over (default 1.0, env GPUHERD_SELECT_WINDOW)")
    parser.add_argument("--force", action="store_true", help="take a GPU other processes use if none is free")
    args = parser.parse_args(ours)
    force = args.force or "--force" in passthrough  # the run's own --force means the same here
    try:
        selection = select_least_used(args.window, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                      force=force, take_claim=args.run)
    except DeviceError as exc:
        die(str(exc), exc.exit_code, parser.prog)
    print(selection.table(), flush=True)
    print(f"Using GPU {selection.gpu.index} (lowest utilization)", flush=True)
    if not args.run:
        return 0
    os.environ[CLAIM_FDS_ENV] = selection.claim.make_inheritable()
    os.execv(str(TRAIN_GPU), [str(TRAIN_GPU), str(selection.gpu.index), *passthrough])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())

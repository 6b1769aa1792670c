"""`gpuherd gpu N` and `gpuherd auto`: one supervised worker on one GPU, chosen or least used.

    gpuherd gpu 3 [options]    one worker on GPU 3 (the id nvidia-smi shows; default 0), supervised
                               like a multi-GPU run: what ./train_gpu.sh 3 does
    gpuherd auto [options]     claim the least-used GPU, print `Using GPU N (lowest utilization)` and
                               run like `gpuherd gpu N`, holding the claim: what ./train_auto_gpu.sh does

Options are `gpuherd run`'s. Exit 2: a bad id, no such GPU, no GPU, or every GPU busy or
claimed (--force shares one); 4: the GPU is lost.
"""

from __future__ import annotations

import os
import re
import sys

from gpuherd.cli import die


def gpu(argv: list[str]) -> int:
    """`gpuherd gpu [N] [options]` -> `gpuherd run --gpus N [options]`."""
    prog = "gpuherd gpu"
    gpu_id = "0"
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv and not argv[0].startswith("-"):
        if not re.fullmatch(r"[0-9]+", argv[0]):
            die(f"GPU id must be a non-negative integer as nvidia-smi shows it, got '{argv[0]}' "
                f"(usage: {prog} <gpu_id> [options])", prog=prog)
        gpu_id, argv = argv[0], argv[1:]
    from supervisor.main import main

    return main(["--gpus", gpu_id, *argv], prog=prog)


def auto(argv: list[str]) -> int:
    """`gpuherd auto [options]`: the selector claims a GPU and execs ./train_gpu.sh N with it."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    from supervisor.commands.select_gpu import main

    os.environ.setdefault("GPUHERD_PYTHON", sys.executable)  # the run after the exec: this interpreter
    return main(["--run", "--", *argv], prog="gpuherd auto")

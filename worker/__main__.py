"""`python -m worker`: one supervised training process.

Everything comes from the supervisor's environment (docs/reference/environment.md):
the resolved config (GPUHERD_CONFIG), the prepared dataset cache
(GPUHERD_DATASET_CACHE), the run directory and this worker's identity.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from gpuherd import contract
from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.gloo_exit import settle
from gpuherd.status_channel import StatusWriter
from worker.logs import setup_logging
from worker.main import guarded


def main() -> int:
    # Registered before torch is imported, so it runs after torch's own atexit callbacks, right
    # before the interpreter finalizes: else a rank that finished (or stopped on a NaN) can
    # still die of SIGABRT in gloo's teardown (gpuherd/gloo_exit.py: why).
    atexit.register(settle)
    if os.environ.get(contract.SPARE) == "1":
        from worker.spare import stand_by

        if not stand_by():  # retired before it was needed
            return 0
    identity = WorkerIdentity.from_env()
    setup_logging(identity, "INFO")
    status = StatusWriter.from_env(identity.rank)

    def body() -> int:
        from worker.distributed import WorkerError

        parent = os.environ.get(contract.SUPERVISOR_PID)
        if parent and os.getppid() != int(parent):
            # The supervisor died before its death signal was armed for us: nobody would
            # ever stop this process, so do not start training.
            raise WorkerError(f"supervisor (pid {parent}) is gone; not starting", ExitCode.FAILURE)
        path = os.environ.get(contract.CONFIG_PATH)
        if not path:
            raise WorkerError(f"{contract.CONFIG_PATH} is not set: start workers through the supervisor "
                              "(run_training.sh) or use pretrain_main.py", ExitCode.USAGE)
        cfg = Config.load(Path(path))
        if os.environ.get(contract.RESUME):  # a restarted attempt: the supervisor chose the checkpoint
            cfg.training.resume = os.environ[contract.RESUME]
        cache = os.environ.get(contract.DATASET_CACHE)
        run_dir = os.environ.get(contract.RUN_DIR)
        import torch

        from gpuherd.torch_floor import check_torch_version

        check_torch_version(torch.__version__)  # one line and exit 2, not an AttributeError at step 0
        from worker.heap import freeze_imports
        from worker.train import run

        freeze_imports()
        return run(cfg, identity, cache_dir=Path(cache) if cache else None,
                   status=status, run_dir=Path(run_dir) if run_dir else None)

    return guarded(body, status)


def _exit(code: int) -> None:
    """A graceful stop has saved its checkpoint and reported everything: leave without the
    interpreter's teardown, which can block in the garbage collection of torch's distributed
    objects (seen on a two-node gloo job stopped by scancel: the worker sat in it until the
    stop timeout SIGKILLed it, and SLURM's KillWait would have ended the job next)."""
    if code not in (ExitCode.SIGINT, ExitCode.SIGTERM):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())

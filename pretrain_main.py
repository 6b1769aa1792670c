#!/usr/bin/env python3
"""Train in this one process, without the supervisor (seed 003's single-GPU path).

    CUDA_VISIBLE_DEVICES=2 GPU_RANK=2 python3 pretrain_main.py --debug
    python3 pretrain_main.py --config single_gpu.json --max-steps 10 --resume auto

Resolves the config and checks it against the tokenizer and this machine's memory
(exit 2 on any problem, before anything is written), prepares the dataset cache
in-process (built once, reused afterwards), creates logs/<run-id>/ with the
resolved config, and trains as rank 0 of 1. Works from any directory.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the repo's packages, from any cwd

from gpuherd.cli import add_resume_flag, base_parser, config_from_args, die, resume_override  # noqa: E402
from gpuherd.config import Config  # noqa: E402
from gpuherd.contract import WorkerIdentity  # noqa: E402
from gpuherd.extras import extras_named  # noqa: E402
from gpuherd.files import write_bytes_atomic  # noqa: E402
from gpuherd.model_checks import check_fits, check_vocab, host_memory_bytes  # noqa: E402
from gpuherd.status_channel import StatusWriter  # noqa: E402


def new_run_dir(run_root: Path) -> Path:
    """logs/<YYYYmmdd-HHMMSS-xxxx>/, the supervisor's naming (docs/reference/file-layouts.md)."""
    run_dir = run_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def tokenizer_vocab(cfg: Config) -> int:
    """The tokenizer's vocabulary size, checked against model.vocab_size; exits 2 (3 for an
    unusable tokenizer) with one line before anything is written."""
    from dataset_cache import DatasetError, load_tokenizer

    try:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    except DatasetError as exc:
        die(str(exc), exc.exit_code)
    problem = check_vocab(cfg, vocab)
    if problem:
        die(problem)
    return vocab


def check_memory(cfg: Config, device, vocab: int) -> None:
    """Refuse (exit 2) a model whose training state cannot fit in this GPU's free memory
    or this host's available RAM."""
    import torch

    from gpuherd.exit_codes import ExitCode
    from worker.distributed import WorkerError

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = check_fits(cfg, free, tokenizer_vocab=vocab, where=f"GPU {device.index} (free memory)")
    else:
        problem = check_fits(cfg, host_memory_bytes(1), tokenizer_vocab=vocab, where="this host (available RAM)")
    if problem:
        raise WorkerError(problem, ExitCode.USAGE)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("pretrain_main.py", "Train one process (one GPU, or the CPU) without the supervisor.")
    add_resume_flag(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, resume_override(args))  # exits 2 with one line on a bad config
    vocab = tokenizer_vocab(cfg)

    identity = WorkerIdentity.from_env()
    from worker.logs import setup_logging
    from worker.main import guarded

    setup_logging(identity, cfg.debug.log_level)
    status = StatusWriter.from_env(identity.rank)

    def body() -> int:
        import torch

        from gpuherd.torch_floor import check_torch_version

        check_torch_version(torch.__version__)  # before anything is built or written
        from dataset_cache import prepare_cache
        from worker.distributed import choose_device
        from worker.train import run

        device, resolved = choose_device(cfg, identity)
        setup_logging(resolved, cfg.debug.log_level)  # CPU0: / GPU2: from the first line on

        if identity.world_size != 1:
            from gpuherd.exit_codes import ExitCode
            from worker.distributed import WorkerError

            raise WorkerError(f"pretrain_main.py trains one process, but WORLD_SIZE={identity.world_size}; "
                              "use run_training.sh for several", ExitCode.USAGE)
        check_memory(cfg, device, vocab)
        cache_dir = prepare_cache(cfg.data).path
        run_dir = new_run_dir(Path(cfg.system.run_root))
        write_bytes_atomic(run_dir / "config.json", cfg.to_json())
        return run(cfg, resolved, cache_dir=Path(cache_dir), status=status, run_dir=run_dir, run_id=run_dir.name)

    return guarded(body, status)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # As the supervisor does for its workers: CUDA_VISIBLE_DEVICES=2 means nvidia-smi's GPU 2
    # (CUDA's own default order, fastest first, may number mixed GPUs differently).
    from gpuherd.contract import cuda_defaults

    os.environ.update(cuda_defaults(os.environ))
    with extras_named("pretrain_main.py"):
        sys.exit(main())

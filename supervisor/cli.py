"""`python -m supervisor` command line (run_training.sh passes its arguments through).

Built on gpuherd.cli.base_parser, so --debug/--preset/--config/--max-steps/--set
mean what they mean everywhere; the supervisor's own flags map onto
`system.*` config fields, so a config file can set them too and one validation
pass covers both.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from gpuherd.cli import base_parser, config_from_args, die
from gpuherd.config import Config

PROG = "run_training.sh"


@dataclass
class Launch:
    config: Config
    script: Path | None = None  # --script: a torchrun-style user script instead of the built-in worker
    script_args: list[str] = field(default_factory=list)
    nproc_explicit: bool = False
    force: bool = False
    run_id: str | None = None
    verbose: bool = False


def _id_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,2, got '{text}'") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one id")
    return ids


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(PROG, "Prepare the dataset once, start one isolated worker per GPU (or CPU workers), "
                               "supervise them, and exit with a code that names the cause.")
    g = parser.add_argument_group("supervisor")
    g.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="number of workers: CPU workers without GPU (default 2), else the first N planned GPUs")
    g.add_argument("--gpus", type=_id_list, default=None, metavar="0,2",
                   help="physical GPU ids (as nvidia-smi shows them) to use, in rank order; default: all visible")
    iso = g.add_mutually_exclusive_group()
    iso.add_argument("--no-isolate", dest="isolate", action="store_false", default=None,
                     help="torchrun convention: every worker sees all planned GPUs and uses cuda:$LOCAL_RANK")
    iso.add_argument("--isolate", dest="isolate", action="store_true",
                     help="each worker sees only its own GPU (default, except with --script)")
    g.add_argument("--force", action="store_true",
                   help="use a GPU another process holds memory on; reuse an existing --run-id directory")
    g.add_argument("--hang-timeout", type=_seconds, default=None, metavar="S",
                   help="seconds without a heartbeat before a worker counts as hung (default: per preset)")
    g.add_argument("--grace-period", type=_seconds, default=None, metavar="S",
                   help="teardown: seconds between SIGTERM and SIGKILL (default: per preset)")
    g.add_argument("--log-ranks", type=_id_list, default=None, metavar="R[,R]",
                   help="console shows these ranks, plus every rank's warnings and errors (files keep all)")
    g.add_argument("--collapse-logs", action="store_true",
                   help="print a line that all ranks print identically once, with a rank count")
    g.add_argument("--run-id", default=None, metavar="ID", help="name of the run directory (default: time + random)")
    g.add_argument("-v", "--verbose", action="store_true", help="the supervisor's own debug messages on the console")
    g.add_argument("--script", default=None, metavar="PATH",
                   help="run a torchrun-style training script instead of the built-in trainer; "
                        "every argument after PATH goes to the script")
    return parser


def parse(argv: list[str]) -> Launch:
    """Arguments -> a validated Launch; exits 2 with one line on any problem."""
    ours, script, script_args = _split_script(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    if script is not None:
        args.script = script
    extra = []
    if args.nproc is not None:
        extra.append(f"system.nproc={args.nproc}")
    if args.gpus is not None:
        extra.append(f"system.gpus={args.gpus}")
    isolate = args.isolate if args.isolate is not None else (False if args.script else None)
    if isolate is not None:
        extra.append(f"system.isolate={'true' if isolate else 'false'}")
    if args.hang_timeout is not None:
        extra.append(f"system.hang_timeout={args.hang_timeout}")
    if args.grace_period is not None:
        extra.append(f"system.grace_period={args.grace_period}")
    if args.log_ranks is not None:
        extra.append(f"system.log_ranks={args.log_ranks}")
    if args.collapse_logs:
        extra.append("system.collapse_logs=true")
    cfg = config_from_args(args, extra)
    script_path = None
    if args.script is not None:
        script_path = (Path.cwd() / args.script).resolve()
        if not script_path.is_file():
            die(f"--script file not found: {args.script}")
    return Launch(config=cfg, script=script_path, script_args=script_args, nproc_explicit=args.nproc is not None,
                  force=args.force, run_id=args.run_id, verbose=args.verbose)


def _split_script(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Everything after `--script PATH` belongs to the script, even `--debug` or `-h`."""
    for i, arg in enumerate(argv):
        if arg == "--script":
            if i + 1 >= len(argv):
                die("--script needs a path (see run_training.sh --help)")
            return argv[:i], argv[i + 1], argv[i + 2:]
        if arg.startswith("--script="):
            return argv[:i], arg.split("=", 1)[1], argv[i + 1:]
        if arg == "--":
            break
    return argv, None, []

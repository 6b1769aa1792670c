"""Command-line options every entry point shares, and the one-line error exit.

`run_training.sh`, `train_gpu.sh`, `train_auto_gpu.sh`, `pretrain_main.py`,
`prepare_dataset.py` and `generate.py` all build their parser from
`base_parser()`, so `--debug`, `--preset`, `--config`, `--max-steps` and `--set`
mean the same everywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from gpuherd.config import PRESETS, Config, ConfigError, resolve
from gpuherd.exit_codes import ExitCode
from gpuherd.text import one_line


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a user needs the error, in one line."""

    def error(self, message: str) -> NoReturn:
        die(f"{message} (see {self.prog} --help)")


def die(message: str, code: int = ExitCode.USAGE, prog: str = "gpuherd") -> NoReturn:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(int(code))


def base_parser(prog: str, description: str) -> OneLineParser:
    parser = OneLineParser(prog=prog, description=description)
    group = parser.add_argument_group("configuration (the same for every gpuherd command)")
    group.add_argument("--debug", action="store_true", help="shorthand for --preset debug")
    group.add_argument(
        "--preset", choices=sorted(PRESETS), default=None,
        help="start from this preset (default: production)",
    )
    group.add_argument(
        "--config", metavar="FILE.json", default=None,
        help='partial nested JSON on top of the preset, e.g. {"training": {"batch_size": 4}}',
    )
    group.add_argument("--max-steps", type=int, default=None, metavar="N", help="override training.max_steps")
    group.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="dotted override, repeatable, e.g. --set training.learning_rate=1e-4",
    )
    return parser


def add_resume_flag(parser: argparse.ArgumentParser) -> None:
    """`--resume auto|PATH` for the entry points that train (= `--set training.resume=...`)."""
    parser.add_argument("--resume", metavar="auto|PATH", default=None,
                        help="continue from the latest checkpoint in system.checkpoint_dir (auto) or from PATH")


def resume_override(args: argparse.Namespace) -> list[str]:
    return [f"training.resume={args.resume}"] if getattr(args, "resume", None) else []


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None, files: bool = True) -> Config:
    """Resolve the config the parsed options describe; exit 2 with one line if bad. `files`:
    the files it names are checked on this machine (resolve's)."""
    if args.debug and args.preset not in (None, "debug"):
        die(f"--debug and --preset {args.preset} contradict each other")
    preset_name = "debug" if args.debug else args.preset
    try:
        return resolve(
            preset_name=preset_name,
            config_file=args.config,
            overrides=list(args.overrides) + list(extra or []),
            max_steps=args.max_steps,
            cwd=Path.cwd(),
            files=files,
        )
    except ConfigError as exc:
        die(str(exc))

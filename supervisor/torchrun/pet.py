"""torchrun's `PET_<FLAG>` environment variables: each is its flag's default, as under torchrun.

torch's `env` action (torch.distributed.argparse_util) takes `PET_<DEST>` (the flag's long
name, upper case, `_` for `-`) as the default of a flag with a value; `check_env` reads
`PET_<DEST>` as an integer, non-zero meaning the switch is on. A flag on the command line
wins. Schedulers (the Kubeflow PyTorchJob operator, TorchX) set these instead of flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from gpuherd.cli import die
from supervisor.torchrun.flags import PET, SWITCHES, TORCHRUN_FLAGS


def apply_pet_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Set the parser's defaults from PET_* before parsing. A value that does not parse gets
    the same one line as the flag would (argparse converts string defaults through `type`)."""
    defaults: dict[str, object] = {}
    for torchrun_dest in sorted(PET):
        name = f"PET_{torchrun_dest.upper()}"
        raw = environ.get(name)
        if raw is None:
            continue
        if torchrun_dest in SWITCHES:
            try:
                defaults[TORCHRUN_FLAGS[torchrun_dest]] = bool(int(raw))
            except ValueError:
                die(f"{name}={raw!r}: expected 0 or 1 (torchrun reads it as an integer)")
        elif raw.strip():
            choices = _choices(parser, TORCHRUN_FLAGS[torchrun_dest])  # argparse checks typed values only
            if choices and raw not in choices:
                die(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
            defaults[TORCHRUN_FLAGS[torchrun_dest]] = raw
    parser.set_defaults(**defaults)


def _choices(parser: argparse.ArgumentParser, dest: str) -> tuple | None:
    action = next((a for a in parser._actions if a.dest == dest), None)
    return tuple(action.choices) if action is not None and action.choices else None

"""`python -m supervisor.commands.topology [--gpus 0,1]`: the GPU matrix like `nvidia-smi topo -m`,
plus warnings for slow pairs. Exit 0; 2 without NVML/GPU or for a bad id."""

from __future__ import annotations

import os
import sys

from gpuherd.cli import OneLineParser, die
from gpuherd.exit_codes import ExitCode
from gpuherd.text import int_list
from supervisor.gpus import DeviceError, NvmlUnavailable, read_inventory, read_topology
from supervisor.gpus import allowed_gpus

PROG = "python -m supervisor.commands.topology"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--gpus", default=None, metavar="0,1,...",
                        help="GPU ids to show (default: all allowed by CUDA_VISIBLE_DEVICES)")
    args = parser.parse_args(argv)
    try:
        inventory = read_inventory()
        allowed = allowed_gpus(inventory, os.environ.get("CUDA_VISIBLE_DEVICES"))
        ids = [g.index for g in allowed] if args.gpus is None else _ids(args.gpus, [g.index for g in inventory])
        if not ids:
            die("no GPU to show", ExitCode.USAGE, PROG)
        topo = read_topology(ids)
    except NvmlUnavailable as exc:
        die(f"no GPU found: {exc}", ExitCode.USAGE, PROG)
    except DeviceError as exc:
        die(str(exc), exc.exit_code, PROG)
    print(topo.format())
    for warning in topo.warnings():
        print(f"\nWARNING: {warning}", file=sys.stderr)
    return 0


def _ids(text: str, existing: list[int]) -> list[int]:
    try:
        ids = int_list(text)
    except ValueError:
        die(f"--gpus expects ids like 0,1, got '{text}'", ExitCode.USAGE, PROG)
    for i in ids:
        if i not in existing:
            die(f"GPU {i} does not exist (GPUs: {', '.join(map(str, existing)) or 'none'})", ExitCode.USAGE, PROG)
    return ids


if __name__ == "__main__":
    sys.exit(main())

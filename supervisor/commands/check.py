"""`python -m supervisor.commands.check [options]`: pre-flight checks as a table (`gpuherd check`).

Checks the GPUs a run would use (--gpus, else system.gpus / system.device_id, else
every GPU CUDA_VISIBLE_DEVICES allows; none with system.device=cpu) and this host.
Takes the run's configuration options (--debug, --config, --set ...), since disk
space, memory and the cache depend on them, and for a multi-node job the master
address; it judges the run `gpuherd run` with the same options would start, and its
first line says which (preset, model, workers).
Exit codes: 0 no FAIL (WARN lines are printed); 4 a GPU failed; 2 the host failed,
or bad input (one line on stderr naming the culprit).
"""

from __future__ import annotations

import os
import sys

import orjson

from gpuherd.cli import base_parser, config_from_args, die
from gpuherd.config import Config
from supervisor.gpus import DeviceError, NvmlUnavailable, allowed_gpus, read_inventory
from supervisor.health import run_checks

PROG = "gpuherd check"


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default=None, metavar="IDS", help="GPU ids to check, e.g. 0,2 (default: the run's)")
    parser.add_argument("--master-addr", default=None, metavar="HOST", help="multi-node: node 0's address")
    parser.add_argument("--master-port", type=int, default=None, metavar="PORT", help="multi-node: the job's port")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="multi-node: this node (0 binds the port)")
    parser.add_argument("--json", action="store_true", help="print the items as JSON instead of a table")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(args)
    if (args.master_addr is None) != (args.master_port is None):
        die("--master-addr and --master-port go together", prog=PROG)
    master = (args.master_addr, args.master_port) if args.master_addr else None
    try:
        report = run_checks(cfg, _gpu_ids(cfg, args.gpus), master=master, node_rank=args.node_rank)
    except DeviceError as exc:
        die(str(exc), exc.exit_code, PROG)
    if not args.json:
        print(f"judged: {report.judged}")  # what `gpuherd run` with these options would train
    print(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode() if args.json else report.table())
    print(f"{PROG}: {report.counts()}", file=sys.stderr)
    failure = report.first_failure()
    if failure is not None:
        print(f"{PROG}: error: {failure.line()}", file=sys.stderr)
    return report.failed_exit_code or 0


def _gpu_ids(cfg: Config, text: str | None) -> list[int] | None:
    """--gpus, the config's choice, or the GPUs CUDA_VISIBLE_DEVICES allows (None: all NVML sees)."""
    if text is not None:
        try:
            return [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            die(f"--gpus {text}: expected GPU ids like 0,2", prog=PROG)
    if cfg.system.device == "cpu":
        return []
    if cfg.system.gpus is not None:
        return list(cfg.system.gpus)
    if cfg.system.device_id is not None:
        return [cfg.system.device_id]
    allowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if allowed is None:
        return None
    try:
        return [gpu.index for gpu in allowed_gpus(read_inventory(), allowed)]
    except NvmlUnavailable:
        return None  # run_checks says there is no GPU
    except DeviceError as exc:
        die(str(exc), exc.exit_code, PROG)


if __name__ == "__main__":
    sys.exit(main())

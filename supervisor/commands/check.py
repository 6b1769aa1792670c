"""`python -m supervisor.commands.check [options]`: pre-flight checks as a table (`gpuherd check`).

Checks the GPUs a run would use (--gpus, else system.gpus / system.device_id, else
every GPU CUDA_VISIBLE_DEVICES allows; none with system.device=cpu) and this host.
Takes the run's configuration options (--debug, --config, --set ...), since disk
space, memory and the cache depend on them, and for a multi-node job the master
address; it judges the run `gpuherd run` with the same options would start, and its
first line says which (preset, model, workers).
Shows this host's suspect list (devices an earlier run blamed for silent data corruption or
too many transient faults: the next run leaves those GPUs out); --clear-suspect DEVICE takes
one off. Exit codes: 0 no FAIL (WARN lines are printed); 4 a GPU failed; 2 the host failed,
or bad input (one line on stderr naming the culprit).
"""

from __future__ import annotations

import os
import sys

import orjson

from gpuherd.cli import base_parser, config_from_args, die
from gpuherd.config import Config
from supervisor.gpus import DeviceError, NvmlUnavailable, allowed_gpus, read_inventory
from supervisor.health import SuspectList, list_path, run_checks

PROG = "gpuherd check"


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default=None, metavar="IDS", help="GPU ids to check, e.g. 0,2 (default: the run's)")
    parser.add_argument("--master-addr", default=None, metavar="HOST", help="multi-node: node 0's address")
    parser.add_argument("--master-port", type=int, default=None, metavar="PORT", help="multi-node: the job's port")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="multi-node: this node (0 binds the port)")
    parser.add_argument("--json", action="store_true", help="print the items as JSON instead of a table")
    parser.add_argument("--clear-suspect", default=None, metavar="DEVICE",
                        help="take a device off this host's suspect list (GPU3, 3, a GPU UUID, CPU1, or all), "
                             "then check as usual")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(args)
    listed = SuspectList.load(list_path(cfg.system.run_root))
    if args.clear_suspect is not None:
        _clear(listed, args.clear_suspect)
    if (args.master_addr is None) != (args.master_port is None):
        die("--master-addr and --master-port go together", prog=PROG)
    master = (args.master_addr, args.master_port) if args.master_addr else None
    try:
        report = run_checks(cfg, _gpu_ids(cfg, args.gpus), master=master, node_rank=args.node_rank)
    except DeviceError as exc:
        die(str(exc), exc.exit_code, PROG)
    if not args.json:
        print(f"judged: {report.judged}")  # what `gpuherd run` with these options would train
    body = {**report.to_dict(), "suspect_list": {"path": str(listed.path), "devices": [
        {"device": d.label, "uuid": d.uuid, "strikes": len(d.strikes),
         "last": d.strikes[-1].line() if d.strikes else ""}
        for d in listed.devices]}}
    print(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() if args.json else report.table())
    if not args.json:
        print(_suspect_lines(listed))
    print(f"{PROG}: {report.counts()}", file=sys.stderr)
    failure = report.first_failure()
    if failure is not None:
        print(f"{PROG}: error: {failure.line()}", file=sys.stderr)
    return report.failed_exit_code or 0


def _suspect_lines(listed: SuspectList) -> str:
    """This host's suspect list: what the next `gpuherd run` leaves out, and how to put it back."""
    if not listed.devices:
        return f"suspect list: empty ({listed.path})"
    lines = [f"suspect list ({listed.path}): the next run leaves these GPUs out unless --allow-suspect-gpus "
             "(CPU slots are named only)"]
    lines += [f"  {d.line()}  [--clear-suspect {d.label}]" for d in listed.devices]
    return "\n".join(lines)


def _clear(listed: SuspectList, selector: str) -> None:
    """--clear-suspect: the named entries off the list (written atomically), one line; a device
    that is not on it is bad input (exit 2), the list untouched."""
    gone = listed.remove(selector)
    if not gone:
        on = ", ".join(d.label for d in listed.devices) or "the list is empty"
        die(f"--clear-suspect {selector}: not on this host's suspect list {listed.path} ({on})", prog=PROG)
    try:
        listed.save()
    except OSError as exc:
        die(f"--clear-suspect: cannot write {listed.path}: {exc.strerror or exc}", prog=PROG)
    print(f"{PROG}: {', '.join(d.label for d in gone)} taken off the suspect list {listed.path}", file=sys.stderr)


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

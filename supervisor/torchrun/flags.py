"""torchrun's launch flags with torchrun's meaning, so `torchrun` -> `gpuherd run` is the one change.

The flags torchrun shares with gpuherd (`--nnodes`, `--node-rank`, `--master-addr`,
`--master-port`, `--max-restarts`, `--rdzv-id` = `--run-id`, `--local-ranks-filter` =
`--log-ranks`, each also spelt with `_`) are aliases in supervisor/cli.py. The ones here
have no gpuherd twin: they are translated into gpuherd options (`system.*` overrides, so one
validation covers both), or, where gpuherd always does what they ask for, accepted and named
once at INFO (`--tee`, `--redirects`, ...).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from gpuherd.cli import die
from supervisor.rendezvous import SingleStore

LOOPBACK = "127.0.0.1"
# torchrun's flags that only tune what gpuherd always does its own way
_NOT_NEEDED = {
    "tee": "every rank's output always goes to the console and logs/<run-id>/",
    "redirects": "every rank's output always goes to the console and logs/<run-id>/",
    "monitor_interval": "worker exits are seen at once (SIGCHLD), not by polling",
    "start_method": "scripts always start as their own processes",
}


@dataclass
class TorchrunLaunch:
    """What the torchrun flags asked for, in gpuherd's terms."""

    overrides: list[str] = field(default_factory=list)  # system.* settings (--set syntax)
    nproc: int | None = None  # a number of workers (--nproc-per-node N)
    store: SingleStore | None = None  # one node: where the workers' store listens, MASTER_ADDR
    notices: list[str] = field(default_factory=list)  # said once at INFO when the run starts


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("torchrun's flags (same meaning as under torchrun)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", default=None, metavar="N|gpu|cpu|auto",
                   help="workers on this node: N; one per GPU; one per CPU core; GPUs if any, else CPU cores")
    t.add_argument("--standalone", action="store_true",
                   help="one node, its store on a free local port (MASTER_ADDR=localhost)")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT]",
                   help="= --master-addr HOST --master-port PORT")
    t.add_argument("--rdzv-backend", "--rdzv_backend", default=None, choices=("static", "c10d"),
                   help="accepted; gpuherd hosts the workers' store itself either way")
    t.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="run directories go to DIR/<run-id>/ (= --set system.run_root=DIR)")
    t.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    t.add_argument("--no-python", "--no_python", action="store_true",
                   help="run SCRIPT as an executable, without python in front")
    for flags, dest in ((("-t", "--tee"), "tee"), (("-r", "--redirects"), "redirects"),
                        (("--monitor-interval", "--monitor_interval"), "monitor_interval"),
                        (("--start-method", "--start_method"), "start_method")):
        t.add_argument(*flags, dest=dest, default=None, metavar="X", help=f"accepted, not needed: {_NOT_NEEDED[dest]}")


def translate(args: argparse.Namespace) -> TorchrunLaunch:
    """The torchrun flags in `args` -> gpuherd's settings; exit 2 with one line on a bad one.
    Fills args.master_addr/master_port from --rdzv-endpoint for the multi-node checks."""
    out = TorchrunLaunch()
    multi = args.nnodes not in (None, 1)
    if args.standalone and multi:
        die(f"--standalone runs one node, but --nnodes is {args.nnodes}")
    if args.rdzv_backend == "c10d" and multi and args.node_rank is None and not args.slurm:
        die("gpuherd orders nodes by --node-rank: give each node its --node-rank R (or use --slurm), "
            "where torchrun's c10d backend would assign them")
    if args.nproc_per_node is not None:
        if args.nproc is not None:
            die("--nproc and --nproc-per-node say the same thing; give one")
        _nproc_per_node(args.nproc_per_node, out)
    if args.rdzv_endpoint:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep:
            host, port = args.rdzv_endpoint, ""
        args.master_addr = args.master_addr or host
        if port and args.master_port is None:
            if not port.isdigit():
                die(f"--rdzv-endpoint {args.rdzv_endpoint}: the port must be a number")
            args.master_port = int(port)
    if args.log_dir:
        out.overrides.append(f"system.run_root={args.log_dir}")
    ignored = [dest for dest in _NOT_NEEDED if getattr(args, dest) is not None]
    if ignored:
        why = "; ".join(dict.fromkeys(_NOT_NEEDED[dest] for dest in ignored))
        out.notices.append(f"ignored torchrun flag(s) {', '.join('--' + d.replace('_', '-') for d in ignored)}: {why}")
    out.store = _single_store(args, out)
    return out


def _nproc_per_node(value: str, out: TorchrunLaunch) -> None:
    cores = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if value.isdigit() and int(value) > 0:
        out.nproc = int(value)
    elif value == "gpu":
        out.overrides.append("system.device=cuda")  # every usable GPU; none is exit 2, as torchrun fails
    elif value == "cpu":
        out.overrides += ["system.device=cpu", f"system.nproc={cores}"]
    elif value == "auto":
        out.overrides.append(f"system.nproc={cores}")  # every GPU; without one, one worker per core
    else:
        die(f"--nproc-per-node {value!r}: expected a number > 0, gpu, cpu or auto")


def _single_store(args: argparse.Namespace, out: TorchrunLaunch) -> SingleStore | None:
    """One node, as torchrun does it: --standalone -> a free local port and MASTER_ADDR=localhost;
    --master-addr/--master-port -> the store exactly there; neither -> a free loopback port."""
    if args.nnodes not in (None, 1) or args.slurm:
        return None  # several nodes: node 0's agent hosts the store (supervisor/rendezvous/multi.py)
    if args.standalone:
        if args.master_addr or args.master_port is not None:
            out.notices.append("--standalone picks its own address and port: --master-addr/--master-port ignored")
        return SingleStore(bind_addr=LOOPBACK, port=0, advertise="localhost")
    if args.master_addr or args.master_port is not None:
        addr = args.master_addr or LOOPBACK
        return SingleStore(bind_addr=addr, port=args.master_port or 0, advertise=addr)
    return None

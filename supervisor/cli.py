"""`python -m supervisor` command line (run_training.sh passes its arguments through).

Built on gpuherd.cli.base_parser, so --debug/--preset/--config/--max-steps/--set
mean what they mean everywhere; the supervisor's own flags map onto
`system.*` config fields, so a config file can set them too and one validation
pass covers both.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpuherd.cli import add_resume_flag, base_parser, config_from_args, die, resume_override
from gpuherd.config import Config
from supervisor.rendezvous import DEFAULT_PORT, NodeSpec

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
    node: NodeSpec = field(default_factory=NodeSpec)  # multi-node: which node this supervisor is


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
    add_resume_flag(parser)
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
                   help="fixed step allowance: seconds without progress before a rank counts as hung "
                        "(default: learned, max(system.hang_floor, system.hang_factor x p99 step time))")
    g.add_argument("--grace-period", type=_seconds, default=None, metavar="S",
                   help="teardown: seconds between SIGTERM and SIGKILL (default: per preset)")
    g.add_argument("--log-ranks", type=_id_list, default=None, metavar="R[,R]",
                   help="console shows these ranks, plus every rank's warnings and errors (files keep all)")
    g.add_argument("--collapse-logs", action="store_true",
                   help="print a line that all ranks print identically once, with a rank count")
    r = parser.add_argument_group("restarts")
    r.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="after a crash, hang or lost worker, restart every worker up to N times, resuming from "
                        "the newest checkpoint this run wrote (default 0)")
    r.add_argument("--restart-backoff", type=_seconds, default=None, metavar="S",
                   help="seconds to wait between a failed attempt's teardown and the restart (default 0.2, "
                        "doubling for each further quick failure in a row, at most 60)")
    r.add_argument("--restart-on-nan", action="store_true",
                   help="restart after a NaN stop (exit 6) too; by default a NaN stop ends the run")
    m = parser.add_argument_group("multi-node (one supervisor per node; see README 'Multi-node')")
    m.add_argument("--nnodes", type=int, default=None, metavar="N", help="nodes in the job (default 1)")
    m.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node, 0..N-1; node 0 hosts the job store")
    m.add_argument("--master-addr", default=None, metavar="HOST",
                   help="node 0's address as every node reaches it; node 0 binds the store to that interface only")
    m.add_argument("--master-port", type=int, default=None, metavar="P",
                   help=f"the job store's port on node 0 (default {DEFAULT_PORT})")
    m.add_argument("--slurm", action="store_true",
                   help="take --nnodes/--node-rank/--master-addr/--master-port from SLURM's environment "
                        "(run under srun, one task per node); explicit flags win")
    g.add_argument("--run-id", default=None, metavar="ID", help="name of the run directory (default: time + random)")
    g.add_argument("-v", "--verbose", action="store_true", help="the supervisor's own debug messages on the console")
    g.add_argument("--script", default=None, metavar="PATH",
                   help="run a torchrun-style training script instead of the built-in trainer; "
                        "every argument after PATH goes to the script")
    return parser


# flags whose value goes to `system.<same name>` (store_true flags only when given)
_SYSTEM_FLAGS = ("nproc", "gpus", "isolate", "hang_timeout", "grace_period", "log_ranks", "collapse_logs",
                 "max_restarts", "restart_backoff", "restart_on_nan")


def parse(argv: list[str]) -> Launch:
    """Arguments -> a validated Launch; exits 2 with one line on any problem."""
    ours, script, script_args = _split_script(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    if script is not None:
        args.script = script
    if args.script is not None and args.isolate is None:
        args.isolate = False  # a torchrun-style script expects every GPU visible
    node = _node_spec(args)  # may fill --nproc and --run-id from SLURM's allocation
    extra = resume_override(args)
    for flag in _SYSTEM_FLAGS:  # each flag is a system.* config key: one validation covers both
        value = getattr(args, flag)
        if value is False and flag == "isolate":
            extra.append("system.isolate=false")  # --no-isolate (a store_true flag left False says nothing)
        elif value is not None and value is not False:
            extra.append(f"system.{flag}={'true' if value is True else value}")
    cfg = config_from_args(args, extra)
    script_path = None
    if args.script is not None:
        script_path = (Path.cwd() / args.script).resolve()
        if not script_path.is_file():
            die(f"--script file not found: {args.script}")
    return Launch(config=cfg, script=script_path, script_args=script_args, nproc_explicit=args.nproc is not None,
                  force=args.force, run_id=args.run_id, verbose=args.verbose, node=node)


def _node_spec(args: argparse.Namespace) -> NodeSpec:
    """--nnodes/--node-rank/--master-addr/--master-port (or SLURM's environment), checked."""
    nnodes, node_rank, addr, port = args.nnodes, args.node_rank, args.master_addr, args.master_port
    if args.slurm:
        slurm = _read_slurm(addr)
        nnodes = slurm.nnodes if nnodes is None else nnodes
        node_rank = slurm.node_rank if node_rank is None else node_rank
        addr = slurm.master_addr if addr is None else addr
        port = slurm.master_port if port is None else port
        if args.run_id is None:
            args.run_id = f"slurm-{slurm.job_id}"
        if args.nproc is None and args.gpus is None and slurm.gpus_on_node and slurm.cuda_visible_devices is None:
            args.nproc = slurm.gpus_on_node  # SLURM said how many GPUs but did not hide the others
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    port = DEFAULT_PORT if port is None else port
    if nnodes < 1:
        die(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        die(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if not 1 <= port <= 65535:
        die(f"--master-port {port} is not a TCP port (1-65535)")
    if nnodes > 1 and not addr:
        die(f"--nnodes {nnodes} needs --master-addr: node 0's address, as every node reaches it")
    return NodeSpec(nnodes=nnodes, node_rank=node_rank, master_addr=addr or "", master_port=port)


def _read_slurm(master_addr: str | None):
    from supervisor.rendezvous import SlurmError, read_slurm

    try:  # an explicit --master-addr spares the node-list expansion (no scontrol needed)
        return read_slurm(os.environ, master_addr=master_addr)
    except SlurmError as exc:
        die(f"--slurm: {exc}")


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

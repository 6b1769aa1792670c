"""`gpuherd run` (= `python -m supervisor`, what run_training.sh passes its arguments to).

    gpuherd run [options]                        the built-in trainer
    gpuherd run [options] train.py [ARGS...]     a torchrun-style script; everything after
                                                 it is the script's (also: --script PATH ARGS)

Built on gpuherd.cli.base_parser, so --debug/--preset/--config/--max-steps/--set
mean what they mean everywhere; the supervisor's own flags map onto
`system.*` config fields, so a config file can set them too and one validation
pass covers both. torchrun's flags are accepted with torchrun's meaning
(supervisor/torchrun/flags.py; the ones gpuherd shares are aliases below).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from gpuherd.cli import add_resume_flag, base_parser, config_from_args, die, resume_override
from gpuherd.config import Config
from gpuherd.text import int_list
from supervisor.rendezvous import DEFAULT_PORT, NodeSpec, SingleStore
from supervisor.torchrun import Script, ScriptError, TorchrunLaunch, add_torchrun_flags, apply_pet_defaults, translate

PROG = "gpuherd run"


@dataclass
class Launch:
    config: Config
    script: Script | None = None  # a torchrun-style user program instead of the built-in worker
    nproc_explicit: bool = False
    force: bool = False
    run_id: str | None = None
    verbose: bool = False
    node: NodeSpec = field(default_factory=NodeSpec)  # multi-node: which node this supervisor is
    store: SingleStore | None = None  # one node: where torchrun's flags put the workers' store
    requeue: int = 0  # --slurm: SLURM_RESTART_COUNT (how often SLURM requeued this job)
    slurm_job_id: str | None = None  # --slurm: SLURM_JOB_ID
    start: int = 0  # this start of the run: >= 1 when --slurm continues its existing run directory (supervisor/requeue.py)
    notices: list[str] = field(default_factory=list)  # said at INFO once logging is set up
    torchrun: TorchrunLaunch = field(default_factory=TorchrunLaunch)  # role, signals, NUMA, virtual local rank


def _id_list(text: str) -> list[int]:
    try:
        ids = int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,2, got '{text}'") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one id")
    return ids


def _nnodes(text: str) -> tuple[int, int]:
    """torchrun's `N` or `MIN:MAX` (an elastic job: it starts with MIN nodes, takes up to MAX)."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes like 2 or a range like 1:4, got '{text}'") \
            from None
    if high and not 1 <= lo <= hi:  # a plain number is judged with the other node options (_check_nodes)
        raise argparse.ArgumentTypeError(f"'{text}': expected 1 <= MIN <= MAX") from None
    return lo, hi


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = base_parser(prog, "Prepare the dataset once, start one isolated worker per GPU (or CPU workers), "
                               "supervise them, and exit with a code that names the cause. With a SCRIPT: "
                               "run it on every worker instead of the built-in trainer, as torchrun would.")
    parser.usage = f"{prog} [options] [SCRIPT [ARGS...]]"
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
    g.add_argument("--grace-period", "--shutdown-timeout", "--shutdown_timeout", type=_seconds, default=None, metavar="S",
                   help="teardown: seconds between SIGTERM and SIGKILL; Ctrl-C: seconds to reach a save "
                        "(default: per preset)")
    g.add_argument("--stop-timeout", type=_seconds, default=None, metavar="S",
                   help="a graceful stop (SIGTERM, SIGUSR1/2, Ctrl-C) with its final checkpoint takes at most this "
                        "long, then SIGKILL (default 120; under SLURM shorter than its KillWait)")
    g.add_argument("--log-ranks", "--local-ranks-filter", "--local_ranks_filter", type=_id_list, default=None,
                   metavar="R[,R]",
                   help="console shows these ranks, plus every rank's warnings and errors (files keep all)")
    g.add_argument("--collapse-logs", action="store_true",
                   help="fold step lines too (other lines that ranks print alike are always folded, "
                        "GPU[0-7]:...)")
    _add_restart_flags(parser)
    _add_node_flags(parser)
    g.add_argument("--run-id", "--rdzv-id", "--rdzv_id", default=None, metavar="ID", action=_OneRunId,
                   help="name of the run directory and TORCHELASTIC_RUN_ID (default: time + random)")
    g.add_argument("-v", "--verbose", action="store_true", help="the supervisor's own debug messages on the console")
    g.add_argument("--skip-checks", dest="preflight", action="store_false", default=None,
                   help="skip the pre-flight GPU and host checks (`gpuherd check`) before the run")
    g.add_argument("--report", dest="report", action="store_true", default=None,
                   help="render report.html and its figures into the run directory before exiting (default: "
                        "not on the exit path; the summary names `gpuherd report RUN`)")
    g.add_argument("--no-report", dest="report", action="store_false", default=None,
                   help="no report at the end (the default; kept for scripts that pass it)")
    _add_script_flags(parser)
    add_torchrun_flags(parser)
    return parser


class _OneRunId(argparse.Action):
    """--run-id and its torchrun spelling --rdzv-id name one thing: the two with different
    values are refused instead of the last one silently winning (one flag repeated is the
    usual "the last one wins", as a wrapper script's default overridden)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, "_run_id_flag", None)
        spelling = lambda flag: (flag or "").replace("_", "-")  # noqa: E731 - --rdzv_id is --rdzv-id
        if given is not None and given[1] != values and spelling(given[0]) != spelling(option_string):
            die(f"{given[0]} {given[1]} and {option_string} {values} name the run twice, differently; give one")
        namespace._run_id_flag = (option_string, values)
        setattr(namespace, self.dest, values)


def _add_restart_flags(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("restarts")
    r.add_argument("--max-restarts", "--max_restarts", type=int, default=None, metavar="N",
                   help="after a crash, hang or lost worker, restart every worker up to N times, resuming from "
                        "the newest checkpoint this run wrote (default 0)")
    r.add_argument("--restart-backoff", type=_seconds, default=None, metavar="S",
                   help="seconds to wait between a failed attempt's teardown and the restart (default 0.2, "
                        "doubling for each further quick failure in a row, at most 60)")
    r.add_argument("--spares", type=int, default=None, metavar="K",
                   help="warm spare workers per node (default 1 with --max-restarts > 0, 0 turns live recovery "
                        "off): a lost rank of the built-in DDP trainer is replaced by one while the others keep "
                        "running, with no checkpoint read; otherwise every worker restarts")
    r.add_argument("--spare-nodes", type=int, default=None, metavar="K",
                   help="multi-node: K more nodes (--node-rank N..N+K-1) stand by without a rank; a node that dies "
                        "whole (not node 0) is replaced by one while every other node's workers keep running "
                        "(needs --max-restarts; built-in DDP trainer)")
    r.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="a rank lost with no warm spare left: the N or more survivors go on without it (one "
                        "carries its data slot: same global batch, same data order) instead of a restart "
                        "(default 0: never; built-in DDP trainer; a multi-node job counts the survivors of "
                        "every node, and a node keeps one rank of its own; rank 0 lost: its lowest survivor "
                        "writes the checkpoints)")
    r.add_argument("--restart-on-nan", action="store_true",
                   help="restart after a NaN stop (exit 6) too; by default a NaN stop ends the run")
    r.add_argument("--exclude-suspect-gpus", action="store_true",
                   help="after a suspect-device stop (exit 8), restart without the GPUs that had too many "
                        "transient faults: one worker fewer each (CPU workers: nothing to exclude)")
    r.add_argument("--allow-suspect-gpus", action="store_true",
                   help="start on GPUs this host's suspect list names (silent data corruption, or too many "
                        "transient faults in an earlier run): by default they are left out, and an explicit "
                        "--gpus naming one is refused; `gpuherd check` shows the list")


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("multi-node (one supervisor per node; see docs/guide/multi-node.md)")
    m.add_argument("--nnodes", type=_nnodes, default=None, metavar="N|MIN:MAX",
                   help="nodes in the job (default 1); MIN:MAX: start once MIN joined, admit more up to MAX "
                        "at the next restart (docs/guide/multi-node.md)")
    m.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R",
                   help="this node, 0..N-1; node 0 hosts the job store")
    m.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST",
                   help="node 0's address as every node reaches it; node 0 binds the store to that interface only")
    m.add_argument("--master-port", "--master_port", type=int, default=None, metavar="P",
                   help=f"the job store's port on node 0 (default {DEFAULT_PORT})")
    m.add_argument("--slurm", action="store_true",
                   help="take --nnodes/--node-rank/--master-addr/--master-port from SLURM's environment "
                        "(run under srun, one task per node); explicit flags win")


def _add_script_flags(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("your script (torchrun-style; the built-in trainer without one)")
    s.add_argument("script", nargs="?", default=None, metavar="SCRIPT",
                   help="run this on every worker instead of the built-in trainer; every argument after "
                        "it is the script's")
    s.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    s.add_argument("--script", dest="script_flag", nargs=argparse.REMAINDER, default=None, metavar="PATH",
                   help="the same as SCRIPT (every argument after PATH is the script's)")
    s.add_argument("--no-auto-heartbeat", dest="auto_heartbeat", action="store_false",
                   help="start the script exactly as torchrun does: no heartbeats from its optimizer steps, "
                        "no stack dumps on SIGUSR1 (hang detection then needs status records from it)")
    s.add_argument("--no-standbys", dest="standbys", action="store_false", default=None,
                   help="no restart standbys: a restarted rank starts a fresh interpreter (by default, while "
                        "restarts are left, one per rank imports torch for the next attempt as this one trains)")


# flags whose value goes to `system.<same name>` (store_true flags only when given)
_SYSTEM_FLAGS = ("nproc", "gpus", "isolate", "hang_timeout", "grace_period", "stop_timeout", "log_ranks",
                 "collapse_logs", "max_restarts", "spares", "spare_nodes", "min_replicas", "restart_backoff", "restart_on_nan", "exclude_suspect_gpus",
                 "allow_suspect_gpus",
                 "preflight", "report", "standbys")


def parse(argv: list[str], prog: str = PROG, files: bool = True) -> Launch:
    """Arguments -> a validated Launch; exits 2 with one line on any problem. `files`: the files
    the arguments name (the script, the data) are looked for on this machine; False where the
    command line is checked for other machines (`gpuherd sbatch`: the job's nodes)."""
    parser = build_parser(prog)
    apply_pet_defaults(parser, os.environ)  # torchrun's PET_<FLAG>: a flag's default, the command line wins
    args = parser.parse_args(argv)
    args.min_nodes, args.nnodes = args.nnodes if args.nnodes is not None else (None, None)  # MIN:MAX
    if args.nproc is not None and args.nproc_per_node == os.environ.get("PET_NPROC_PER_NODE"):
        args.nproc_per_node = None  # --nproc typed wins over PET_NPROC_PER_NODE, as a typed flag would
    script = _script(args, prog, files)
    if script is not None and args.isolate is None and not args.virtual_local_rank:
        args.isolate = False  # a torchrun-style script expects every GPU visible
    torchrun = translate(args)
    if torchrun.nproc is not None:
        args.nproc = torchrun.nproc
    node = _node_spec(args)  # may fill --nproc and --run-id from SLURM's allocation
    extra = resume_override(args)
    for flag in _SYSTEM_FLAGS:  # each flag is a system.* config key: one validation covers both
        value = getattr(args, flag)
        if value is False and flag in ("isolate", "preflight", "report", "standbys"):
            extra.append(f"system.{flag}=false")  # --no-isolate, --skip-checks, --no-report, --no-standbys
        elif value is not None and value is not False:
            extra.append(f"system.{flag}={'true' if value is True else value}")
    cfg = config_from_args(args, extra + torchrun.overrides, files)
    _check_nodes(node, args.node_rank_given, cfg.system.spare_nodes, script is not None)
    return Launch(config=cfg, script=script, nproc_explicit=args.nproc is not None, force=args.force,
                  run_id=args.run_id, verbose=args.verbose, node=node, store=torchrun.store,
                  notices=torchrun.notices, torchrun=torchrun, requeue=args.requeue,
                  slurm_job_id=args.slurm_job_id)


def _script(args: argparse.Namespace, prog: str, files: bool = True) -> Script | None:
    """SCRIPT ARGS (or --script PATH ARGS) with -m / --no-python / --no-auto-heartbeat, checked."""
    if args.script_flag is not None:
        if args.script is not None:
            die(f"two scripts: {args.script} and --script {' '.join(args.script_flag)}; give one")
        if not args.script_flag:
            die(f"--script needs a path (see {prog} --help)")
        args.script, args.script_args = args.script_flag[0], args.script_flag[1:]
    if args.script is None:
        for flag, given in (("-m", args.module), ("--no-python", args.no_python), ("--run-path", args.run_path),
                            ("--no-auto-heartbeat", not args.auto_heartbeat)):
            if given:
                die(f"{flag} needs a script or module to run (see {prog} --help)")
        return None
    script = Script(args.script, list(args.script_args), module=args.module, no_python=args.no_python,
                    auto_heartbeat=args.auto_heartbeat, run_path=args.run_path)
    try:
        script.check(files)
    except ScriptError as exc:
        die(str(exc), exc.exit_code)
    return script


def _node_spec(args: argparse.Namespace) -> NodeSpec:
    """--nnodes/--node-rank/--master-addr/--master-port (or SLURM's environment), checked."""
    nnodes, node_rank, addr, port = args.nnodes, args.node_rank, args.master_addr, args.master_port
    args.requeue, args.slurm_job_id = 0, None
    if args.slurm:
        slurm = _read_slurm(addr)
        nnodes = slurm.nnodes if nnodes is None else nnodes
        node_rank = slurm.node_rank if node_rank is None else node_rank
        addr = slurm.master_addr if addr is None else addr
        port = slurm.master_port if port is None else port
        if args.run_id is None:
            args.run_id = f"slurm-{slurm.job_id}"
        args.requeue, args.slurm_job_id = slurm.restart_count, slurm.job_id
        if args.nproc is None and args.gpus is None and slurm.gpus_on_node and slurm.cuda_visible_devices is None:
            args.nproc = slurm.gpus_on_node  # SLURM said how many GPUs but did not hide the others
    nnodes = 1 if nnodes is None else nnodes
    min_nodes = nnodes if args.min_nodes is None else args.min_nodes
    args.node_rank_given = node_rank is not None
    node_rank = 0 if node_rank is None else node_rank
    port = DEFAULT_PORT if port is None else port
    return NodeSpec(nnodes=nnodes, node_rank=node_rank, master_addr=addr or "", master_port=port, min_nodes=min_nodes)


def _check_nodes(node: NodeSpec, rank_given: bool, spare_nodes: int, script: bool) -> None:
    """The node options, once the config says --spare-nodes K (system.spare_nodes, from any
    source): N..N+K-1 are the spare nodes' ranks."""
    nnodes, node_rank, shown = node.nnodes, node.node_rank, _shown(node.min_nodes, node.nnodes)
    if nnodes < 1:
        die(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes + spare_nodes:
        die(f"--node-rank {node_rank} is outside 0..{nnodes + spare_nodes - 1} (--nnodes {shown}"
            + (f", --spare-nodes {spare_nodes})" if spare_nodes else ")"))
    if not 1 <= node.master_port <= 65535:
        die(f"--master-port {node.master_port} is not a TCP port (1-65535)")
    if nnodes > 1 and not node.master_addr:
        die(f"--nnodes {shown} needs --master-addr: node 0's address, as every node reaches it")
    if nnodes > 1 and not rank_given:  # each node defaulting to 0 would wait out the rendezvous as node 0
        die(f"--nnodes {shown} needs --node-rank R (0..{nnodes - 1}, a different one on each "
            "node; node 0 hosts the job store), or --slurm under srun")
    if spare_nodes and node.elastic:
        die(f"--spare-nodes {spare_nodes} with --nnodes {shown}: an elastic job admits a node that comes at its next "
            "restart already; spare nodes are for a fixed --nnodes N")
    if spare_nodes and node.nnodes < 2:
        die(f"--spare-nodes {spare_nodes} needs a multi-node job (--nnodes N >= 2): on one node, --spares K")
    if spare_nodes and script:
        die(f"--spare-nodes {spare_nodes} with a script: a spare node's ranks take the built-in trainer's state from "
            "the survivors (live recovery); a script's state is its own")


def _shown(min_nodes: int, nnodes: int) -> str:
    return str(nnodes) if min_nodes == nnodes else f"{min_nodes}:{nnodes}"


def _read_slurm(master_addr: str | None):
    from supervisor.rendezvous import SlurmError, read_slurm

    try:  # an explicit --master-addr spares the node-list expansion (no scontrol needed)
        return read_slurm(os.environ, master_addr=master_addr)
    except SlurmError as exc:
        die(f"--slurm: {exc}")

"""`python -m supervisor.commands.sbatch`: write an sbatch script that trains on N nodes x G GPUs.

  python -m supervisor.commands.sbatch --nodes 2 --gpus-per-node 8 --time 48:00:00 --partition gpu \\
      --output train.sbatch -- --preset gpt2-small --set training.max_steps=1000
  sbatch train.sbatch

`--gpus-per-node 0` (or `--cpu`) writes a job for CPU-only nodes: no GPU request (a cluster
without GRES rejects one), `--cpu-workers N` CPU workers per node.

Everything after `--` goes to run_training.sh on every node. The script asks SLURM for
one task per node (gpuherd runs one supervisor per node, and the supervisor starts the
per-GPU workers itself, as torchrun does) and starts it with `run_training.sh --slurm`,
which reads node rank, node count and master address from SLURM (supervisor/rendezvous/slurm_env.py).
Bad flags, and training arguments `gpuherd run` would refuse on the nodes (checked by its own
parse: `node_refusal`): one line on stderr, exit 2, nothing written. docs/guide/slurm.md has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuherd.cli import OneLineParser, die
from gpuherd.files import write_bytes_atomic
from supervisor import REPO_ROOT
from supervisor import cli as run_cli
from supervisor.run_dir import new_run_id

PROG = "python -m supervisor.commands.sbatch"
CPUS_PER_GPU = 8  # the usual CPU share on GPU nodes: 8 tasks x 8 CPUs for 8 GPUs
CPUS_PER_CPU_WORKER = 2  # a CPU worker: its compute threads and its data prefetch
# SIGUSR1 this long before the time limit: every node saves a checkpoint and stops within
# the stop timeout (120 s by default); SLURM may send it up to 60 s earlier (sbatch(1)).
STOP_WARNING_S = 180

# sbatch(1) --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; UNLIMITED / INFINITE where allowed.
TIME_RE = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
MEM_RE = re.compile(r"[0-9]+[KMGT]?", re.IGNORECASE)  # sbatch(1) --mem: size[units], 0 = all of the node's memory


@dataclass(frozen=True)
class SbatchOptions:
    nodes: int
    gpus_per_node: int  # 0: CPU-only nodes
    cpus_per_task: int
    repo: Path  # absolute: the job cds here
    log_dir: Path  # absolute: sbatch resolves relative --output paths against the job's start directory
    job_name: str = "gpuherd"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    mem: str | None = None
    train_args: tuple[str, ...] = ()
    stop_warning: int = STOP_WARNING_S  # seconds before the time limit SLURM sends SIGUSR1; 0: none
    cpu_workers: int = 1  # CPU workers per node when gpus_per_node is 0
    requeue: bool = False  # #SBATCH --requeue: SLURM may requeue the job (node failure, preemption)
    run_id: str | None = None  # the script's run: every submission of it continues that run; None: train_args name it
    spare_nodes: int = 0  # more nodes that stand by without a rank (--spare-nodes): SLURM allocates nodes + spare_nodes

    @property
    def devices(self) -> str:
        return f"{self.gpus_per_node} GPU(s)" if self.gpus_per_node else f"{self.cpu_workers} CPU worker(s)"


def render_sbatch(options: SbatchOptions) -> str:
    """The whole sbatch script for `options`; pure, so tests and the CLI share it."""
    return "\n".join([*_header(options), *_body(options)]) + "\n"


def _header(o: SbatchOptions) -> list[str]:
    output = o.log_dir / "%x-%j.out"  # %x = job name, %j = job id (sbatch(1) filename pattern)
    directives = [
        ("job-name", o.job_name), ("nodes", o.nodes + o.spare_nodes), ("ntasks-per-node", 1),
        ("gres", f"gpu:{o.gpus_per_node}" if o.gpus_per_node else None),
        ("cpus-per-task", o.cpus_per_task), ("mem", o.mem), ("time", o.time), ("partition", o.partition),
        ("account", o.account), ("output", output), ("error", output),
        # a requeued job (same id, same output file) adds to the first attempt's output, never truncates it
        ("open-mode", "append"),
        ("requeue", "" if o.requeue else None),
        # USR1 (not B:USR1): to every step's tasks, i.e. each node's supervisor, which saves and stops
        ("signal", f"USR1@{o.stop_warning}" if o.stop_warning else None),
    ]
    return [
        "#!/bin/bash",
        f"# gpuherd: {o.nodes} node(s) x {o.devices}"
        + (f" and {o.spare_nodes} spare node(s) (SLURM_NODEID {o.nodes} and up: no rank until a node dies whole)"
           if o.spare_nodes else "") + f", written by `{PROG}` for the checkout {o.repo}",
        "# Submit: sbatch THIS_FILE    Follow: tail -f " + str(o.log_dir / f"{o.job_name}-JOBID.out"),
        "#",
        "# One task per node: gpuherd runs one supervisor per node and the supervisor starts",
        "# one worker per GPU itself, so SLURM must not start a task per GPU.",
        "# --signal=USR1@T: T seconds before the time limit every supervisor gets SIGUSR1 and its",
        "# workers save a checkpoint and stop (exit 143); scancel and preemption (SIGTERM) do the same.",
        "# A requeued job (scontrol requeue, --requeue after a node failure) and this script submitted",
        "# again (after the time limit, say) continue the same run: the same logs/<run-id>-node<r>/,",
        "# resumed from its newest checkpoint. For a new run, write a new script (or change --run-id).",
        *(f"#SBATCH --{name}={value}".rstrip("=") for name, value in directives if value is not None),
    ]


def node_args(o: SbatchOptions) -> list[str]:
    """What every node's `run_training.sh --slurm` is given after --slurm."""
    workers = [] if o.gpus_per_node or "--nproc" in o.train_args else ["--nproc", str(o.cpu_workers)]
    run = ["--run-id", o.run_id] if o.run_id else []
    # SLURM counts every node it allocated: the training nodes are said explicitly, the rest stand by
    spares = ["--nnodes", str(o.nodes), "--spare-nodes", str(o.spare_nodes)] if o.spare_nodes else []
    return [*run, *spares, *workers, *o.train_args]


def node_refusal(o: SbatchOptions) -> str | None:
    """What `gpuherd run` on the job's nodes would refuse at its start, found now by its own parse
    (supervisor/cli.py), or None: a job every node refuses (--spare-nodes without --max-restarts,
    with a script, on one node) would wait in the queue for its nodes only to end at once. What
    --slurm reads from SLURM is given as node 0 would read it (the node count, rank 0, an address);
    paths are relative to the checkout, where the job starts. The files the arguments name (the
    script, the data) are not looked for: the nodes may see other files than this machine."""
    slurm = ["--nnodes", str(o.nodes), "--node-rank", "0", "--master-addr", "127.0.0.1"]
    said = io.StringIO()
    try:
        with contextlib.chdir(o.repo), contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            run_cli.parse([*slurm, *node_args(o)], files=False)
    except SystemExit as exc:
        lines = said.getvalue().strip().splitlines()
        return re.sub(r"^[^:]*: error: ", "", lines[-1]) if lines else f"it exits at once (code {exc.code})"
    return None


def _body(o: SbatchOptions) -> list[str]:
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "run_training.sh", "--slurm", *node_args(o)]
    return [
        "",
        "set -euo pipefail",
        'if [[ -z "${SLURM_JOB_ID:-}" ]]; then echo "submit this script with: sbatch $0" >&2; exit 2; fi',
        "",
        "# The checkout this script was written for: logs/, cache/ and .checkpoints/ live here,",
        "# and relative paths in the training arguments below are relative to it too.",
        f"cd {shlex.quote(str(o.repo))}",
        "",
        "# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch (sbatch(1));",
        "# without this the supervisor and all of its workers would share one CPU.",
        'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        "",
        *NCCL_SECTION,
        "",
        *TROUBLESHOOTING,
        "",
        'echo "gpuherd: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s): $SLURM_JOB_NODELIST"',
        "",
        "# One supervisor per node. --slurm: node rank, node count, master address and port come",
        "# from SLURM's environment (docs/guide/slurm.md). --kill-on-bad-exit=0: the supervisors end the",
        "# step on every node themselves when one node fails (a failure reaches every node through the",
        "# job store within a second; a node that dies whole is named within ~10 s). srun's own kill",
        "# would SIGTERM the survivors first, and they could no longer say which node was lost.",
        shlex.join(srun),
    ]


NCCL_SECTION = [
    "# ---- NCCL (sbatch passes the submitting shell's environment on, so e.g.",
    "#      `NCCL_DEBUG=INFO sbatch THIS_FILE` overrides the default below)",
    "# WARN: errors and warnings only. INFO prints the interfaces and transports NCCL picked",
    "# (NET/IB, NET/Socket, P2P/NVLink) on every rank: the first thing to read when a",
    "# multi-node run fails, hangs or is slow.",
    'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
    "# A failed or timed-out collective already ends the process: torch's default",
    "# TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears it down without ncclCommAbort, which can hang",
    "# (1 would call it). The supervisor sees the exit and tears the node down.",
    "# The network interface between nodes. Set it when NCCL_DEBUG=INFO shows NCCL on the",
    "# wrong one (docker0, a slow management network) or it finds none: name the fast",
    "# interface, or exclude interfaces by prefix with ^.",
    "# export NCCL_SOCKET_IFNAME=eth0",
    "# export NCCL_SOCKET_IFNAME=^lo,docker",
    "# The same for gloo (the workers' CPU stop vote): needed where the hostname resolves",
    "# to 127.0.1.1 (Debian/Ubuntu /etc/hosts), or gloo connects to itself and times out.",
    "# export GLOO_SOCKET_IFNAME=eth0",
    "# InfiniBand: disable it when IB errors or hangs appear on nodes without working IB;",
    "# NCCL then uses TCP sockets (works everywhere, much slower).",
    "# export NCCL_IB_DISABLE=1",
]

TROUBLESHOOTING = [
    "# ---- When something goes wrong (exit codes: docs/reference/exit-codes.md)",
    "# NCCL errors: NCCL_DEBUG=INFO; then NCCL_IB_DISABLE=1 or NCCL_SOCKET_IFNAME (above).",
    "# Exit 5, a rank never joined: check that the nodes reach each other and that no firewall",
    "#   blocks MASTER_PORT on the first node (docs/guide/slurm.md says which port); a slow start",
    "#   wants a larger --set system.rendezvous_timeout=SECONDS.",
    "# Exit 124, a hang: the log names the rank that stopped; its Python stacks are in",
    "#   logs/<run-id>/worker-rank<r>-GPU<n>.log on its node.",
    "# Out of memory: lower training.batch_size and raise training.grad_accum_nums,",
    "#   --set training.gradient_checkpointing=true, or training.strategy=fsdp to shard the model.",
    "# Slow: NCCL_DEBUG=INFO shows NET/IB or NET/Socket between nodes; `python -m",
    "#   supervisor.commands.topology` on a node shows NVLink or PCIe between its GPUs.",
    "# Start small: --debug on one node, then two nodes, then the long run.",
]


def parse(argv: list[str]) -> tuple[SbatchOptions, Path | None]:
    """Arguments -> (options, script path or None for stdout); exits 2 with one line on any problem."""
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = _parser()
    args, unknown = parser.parse_known_args(ours)
    if unknown:
        die(f"unrecognized arguments: {' '.join(unknown)} (arguments for run_training.sh go after --, "
            f"e.g. {PROG} --nodes 2 --gpus-per-node 8 -- --preset gpt2-small)")
    log_dir = Path(args.log_dir).expanduser().absolute() if args.log_dir else REPO_ROOT / "logs" / "slurm"
    if re.search(r"[\s%]", str(log_dir)):
        die(f"the log directory {log_dir} contains whitespace or '%' (a filename pattern character in "
            "#SBATCH --output); choose another with --log-dir")
    gpus = 0 if args.cpu else args.gpus_per_node
    if gpus is None:
        die("the following arguments are required: --gpus-per-node (0, or --cpu, for CPU-only nodes)")
    if args.cpu and args.gpus_per_node:
        die(f"--cpu and --gpus-per-node {args.gpus_per_node} contradict each other: a CPU job asks for no GPU")
    if gpus and args.cpu_workers is not None:
        die("--cpu-workers is for CPU-only nodes (--gpus-per-node 0 or --cpu): on GPU nodes there is one worker per GPU")
    cpu_workers = args.cpu_workers or 1
    options = SbatchOptions(
        nodes=args.nodes, gpus_per_node=gpus,
        cpus_per_task=args.cpus_per_task or (CPUS_PER_GPU * gpus if gpus else CPUS_PER_CPU_WORKER * cpu_workers),
        repo=REPO_ROOT, log_dir=log_dir, job_name=args.job_name, partition=args.partition,
        account=args.account, time=args.time, mem=args.mem, train_args=tuple(train_args),
        stop_warning=args.stop_warning, cpu_workers=cpu_workers, requeue=args.requeue, spare_nodes=args.spare_nodes,
        run_id=None if _names_run(train_args) else script_run_id(args.job_name))
    refused = node_refusal(options)
    if refused is not None:
        die(f"every node of this job would refuse to start: {refused} (the arguments after -- are gpuherd run's)")
    return options, (Path(args.output).expanduser() if args.output else None)


def script_run_id(job_name: str) -> str:
    """The run a new script trains: its job name and the moment it was written, so each script
    written is a new run and each submission of one script continues it."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", job_name).strip("-._")[:80] or "gpuherd"
    return f"{name}-{new_run_id()}"


def _names_run(train_args: list[str]) -> bool:
    return any(a == "--run-id" or a.startswith("--run-id=") for a in train_args)


def _parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, usage=f"{PROG} --nodes N --gpus-per-node G [options] [-- TRAINING ARGS]",
                           description="Write an sbatch script that trains on N nodes x G GPUs; "
                                       "arguments after -- go to run_training.sh on every node.",
                           epilog=f"example: {PROG} --nodes 2 --gpus-per-node 8 --time 48:00:00 -o job.sbatch "
                                  "-- --preset gpt2-small, then: sbatch job.sbatch (details: docs/guide/slurm.md)")
    parser.add_argument("--nodes", type=_count, required=True, metavar="N", help="nodes to train on")
    parser.add_argument("--gpus-per-node", type=_count_or_zero(" (0 for CPU-only nodes)"), default=None, metavar="G",
                        help="GPUs on each node; 0 for CPU-only nodes (no GPU request)")
    parser.add_argument("--spare-nodes", type=_count_or_zero(" (0 for none)"), default=0, metavar="K",
                        help="K more nodes that stand by without a rank and take the place of a node that dies "
                             "whole (default 0; the training arguments need --max-restarts)")
    parser.add_argument("--cpu", action="store_true", help="CPU-only nodes: the same as --gpus-per-node 0")
    parser.add_argument("--cpu-workers", type=_count, default=None, metavar="N",
                        help="CPU workers per node on CPU-only nodes (default 1)")
    parser.add_argument("--requeue", action="store_true",
                        help="#SBATCH --requeue: SLURM may requeue the job (node failure, preemption); it "
                             "continues the same run from its newest checkpoint")
    parser.add_argument("--cpus-per-task", type=_count, default=None, metavar="C",
                        help=f"CPUs for each node's supervisor and its workers (default {CPUS_PER_GPU} per GPU, "
                             f"{CPUS_PER_CPU_WORKER} per CPU worker)")
    parser.add_argument("--mem", type=_matching(MEM_RE, "a size like 200G, or 0 for all of it"), default=None,
                        help="memory per node (sbatch --mem; default: the cluster's)")
    parser.add_argument("--time", type=_matching(TIME_RE, "a time like 48:00:00, 2-00:00:00 or 90"),
                        default=None, metavar="LIMIT", help="wall-clock limit (default: the partition's)")
    parser.add_argument("--job-name", type=_word, default="gpuherd", metavar="NAME", help="default gpuherd")
    parser.add_argument("--partition", type=_word, default=None, metavar="NAME")
    parser.add_argument("--account", type=_word, default=None, metavar="NAME")
    parser.add_argument("--stop-warning", type=_seconds, default=STOP_WARNING_S, metavar="S",
                        help="SLURM sends SIGUSR1 this many seconds before the time limit, and every node saves a "
                             f"checkpoint and stops (default {STOP_WARNING_S}; 0: no signal)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="where SLURM writes the job's output, NAME-JOBID.out (default: logs/slurm in the checkout)")
    parser.add_argument("--output", "-o", default=None, metavar="PATH", help="write the script here (default: stdout)")
    return parser


# Argument types: argparse turns an ArgumentTypeError into one line, `argument --x: message`.

def _count(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got '{text}'")
    return int(text)


def _count_or_zero(zero: str):
    """A whole number of at least 0; `zero` says what 0 means, in the message."""
    def check(text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text):
            raise argparse.ArgumentTypeError(f"expected a whole number{zero}, got '{text}'")
        return int(text)
    return check


def _seconds(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) > 65535:  # sbatch(1): sig_time at most 65535
        raise argparse.ArgumentTypeError(f"expected whole seconds from 0 to 65535, got '{text}'")
    return int(text)


def _word(text: str) -> str:
    """One #SBATCH value: whitespace or control characters would break the directive line."""
    if not text or not text.isprintable() or re.search(r"\s", text):
        raise argparse.ArgumentTypeError(f"expected one word without spaces, got {text!r}")
    return text


def _matching(pattern: re.Pattern[str], what: str):
    def check(text: str) -> str:
        if not pattern.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'")
        return text
    return check


def main(argv: list[str] | None = None) -> int:
    options, path = parse(list(sys.argv[1:] if argv is None else argv))
    script = render_sbatch(options)
    try:
        # sbatch does not create the --output directory; a missing one loses the job's output
        options.log_dir.mkdir(parents=True, exist_ok=True)
        if path is None:
            sys.stdout.write(script)
            return 0
        write_bytes_atomic(path, script.encode())
    except OSError as exc:
        die(f"cannot write {exc.filename or path}: {exc.strerror}")
    print(f"wrote {path}; submit it with: sbatch {shlex.quote(str(path))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

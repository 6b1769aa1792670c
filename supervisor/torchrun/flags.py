"""torchrun's launch flags with torchrun's meaning, so `torchrun` -> `gpuherd run` is the one change.

Every flag of torchrun's parser (torch.distributed.run.get_args_parser, torch 2.13) is
accepted; `TORCHRUN_FLAGS` names where each one lands, and tests/supervisor/
test_torchrun_flags.py reads the installed torch's parser and fails on a flag missing here.
The flags torchrun shares with gpuherd (`--nnodes`, `--node-rank`, `--master-addr`,
`--master-port`, `--max-restarts`, `--rdzv-id` = `--run-id`, `--local-ranks-filter` =
`--log-ranks`, each also spelt with `_`) are aliases in supervisor/cli.py. The ones here are
translated into gpuherd options (`system.*` overrides, so one validation covers both) or into
the workers' environment; the few that only tune what gpuherd does its own way are accepted
and named once at INFO as having no effect. Each `PET_<FLAG>` variable is its flag's default,
as under torchrun (pet.py).
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass, field
from string import Template

from gpuherd.cli import die
from supervisor.rendezvous import SingleStore
from supervisor.torchrun.rdzv_conf import parse_rdzv_conf

LOOPBACK = "127.0.0.1"
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode

# torchrun's flags that only tune what gpuherd does its own way: accepted, said to have no effect
NO_EFFECT = {
    "tee": "every rank's output always goes to the console and logs/<run-id>/",
    "redirects": "every rank's output always goes to the console and logs/<run-id>/",
    "monitor_interval": "worker exits are seen at once (SIGCHLD), not by polling",
    "start_method": "scripts always start as their own processes",
    "event_log_handler": "gpuherd records a run's events in logs/<run-id>/metrics.jsonl and summary.json",
    "logs_specs": "every rank's log is logs/<run-id>/worker-rank{r}-{TAG}.log",
    "duplicate_stdout_filters": "every line is in logs/<run-id>/worker-rank{r}-{TAG}.log: grep it there",
    "duplicate_stderr_filters": "every line is in logs/<run-id>/worker-rank{r}-{TAG}.log: grep it there",
}

# torchrun's dest -> gpuherd's dest, for every flag of torchrun's parser. PET_<TORCHRUN DEST>
# sets the default of the flags in PET (torchrun's `env`/`check_env` actions; not
# --logs-specs and --numa-binding, which torchrun reads from the command line only).
TORCHRUN_FLAGS = {
    "nnodes": "nnodes", "nproc_per_node": "nproc_per_node", "rdzv_backend": "rdzv_backend",
    "rdzv_endpoint": "rdzv_endpoint", "rdzv_id": "run_id", "rdzv_conf": "rdzv_conf", "standalone": "standalone",
    "max_restarts": "max_restarts", "monitor_interval": "monitor_interval", "start_method": "start_method",
    "event_log_handler": "event_log_handler", "role": "role", "module": "module", "no_python": "no_python",
    "run_path": "run_path", "log_dir": "log_dir", "redirects": "redirects", "tee": "tee",
    "local_ranks_filter": "log_ranks", "duplicate_stdout_filters": "duplicate_stdout_filters",
    "duplicate_stderr_filters": "duplicate_stderr_filters", "node_rank": "node_rank", "master_addr": "master_addr",
    "master_port": "master_port", "local_addr": "local_addr", "logs_specs": "logs_specs",
    "numa_binding": "numa_binding", "signals_to_handle": "signals_to_handle", "shutdown_timeout": "grace_period",
    "virtual_local_rank": "virtual_local_rank",
}
SWITCHES = {"standalone", "module", "no_python", "run_path", "virtual_local_rank"}  # torchrun's check_env flags
PET = set(TORCHRUN_FLAGS) - {"logs_specs", "numa_binding"}


@dataclass
class TorchrunLaunch:
    """What the torchrun flags asked for, in gpuherd's terms."""

    overrides: list[str] = field(default_factory=list)  # system.* settings (--set syntax)
    nproc: int | None = None  # a number of workers (--nproc-per-node N)
    store: SingleStore | None = None  # one node: where the workers' store listens, MASTER_ADDR
    notices: list[str] = field(default_factory=list)  # said once at INFO when the run starts
    role: str = "default"  # ROLE_NAME
    signals_to_handle: str = DEFAULT_SIGNALS  # TORCHELASTIC_SIGNALS_TO_HANDLE
    virtual_local_rank: bool = False  # LOCAL_RANK=0, each worker sees only its GPU
    numa_binding: str | None = None  # one of NUMA_MODES
    prefix_template: str | None = None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, read when the launch is parsed

    def line_prefix(self, rank: int, local_rank: int) -> str | None:
        """A worker's line prefix from torchrun's template (string.Template: ${rank}, ${local_rank},
        ${role_name}), None for gpuherd's own `GPU3:`/`CPU0:`."""
        if not self.prefix_template:
            return None
        return Template(self.prefix_template).safe_substitute(role_name=self.role, rank=rank, local_rank=local_rank)


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("torchrun's flags (same meaning as under torchrun; PET_<FLAG> sets a default)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", default=None, metavar="N|gpu|cpu|auto",
                   help="workers on this node: N; one per GPU; one per CPU core; GPUs if any, else CPU cores")
    t.add_argument("--standalone", action="store_true",
                   help="one node, its store on a free local port (MASTER_ADDR=localhost)")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT]",
                   help="= --master-addr HOST --master-port PORT")
    t.add_argument("--rdzv-backend", "--rdzv_backend", default=None, choices=("static", "c10d"),
                   help="accepted; gpuherd hosts the workers' store itself either way")
    t.add_argument("--rdzv-conf", "--rdzv_conf", default=None, metavar="K=V,...",
                   help="join_timeout=S is the nodes' join timeout (system.rendezvous_timeout); other keys are "
                        "accepted and named")
    t.add_argument("--local-addr", "--local_addr", default=None, metavar="HOST",
                   help="this node's address: where it hosts the workers' store when no --master-addr says")
    t.add_argument("--role", default=None, metavar="NAME", help="the workers' ROLE_NAME (default 'default')")
    t.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="run directories go to DIR/<run-id>/ (= --set system.run_root=DIR)")
    t.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    t.add_argument("--no-python", "--no_python", action="store_true",
                   help="run SCRIPT as an executable, without python in front")
    t.add_argument("--run-path", "--run_path", action="store_true",
                   help="run SCRIPT with the interpreter running gpuherd, not PYTHON_EXEC (torchrun: runpy.run_path "
                        "in its own interpreter)")
    t.add_argument("--signals-to-handle", "--signals_to_handle", default=None, metavar="SIGTERM,...",
                   help=f"the workers' TORCHELASTIC_SIGNALS_TO_HANDLE (default {DEFAULT_SIGNALS}); gpuherd's "
                        "own handling of signals is in docs/guide/stopping.md")
    t.add_argument("--numa-binding", "--numa_binding", default=None, choices=NUMA_MODES,
                   help="bind each GPU worker to the CPUs (and memory) near its GPU, as torchrun does")
    t.add_argument("--virtual-local-rank", "--virtual_local_rank", action="store_true",
                   help="LOCAL_RANK=0 for every worker, each seeing only its own GPU")
    for flags, dest, nargs in ((("-t", "--tee"), "tee", None), (("-r", "--redirects"), "redirects", None),
                               (("--monitor-interval", "--monitor_interval"), "monitor_interval", None),
                               (("--start-method", "--start_method"), "start_method", None),
                               (("--event-log-handler", "--event_log_handler"), "event_log_handler", None),
                               (("--logs-specs", "--logs_specs"), "logs_specs", None),
                               (("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
                                "duplicate_stdout_filters", None),
                               (("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
                                "duplicate_stderr_filters", None)):
        t.add_argument(*flags, dest=dest, default=None, nargs=nargs, metavar="X",
                       help=f"accepted, no effect: {NO_EFFECT[dest]}")


def translate(args: argparse.Namespace) -> TorchrunLaunch:
    """The torchrun flags in `args` -> gpuherd's settings; exit 2 with one line on a bad one.
    Fills args.master_addr/master_port from --rdzv-endpoint for the multi-node checks."""
    out = TorchrunLaunch(role=args.role or "default", virtual_local_rank=bool(args.virtual_local_rank),
                         numa_binding=args.numa_binding,
                         prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
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
    _endpoint(args)
    if args.log_dir:
        out.overrides.append(f"system.run_root={args.log_dir}")
    if args.rdzv_conf:
        conf = parse_rdzv_conf(args.rdzv_conf)
        out.overrides += conf.overrides
        out.notices += conf.notices
    if args.signals_to_handle is not None:
        out.signals_to_handle = _signal_names(args.signals_to_handle)
    if out.virtual_local_rank and args.isolate is False:
        die("--virtual-local-rank gives each worker only its own GPU, --no-isolate all of them; give one")
    if out.virtual_local_rank:
        args.isolate = True
    ignored = [dest for dest in NO_EFFECT if getattr(args, dest) not in (None, "", [])]
    if ignored:
        why = "; ".join(dict.fromkeys(NO_EFFECT[dest] for dest in ignored))
        out.notices.append(f"torchrun flag(s) {', '.join('--' + d.replace('_', '-') for d in ignored)} "
                           f"accepted, no effect here: {why}")
    out.store = _single_store(args, out)
    return out


def _endpoint(args: argparse.Namespace) -> None:
    if not args.rdzv_endpoint:
        return
    host, sep, port = args.rdzv_endpoint.rpartition(":")
    if not sep:
        host, port = args.rdzv_endpoint, ""
    args.master_addr = args.master_addr or host
    if port and args.master_port is None:
        if not port.isdigit():
            die(f"--rdzv-endpoint {args.rdzv_endpoint}: the port must be a number")
        args.master_port = int(port)


def _signal_names(text: str) -> str:
    """torchrun's comma-separated signal names, checked here rather than warned about per rank."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if not name.startswith("SIG") or not isinstance(getattr(signal, name, None), signal.Signals):
            die(f"--signals-to-handle: {name!r} is not a signal name (e.g. {DEFAULT_SIGNALS})")
    if not names:
        die(f"--signals-to-handle: no signal named (e.g. {DEFAULT_SIGNALS})")
    return ",".join(names)


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
    --master-addr/--master-port -> the store exactly there; --local-addr -> this node's address;
    none -> a free port on localhost (torchrun's MASTER_ADDR without an address flag)."""
    if args.nnodes not in (None, 1) or args.slurm:
        if args.local_addr:
            out.notices.append("--local-addr: no effect with several nodes (every node reaches node 0's store "
                               "at --master-addr)")
        return None  # several nodes: node 0's agent hosts the store (supervisor/rendezvous/multi.py)
    if args.standalone:
        if args.master_addr or args.master_port is not None:
            out.notices.append("--standalone picks its own address and port: --master-addr/--master-port ignored")
        return SingleStore(bind_addr=LOOPBACK, port=0, advertise="localhost")
    if args.master_addr or args.master_port is not None or args.local_addr:
        addr = args.master_addr or args.local_addr or LOOPBACK
        return SingleStore(bind_addr=addr, port=args.master_port or 0, advertise=addr)
    return SingleStore(bind_addr=LOOPBACK, port=0, advertise="localhost")

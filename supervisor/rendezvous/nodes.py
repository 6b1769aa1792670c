"""A multi-node job's shared vocabulary: where node 0 is, which node this is, what every
node must agree on, and how ranks are laid out node by node (node r's first rank is
the number of workers on nodes < r).

Node 0 binds the job store's socket before anything starts (`bind_master`), so a
wrong address or a busy port is a one-line error, not a timeout.
"""

from __future__ import annotations

import errno
import hashlib
import socket
from dataclasses import dataclass
from typing import Any

import orjson

from gpuherd.config import Config
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from supervisor.summary import RootCause

DEFAULT_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class NodeSpec:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = DEFAULT_PORT
    min_nodes: int = 0  # --nnodes MIN:MAX: MIN (0: the same as nnodes, a fixed size); nnodes is then MAX

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes


class NodeLinkError(GpuherdError):
    """A node could not join (or lost) the job: one line and its exit code; `cause` is the
    job's root cause when another node failed first (every node reports that one)."""

    exit_code = ExitCode.RENDEZVOUS

    def __init__(self, message: str, exit_code: int | None = None, cause: RootCause | None = None) -> None:
        super().__init__(message, exit_code)
        self.cause = cause


class SpareNodeUnused(NodeLinkError):
    """A spare node (--spare-nodes) the job ended without: nothing of it ran, it ends with exit 0."""

    exit_code = ExitCode.OK


def bind_master(addr: str, port: int) -> tuple[socket.socket, str]:
    """Node 0: bind the job store's socket on the chosen interface only, before anything
    starts, so a wrong address or a busy port is a one-line error (exit 2)."""
    try:
        infos = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NodeLinkError(f"--master-addr {addr}: cannot resolve it ({exc.strerror})", ExitCode.USAGE) from None
    ip = infos[0][4][0]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise NodeLinkError(f"--master-port {port} is already in use on {addr} ({ip}); pick another port",
                                ExitCode.USAGE) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise NodeLinkError(f"--master-addr {addr} ({ip}) is not an address of this machine: node 0 hosts the "
                                "job store, so run node 0 where --master-addr points", ExitCode.USAGE) from None
        raise NodeLinkError(f"cannot listen on {addr}:{port}: {exc.strerror}", ExitCode.USAGE) from None
    return sock, ip


def training_fingerprint(cfg: Config) -> str:
    """What every node must agree on (paths may differ per node, so they are left out)."""
    d = cfg.to_dict()
    training = {k: v for k, v in d["training"].items() if k not in ("resume", "deepspeed_config")}
    data = {k: d["data"][k] for k in ("dataset", "tokenizer", "context_length", "num_samples", "val_fraction")}
    keep = {"preset": d["preset"], "model": d["model"], "training": training, "data": data,
            "seed": d["system"]["seed"], "max_restarts": d["system"]["max_restarts"]}
    return hashlib.sha256(orjson.dumps(keep, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True)
class Layout:
    """This node's place in one attempt."""

    rank_offset: int
    world_size: int


def settings_problem(rec: dict[str, Any], first: dict[str, Any], r: Any) -> str | None:
    """Why node `r`'s join record cannot run in node 0's job (`first`): another --run-id,
    other model/training/data settings or another mode; None: it can. Exit 2 for that node."""
    if rec.get("run_id_given") and first.get("run_id_given") and rec.get("run_id") != first.get("run_id"):
        return (f"node {r} ({rec.get('host')}) was started with --run-id {rec.get('run_id')} and node 0 "
                f"({first.get('host')}) with --run-id {first.get('run_id')}: one job, one --run-id (start every "
                "node with the same one)")
    for key, what in (("fingerprint", "model/training/data settings"), ("mode", "mode (--script or not)")):
        if rec.get(key) != first.get(key):
            return (f"node {r} ({rec.get('host')}) runs other {what} than node 0 ({first.get('host')}): start "
                    "every node with the same arguments")
    return None


def node_ranks(nodes: list[dict[str, Any]], r: int) -> list[int]:
    """The job's ranks on node `r` (its place among `nodes`): they follow the workers of nodes < r."""
    first = sum(int(rec.get("nproc", 0)) for rec in nodes[:r])
    return list(range(first, first + int(nodes[r].get("nproc", 0))))


def layout(nodes: list[dict[str, Any]], node_rank: int) -> Layout:
    """Check the join records agree, and lay ranks out node by node. `node_rank`: this node's
    place among `nodes` (an elastic round admits a subset of the node ranks, in order)."""
    first = nodes[0]
    for r, rec in enumerate(nodes[1:], start=1):
        problem = settings_problem(rec, first, rec.get("node", r))  # its --node-rank (an elastic round may skip some)
        if problem is not None:
            raise NodeLinkError(problem, ExitCode.USAGE)
    offset = sum(int(rec["nproc"]) for rec in nodes[:node_rank])
    return Layout(rank_offset=offset, world_size=sum(int(rec["nproc"]) for rec in nodes))

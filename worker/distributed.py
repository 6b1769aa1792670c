"""Device choice, the device-UUID check, and process-group setup from the environment. A group a
lost peer broke, and its rebuilt generation: gpuherd/broken_group.py (a script's live recovery uses
them too)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import orjson
import torch
import torch.distributed as dist

from gpuherd import contract
from gpuherd.broken_group import COLLECTIVE_TIMEOUT, active, job_store, join_rebuilt
from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode



class WorkerError(GpuherdError, RuntimeError):
    """A failure with a known cause: one line for the user and its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message, exit_code)


def choose_device(cfg: Config, identity: WorkerIdentity) -> tuple[torch.device, WorkerIdentity]:
    """The torch device this process trains on, and the identity with its kind filled in."""
    kind = identity.device_kind or ("cuda" if cfg.system.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise WorkerError("a CUDA device was requested but torch sees none (CPU-only torch build, or no driver)",
                          ExitCode.DEVICE)
    if kind == "cpu":
        return torch.device("cpu"), replace(identity, device_kind="cpu")
    count = torch.cuda.device_count()
    if count == 1:
        index = 0  # isolated: CUDA_VISIBLE_DEVICES holds just our GPU
    elif not identity.supervised and cfg.system.device_id is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        index = cfg.system.device_id  # standalone, config names the GPU
    else:
        index = identity.local_rank  # --no-isolate: all planned GPUs visible
    if index >= count:
        raise WorkerError(f"GPU index {index} requested but only {count} visible", ExitCode.DEVICE)
    device_id = identity.device_id
    if not identity.supervised and not os.environ.get(contract.GPU_RANK) and not os.environ.get(contract.DEVICE_ID):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        device_id = int(visible) if visible.isdigit() else index
    torch.cuda.set_device(index)
    return torch.device("cuda", index), replace(identity, device_kind="cuda", device_id=device_id)


def check_device_uuid(device: torch.device, expected: str | None) -> str:
    """The UUID of the device we got; exit 4 if the supervisor planned another one."""
    if device.type != "cuda":
        return ""
    got = str(torch.cuda.get_device_properties(device).uuid)
    if expected and not contract.same_device_uuid(got, expected):
        raise WorkerError(
            f"device mismatch: the supervisor planned GPU {expected} but this process got GPU-{got} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})", ExitCode.DEVICE)
    return f"GPU-{got}" if not got.startswith("GPU-") else got


def backend_for(cfg: Config, device: torch.device) -> str:
    """system.backend; auto: nccl on a GPU, gloo on the CPU, and gloo where ranks share one GPU
    (system.shared_gpu_for_tests, tests only: NCCL refuses one GPU twice; nccl is refused at launch)."""
    if cfg.system.backend != "auto":
        return cfg.system.backend
    return "nccl" if device.type == "cuda" and not cfg.system.shared_gpu_for_tests else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(cfg: Config, identity: WorkerIdentity, device: torch.device) -> None:
    """env:// rendezvous bounded by system.rendezvous_timeout; a rank that never
    joins becomes one clear line and exit code 5 instead of a hang."""
    if identity.world_size == 1:  # standalone sharded strategies still need a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            raise WorkerError(f"{var} is not set: a distributed worker needs the supervisor's environment",
                              ExitCode.RENDEZVOUS)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = timedelta(seconds=cfg.system.rendezvous_timeout)
    backend = backend_for(cfg, device)
    started = time.monotonic()
    try:
        kwargs: dict[str, Any] = {}
        if device.type == "cuda" and backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init: a broken GPU fails here, not later
        dist.init_process_group(backend, init_method="env://", rank=identity.rank,
                                world_size=identity.world_size, timeout=timeout, **kwargs)
        dist.barrier()  # every rank has really joined, not just the store
    except (RuntimeError, ValueError, TimeoutError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise WorkerError(
            f"process group {not_formed(cfg.system.rendezvous_timeout, started)}: "
            f"rank {identity.rank} of {identity.world_size} waited at {where} for the other ranks; {detail}",
            ExitCode.RENDEZVOUS) from None
    if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)


def join_generation(cfg: Config, identity: WorkerIdentity, device: torch.device, generation: int) -> None:
    """Form rebuilt group `generation` of a live recovery (gpuherd/broken_group.py: `join_rebuilt`).
    Exit 5 if it does not form within system.rendezvous_timeout (a second failure: the supervisor
    restarts everyone)."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    started = time.monotonic()
    try:
        join_rebuilt(backend_for(cfg, device), cfg.system.rendezvous_timeout, identity.rank, identity.world_size,
                     device, generation)
    except (RuntimeError, ValueError, TimeoutError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise WorkerError(f"live recovery: rebuilt group {generation} "
                          f"{not_formed(cfg.system.rendezvous_timeout, started)}: rank {identity.rank} of "
                          f"{identity.world_size} waited at {where}; {detail}", ExitCode.RENDEZVOUS) from None


def not_formed(timeout_s: float, started: float) -> str:
    """Why a group did not form, as far as the clock can tell: the rendezvous timeout ran out, or
    something ended the wait sooner (a peer's connection closed: the detail after says what)."""
    waited = time.monotonic() - started
    if waited >= 0.9 * timeout_s:
        return f"did not form within {timeout_s:g}s (system.rendezvous_timeout)"
    return f"did not form: the wait ended after {waited:.1f} s, before system.rendezvous_timeout ({timeout_s:g}s)"


class RegrowEnded(Exception):
    """A regrow's newcomer: the shrunk group ended its training before it could grow back."""


def regrow_answer(cfg: Config, generation: int) -> str:
    """A regrow's newcomer waits for the shrunk group's answer (contract.REGROW_KEY): "go" or "ended"."""
    timeout = timedelta(seconds=cfg.system.rendezvous_timeout)
    try:
        store = job_store(timeout)
        return store.get(contract.REGROW_KEY.format(generation=generation)).decode()
    except (RuntimeError, ValueError, TimeoutError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise WorkerError(f"live recovery: no answer from the shrunk group on regrow {generation} within "
                          f"{cfg.system.rendezvous_timeout:g}s (system.rendezvous_timeout); {detail}",
                          ExitCode.RENDEZVOUS) from None


def read_decision(cfg: Config, generation: int) -> dict[str, Any]:
    """The supervisor's word on rebuilt group `generation` (contract.DECISION_KEY): a spare takes
    the lost rank, the survivors shrink, or a spare takes back a carried rank (a regrow). Waits
    for it up to system.rendezvous_timeout."""
    timeout = timedelta(seconds=cfg.system.rendezvous_timeout)
    try:
        store = job_store(timeout)
        return orjson.loads(store.get(contract.DECISION_KEY.format(generation=generation)))
    except (RuntimeError, ValueError, TimeoutError, KeyError, orjson.JSONDecodeError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise WorkerError(f"live recovery: no word from the supervisor on rebuilt group {generation} within "
                          f"{cfg.system.rendezvous_timeout:g}s (system.rendezvous_timeout); {detail}",
                          ExitCode.RENDEZVOUS) from None


class DecisionWatch:
    """A shrunk group's look, at each step boundary, for the supervisor's word that a warm spare
    takes back a carried rank: one store connection, kept, and one `check` (no wait) per look."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._store: Any = None

    def regrow(self, generation: int) -> bool:
        """True when rebuilt group `generation` is a regrow the supervisor decided."""
        key = contract.DECISION_KEY.format(generation=generation)
        try:
            store = self._connect()
            if not store.check([key]):
                return False
            return "regrow" in orjson.loads(store.get(key))
        except (RuntimeError, ValueError, TimeoutError, orjson.JSONDecodeError):
            return False  # the store is gone: the supervisor is ending the attempt anyway

    def answer(self, generation: int, verdict: str) -> None:
        """Tell the newcomer of rebuilt group `generation` (if one comes): "go" or "ended"."""
        try:
            self._connect().set(contract.REGROW_KEY.format(generation=generation), verdict)
        except (RuntimeError, ValueError, TimeoutError):
            pass  # the store is gone: the supervisor is ending the attempt anyway

    def _connect(self) -> Any:
        if self._store is None:
            self._store = job_store(timedelta(seconds=self.cfg.system.rendezvous_timeout))
        return self._store


def barrier(group: Any = None) -> None:
    """`group`: another process group than the default (a checkpoint writer thread's own)."""
    if active():
        dist.barrier(group=group)
    else:
        _no_group_left(group)


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not active():
        _no_group_left(group)
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _no_group_left(group: Any) -> None:
    """A collective over an explicit group once no group exists any more (live recovery left the
    broken one, destroying every group): a checkpoint writer thread that reaches its collectives
    only now must fail, not go on alone as if it were a single process (it would publish a
    checkpoint of its own shards only)."""
    if group is not None:
        raise RuntimeError("its process group is gone (left after a lost peer): a collective over it cannot run")


def smallest_device_memory(device: torch.device) -> int | None:
    """Total memory of the smallest GPU among all ranks (None on CPU): what a layout
    every rank must agree on has to fit."""
    if device.type != "cuda":
        return None
    return min(gather_objects(int(torch.cuda.get_device_properties(device).total_memory)))


def shutdown() -> None:
    if active():
        dist.destroy_process_group()


@dataclass
class StopVote:
    """Ranks agree to stop at the same step boundary (SIGINT may reach them at
    different steps). A CPU gloo group carries the vote, so the check never
    synchronises the GPU."""

    group: Any = None

    @classmethod
    def create(cls) -> StopVote:
        if not active() or dist.get_world_size() == 1:
            return cls(None)
        if dist.get_backend() == "gloo":
            return cls(dist.group.WORLD)
        return cls(dist.new_group(backend="gloo"))

    def highest(self, local: int, regrow: int = 0) -> tuple[int, int]:
        """The largest of every rank's `local` (a stop's exit code, 0 for none), and of `regrow`
        (the rebuilt group a warm spare waits in, 0 for none): every rank stops, or regrows, at
        the same step. One all-reduce carries both."""
        if self.group is None:
            return local, regrow
        value = torch.tensor([local, regrow], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        stop, grow = value.tolist()
        return int(stop), int(grow)

"""An attempt's live recovery, put together: whether it applies, its spares, their environment.

`live_for_attempt` returns None when there is nothing to decide (no --max-restarts, or
--spares 0 without --min-replicas) and when live recovery cannot apply to the run at all (a script
without the bootstrap, a single worker: known at launch, said once then, and no spare is started that could never
be used): the attempt then behaves exactly as without the feature. A multi-node job's
attempt gets the job's control plane (`regroup`): each node keeps its own spares and
replaces its own lost ranks (or, with --min-replicas and none left, shrinks the job's group
without them, and grows it back with its refilled spare), the rebuilt group agreed on through
the job store; node 0, whose helper hosts the workers' store, writes every node's decision there.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

from loguru import logger

from gpuherd import contract
from gpuherd.config import Config
from supervisor.gpus import DevicePlan, DeviceSlot
from supervisor.processes.error_file import error_file_for
from supervisor.processes.live_recovery import LiveRecovery, Regroup
from supervisor.processes.spare_source import SpareSource
from supervisor.processes.spares import SparePool
from supervisor.processes.spawn import WorkerProcess, spawn
from supervisor.processes.standbys import standby_env
from supervisor.processes.worker_env import RunEnv, worker_env

LIVE_ENV = {contract.LIVE_RECOVERY: "1"}  # in every worker's environment while spares stand by
SHRINK_ENV = {**LIVE_ENV, contract.SHRINK: "1"}  # ... and when a loss with no spare left may shrink the group




class Script(Protocol):
    """What live recovery reads of a user's script (supervisor/torchrun/script.py's Script)."""

    target: str
    module: bool

    @property
    def bootstrapped(self) -> bool: ...

    def command(self, local_rank: int | None = None) -> list[str]: ...


def why_off(cfg: Config, script: Script | None, multi_node: bool, world_size: int) -> str | None:
    """Why no rank of this attempt can be replaced live, whatever happens (None: it can). A
    script's ranks are recovered live only through gpuherd.live (their `able` records say so)."""
    if script is not None:
        why = why_off_script(cfg, script, multi_node)
        if why:
            return why
    if world_size < 2 and not multi_node:  # a multi-node job's other nodes hold the state
        return "a single worker: no survivor holds the state"
    return None


def why_off_script(cfg: Config, script: Script, multi_node: bool) -> str | None:
    if not script.bootstrapped:
        return ("a script run without gpuherd's bootstrap (--no-python or --no-auto-heartbeat): a warm spare of a "
                "script is its interpreter waiting in the bootstrap")
    if script.command(0) != script.command(1):
        return "the script's command line names ${local_rank}: a warm spare cannot know it before it takes a rank"
    if multi_node:
        return "a script across nodes (a script's live recovery is built for one node)"
    if cfg.system.min_replicas > 0:
        return "--min-replicas with a script (a script's data slots cannot be carried by another rank)"
    return None


def names_live(script: Script) -> bool:
    """The script's file names gpuherd.live: its spares start with the attempt, as the built-in
    trainer's do, so that one is warm for an early loss; else once a rank attaches (a script of
    which no rank does keeps no spare, whose torch import would slow the ranks' start)."""
    if script.module:
        return False
    try:
        text = Path(script.target).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return "gpuherd.live" in text or "gpuherd import live" in text


@dataclass
class AttemptLive:
    """What the attempt needs to run live recovery."""

    cfg: Config
    command: list[str]
    plan: DevicePlan
    run_env: RunEnv
    base_env: Mapping[str, str]
    log_dir: Path
    watch: Callable[[int], None]  # the orphan guard's: every spare's process group is guarded too
    tell: Callable[[str, str], bool] | None = None  # a key into the workers' store (None: not hosted by this node)
    shrink: bool = False  # set by live_for_attempt: --min-replicas applies to this attempt
    script: bool = False  # a user's script: its spare is the script's interpreter waiting in the bootstrap
    lend: Callable[[float], WorkerProcess | None] | None = None  # a script's restart standbys, older than a spare

    @property
    def env(self) -> dict[str, str]:
        return dict(SHRINK_ENV if self.shrink else LIVE_ENV)

    def start_spare(self, number: int, more: Mapping[str, str] | None = None, keep_fds: tuple[int, ...] = ()
                    ) -> WorkerProcess:
        slot = self.plan.slots[0]  # a placeholder: the real rank comes with the assignment
        env = {**worker_env(self.base_env, self.plan, slot, self.run_env, 0), **self.env, contract.SPARE: "1"}
        if self.script:  # the restart standby's wait (worker/script_bootstrap.py: `stand_by`), for a lost rank;
            # GPUHERD_SPARE: it says `warm` once torch is imported (a straggler moves only to a warm spare)
            env = {**standby_env({**worker_env(self.base_env, self.plan, slot, self.run_env, 0), **self.env}),
                   contract.SPARE: "1"}
        env.update(more or {})
        spare = spawn(self.command, lambda fd: {**env, contract.STATUS_FD: str(fd)}, slot,
                      self.log_dir / f"spare-{number}.log", stdin_pipe=True, keep_fds=keep_fds)
        self.watch(spare.pgid)
        return spare

    def start_source(self, number: int, more: Mapping[str, str] | None = None) -> SpareSource:
        """A spare source (spare_source.py): a spare that forks the others, warm."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = self.start_spare(number, {**(more or {}), contract.SPARE_SOURCE_FD: str(theirs.fileno())},
                                       (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return SpareSource(process, ours, self.watch, self.log_dir)

    def env_for(self, slot: DeviceSlot, spare: WorkerProcess, generation: int) -> dict[str, str]:
        error_file = error_file_for(spare.log_path.parent / f"worker-rank{slot.rank}-{slot.tag}.log")
        error_file.unlink(missing_ok=True)  # the lost rank's account was read already
        return {**worker_env(self.base_env, self.plan, slot, self.run_env, 0, error_file=str(error_file)),
                **self.env, contract.JOIN_GENERATION: str(generation)}


def live_for_attempt(parts: AttemptLive, budget: int, attempt: int, numbered_from: int, script: Script | None,
                     multi_node: bool, write_metric: Callable[[dict], None], regroup: Regroup | None = None,
                     node: int | None = None) -> LiveRecovery | None:
    """`regroup`, `node`: a multi-node job's control plane, and this node's rank."""
    count, floor = parts.cfg.system.spares, parts.cfg.system.min_replicas  # settled when the config was built
    if (count == 0 and floor == 0) or parts.cfg.system.max_restarts == 0:
        return None
    off = why_off(parts.cfg, script, multi_node, parts.plan.world_size)
    if off:
        if attempt == 0:
            logger.info(f"live recovery off: {off}; a failure restarts every worker (--max-restarts), "
                        "no warm spare is started")
        return None
    parts.shrink, parts.script = floor > 0, script is not None
    pool = SparePool(count, parts.start_spare, parts.lend if script is not None else None,
                     parts.start_source if SpareSource.possible() else None)  # the spares: forks of one warm one
    return LiveRecovery(pool, budget, attempt, parts.env_for, numbered_from,
                        write_metric, regroup=regroup, node=node, shrink_floor=floor, tell=parts.tell,
                        worker_env=parts.env, world_size=parts.run_env.world_size, script=script is not None,
                        lazy_spares=script is not None and not names_live(script))


def discard_spares(pool: SparePool, forget: Callable[[int], None]) -> None:
    """The attempt is over: spares never used end (end of input, then SIGKILL) and leave no fd."""
    for spare in pool.retire():
        spare.discard()
        forget(spare.pgid)

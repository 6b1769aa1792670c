"""The supervisor's live-recovery policy in milliseconds: when a spare may take a lost rank, why
not otherwise, and what a recovery records (the real processes: tests/e2e/test_live_recovery_run.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from pathlib import Path

import orjson
import pytest
from loguru import logger

from gpuherd import contract
from gpuherd.config import Config, ConfigError, resolve, validate
from gpuherd.status_records import from_object as record
from supervisor.gpus import DeviceSlot
from supervisor.processes import LiveRecovery
from supervisor.torchrun import Script
from supervisor.processes.live_setup import AttemptLive, live_for_attempt, why_off
from supervisor.processes.spares import SparePool
from supervisor.summary import RootCause


@dataclass
class FakeProc:
    pid: int
    rank: int = 0
    returncode: int | None = None

    @property
    def slot(self) -> DeviceSlot:
        return DeviceSlot(self.rank, "cpu", self.rank)

    log_path: Path = Path("/dev/null")

    def poll(self) -> int | None:
        return self.returncode


class FakePool(SparePool):
    """The real pool (take, refill) over fake processes: spare n has pid 900 + n."""

    def __init__(self, count: int = 1) -> None:
        self.envs: dict[int, dict] = {}  # pid -> what was added to the spare's environment
        super().__init__(count, self._fake_start)
        self.promoted: list[tuple[int, dict]] = []
        self.fill()

    def promote(self, spare: FakeProc, slot: DeviceSlot, log_path: Path, env: dict) -> FakeProc:
        self.promoted.append((slot.rank, env))
        return FakeProc(pid=spare.pid, rank=slot.rank)

    def _heard_warm(self, spare: FakeProc) -> bool:  # a fake spare has no status channel: `said_warm` says it
        return spare.pid in self._warm

    def said_warm(self, pid: int) -> None:
        self._warm.add(pid)

    def _fake_start(self, n: int, env: dict) -> FakeProc:
        self.envs[900 + n] = dict(env)
        return FakeProc(pid=900 + n)


def _live(budget: int = 2, off: str | None = None, pool: FakePool | None = None) -> tuple[LiveRecovery, list[dict]]:
    metrics: list[dict] = []
    live = LiveRecovery(pool or FakePool(), budget, attempt=0, env_for=lambda slot, spare, g: {"GEN": str(g)},
                        numbered_from=0, write_metric=metrics.append, off=off)
    for rank in (0, 1):
        live.observe(record({"type": "live", "rank": rank, "event": "able", "able": True, "why": None}))
    return live, metrics


@pytest.fixture
def warnings():
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    yield lines
    logger.remove(handler)


def _cause(rank: int = 1) -> RootCause:
    return RootCause("worker-exit", 137, f"CPU{rank} (rank {rank}) killed by SIGKILL after 3.0 s", rank=rank)


def test_a_spare_takes_the_lost_rank_and_the_recovery_is_accounted_from_the_ranks_records():
    live, metrics = _live()
    for step in range(7):  # step records carry the 0-based index of the completed step
        live.observe(record({"type": "step", "rank": 0, "step": step}))
    new = live.recover(FakeProc(pid=11, rank=1), _cause(), [FakeProc(pid=10, rank=0)], now=100.0)[1]
    assert new is not None and new.pid == 900 and new.slot.rank == 1
    assert live.pool.promoted == [(1, {"GEN": "1"})]  # the first rebuilt group of the attempt
    assert live.budget == 1 and live.in_flight is not None
    live.observe(record({"type": "live", "rank": 0, "event": "lost_peer", "generation": 1, "step": 8}))
    live.observe(record({"type": "live", "rank": 1, "event": "rejoined", "generation": 1, "step": 7, "source": 0,
                     "role": "newcomer", "seconds": 0.2}))
    live.observe(record({"type": "live", "rank": 1, "event": "first_step", "generation": 1, "step": 8}))
    (rec,) = live.recoveries
    assert rec.outcome == "recovered" and rec.resumed_step == 7 and rec.source_rank == 0
    assert rec.steps_redone == 1  # rank 0 said it had completed 8 when the collective broke
    assert rec.survivors == [{"rank": 0, "pid": 10}] and rec.lost_pid == 11 and rec.replaced_by_pid == 900
    assert metrics[-1]["type"] == "recovery" and metrics[-1]["outcome"] == "recovered"
    assert live.settle()[0]["outcome"] == "recovered"


def _recover(live: LiveRecovery, number: int, now: float) -> FakeProc | None:
    """Rank 1 lost and, when a spare took it, its first step completed in rebuilt group `number`."""
    new = live.recover(FakeProc(pid=10 + number, rank=1), _cause(), [FakeProc(pid=10, rank=0)], now=now)[1]
    if new is not None:
        live.observe(record({"type": "live", "rank": 1, "event": "first_step", "generation": number, "step": 8}))
    return new


def test_the_pool_refills_when_a_spare_is_promoted_so_failures_in_a_row_are_all_recovered_live(warnings):
    live, _ = _live(budget=8)  # the defaults: --max-restarts 8, one warm spare
    for number in range(1, 5):
        new = _recover(live, number, now=15.0 * number)
        assert new is not None and new.pid == 900 + number - 1, warnings
        assert [s.pid for s in live.pool.spares] == [900 + number]  # a fresh spare already stands by
        assert live.pool.envs[900 + number] == {}  # the group is whole: it warms up at nice 19 (worker/spare.py)
    assert [r.outcome for r in live.recoveries] == ["recovered"] * 4 and live.budget == 4
    assert not [w for w in warnings if "not possible" in w]


def test_no_new_spare_is_started_once_no_restart_is_left_for_it():
    live, _ = _live(budget=1)
    assert _recover(live, 1, now=1.0) is not None
    assert live.pool.spares == [] and live.pool.started == 1
    assert live.why_not(1, [0]).startswith("no restart left for it")


@pytest.mark.parametrize(("setup", "why"), [
    (lambda live: setattr(live, "rules", replace(live.rules, off="a --script run (x)")), "a --script run (x)"),
    (lambda live: setattr(live, "state", replace(live.state, budget=0)), "no restart left for it"),
    (lambda live: setattr(live, "state", replace(live.state, able={1: None})),
     "rank 0 had not started training yet"),
    (lambda live: live.observe(record({"type": "live", "rank": 0, "event": "able", "able": False,
                                "why": "strategy fsdp shards its state"})), "rank 0: strategy fsdp shards its state"),
    (lambda live: live.pool.spares.clear(), "no warm spare left"),
    (lambda live: setattr(live.pool.spares[0], "returncode", -9), "the warm spare is gone (pid 900 killed by SIGKILL)"),
])
def test_where_live_recovery_cannot_apply_it_says_why_and_leaves_the_restart_to_the_supervision(setup, why, warnings):
    live, _ = _live()
    setup(live)
    assert live.recover(FakeProc(pid=11, rank=1), _cause(), [FakeProc(pid=10, rank=0)], now=1.0)[1] is None
    assert live.recoveries == [] and live.pool.promoted == []
    (line,) = warnings
    assert line.startswith("live recovery not possible: ") and why in line


def test_a_second_failure_during_a_recovery_fails_it_and_falls_back(warnings):
    live, metrics = _live(pool=FakePool(count=2))
    live.recover(FakeProc(pid=11, rank=1), _cause(), [FakeProc(pid=10, rank=0)], now=1.0)
    assert live.recover(FakeProc(pid=10, rank=0), _cause(0), [FakeProc(pid=900, rank=1)], now=2.0)[1] is None
    assert warnings[-1] == "live recovery not possible: a second failure during a recovery (rank 1 was being replaced)"
    (rec,) = live.recoveries
    assert rec.outcome == "failed" and "then CPU0 (rank 0) killed by SIGKILL" in rec.failed
    assert metrics[-1]["outcome"] == "failed"


def test_a_recovery_still_in_flight_when_the_attempt_ends_is_recorded_as_failed():
    live, _ = _live()
    live.recover(FakeProc(pid=11, rank=1), _cause(), [FakeProc(pid=10, rank=0)], now=1.0)
    (rec,) = live.settle()
    assert rec["outcome"] == "failed" and "before the rebuilt group completed a step" in rec["failed"]


def test_every_rank_lost_leaves_no_survivor_to_take_the_state_from():
    live, _ = _live()
    assert live.why_not(1, []) == "every rank was lost: no survivor holds the state"


def test_spares_default_to_one_with_restarts_and_need_restarts_when_asked_for(tmp_path):
    def spares(*overrides: str) -> int:
        return resolve(overrides=list(overrides), cwd=tmp_path, files=False).system.spares

    assert spares() == 0
    assert spares("system.max_restarts=2") == 1
    assert spares("system.max_restarts=2", "system.spares=0") == 0
    assert spares("system.max_restarts=2", "system.spares=3") == 3
    with pytest.raises(ConfigError, match="system.spares=1 needs system.max_restarts > 0"):
        resolve(overrides=["system.spares=1"], cwd=tmp_path, files=False)
    cfg = Config()
    cfg.system.max_restarts, cfg.system.spares = 0, 1
    with pytest.raises(ConfigError, match="system.spares=1 needs system.max_restarts > 0"):
        validate(cfg)


@pytest.mark.parametrize(("argv", "settled"), [(["--max-restarts", "2"], 1), (["--max-restarts", "2", "--spares", "-1"], 1),
                                               ([], 0), (["--max-restarts", "2", "--spares", "0"], 0)])
def test_the_launch_settles_spares_once_and_the_config_the_workers_read_holds_the_number(argv, settled):
    """--spares -1 (the default) is decided when the config is built: the supervisor, config.json
    and the workers read that number; nothing downstream derives it again."""
    from supervisor.cli import parse

    cfg = parse(["--debug", *argv], files=False).config
    assert cfg.system.spares == settled
    assert orjson.loads(cfg.to_json())["system"]["spares"] == settled


def test_attempts_where_no_rank_can_be_replaced_live_say_why_up_front():
    cfg = Config()
    script = Script("train.py", ["--steps", "5"])
    assert why_off(cfg, script=script, multi_node=False, world_size=2) is None  # gpuherd.live's able records decide
    assert "without gpuherd's bootstrap" in why_off(cfg, script=Script("train.py", auto_heartbeat=False),
                                                     multi_node=False, world_size=2)
    assert "${local_rank}" in why_off(cfg, script=Script("train.py", ["--out", "o${local_rank}"]), multi_node=False,
                                      world_size=2)
    assert why_off(cfg, script=script, multi_node=True, world_size=2).startswith("a script across nodes")
    assert why_off(cfg, script=None, multi_node=False, world_size=1).startswith("a single worker")
    # a multi-node job: the other nodes' ranks survive a lost one, even with one worker per node
    assert why_off(cfg, script=None, multi_node=True, world_size=1) is None
    assert why_off(cfg, script=None, multi_node=False, world_size=2) is None


def test_a_survivor_that_never_leaves_the_broken_group_ends_the_recovery_after_a_step_allowance():
    live, metrics = _live(pool=FakePool())
    live.observe(record({"type": "live", "rank": 2, "event": "able", "able": True, "why": None}))
    # a survivor may notice the loss before the supervisor has reaped the lost rank
    live.observe(record({"type": "live", "rank": 0, "event": "lost_peer", "generation": 1, "step": 5}))
    live.recover(FakeProc(pid=11, rank=1), _cause(), [FakeProc(pid=10, rank=0), FakeProc(pid=12, rank=2)], now=100.0)
    assert live.stuck(105.0, step_allowance=2.0) is None  # at least STUCK_S
    assert live.stuck(115.0, step_allowance=30.0) is None  # a step's allowance when longer
    why, rank = live.stuck(111.0, step_allowance=2.0)
    assert rank == 2 and why.startswith("live recovery 1 not possible: rank(s) 2 stayed in a collective")
    live.give_up(_cause(2))
    assert live.recoveries[0].outcome == "failed" and metrics[-1]["outcome"] == "failed"
    assert live.stuck(200.0, step_allowance=2.0) is None  # nothing in flight any more


def _shrinking(floor: int = 2, spares: int = 0, ranks: int = 4) -> tuple[LiveRecovery, list[dict], list[tuple]]:
    """Live recovery with --min-replicas `floor` and `spares` warm spares; what it tells the store."""
    told: list[tuple[str, dict]] = []
    metrics: list[dict] = []
    live = LiveRecovery(FakePool(spares), 3, attempt=0, env_for=lambda slot, spare, g: {"GEN": str(g)},
                        numbered_from=0, write_metric=metrics.append, shrink_floor=floor,
                        tell=lambda key, value: told.append((key, orjson.loads(value))) or True)
    for rank in range(ranks):
        live.observe(record({"type": "live", "rank": rank, "event": "able", "able": True, "why": None}))
    return live, metrics, told


def test_with_no_spare_left_a_lost_rank_shrinks_the_group_and_the_survivors_are_told_in_the_store(warnings):
    live, metrics, told = _shrinking()
    assert live.shrinks() and live.why_not(2, [0, 1, 3]) is None
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (0, 1, 3)]
    assert live.recover(FakeProc(pid=12, rank=2), _cause(2), survivors, now=100.0)[0]
    assert told == [("gpuherd-live/1/decision", {"shrink": 2, "ranks": [0, 1, 3]})]
    assert live.budget == 2 and live.group == [0, 1, 3] and live.pool.promoted == []
    rec = live.in_flight
    assert rec.action == "shrink" and rec.replicas == 3 and rec.survivors == [
        {"rank": r, "pid": 10 + r} for r in (0, 1, 3)]
    for r in (0, 1, 3):
        live.observe(record({"type": "live", "rank": r, "event": "lost_peer", "generation": 1, "step": 8}))
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": 1, "step": 8, "source": 0,
                      "role": "source" if r == 0 else "survivor", "seconds": 0.3, "replicas": 3}))
    live.observe(record({"type": "step", "rank": 1, "step": 8}))  # a survivor's first completed step in the shrunk group
    assert rec.outcome == "recovered" and rec.resumed_step == 8 and rec.source_rank == 0 and rec.steps_redone == 0
    assert metrics[-1]["action"] == "shrink" and metrics[-1]["replaced_by_pid"] == 0
    assert "3 process(es) train on with its data slot carried" in warnings[-1]
    (settled,) = live.settle()  # the attempt ends: how long it trained shrunk, from the loss
    assert abs(settled["shrunk_s"] - (time.monotonic() - 100.0)) < 5


def test_a_shrunk_group_shrinks_again_even_when_a_spare_is_back_since_no_spare_can_join_it():
    live, _metrics, told = _shrinking(floor=2, spares=1)
    assert not live.shrinks()  # a warm spare waits: it takes the lost rank, and the survivors are told so
    new = live.recover(FakeProc(pid=12, rank=2), _cause(2), [FakeProc(pid=10 + r, rank=r) for r in (0, 1, 3)], 1.0)[1]
    assert new is not None and told == [("gpuherd-live/1/decision", {"spare": 2})]
    live.observe(record({"type": "live", "rank": 2, "event": "first_step", "generation": 1, "step": 8}))
    live.state = replace(live.state, group=(0, 1, 3))  # as after a shrink
    assert live.shrinks() and live.pool.ready()


def test_shrinking_is_refused_in_one_line_below_the_floor():
    live, _metrics, _told = _shrinking(floor=2)
    assert "1 survivor(s) are fewer than --min-replicas 2" in live.why_not(3, [0])


def test_a_sharded_rank_is_not_shrunk_away_with_no_spare_left_but_restarts_saying_why():
    live, _metrics, told = _shrinking(floor=2)
    no_shrink = "its shard cannot be spread over fewer ranks while training (a shrink of fsdp is not built)"
    for rank in range(4):  # an FSDP worker's able record says it can be replaced, but not shrunk away
        live.observe(record({"type": "live", "rank": rank, "event": "able", "able": True, "no_shrink": no_shrink}))
    assert live.why_not(2, [0, 1, 3]) == f"no spare left, and rank 2: {no_shrink}"
    assert told == []


def test_rank_0_lost_with_no_spare_left_shrinks_too_its_lowest_survivor_leading_until_a_regrow_brings_it_back(
        warnings):
    live, _metrics, told = _shrinking(floor=2, spares=1)
    live.pool.spares[0].returncode = 137  # the standing spare died: none left
    assert live.shrinks() and live.why_not(0, [1, 2, 3]) is None
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (1, 2, 3)]
    assert live.recover(FakeProc(pid=10, rank=0), _cause(0), survivors, now=100.0)[0]
    assert told == [("gpuherd-live/1/decision", {"shrink": 0, "ranks": [1, 2, 3]})]
    assert "go on without rank 0" in warnings[-1] and "rank 1 leads in its place" in warnings[-1]
    rec = live.in_flight
    assert rec.rank == 0 and rec.survivors == [{"rank": r, "pid": 10 + r} for r in (1, 2, 3)]
    for r in (1, 2, 3):
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": 1, "step": 8, "source": 1,
                             "role": "source" if r == 1 else "survivor", "seconds": 0.3, "replicas": 3}))
    live.observe(record({"type": "step", "rank": 2, "step": 8}))
    assert rec.outcome == "recovered" and rec.source_rank == 1 and rec.resumed_step == 8
    live.pool.said_warm(901)
    assert live.regrow_candidate() == 0  # the pool's refill takes rank 0 back
    live.regrow(DeviceSlot(0, "cpu", 0), Path("/dev/null"), survivors, now=130.0)
    assert told[-1] == ("gpuherd-live/2/decision", {"regrow": 0, "ranks": [0, 1, 2, 3]}) and live.group is None
    assert live.pool.promoted == [(0, {"GEN": "2"})] and live.recoveries[-1].survivors == rec.survivors


def test_without_min_replicas_no_spare_left_stays_a_restart():
    live, _metrics, told = _shrinking(floor=0)
    assert not live.shrinks() and live.why_not(2, [0, 1, 3]) is None  # the pool says why, at the replacement
    assert live.recover(FakeProc(pid=12, rank=2), _cause(2), [FakeProc(pid=10, rank=0)], 1.0)[1] is None
    assert told == []


def test_min_replicas_needs_restarts():
    cfg = Config()
    cfg.system.min_replicas = 2
    with pytest.raises(ConfigError, match="min_replicas=2 needs system.max_restarts"):
        validate(cfg)


@pytest.mark.parametrize("restarts, spares", [(0, -1), (2, 0)])
def test_spare_nodes_need_live_recovery(restarts, spares):
    cfg = Config()
    cfg.system.spare_nodes, cfg.system.max_restarts, cfg.system.spares = 1, restarts, spares
    with pytest.raises(ConfigError, match="spare_nodes=1 needs system.max_restarts > 0 .* and live recovery on"):
        validate(cfg)


def _attempt_live(spares: int, multi_node: bool, lines: list[str]) -> LiveRecovery | None:
    cfg = Config()
    cfg.system.max_restarts, cfg.system.spares, cfg.system.min_replicas = 2, spares, 2
    parts = AttemptLive(cfg, ["python", "-m", "worker"], SimpleNamespace(world_size=4), SimpleNamespace(world_size=4),
                        {}, Path("/nonexistent"),
                        watch=lambda pgid: None, tell=None if multi_node else (lambda key, value: True))
    handler = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        return live_for_attempt(parts, budget=2, attempt=0, numbered_from=0, script=None, multi_node=multi_node,
                                write_metric=lambda record: None)
    finally:
        logger.remove(handler)


def test_min_replicas_alone_turns_live_recovery_on_to_shrink_and_tells_every_worker_to_wait_for_the_decision():
    lines: list[str] = []
    live = _attempt_live(spares=0, multi_node=False, lines=lines)
    assert live is not None and live.shrink_floor == 2 and live.shrinks()
    assert live.worker_env == {contract.LIVE_RECOVERY: "1", contract.SHRINK: "1"} and not lines


@pytest.mark.parametrize("spares", [0, 1])
def test_a_multi_node_job_shrinks_too_its_floor_counting_every_nodes_ranks(spares):
    """Node 1 of a job of 4 ranks hosts no workers' store (node 0 writes the decisions there)."""
    lines: list[str] = []
    live = _attempt_live(spares=spares, multi_node=True, lines=lines)
    assert live.shrink_floor == 2 and live.tell is None and live.worker_env[contract.SHRINK] == "1" and not lines
    assert live.members() == [0, 1, 2, 3]


def _shrunk_without_rank_2(spares: int = 1) -> tuple[LiveRecovery, list[dict], list]:
    """Four ranks, --min-replicas 2; the warm spare died, then rank 2 was lost: the group shrank."""
    live, metrics, told = _shrinking(floor=2, spares=spares)
    for spare in live.pool.spares:
        spare.returncode = 137
    assert live.shrinks()
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (0, 1, 3)]
    assert live.recover(FakeProc(pid=12, rank=2), _cause(2), survivors, 100.0)[0]
    for r in (0, 1, 3):
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": 1, "step": 8, "source": 0,
                             "role": "survivor", "seconds": 0.3, "replicas": 3}))
    live.observe(record({"type": "step", "rank": 1, "step": 8}))
    assert live.recoveries[-1].outcome == "recovered"
    return live, metrics, told


def _rebuilt(live: LiveRecovery, generation: int, ranks: tuple[int, ...]) -> None:
    """The survivors rejoined rebuilt group `generation` and one completed a step in it: the shrink's end."""
    for r in ranks:
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": generation, "step": 9,
                             "source": ranks[0], "role": "survivor", "seconds": 0.3, "replicas": len(ranks)}))
    live.observe(record({"type": "step", "rank": ranks[0], "step": 9}))
    assert live.in_flight is None


def test_after_a_shrink_the_pool_refills_and_once_warm_its_spare_takes_back_the_carried_rank(warnings):
    live, metrics, told = _shrunk_without_rank_2()
    assert [s.pid for s in live.pool.spares if s.poll() is None] == [901]  # the refill, warming up
    assert live.pool.envs[901] == {"GPUHERD_SPARE_WARM_UP_NICE": "0"}  # the shrunk group waits for it: not at nice 19
    assert live.regrow_candidate() is None  # not warm yet: the group stays shrunk meanwhile
    for step in range(9, 20):
        live.observe(record({"type": "step", "rank": 0, "step": step}))
    live.pool.said_warm(901)
    assert live.regrow_candidate() == 2
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (0, 1, 3)]
    new = live.regrow(DeviceSlot(2, "cpu", 2), Path("/dev/null"), survivors, now=160.0)
    assert new is not None and new.pid == 901 and live.pool.promoted == [(2, {"GEN": "2"})]
    assert told[-1] == ("gpuherd-live/2/decision", {"regrow": 2, "ranks": [0, 1, 2, 3]})
    assert live.group is None and live.budget == 2  # grown back whole; a regrow uses no restart
    shrink, regrow = live.recoveries
    assert shrink.shrunk_s == regrow.shrunk_s == 60.0  # from the loss to the regrow's decision
    assert regrow.action == regrow.kind == "regrow" and regrow.replicas == 4 and regrow.lost_pid == 0
    assert regrow.survivors == [{"rank": r, "pid": 10 + r} for r in (0, 1, 3)]
    live.observe(record({"type": "live", "rank": 2, "event": "rejoined", "generation": 2, "step": 20, "source": 0,
                         "role": "newcomer", "seconds": 0.2, "replicas": 4}))
    live.observe(record({"type": "live", "rank": 2, "event": "first_step", "generation": 2, "step": 21}))
    assert regrow.outcome == "recovered" and regrow.resumed_step == 20 and regrow.steps_redone == 0
    assert metrics[-1]["action"] == "regrow" and metrics[-1]["shrunk_s"] == 60.0
    assert "regrow: warm spare pid 901 took back rank 2" in warnings[-1]
    assert [r["shrunk_s"] for r in live.settle()] == [60.0, 60.0]  # the shrink ended at the regrow
    assert live.regrow_candidate() is None


def test_a_group_shrunk_twice_grows_back_one_rank_at_a_time_and_stays_shrunk_until_the_last():
    live, _metrics, told = _shrunk_without_rank_2(spares=1)
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (0, 1)]
    assert live.recover(FakeProc(pid=13, rank=3), _cause(3), survivors, now=110.0)[0]
    assert told[-1] == ("gpuherd-live/2/decision", {"shrink": 3, "ranks": [0, 1]})
    _rebuilt(live, 2, (0, 1))
    live.pool.said_warm(901)
    assert live.regrow_candidate() == 2
    live.regrow(DeviceSlot(2, "cpu", 2), Path("/dev/null"), survivors, now=130.0)
    assert told[-1] == ("gpuherd-live/3/decision", {"regrow": 2, "ranks": [0, 1, 2]}) and live.group == [0, 1, 2]
    assert live.regrow_candidate() is None  # in flight, and no second spare warm


def test_a_regrow_whose_decision_cannot_reach_the_workers_keeps_the_spare_and_the_shrunk_group(warnings):
    live, _metrics, _told = _shrunk_without_rank_2()
    live.tell = lambda key, value: False
    live.pool.said_warm(901)
    assert live.regrow(DeviceSlot(2, "cpu", 2), Path("/dev/null"), [], now=120.0) is None
    assert live.pool.promoted == [] and live.group == [0, 1, 3] and live.regrow_candidate() == 2
    assert "regrow not possible: the rendezvous store is gone" in warnings[-1]


def test_the_pool_knows_a_spare_is_warm_from_its_status_channel_and_reads_it_before_a_promotion():
    read, write = os.pipe()
    spare = SimpleNamespace(pid=4242, status_fd=read, poll=lambda: None)
    pool = SparePool(1, lambda n, _env: spare)
    pool.fill()
    try:
        assert pool.warm() is None  # still warming up: it said nothing yet
        os.write(write, _status_line({"type": "live", "rank": 0, "event": "warm"}))
        assert pool.warm() is spare and pool.warm() is spare  # read once, remembered
        assert pool.take_warm() is spare and pool.spares == [] and pool.warm() is None
    finally:
        os.close(read)
        os.close(write)


def _status_line(record: dict) -> bytes:  # what a worker's StatusWriter writes: one JSON line
    return orjson.dumps({**record, "time": time.time()}) + b"\n"


def test_no_regrow_once_a_rank_finished_training():
    live, _metrics, _told = _shrunk_without_rank_2()
    live.pool.said_warm(901)
    assert live.regrow_candidate() == 2
    live.observe(record({"type": "done", "rank": 0, "step": 40}))
    assert live.regrow_candidate() is None


# ---- a user's script (gpuherd.live): its spares, its restart standbys lent, its words


@dataclass
class AgedProc(FakeProc):
    started: float = 0.0


def test_a_script_spare_older_than_the_pools_is_lent_by_the_restart_standbys():
    """After a recovery the pool's new spare is still importing torch; a restart standby started
    earlier (at the attempt's first step) takes the next lost rank instead."""
    standbys = {3: AgedProc(pid=700, started=5.0), 4: AgedProc(pid=701, started=1.0)}

    def lend(before: float):
        older = [(p.started, local) for local, p in standbys.items() if p.started < before]
        return standbys.pop(min(older)[1]) if older else None

    pool = SparePool(1, lambda n, _env: AgedProc(pid=900 + n, started=10.0), lend)
    pool.fill()
    assert pool.take()[0].pid == 701  # the oldest standby, before the pool's younger spare
    assert pool.take()[0].pid == 700
    assert pool.take()[0].pid == 900  # no standby left older than it: the pool's own


def test_a_script_that_never_attaches_keeps_no_spare_and_its_loss_says_why(warnings):
    pool = SparePool(1, lambda n, _env: FakeProc(pid=900 + n))
    live = LiveRecovery(pool, 2, attempt=0, env_for=lambda slot, spare, g: {}, numbered_from=0,
                        write_metric=lambda m: None, script=True, lazy_spares=True)
    assert pool.started == 0
    assert live.why_not(1, [0]) == "rank 1's script had not called gpuherd.live.attach (a script is recovered live " \
                                   "only through it)"
    live.observe(record({"type": "live", "rank": 0, "event": "able", "able": True, "why": None}))
    assert pool.started == 1 and pool.ready()  # the first rank that attached: the pool's spare starts now
    live.observe(record({"type": "live", "rank": 1, "event": "able", "able": True, "why": None}))
    assert pool.started == 1


def test_a_script_naming_gpuherd_live_gets_its_spares_with_the_attempt(tmp_path):
    from supervisor.processes.live_setup import names_live

    (tmp_path / "live.py").write_text("import gpuherd.live as live\n")
    (tmp_path / "plain.py").write_text("import torch\n")
    assert names_live(Script(str(tmp_path / "live.py")))
    assert not names_live(Script(str(tmp_path / "plain.py")))
    assert not names_live(Script("pkg.train", module=True))  # a module: its file is not known here


def test_the_restart_standbys_lend_their_oldest_live_one_started_before_a_time():
    from supervisor.processes.standbys import Standbys

    made = iter([AgedProc(pid=700, started=3.0), AgedProc(pid=701, started=1.0, returncode=-9),
                 AgedProc(pid=702, started=2.0)])
    standbys = Standbys()
    standbys.fill([DeviceSlot(r, "cpu", r) for r in range(3)], lambda slot: (next(made), {}))
    assert standbys.lend(before=1.5) is None  # the only older one died
    assert standbys.lend(before=10.0).pid == 702
    assert standbys.pids() == {700, 701}  # lent: no longer a standby of the next attempt


@dataclass
class FakeSource:
    """A spare source (supervisor/processes/spare_source.py) over fake processes: `forked` says which
    of the spares asked of it it has forked (pid 800 + n for spare n)."""

    process: AgedProc
    asked: list[int] = field(default_factory=list)
    closed: bool = False
    forked: int = 0

    def ask(self, number: int) -> bool:
        self.asked.append(number)
        return True

    def collect(self, slot: DeviceSlot) -> tuple[list, int]:
        done, self.asked = self.asked[:self.forked], self.asked[self.forked:]
        self.forked = 0
        return [AgedProc(pid=800 + n, started=20.0) for n in done], 0

    def close(self) -> None:
        self.closed = True


def test_a_pool_with_a_spare_source_takes_a_fork_before_an_older_standby_and_the_source_last():
    """A fork of the warm source is warm at once; a restart standby older than it may still be
    importing torch. Before the source forked any, the source itself takes the rank (as a spare
    still importing did), serves no more, and the next refill starts a new source."""
    standbys = {0: AgedProc(pid=700, started=5.0)}
    sources: list[FakeSource] = []

    def new_source(n: int, _env: dict) -> FakeSource:
        sources.append(FakeSource(AgedProc(pid=600 + n, started=1.0)))
        return sources[-1]

    pool = SparePool(1, lambda n, _env: AgedProc(pid=900 + n, started=10.0), lambda before: (
        standbys.pop(0) if standbys and standbys[0].started < before else None), new_source)
    assert [p.pid for p in pool.fill()] == [600] and sources[0].asked == [1]  # the source, and a spare asked of it
    assert pool.ready()
    sources[0].forked = 1
    assert pool.adopt()[0].pid == 801 and pool.warm().pid == 801
    assert pool.take()[0].pid == 801 and 0 in standbys  # the fork, not the standby started before it
    assert pool.fill() == [] and sources[0].asked == [2]  # the refill: asked of the same source
    assert pool.take()[0].pid == 600 and sources[0].closed  # no fork yet, the source older than the standby
    assert pool.source is None
    assert [p.pid for p in pool.fill()] == [603] and sources[1].asked == [4]  # a new source for the next refill
    sources[1].forked = 1
    assert [p.pid for p in pool.adopt()] == [804] and pool.take()[0].pid == 804
    none = SparePool(0, lambda n, _env: AgedProc(pid=900 + n), None, new_source)  # --spares 0 (--min-replicas alone)
    assert none.fill() == [] and none.source is None and len(sources) == 2 and not none.ready()


def test_a_regrow_whose_newcomer_takes_longer_than_the_stuck_allowance_to_its_first_step_is_waited_for(warnings):
    """A regrow breaks no group: the survivors leave theirs at a step boundary the decision named,
    so none sends a `lost_peer` record and none can be 'stuck in the broken group'. A newcomer whose
    first step comes more than STUCK_S after the decision (its trainer built beside busy ranks) is
    no reason for a restart (CI: every rank rejoined generation 2, no first_step within 10 s, and
    the supervisor restarted every worker)."""
    live, _metrics, _told = _shrinking(floor=2, spares=1)
    live.pool.spares[0].returncode = 137  # the standing spare died: none left
    survivors = [FakeProc(pid=10 + r, rank=r) for r in (0, 1, 3)]
    live.observe(record({"type": "live", "rank": 0, "event": "lost_peer", "generation": 1, "step": 5}))
    assert live.recover(FakeProc(pid=12, rank=2), _cause(2), survivors, now=100.0)[0]
    for r in (0, 1, 3):
        live.observe(record({"type": "live", "rank": r, "event": "lost_peer", "generation": 1, "step": 5}))
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": 1, "step": 5, "source": 0,
                             "role": "source" if r == 0 else "survivor", "seconds": 0.3, "replicas": 3}))
    live.observe(record({"type": "step", "rank": 0, "step": 5}))
    assert live.recoveries[0].outcome == "recovered"
    live.pool.said_warm(901)
    assert live.regrow_candidate() == 2
    live.regrow(DeviceSlot(2, "cpu", 2), Path("/dev/null"), survivors, now=130.0)
    rec = live.in_flight
    assert rec.action == "regrow"
    for r in (0, 1, 3):  # the survivors rejoin generation 2 at once; the newcomer takes its time
        live.observe(record({"type": "live", "rank": r, "event": "rejoined", "generation": 2, "step": 9, "source": 0,
                             "role": "source" if r == 0 else "survivor", "seconds": 0.2, "replicas": 4}))
    assert live.stuck(145.0, step_allowance=2.0) is None  # 15 s after the decision: slow, not stuck
    live.observe(record({"type": "live", "rank": 2, "event": "rejoined", "generation": 2, "step": 9, "source": 0,
                         "role": "newcomer", "seconds": 0.4, "replicas": 4}))
    live.observe(record({"type": "live", "rank": 2, "event": "first_step", "generation": 2, "step": 10}))
    assert rec.outcome == "recovered" and live.in_flight is None

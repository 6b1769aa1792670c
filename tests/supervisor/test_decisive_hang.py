"""A hang beyond doubt is ended in seconds, without waiting for any allowance: a rank stopped
by a signal (state T) while another runs, or a wedged one (liveness thread silent, CPU idle,
outside a save) that every other rank waits for in a collective. The slow-but-alive cases
(a GC pause, a long eval, a slow save, a slow first step, a compile, a stop-and-continue,
the whole job paused) never look like that."""

from __future__ import annotations

import subprocess
import time

import orjson
import psutil
import pytest

from gpuherd.status_records import Alive, from_object as rec
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts
from supervisor.health.evidence import DECISIVE_SILENT_S, DECISIVE_STOP_S, RankSnapshot, decisive
from supervisor.health.proc_state import ProcState
from tests.supervisor import helpers as sh

POLICY = HangPolicy(step_default=300, startup=900, factor=5, floor=10)
BUSY, IDLE = ProcState("R", 0.0, 0.6), ProcState("S", 0.0, 0.0)


def stopped(since: float) -> ProcState:
    return ProcState("T", since, 0.0)


def live(step: int, where: str, collective: bool = False, phase: str = "step") -> Alive:
    return Alive(phase=phase, step=step, for_s=1.0, where=where, where_s=1.0, collective=collective)


def snap(rank: int, proc: ProcState | None, live: Alive | None = None, age: float = 0.5) -> RankSnapshot:
    return RankSnapshot(rank, 7, silent_s=age, live=live, live_age_s=age if live else None, live_latest=True,
                        proc=proc)


WAITING = live(7, "all_reduce (gradients)", collective=True)


def test_a_rank_stopped_for_three_seconds_while_another_runs_is_hung():
    hung, why = decisive([snap(0, IDLE), snap(1, stopped(10.0))], now=10.0 + DECISIVE_STOP_S, floor=0.0)
    assert hung == [1] and "state T" in why
    # a script without liveness records: the kernel alone decides it the same way
    assert decisive([snap(0, BUSY), snap(1, stopped(10.0))], now=13.5, floor=0.0)[0] == [1]


def test_a_stop_and_continue_the_whole_job_paused_or_the_supervisor_stopped_are_not_decisive():
    assert decisive([snap(0, IDLE), snap(1, stopped(10.0))], now=12.0, floor=0.0) == ([], "")  # 2 s: passing
    assert decisive([snap(0, stopped(1.0)), snap(1, stopped(1.0))], now=60.0, floor=0.0) == ([], "")  # Ctrl-Z
    # the whole job stopped, its ranks first seen in T in two /proc reads: the later one is not running
    assert decisive([snap(0, stopped(10.0)), snap(1, stopped(10.4))], now=13.1, floor=0.0) == ([], "")
    # the supervisor itself was stopped until 58 s: the state counts from then
    assert decisive([snap(0, IDLE), snap(1, stopped(1.0))], now=60.0, floor=58.0) == ([], "")


def test_peers_waiting_in_a_collective_for_a_stopped_rank_never_shorten_the_stop_rule():
    """Issue 49 asked for a stopped rank decided sooner when its peers wait for it in a collective.
    That is what every stop-and-continue of a training rank looks like (its peers block in the
    next all-reduce within a step), and the docs promise to ride out a stop-and-continue under
    DECISIVE_STOP_S (the goodput benchmark's fault schedule has one of 2 s): the peers' wait says
    nothing of how long the stop lasts, so the rule keeps its 3 s."""
    peers = [snap(rank, IDLE, WAITING) for rank in (0, 2, 3)]  # their liveness threads report: waiting for it
    almost = DECISIVE_STOP_S - 0.1
    assert decisive([*peers, snap(1, stopped(10.0), live(7, "forward/backward"), age=almost)],
                    now=10.0 + almost, floor=0.0) == ([], "")
    hung, why = decisive([*peers, snap(1, stopped(10.0), live(7, "forward/backward"), age=DECISIVE_STOP_S)],
                         now=10.0 + DECISIVE_STOP_S, floor=0.0)
    assert hung == [1] and "state T" in why


def test_a_wedged_rank_that_the_others_wait_for_is_hung():
    wedged = snap(1, IDLE, live(7, "forward/backward"), age=3.5)
    hung, why = decisive([snap(0, IDLE, WAITING), wedged], now=100.0, floor=0.0)
    assert hung == [1] and "liveness thread silent" in why


def test_slow_but_alive_ranks_are_never_decisive():
    others = [snap(0, IDLE, WAITING)]
    gc_pause = snap(1, BUSY, live(7, "forward/backward"), age=4.0)  # the GIL held, the CPU busy
    saving = snap(1, IDLE, live(7, "torch.save", phase="checkpoint"), age=4.0)  # a slow save on a slow disk
    first_step = snap(1, IDLE, live(0, "init", phase="init"), age=4.0)
    evaluating = snap(1, BUSY, live(7, "eval", phase="eval"), age=0.5)  # its thread reports
    for rank1 in (gc_pause, saving, first_step, evaluating):
        assert decisive([*others, rank1], now=100.0, floor=0.0) == ([], "")
    # not everyone waits for it: rank 0 computes too (a long eval on both)
    assert decisive([snap(0, BUSY, live(7, "eval", phase="eval")),
                     snap(1, IDLE, live(7, "forward/backward"), age=4.0)], now=100.0, floor=0.0) == ([], "")


def test_a_rank_blocked_right_after_announcing_a_save_or_a_compile_is_not_decisive():
    """Its liveness thread's last record still says `step` (the loop took the GIL before the
    thread could report the new phase); the loop's own `phase` record is the newer word."""
    for phase in ("checkpoint", "compile"):
        blocked = RankSnapshot(1, 7, silent_s=4.0, live=live(7, "forward/backward"), live_age_s=4.0,
                               live_latest=False, proc=IDLE, announced=phase)
        assert decisive([snap(0, IDLE, WAITING), blocked], now=100.0, floor=0.0) == ([], "")
    wedged = RankSnapshot(1, 7, silent_s=4.0, live=live(7, "forward/backward"), live_age_s=4.0, live_latest=True,
                          proc=IDLE, announced="train")
    assert decisive([snap(0, IDLE, WAITING), wedged], now=100.0, floor=0.0)[0] == [1]


def test_the_monitor_names_a_stopped_rank_long_before_any_allowance():
    hb = Heartbeats([0, 1], 0.0, LearnedTimeouts(POLICY), rendezvous=600, expect_heartbeats=False)
    for rank in (0, 1):
        hb.record(rank, rec({"type": "step", "rank": rank, "step": 7}), 1.0)
    hb.procs.state = {0: IDLE, 1: stopped(2.0)}.get
    assert hb.check(4.0, {0, 1}) is None
    verdict = hb.check(5.0, {0, 1})
    assert verdict is not None and verdict.rank == 1
    assert "decided without waiting for an allowance: stopped by a signal (state T)" in verdict.message


def test_a_sigstopped_rank_of_a_script_run_is_named_within_5_s_with_default_settings(tmp_path):
    cmd = [*sh.command("--nproc", "2", script=None), "--script", str(sh.REPO_ROOT / "bench" / "goodput_worker.py"),
           str(tmp_path), "100000", "0.05"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = tmp_path / "steps.log"
    code, err, stopped_at = sh.stop_when(
        proc, lambda: steps.exists() and len(steps.read_text().splitlines()) > 30,
        lambda: next(p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "goodput_worker.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"))
    assert code == 124, err[-3000:]
    run_dir = sh.run_dir_of(tmp_path)
    cause = orjson.loads((run_dir / "summary.json").read_bytes())["root_cause"]
    assert cause["rank"] == 1 and "stopped by a signal (state T)" in cause["message"], cause["message"]
    ends = [r for r in map(orjson.loads, (run_dir / "metrics.jsonl").read_bytes().splitlines())
            if r.get("event") == "attempt_end"]
    assert ends[-1]["failed_at"] - stopped_at <= 5.0  # the verdict, not the teardown after it


@pytest.mark.slow
def test_slow_but_alive_stretches_of_a_real_rank_never_end_the_run_with_default_settings(tmp_path):
    """Rank 1 of a real run, with gpuherd's liveness thread, goes through a slow first step and a
    GC pause (the GIL held computing: its thread silent, the CPU busy), a compile and a slow save
    (a C call holding the GIL waits: the thread silent, the CPU idle, the phase announced just
    before) and a long eval (the GIL released: the thread reports, the CPU idle), each past the
    decisive rules' 3 s, while rank 0 waits for it in a collective. None is a hang."""
    seconds = DECISIVE_SILENT_S + 1.0
    r = sh.run(tmp_path, "slow-alive:0", f"slow-alive:{seconds:g}", timeout=120)
    assert r.code == 0, r.err[-3000:]
    assert "hang" not in r.err.lower(), r.err[-3000:]
    records = [orjson.loads(line) for line in (r.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    alive = sorted(x["time"] for x in records if x.get("type") == "alive" and x.get("rank") == 1)
    frozen = sum(g for g in (b - a for a, b in zip(alive, alive[1:])) if g > 2.0)  # alive records come every 1 s
    # the four GIL-held stretches froze the liveness thread (the evidence a wedged rank gives); the eval did not
    assert 4 * seconds - 1.0 <= frozen < 5 * seconds - 1.0, frozen

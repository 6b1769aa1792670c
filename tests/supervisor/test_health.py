"""The supervisor's judgement, unit by unit: which rank to blame and why, learned
timeouts and their file, straggler windows, collective-trace analysis, the kernel's
view of a process, the restart backoff, and the warm store helper."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta

import orjson
import pytest

from gpuherd.status_records import Alive, from_object as rec
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts, Stragglers, previous_learned, traces
from supervisor.health.evidence import RankSnapshot, blame, judge
from supervisor.health.proc_state import ProcReader, ProcState, ProcTracker
from supervisor.health.timeouts import FILE_NAME, read_learned
from supervisor.processes import die_with_parent, python_env
from supervisor.rendezvous import HostedStore, StoreServer
from supervisor.restarts import MAX_BACKOFF_S, backoff
from tests.supervisor.helpers import wait_for

POLICY = HangPolicy(step_default=60, startup=300, factor=5, floor=10)


def _alive(step, where, collective=False, **extra):
    return rec({"type": "alive", "phase": "step", "step": step, "for_s": 0.1, "where": where, "where_s": 0.1,
                "collective": collective, **extra})


# ---------------------------------------------------------------------------- evidence


def _view(rank, step=40, live=None, proc=None, age=0.5):
    return RankSnapshot(rank, step, silent_s=age, live=live, live_age_s=age if live else None, live_latest=True,
                    proc=proc)


def test_a_stopped_rank_is_blamed_not_the_one_waiting_for_it():
    found = [judge(_view(0, 41, _alive(41, "all_reduce (gradients)", True), ProcState("S", 0.0, 0.0)), 12.0),
             judge(_view(1, 40, _alive(40, "forward/backward"), ProcState("T", 1.0, 0.0), age=11), 12.0)]
    ranks, why = blame(found, {0: 10.0, 1: 11.0})
    assert ranks == [1] and "kernel" in why
    assert "process stopped (state T) for 11 s" in found[1].line and "last seen at step 40" in found[1].line
    assert found[0].line.startswith("rank 0: waiting in all_reduce (gradients) at step 41")


def test_a_rank_outside_the_collective_is_blamed_when_the_others_wait_in_it():
    found = [judge(_view(0, 40, _alive(40, "all_reduce", True)), 20.0),
             judge(_view(1, 40, _alive(40, "data loading")), 20.0),
             judge(_view(2, 40, _alive(40, "all_reduce", True)), 20.0)]
    assert blame(found, {0: 12.0, 1: 12.0, 2: 12.0}) == ([1], "not in the collective the others wait in")
    assert "in data loading at step 40" in found[1].line and "not in a collective" in found[1].line


def test_a_silent_liveness_thread_is_a_wedged_process():
    found = [judge(_view(0, 40, _alive(40, "all_reduce", True)), 20.0),
             judge(_view(1, 40, _alive(40, "forward/backward"), ProcState("R", 0.0, 1.0), age=9), 20.0)]
    ranks, why = blame(found, {0: 12.0, 1: 12.0})
    assert ranks == [1] and "liveness" in why and "CPU busy (100% of a core)" in found[1].line


def test_without_liveness_the_rank_furthest_behind_is_blamed():
    found = [judge(_view(0, 300), 20.0), judge(_view(1, 2, age=15), 20.0)]
    ranks, _ = blame(found, {1: 15.0})
    assert ranks == [1] and found[1].line.startswith("rank 1 sent no heartbeat for 15 s")


def test_everyone_in_the_same_collective_is_said_not_to_single_anyone_out():
    found = [judge(_view(r, 40, _alive(40, "all_reduce", True)), 20.0) for r in range(3)]
    ranks, why = blame(found, {0: 11.0, 1: 12.0, 2: 11.5})
    assert ranks == [1] and "no rank stands out" in why


def test_the_verdict_lists_the_blamed_rank_first_and_explains_the_allowance():
    hb = Heartbeats([0, 1], now=0.0, timeouts=LearnedTimeouts(POLICY), rendezvous=60, expect_heartbeats=True)
    for t in range(1, 8):  # warm-up: steps of ~0.1 s
        for r in (0, 1):
            hb.record(r, _alive(t, "compute", took={"step": [1, 0.1]}), float(t))
    hb.record(0, _alive(8, "all_reduce", True), 8.0)
    hb.record(1, _alive(8, "data loading"), 8.0)
    for t in (9.0, 12.0, 15.0, 17.5):  # both stuck since 7.9 s; the allowance is 10 s
        hb.record(0, replace(_alive(8, "all_reduce", True), for_s=t - 7.9, where_s=t - 7.9), t)
        hb.record(1, replace(_alive(8, "data loading"), for_s=t - 7.9, where_s=t - 7.9), t)
        assert hb.check(t, {0, 1}) is None
    v = hb.check(18.0, {0, 1})
    assert v.kind == "hang" and v.rank == 1
    assert v.evidence[0] == "rank 1: in data loading at step 8 for 10 s, not in a collective"
    assert v.evidence[1] == "rank 0: waiting in all_reduce at step 8 for 10 s"
    assert "step allowance 10 s (learned: max(10 s, 5 x p99 0.10 s))" in v.message


def test_malformed_liveness_records_from_a_script_are_shrugged_off():
    hb = Heartbeats([0], now=0.0, timeouts=LearnedTimeouts(POLICY), rendezvous=60, expect_heartbeats=True,
                    stragglers=Stragglers(1.3, 1, write=lambda rec: None))
    for junk in ({"type": "alive", "took": {"step": 5}, "for_s": "soon", "steps": "many"},
                 {"type": "alive", "took": [1, 2], "step": "7", "where_s": None, "compute_s": 1.0, "steps": 3},
                 {"type": "alive", "took": {"step": ["a", 1.0]}, "collective": "yes"}):
        hb.record(0, rec(junk), 1.0)
        hb.record(0, rec({"type": "step", "step": "eight"}), 1.5)
        assert hb.check(2.0, {0}) is None
    assert hb.ranks[0].live.collective is False and hb.ranks[0].live.step is None
    assert set(hb.ranks[0].live.refused) == {"took", "collective"}  # each dropped field is named


# ---------------------------------------------------------------------------- learned timeouts


def test_allowance_is_initial_until_warm_up_then_factor_times_p99_with_a_floor():
    t = LearnedTimeouts(POLICY)
    assert t.allowance("step") == 60 and t.allowance("eval") == 300 and t.allowance("startup") == 300
    for _ in range(4):
        t.observe("step", 4.0)
    assert t.allowance("step") == 60  # 4 of 5 warm-up steps
    t.observe("step", 4.0)
    assert t.allowance("step") == 20.0  # 5 x 4 s
    t.observe("checkpoint", 1.0)
    assert t.allowance("checkpoint") == 10.0  # the floor
    assert LearnedTimeouts(HangPolicy(60, 300, 5, 10, override=7)).allowance("step") == 7


def test_learned_timeouts_are_saved_and_found_again_only_for_the_same_settings(tmp_path):
    t = LearnedTimeouts(POLICY, fingerprint="abc-train-2")
    t.observe("step", 3.0, count=10)
    (tmp_path / "run1").mkdir()
    t.save(tmp_path / "run1")
    doc = orjson.loads((tmp_path / "run1" / FILE_NAME).read_bytes())
    assert doc["phases"]["step"] == {"timeout_s": 15.0, "p99_s": 3.0, "observed": 10} and doc["factor"] == 5
    assert read_learned(tmp_path / "run1" / FILE_NAME, "abc-train-2") == {"step": 15.0}
    assert previous_learned(tmp_path, "other-settings", exclude=tmp_path / "run2") is None
    assert previous_learned(tmp_path, "abc-train-2", exclude=tmp_path / "run1") is None  # not our own run
    resumed = LearnedTimeouts(POLICY, previous_learned(tmp_path, "abc-train-2", exclude=tmp_path / "run2"))
    assert resumed.allowance("step") == 15.0 and "learned earlier" in resumed.explain("step")


# ---------------------------------------------------------------------------- stragglers


def test_a_rank_slower_for_enough_windows_is_warned_about_once_with_the_reason():
    written, warned = [], []
    s = Stragglers(factor=1.3, windows=2, write=written.append, window_s=5.0, warn=warned.append)
    s.sample({"type": "host", "rank": 0, "cpu_percent": 99.0})
    s.sample({"type": "host", "rank": 1, "cpu_percent": 40.0})
    for second in range(1, 31):
        s.add(0, Alive(steps=10, compute_s=0.5), float(second))
        s.add(1, Alive(steps=10, compute_s=1.0 if second > 10 else 0.5), float(second))
        s.tick(float(second))
    assert len(warned) == 1 and "rank 1 computes 2.00x slower" in warned[0] and "less CPU" in warned[0]
    assert written == s.found and written[0]["rank"] == 1 and written[0]["slowdown"] == 2.0


def test_gpu_samples_name_thermal_slowdown_and_a_recovered_rank_is_reported_again():
    warned = []
    s = Stragglers(factor=1.3, windows=1, write=lambda rec: None, window_s=1.0, warn=warned.append)
    s.sample({"type": "gpu", "rank": 2, "clock_events": ["sw_thermal"], "temp": 91, "temp_slowdown": 90})
    for second, slow in enumerate([2.0, 2.0, 1.0, 2.0], start=1):
        for r in range(3):
            s.add(r, Alive(steps=5, compute_s=slow if r == 2 else 1.0), float(second))
        s.tick(float(second) + 1.0)
    assert len(warned) == 2 and all("thermal slowdown (91 C" in w for w in warned)


def test_a_scripts_step_records_with_its_compute_per_step_name_its_straggler():
    """A script recovered live through gpuherd.live sends no `alive` records: its session's `step`
    records carry its compute per step (gpuherd/live/pace.py), which the check reads alike."""
    warned = []
    s = Stragglers(factor=1.3, windows=2, write=lambda rec: None, window_s=5.0, warn=warned.append)
    hb = Heartbeats([0, 1, 2], now=0.0, timeouts=LearnedTimeouts(POLICY), rendezvous=60, expect_heartbeats=False,
                    stragglers=s)
    for second in range(1, 21):
        for r in range(3):
            hb.record(r, rec({"type": "step", "step": 4 * second, "steps": 4,
                              "compute_s": 0.4 if r == 2 and second > 5 else 0.1, "wait_s": 0.05}), float(second))
        hb.record(0, rec({"type": "step", "step": 4 * second}), float(second))  # a plain one (no timings): nothing
        s.tick(float(second))
    assert len(warned) == 1 and "rank 2 computes 4.00x slower" in warned[0]
    assert hb.ranks[2].step == 80  # a step record all the same


# ---------------------------------------------------------------------------- collective traces


def _dump(tmp_path, rank, entered, completed):
    doc = {"rank": rank, "pg_status": {"0": {"last_enqueued_collective": entered,
                                             "last_completed_collective": completed}},
           "last": {"0": [{"seq": s, "op": "nccl:all_reduce", "group": ["0", "default_pg"]}
                          for s in range(max(1, entered - 2), entered + 1)]}}
    (tmp_path / f"rank{rank}.json").write_bytes(orjson.dumps(doc))


def test_trace_analysis_names_who_never_joined_and_who_waits(tmp_path):
    _dump(tmp_path, 0, 81, 80)
    _dump(tmp_path, 1, 80, 80)
    assert traces.answered(tmp_path, {0, 1, 2}) == {0, 1}
    lines = traces.analyse(tmp_path, [0, 1, 2])
    assert lines == [
        "collective trace: rank 0: inside nccl:all_reduce #81 of default_pg, not completed",
        "collective trace: rank 1: never joined nccl:all_reduce #81 of default_pg (last entered #80 nccl:all_reduce)",
        "collective trace: rank 2: no trace (it could not answer: stopped, wedged or gone)",
    ]
    assert traces.analyse(tmp_path / "none", [0]) == [traces.NO_RECORDER]


# ---------------------------------------------------------------------------- the kernel's view


def test_proc_watch_sees_a_stopped_process_and_idle_cpu():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reader, watch = ProcReader(), ProcTracker()
        reader.watch(0, child.pid)
        watch.add(reader.read(), 1.0)
        child.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: (watch.add(reader.read(), 2.0), watch.state(0).letter)[1] == "T", timeout=10)
        watch.add(reader.read(), 5.0)
        state = watch.state(0)
        assert state.hard and state.frozen and state.since == 2.0
        assert state.describe(14.0) == "process stopped (state T) for 12 s"
    finally:
        child.kill()
        child.wait()
    watch.add(reader.read(), 20.0)
    assert watch.state(0).letter in ("Z", "X")


# ---------------------------------------------------------------------------- restarts


def test_backoff_doubles_for_quick_failures_in_a_row_up_to_a_cap():
    assert [backoff(1.0, n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(1.0, 30) == MAX_BACKOFF_S and backoff(0.0, 5) == 0.0


def test_one_warm_store_helper_serves_each_attempt_a_fresh_store():
    torch_dist = pytest.importorskip("torch.distributed")
    server = StoreServer(sys.executable, python_env(), die_with_parent())
    try:
        pids = set()
        for attempt in range(2):
            store = HostedStore(timeout_s=30)
            pids.add(server.serve(store).pid)
            client = torch_dist.TCPStore(store.addr, store.port, None, False, timedelta(seconds=60))
            assert not client.check(["key"])  # nothing left from the previous attempt
            client.set("key", str(attempt))
            assert client.get("key") == str(attempt).encode()
            del client
            store.stop()
            server.drop()
        assert len(pids) == 1 and server.proc.poll() is None  # the same process, still up
    finally:
        server.close()


def test_the_supervisor_writes_a_key_the_workers_read_through_the_store_helper():
    """The supervisor stays torch-free: a live recovery's decision reaches the workers' store
    through the helper that serves it."""
    torch_dist = pytest.importorskip("torch.distributed")
    server = StoreServer(sys.executable, python_env(), die_with_parent())
    assert not server.set("gpuherd-live/1/decision", "{}")  # no helper yet: nothing to write through
    try:
        store = HostedStore(timeout_s=30)
        server.serve(store)
        client = torch_dist.TCPStore(store.addr, store.port, None, False, timedelta(seconds=60))
        assert server.set("gpuherd-live/1/decision", '{"shrink": 2, "ranks": [0, 1, 3]}')
        assert client.get("gpuherd-live/1/decision") == b'{"shrink": 2, "ranks": [0, 1, 3]}'  # waits until set
        assert server.proc.poll() is None  # a write does not replace the store being served
        del client
        store.stop()
    finally:
        server.close()


def test_a_background_write_stays_in_flight_until_it_is_published_or_fails_whatever_is_accounted_meanwhile():
    """A save's `accounted` record (its cost to the loop) may come while its write still runs, at
    the next save's start: the teardown must still wait for that write."""
    hb = Heartbeats([0, 1], now=0.0, timeouts=LearnedTimeouts(POLICY), rendezvous=60, expect_heartbeats=True)
    path = "/ckpt/step_0000006.pt"
    hb.record(0, rec({"type": "checkpoint_write", "rank": 0, "state": "started", "step": 6, "path": path}), 1.0)
    hb.record(0, rec({"type": "checkpoint_write", "rank": 0, "state": "accounted", "step": 6, "cost_s": 0.1,
                      "steps": 3}), 2.0)
    assert hb.ranks[0].writing == path
    hb.record(0, rec({"type": "checkpoint", "rank": 0, "step": 6, "path": path}), 3.0)
    assert hb.ranks[0].writing is None
    hb.record(0, rec({"type": "checkpoint_write", "rank": 0, "state": "started", "step": 9, "path": path}), 4.0)
    hb.record(0, rec({"type": "checkpoint_write", "rank": 0, "state": "failed", "step": 9, "path": path}), 5.0)
    assert hb.ranks[0].writing is None

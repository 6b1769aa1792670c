"""Elastic node counts (`--nnodes MIN:MAX`), torchrun's c10d semantics: the job starts once MIN
nodes joined (after a last call for more), fewer than MIN by the join timeout is exit 5 naming
who came, and a node arriving while a round runs waits, then joins at a restart that does not
count against --max-restarts, the world grown by its workers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from supervisor.rendezvous.elastic_rounds import ElasticRounds
from tests.supervisor import helpers as sh
from tests.supervisor.test_node_agent_data import DictStore

ELASTIC = Path(sh.REPO_ROOT) / "tests" / "supervisor" / "workers" / "elastic.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(cwd: Path, rank: int, port: int, nnodes: str, *script_args: str, args: tuple[str, ...] = ()):
    return sh.start(cwd, *script_args, script=ELASTIC, args=(
        "--nproc", "1", "--nnodes", nnodes, "--node-rank", str(rank), "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--run-id", "job", "--grace-period", "2", *args))


def _summary(cwd: Path, rank: int) -> dict:
    return orjson.loads((cwd / "logs" / f"job-node{rank}" / "summary.json").read_bytes())


# ------------------------------------------------------------------ the rounds, on a dict store
def _rounds(store: DictStore, node_rank: int, last_call: float = 0.0) -> ElasticRounds:
    return ElasticRounds(store, node_rank, min_nodes=2, max_nodes=3, join_timeout=1.0, last_call=last_call)


def test_node_0_closes_a_round_with_the_nodes_that_came_in_time():
    store = DictStore({"a0/node2": b"{}"})
    k, members = _rounds(store, 0).open_and_close(b"{}", aborted=lambda k: False)
    assert (k, members) == (0, [0, 2])  # MIN reached, the last call over: node 1 is not waited for
    assert orjson.loads(store.values["a0/members"]) == [0, 2] and store.values["round"] == b"0"


def test_too_few_nodes_is_no_round_and_names_who_came():
    store = DictStore({})
    rounds = _rounds(store, 0)
    assert rounds.open_and_close(b"{}", aborted=lambda k: False) == (0, None)
    cause = rounds.too_few(0, lambda r: "h0", "127.0.0.1:29500")
    assert cause["exit_code"] == 5 and cause["kind"] == "rendezvous"
    assert "only 1 of the 2..3 nodes (--nnodes 2:3) joined within 1 s" in cause["message"]
    assert "came: node 0 (h0); not: node 1, node 2" in cause["message"]


def test_a_node_finding_its_round_running_is_late_and_is_seen_waiting():
    store = DictStore({"round": b"0", "a0/members": b"[0, 1]"})
    late = _rounds(store, 2)
    assert late.target() == (1, True)
    store.values["a1/node2"] = b"{}"  # it waits for round 1
    node0 = _rounds(store, 0)
    node0.members = [0, 1]
    assert node0.waiting(0) == [2]
    assert _rounds(store, 1).target() == (0, False)  # a member of the running round is not late


def test_a_waiting_node_is_released_when_the_job_ends():
    store = DictStore({"round": b"0", "a0/members": b"[0, 1]", "closed": b"1"})
    k, members, why = _rounds(store, 2).admitted(1, b"{}", aborted=lambda k: False, on_late=lambda k, m: None)
    assert (k, members, why) == (1, None, "closed")


@pytest.mark.parametrize("nnodes, fragment", [("3:2", "expected 1 <= MIN <= MAX"), ("0:2", "expected 1 <= MIN <= MAX"),
                                              ("1:x", "a range like 1:4")])
def test_bad_ranges_are_usage_errors(tmp_path, nnodes, fragment):
    proc = subprocess.run([sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report",
                           "--nnodes", nnodes, "--master-addr", "127.0.0.1"],
                          cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr


def test_a_node_rank_up_to_max_is_accepted_and_beyond_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report",
                           "--nnodes", "1:3", "--node-rank", "3", "--master-addr", "127.0.0.1"],
                          cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--node-rank 3 is outside 0..2 (--nnodes 1:3)" in proc.stderr


# ------------------------------------------------------------------ real supervisors on localhost
def test_fewer_than_min_by_the_join_timeout_is_exit_5_naming_who_came(tmp_path):
    n0 = _node(tmp_path, 0, _port(), "2:3", "2", args=("--set", "system.rendezvous_timeout=3"))
    code, _, err = sh.finish(n0, timeout=120)
    assert code == 5, err[-2000:]
    assert "only 1 of the 2..3 nodes (--nnodes 2:3) joined within 3 s" in err
    assert "came: node 0 (" in err and "not: node 1, node 2" in err and "Traceback" not in err
    assert _summary(tmp_path, 0)["root_cause"]["kind"] == "rendezvous"


def test_min_starts_the_job_and_a_late_node_joins_at_the_next_restart(tmp_path):
    """Node 0 alone (MIN 1) starts; node 2 comes late (a gap at node rank 1), waits, and the
    restart that admits it is not one of --max-restarts 0: the world grows to 2 ranks."""
    port = _port()
    args = ("--set", "system.rendezvous_last_call=1")
    n0 = _node(tmp_path, 0, port, "1:3", "2", args=args)
    assert sh.wait_for(lambda: (tmp_path / "logs" / "job-node0" / "worker-rank0-CPU0.log").is_file()
                       and "rank 0/1" in (tmp_path / "logs" / "job-node0" / "worker-rank0-CPU0.log").read_text(),
                       timeout=180), "node 0 did not start alone"
    n2 = _node(tmp_path, 2, port, "1:3", "2", args=args)
    (code0, out0, err0), (code2, out2, err2) = sh.finish(n0, timeout=240), sh.finish(n2, timeout=240)
    assert code0 == 0, err0[-3000:]
    assert code2 == 0, err2[-3000:]
    assert "this node waits to join at its next restart" in err2
    assert "attempt 0 was restarted for a membership change: node 2 (" in err0 and "also on this node" not in err0
    assert "rank 0/2 sum=2 group 0/2 restart_count 0" in out0
    assert "rank 1/2 sum=2 group 1/2 restart_count 0" in out2  # GROUP_RANK: its place among the nodes admitted
    s0, s2 = _summary(tmp_path, 0), _summary(tmp_path, 2)
    assert s0["restarts"] == 0 and [a["outcome"] for a in s0["attempts"]] == ["membership", "success"]
    assert "node 2 (" in s0["attempts"][0]["root_cause"]["message"]
    assert s0["nnodes"] == s2["nnodes"] == 2 and [n["node"] for n in s2["nodes"]] == [0, 2]
    assert [n["first_rank"] for n in s2["nodes"]] == [0, 1] and s2["workers"][0]["rank"] == 1


def test_a_late_node_agent_says_which_round_runs_without_it_then_waits():
    from supervisor.rendezvous.node_agent_main import Agent

    store = DictStore({"round": b"0", "a0/members": b"[0]", "closed": b"1"})  # closed: the wait ends at once
    agent = Agent(store, node_rank=2, nnodes=3, join_timeout=1.0, where="127.0.0.1:29500", rounds=_rounds(store, 2))
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    agent.handle({"cmd": "join", "attempt": 0, "record": {"host": "h2", "nproc": 1}})
    assert events[0] == {"event": "waiting", "attempt": 0, "round": 0, "members": [0]}
    assert events[1]["event"] == "join-closed" and "a1/node2" in store.values  # it waited for round 1


def test_a_node_waiting_for_node_0_reports_node_0s_failure_before_any_round():
    from supervisor.rendezvous.node_agent_main import Agent

    cause = {"kind": "dataset", "exit_code": 3, "node": 0, "host": "h0", "rank": None, "device": None,
             "stderr_tail": [], "message": "node 0 (h0): dataset: no such file"}
    store = DictStore({"a0/abort": orjson.dumps(cause)})
    agent = Agent(store, node_rank=1, nnodes=3, join_timeout=5.0, where="127.0.0.1:29500", rounds=_rounds(store, 1))
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    agent.handle({"cmd": "join", "attempt": 0, "record": {"host": "h1", "nproc": 1}})
    assert [e["event"] for e in events] == ["abort", "join-aborted"] and events[0]["cause"] == cause


def test_a_late_node_with_other_settings_is_refused_alone_and_the_job_runs_on(tmp_path):
    """Node 2 arrives late with another learning rate: node 0 does not restart its workers to admit
    it (the settings would differ only then, and both nodes would exit 2); node 2 alone exits 2."""
    port = _port()
    args = ("--set", "system.rendezvous_last_call=1")
    n0 = _node(tmp_path, 0, port, "1:3", "2", args=args)
    log0 = tmp_path / "logs" / "job-node0" / "worker-rank0-CPU0.log"
    try:
        assert sh.wait_for(lambda: log0.is_file() and "rank 0/1" in log0.read_text(), timeout=180), \
            "node 0 did not start alone"
        n2 = _node(tmp_path, 2, port, "1:3", "2", args=(*args, "--set", "training.learning_rate=1"))
        code2, _, err2 = sh.finish(n2, timeout=120)
        assert code2 == 2, err2[-3000:]
        assert "node 2 (" in err2 and "runs other model/training/data settings than node 0" in err2
        assert "it was not admitted, the job goes on without it" in err2
        assert n0.poll() is None  # the job still runs, never restarted
    finally:
        n0.send_signal(signal.SIGTERM)
        code0, _, err0 = sh.finish(n0, timeout=120)
    assert code0 == 143, err0[-3000:]
    assert [a["outcome"] for a in _summary(tmp_path, 0)["attempts"]] == ["terminated"], _summary(tmp_path, 0)

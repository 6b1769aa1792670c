"""`gpuherd spare RUN`: the request and its answer through the run directory, the judgment of a
request against what the supervision knows, the asked spare taking back its rank, and the
command's one line and exit code for each bad input (the real processes:
tests/e2e/test_shrink_run.py's regrow test, whose spare an operator asks for half of the time)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gpuherd.exit_codes import ExitCode
from supervisor.commands import spare as command
from supervisor.commands.dispatch import COMMANDS
from supervisor.processes.policy import Phase
from supervisor.processes.spare_requests import (
    Answer,
    Facts,
    SpareDesk,
    SpareRequest,
    device_name,
    judge,
    read_answer,
    request_path,
    write_request,
)
from supervisor.processes.stopping import StopRules
from supervisor.processes.supervision import Supervision
from tests.supervisor.test_live_recovery import _rebuilt, _shrinking, _shrunk_without_rank_2, FakeProc, _cause

CPUS = {r: (f"CPU{r}", "") for r in range(4)}


@pytest.mark.parametrize("text, name", [
    ("3", "GPU3"), ("GPU3", "GPU3"), ("gpu 3", "GPU3"), ("cuda:3", "GPU3"), ("CPU1", "CPU1"), ("cpu:1", "CPU1"),
    ("GPU-8f3e2a1c-0000", "GPU-8f3e2a1c-0000")])
def test_a_device_is_named_as_the_console_names_it(text, name):
    assert device_name(text) == name


@pytest.mark.parametrize("text", ["", "cuda", "GPU3x", "tpu:1", "-1", "GPU-zz"])
def test_a_device_that_is_no_device_name_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match="expected a device like GPU3"):
        device_name(text)


def _facts(**change) -> Facts:
    return Facts(**{"running": None, "off": None, "carried": {2: "CPU2"}, "devices": CPUS, "asked": {}, **change})


def test_a_shrunk_group_gets_a_spare_for_its_lost_rank_on_the_device_it_left():
    assert judge(SpareRequest("a"), _facts()) == 2
    assert judge(SpareRequest("a", "CPU2"), _facts()) == 2
    two = _facts(carried={1: "CPU1", 3: "CPU3"})
    assert judge(SpareRequest("a"), two) == 1  # the lowest first
    assert judge(SpareRequest("a", "CPU3"), two) == 3  # the operator picks which comes back first
    assert judge(SpareRequest("a"), _facts(carried={1: "GPU1", 3: "GPU3"}, asked={1: 77})) == 3
    gpus = {0: ("GPU4", "GPU-aaaa"), 1: ("GPU5", "GPU-bbbb")}
    assert judge(SpareRequest("a", "GPU-bbbb"), _facts(carried={1: "GPU5"}, devices=gpus)) == 1  # by UUID


@pytest.mark.parametrize("facts, code, words", [
    (_facts(off="a --script run"), ExitCode.REFUSED, "cannot shrink or grow back: a --script run"),
    (_facts(running="stopping"), ExitCode.REFUSED, "the run is stopping: no spare started"),
    (_facts(finished=True), ExitCode.REFUSED, "training has finished"),
    (_facts(carried={}), ExitCode.REFUSED, "not shrunk: all 4 ranks train, nothing to grow back"),
    (_facts(carried={}, elsewhere={7: 1}), ExitCode.REFUSED,
     "the ranks lost are another node's (node 1's rank 7): ask that node's supervisor"),
    (_facts(carried={}, dead_nodes=(2,)), ExitCode.REFUSED,
     "the ranks lost are node 2's, which died whole: they come back with the job's next restart"),
    (_facts(asked={2: 901}), ExitCode.REFUSED, "already starting for every carried rank (pid 901 for rank 2)"),
    (_facts(standing=(905,)), ExitCode.REFUSED, "already starting for every carried rank (the pool's pid 905)"),
])
def test_a_request_the_runs_state_cannot_take_is_refused_with_why(facts, code, words):
    answer = judge(SpareRequest("a"), facts)
    assert isinstance(answer, Answer) and answer.code == code and words in answer.message


@pytest.mark.parametrize("device, code, words", [
    ("GPU2", ExitCode.USAGE, "--device GPU2 is not one of this run's devices here (CPU0, CPU1, CPU2, CPU3)"),
    ("CPU7", ExitCode.USAGE, "a spare takes back a lost rank on the device it left: CPU2 (rank 2)"),
    ("CPU1", ExitCode.USAGE, "--device CPU1 is rank 1's, which is training"),
])
def test_a_device_the_run_did_not_lose_is_refused_naming_the_ones_it_did(device, code, words):
    answer = judge(SpareRequest("a", device), _facts())
    assert isinstance(answer, Answer) and answer.code == code and words in answer.message


def test_a_device_whose_rank_has_a_spare_coming_is_refused():
    answer = judge(SpareRequest("a", "CPU2"), _facts(carried={2: "CPU2", 3: "CPU3"}, standing=(905,)))
    assert answer.code == ExitCode.REFUSED and "already starting for rank 2 on CPU2" in answer.message


def test_with_no_spares_the_asked_spare_takes_back_the_rank_it_was_asked_for():
    live, _metrics, told = _shrunk_without_rank_2(spares=0)
    live.recover(FakeProc(pid=13, rank=3), _cause(3), [FakeProc(pid=10 + r, rank=r) for r in (0, 1)], now=110.0)
    _rebuilt(live, 2, (0, 1))
    assert live.pool.spares == [] and live.regrow_candidate() is None  # --spares 0: nothing grows it back alone
    spare = live.ask_spare(3)
    assert live.pool.spares == [spare] and live.regrow_candidate() is None  # warming up
    live.pool.said_warm(spare.pid)
    assert live.regrow_candidate() == 3  # not the lowest carried rank: the one it was asked for
    live.regrow(FakeProc(pid=0, rank=3).slot, os.devnull, [], now=130.0)
    assert told[-1] == ("gpuherd-live/3/decision", {"regrow": 3, "ranks": [0, 1, 3]})
    assert live.pool.count == 0 and live.pool.spares == []  # no refill: --spares 0 stays 0


def test_the_supervision_loop_answers_each_request_and_starts_the_spare_it_grants(tmp_path):
    live, _metrics, _told = _shrunk_without_rank_2(spares=0)
    heartbeats = SimpleNamespace(ranks={}, longest_step=lambda: None)
    metrics = SimpleNamespace(write_lines=lambda data: None, write=lambda record: None)
    sup = Supervision([FakeProc(pid=10 + r, rank=r) for r in range(4)], SimpleNamespace(logs={}), heartbeats,
                      metrics, StopRules.for_script(2.0, 10.0), finish_window=60.0, live=live,
                      requests=SpareDesk(tmp_path), clock=lambda: 100.0)

    def asked(device: str | None = None) -> Answer:
        request = write_request(tmp_path, device)
        sup._answer_requests()
        return read_answer(tmp_path, request.id)
    try:
        assert asked("CPU1").code == ExitCode.USAGE  # rank 1 trains
        assert asked() == Answer(0, "warm spare pid 900 started for rank 2 on CPU2: the group grows back to it at a "
                                    "step boundary once it is warm", 2, "CPU2", 900)
        assert live.asked == {900: 2} and [s.pid for s in live.pool.spares] == [900]
        assert "already starting for every carried rank (pid 900 for rank 2)" in asked().message
        sup.state = replace(sup.state, phase=Phase.STOPPING)
        assert asked().message == "the run is stopping: no spare started" and len(live.pool.spares) == 1
    finally:
        sup.restore_signal_handlers()


def test_a_request_travels_through_the_run_directory_and_its_answer_back(tmp_path):
    stale = write_request(tmp_path, None)  # from a start of the run that ended: never acted on
    desk = SpareDesk(tmp_path)
    assert not request_path(tmp_path, stale.id).exists() and desk.take() == []
    request = write_request(tmp_path, "CPU2")
    (taken,) = desk.take()
    assert taken.id == request.id and taken.device == "CPU2" and not request_path(tmp_path, request.id).exists()
    assert read_answer(tmp_path, request.id) is None  # not answered yet
    desk.answer(request.id, Answer(ExitCode.OK, "started", rank=2, device="CPU2", pid=901))
    assert read_answer(tmp_path, request.id) == Answer(0, "started", 2, "CPU2", 901)
    assert read_answer(tmp_path, request.id) is None and desk.take() == []  # each read once
    assert [p.name for p in (tmp_path / "requests").iterdir()] == []


def test_an_unreadable_request_is_answered_as_such(tmp_path):
    desk = SpareDesk(tmp_path)
    (tmp_path / "requests").mkdir()
    request_path(tmp_path, "0123456789abcdef").write_bytes(b'{"format": 1, "id": "0123456789abcdef", "device": 5}')
    assert desk.take() == []
    answer = read_answer(tmp_path, "0123456789abcdef")
    assert answer.code == ExitCode.USAGE and "device is not a string" in answer.message


# ------------------------------------------------------------------ the command


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "logs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_bytes(b"{}")
    return run


@pytest.fixture
def running(run_dir):
    """The run's supervisor holds run.lock, as `supervisor/run_dir.py: hold` does."""
    fd = os.open(run_dir / "run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield run_dir
    os.close(fd)


def _supervisor_answers(run_dir, answer: Answer) -> threading.Thread:
    """A stand-in for the supervision loop: takes the request, checks it, answers."""
    desk = SpareDesk(run_dir)

    def serve() -> None:
        for _ in range(200):
            for request in desk.take():
                assert request.device in (None, "GPU3")
                desk.answer(request.id, answer)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = command.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_prints_the_supervisors_answer_and_exits_0(running, capsys):
    thread = _supervisor_answers(running, Answer(ExitCode.OK, "warm spare pid 901 started for rank 3 on GPU3", 3,
                                                 "GPU3", 901))
    code, out, err = _run([str(running), "--device", "cuda:3"], capsys)
    thread.join()
    assert (code, out, err) == (0, "gpuherd spare: warm spare pid 901 started for rank 3 on GPU3\n", "")
    assert "spare" in COMMANDS


def test_a_refusal_is_one_line_with_its_code(running, capsys):
    thread = _supervisor_answers(running, Answer(ExitCode.REFUSED, "the group is not shrunk: all 4 ranks train"))
    code, out, err = _run([str(running)], capsys)
    thread.join()
    assert code == 10 and out == "" and err == "gpuherd spare: error: the group is not shrunk: all 4 ranks train\n"


@pytest.mark.parametrize("argv, code, words", [
    (["nope"], 2, "run 'nope' not found"),
    (["{run}", "--device", "TPU1"], 2, "--device 'TPU1': expected a device like GPU3"),
    (["{run}", "--timeout", "0"], 2, "--timeout 0: must be > 0 seconds"),
    (["{run}"], 10, "run r1 is not running (no run.lock: no supervisor ever held it): no spare started"),
])
def test_bad_input_is_one_line_and_a_documented_code(run_dir, capsys, argv, code, words, monkeypatch):
    monkeypatch.chdir(run_dir.parent.parent)
    got, out, err = _run([a.format(run=run_dir) for a in argv], capsys)
    assert got == code and out == "" and err.count("\n") == 1 and words in err, err
    assert not (run_dir / "requests").exists()  # nothing written before the request is valid


def test_a_run_whose_supervisor_ended_is_not_running(run_dir, capsys):
    (run_dir / "run.lock").write_text("pid 1 on host\n")  # left behind; nobody holds its lock
    code, _out, err = _run([str(run_dir)], capsys)
    assert code == 10 and "is not running (its supervisor has ended)" in err


def test_no_answer_in_time_withdraws_the_request(running, capsys):
    code, _out, err = _run([str(running), "--timeout", "0.3"], capsys)
    assert code == 1 and "no answer from the supervisor of run r1 within 0.3 s" in err
    assert list((running / "requests").iterdir()) == []  # a later start of the run never acts on it


def test_a_training_ranks_device_on_a_run_that_is_not_shrunk_is_a_wrong_request(running, capsys):
    """As found: `gpuherd spare RUN --device CPU1` while all 4 ranks of a --min-replicas run trained
    answered 10, "not shrunk", as if the run's state were what stood in the way; naming a training
    rank's device is a wrong request whatever the state: 2. The command, the run directory's request
    and answer files and the supervision loop's judgment, as in a run."""
    live, _metrics, _told = _shrinking(floor=2, spares=0)  # nothing lost yet: the group is whole
    heartbeats = SimpleNamespace(ranks={}, longest_step=lambda: None)
    metrics = SimpleNamespace(write_lines=lambda data: None, write=lambda record: None)
    sup = Supervision([FakeProc(pid=10 + r, rank=r) for r in range(4)], SimpleNamespace(logs={}), heartbeats,
                      metrics, StopRules.for_script(2.0, 10.0), finish_window=60.0, live=live,
                      requests=SpareDesk(running), clock=lambda: 100.0)
    done = threading.Event()

    def supervision_loop() -> None:
        while not done.is_set():
            sup._answer_requests()
            time.sleep(0.01)
    loop = threading.Thread(target=supervision_loop)
    loop.start()
    try:
        wrong = _run([str(running), "--device", "CPU1"], capsys)
        unneeded = _run([str(running)], capsys)
    finally:
        done.set()
        loop.join()
        sup.restore_signal_handlers()
    assert wrong == (2, "", "gpuherd spare: error: --device CPU1 is rank 1's, which is training: name a device a "
                            "lost rank left: no rank is lost here\n")
    assert unneeded == (10, "", "gpuherd spare: error: the group is not shrunk: all 4 ranks train, nothing to grow "
                                "back\n")

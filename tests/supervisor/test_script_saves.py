"""supervisor/torchrun/script_saves.py: the words about a script's saves say what gpuherd saw."""

from __future__ import annotations

from gpuherd.status_records import ScriptSave, Step
from supervisor.summary import AttemptReport, RootCause, Summary
from supervisor.torchrun import ScriptSaves
from supervisor.torchrun.script_saves import NONE_SEEN, UNWATCHED


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _saves(*events: tuple[float, object]) -> tuple[ScriptSaves, Clock]:
    clock = Clock()
    saves = ScriptSaves(clock)
    for at, record in events:
        clock.now = at
        saves.observe(record)
    return saves, clock


def test_the_newest_save_of_any_rank_is_named_with_its_path_step_and_distance_to_the_failure():
    saves, _ = _saves((10.0, ScriptSave(rank=0, step=30, path="/ck/a.pt", api="torch.save")),
                      (12.0, Step(rank=0, step=38)),
                      (12.5, ScriptSave(rank=0, step=40, path="/ck/b.pt", api="torch.save")),
                      (13.0, ScriptSave(rank=1, step=40, path=None, api="torch.save")),
                      (14.0, Step(rank=1, step=45)))
    assert saves.said(15.0) == ("the last save gpuherd saw: rank 1's torch.save to a buffer or unnamed file "
                                "(no path) after 40 optimizer step(s) of attempt 0, 2.0 s before the failure "
                                "(its last step reported: 45)")
    assert saves.record(15.0) == {"rank": 1, "step": 40, "path": None, "api": "torch.save", "attempt": 0,
                                  "before_s": 2.0, "last_step": 45}
    assert saves.last(12.9).path == "/ck/b.pt"  # what was seen before a moment


def test_a_framework_checkpoint_is_named_by_the_framework_at_its_own_step():
    saves, _ = _saves((3.0, ScriptSave(rank=0, step=40, path="/ck/last.ckpt", api="lightning")))
    assert saves.said(4.5) == ("the last save gpuherd saw: rank 0's Lightning checkpoint /ck/last.ckpt at step 40, "
                               "1.5 s before the failure")


def test_no_save_seen_is_said_as_such_and_a_script_run_without_the_bootstrap_is_not_watched_at_all():
    saves, _ = _saves((1.0, Step(rank=0, step=3)))
    assert saves.said(2.0) == NONE_SEEN and saves.record(2.0) == {}
    assert ScriptSaves(watched=False).said(2.0) == UNWATCHED  # --no-auto-heartbeat: nothing could be seen


def test_a_stop_says_whether_a_save_followed_the_signal():
    saves, _ = _saves((5.0, ScriptSave(rank=0, step=10, path="/ck/m.pt", api="torch.save")),
                      (6.0, Step(rank=0, step=14)))
    assert saves.after_signal(since=7.0) == (
        "no save followed the signal (the last save gpuherd saw: rank 0's torch.save to /ck/m.pt after 10 optimizer "
        "step(s) of attempt 0, 2.0 s before the signal (its last step reported: 14))")
    saves.clock.now = 7.5
    saves.observe(ScriptSave(rank=0, step=15, path="/ck/m.pt", api="torch.save"))
    assert saves.after_signal(since=7.0) == (
        "the script saved after the signal: rank 0's torch.save to /ck/m.pt after 15 optimizer step(s) of attempt 0")
    assert ScriptSaves().after_signal(since=1.0).startswith("no save followed the signal, and gpuherd "
                                                            "had seen no save by the script")


def test_an_attempt_that_saved_nothing_names_the_save_of_the_attempt_before():
    """The run's newest save stands across a restart, with the attempt it came in; the steps
    reported in a later attempt (the bootstrap counts from 0 again) are not compared with it."""
    saves, clock = _saves((5.0, ScriptSave(rank=0, step=10, path="/ck/m.pt", api="torch.save")))
    saves.begin(1)
    clock.now = 9.0
    saves.observe(Step(rank=0, step=3))
    assert saves.said(10.0) == ("the last save gpuherd saw: rank 0's torch.save to /ck/m.pt after 10 optimizer "
                                "step(s) of attempt 0, 5.0 s before the failure")
    assert saves.record(10.0)["attempt"] == 0 and saves.record(10.0)["last_step"] is None


def test_the_summary_of_a_restarted_script_says_what_was_seen_never_started_afresh():
    said = "the last save gpuherd saw: rank 0's Lightning checkpoint /ck/last.ckpt at step 40, 1.6 s before the failure"
    cause = RootCause("worker-exit", 137, "CPU1 (rank 1) killed by SIGKILL after 13.6 s", rank=1, device="CPU1")
    attempts = [AttemptReport(attempt=0, started_at="", duration_s=14.0, exit_code=137, outcome="worker-exit",
                              root_cause=cause, resumed_from=None, log_dir="/l", teardown_s=0.1, workers=[],
                              script_saves={"rank": 0, "step": 40, "said": said}),
                AttemptReport(attempt=1, started_at="", duration_s=9.0, exit_code=0, outcome="success",
                              root_cause=None, resumed_from=None, log_dir="/l/attempt-1", teardown_s=None, workers=[],
                              script_saves={"said": NONE_SEEN})]
    summary = Summary(run_id="r", run_dir="/l", mode="script", command=[], exit_code=0, outcome="success",
                      started_at="", duration_s=25.0, root_cause=None, workers=[], max_restarts=2, restarts=1,
                      attempts=attempts)
    assert summary._attempt_lines() == [
        f"attempt 0 failed with exit code 137: CPU1 (rank 1) killed by SIGKILL after 13.6 s; attempt 1 started the "
        f"script again; {said}"]


def test_the_report_and_top_list_each_script_save_once_however_many_ranks_wrote_it():
    """A sharded save (dcp.save on every rank) is one event naming the ranks; each later save its own."""
    from gpuherd.status_records import Restart
    from supervisor.views.events import EventLog

    log = EventLog()
    for rank in (0, 1):
        log.add(ScriptSave(rank=rank, time=100.0 + rank * 0.01, step=10, path="/ck/step10", api="dcp.save"))
    log.add(ScriptSave(rank=0, time=105.0, step=20, path=None, api="torch.save"))
    log.add(Restart(time=106.0, attempt=1, exit_code=137, after="CPU1 (rank 1) killed by SIGKILL",
                    script_save="the last save gpuherd saw: rank 0's torch.save ..."))
    texts = [e.text for e in log.events()]
    assert texts[1:] == ["rank 0: the script saved into a buffer (no path) with torch.save at step 20",
                         "restart 1 after exit code 137: CPU1 (rank 1) killed by SIGKILL; the last save gpuherd saw: "
                         "rank 0's torch.save ..."]
    assert texts[0] == "ranks 0-1: the script saved /ck/step10 with dcp.save at step 10"

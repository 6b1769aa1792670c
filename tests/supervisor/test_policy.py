"""The supervision policy, driven with synthetic events and a fake clock: every row of the
phase table in docs/design/supervision.md, every escalation, double signals, early exits, a save
in progress, node loss. No process, no pipe: each test runs in microseconds. The end-to-end
tests (test_processes.py, test_stopping.py, test_blame.py) still run the real thing."""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import replace

import pytest

from supervisor.processes import policy as pol
from supervisor.processes.policy import Phase
from supervisor.summary import CauseKind, RootCause

RULES = pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0)
SCRIPT = pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=None, finish_window=60.0)


def rank(r: int, **kw) -> pol.Rank:
    return pol.Rank(r, f"CPU{r}", **{"handles": frozenset({signal.SIGUSR1, signal.SIGUSR2}), **kw})


def view(now: float, *ranks: pol.Rank, step_s: float | None = None) -> pol.View:
    return pol.View(now, tuple(ranks), step_s)


TWO = (rank(0), rank(1))


class Run:
    """A policy run: feed events, keep the state, collect every action."""

    def __init__(self, rules: pol.Rules = RULES, state: pol.State | None = None) -> None:
        self.rules, self.state, self.actions = rules, state or pol.State(), []

    def __call__(self, event) -> list:
        self.state, actions = pol.decide(self.state, event, self.rules)
        self.actions += actions
        return actions

    def tick(self, now: float, *ranks: pol.Rank, step_s: float | None = None) -> list:
        return self(pol.Tick(view(now, *ranks, step_s=step_s)))

    @property
    def phase(self) -> Phase:
        return self.state.phase


def sends(actions, signum=None) -> list[tuple[tuple[int, ...], int, bool]]:
    return [(a.ranks, a.signum, a.group) for a in actions if isinstance(a, pol.Send)
            and (signum is None or a.signum == signum)]


def logs(actions, level=None) -> list[str]:
    return [a.message for a in actions if isinstance(a, pol.Log) and (level is None or a.level == level)]


def failure(r: int, code: int = 1, message: str | None = None) -> RootCause:
    return RootCause("worker-exit", code, message or f"CPU{r} (rank {r}) exit code {code} after 3.0 s", rank=r,
                     device=f"CPU{r}")


def crash(now: float, r: int, *alive: pol.Rank, code: int = 1, message: str | None = None) -> pol.Exited:
    return pol.Exited(view(now, *alive), r, f"CPU{r}", code, f"exit code {code}", failure=failure(r, code, message))


# ---- running: nothing happens without an event; a tick with no deadline changes nothing


def test_running_has_no_deadline_and_a_tick_does_nothing():
    run = Run()
    assert run.tick(1000.0, *TWO) == [] and run.phase is Phase.RUNNING and run.state.deadline is None


# ---- a failure: TERMINATING (SIGTERM + SIGCONT to every group), KILLING at the grace, DONE


def test_a_crash_terminates_every_other_group_then_kills_at_the_grace_period():
    run = Run()
    actions = run(crash(10.0, 1, rank(0), rank(2)))
    assert run.phase is Phase.TERMINATING and run.state.deadline == 15.0
    assert sends(actions) == [((0, 2), signal.SIGTERM, True), ((0, 2), signal.SIGCONT, True)]
    assert run.state.cause.rank == 1 and run.state.failed_at == 10.0
    assert [a.cause for a in actions if isinstance(a, pol.Publish)] == [run.state.cause]
    # the survivors are signalled before the cause is published (a thread; under SLURM, scontrol)
    kinds = [type(a) for a in actions]
    assert kinds.index(pol.Send) < kinds.index(pol.Publish)
    assert run.tick(14.9, rank(0)) == []  # not yet
    actions = run.tick(15.0, rank(0))
    assert run.phase is Phase.KILLING and sends(actions) == [((0,), signal.SIGKILL, True)]
    assert logs(actions, "warning") == ["grace period over: SIGKILL to CPU0"]
    assert run.state.deadline == 15.0 + pol.KILL_WAIT


def test_the_victims_of_a_teardown_do_not_change_the_root_cause():
    run = Run()
    run(crash(10.0, 1, rank(0)))
    cause = run.state.cause
    assert run(pol.Exited(view(10.1), 0, "CPU0", 143, "killed by SIGTERM")) == []
    assert run.state.cause is cause


def test_killing_gives_up_after_kill_wait_with_a_note():
    run = Run()
    run(crash(10.0, 1, rank(0)))
    run.tick(15.0, rank(0))
    actions = run.tick(15.0 + pol.KILL_WAIT, rank(0))
    assert run.phase is Phase.DONE
    assert [a.message for a in actions if isinstance(a, pol.Note)] == [
        "some worker did not die within 10 s of SIGKILL (uninterruptible sleep?)"]


def test_no_worker_left_drains_then_done_when_the_pipes_close_or_at_drain_wait():
    run = Run()
    run(crash(10.0, 1, rank(0)))
    run(pol.AllGone(view(10.2)))
    assert run.phase is Phase.DRAINING and run.state.deadline == 10.2 + pol.DRAIN_WAIT
    run(pol.PipesClosed(view(10.3)))
    assert run.phase is Phase.DONE
    other = Run()
    other(pol.AllGone(view(5.0)))  # every rank finished: from RUNNING too
    other.tick(5.0 + pol.DRAIN_WAIT)
    assert other.phase is Phase.DONE and other.state.cause is None


def test_a_teardown_never_goes_back_to_a_gentler_phase():
    run = Run()
    run(crash(10.0, 1, rank(0)))
    run.tick(15.0, rank(0))  # KILLING
    run(pol.Fatal(view(16.0, rank(0)), RootCause("watcher", 4, "GPU lost: GPU 0")))  # after the cause: a note
    assert run.phase is Phase.KILLING
    assert run.actions[-1] == pol.Note("also reported after the root cause: GPU lost: GPU 0")


# ---- watchers, helpers, another node: TERMINATING


def test_a_watchers_fatal_cause_terminates_with_its_code():
    run = Run()
    actions = run(pol.Fatal(view(3.0, *TWO), RootCause("watcher", 4, "GPU lost: GPU 1", rank=1)))
    assert run.phase is Phase.TERMINATING and run.state.cause.exit_code == 4
    assert logs(actions, "error") == ["GPU lost: GPU 1"]
    kinds = [type(a) for a in actions]
    assert kinds.index(pol.Send) < kinds.index(pol.Publish)


def test_a_node_lost_elsewhere_terminates_this_node_without_publishing_it_back():
    run = Run()
    lost = RootCause("node", 1, "node 1 (h1) stopped responding", node=1)
    actions = run(pol.Fatal(view(3.0, *TWO), lost, remote=True))
    assert run.phase is Phase.TERMINATING and run.state.cause is lost
    assert not [a for a in actions if isinstance(a, pol.Publish)]
    assert sends(actions, signal.SIGTERM) == [((0, 1), signal.SIGTERM, True)]


def test_this_node_moved_out_as_a_straggler_kills_its_workers_at_once_and_publishes_nothing():
    """Node 0 moved this node out (a spare node takes its place): its workers go at once, as a
    node that died whole, so the others' collectives fail now and they rebuild with the spare node."""
    run = Run()
    moved = RootCause("straggler", 0, "this node was moved out of the job by node 0, a spare node taking its place")
    actions = run(pol.Fatal(view(3.0, *TWO), moved, remote=True))
    assert run.phase is Phase.KILLING and run.state.cause is moved
    assert sends(actions, signal.SIGKILL) == [((0, 1), signal.SIGKILL, True)] and not sends(actions, signal.SIGTERM)
    assert not [a for a in actions if isinstance(a, pol.Publish)]
    assert logs(actions, "warning") == [f"{moved.message}; stopping this node's workers at once"]


def test_ctrl_c_on_another_node_stops_this_one_gracefully():
    run = Run()
    actions = run(pol.Fatal(view(3.0, *TWO), RootCause("interrupted", 130, "node 1 (h1): interrupted by Ctrl-C"), remote=True))
    assert run.phase is Phase.STOPPING and sends(actions) == [((0, 1), signal.SIGINT, False)]


@pytest.mark.parametrize("first", ["another node", "a worker", "a stop request"])
def test_the_first_ctrl_c_heard_after_a_graceful_stop_began_elsewhere_joins_it_and_a_second_kills(first):
    """One Ctrl-C reaches every node (a terminal, srun): a node that heard it first from another
    node through the job store, or from its own worker, must not take its own copy for a second
    Ctrl-C and kill the ranks on their way to the save."""
    run = Run()
    if first == "another node":
        run(pol.Fatal(view(3.0, *TWO), RootCause("interrupted", 130, "node 0 (h0): interrupted by Ctrl-C"),
                      remote=True))
    elif first == "a worker":
        run(pol.WorkerStop(view(3.0, *TWO), 1, "CPU1", "SIGINT"))
    else:
        run(pol.SignalReceived(view(3.0, *TWO), signal.SIGTERM))
    cause, deadline = run.state.cause, run.state.deadline
    actions = run(pol.SignalReceived(view(3.1, *TWO), signal.SIGINT))
    assert run.phase is Phase.STOPPING and not sends(actions) and run.state.deadline == deadline
    assert run.state.cause is cause and run.state.stop_signal is not None  # asked to stop: never restarted
    assert logs(actions) == [f"Ctrl-C: the graceful stop already under way goes on ({cause.message}); "
                             "press Ctrl-C again to kill every worker now"]
    actions = run(pol.SignalReceived(view(3.5, *TWO), signal.SIGINT))
    assert run.phase is Phase.KILLING and sends(actions) == [((0, 1), signal.SIGKILL, True)]
    assert logs(actions) == ["Ctrl-C again: killing every worker now"]


def test_a_stop_request_on_another_node_saves_and_stops_here():
    run = Run()
    stopped = RootCause("terminated", 143, "node 1 (h1): the supervisor received SIGTERM")
    actions = run(pol.Fatal(view(3.0, *TWO), stopped, remote=True))
    assert run.phase is Phase.STOPPING and sends(actions) == [((0, 1), signal.SIGUSR2, False)]
    assert run.state.deadline == 3.0 + RULES.stop_timeout


# ---- Ctrl-C: STOPPING (SIGINT to each leader); the grace covers the step in flight and saves


def test_ctrl_c_asks_each_leader_to_stop_and_kills_after_the_grace_period():
    run = Run()
    actions = run(pol.SignalReceived(view(100.0, *TWO), signal.SIGINT))
    assert run.phase is Phase.STOPPING and run.state.deadline == 105.0
    assert sends(actions) == [((0, 1), signal.SIGINT, False)]
    assert run.state.cause.exit_code == 130 and run.state.stop_signal == signal.SIGINT
    assert "waiting up to 5 s" in logs(actions, "warning")[0]
    actions = run.tick(105.0, *TWO)
    assert run.phase is Phase.KILLING and sends(actions, signal.SIGKILL) == [((0, 1), signal.SIGKILL, True)]
    assert run.state.graceful.unfinished == ("CPU0 (rank 0) was killed before saving it",
                                             "CPU1 (rank 1) was killed before saving it")


def test_ctrl_c_waits_for_the_step_in_flight_as_long_as_the_longest_step_seen():
    run = Run()
    actions = run(pol.SignalReceived(view(100.0, *TWO, step_s=30.0), signal.SIGINT))
    assert run.state.deadline == 100.0 + 5.0 + pol.STEP_MARGIN * 30.0
    assert "waiting up to 50 s for the step in flight (about 30 s) and the save" in logs(actions, "warning")[0]


def test_ctrl_c_waits_on_while_a_rank_is_still_in_its_step_and_while_it_saves():
    run = Run()
    run(pol.SignalReceived(view(100.0, *TWO), signal.SIGINT))
    stepping = (rank(0, in_step=True), rank(1, in_step=True))
    actions = run.tick(105.0, *stepping)
    assert run.phase is Phase.STOPPING and run.state.deadline == 110.0 and not sends(actions)
    assert logs(actions, "info") == ["rank(s) 0, 1 still in the step it stops after: waiting for it "
                                     "(at most 115 s more, the stop timeout)"]
    run.tick(110.0, rank(0, saving=True), rank(1, saving=True))  # the save began: wait on, said once
    assert run.state.deadline == 115.0 and len(logs(run.actions, "info")) == 1
    run.tick(115.0, rank(0, leaving=True, save_ended=114.0), rank(1, leaving=True, save_ended=114.0))
    assert run.state.deadline == 119.0  # a grace period after the save
    actions = run.tick(119.0, rank(0, leaving=True, save_ended=114.0))
    assert run.phase is Phase.KILLING and run.state.graceful.unfinished == ()  # it was on its way out


def test_a_graceful_stop_never_waits_past_the_stop_timeout():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGINT))
    for now in (5.0, 10.0, 50.0, 100.0, 115.0):
        run.tick(now, rank(0, saving=True), rank(1))
    actions = run.tick(120.0, rank(0, saving=True), rank(1))
    assert run.phase is Phase.KILLING
    assert logs(actions, "warning") == ["stop timeout over: SIGKILL to CPU0, CPU1"]
    assert run.state.graceful.unfinished[0] == "CPU0 (rank 0) was killed while saving it"


def test_a_second_ctrl_c_kills_at_once():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGINT))
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGINT))
    assert run.phase is Phase.KILLING and sends(actions) == [((0, 1), signal.SIGKILL, True)]
    assert logs(actions) == ["Ctrl-C again: killing every worker now"]


def test_ctrl_c_during_a_teardown_kills_at_once_and_keeps_the_root_cause():
    run = Run()
    run(crash(0.0, 1, rank(0)))
    actions = run(pol.SignalReceived(view(1.0, rank(0)), signal.SIGINT))
    assert run.phase is Phase.KILLING and run.state.cause.rank == 1
    assert logs(actions) == ["Ctrl-C during the teardown: killing every worker now"]


def test_a_teardown_waits_for_a_background_checkpoint_write_up_to_the_stop_timeout():
    run = Run()
    writer = rank(0, writing="/ck/.checkpoints/step_0000040.pt")
    run(crash(10.0, 1, writer))
    actions = run.tick(15.0, writer)  # grace over: the write still goes on
    assert run.phase is Phase.TERMINATING and run.state.deadline == 20.0 and not sends(actions)
    assert logs(actions, "info") == ["CPU0 still writing a checkpoint in the background: waiting for it "
                                     "(at most 115 s more, the stop timeout)"]
    assert logs(run.tick(20.0, writer)) == []  # said once
    actions = run.tick(130.0, writer)  # the stop timeout after the failure: killed, and said
    assert run.phase is Phase.KILLING and sends(actions, signal.SIGKILL)
    assert [a.message for a in actions if isinstance(a, pol.Note)] == [
        "CPU0 (rank 0) was killed while writing step_0000040.pt in the background: it never became a checkpoint "
        "(--resume takes an older one)"]


def test_a_scripts_teardown_waits_for_a_rank_inside_torch_save_up_to_the_stop_timeout():
    """Its bootstrap holds the SIGTERM to the save's end; the built-in worker's foreground
    save is not waited for (its teardown signal means exit now)."""
    run = Run(SCRIPT)
    saver = rank(0, saving=True)
    run(crash(10.0, 1, saver))
    actions = run.tick(15.0, saver)
    assert run.phase is Phase.TERMINATING and run.state.deadline == 20.0 and not sends(actions)
    assert logs(actions, "info") == ["CPU0 still writing a checkpoint (torch.save): waiting for it "
                                     "(at most 115 s more, the stop timeout)"]
    assert sends(run.tick(20.0, rank(0)), signal.SIGKILL)  # the save ended, and the rank is still there
    builtin = Run()
    builtin(crash(10.0, 1, saver))
    assert builtin.tick(15.0, saver) and builtin.phase is Phase.KILLING
    stopped = Run(SCRIPT)  # a stop request: the stop timeout was its whole wait already
    stopped(pol.SignalReceived(view(0.0, saver), signal.SIGTERM))
    assert sends(stopped.tick(120.0, saver), signal.SIGKILL) and stopped.phase is Phase.KILLING


def test_a_hung_rank_whose_background_write_never_ends_is_killed_with_its_writer_not_waited_for():
    run = Run(pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0, traces=False))
    writer = rank(0, writing="/ck/.checkpoints/step_0000040.pt")
    waiting = rank(1)
    run(pol.HangFound(view(50.0, writer, waiting), hang_cause(0)))
    actions = run.tick(50.0 + pol.STACK_DUMP_WAIT, writer, waiting)
    assert sends(actions, signal.SIGKILL) == [((0,), signal.SIGKILL, True)]  # its group: the writer child too
    actions = run.tick(55.5, writer, waiting)  # grace over: no wait for that write up to the stop timeout
    assert run.phase is Phase.KILLING and not logs(actions, "info")


def test_a_graceful_stop_waits_for_a_background_write_like_a_save():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGINT))
    run.tick(5.0, rank(0, writing="/ck/step_0000008.pt"), rank(1))
    assert run.phase is Phase.STOPPING and run.state.deadline == 10.0


def test_a_worker_that_fails_its_final_save_makes_the_save_not_saved():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGINT))
    run(pol.Exited(view(3.0, rank(1)), 0, "CPU0", 7, "exit code 7 (cannot write)"))
    run(pol.Exited(view(3.5), 1, "CPU1", 130, "exit code 130"))
    assert run.state.graceful.unfinished == ("CPU0 (rank 0) exit code 7 (cannot write) while stopping",)
    assert run.state.graceful.outcome(saved=True) == "not saved"


# ---- stop requests: SIGTERM / SIGHUP / SIGUSR1 / SIGUSR2; SIGQUIT


def test_sigterm_saves_and_stops_within_the_stop_timeout_and_a_second_one_kills():
    run = Run()
    starting = rank(1, handles=frozenset({signal.SIGUSR1}))  # no handler yet: nothing to save, SIGTERM
    actions = run(pol.SignalReceived(view(0.0, rank(0), starting), signal.SIGTERM))
    assert run.phase is Phase.STOPPING and run.state.deadline == 120.0 and run.state.cause.exit_code == 143
    assert (run.state.cause.kind, run.state.cause.signal) == (CauseKind.TERMINATED, "SIGTERM")
    assert sends(actions) == [((0,), signal.SIGUSR2, False), ((1,), signal.SIGTERM, True)]
    assert run(pol.SignalReceived(view(1.0, rank(0)), signal.SIGUSR1)) == []  # a later USR1 changes nothing
    actions = run(pol.SignalReceived(view(2.0, rank(0)), signal.SIGHUP))
    assert run.phase is Phase.KILLING and logs(actions) == ["SIGHUP again: killing every worker now"]


def test_sigusr1_to_a_built_in_run_is_a_stop_request_with_exit_143():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGUSR1))
    assert run.phase is Phase.STOPPING and run.state.cause.exit_code == 143
    assert run.state.cause.signal == "SIGUSR1"  # SLURM's warning before the time limit: named by this field


def test_a_script_gets_sigterm_and_the_stop_timeout_and_its_usr_signals_forwarded():
    run = Run(SCRIPT)
    actions = run(pol.SignalReceived(view(0.0, rank(0), rank(1, handles=frozenset({signal.SIGUSR2}))), signal.SIGUSR1))
    assert actions == [pol.Forward((0,), ("CPU1",), signal.SIGUSR1)] and run.state.cause is None
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGTERM))
    assert run.phase is Phase.TERMINATING and run.state.deadline == 121.0
    assert sends(actions, signal.SIGTERM) == [((0, 1), signal.SIGTERM, True)]


def test_sigquit_tears_down_without_a_save_exits_131_and_again_kills():
    run = Run()
    actions = run(pol.SignalReceived(view(0.0, *TWO), signal.SIGQUIT))
    assert run.phase is Phase.TERMINATING and run.state.cause.exit_code == 131
    assert run.state.stop_signal == signal.SIGQUIT and run.state.graceful is None
    assert sends(actions, signal.SIGTERM) == [((0, 1), signal.SIGTERM, True)]
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGQUIT))
    assert run.phase is Phase.KILLING and sends(actions, signal.SIGKILL)


# ---- an early clean exit: FINISHING; the first rank to leave is the root cause


def test_an_early_clean_exit_waits_for_the_others_and_says_so_once():
    run = Run()
    run(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0", where="step 40, phase train"))
    assert run.phase is Phase.FINISHING and run.state.deadline == 10.0 + pol.EARLY_EXIT_NOTICE
    actions = run.tick(12.0, rank(0))
    assert logs(actions, "info") == ["CPU1 (rank 1) exited 0 first (step 40, phase train); rank(s) 0 may finish at "
                                     "their own pace: a hang only after 60 s without progress"]
    assert run.state.deadline is None  # rank 0 sends heartbeats: the heartbeat judge decides
    run(pol.Exited(view(20.0), 0, "CPU0", 0, "exit code 0", done=True))
    run(pol.AllGone(view(20.0)))
    assert run.state.cause is None and run.phase is Phase.DRAINING


def test_a_rank_that_finished_with_done_is_not_an_early_exit():
    run = Run()
    run(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0", done=True))
    assert run.phase is Phase.RUNNING


def test_silent_ranks_after_an_early_exit_are_a_hang_once_the_finish_window_is_over():
    run = Run()
    silent = rank(0, heard=False)
    run(pol.Exited(view(10.0, silent), 1, "CPU1", 0, "exit code 0", where="no step yet"))
    run.tick(12.0, silent)
    assert run.state.deadline == 70.0
    actions = run.tick(70.0, silent)
    assert run.phase is Phase.DUMPING_STACKS and run.state.cause.kind == "early-exit"
    assert run.state.cause.exit_code == 124 and run.state.cause.rank == 1
    assert sends(actions) == [((0,), signal.SIGUSR1, False)]


def test_the_first_rank_to_leave_is_the_root_cause_when_another_then_fails():
    """Issue 24: rank 1 exited 0 early; rank 0 then died on 'Connection closed by peer'."""
    run = Run()
    run(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0", where="step 3, phase train"))
    run(crash(10.4, 0, message="CPU0 (rank 0) exit code 1 after 9.0 s: RuntimeError: Connection closed by peer"))
    cause = run.state.cause
    assert (cause.kind, cause.rank, cause.device, cause.exit_code) == ("early-exit", 1, "CPU1", 1)
    assert cause.message.startswith("CPU1 (rank 1) left first: it exited 0 (step 3, phase train) while the others "
                                    "still ran; then CPU0 (rank 0) exit code 1")
    assert cause.message.endswith("Connection closed by peer: a consequence of its absence")
    assert run.phase is Phase.TERMINATING


def test_a_rank_failing_on_its_own_account_after_an_early_exit_is_the_root_cause():
    """An exception of its own (or a signal) is no consequence of the other rank's absence."""
    run = Run()
    run(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0", where="step 3, phase train"))
    run(crash(10.4, 0, message="CPU0 (rank 0) exit code 1 after 9.0 s: RuntimeError: boom on rank 0"))
    assert (run.state.cause.kind, run.state.cause.rank) == ("worker-exit", 0)


def test_a_failure_without_an_early_exit_names_the_failing_rank():
    run = Run()
    run(crash(10.0, 0, rank(1)))
    assert run.state.cause.kind == "worker-exit" and run.state.cause.rank == 0


# ---- a hang: DUMPING_TRACES -> DUMPING_STACKS -> TERMINATING -> KILLING


def hang_cause(r: int = 1) -> RootCause:
    return RootCause("hang", 124, f"hang: rank {r} (stopped)", rank=r, device=f"CPU{r}")


def test_a_hang_asks_for_traces_and_stacks_at_once_then_terminates_killing_the_hung_rank():
    run = Run()
    actions = run(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0})))
    assert run.phase is Phase.DUMPING_TRACES and run.state.trace_ranks == {0}
    assert run.state.deadline == 50.0 + pol.TRACES_WAIT and pol.RequestTraces() in actions
    assert logs(actions, "error") == ["hang: rank 1 (stopped)"]
    assert sends(actions) == [((0, 1), signal.SIGUSR1, False)]  # the stacks, in parallel with the traces
    actions = run(pol.TracesIn(view(51.0, *TWO)))
    assert actions[0] == pol.AnalyseTraces() and run.phase is Phase.DUMPING_STACKS
    assert not sends(actions) and run.state.deadline == 51.0  # the stacks were written long ago
    actions = run.tick(51.0, *TWO)
    assert run.phase is Phase.TERMINATING
    # the hung rank could not act on the teardown signal: SIGKILL, no grace period waited out
    assert sends(actions) == [((1,), signal.SIGKILL, True), ((0,), signal.SIGTERM, True), ((0,), signal.SIGCONT, True)]
    run.tick(56.0, *TWO)
    assert run.phase is Phase.KILLING


def test_a_stopped_hung_rank_is_killed_at_the_verdict_and_never_waited_for():
    run = Run()
    actions = run(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0}), stopped=frozenset({1})))
    assert sends(actions) == [((1,), signal.SIGKILL, True), ((0,), signal.SIGUSR1, False)]
    assert "CPU1 (rank 1) is stopped and cannot answer: SIGKILL now" in logs(actions, "warning")
    # the traces are asked for, not waited for: the kernel already said who hung
    assert pol.RequestTraces() in actions
    assert run.phase is Phase.DUMPING_STACKS and run.state.deadline == 50.0 + pol.STACK_DUMP_WAIT
    stopped_only = Run()
    stopped_only(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset(), stopped=frozenset({1})))
    assert stopped_only.phase is Phase.DUMPING_STACKS and stopped_only.state.deadline == 50.0 + pol.STACK_DUMP_WAIT


def test_trace_wait_over_reads_what_came_and_goes_on():
    run = Run()
    run(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0, 1})))
    actions = run.tick(50.0 + pol.TRACES_WAIT, *TWO)
    assert actions[0] == pol.AnalyseTraces() and run.phase is Phase.DUMPING_STACKS


def test_no_responsive_rank_skips_the_traces_and_no_handler_skips_the_stacks():
    run = Run()
    mute = (rank(0, handles=frozenset()), rank(1, handles=frozenset()))
    actions = run(pol.HangFound(view(50.0, *mute), hang_cause(), responsive=frozenset()))
    assert run.phase is Phase.DUMPING_STACKS and run.state.deadline == 50.0 and not sends(actions)
    assert "CPU0, CPU1 installed no SIGUSR1 handler" in [a for a in actions if isinstance(a, pol.Note)][0].message
    run.tick(50.0, *mute)
    assert run.phase is Phase.TERMINATING


def test_a_hang_after_an_early_exit_says_how_long_ago_it_left():
    run = Run()
    run(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0"))
    run(pol.HangFound(view(75.0, rank(0)), hang_cause(0)))
    assert run.state.cause.message.endswith("; CPU1 (rank 1) had exited 0 65 s before (waiting for it?)")


def test_without_trace_dir_a_hang_goes_straight_to_the_stacks():
    run = Run(pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0, traces=False))
    run(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0, 1})))
    assert run.phase is Phase.DUMPING_STACKS


def test_a_hang_verdict_after_the_root_cause_changes_nothing():
    run = Run()
    run(crash(1.0, 0, rank(1)))
    assert run(pol.HangFound(view(2.0, rank(1)), hang_cause())) == [] and run.state.cause.rank == 0


def test_the_traces_read_are_said_and_become_the_hang_causes_evidence():
    run = Run()
    verdict = replace(hang_cause(), evidence=["rank 1: no step for 60 s"])
    run(pol.HangFound(view(50.0, *TWO), verdict, responsive=frozenset({0, 1})))
    run.tick(50.0 + pol.TRACES_WAIT, *TWO)
    actions = run(pol.TracesRead(view(53.0, *TWO), ("rank 0: in all_reduce #7", "rank 1: never reached #7")))
    assert logs(actions, "error") == ["rank 0: in all_reduce #7", "rank 1: never reached #7"]
    assert run.state.cause.evidence == ["rank 1: no step for 60 s", "rank 0: in all_reduce #7",
                                        "rank 1: never reached #7"]
    assert verdict.evidence == ["rank 1: no step for 60 s"]  # the event's cause never changed behind its back


def test_the_cause_as_published_becomes_the_root_cause():
    run = Run()
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGTERM))
    published = [a.cause for a in actions if isinstance(a, pol.Publish)][0]
    named = replace(published, message="SLURM: the job's time limit was reached")
    assert run(pol.Published(view(1.0, *TWO), named)) == [] and run.state.cause == named
    assert Run()(pol.Published(view(1.0), named)) == []  # no cause: nothing to rename


def test_a_cause_published_late_keeps_what_the_attempt_learned_meanwhile():
    """Publishing runs off the loop: the evidence read before its answer came stays; its words are taken."""
    run = Run()
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGTERM))
    published = [a.cause for a in actions if isinstance(a, pol.Publish)][0]
    run(pol.TracesRead(view(1.5, *TWO), ("rank 0: in all_reduce #7",)))
    named = replace(published, message="stopped by SLURM: scancel (SIGTERM)")
    assert run(pol.Published(view(2.0, *TWO), named, of=published)) == []
    assert run.state.cause.message == named.message and run.state.cause.evidence == ["rank 0: in all_reduce #7"]


def test_once_drained_a_local_cause_gets_its_ranks_complete_stderr_tail():
    tails = ((0, ("a",)), (1, ("Traceback", "ValueError: x")))
    run = Run()
    run(crash(1.0, 1, rank(0)))
    run(pol.TailsRead(view(2.0), tails))
    assert run.state.cause.stderr_tail == ["Traceback", "ValueError: x"]
    remote = Run()
    remote(pol.Fatal(view(1.0, rank(0)), RootCause("worker-exit", 1, "node 1: x", rank=1, node=1), remote=True))
    remote(pol.TailsRead(view(2.0), tails))
    assert remote.state.cause.stderr_tail == []  # another node's cause: not this node's tail
    early = Run()
    early(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0"))
    reset = replace(failure(0), stderr_tail=["RuntimeError: Connection reset by peer"])
    early(pol.Exited(view(11.0), 0, "CPU0", 1, "exit code 1", failure=reset))
    assert early.state.cause.kind == "early-exit"
    kept = early.state.cause
    early(pol.TailsRead(view(12.0), tails))
    assert early.state.cause is kept  # an early exit's cause keeps the failing rank's tail


def test_a_root_cause_is_immutable():
    cause = failure(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cause.message = "changed"  # type: ignore[misc]


def test_the_state_is_immutable_and_decide_is_pure():
    state = pol.State()
    event = pol.SignalReceived(view(0.0, *TWO), signal.SIGINT)
    first = pol.decide(state, event, RULES)
    assert pol.decide(state, event, RULES) == first and state == pol.State()


# ---- gpuherd's worker: teardown and stacks by signals nobody else sends; a worker's own stop signal

BUILT_IN = pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0,
                     teardown_signal=signal.SIGRTMIN, stacks_signal=signal.SIGRTMAX)


def test_the_built_in_worker_is_torn_down_and_asked_for_stacks_with_the_rules_signals():
    run = Run(BUILT_IN)
    run(crash(10.0, 1, rank(0)))
    assert sends(run.actions, signal.SIGRTMIN) == [((0,), signal.SIGRTMIN, True)]
    assert not sends(run.actions, signal.SIGTERM)
    hung = Run(BUILT_IN)
    handles = frozenset({signal.SIGRTMAX, signal.SIGUSR2})
    hung(pol.HangFound(view(10.0, rank(0, handles=handles)), failure(0, 124), frozenset()))
    assert sends(hung.actions, signal.SIGRTMAX) == [((0,), signal.SIGRTMAX, False)]
    assert any("(SIGRTMAX)" in line for line in logs(hung.actions))


def test_a_stop_signal_that_reached_a_worker_stops_every_worker_as_the_supervisors_own_would():
    run = Run(BUILT_IN)
    actions = run(pol.WorkerStop(view(10.0, *TWO), 1, "CPU1", "SIGTERM"))
    assert run.phase is Phase.STOPPING and run.state.cause.exit_code == 143
    assert run.state.cause.message == "CPU1 (rank 1) received SIGTERM" and run.state.stop_signal == signal.SIGTERM
    assert run.state.cause.signal == "SIGTERM"  # a field: naming a SLURM stop reads it, never the message
    assert sends(actions) == [((0, 1), signal.SIGUSR2, False)]
    # the workers are signalled before the cause is published (naming it may ask SLURM)
    kinds = [type(a) for a in actions]
    assert kinds.index(pol.Send) < kinds.index(pol.Publish)
    # a second worker's record, or the same signal again, is never a kill
    assert run(pol.WorkerStop(view(11.0, *TWO), 0, "CPU0", "SIGTERM")) == [] and run.phase is Phase.STOPPING


def test_a_worker_that_got_sigint_itself_stops_like_ctrl_c():
    run = Run(BUILT_IN)
    run(pol.WorkerStop(view(10.0, *TWO), 0, "CPU0", "SIGINT"))
    assert run.phase is Phase.STOPPING and run.state.cause.exit_code == 130
    assert sends(run.actions) == [((0, 1), signal.SIGINT, False)]


# ---- rows of the phase table the tests above did not reach


def test_a_stop_request_ends_in_killing_at_the_stop_timeout_naming_it():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGTERM))
    assert run.tick(119.9, *TWO) == [] and run.phase is Phase.STOPPING
    actions = run.tick(120.0, *TWO)
    assert run.phase is Phase.KILLING and sends(actions, signal.SIGKILL) == [((0, 1), signal.SIGKILL, True)]
    assert logs(actions, "warning") == ["stop timeout over: SIGKILL to CPU0, CPU1"]


def test_sighup_and_sigusr2_are_stop_requests_too():
    for signum, code in ((signal.SIGHUP, 129), (signal.SIGUSR2, 143)):
        run = Run()
        actions = run(pol.SignalReceived(view(0.0, *TWO), signum))
        assert run.phase is Phase.STOPPING and run.state.cause.exit_code == code
        assert sends(actions) == [((0, 1), signal.SIGUSR2, False)] and run.state.stop_signal == signum


def test_a_second_sigterm_kills_at_once():
    run = Run()
    run(pol.SignalReceived(view(0.0, *TWO), signal.SIGTERM))
    actions = run(pol.SignalReceived(view(1.0, *TWO), signal.SIGTERM))
    assert run.phase is Phase.KILLING and logs(actions) == ["SIGTERM again: killing every worker now"]


def test_a_sigterm_during_a_teardown_keeps_the_root_cause_and_is_remembered_as_a_stop():
    """The restart policy reads `stop_signal`: a scancel during a teardown is never restarted."""
    run = Run()
    run(crash(0.0, 1, rank(0)))
    assert run(pol.SignalReceived(view(1.0, rank(0)), signal.SIGTERM)) == []
    assert run.phase is Phase.TERMINATING and run.state.cause.rank == 1
    assert run.state.stop_signal == signal.SIGTERM


def test_a_node_asking_to_join_saves_and_stops_this_node_for_a_membership_restart():
    """Elastic (--nnodes MIN:MAX): node 0 publishes a `membership` cause; every node saves
    and stops as for a stop request, then restarts with the node admitted."""
    run = Run()
    joining = RootCause("membership", 0, "node 2 (h2) asks to join")
    actions = run(pol.Fatal(view(3.0, *TWO), joining, remote=True))
    assert run.phase is Phase.STOPPING and run.state.cause is joining
    assert sends(actions) == [((0, 1), signal.SIGUSR2, False)] and run.state.deadline == 3.0 + RULES.stop_timeout
    assert not [a for a in actions if isinstance(a, pol.Publish)]


def test_a_helpers_death_tears_down_like_a_watcher():
    run = Run()
    actions = run(pol.Fatal(view(3.0, *TWO), RootCause("supervisor", 1, "the store server exited with code 1")))
    assert run.phase is Phase.TERMINATING and run.state.cause.kind == "supervisor"
    assert sends(actions, signal.SIGTERM) == [((0, 1), signal.SIGTERM, True)]
    assert [a.cause.kind for a in actions if isinstance(a, pol.Publish)] == ["supervisor"]


def test_a_failure_while_finishing_terminates_and_a_hang_while_finishing_dumps_traces():
    run = Run()
    run(pol.Exited(view(10.0, *TWO), 2, "CPU2", 0, "exit code 0"))
    run(crash(11.0, 1, rank(0)))
    assert run.phase is Phase.TERMINATING and run.state.cause.kind == "worker-exit"
    hung = Run()
    hung(pol.Exited(view(10.0, *TWO), 2, "CPU2", 0, "exit code 0"))
    hung(pol.HangFound(view(80.0, *TWO), hang_cause(), responsive=frozenset({0})))
    assert hung.phase is Phase.DUMPING_TRACES


def test_dumping_stacks_waits_for_the_stacks_at_most_the_grace_period():
    run = Run(pol.Rules(grace=1.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0,
                        traces=False))
    run(pol.HangFound(view(50.0, *TWO), hang_cause()))
    assert run.phase is Phase.DUMPING_STACKS and run.state.deadline == 50.0 + min(pol.STACK_DUMP_WAIT, 1.0)


# ---- live recovery: the loop says whether a warm spare can take a lost rank (`Spare`); the policy decides

CAN = pol.Spare()  # a spare can take the rank now
SECOND = pol.Spare("a second failure during a recovery (rank 1 was being replaced)")


def lost(now: float, r: int, *alive: pol.Rank, spare: pol.Spare | None = CAN, code: int = 1) -> pol.Exited:
    return pol.Exited(view(now, *alive), r, f"CPU{r}", code, f"exit code {code}", failure=failure(r, code),
                      spare=spare)


def test_a_replaceable_ranks_failed_exit_is_replaced_live_without_a_teardown():
    run = Run()
    actions = run(lost(10.0, 1, rank(0)))
    assert actions == [pol.ReplaceLive(1, failure(1))]
    assert run.phase is Phase.RUNNING and run.state.cause is None and run.state.deadline is None


def test_a_failed_replacement_is_the_usual_teardown_with_the_same_cause():
    run = Run()
    run(lost(10.0, 1, rank(0)))
    actions = run(pol.ReplaceFailed(view(10.0, rank(0)), 1, failure(1)))
    usual = Run()
    assert actions == usual(crash(10.0, 1, rank(0))) and run.state == usual.state
    assert run.phase is Phase.TERMINATING and run.state.cause == failure(1)


def test_a_rank_no_spare_can_take_is_the_usual_teardown_saying_why_and_failing_the_recovery():
    run = Run()
    actions = run(lost(10.0, 1, rank(0), spare=SECOND))
    said = pol.Log("warning", f"live recovery not possible: {SECOND.why_not}")
    assert actions[:2] == [pol.GiveUpLive(failure(1)), said]
    usual = Run()
    assert actions[2:] == usual(crash(10.0, 1, rank(0))) and run.state == usual.state


def test_without_live_recovery_a_failed_exit_says_nothing_of_it():
    run = Run()
    assert run(lost(10.0, 1, rank(0), spare=None)) == Run()(crash(10.0, 1, rank(0)))


def test_a_second_failure_during_a_recovery_ends_the_attempt_with_the_second_as_cause():
    run = Run()
    run(lost(10.0, 1, rank(0), rank(2)))  # replaced: the recovery is in flight
    actions = run(lost(12.0, 2, rank(0), rank(1), spare=SECOND))
    assert pol.GiveUpLive(failure(2)) in actions and run.state.cause == failure(2)
    assert run.phase is Phase.TERMINATING and sends(actions, signal.SIGTERM) == [((0, 1), signal.SIGTERM, True)]


def test_a_hang_on_a_replaceable_rank_kills_it_for_recovery_and_its_exit_is_replaced_with_the_verdict():
    run = Run()
    verdict = hang_cause()
    actions = run(pol.HangFound(view(50.0, *TWO), verdict, responsive=frozenset({0}), spare=CAN))
    assert logs(actions, "error") == ["hang: rank 1 (stopped); SIGKILL to CPU1 (rank 1) for a live recovery"]
    assert sends(actions) == [((1,), signal.SIGKILL, True)] and pol.RequestTraces() not in actions
    assert run.phase is Phase.RUNNING and run.state.cause is None and run.state.condemned == ((1, verdict),)
    assert run(pol.HangFound(view(50.3, *TWO), verdict, spare=CAN)) == []  # killed already, not reaped yet
    actions = run(lost(50.5, 1, rank(0), code=137))
    assert actions == [pol.ReplaceLive(1, verdict)] and run.state.condemned == ()


def test_a_condemned_rank_whose_replacement_fails_tears_down_with_the_verdict_as_cause():
    run = Run()
    verdict = hang_cause()
    run(pol.HangFound(view(50.0, *TWO), verdict, spare=CAN))
    actions = run(lost(50.5, 1, rank(0), code=137, spare=pol.Spare("no warm spare ready")))
    assert logs(actions, "warning") == ["live recovery not possible: no warm spare ready"]
    assert run.state.cause == verdict and run.phase is Phase.TERMINATING


def test_a_hang_on_a_rank_no_spare_can_take_is_the_usual_diagnosis():
    run, usual = Run(), Run()
    event = pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0}), spare=SECOND)
    assert run(event) == usual(replace(event, spare=None)) and run.state == usual.state
    assert run.phase is Phase.DUMPING_TRACES


def test_a_rendezvous_verdict_is_never_killed_for_recovery():
    run = Run()
    never = RootCause("rendezvous", 5, "rank 1 never joined", rank=1, device="CPU1")
    run(pol.HangFound(view(50.0, *TWO), never, spare=CAN))
    assert run.state.cause == never and run.state.condemned == ()


def test_a_survivor_stuck_in_the_broken_group_fails_the_recovery_and_tears_down():
    run = Run()
    run(lost(10.0, 1, rank(0), rank(2)))
    stuck = RootCause("hang", 124, "live recovery 1 not possible: rank(s) 2 stayed in a collective", rank=2,
                      device="CPU2")
    ranks = (rank(0), rank(1), rank(2))
    actions = run(pol.RecoveryStuck(view(25.0, *ranks), stuck))
    assert actions[:2] == [pol.GiveUpLive(stuck), pol.Log("error", stuck.message)]
    # where the stuck rank waits goes to the worker logs before the teardown
    assert pol.Send((0, 1, 2), RULES.stacks_signal, group=False) in actions
    assert run.state.cause == stuck and run.phase is Phase.DUMPING_STACKS
    assert run(pol.RecoveryStuck(view(26.0, rank(0)), stuck)) == []  # the attempt is ending already
    run(pol.Tick(view(25.0 + pol.STACK_DUMP_WAIT, *ranks)))
    assert run.phase is Phase.TERMINATING


def test_a_recovery_a_peer_node_could_not_join_ends_without_asking_for_stacks():
    run = Run()
    run(lost(10.0, 1, rank(0), rank(2)))
    why = RootCause("rendezvous", 1, "node 1 could not rebuild the group")
    actions = run(pol.RecoveryStuck(view(25.0, rank(0), rank(2)), why))
    assert not [a for a in actions if isinstance(a, pol.Send) and a.signum == signal.SIGUSR1]
    assert run.phase is Phase.TERMINATING


# ---- regrow: a warm spare back while the group is shrunk takes back a carried rank, only while training runs


def test_a_warm_spare_back_while_shrunk_regrows_the_carried_rank_without_a_phase_change():
    run = Run()
    actions = run(pol.SpareReady(view(30.0, rank(0), rank(1), rank(3)), 2))
    assert actions == [pol.Regrow(2)]
    assert run.phase is Phase.RUNNING and run.state.cause is None and run.state.deadline is None


def test_no_regrow_during_a_stop_a_teardown_or_an_early_exit_the_spare_waits():
    stopping = Run()
    stopping(pol.SignalReceived(view(10.0, *TWO), signal.SIGINT))
    assert stopping.phase is Phase.STOPPING and stopping(pol.SpareReady(view(11.0, *TWO), 2)) == []
    failed = Run()
    failed(crash(10.0, 1, rank(0)))
    assert failed.state.cause is not None and failed(pol.SpareReady(view(10.5, rank(0)), 2)) == []
    finishing = Run()
    finishing(pol.Exited(view(10.0, rank(0)), 1, "CPU1", 0, "exit code 0"))
    assert finishing.phase is Phase.FINISHING and finishing(pol.SpareReady(view(10.5, rank(0)), 2)) == []


def test_no_regrow_while_a_hung_rank_is_being_killed_for_a_recovery_then_it_may():
    run = Run()
    run(pol.HangFound(view(50.0, *TWO), hang_cause(), responsive=frozenset({0}), spare=CAN))
    assert run.state.condemned and run(pol.SpareReady(view(50.2, *TWO), 2)) == []
    run(lost(50.5, 1, rank(0), code=137))  # its loss is handled (replaced or shrunk): nothing condemned now
    assert run(pol.SpareReady(view(60.0, rank(0)), 2)) == [pol.Regrow(2)]


def test_ctrl_c_on_a_script_says_the_signal_went_to_it_and_promises_no_save():
    """A script gets SIGINT and does with it what it likes (Lightning saves nothing on
    KeyboardInterrupt): the line promises no checkpoint, the end of the run says whether one came."""
    run = Run(SCRIPT)
    actions = run(pol.SignalReceived(view(100.0, *TWO), signal.SIGINT))
    assert sends(actions) == [((0, 1), signal.SIGINT, False)]
    line = logs(actions, "warning")[0]
    assert line.startswith("Ctrl-C: SIGINT to every worker; what the script does with it is its own (gpuherd saves "
                           "nothing for a script; the end of the run says whether a save followed): waiting up to 5 s")
    assert "save a checkpoint" not in line


def test_a_cause_from_the_store_that_names_this_node_is_not_said_to_be_another_nodes():
    """Node 0's agent SIGSTOPped 12 s publishes its own stall (node 0) as the job's cause: node 0's
    supervisor hears it from the store like any remote cause, but the failure is its own node's."""
    run = Run()
    stall = RootCause("node", 1, "node 0 (h0) stopped responding: its node agent did not run for 12.1 s", node=0)
    actions = run(pol.Fatal(view(3.0, *TWO), stall, remote=True, here=True))
    assert run.phase is Phase.TERMINATING and not [a for a in actions if isinstance(a, pol.Publish)]
    assert logs(actions, "error") == [f"the job failed on this node: {stall.message}; stopping this node's workers"]
    elsewhere = Run()
    assert logs(elsewhere(pol.Fatal(view(3.0, *TWO), stall, remote=True)), "error")[0].startswith(
        "the job failed on another node: node 0 (h0)")

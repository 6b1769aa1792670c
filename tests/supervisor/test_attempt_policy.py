"""The attempt policy (supervisor/attempt_policy.py), driven with synthetic attempt reports:
restart, the dataset re-check, give up, live recoveries against --max-restarts, the exclusion
of suspect GPUs, a membership change, a stop between attempts, the requeue at the end. No
process, no file: each test runs in microseconds. The process tests (test_restarts.py,
gpus/test_exclude.py, test_elastic_nodes.py, test_live_recovery.py) still run the real loop."""

from __future__ import annotations

import signal

import pytest

from gpuherd.exit_codes import ExitCode
from supervisor import attempt_policy as ap
from supervisor.gpus import DevicePlan, DeviceSlot
from supervisor.restarts import MAX_BACKOFF_S, STREAK_RESET_S
from supervisor.summary import RootCause, SuspectDevice

CPU2 = DevicePlan(slots=(DeviceSlot(0, "cpu", 0), DeviceSlot(1, "cpu", 1)), isolate=False)
GPU4 = DevicePlan(slots=tuple(DeviceSlot(r, "cuda", r) for r in range(4)), isolate=True)
CRASH = RootCause("worker-exit", 1, "CPU1 (rank 1) exit code 1 after 2.0 s", rank=1, device="CPU1")
EXIT_8 = RootCause("worker-exit", ExitCode.DEVICE_SUSPECT, "GPU2 (rank 2) exit code 8", rank=2, device="GPU2")
SCRIPT = ap.Rules(max_restarts=3, train=False, base_backoff=0.2)
TRAIN = ap.Rules(max_restarts=3, train=True, base_backoff=0.2)


class Loop:
    """A run of attempts: feed events, keep the state."""

    def __init__(self, rules: ap.Rules = SCRIPT, plan: DevicePlan = CPU2) -> None:
        self.rules, self.state = rules, ap.State(plan=plan)

    def __call__(self, event: ap.Event) -> ap.Decision:
        self.state, decision = ap.next_attempt(self.state, event, self.rules)
        return decision

    def fails(self, cause: RootCause = CRASH, ran_s: float = 2.0, **more) -> ap.Decision:
        return self(ap.AttemptEnded(cause, ran_s, **more))


def suspect(gpu: int, faults: int, limit: int = 2) -> SuspectDevice:
    return SuspectDevice(attempt=0, rank=gpu, device=f"cuda:0 (GPU {gpu})", gpu=gpu, host="h1",
                         transient_faults=faults, limit=limit, step=11)


def test_success_ends_the_run_with_no_cause():
    loop = Loop()
    assert loop(ap.AttemptEnded(None, 30.0)) == ap.Stop(None)
    assert loop.state.restarts_used == 0


def test_a_crash_is_restarted_from_the_newest_checkpoint_after_a_doubling_pause():
    loop = Loop()
    first = loop.fails(newest="/ck/step_0000004.pt")
    assert first == ap.Restart(1, 0.2, "/ck/step_0000004.pt", CPU2, CRASH, message=(
        "attempt 0 failed (CPU1 (rank 1) exit code 1 after 2.0 s); restart 1 of 3 in 0.2 s, "
        "resuming from /ck/step_0000004.pt"))
    assert (loop.state.attempt, loop.state.restarts_used, loop.state.streak) == (1, 1, 1)
    second = loop.fails()
    assert second.delay == 0.4 and second.resume is None
    assert second.message.endswith("restart 2 of 3 in 0.4 s, starting as the first attempt did "
                                   "(no checkpoint written yet)")


def test_the_backoff_starts_over_after_progress_or_a_long_attempt():
    loop = Loop(ap.Rules(max_restarts=20, train=False, base_backoff=0.2))
    for _ in range(3):
        loop.fails()
    assert loop.state.streak == 3
    assert loop.fails(progressed=True).delay == 0.2  # a completed step: not a quick failure
    loop.fails()
    assert loop.fails(ran_s=STREAK_RESET_S).delay == 0.2
    for _ in range(12):
        last = loop.fails()
    assert last.delay == MAX_BACKOFF_S


def test_restarts_used_up_give_up_with_the_last_cause_and_say_why():
    loop = Loop(ap.Rules(max_restarts=1, train=False))
    assert isinstance(loop.fails(), ap.Restart)
    assert loop.fails() == ap.Stop(CRASH, "all 1 restart(s) used")
    # without --max-restarts a restart was never on the table: nothing to say
    assert Loop(ap.Rules(max_restarts=0, train=False)).fails() == ap.Stop(CRASH, None)


@pytest.mark.parametrize(("cause", "stop_signal", "why"), [
    (RootCause("worker-exit", 143, "CPU0 (rank 0) killed by SIGTERM"), "SIGTERM", "the supervisor received SIGTERM"),
    (RootCause("interrupted", 130, "interrupted by Ctrl-C (SIGINT)"), "SIGINT", "the supervisor received SIGINT"),
    (RootCause("worker-exit", int(ExitCode.USAGE), "x"), None,
     "a usage or config error fails every attempt the same way"),
    (RootCause("worker-exit", int(ExitCode.NAN), "x"), None,
     "a NaN stop is not restarted unless --restart-on-nan is given"),
])
def test_a_stop_or_a_failure_that_would_repeat_gives_up(cause, stop_signal, why):
    loop = Loop()
    assert loop.fails(cause, stop_signal=stop_signal) == ap.Stop(cause, why)
    assert loop.state.restarts_used == 0 and loop.state.waiting is None


def test_the_built_in_trainer_restarts_only_after_the_dataset_check():
    loop = Loop(TRAIN)
    assert loop.fails() == ap.CheckDataset()
    assert loop.state.restarts_used == 0  # nothing decided yet
    restart = loop(ap.DatasetChecked(rebuilt=False))  # the cache is sound: a crash restarts
    assert isinstance(restart, ap.Restart) and restart.attempt == 1 and loop.state.restarts_used == 1
    assert loop.fails() == ap.CheckDataset()
    assert loop(ap.DatasetChecked(failure="dataset: no text files under /data")) == ap.Stop(
        CRASH, "the dataset cache cannot be rebuilt: dataset: no text files under /data")


def test_a_dataset_error_restarts_only_once_the_cache_was_rebuilt():
    damaged = RootCause("dataset", int(ExitCode.DATA), "the cache is truncated: CPU0 (rank 0) was killed by SIGBUS")
    loop = Loop(TRAIN)
    assert loop.fails(damaged) == ap.CheckDataset()
    assert loop(ap.DatasetChecked(rebuilt=False)) == ap.Stop(damaged,
                                                             "a dataset error fails every attempt the same way")
    loop = Loop(TRAIN)
    loop.fails(damaged)
    assert isinstance(loop(ap.DatasetChecked(rebuilt=True)), ap.Restart)


def test_live_recoveries_count_against_max_restarts():
    loop = Loop()
    assert loop.state.live_budget(loop.rules) == 3
    restart = loop.fails(recovered=2)  # two ranks replaced live, then the attempt failed
    assert "restart 3 of 3" in restart.message
    assert (loop.state.recovered, loop.state.restarts_used, loop.state.live_budget(loop.rules)) == (2, 1, 0)
    assert loop.fails() == ap.Stop(CRASH, "all 3 restart(s) used")
    loop = Loop()
    assert loop.fails(recovered=3) == ap.Stop(CRASH, "all 3 restart(s) used")  # recovered, then failed: none left


def test_suspect_gpus_over_the_limit_are_left_out_of_the_next_attempt():
    loop = Loop(ap.Rules(max_restarts=2, train=False, exclude_suspect_gpus=True), GPU4)
    restart = loop.fails(EXIT_8, suspects=(suspect(2, 3), suspect(0, 1)))  # GPU 0 under the limit: kept
    assert [s.device_id for s in restart.plan.slots] == [0, 1, 3] and restart.plan.world_size == 3
    assert [s.rank for s in restart.plan.slots] == [0, 1, 2]
    assert restart.exclude_gpus == (2,) and loop.state.excluded == (2,) and loop.state.plan == restart.plan
    assert restart.said == ("--exclude-suspect-gpus: attempt 1 runs without GPU 2 (3 transient faults, limit 2): "
                            "world size 4 -> 3 (GPU 0, GPU 1, GPU 3)",)
    again = loop.fails(EXIT_8, suspects=(suspect(3, 5),))
    assert [s.device_id for s in again.plan.slots] == [0, 1] and loop.state.excluded == (2, 3)


def test_suspect_gpus_stay_without_the_flag_or_after_another_failure():
    suspects = (suspect(2, 3),)
    assert Loop(SCRIPT, GPU4).fails(EXIT_8, suspects=suspects).plan == GPU4
    flagged = ap.Rules(max_restarts=2, train=False, exclude_suspect_gpus=True)
    assert Loop(flagged, GPU4).fails(CRASH, suspects=suspects).plan == GPU4
    none_blamed = Loop(flagged, GPU4).fails(EXIT_8, suspects=(suspect(2, 1),))
    assert none_blamed.plan == GPU4 and none_blamed.said == (
        "--exclude-suspect-gpus: no GPU of this node went over the limit of transient faults: restarting on the "
        "same GPUs",)
    cpu = Loop(flagged, CPU2)
    assert cpu.fails(EXIT_8).said == ("--exclude-suspect-gpus: CPU workers, nothing to exclude",)
    assert cpu.fails(EXIT_8).said == ()  # said once a run


def test_no_gpu_left_ends_the_run_with_the_attempts_exit_8():
    loop = Loop(ap.Rules(max_restarts=2, train=False, exclude_suspect_gpus=True),
                DevicePlan(slots=(DeviceSlot(0, "cuda", 1),), isolate=True))
    stop = loop.fails(EXIT_8, suspects=(suspect(1, 3),))
    assert stop.cause == EXIT_8 and stop.not_restarted.startswith(
        "--exclude-suspect-gpus: no GPU left for another attempt: every GPU this attempt ran on is suspect (GPU 1)")
    assert loop.state.restarts_used == 0


def test_a_membership_change_restarts_at_once_uncounted_keeping_the_devices():
    joining = RootCause("membership", 0, "node 2 (h2) asks to join")
    loop = Loop(ap.Rules(max_restarts=1, train=True, exclude_suspect_gpus=True), GPU4)
    loop.fails()
    loop(ap.DatasetChecked())
    assert loop.state.streak == 1 and loop.state.restarts_used == 1
    restart = loop.fails(joining, newest="/ck/step_0000008.pt")  # no dataset check: nobody failed
    assert restart.membership and restart.delay == 0.0 and restart.plan == GPU4
    assert restart.message == ("attempt 1 ended (node 2 (h2) asks to join); restarting in 0 s, "
                               "resuming from /ck/step_0000008.pt")
    assert (loop.state.attempt, loop.state.restarts_used, loop.state.streak) == (2, 1, 1)
    assert loop.fails(joining, stop_signal="SIGTERM") == ap.Stop(joining, "the supervisor received SIGTERM")


@pytest.mark.parametrize(("signum", "in_pause", "kind", "code", "said"), [
    (signal.SIGINT, True, "interrupted", 130, "interrupted by Ctrl-C (SIGINT) during the pause before attempt 1"),
    (signal.SIGTERM, True, "terminated", 143, "the supervisor received SIGTERM during the pause before attempt 1"),
    (signal.SIGINT, False, "interrupted", 130, "interrupted by Ctrl-C (SIGINT) between attempts"),
])
def test_a_stop_signal_between_attempts_ends_the_run_with_its_cause(signum, in_pause, kind, code, said):
    loop = Loop()
    loop.fails()
    stop = loop(ap.Interrupted(signum, in_pause=in_pause))
    assert (stop.cause.kind, stop.cause.exit_code, stop.cause.message, stop.not_restarted) == (kind, code, said, None)


def test_node_0_of_a_preempted_slurm_job_asks_for_the_requeue():
    preempted = RootCause("terminated", 143, "stopped by SLURM: preemption (SIGTERM); checkpoint step 3 saved: x",
                          signal="SIGTERM", slurm_stop=True, preempted=True)
    assert ap.requeue_wanted(preempted, node_rank=0, slurm_job_id="42")
    assert not ap.requeue_wanted(preempted, node_rank=1, slurm_job_id="42")  # node 0 asks, once every node ended
    assert not ap.requeue_wanted(preempted, node_rank=0, slurm_job_id=None)
    assert not ap.requeue_wanted(RootCause("terminated", 143, "stopped by SLURM: scancel (SIGTERM)", signal="SIGTERM",
                                           slurm_stop=True), node_rank=0, slurm_job_id="42")
    # the fact is the field: words that look like a preemption do not make one
    assert not ap.requeue_wanted(RootCause("worker-exit", 1, "stopped by SLURM: preemption (quoted by a worker)"),
                                 node_rank=0, slurm_job_id="42")
    assert not ap.requeue_wanted(None, node_rank=0, slurm_job_id="42")


def test_a_scripts_restart_names_the_last_save_gpuherd_saw_never_a_fresh_start():
    """A --script resumes from what it saved itself, as its code decides: the line says the script
    starts again and what gpuherd saw of its saves, never 'no checkpoint written yet'."""
    saw = "the last save gpuherd saw: rank 0's torch.save to /ck/last.pt after 40 optimizer step(s) of attempt 0"
    restart = Loop().fails(saw=saw)
    assert restart.resume is None and restart.message == (
        "attempt 0 failed (CPU1 (rank 1) exit code 1 after 2.0 s); restart 1 of 3 in 0.2 s, the script starts "
        f"again with the same command; {saw}")

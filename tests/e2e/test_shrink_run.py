"""Shrinking instead of stopping, through the whole product: one of 4 ranks SIGKILLed mid-run with
no warm spare (--spares 0 --min-replicas 2): the other 3 keep their processes, one of them carries
the lost rank's data slot, nobody restarts, and every loss and gradient norm of the run equals an
undisturbed 4-rank run's within float32 rounding (the all-reduce sums over 3 ranks, not 4). With
--spares 1 the pool's refill, once warm, grows the group back to 4 at a step boundary (with --spares
0, the spare an operator starts with `gpuherd spare RUN`), and every sample is trained exactly once,
in the undisturbed run's order."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections import defaultdict

import orjson
import psutil
import pytest

from gpuherd.checkpoint_layout import list_checkpoints
from tests.e2e.helpers import cut_short, every_spare, records
from tests.e2e.test_live_recovery_run import PLAIN_RUNS, STEPS, _command, _losses, _pid, _reached, \
    _uninterrupted
from tests.supervisor.helpers import finish, wait_for

# Relative difference allowed per logged loss and gradient norm: measured at most 1.1e-7 (one
# float32 ulp) over 40 steps of the tiny model; a step that dropped or double-counted the lost
# slot's samples moves the gradient norm by percent.
TOLERANCE = 1e-5


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= TOLERANCE * abs(expected)


SAVE_EVERY = 10  # periodic saves (asynchronous), some of them while shrunk: the group's first rank writes them
KEEP_LAST = 2  # the debug preset's training.keep_last


def _saves(cwd, run_dir, final: int) -> dict[int, set[int]]:
    """step -> the ranks that reported publishing its checkpoint (an asynchronous save: only the
    rank that wrote it; the final one, written while the loop waits: every rank), after checking
    the directory holds only the newest KEEP_LAST of them, the final one (step `final`)
    included: whoever wrote them also pruned them. (A save whose writer was the rank SIGKILLed
    may be on disk without its record, or neither.)"""
    published: dict[int, set[int]] = defaultdict(set)
    for r in records(run_dir, "checkpoint"):
        published[r["step"]].add(r["rank"])
    on_disk = [step for step, _ in list_checkpoints(cwd / ".checkpoints")]
    assert on_disk[-1] == final and len(on_disk) == min(KEEP_LAST, len(published)), (on_disk, dict(published))
    assert set(sorted(published)[-KEEP_LAST + 1:]) <= set(on_disk), (on_disk, dict(published))
    return published


def _written_by_the_lead(published: dict[int, set[int]], since: int, until: float, lead: int) -> None:
    """Every asynchronous save of the steps in (since, until] came from `lead`: the first rank of
    the group that trained them (rank 0, or its lowest survivor while a shrunk group lacked it)."""
    assert all(ranks == {lead} for step, ranks in published.items() if since < step <= until), (lead, published)


def _start_shrinkable(tmp_path, python_env, run_id: str, spares: str, *extra: str, **kw):
    """A 4-rank run that shrinks instead of restarting (--min-replicas 2), saving every SAVE_EVERY
    steps; (its process, its run directory)."""
    proc = subprocess.Popen(_command(run_id, "--max-restarts", "2", "--spares", spares, "--min-replicas", "2", *extra,
                                     nproc=4, **kw) + ["--set", f"training.save_every={SAVE_EVERY}"],
                            cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, tmp_path / "logs" / run_id


def test_a_rank_lost_with_no_spare_left_shrinks_the_group_with_the_same_samples_and_losses(
        tmp_path, tmp_path_factory, python_env):
    plain = _uninterrupted(tmp_path_factory, python_env, 4)
    plain_norms = {r["step"]: r["grad_norm"] for r in records(PLAIN_RUNS[4], "step")}
    kill_at, lost = random.randint(3, STEPS - 10), random.choice([0, 1, 2, 3])
    proc, run_dir = _start_shrinkable(tmp_path, python_env, "sh", "0")
    try:
        assert wait_for(lambda: _reached(run_dir, kill_at), timeout=240, interval=0.02)
        pids = {rank: _pid(run_dir, rank) for rank in range(4)}
        psutil.Process(pids[lost]).send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, f"rank {lost} killed at step {kill_at}: {err[-3000:]}"
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, err[-3000:]
    (rec,) = summary["recoveries"]
    survivors = {rank: pid for rank, pid in pids.items() if rank != lost}
    assert rec["outcome"] == "recovered" and rec["action"] == "shrink" and rec["rank"] == lost
    assert rec["replicas"] == 3 and rec["replaced_by_pid"] == 0 and rec["checkpoint_reads"] == 0
    assert 0 < rec["seconds"] < rec["shrunk_s"] < summary["duration_s"]
    assert rec["survivors"] == [{"rank": rank, "pid": pid} for rank, pid in survivors.items()]
    assert {w["rank"]: w["pid"] for w in summary["workers"] if w["exit_code"] == 0} == survivors  # kept their pids
    assert "3 worker(s) exited 0" in err and "went on with its data slot" in err
    # rank 0 lost: its lowest survivor, rank 1, leads the shrunk group: it writes and prunes the checkpoints
    lead = min(survivors)
    assert (f"rank {lead} leads in its place" in err) == (lost == 0)
    _written_by_the_lead(_saves(tmp_path, run_dir, STEPS), rec["resumed_step"], STEPS - 1, lead)  # the final: all

    # every data slot trained by exactly one survivor in the shrunk group, the lost one by rank lost % 3
    rejoined = [r for r in records(run_dir, "live") if r.get("event") == "rejoined"]
    assert sorted(s for r in rejoined for s in r["slots"]) == [0, 1, 2, 3] and len(rejoined) == 3
    carrier = sorted(survivors)[lost % 3]
    assert [r["slots"] for r in rejoined if r["rank"] == carrier] == [[carrier, lost]]

    # the same global batch in the same order: the gradient norm (of all slots' samples) and every
    # survivor's loss match the undisturbed run's at every step, bit for bit before the loss
    steps = records(run_dir, "step")
    assert {r["step"] for r in steps if r["rank"] != lost} == set(range(STEPS))
    for r in steps:
        assert _close(r["loss"], plain[(r["rank"], r["step"])]), r
        assert _close(r["grad_norm"], plain_norms[r["step"]]), r
        if r["step"] < rec["resumed_step"] - 1:
            assert r["loss"] == plain[(r["rank"], r["step"])]
    final = {r["rank"]: r["loss"] for r in steps if r["step"] == STEPS - 1}
    assert final.keys() == survivors.keys() and all(_close(v, plain[(r, STEPS - 1)]) for r, v in final.items())


LONG = 100000  # max_steps of both runs: each is stopped (Ctrl-C) once past the step it is compared to
SAMPLES = ["--set", "debug.record_samples=true"]
AFTER_REGROW = 5  # steps trained whole again before the stop


def _draws(run_dir) -> dict[tuple[int, int], list[tuple[int, tuple[int, int, int]]]]:
    """(step, data slot) -> every (rank, draw) a logged step record names (the last record of a
    (rank, step): a step done again counts once)."""
    last = {(r["rank"], r["step"]): r for r in records(run_dir, "step") if "loss" in r}
    out: dict[tuple[int, int], list] = defaultdict(list)
    for (rank, step), r in last.items():
        s = r["samples"]
        for i in range(0, len(s), 3):
            out[(step, s[i])].append((rank, tuple(s[i:i + 3])))
    return out


def no_spare_left(supervisor_pid: int) -> set[int]:
    """The standing spares die first: the pool's spare source and every spare it forked; their pids."""
    spares = every_spare(supervisor_pid)
    assert spares, "no warm spare found"
    for spare in spares:
        spare.send_signal(signal.SIGKILL)
    assert wait_for(lambda: all(_dead(spare) for spare in spares), timeout=10)
    return {spare.pid for spare in spares}


def _dead(p: psutil.Process) -> bool:
    """Exited whole: gone, or a zombie its parent (the supervisor) can reap. A killed process's
    leader can show as a zombie while another of its threads (the warm-up's, at nice 19 on a
    loaded machine) has not ended yet; its parent's waitpid still sees it alive then, and the
    pool would hand the lost rank to it."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE and os.listdir(f"/proc/{p.pid}/task") == [str(p.pid)]
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def _regrown(run_dir) -> dict | None:
    return next((r for r in records(run_dir, "recovery") if r.get("action") == "regrow"), None)


def _undisturbed_to(step: int, cwd, python_env):
    """An undisturbed 4-rank run of the same settings, stopped by Ctrl-C once every rank logged `step`."""
    proc = subprocess.Popen(_command("plain", *SAMPLES, nproc=4, steps=LONG), cwd=cwd, env=python_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = cwd / "logs" / "plain"
    try:
        assert wait_for(lambda: len({r["rank"] for r in records(run_dir, "step") if r["step"] >= step}) == 4,
                        timeout=300, interval=0.05)
        proc.send_signal(signal.SIGINT)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 130, err[-3000:]
    return run_dir


def _ask_spare(run_dir, python_env, *extra: str) -> subprocess.CompletedProcess:
    """`gpuherd spare RUN_DIR` as an operator types it."""
    return subprocess.run([sys.executable, "-m", "supervisor.commands.spare", str(run_dir), *extra],
                          env=python_env, capture_output=True, text=True, timeout=60)


def _asked_once_shrunk(run_dir, python_env, lost: int) -> int:
    """`gpuherd spare` once the supervisor has reaped the lost rank (until then: refused, exit 10,
    "not shrunk"); the spare's pid, as the command says it."""
    asked = None

    def granted() -> bool:
        nonlocal asked
        asked = _ask_spare(run_dir, python_env)
        assert asked.returncode in (0, 10) and (asked.returncode == 0 or "not shrunk" in asked.stderr), asked.stderr
        return asked.returncode == 0
    assert wait_for(granted, timeout=60, interval=0.2)
    said = re.search(r"warm spare pid (\d+) started for rank (\d+) on CPU(\d+)", asked.stdout)
    assert said and int(said[2]) == int(said[3]) == lost, asked.stdout  # the device the lost rank left
    return int(said[1])


@pytest.mark.slow  # two 4-rank runs, and the spare's warm-up at nice 19 beside 3 busy ranks
def test_a_shrunk_group_grows_back_when_the_pools_spare_is_warm_with_every_sample_trained_once(
        tmp_path, tmp_path_factory, python_env):
    """No spare (the standing one SIGKILLed, or --spares 0), then one of the 4 ranks SIGKILLed at a
    random step: 3 train on, the pool's new spare (or the one `gpuherd spare` starts) warms up (as
    long as the machine lets a nice-19 thread take) and takes the rank back at a step boundary
    (rank 0 lost: rank 1 leads meanwhile, writing the checkpoints); the run is stopped a few steps
    later and compared with an undisturbed run stopped past the same step."""
    kill_at, lost, operator = random.randint(3, 15), random.choice([0, 1, 2, 3]), random.choice([False, True])
    proc, run_dir = _start_shrinkable(tmp_path, python_env, "rg", "0" if operator else "1", *SAMPLES, steps=LONG)
    missed = ""
    try:
        assert wait_for(lambda: _reached(run_dir, kill_at), timeout=240, interval=0.02)
        pids = {rank: _pid(run_dir, rank) for rank in range(4)}
        if operator:  # nothing lost: nothing to grow back
            whole = _ask_spare(run_dir, python_env)
            assert whole.returncode == 10 and "not shrunk: all 4 ranks train" in whole.stderr, whole.stderr
        else:
            killed = no_spare_left(proc.pid)
        psutil.Process(pids[lost]).send_signal(signal.SIGKILL)
        if operator:
            spare = psutil.Process(_asked_once_shrunk(run_dir, python_env, lost))
        if not wait_for(lambda: (_regrown(run_dir) or {}).get("outcome") == "recovered", timeout=400, interval=0.1):
            missed = "no regrow recovered in 400 s"
        else:
            back = _regrown(run_dir)["resumed_step"]
            if not wait_for(lambda: _reached(run_dir, back + AFTER_REGROW), timeout=120, interval=0.02):
                missed = f"step {back + AFTER_REGROW} not reached in 120 s"
    finally:
        proc.send_signal(signal.SIGINT)  # either way: a missed wait is told with the run's own words below
        code, _out, err = finish(proc, timeout=300)
    assert not missed, f"{missed}; rank {lost} killed at step {kill_at}: {err[-3000:]}"
    assert code == 130, f"rank {lost} killed at step {kill_at}: {err[-3000:]}"
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, err[-3000:]
    assert [(r["action"], r["outcome"], r["rank"]) for r in summary["recoveries"]] == [
        ("shrink", "recovered", lost), ("regrow", "recovered", lost)], err[-3000:]
    shrink, regrow = summary["recoveries"]
    assert regrow["kind"] == "regrow" and regrow["replicas"] == 4 and regrow["replaced_by_pid"] != 0
    if operator:
        assert regrow["replaced_by_pid"] == spare.pid  # the spare asked for
    else:
        assert regrow["replaced_by_pid"] not in killed  # the pool's refill
    assert 0 < regrow["shrunk_s"] == shrink["shrunk_s"] < summary["duration_s"] and regrow["steps_redone"] == 0
    assert shrink["resumed_step"] <= regrow["resumed_step"]
    survivors = {rank: pid for rank, pid in pids.items() if rank != lost}
    assert regrow["survivors"] == [{"rank": rank, "pid": pid} for rank, pid in survivors.items()]
    assert {w["rank"]: w["pid"] for w in summary["workers"] if w["exit_code"] == 130} == {
        **survivors, lost: regrow["replaced_by_pid"]}
    assert f"regrow: warm spare pid {regrow['replaced_by_pid']} took back rank {lost}" in err
    assert 0 < summary["goodput"]["shrunk_s"] <= summary["goodput"]["wall_s"]
    # the shrunk group's first rank wrote its checkpoints (rank 1 when rank 0 was lost), the regrown
    # group's rank 0 (the newcomer, when it took rank 0 back) the ones after, and the final one on Ctrl-C
    last = max(r["step"] for r in records(run_dir, "step") if r["rank"] == 0)
    published = _saves(tmp_path, run_dir, last + 1)
    _written_by_the_lead(published, shrink["resumed_step"], regrow["resumed_step"], min(survivors))
    _written_by_the_lead(published, regrow["resumed_step"], last, 0)

    steps = records(run_dir, "step")  # every rank stopped at the same step boundary, `last`
    plain_dir = _undisturbed_to(last, tmp_path_factory.mktemp("plain-sampled"), python_env)
    plain, plain_norms = _losses(plain_dir), {r["step"]: r["grad_norm"] for r in records(plain_dir, "step")}
    expected = {key: got[0][1] for key, got in _draws(plain_dir).items() if key[0] <= last}
    assert len(expected) == 4 * (last + 1) and len(set(expected.values())) == len(expected)

    # every (step, slot) drawn exactly once, the undisturbed run's windows: none skipped, none repeated.
    # Twice only for the lost rank's last step before its death, which the shrunk group trained again.
    carrier = sorted(survivors)[lost % 3]
    draws = _draws(run_dir)
    # A SIGKILL after the lost rank's last all-reduce but before its step record was written: the
    # step was kept with its slot (its gradient norm, checked below, says so) and its draw has no record;
    # nor has a survivor's that was still in that all-reduce when another survivor completed it.
    behind = cut_short([run_dir], shrink["resumed_step"])
    unrecorded = set(expected) - set(draws)
    assert unrecorded <= {(shrink["resumed_step"] - 1, rank) for rank in {lost, *behind}}, (
        unrecorded, shrink["resumed_step"], lost, behind)
    assert set(draws) == set(expected) - unrecorded
    for (step, slot), got in draws.items():
        assert {draw for _rank, draw in got} == {expected[(step, slot)]}, (step, slot, got)
        if len(got) > 1:
            assert sorted(rank for rank, _d in got) == sorted([lost, carrier]) and slot == lost, (step, got)
            assert step <= shrink["resumed_step"]
    carried = {step for (step, slot), got in draws.items() for rank, _d in got if rank == carrier and slot == lost}
    assert carried == set(range(shrink["resumed_step"], regrow["resumed_step"]))  # carried while shrunk, only then

    # the losses (each rank's own, and the carried slot's, now logged) and gradient norms match the
    # undisturbed run's within float32 rounding at every step, the final one included
    for r in (r for r in steps if "loss" in r):
        assert _close(r["loss"], plain[(r["rank"], r["step"])]) and _close(r["grad_norm"], plain_norms[r["step"]]), r
        for slot, loss in zip(r.get("carried", ()), r.get("carried_loss", ())):
            assert r["rank"] == carrier and slot == lost and _close(loss, plain[(lost, r["step"])]), r
    final = {r["rank"]: r["loss"] for r in steps if r["step"] == last}
    assert final.keys() == set(range(4)) and all(_close(v, plain[(r, last)]) for r, v in final.items())
    worst = max(abs(r["loss"] - plain[(r["rank"], r["step"])]) / abs(plain[(r["rank"], r["step"])])
                for r in steps if "loss" in r)
    print(f"regrow at step {regrow['resumed_step']} after {regrow['shrunk_s']} s shrunk; {last + 1} steps; "
          f"worst relative loss difference {worst:.2e}")

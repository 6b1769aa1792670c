"""A node that died comes back (issue 43): supervisors on localhost run one job (`--nnodes 2`,
one CPU worker each, gloo); node 1's whole process tree (supervisor, node agent, orphan guard,
workers) is SIGKILLed, as a host reboot, an OOM-killed supervisor or a scheduler restarting a
pod does, and node 1 is started again 2 s later with the same command line (`--force`: its
run directory exists). Its old agent is known dead (its connection to node 0 closed), so the
new one takes `--node-rank 1` back and joins node 0's restart: the job finishes with exit 0,
the restart resumes from the newest checkpoint, and every loss equals an uninterrupted run's,
bit for bit. The same when a spare node (`--spare-nodes 1`) given node 1's place dies in the
takeover; and a frozen (SIGSTOPped) spare node is never given it: node 0 passes it over, and
when it wakes it ends itself with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from bench.launchers import tree_pids
from tests.conftest import subprocess_env
from tests.e2e.helpers import records, running
from tests.supervisor.helpers import finish, wait_for
from tests.worker.helpers import free_port

STEPS = 10
TINY = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
        "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", f"training.max_steps={STEPS}", "training.warmup_steps=2",
        "training.log_every=1", "training.eval_every=0", "training.save_every=3", "training.keep_last=2"]


def _command(*extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", *extra]
    for item in TINY:
        cmd += ["--set", item]
    return cmd


def _node(tmp_path, python_env, node: int, port: int, *extra: str) -> subprocess.Popen:
    """`extra`: "--spares", "0" for a plain job; "--spare-nodes", "1" for one with a spare node."""
    cmd = _command("--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                   "--master-port", str(port), "--run-id", "job", "--max-restarts", "2", "--restart-backoff", "0.5",
                   *extra)
    return subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[tuple[int, int], float]:
    """The same model and data on one node with two ranks (the same global ranks, the same gloo
    reduction over localhost): the losses the job has when nothing goes wrong."""
    plain = tmp_path_factory.mktemp("plain")
    run = subprocess.run(_command("--nproc", "2", "--run-id", "plain"), cwd=plain, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = {(r["rank"], r["step"]): r["loss"] for r in records(plain / "logs" / "plain", "step") if "loss" in r}
    assert len(losses) == 2 * STEPS
    return losses


def _signal_whole(proc: subprocess.Popen, sig: int) -> None:
    """Every process of the node's tree at once (gathered first): SIGKILL, the machine gone."""
    for pid in tree_pids(proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGKILL:
        proc.wait()


def _after_a_checkpoint(job, node: int) -> int:
    """Once node 0 saved a checkpoint mid-run: the last step node `node` logged."""
    dirs = [job / "logs" / f"job-node{n}" for n in (0, node)]
    assert wait_for(lambda: any(r["step"] >= 3 for r in records(dirs[0], "checkpoint")), timeout=240, interval=0.02)
    return max(r["step"] for r in records(dirs[1], "step"))


def _job_losses(job) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss over every node's run directory; a step done twice counts with its last value."""
    return {(r["rank"], r["step"]): r["loss"] for d in sorted((job / "logs").iterdir())
            for r in records(d, "step") if "loss" in r}


def _it_rejoined(job, expected, outputs) -> dict:
    """Node 0 and node 1 (started again) ended 0; the restart resumed node 0's newest checkpoint on
    both; every loss is the uninterrupted run's. Node 0's summary."""
    for name, (code, _out, err) in outputs.items():
        assert code == 0, f"{name}: {err[-3000:]}"
        assert "already taken" not in err
    summary = orjson.loads((job / "logs" / "job-node0" / "summary.json").read_bytes())
    assert summary["restarts"] == 1 and summary["attempts"][0]["root_cause"]["node"] == 1
    resumed = summary["attempts"][1]["resumed_from"]
    assert resumed is not None
    rejoined = orjson.loads((job / "logs" / "job-node1" / "summary.json").read_bytes())
    assert rejoined["attempts"][-1]["resumed_from"] == resumed
    assert _job_losses(job) == expected  # every step of both ranks: bit for bit
    return summary


def _job_with_a_rejoin(job, python_env, extra: tuple[str, ...], disrupt, woken=None) -> dict[str, tuple]:
    """Nodes 0 and 1 (and spare node 2, with --spare-nodes) run the job; once node 0 saved a
    checkpoint, `disrupt(procs, port)` kills node 1 whole (and does what else the case does); 2 s
    later node 1 is started again with the same command line and --force, then `woken(procs)`
    (its result kept as "woken"). Every node's (code, out, err) by name; nothing left running."""
    port = free_port()
    procs = [_node(job, python_env, n, port, *extra) for n in ((0, 1, 2) if "--spare-nodes" in extra else (0, 1))]
    outputs = {}
    try:
        if len(procs) > 2:
            standing = job / "logs" / "job-node2" / "supervisor.log"
            assert wait_for(lambda: standing.exists() and "standing by in the job" in standing.read_text(), timeout=240)
        killed_after = _after_a_checkpoint(job, 1)
        disrupt(procs, port)
        assert killed_after < STEPS - 1, "the job finished before the kill: make it longer"
        time.sleep(2)
        procs[1] = _node(job, python_env, 1, port, *extra, "--force")
        if woken is not None:
            outputs["woken"] = woken(procs)
        outputs["node 1 again"] = finish(procs[1], timeout=300)
    finally:
        outputs["node 0"] = finish(procs[0], timeout=300)
        for proc in procs:
            if proc.poll() is None:
                _signal_whole(proc, signal.SIGKILL)
    return outputs


@pytest.mark.slow  # three supervisors' starts and a restart: 110-120 s at load 11 on 2 cores
def test_a_node_killed_whole_and_started_again_rejoins_its_job_at_the_restart(tmp_path, python_env, expected):
    outputs = _job_with_a_rejoin(tmp_path, python_env, ("--spares", "0"),
                                 lambda procs, port: _signal_whole(procs[1], signal.SIGKILL))
    _it_rejoined(tmp_path, expected, outputs)


def _kill_node_1_then_the_spare_node_given_its_place(procs, port) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    _signal_whole(procs[1], signal.SIGKILL)
    store.wait(["a0/promote2"], timedelta(seconds=60))  # node 0 gave node 1's place to the spare node ...
    _signal_whole(procs[2], signal.SIGKILL)  # ... which dies before its workers joined


@pytest.mark.slow  # three supervisors' starts and a restart: 110-120 s at load 11 on 2 cores
def test_a_spare_node_that_dies_in_the_takeover_leaves_the_rank_to_the_node_started_again(tmp_path, python_env, expected):
    outputs = _job_with_a_rejoin(tmp_path, python_env, ("--spare-nodes", "1"),
                                 _kill_node_1_then_the_spare_node_given_its_place)
    summary = _it_rejoined(tmp_path, expected, outputs)
    (rec,) = summary["recoveries"]  # the takeover began, and ended with the spare node's death
    assert (rec["action"], rec["spare_node"], rec["node"], rec["outcome"]) == ("spare-node", 2, 1, "failed")


def _freeze_the_spare_node_and_kill_node_1(procs, port) -> None:
    _signal_whole(procs[2], signal.SIGSTOP)
    _signal_whole(procs[1], signal.SIGKILL)


@pytest.mark.slow  # three supervisors' starts and a restart: 110-120 s at load 11 on 2 cores
def test_a_frozen_spare_node_is_passed_over_and_ends_itself_when_it_wakes(tmp_path, python_env, expected):
    def wake(procs):
        log = tmp_path / "logs" / "job-node0" / "supervisor.log"
        assert wait_for(lambda: "attempt 1: spawned" in log.read_text(), timeout=240)  # node 1 rejoined
        frozen = tree_pids(procs[2].pid)  # its supervisor, agent, orphan guard and warm worker
        _signal_whole(procs[2], signal.SIGCONT)
        ended = finish(procs[2], timeout=120)
        assert wait_for(lambda: not running(frozen), timeout=30)  # no orphaned process
        return ended

    outputs = _job_with_a_rejoin(tmp_path, python_env, ("--spare-nodes", "1"), _freeze_the_spare_node_and_kill_node_1,
                                 wake)
    code, _out, err = outputs.pop("woken")
    summary = _it_rejoined(tmp_path, expected, outputs)
    assert summary["recoveries"] == []  # the frozen spare node never took node 1's place
    assert code == 0, err[-3000:]  # a spare node: nothing of it ran (srun --kill-on-bad-exit would end the job)
    said = [line for line in err.splitlines() if "passed it over" in line]
    assert len(said) == 1 and "spare node 2: node 0 needed it in round 0" in said[0], err[-3000:]
    assert "Traceback" not in err and "lost the job store" not in err

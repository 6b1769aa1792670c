"""gpuherd jobs on a real two-node SLURM cluster (tests/slurm/cluster.py), written by `gpuherd
sbatch` for CPU-only nodes, end to end: a clean job, scancel, `scancel --signal=USR1`, the time
limit with its warning, `scontrol requeue`, a preemption by a higher partition tier (requeued),
the script submitted again, a node's supervisor SIGKILLed, a network partition, a worker
failure restarted with --max-restarts 1 (--spares 0), and replaced live by its node's spare. Every job must leave nothing running on any node
and the same outcome on every node.

Opt-in and slow (tests/slurm/conftest.py): GPUHERD_SLURM_TESTS=1 pytest -m slurm -n 0 tests/slurm
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from supervisor.commands import sbatch
from tests.slurm.cluster import Cluster
from tests.supervisor.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
    "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", "training.warmup_steps=2", "training.log_every=1", "training.eval_every=0",
    "training.save_every=0", "debug.log_level=INFO",
]
STEPS = 12  # a job that runs to its end; a job meant to be stopped runs 100000
DONE_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")


@dataclass
class Job:
    cluster: Cluster
    workdir: Path
    id: str
    run_id: str  # the script's (gpuherd sbatch writes one into it)
    script: Path

    def run_dir(self, node: int) -> Path:
        return self.workdir / "logs" / f"{self.run_id}-node{node}"

    def submit_again(self) -> Job:
        """The same script, submitted again: a new job id, the same run."""
        return Job(self.cluster, self.workdir, self.cluster.sbatch(self.script), self.run_id, self.script)

    def summary(self, node: int) -> dict:
        return orjson.loads((self.run_dir(node) / "summary.json").read_bytes())

    def output(self) -> str:
        path = self.workdir / "out" / f"gpuherd-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def steps(self, node: int = 0) -> dict[int, float]:
        """Rank 0's loss at every step it reported (node 0's metrics.jsonl, every start of the job)."""
        path = self.run_dir(node) / "metrics.jsonl"
        losses = {}
        for line in path.read_bytes().splitlines() if path.exists() else []:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # being written
            if record.get("type") == "step" and record.get("rank") == 0:
                losses[int(record["step"])] = float(record["loss"])
        return losses

    def wait_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if max(self.steps(), default=-1) >= step:
                return
            assert self.cluster.job(self.id).get("JobState") not in DONE_STATES, self.output()[-3000:]
            time.sleep(0.5)
        raise AssertionError(f"job {self.id} never reached step {step}:\n{self.output()[-3000:]}")

    def wait_done(self, timeout: float = 240) -> dict[str, str]:
        info = self.cluster.wait_job(self.id, DONE_STATES, timeout)
        assert_nothing_left(self.cluster)
        return info

    def supervisor_pid(self, node: str) -> int:
        for pid in self.cluster.processes(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"supervisor" in cmdline and b"--slurm" in cmdline:
                return pid
        raise AssertionError(f"no supervisor of job {self.id} on {node}")


def assert_nothing_left(cluster: Cluster, timeout: float = 30) -> None:
    """No process of any job on any node (slurmstepd included) a little after the job ended."""
    deadline = time.monotonic() + timeout
    while True:
        left = {node: cluster.processes(node) for node in cluster.names}
        if not any(left.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running after the job: {left}")
        time.sleep(0.5)


def submit(cluster: Cluster, workdir: Path, *train_args: str, steps: int = 100000, stop_warning: int = 0,
           requeue: bool = False, sbatch_options: tuple[str, ...] = (), spare_nodes: int = 0) -> Job:
    """`gpuherd sbatch --cpu` for 2 nodes x 1 CPU worker (and `spare_nodes` more), submitted."""
    paths = [f"system.run_root={workdir / 'logs'}", f"system.checkpoint_dir={workdir / 'ckpt'}",
             f"data.cache_dir={workdir / 'cache'}"]
    settings = [part for item in [*TINY, *paths, f"training.max_steps={steps}"] for part in ("--set", item)]
    argv = ["--nodes", "2", "--cpu", "--cpus-per-task", "1", "--stop-warning", str(stop_warning),
            "--log-dir", str(workdir / "out"), *(["--requeue"] if requeue else []),
            *(["--spare-nodes", str(spare_nodes)] if spare_nodes else []),
            "--", "--debug", "--no-report", *settings, *train_args]
    options, _ = sbatch.parse(argv)
    cluster.wait_idle()  # a node the previous test partitioned comes back first
    script = workdir / "job.sbatch"
    script.write_text(sbatch.render_sbatch(options))
    (workdir / "out").mkdir(exist_ok=True)
    assert options.run_id
    return Job(cluster, workdir, cluster.sbatch(script, *sbatch_options), options.run_id, script)


def same_outcome(job: Job) -> str:
    """The root cause's message, identical on both nodes."""
    first, second = job.summary(0), job.summary(1)
    assert first["root_cause"]["message"] == second["root_cause"]["message"], (first["root_cause"], second["root_cause"])
    assert first["exit_code"] == second["exit_code"]
    return first["root_cause"]["message"]


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory) -> Job:
    """The clean two-node job every resumed job's losses are compared with."""
    job = submit(cluster, tmp_path_factory.mktemp("clean"), steps=STEPS)
    job.wait_done()
    return job


def test_clean_two_node_job(uninterrupted: Job):
    info = uninterrupted.cluster.job(uninterrupted.id)
    assert info["JobState"] == "COMPLETED", uninterrupted.output()[-3000:]
    assert sorted(uninterrupted.steps()) == list(range(STEPS))
    for node in (0, 1):
        s = uninterrupted.summary(node)
        assert s["exit_code"] == 0 and s["nnodes"] == 2 and s["node_rank"] == node


def test_scancel_saves_the_step_on_every_node(cluster: Cluster, workdir: Path):
    job = submit(cluster, workdir)
    job.wait_step(1)
    cluster.sx("scancel", job.id)
    job.wait_done()
    message = same_outcome(job)
    assert message.startswith("stopped by SLURM: scancel (SIGTERM); checkpoint step "), message
    step = int(message.split("checkpoint step ")[1].split()[0])
    assert (workdir / "ckpt" / f"step_{step:07d}.pt").exists()
    assert job.summary(0)["exit_code"] == 143 and job.summary(0)["final_save"] == "saved"
    out = job.output()
    assert "exiting now" not in out and "FAILED" not in out
    # one stream: the job's summary printed once, by node 0, with both nodes in it; node 1 points to it
    assert out.count(f"gpuherd: run {job.run_id} stopped (exit 143)") == 1, out[-3000:]
    assert out.count("the job's summary is printed by node 0") == 1, out[-3000:]
    assert [line.split(" (")[0] for line in out.splitlines() if re.match(r"node [01] \(", line)] == ["node 0", "node 1"]


def test_usr1_warning_is_one_quiet_line_per_node_and_no_stacks(cluster: Cluster, workdir: Path):
    job = submit(cluster, workdir)
    job.wait_step(1)
    cluster.sx("scancel", "--signal=USR1", job.id)
    job.wait_done()
    message = same_outcome(job)
    assert message.startswith("stopped by SLURM: the time limit is near (SIGUSR1"), message
    out = job.output()
    assert "most recent call first" not in out  # no stack dump
    warnings = [line for line in out.splitlines() if re.match(r"n[01]/supervisor:WARNING", line)]
    assert len(warnings) == 2, warnings  # one per node
    assert "checkpoint step " in message and job.summary(1)["final_save"] == "saved"


def test_time_limit_warning_saves_before_the_limit(cluster: Cluster, workdir: Path):
    """--signal=USR1@50: once the limit is 1 minute away SLURM sends the warning at its next
    check (every ~30 s); the job saves and stops before the time limit kills it."""
    job = submit(cluster, workdir, stop_warning=50)
    job.wait_step(1)
    elapsed_min = int(cluster.job(job.id)["RunTime"].split(":")[-2]) + 1
    cluster.sx("scontrol", "update", f"JobId={job.id}", f"TimeLimit={elapsed_min + 1}")
    info = job.wait_done(timeout=300)
    message = same_outcome(job)
    assert message.startswith("stopped by SLURM: the time limit is near (SIGUSR1"), (message, info["JobState"])
    assert "checkpoint step " in message


def test_requeue_continues_the_run_and_matches_an_uninterrupted_one(cluster: Cluster, workdir: Path,
                                                                    uninterrupted: Job):
    job = submit(cluster, workdir, steps=STEPS, requeue=True)
    job.wait_step(2)
    cluster.sx("scontrol", "requeue", job.id)
    info = job.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.output()[-3000:]
    for node in (0, 1):
        s = job.summary(node)
        assert s["exit_code"] == 0 and s["slurm_restart_count"] == 1
        first = s["requeues"][0]
        assert first["exit_code"] == 143 and first["final_save"] == "saved"
        assert first["root_cause"].startswith("stopped by SLURM: requeue (SIGTERM)")
        assert (job.run_dir(node) / "requeue-1").is_dir()
        assert s["attempts"][0]["resumed_from"]
    out = job.output()
    assert out.count("gpuherd: job ") == 2  # both starts' output in the one file (--open-mode=append)
    losses, reference = job.steps(), uninterrupted.steps()
    assert sorted(losses) == list(range(STEPS))
    assert losses[STEPS - 1] == reference[STEPS - 1], (losses, reference)


LONG_STEPS = 60  # long enough that a stop seconds after step 2 (a preemption, a scancel) lands mid-run


@pytest.fixture(scope="module")
def uninterrupted_long(cluster: Cluster, tmp_path_factory) -> Job:
    """The clean two-node job of LONG_STEPS steps."""
    job = submit(cluster, tmp_path_factory.mktemp("clean-long"), steps=LONG_STEPS)
    assert job.wait_done()["JobState"] == "COMPLETED", job.output()[-3000:]
    return job


def test_preempted_job_saves_and_its_requeue_continues_the_run(cluster: Cluster, workdir: Path,
                                                               uninterrupted_long: Job):
    """A job of a higher partition tier (`urgent`, the whole of both nodes) preempts the
    training (PreemptMode=REQUEUE, GraceTime=60): it saves, stops, is requeued, and goes on.
    A job that saves and exits within its GraceTime is not requeued by SLURM (it ends FAILED):
    gpuherd's node 0 asks for the requeue."""
    uninterrupted = uninterrupted_long
    job = submit(cluster, workdir, steps=LONG_STEPS, requeue=True)
    job.wait_step(2)
    urgent = workdir / "urgent.sbatch"
    urgent.write_text("#!/bin/bash\n#SBATCH --partition=urgent --nodes=2 --exclusive --output=/dev/null\nsleep 3\n")
    preemptor = cluster.sbatch(urgent)
    info = job.wait_done(timeout=400)
    assert cluster.job(preemptor)["JobState"] == "COMPLETED"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.output()[-3000:]
    for node in (0, 1):
        s = job.summary(node)
        assert (s["exit_code"], s["start"], s["slurm_restart_count"]) == (0, 1, 1), s
        first = s["requeues"][0]
        assert first["root_cause"].startswith("stopped by SLURM: preemption (SIGTERM)"), first
        assert (first["exit_code"], first["final_save"]) == (143, "saved")
        assert s["attempts"][0]["resumed_from"]
    assert "requeued it (scontrol requeue)" in job.output()
    losses, reference = job.steps(), uninterrupted.steps()
    assert sorted(losses) == list(range(LONG_STEPS))
    assert losses[LONG_STEPS - 1] == reference[LONG_STEPS - 1], (losses, reference)


def test_resubmitted_script_continues_the_run_and_matches_an_uninterrupted_one(cluster: Cluster, workdir: Path,
                                                                               uninterrupted_long: Job):
    """The script submitted again after a scancel (as after a time limit): a new job id, the
    same run directory, resumed from the checkpoint the stop saved."""
    first = submit(cluster, workdir, steps=LONG_STEPS)
    first.wait_step(2)
    cluster.sx("scancel", first.id)
    first.wait_done()
    assert first.summary(0)["final_save"] == "saved", first.output()[-3000:]
    second = first.submit_again()
    assert second.id != first.id
    info = second.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED", second.output()[-3000:]
    for node in (0, 1):
        s = second.summary(node)
        assert (s["exit_code"], s["start"], s["slurm_restart_count"], s["slurm_job_id"]) == (0, 1, 0, second.id)
        earlier = s["requeues"][0]
        assert (earlier["slurm_job_id"], earlier["exit_code"], earlier["final_save"]) == (first.id, 143, "saved")
        assert s["attempts"][0]["resumed_from"]
        assert (second.run_dir(node) / "requeue-1").is_dir()
    assert "was submitted again with --run-id" in second.output()
    losses, reference = second.steps(), uninterrupted_long.steps()
    assert sorted(losses) == list(range(LONG_STEPS))
    assert losses[LONG_STEPS - 1] == reference[LONG_STEPS - 1], (losses, reference)


def test_node_whose_supervisor_is_sigkilled_is_named_on_the_survivor(cluster: Cluster, workdir: Path):
    job = submit(cluster, workdir)
    job.wait_step(1)
    killed_at = time.monotonic()
    cluster.on(cluster.names[1], "kill", "-9", str(job.supervisor_pid(cluster.names[1])))
    summary = job.run_dir(0) / "summary.json"
    deadline = killed_at + 120
    while not summary.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    took = time.monotonic() - killed_at
    job.wait_done()
    cause = job.summary(0)["root_cause"]
    assert cause["message"].startswith(f"node 1 ({cluster.names[1]}) stopped responding"), (cause, took)
    assert job.summary(0)["exit_code"] == 1
    assert took <= 15, f"node 0 named the lost node {took:.1f} s after it died (issue 23: at most 15 s)"


def test_partitioned_node_is_named_from_both_sides(cluster: Cluster, workdir: Path):
    job = submit(cluster, workdir, sbatch_options=("--no-requeue",))  # SLURM would requeue it after NODE_FAIL
    job.wait_step(1)
    cut_at = time.monotonic()
    cluster.partition(cluster.names[1])
    took: dict[int, float] = {}
    try:
        deadline = cut_at + 120
        while len(took) < 2 and time.monotonic() < deadline:
            for n in (0, 1):
                if n not in took and (job.run_dir(n) / "summary.json").exists():
                    took[n] = time.monotonic() - cut_at
            time.sleep(0.2)
    finally:
        cluster.heal(cluster.names[1])
    job.wait_done()
    assert job.summary(0)["root_cause"]["message"].startswith(f"node 1 ({cluster.names[1]}) stopped responding")
    assert "lost the job store" in job.summary(1)["root_cause"]["message"]
    # each side's verdict: 10 s of silence, then the other node's answer is waited for no longer
    assert max(took.values()) <= 20, f"summaries {took} s after the cut (at most 20 s)"


def _workers(cluster: Cluster, node: str) -> tuple[list[int], list[int]]:
    """(training workers, warm spares) among the `python -m worker` processes of `node`."""
    workers, spares = [], []
    for pid in cluster.processes(node):
        try:
            if b"worker" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        (spares if b"GPUHERD_SPARE=1" in environ else workers).append(pid)
    return workers, spares


def _oldest_first(pids: list[int]) -> list[int]:
    """By start time (/proc's starttime, in clock ticks since boot)."""
    def started(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):
            return 1 << 62
    return sorted(pids, key=started)


def test_worker_failure_is_restarted_across_nodes(cluster: Cluster, workdir: Path, uninterrupted: Job):
    job = submit(cluster, workdir, "--max-restarts", "1", "--spares", "0", steps=STEPS)  # no live recovery
    job.wait_step(2)
    worker = next(pid for pid in cluster.processes(cluster.names[1])
                  if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    cluster.on(cluster.names[1], "kill", "-9", str(worker))
    info = job.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED", job.output()[-3000:]
    for node in (0, 1):
        assert job.summary(node)["restarts"] == 1 and job.summary(node)["exit_code"] == 0
    assert job.steps()[STEPS - 1] == uninterrupted.steps()[STEPS - 1]  # the restart lost nothing


def test_worker_lost_on_node_1_is_replaced_live_by_that_nodes_spare(cluster: Cluster, workdir: Path,
                                                                    uninterrupted_long: Job):
    """Node 1 claims the rebuilt group on the job store and promotes its own warm spare; node 0's
    worker keeps its process and hands the state over; nobody restarts, the losses are the same.
    LONG_STEPS: on a loaded host a 12-step job could reach its end before the kill, and node 0's
    worker, done, left no group to rebuild (a restart, rightly)."""
    job = submit(cluster, workdir, "--max-restarts", "1", steps=LONG_STEPS)
    job.wait_step(2)
    (survivor,), _ = _workers(cluster, cluster.names[0])
    # the pool's spare source and the warm spare it forked once warm: a lost rank goes to the fork
    assert wait_for(lambda: len(_workers(cluster, cluster.names[1])[1]) >= 2, timeout=240)
    (victim,), spares = _workers(cluster, cluster.names[1])
    spare = _oldest_first(spares)[1]
    cluster.on(cluster.names[1], "kill", "-9", str(victim))
    info = job.wait_done(timeout=400)
    assert info["JobState"] == "COMPLETED", job.output()[-3000:]
    for node in (0, 1):
        summary = job.summary(node)
        assert summary["restarts"] == 0 and summary["exit_code"] == 0 and len(summary["attempts"]) == 1
        (rec,) = summary["recoveries"]
        assert rec["outcome"] == "recovered" and rec["node"] == 1 and rec["rank"] == 1
        assert rec["lost_pid"] == victim and rec["replaced_by_pid"] == spare and rec["steps_redone"] <= 1
    assert job.summary(0)["workers"][0]["pid"] == survivor  # node 0's worker kept its process
    got, expected = job.steps(), uninterrupted_long.steps()
    assert len(got) == LONG_STEPS and got == expected  # bit for bit, every step

"""A SLURM job script submitted again (a new job id, the same --run-id) continues its run,
and a second start of a run that is still running is refused: the real supervisor under a
one-node SLURM environment (no cluster needed; tests/slurm runs the same on a real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import orjson

from tests.supervisor import helpers as sh


def slurm_env(job_id: str) -> dict[str, str]:
    env = {k: v for k, v in sh.env().items() if not k.startswith("SLURM_")}
    return {**env, "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": "0"}


def supervisor(job_id: str, run_id: str, *behaviours: str) -> list[str]:
    return [sys.executable, "-m", "supervisor", "--slurm", "--run-id", run_id, "--set", "system.device=cpu",
            "--no-report", "--nproc", "1", "--script", str(sh.SCENARIO), *behaviours]


def run(tmp_path, job_id: str, run_id: str, *behaviours: str) -> subprocess.CompletedProcess:
    return subprocess.run(supervisor(job_id, run_id, *behaviours), cwd=tmp_path, env=slurm_env(job_id),
                          capture_output=True, text=True, timeout=120)


def test_the_script_submitted_again_continues_its_run_from_its_checkpoint(tmp_path):
    first = run(tmp_path, "100", "nightly", "save:3")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "logs" / "nightly"
    saved = orjson.loads((run_dir / "summary.json").read_bytes())
    assert (saved["start"], saved["slurm_job_id"]) == (0, "100")

    second = run(tmp_path, "101", "nightly", "env")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "job 101 was submitted again with --run-id nightly: run nightly goes on (start 1)" in second.stderr
    env = json.loads(next(line for line in (second.stdout + second.stderr).splitlines()
                          if "ENV {" in line).split("ENV ", 1)[1])
    checkpoint = tmp_path / ".checkpoints" / "step_0000003.pt"
    assert os.path.samefile(env["GPUHERD_RESUME"], checkpoint)
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    assert (s["start"], s["slurm_job_id"], s["slurm_restart_count"]) == (1, "101", 0)
    assert [(e["requeue"], e["slurm_job_id"], e["exit_code"]) for e in s["requeues"]] == [(0, "100", 0)]
    assert s["attempts"][0]["resumed_from"] and (run_dir / "requeue-1").is_dir()
    assert list(run_dir.glob("worker-rank0-*.log")) and list((run_dir / "requeue-1").glob("worker-rank0-*.log"))

    third = run(tmp_path, "102", "nightly", "env")  # and again: start 2, every earlier start listed
    assert third.returncode == 0, third.stderr[-3000:]
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    assert s["start"] == 2 and [e["slurm_job_id"] for e in s["requeues"]] == ["100", "101"]


def test_a_second_start_while_the_run_still_runs_is_refused_and_writes_nothing(tmp_path):
    running = subprocess.Popen(supervisor("200", "busy", "forever"), cwd=tmp_path, env=slurm_env("200"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sh.wait_for(lambda: sh.workers_started(running, 1, tmp_path, lines=3)), "the first start never trained"
        run_dir = tmp_path / "logs" / "busy"
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != "metrics.jsonl"
                  and not p.name.endswith(".log")}
        second = run(tmp_path, "201", "busy", "train:2")
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "is in use by a start of this run that is still running" in lines[0], lines
        assert f"pid {running.pid}" in lines[0]
        assert not (run_dir / "requeue-1").exists()
        assert {p: p.stat().st_mtime_ns for p in before} == before  # config.json and the rest untouched
    finally:
        running.terminate()
        sh.finish(running, timeout=60)


def test_continuing_a_run_with_another_model_is_refused_before_anything_starts(tmp_path):
    """The built-in trainer's checkpoint holds the model: a start of the run with another
    model.dim could only fail in its workers, after the run's files were rewritten."""
    def start(job_id: str, dim: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "supervisor", "--slurm", "--run-id", "grow", "--debug", "--no-report",
               "--nproc", "1"]
        for item in ("system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "training.max_steps=2",
                     "training.eval_every=0", f"model.dim={dim}"):
            cmd += ["--set", item]
        return subprocess.run(cmd, cwd=tmp_path, env=slurm_env(job_id), capture_output=True, text=True, timeout=120)

    first = start("300", 64)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "logs" / "grow"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock"}
    second = start("301", 128)
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "another model (model.dim 64 -> 128)" in lines[0], second.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock"} == before

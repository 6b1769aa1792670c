"""The worker as a process: signals, rendezvous timeout, `python -m worker` under the
supervisor's contract, and `pretrain_main.py` standalone (real processes, real signals)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from tests.worker import helpers as h

from gpuherd import contract
from gpuherd.config import resolve

LONG = ["training.max_steps=100000", "training.log_every=1"]


def long_run(tmp: Path, port: int, *extra: str, supervised: bool = False) -> h.Watched:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp), "status_dir": str(tmp), "signals": True,
                                "runs": [{"name": "run", "port": port, "overrides": [*LONG, *extra]}]}))
    env = h.worker_env(0, 1, port, **({contract.SUPERVISED: "1"} if supervised else {}))
    return h.Watched(["tests/worker/helpers.py", "train", str(spec)], env)


def test_sigint_stops_at_a_step_boundary_with_a_checkpoint(tmp_path: Path):
    proc = long_run(tmp_path, h.free_port())
    try:
        proc.wait_for("Step [2/")
        proc.proc.send_signal(signal.SIGINT)
        assert proc.finish(timeout=60) == 130
    finally:
        proc.kill()
    saved = proc.wait_for("checkpoint saved:")
    last = max(int(m) for m in re.findall(r"Step \[(\d+)/", proc.stderr))
    assert f"step_{last + 1:07d}.pt" in saved  # every finished step is in it
    # the loop's own records (the liveness thread may still beat once on the way out)
    records = [r for r in h.read_status(tmp_path / "run-rank0.jsonl") if r["type"] != "alive"]
    assert records[-1] == {**records[-1], "type": "phase", "name": "shutdown"}
    assert not any(r["type"] == "done" for r in records)


def test_sigusr2_saves_and_stops_with_143(tmp_path: Path):
    """The supervisor's stop request (it got SIGTERM: a preemption, scancel): unlike SIGTERM,
    the worker finishes its step and saves first."""
    proc = long_run(tmp_path, h.free_port())
    try:
        proc.wait_for("Step [2/")
        proc.proc.send_signal(signal.SIGUSR2)
        assert proc.finish(timeout=60) == 143
    finally:
        proc.kill()
    saved = proc.wait_for("checkpoint saved:")
    last = max(int(m) for m in re.findall(r"Step \[(\d+)/", proc.stderr))
    assert f"step_{last + 1:07d}.pt" in saved
    assert "received SIGUSR2" in proc.stderr and "stopped after" in proc.stderr
    # the loop's own records (the liveness thread may still beat once on the way out)
    records = [r for r in h.read_status(tmp_path / "run-rank0.jsonl") if r["type"] != "alive"]
    assert records[-1] == {**records[-1], "type": "phase", "name": "shutdown"}


def test_stacks_signal_dumps_stacks_then_teardown_signal_exits_143(tmp_path: Path):
    """The supervisor's own signals: stacks on a hang verdict (training goes on), and the
    teardown's "exit now" (no collectives, no checkpoint)."""
    proc = long_run(tmp_path, h.free_port())
    try:
        proc.wait_for("Step [1/")
        proc.proc.send_signal(contract.STACKS_SIGNAL)
        proc.wait_for("most recent call first")
        before = max(int(m) for m in re.findall(r"Step \[(\d+)/", proc.stderr))
        proc.wait_for(f"Step [{before + 2}/")
        proc.proc.send_signal(contract.TEARDOWN_SIGNAL)
        assert proc.finish(timeout=20) == 143
    finally:
        proc.kill()
    # the dump shows the main thread inside the training loop (the signal may land between
    # steps, in logging or data loading, so the step function itself need not be on the stack)
    assert re.search(r'File ".*worker/train\.py", line \d+ in _train\n', proc.stderr)
    assert "tearing the run down: exiting now (143)" in proc.stderr
    assert not list((tmp_path / "ckpt").glob("step_*"))


def _signalled(proc: h.Watched, at: str, *signums: int, timeout: float) -> int:
    """Once `at` was printed, send `signums`; the exit code (the process never outlives this)."""
    try:
        proc.wait_for(at)
        for signum in signums:
            proc.proc.send_signal(signum)
        return proc.finish(timeout=timeout)
    finally:
        proc.kill()


def test_unsupervised_sigterm_exits_143_at_once(tmp_path: Path):
    proc = long_run(tmp_path, h.free_port())
    assert _signalled(proc, "Step [1/", signal.SIGTERM, timeout=20) == 143
    assert "SIGTERM without a supervisor: exiting now (143)" in proc.stderr
    assert not list((tmp_path / "ckpt").glob("step_*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_supervised_worker_takes_its_own_stop_signal_as_save_and_stop(tmp_path: Path, signum: int):
    """SLURM signals every process of a step (scancel, the time limit, its USR1 warning): the
    worker saves its step and exits 143, tells its supervisor, and a second signal does not kill
    it (only the supervisor decides that). SIGUSR1 dumps no stacks."""
    proc = long_run(tmp_path, h.free_port(), supervised=True)
    assert _signalled(proc, "Step [2/", signum, signum, timeout=60) == 143
    saved = proc.wait_for("checkpoint saved:")
    last = max(int(m) for m in re.findall(r"Step \[(\d+)/", proc.stderr))
    assert f"step_{last + 1:07d}.pt" in saved
    assert "most recent call first" not in proc.stderr
    stops = [r for r in h.read_status(tmp_path / "run-rank0.jsonl") if r["type"] == "stop"]
    assert [r["signal"] for r in stops] == [signal.Signals(signum).name]


def test_missing_rank_is_a_rendezvous_error(tmp_path: Path):
    port = h.free_port()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tmp": str(tmp_path), "status_dir": str(tmp_path), "runs": [
        {"name": "run", "port": port, "overrides": ["system.rendezvous_timeout=3", "training.strategy=ddp"]}]}))
    res = h.spawn(["tests/worker/helpers.py", "train", str(spec)], [h.worker_env(0, 2, port)], timeout=60)[0]
    assert res.returncode == 5, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "ERROR |" in ln]
    assert len(errors) == 1 and "process group did not form within 3s" in errors[0] and "rank 0 of 2" in errors[0]


@pytest.fixture(scope="module")
def dummy_cache(tmp_path_factory) -> tuple[Path, Path]:
    """A real dataset cache (dummy corpus, byte tokenizer) and the resolved config naming it."""
    from dataset_cache import prepare_cache

    tmp = tmp_path_factory.mktemp("cache")
    cfg = resolve("debug", overrides=[*h.TINY, "data.dataset=dummy", "data.tokenizer=byte", "data.num_samples=200",
                                      "training.max_steps=3", "training.eval_every=2", "training.eval_steps=1",
                                      f"data.cache_dir={tmp / 'cache'}", f"system.checkpoint_dir={tmp / 'ckpt'}"],
                  cwd=tmp)
    info = prepare_cache(cfg.data)
    config = tmp / "config.json"
    config.write_bytes(cfg.to_json())
    return config, info.path


def test_python_m_worker_under_the_supervisor_contract(tmp_path: Path, dummy_cache):
    config, cache = dummy_cache
    port = h.free_port()
    procs, reads = [], []
    try:
        for rank in range(2):
            read_fd, write_fd = os.pipe()
            env = h.worker_env(rank, 2, port, GPUHERD_CONFIG=str(config), GPUHERD_DATASET_CACHE=str(cache),
                               GPUHERD_SUPERVISED="1", GPUHERD_STATUS_FD=str(write_fd),
                               GPUHERD_RUN_DIR=str(tmp_path))
            procs.append(h.Watched(["-m", "worker"], env, pass_fds=(write_fd,)))
            os.close(write_fd)
            reads.append(read_fd)
        codes = [p.finish(timeout=120) for p in procs]
        status = [os.fdopen(fd, "rb").read() for fd in reads]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], procs[0].stderr + procs[1].stderr
    for rank, proc in enumerate(procs):
        steps = [ln for ln in proc.lines if "] Step [" in ln]
        assert [ln.split(" | ")[:2] for ln in steps] == [["INFO", f"[CPU {rank}] Step [{s}/3]"] for s in range(3)]
        types = [json.loads(line)["type"] for line in status[rank].splitlines()]
        assert types[0] == "ready" and types[-1] == "done" and "eval" in types and "checkpoint" in types
    assert (tmp_path / "tensorboard").is_dir()  # rank 0 only, into the run directory


def test_python_m_worker_without_config_is_a_usage_error():
    res = h.spawn(["-m", "worker"], [h.worker_env(0, 1, 0)], timeout=60)[0]
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("CPU0:ERROR | GPUHERD_CONFIG is not set")


def test_pretrain_main_standalone_from_another_directory(tmp_path: Path, dummy_cache):
    _, cache = dummy_cache
    cache_root = cache.parent
    args = [str(h.REPO / "pretrain_main.py"), "--debug", "--max-steps", "2",
            *[f"--set={item}" for item in (*h.TINY[:5], "data.dataset=dummy", "data.tokenizer=byte",
                                           "data.num_samples=200", f"data.cache_dir={cache_root}",
                                           "data.context_length=16", "training.eval_every=0")]]
    res = h.spawn(args, [h.worker_env(0, 1, 0, PYTHONPATH="", GPU_RANK="")], timeout=120, cwd=tmp_path)[0]
    assert res.returncode == 0, res.stderr
    steps = [ln for ln in res.stderr.splitlines() if "] Step [" in ln]
    assert [ln.split(" | ")[0] for ln in steps] == ["CPU0:INFO", "CPU0:INFO"]
    assert steps[0].startswith("CPU0:INFO | [CPU 0] Step [0/2] | Loss: ")
    run_dirs = list((tmp_path / "logs").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "config.json").is_file()
    assert (tmp_path / ".checkpoints" / "step_0000002.pt").is_file()


def test_pretrain_main_bad_config_is_one_line(tmp_path: Path):
    res = h.spawn([str(h.REPO / "pretrain_main.py"), "--debug", "--set", "training.batch_sise=4"],
                  [h.worker_env(0, 1, 0)], timeout=60, cwd=tmp_path)[0]
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "gpuherd: error: --set: unknown key 'training.batch_sise' (did you mean 'training.batch_size'?)"]
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_group_that_failed_before_its_timeout_is_not_said_to_have_timed_out():
    """A peer that exited (its training over) ends a rebuilt group's wait at once: the line says the
    wait ended early, not that the rendezvous timeout ran out."""
    import time

    from worker.distributed import not_formed

    assert not_formed(60, time.monotonic() - 0.4) == ("did not form: the wait ended after 0.4 s, before "
                                                      "system.rendezvous_timeout (60s)")
    assert not_formed(3, time.monotonic() - 3.0) == "did not form within 3s (system.rendezvous_timeout)"

"""Signals while the dataset cache is built, as found by killing `gpuherd run` while it prints
`building dataset cache`: nothing it started outlives it (SIGKILL: the tokenizer pool, its
forkserver and resource tracker included), SIGTERM ends with exit 143 and a summary, and a
SIGINT inherited as ignored stays ignored for the whole run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import psutil
import pytest

from tests.supervisor import helpers as sh

BUILDING = "building dataset cache"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~40 MB of text: a build with a 2-process tokenizer pool that runs for a while."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    for i in range(4):
        (root / f"part{i}.txt").write_text(" ".join(rng.choices(words, k=1_600_000)))
    return root


def _start(cwd: Path, corpus: Path, *extra: str, ignore_sigint: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--nproc", "1", "--no-report", "--skip-checks",
           "--set", f"data.dataset={corpus}", "--set", f"data.cache_dir={cwd / 'cache'}", *extra]
    if ignore_sigint:  # as a shell's background job or a CI runner leaves it
        cmd = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *cmd]
    return subprocess.Popen(cmd, cwd=cwd, env=sh.env(), stdout=subprocess.PIPE, preexec_fn=_two_cpus,
                            stderr=open(cwd / "stderr.txt", "w"), text=True)  # noqa: SIM115 - closed with the process


def _two_cpus() -> None:
    """The build starts one tokenizer process per CPU it may use: two, whatever this machine has."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def _building(cwd: Path, proc: subprocess.Popen) -> list[psutil.Process]:
    """Once the tokenizer pool runs: every process below the supervisor."""
    def pool_running() -> bool:
        return BUILDING in (cwd / "stderr.txt").read_text() and len(_pool(proc)) == 2

    assert sh.wait_for(pool_running, timeout=120), (cwd / "stderr.txt").read_text()
    return psutil.Process(proc.pid).children(recursive=True)


def _pool(proc: subprocess.Popen) -> list[psutil.Process]:
    """The tokenizer processes: children of the forkserver, itself a child of the supervisor."""
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()) and p.ppid() != proc.pid:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _all_gone(procs: list[psutil.Process], timeout: float = 60) -> list[str]:
    def alive() -> list[psutil.Process]:
        return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    sh.wait_for(lambda: not alive(), timeout=timeout)
    return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive()]


needs_a_pool = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                  reason="with one CPU the build tokenizes in-process: there is no pool")


@needs_a_pool
def test_sigkill_during_the_build_leaves_no_process_behind(tmp_path, corpus):
    """The supervisor stopped (Ctrl-Z) and then killed mid-build: its tokenizer processes, blocked
    on the pool's pipes once their batches are done, would wait forever under the forkserver."""
    proc = _start(tmp_path, corpus)
    below = _building(tmp_path, proc)
    pool = _pool(proc)
    proc.send_signal(signal.SIGSTOP)
    assert sh.wait_for(lambda: all(p.status() == psutil.STATUS_SLEEPING for p in pool), timeout=120)
    proc.kill()
    proc.wait()
    left = _all_gone(below)
    for p in below:  # never leave them to the next test, whatever the assertion says
        if p.is_running():
            p.kill()
    assert not left, left


@needs_a_pool
def test_sigterm_during_the_build_ends_with_143_and_a_summary(tmp_path, corpus):
    proc = _start(tmp_path, corpus)
    below = _building(tmp_path, proc)
    proc.send_signal(signal.SIGSTOP)  # held mid-build: the SIGTERM is there when it goes on, whatever the load
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=120) == 143
    err = (tmp_path / "stderr.txt").read_text()
    assert "root cause: the supervisor received SIGTERM while preparing the dataset" in err, err
    assert "Traceback" not in err and "resource_tracker" not in err, err
    (summary,) = tmp_path.glob("logs/*/summary.json")
    assert orjson.loads(summary.read_bytes())["exit_code"] == 143
    assert not _all_gone(below)
    assert not list((tmp_path / "cache").glob("*/metadata.json"))  # the cut build published nothing


@needs_a_pool
def test_sigint_inherited_as_ignored_is_ignored_for_the_whole_run(tmp_path, corpus):
    """During the build (it completes) and while workers train (they keep training); SIGTERM stops it."""
    proc = _start(tmp_path, corpus, "--max-steps", "3", ignore_sigint=True)
    _building(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    assert sh.wait_for(lambda: "dataset cache built" in (tmp_path / "stderr.txt").read_text(), timeout=300)
    proc.kill()
    proc.wait()

    cmd = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", sys.executable, "-m", "supervisor", "--set",
           "system.device=cpu", "--no-report", "--nproc", "1", "--run-id", "train", "--script", str(sh.SCENARIO),
           "forever"]
    run = subprocess.Popen(cmd, cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "train" / "worker-rank0-CPU0.log"
    assert sh.wait_for(lambda: log.is_file() and "Step [3/" in log.read_text(), timeout=120)
    run.send_signal(signal.SIGINT)
    steps = log.read_text().count("Step [")
    assert sh.wait_for(lambda: log.read_text().count("Step [") > steps + 20, timeout=60)  # still training
    assert run.poll() is None
    run.send_signal(signal.SIGTERM)
    code, _, err = sh.finish(run, timeout=120)
    assert code == 143, err[-3000:]
    assert "SIGINT was ignored when gpuherd started" in err and "stop it with SIGTERM" in err
    assert "interrupted" not in err

"""Suite-wide rules: GPU tests skip cleanly without CUDA, every test that starts a
process is marked `integration` (`pytest -m "not integration"` is the fast tier; see
tests/process_starters.py for how it is decided and checked), and no test may leave a
process behind (the product's promise is 'no orphans'; the suite keeps it too)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.bytecode import compile_bytecode, writing_bytecode
from tests.process_starters import Reach, Watch, starts_processes

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cuda_available() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    import torch

    return torch.cuda.is_available()


# The stop signals a supervisor keeps ignored for its whole run when it inherits them ignored
# (supervisor/processes/signal_rules.py STOP_SIGNALS).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def pytest_configure(config: pytest.Config) -> None:
    """A suite started with stop signals ignored (a shell's background job ignores SIGINT and
    SIGQUIT, nohup SIGHUP, so do some CI runners) would pass that on to every supervisor it
    starts, which then keeps them ignored by design, and every Ctrl-C or SIGQUIT test would
    wait for an exit that never comes. The suite starts its processes with the default
    dispositions; a test that wants one ignored says so itself (test_preparation_signals.py)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    if not hasattr(config, "workerinput"):  # the main pytest process, before xdist starts its workers
        compile_bytecode(REPO_ROOT)  # tests/bytecode.py: why


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """pytest caches each test module's rewritten asserts where bytecode may be written."""
    with writing_bytecode():
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reach = Reach()
    for item in items:
        if "integration" not in item.keywords and starts_processes(item, reach):
            item.add_marker(pytest.mark.integration)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in gpu_items:
            item.add_marker(skip)
    if os.environ.get("GPUHERD_OFFLINE") == "1":
        skip = pytest.mark.skip(reason="GPUHERD_OFFLINE=1: test fetches from PyPI")
        for item in items:
            if "network" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def python_env() -> dict[str, str]:
    return subprocess_env()


def subprocess_env() -> dict[str, str]:
    """Environment for subprocesses that run gpuherd's entry points from any cwd (also for a
    fixture of a wider scope than `python_env`'s)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUHERD_PYTHON"] = sys.executable
    return env


# Python's own per-process singletons: started once by multiprocessing in the test
# process itself and ended with it, so they are not leaks of the code under test.
_MP_SINGLETONS = ("from multiprocessing.forkserver import main", "from multiprocessing.resource_tracker import main")


@pytest.fixture(autouse=True)
def unmarked_tests_start_no_process(request):
    """The fast tier's promise, checked: a test not marked `integration` that starts a
    process anyway fails, naming it (mark it, or teach tests/process_starters.py)."""
    if "integration" in request.node.keywords:
        yield
        return
    with Watch() as watch:
        yield
    assert not watch.started, (
        "this test starts processes but is not marked integration (tests/process_starters.py did not see "
        "it coming): " + "; ".join(dict.fromkeys(watch.started)))


@pytest.fixture(autouse=True)
def no_stray_processes():
    """Fail any test that leaves a child (or grandchild) process running."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in before:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
            if proc.ppid() == os.getpid() and any(marker in cmdline for marker in _MP_SINGLETONS):
                continue
            leftovers.append(f"{proc.pid} {cmdline[:120]}")
            proc.kill()
        except psutil.Error:
            continue
    assert not leftovers, "test left processes running:\n" + "\n".join(leftovers)

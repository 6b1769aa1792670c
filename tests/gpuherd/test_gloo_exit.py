"""gpuherd/gloo_exit.py: settle() returns once the named threads sat still, never before,
and gives up at its limit. Real threads, named through /proc as torch names gloo's."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuherd.gloo_exit import TASKS, settle

NAME = "gh_settle_test"  # a thread name (/proc comm: at most 15 characters)


def _named(work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        (TASKS / str(threading.get_native_id()) / "comm").write_text(NAME)
        work()
    return run


@pytest.fixture
def start() -> Iterator[Callable[[Callable[[], None]], None]]:
    threads: list[threading.Thread] = []

    def start_thread(work: Callable[[], None]) -> None:
        named = threading.Event()
        thread = threading.Thread(target=_named(lambda: (named.set(), work())), daemon=True)
        thread.start()
        named.wait()
        threads.append(thread)

    yield start_thread
    for thread in threads:
        thread.join(timeout=30)


BLOCK = bytes(16 << 20)


def _busy(blocks: int) -> None:
    """CPU work outside the GIL (hashlib releases it), like gloo's own work in C++."""
    for _ in range(blocks):
        hashlib.sha256(BLOCK).digest()


def test_returns_only_once_a_busy_thread_has_parked(start):
    finished, release = threading.Event(), threading.Event()

    def work() -> None:
        _busy(16)
        finished.set()
        release.wait()  # parked, as gloo's worker between collectives

    start(work)
    try:
        assert settle(names=(NAME,), limit_s=60)
        assert finished.is_set()
    finally:
        release.set()


def test_gives_up_at_its_limit_on_a_thread_that_never_parks(start):
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            _busy(1)

    start(work)
    try:
        assert settle(names=(NAME,), limit_s=0.2) is False
    finally:
        stop.set()


def test_a_parked_thread_or_none_at_all_settles(start, tmp_path):
    release = threading.Event()
    start(release.wait)
    try:
        assert settle(names=(NAME,), limit_s=60)
    finally:
        release.set()
    assert settle(names=("no_such_thread",), limit_s=60)
    assert settle(names=(NAME,), limit_s=60, tasks=Path(tmp_path / "no_proc"))  # no /proc: nothing to wait for

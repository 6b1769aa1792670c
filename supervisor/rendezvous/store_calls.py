"""The job store calls a node agent makes, and the watch on calls node 0 never answers.

Everything the agent reads many keys of, or waits for, goes through `StoreCalls`, so
every loop over nodes is one request (torch's `TCPStore.multi_get`, `check` of a key
list) and every wait is the server's (`TCPStore.wait`, which costs no request while it
blocks), never a client polling N keys: the store's load grows with the nodes, not with
their square. A plain key-value object with only `check`/`get`/`set`/`compare_set` (a
test's stand-in, an older store) gets the same answers from those four calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import orjson

STANDIN_POLL_S = 0.05  # a store without server-side waits is asked this often


def is_timeout(exc: BaseException) -> bool:
    """torch's store says a wait ran out with DistStoreError; a lost connection is DistNetworkError."""
    return type(exc).__name__ == "DistStoreError" and "timeout" in str(exc).lower()


class StoreCalls:
    """One connection's calls: server-side waits and one-request reads of many keys."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:  # check/get/set/compare_set/add as the store has them
        return getattr(self.store, name)

    def wait(self, keys: list[str], timeout: float) -> bool:
        """True once every key exists; False after `timeout` s. One request on torch's store
        (a timed-out one, two: the wait and its cancel); the server answers when the last key is set."""
        if not keys:
            return True
        if not hasattr(self.store, "wait"):
            deadline = time.monotonic() + timeout
            while not self.store.check(keys):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(STANDIN_POLL_S)
            return True
        try:
            self.store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as exc:
            if is_timeout(exc):
                return False
            raise
        return True

    def wait_long(self, keys: list[str], timeout: float, piece: float) -> bool:
        """`wait` for up to `timeout` s, asked in pieces of `piece` s that a store watchdog can judge."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.wait(keys, min(left, piece)):
                return True
        return False

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value in one request (each key must exist: torch's store waits for it)."""
        if not keys:
            return []
        if hasattr(self.store, "multi_get"):
            return list(self.store.multi_get(keys))
        return [self.store.get(key) for key in keys]

    def get_if_set(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def missing(self, keys: list[str]) -> list[int]:
        """The indexes of the keys not set, halving the list with one `check` per half: a few
        requests when a few nodes are missing, not one per node."""
        if not keys or self.store.check(keys):
            return []
        if len(keys) == 1:
            return [0]
        half = len(keys) // 2
        return self.missing(keys[:half]) + [half + i for i in self.missing(keys[half:])]


class TimedStore:
    """A client's store whose calls say until when their answer is due: a call node 0 never
    answers (a network partition sends no RST, so the TCP connection just waits) is seen
    by the watchdog while the call still blocks. A wait is due when its timeout ends."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.due: float | None = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def timed(*args: Any) -> Any:
            patience = args[1].total_seconds() if name == "wait" and len(args) > 1 else 0.0
            self.due = time.monotonic() + patience
            try:
                return method(*args)
            finally:
                self.due = None
        return timed

    def clone(self) -> TimedStore:
        return TimedStore(self._store.clone())


def overdue(stores: list[TimedStore], silent_s: float, since: float = float("-inf")) -> bool:
    """Whether any of these connections waits for an answer more than `silent_s` past its due time
    (or past `since`, when later: this process ran again then after being stopped)."""
    now = time.monotonic()
    return any(s.due is not None and now - max(s.due, since) > silent_s for s in stores)


Connect = Callable[[], Any]  # a fresh connection to the job store (its own socket, for a thread that blocks)



def json_or_none(raw: bytes | None) -> Any:
    """A value read back from the store, decoded; None where there is none or it is not JSON."""
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None

"""Tokenize a stream of document pieces on every core, in order, in bounded memory.

Pieces are grouped into batches of ~BATCH_CHARS characters (so a corpus of tiny
JSONL lines does not pay one inter-process round trip per line) and at most
`2 x workers` batches are in flight: `Pool.imap` would read the whole input
ahead, which is exactly what a corpus larger than RAM cannot afford. Results
come back in submission order, so the token file is identical whatever the
number of workers.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import psutil

from dataset_cache.corpus import Piece
from dataset_cache.tokenizers import Tokenizer, load_tokenizer
from gpuherd.errors import DatasetError
from gpuherd.parent_death import die_with_parent

BATCH_CHARS = 1 << 18  # ~256 KB of text per task: amortizes pickling, and enough tasks to keep every core busy to the end
MIN_PARALLEL_BYTES = 4 << 20  # below this, starting processes costs more than it saves

_TOKENIZER: Tokenizer | None = None  # set in the parent before fork, or loaded by _init_worker


@dataclass(frozen=True)
class EncodedBatch:
    tokens: np.ndarray  # ids of every piece, the end-of-text id after each finished document
    doc_ends: list[int]  # positions in `tokens` just after each document's end-of-text id
    text_bytes: int


ABANDON_WAIT_S = 10.0  # a stopped build's running batches: seconds at most
HELPER_STOP_S = 10.0  # multiprocessing's forkserver or resource tracker asked to stop: seconds before SIGKILL


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def encode_pieces(
    tokenizer: Tokenizer, pieces: Iterator[Piece], dtype: np.dtype, workers: int, doc_limit: int = 0
) -> Iterator[EncodedBatch]:
    """Encoded batches in input order; stops after `doc_limit` documents (0: all)."""
    batches = _batches(pieces, doc_limit)
    if workers <= 1:
        global _TOKENIZER
        _TOKENIZER = tokenizer
        for batch in batches:
            yield _encode_batch(batch, dtype.str)
        return
    yield from _encode_in_pool(tokenizer, batches, dtype, workers)


def _encode_in_pool(
    tokenizer: Tokenizer, batches: Iterator[list[tuple[str, bool]]], dtype: np.dtype, workers: int
) -> Iterator[EncodedBatch]:
    global _TOKENIZER
    # fork shares the already loaded tokenizer with every worker for free (GPT-2's
    # merges take ~0.4 s to load); it is only safe while this process has no other
    # threads, otherwise a forkserver gives each worker a clean start.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    if method == "fork":
        tokenizer.encode("warm up")  # build the lazy encoder once, before forking
        _TOKENIZER = tokenizer
    helpers_before = _multiprocessing_helpers()  # before the executor's queues start a resource tracker
    # ProcessPoolExecutor, not Pool: a worker that dies (OOM killer) breaks the
    # executor with an error, where Pool would wait for its lost task forever.
    executor = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
        initargs=(tokenizer.spec, os.getpid() if method == "fork" else 0),
    )
    pending: deque[Future[EncodedBatch]] = deque()
    try:
        # Start (fork) every worker now, before `batches` opens the first input:
        # pyarrow's C++ thread pools must not exist yet in the process being forked.
        executor.submit(os.getpid)
        for batch in batches:
            pending.append(executor.submit(_encode_batch, batch, dtype.str))
            while len(pending) >= 2 * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    except BaseException as exc:
        _abandon(executor)
        del executor, pending
        # The frames the exception passed through (a stop signal lands anywhere, the executor's
        # own calls included) still hold the executor and its queues: their semaphores must be
        # released before the build's resource tracker stops, or it unlinks them as leaked (a
        # warning on the console) and their finalizers fail again once collected (tracebacks).
        traceback.clear_frames(exc.__traceback__)
        _stop_helpers_started(helpers_before)
        raise
    executor.shutdown(wait=True, cancel_futures=True)
    del executor, pending
    _stop_helpers_started(helpers_before)


def _multiprocessing_helpers() -> tuple[int | None, int | None]:
    """The pids of multiprocessing's forkserver and resource tracker of this process (None: not running)."""
    from multiprocessing import forkserver, resource_tracker

    return (getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None))


def _stop_helpers_started(before: tuple[int | None, int | None]) -> None:
    """A forkserver pool leaves multiprocessing's forkserver and resource tracker running for
    the rest of this process's life: a launcher's exit code would come before they are gone.
    The ones this build started end with it (stopped and reaped; multiprocessing starts them
    again if anything needs them later). The pool's semaphores are released first (collected),
    or their release would start a new resource tracker."""
    from multiprocessing import forkserver, resource_tracker

    gc.collect()
    server_before, tracker_before = before
    server_now, tracker_now = _multiprocessing_helpers()
    if server_now is not None and server_before is None:
        # a tokenizer process the forkserver was still starting when the build was cut short is
        # not the executor's yet: it holds the resource tracker's pipe, so the tracker (and the
        # wait for it below) would never end
        _kill_children_of(server_now)
        _bounded(forkserver._forkserver._stop, server_now)
    if tracker_now is not None and tracker_before is None:
        _bounded(resource_tracker._resource_tracker._stop, tracker_now)


def _kill_children_of(pid: int) -> None:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _bounded(stop: Callable[[], None], pid: int) -> None:
    """multiprocessing's `_stop()` waits for the helper's exit without a limit: after
    HELPER_STOP_S it is SIGKILLed, so that wait ends and the run's exit never hangs on it."""
    timer = threading.Timer(HELPER_STOP_S, _kill_quietly, args=(pid,))
    timer.daemon = True
    timer.start()
    try:
        stop()
    finally:
        timer.cancel()


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _abandon(executor: ProcessPoolExecutor) -> None:
    """The build is over unfinished (a stop signal raised in this thread, a failure, the
    consumer gone): the queued batches are cancelled and the executor's manager thread gets
    ABANDON_WAIT_S to let the running ones finish and its tokenizer processes leave, as a
    plain shutdown would; then whatever is left is killed. A signal's exception can land
    inside the executor's own bookkeeping (between the two writes of a wake-up message, say),
    after which that thread never ends and `shutdown(wait=True)` would wait for it forever:
    the run must end all the same."""
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=ABANDON_WAIT_S)
    processes += list((getattr(executor, "_processes", None) or {}).values())
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=5)
    if manager is not None and manager.is_alive():
        # with its processes gone the manager thread ends, and with it the call queue's feeder
        # thread: both hold the queues' semaphores, which must be released (collected) before
        # the build's resource tracker is stopped, or it unlinks them as leaked (a warning on
        # the console) and their finalizers fail again at the exit (tracebacks)
        manager.join(timeout=5)


def _result(future: Future[EncodedBatch]) -> EncodedBatch:
    try:
        return future.result()
    except BrokenProcessPool:
        raise DatasetError("a tokenizer process died during the build (killed, or out of memory?); nothing was published") from None


def _batches(pieces: Iterator[Piece], doc_limit: int) -> Iterator[list[tuple[str, bool]]]:
    batch: list[tuple[str, bool]] = []
    chars = documents = 0
    for piece in pieces:
        batch.append((piece.text, piece.ends_document))
        chars += len(piece.text)
        documents += piece.ends_document
        if doc_limit and documents >= doc_limit:
            break
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _init_worker(spec: str, parent_pid: int) -> None:
    # The parent handles Ctrl-C and terminates the pool; a worker must not also
    # print a KeyboardInterrupt traceback. If the parent dies (even by SIGKILL),
    # the kernel kills the worker instead of leaving it blocked on its queue.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)  # parent_pid 0: started by a forkserver, whose own lifetime follows ours
    global _TOKENIZER
    if _TOKENIZER is None or _TOKENIZER.spec != spec:
        _TOKENIZER = load_tokenizer(spec)


def _encode_batch(batch: list[tuple[str, bool]], dtype_str: str) -> EncodedBatch:
    assert _TOKENIZER is not None
    dtype = np.dtype(dtype_str)
    eot = np.array([_TOKENIZER.eot_id], dtype=dtype)
    arrays, doc_ends, length, text_bytes = [], [], 0, 0
    for text, ends_document in batch:
        ids = _TOKENIZER.encode_array(text, dtype)
        arrays.append(ids)
        length += ids.size
        text_bytes += len(text.encode("utf-8"))
        if ends_document:
            arrays.append(eot)
            length += 1
            doc_ends.append(length)
    tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
    return EncodedBatch(tokens=tokens, doc_ends=doc_ends, text_bytes=text_bytes)

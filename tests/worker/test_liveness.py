"""gpuherd/liveness.py: the whereabouts record, step/compute/wait accounting, the thread
that reports while the loop is stuck, the trace request; and the worker's flight-recorder
dump it calls (worker/collectives.py) on a real gloo process group."""

from __future__ import annotations

import os
import threading
import time

import orjson
import pytest

from gpuherd.liveness import Liveness
from gpuherd.status_channel import StatusWriter
from gpuherd.status_records import Alive, decode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _records(fd: int) -> list:
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return []
    return [decode(line) for line in data.splitlines()]


def test_record_says_where_the_loop_is_and_what_it_timed():
    clock = Clock()
    live = Liveness(StatusWriter(None, 0), clock=clock)
    live.step(7)
    live.doing("data loading")
    clock.now += 0.1
    live.doing("forward/backward")
    clock.now += 0.3
    live.collective_begin("all_reduce (gradients)")
    clock.now += 0.5  # waiting for a slower peer
    rec = live.record()
    assert rec["phase"] == "step" and rec["step"] == 7 and rec["collective"] is True
    assert rec["where"] == "all_reduce (gradients)" and rec["where_s"] == pytest.approx(0.5)
    assert rec["for_s"] == pytest.approx(0.9) and "took" not in rec and "steps" not in rec
    live.collective_end()
    clock.now += 0.1
    live.step(8)  # closes step 7: 1.0 s, of which 0.5 s waiting
    rec = live.record()
    assert rec["took"] == {"step": [1, pytest.approx(1.0)]}
    assert rec["steps"] == 1 and rec["compute_s"] == pytest.approx(0.5) and rec["wait_s"] == pytest.approx(0.5)
    assert live.record().get("took") is None  # counters are per record


def test_eval_and_checkpoint_are_timed_phases_outside_the_steps():
    clock = Clock()
    live = Liveness(StatusWriter(None, 0), clock=clock)
    live.step(0)
    clock.now += 0.2
    with live.phase("eval"):
        assert live.where.phase == "eval" and live.where.step == 0
        clock.now += 3.0
    assert live.where.phase == "between steps"
    rec = live.record()
    assert rec["took"]["eval"] == [1, pytest.approx(3.0)]
    assert rec["took"]["step"] == [1, pytest.approx(0.2)]  # the step ended where the eval began


def test_the_thread_reports_while_the_loop_is_blocked(pipe):
    r, w = pipe
    live = Liveness(StatusWriter(w, 3), interval=0.05).start()
    live.step(40)
    blocked = threading.Event()
    with live.collective("all_reduce"):
        blocked.wait(0.3)  # the "loop" makes no progress; the thread must not care
    live.stop()
    records = _records(r)
    assert len(records) >= 3 and all(isinstance(rec, Alive) and rec.rank == 3 for rec in records)
    waiting = [rec for rec in records if rec.collective]
    assert waiting and waiting[-1].where == "all_reduce" and waiting[-1].step == 40


def test_without_a_supervisor_no_thread_is_started():
    live = Liveness(StatusWriter(None, 0)).start()
    assert live._thread is None
    live.stop()


def test_a_trace_request_is_answered_once_from_the_thread(pipe, tmp_path):
    r, w = pipe
    calls: list[tuple[str, str]] = []
    done = threading.Event()

    def dump(trace_dir):
        calls.append((str(trace_dir), threading.current_thread().name))
        done.set()

    live = Liveness(StatusWriter(w, 0), interval=0.05, trace_dir=tmp_path, dump=dump).start()
    time.sleep(0.15)
    assert calls == []  # nothing asked yet
    # written as the supervisor writes it (supervisor/health/traces.py): at once, by a rename; a
    # file created and then written is two changes, and a tick between them sees both as requests
    (tmp_path / "request.tmp").write_text("1")
    (tmp_path / "request.tmp").rename(tmp_path / "request")
    assert done.wait(5)
    time.sleep(0.2)  # further ticks see the same request
    live.stop()
    assert calls == [(str(tmp_path), "gpuherd-trace-dump")]


def test_flight_recorder_dump_of_a_real_gloo_group(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from worker.collectives import dump_collective_trace

    monkeypatch.setenv("RANK", "0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(2)
        for _ in range(3):
            dist.all_reduce(t)
        # gloo retires a collective in the recorder from its own thread, a moment after the call
        # returned: dump again until the last one reads completed (at most 5 s)
        deadline = time.monotonic() + 5
        while True:
            dump_collective_trace(tmp_path / "traces")
            doc = orjson.loads((tmp_path / "traces" / "rank0.json").read_bytes())
            # the recorder is per process: find our group by its entries, whatever ran in this process before
            pg, last = next((pg, entries) for pg, entries in doc["last"].items()
                            if entries[-1]["op"] == "gloo:all_reduce")
            status = doc["pg_status"][pg]
            if status["last_completed_collective"] == status["last_enqueued_collective"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        dist.destroy_process_group()
    assert doc["rank"] == 0, doc
    # gloo may retire the last collective only when the next one starts: it is enqueued, the one before completed
    assert last[-1]["seq"] == status["last_enqueued_collective"] >= 3, doc
    assert status["last_completed_collective"] >= status["last_enqueued_collective"] - 1, doc
    assert (tmp_path / "traces" / "fr" / "rank0").stat().st_size > 0  # torch's own format, for fr_trace

"""Reading a run's files while they are written, and judging each rank from them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest

from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import from_object
from supervisor.views.events import collect
from supervisor.views.run_files import JsonlTail, LogTail, RunFiles, RunFilesError, resolve_run
from supervisor.views.top_state import RunState

CONFIG = {"training": {"batch_size": 4, "grad_accum_nums": 2, "max_restarts": 0}, "data": {"context_length": 128}}


def _decoded(records: list[dict]) -> list:
    """Records as the views get them from metrics.jsonl: decoded once."""
    return [from_object(r, supervisor=True) for r in records]


def _line(**record) -> bytes:
    return orjson.dumps(record) + b"\n"


def test_a_half_written_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = _line(type="step", rank=0, time=1.0, step=3, loss=2.5)
    path.write_bytes(whole + whole[:17])
    tail = JsonlTail(path)
    assert [r.step for r in tail.read_new()] == [3]
    assert tail.read_new() == []
    with path.open("ab") as f:
        f.write(whole[17:] + b"not json\n" + b"[1, 2]\n")
    assert [r.loss for r in tail.read_new()] == [2.5]
    assert tail.malformed == 2


def test_a_replaced_file_is_read_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_line(type="done", rank=0, time=1.0, step=1) * 3)
    tail = JsonlTail(path)
    assert len(tail.read_new()) == 3
    path.write_bytes(_line(type="done", rank=1, time=2.0, step=2))
    assert [r.rank for r in tail.read_new()] == [1]


def test_supervisor_log_gives_its_warnings_and_errors_only(tmp_path):
    log = tmp_path / "supervisor.log"
    log.write_text("2026-11-23 01:17:32.031 INFO | spawned\n"
                   "2026-11-23 01:17:33.000 WARNING | GPU 1 (rank 1) is throttling: thermal slowdown\n"
                   "2026-11-23 01:17:34.500 ERROR | dataset: broken\n2026-11-23 01:17:35.000 WARN")
    found = LogTail(log).read_new()
    assert [(w.level, w.message) for w in found] == [
        ("WARNING", "GPU 1 (rank 1) is throttling: thermal slowdown"), ("ERROR", "dataset: broken")]


def _run(root: Path, name: str, records: list[dict], age: float = 0.0) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    (run_dir / "metrics.jsonl").write_bytes(b"".join(_line(**r) for r in records))
    if age:
        stamp = time.time() - age
        os.utime(run_dir / "config.json", (stamp, stamp))
    return run_dir


def test_resolve_run_by_path_id_or_newest(tmp_path):
    logs = tmp_path / "logs"
    old = _run(logs, "zzz-old", [], age=100)
    new = _run(logs, "aaa-new", [])
    (logs / "not-a-run").mkdir()
    assert resolve_run(None, logs) == new  # newest by start, not by name
    assert resolve_run("zzz-old", logs) == old.resolve()
    assert resolve_run(str(old), tmp_path / "elsewhere") == old.resolve()
    with pytest.raises(RunFilesError, match="not a gpuherd run directory") as err:
        resolve_run(str(logs / "not-a-run"), logs)
    assert err.value.exit_code == ExitCode.USAGE
    with pytest.raises(RunFilesError, match="no run found"):
        resolve_run(None, tmp_path / "empty")


def _state(tmp_path: Path, records: list[dict], summary: dict | None = None) -> RunState:
    run_dir = _run(tmp_path / "logs", "r", records)
    for rank in {r["rank"] for r in records if "rank" in r}:
        (run_dir / f"worker-rank{rank}-GPU{rank + 4}.log").write_text("")
    if summary is not None:
        (run_dir / "summary.json").write_bytes(orjson.dumps(summary))
    state = RunState(RunFiles(run_dir))
    state.refresh()
    return state


def _steps(rank: int, upto: int, now: float, tokens_per_s: float = 1024.0) -> list[dict]:
    return [{"type": "step", "rank": rank, "time": now - (upto - s), "step": s, "max_steps": 100, "loss": 5.0 - s / 10,
             "tokens_per_s": tokens_per_s, "mfu": 0.4} for s in range(upto + 1)]


def test_silent_and_slow_ranks_are_named_with_the_reason(tmp_path):
    now = time.time()
    records = [{"type": "phase", "rank": r, "time": now - 60, "name": "train"} for r in range(4)]
    records += _steps(0, 20, now) + _steps(1, 20, now, tokens_per_s=400.0) + _steps(2, 17, now)
    records += [dict(r, time=r["time"] - 40) for r in _steps(3, 20, now)]  # nothing for 40 s
    state = _state(tmp_path, records)
    verdicts = state.verdicts(now)
    assert state.ranks[0].device == "GPU4" and verdicts[0].level == "ok"
    assert verdicts[1].level == "slow" and "step time 2.56 s" in verdicts[1].reason  # 1024 tokens / 400 tok/s
    assert verdicts[2].level == "slow" and verdicts[2].reason == "3 steps behind the leading rank"
    assert verdicts[3].level == "silent" and verdicts[3].reason.startswith("no heartbeat for 40 s")
    assert state.eta() == pytest.approx(79 * 1024 / 400)


def test_the_root_cause_rank_is_failed_and_the_others_were_stopped(tmp_path):
    now = time.time()
    summary = {"exit_code": 1, "duration_s": 12.0, "root_cause": {"rank": 1, "message": "GPU5 (rank 1) exit code 1"},
               "workers": [{"rank": 0, "role": "victim", "ended": "killed by SIGTERM"},
                           {"rank": 1, "role": "first-failure", "ended": "exit code 1 (failure)"}]}
    state = _state(tmp_path, _steps(0, 3, now) + _steps(1, 3, now), summary)
    verdicts = state.verdicts(now)
    assert (verdicts[1].level, verdicts[1].reason) == ("failed", "GPU5 (rank 1) exit code 1")
    assert verdicts[0].level == "ended" and "killed by SIGTERM" in verdicts[0].reason
    assert state.outcome() == "FAILED with exit code 1: GPU5 (rank 1) exit code 1" and state.elapsed() == 12.0


def test_events_collapse_what_every_rank_reports_alike(tmp_path):
    now = time.time()
    records = [{"type": "checkpoint", "rank": r, "time": now, "step": 10, "path": "/c/step_0000010.pt"} for r in (0, 1)]
    records += [{"type": "nan", "rank": 1, "time": now + 1, "step": 11, "action": "skip", "loss": "nan"},
                {"type": "restart", "time": now + 2, "attempt": 1, "after": "rank 1 crashed", "exit_code": 1},
                {"type": "gpu_event", "time": now + 3, "gpu": 2, "rank": 1, "event": "xid", "data": 79}]
    events = collect(_decoded(records), [])
    assert [(e.kind, e.text) for e in events] == [
        ("checkpoint", "checkpoint saved at step 10: step_0000010.pt"),
        ("nan", "non-finite loss/gradient at step 11 (loss nan): skipped"),
        ("restart", "restart 1 after exit code 1: rank 1 crashed"),
        ("xid", "GPU 2: XID 79")]


def test_a_multi_node_shrink_and_regrow_name_the_node_whose_rank_it_was(tmp_path):
    now = time.time()
    common = {"type": "recovery", "attempt": 0, "device": "CPU1", "survivors": [], "started_at": "",
              "outcome": "recovered", "node": 1, "rank": 3, "seconds": 0.5}
    records = [{**common, "time": now, "number": 1, "failed": "CPU1 (rank 3) killed by SIGKILL", "kind": "worker-exit",
                "action": "shrink", "replicas": 3, "lost_pid": 13, "replaced_by_pid": 0},
               {**common, "time": now + 9, "number": 2, "failed": "", "kind": "regrow", "action": "regrow",
                "replicas": 4, "lost_pid": 0, "replaced_by_pid": 901, "shrunk_s": 8.5}]
    assert [e.text for e in collect(_decoded(records), [])] == [
        "live recovery 1: node 1's rank 3 lost with no spare left: 3 process(es) went on with its data slot in "
        "0.5000 s: CPU1 (rank 3) killed by SIGKILL",
        "live recovery 2: regrow: node 1's warm spare pid 901 took back rank 3 after 8.5000 s shrunk: 4 process(es) "
        "again, its first step in 0.5000 s"]


def test_checkpoint_events_say_what_each_save_cost_the_loop(tmp_path):
    now = time.time()
    records = [{"type": "checkpoint", "rank": 0, "time": now, "step": 3, "path": "/c/step_0000003.pt",
                "stall_s": 0.05, "wait_s": 0.0, "write_s": 2.314, "mode": "async"},
               {"type": "checkpoint_write", "rank": 0, "time": now + 1, "state": "started", "step": 6,
                "path": "/c/step_0000006.pt"},
               {"type": "checkpoint_write", "rank": 0, "time": now + 2, "state": "failed", "step": 6,
                "path": "/c/step_0000006.pt"},
               {"type": "checkpoint", "rank": 0, "time": now + 3, "step": 9, "path": "/c/step_0000009.pt",
                "stall_s": 1.5, "wait_s": 1.2, "write_s": 0.3, "mode": "blocking"}]
    assert [(e.kind, e.text) for e in collect(_decoded(records), [])] == [
        ("checkpoint", "checkpoint saved at step 3: step_0000003.pt (async: loop blocked 0.05 s, written in 2.31 s)"),
        ("error", "rank 0: the background write of step_0000006.pt failed"),
        ("checkpoint", "checkpoint saved at step 9: step_0000009.pt (loop blocked 1.50 s, 1.20 s of it waiting for "
                       "the previous write)")]


def test_a_gpu_rank_row_shows_its_gpu_sample(tmp_path):
    from rich.console import Console

    from supervisor.views.top import frame

    now = time.time()
    gpu = {"type": "gpu", "time": now, "gpu": 4, "rank": 0, "util": 97, "mem_used": 61 * 1024**3,
           "mem_total": 80 * 1024**3, "temp": 71, "power_w": 655.0, "sm_clock_mhz": 1755}
    state = _state(tmp_path, _steps(0, 5, now) + [gpu])
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(frame(state, now))
    row = next(line for line in console.export_text().splitlines() if "GPU4" in line)
    for cell in ("5/100", "4.5000", "1,024", "40.0%", "1.00s", "97%", "61.0/80G", "71C", "655W", "1755MHz", "ok"):
        assert cell in row, (cell, row)


def test_a_finished_rank_shows_done_not_its_final_save_and_a_stopped_one_shutdown(tmp_path):
    from rich.console import Console

    from supervisor.views.top import frame

    now = time.time()
    saved = [{"type": "phase", "rank": r, "time": now - 2, "name": "checkpoint"} for r in (0, 1)]
    records = _steps(0, 5, now - 3) + _steps(1, 5, now - 3) + saved
    records += [{"type": "done", "rank": 0, "time": now - 1, "step": 6},  # the trainer's final save, then done
                {"type": "phase", "rank": 1, "time": now - 1, "name": "shutdown"}]  # a graceful stop
    state = _state(tmp_path, records)
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(frame(state, now))
    lines = console.export_text().splitlines()
    cells = {gpu: [c.strip() for c in next(line for line in lines if gpu in line).split("│")[1:-1]]
             for gpu in ("GPU4", "GPU5")}  # rank, device, phase, step, ...
    assert cells["GPU4"][2:4] == ["done", "6/100"] and "checkpoint" not in cells["GPU4"], cells["GPU4"]
    assert cells["GPU5"][2] == "shutdown", cells["GPU5"]

    with (state.files.run_dir / "metrics.jsonl").open("ab") as metrics:
        metrics.write(_line(type="restart", time=now, attempt=1))
    state.refresh()
    assert (state.ranks[0].done, state.ranks[0].phase, state.ranks[1].phase) == (False, None, "shutdown")

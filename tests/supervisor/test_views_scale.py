"""`gpuherd top` and `gpuherd report` on a 2,048-rank run: a bounded screen and page that
still name the failed and the slow ranks."""

from __future__ import annotations

import io
import random
import statistics
from contextlib import redirect_stdout

import pytest

from bench.bench_views import FAILED_RANK, SLOW_RANKS, synthesize
from gpuherd.status_records import from_object
from supervisor.commands import report as report_command
from supervisor.commands import top as top_command
from supervisor.views.events import collect
from supervisor.views.top_state import BEHIND_STEPS, SLOW_FACTOR, RankVerdict, RankView, _Peers, _straggler


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("views") / "run-2048"
    synthesize(run_dir, 2048, steps=3)
    return run_dir


def _decoded(records: list[dict]) -> list:
    """Records as the views get them from metrics.jsonl: decoded once."""
    return [from_object(r, supervisor=True) for r in records]


def _top(*args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert top_command.main([*args, "--once", "--width", "250"]) == 0
    return out.getvalue()


def test_top_groups_2048_ranks_by_status_and_shows_the_worst_in_full(big_run):
    screen = _top(str(big_run))
    lines = screen.splitlines()
    assert len(lines) < 40  # not 2,048 rows
    failed = next(line for line in lines if "FAILED" in line and "r[" in line)
    assert f"r[{FAILED_RANK}]" in failed
    ended = next(line for line in lines if line.lstrip("│").startswith("ended"))
    assert f"2,047" in ended and f"r[0-{FAILED_RANK - 1},{FAILED_RANK + 1}-2047]" in ended
    worst = lines[lines.index(next(line for line in lines if "most worth a look" in line)):]
    rows = [line for line in worst if line.startswith("│")]
    first_ranks = [int(row.strip("│").split("│")[0]) for row in rows]
    assert first_ranks[:4] == [FAILED_RANK, *SLOW_RANKS]  # the failed rank, then the slowest step times


def test_top_all_ranks_shows_every_row_of_a_mid_sized_run(tmp_path):
    run_dir = tmp_path / "run-40"
    synthesize(run_dir, 40, steps=2)
    screen = _top(str(run_dir), "--all-ranks")
    assert sum(1 for line in screen.splitlines() if line.startswith("│") and "GPU" in line) == 40
    assert "most worth a look" in _top(str(run_dir))


def test_report_of_2048_ranks_names_them_compactly(big_run, tmp_path):
    with redirect_stdout(io.StringIO()):
        assert report_command.main([str(big_run), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    assert "2,048 GPU workers, ranks 0-2047" in page
    assert f"rank {FAILED_RANK}: RuntimeError: CUDA error" in page
    assert len(page) < 2_000_000  # five figures and a handful of rows, not one per rank


def _brute_force(view: RankView, views: list[RankView]) -> RankVerdict | None:
    """The straggler rule as written before: every other rank, looked at again for each rank."""
    others = [v for v in views if v.rank != view.rank]
    steps = [v.step for v in others if v.step is not None]
    if view.step is not None and steps and max(steps) - view.step >= BEHIND_STEPS:
        return RankVerdict("slow", f"{max(steps) - view.step} steps behind the leading rank")
    times = [v.step_time for v in others if v.step_time]
    if view.step_time and times and view.step_time >= SLOW_FACTOR * statistics.median(times):
        return RankVerdict("slow", f"step time {view.step_time:.2f} s vs {statistics.median(times):.2f} s "
                               "on the other ranks")
    return None


@pytest.mark.parametrize("seed", range(40))
def test_straggler_verdicts_from_sorted_peers_match_the_rule(seed):
    rng = random.Random(seed)
    views = [RankView(r, step=rng.choice([None, 3, 4, 5, 5, 6]), step_time=rng.choice([None, 0.0, 1.0, 1.0, 1.6, 2.5]))
             for r in range(rng.randint(1, 9))]
    peers = _Peers(views)
    assert [_straggler(v, peers) for v in views] == [_brute_force(v, views) for v in views]


def test_an_error_every_rank_reports_is_one_event_with_the_rank_set():
    records = [{"type": "error", "rank": r, "time": 100.0 + r * 0.001, "message": "NCCL watchdog timeout"}
               for r in range(2048) if r != 5]
    records.append({"type": "error", "rank": 5, "time": 100.5, "message": "CUDA error: an illegal memory access"})
    records.append({"type": "error", "rank": 0, "time": 200.0, "message": "NCCL watchdog timeout"})  # later: its own
    assert [e.text for e in collect(_decoded(records), [])] == [
        "ranks 0-4,6-2047: NCCL watchdog timeout", "rank 5: CUDA error: an illegal memory access",
        "rank 0: NCCL watchdog timeout"]

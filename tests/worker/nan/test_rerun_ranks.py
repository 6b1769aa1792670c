"""Two real gloo ranks under DDP: rank 1's gradient goes NaN once. The all-reduce
spreads it to rank 0, both ranks replay the step together, agree it was transient,
blame rank 1 (its local gradient went bad first), and end where a clean run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.nan.replay_helpers import records

REPO = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("rerun_ranks.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("rerun2")
    out = tmp / "out"
    out.mkdir()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "GPUHERD_DEVICE_KIND": "cpu", "GPUHERD_DEVICE_ID": str(rank),
                   "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), f"file://{tmp / 'store'}", str(out)],
                                          env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, even on a timeout
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {"out": out, "codes": [p.returncode for p in procs], "stderr": [err for _, err in results]}


def test_both_ranks_retry_the_step_and_end_where_a_clean_run_ends(run):
    assert run["codes"] == [0, 0], run["stderr"]
    for rank in range(2):
        got = json.loads((run["out"] / f"rank{rank}.json").read_text())
        assert got["faulty"] == got["clean"]  # every step's weights, bit for bit


def test_the_warning_and_the_suspect_record_name_rank_1(run):
    warnings = [[line for line in err.splitlines() if line.startswith("WARNING | ") and "Transient fault" in line]
                for err in run["stderr"]]
    assert warnings[0] == []  # rank 0 only received the NaN through the all-reduce
    (line,) = warnings[1]
    assert "Transient fault at step 1" in line and "suspect device: rank 1 [CPU 1] cpu on " in line
    for rank in range(2):
        nan = [r for r in records(run["out"] / f"status{rank}.jsonl") if r["type"] == "nan"]
        assert [(r["step"], r["action"], r["classification"], r["culprits"]) for r in nan] == [
            (1, "retried", "transient", [1])]
    suspects = [[r for r in records(run["out"] / f"status{rank}.jsonl") if r["type"] == "suspect"] for rank in range(2)]
    assert suspects[0] == [] and [(r["rank"], r["transient_faults"]) for r in suspects[1]] == [(1, 1)]

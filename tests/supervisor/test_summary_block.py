"""The console's end-of-run block for the outcomes a multi-node SLURM job adds: a planned stop
is one line, not a failure block, and node 0's block carries every node's outcome."""

from __future__ import annotations

from supervisor.summary import RootCause, Summary


def _summary(cause: RootCause | None, exit_code: int, **fields) -> Summary:
    return Summary(run_id="slurm-7", run_dir="logs/slurm-7-node0", mode="train", command=["python", "-m", "worker"],
                   exit_code=exit_code, outcome=cause.kind if cause else "success", started_at="t0", duration_s=9.0,
                   root_cause=cause, workers=[], **fields)


STOPPED = RootCause("terminated", 143, "stopped by SLURM: scancel (SIGTERM); checkpoint step 3 saved: ck/step_3.pt")
NODES = [
    {"node": 0, "host": "n-a", "exit_code": 143, "outcome": "terminated", "final_save": "saved", "run_dir": "logs/a"},
    {"node": 1, "outcome": "unknown: it never said"},
]


def test_a_planned_stop_is_one_line_with_the_checkpoint():
    block = _summary(STOPPED, 143).block()
    assert block.splitlines()[:2] == ["gpuherd: run slurm-7 stopped (exit 143)", f"root cause: {STOPPED.message}"]
    assert "FAILED" not in block and "====" not in block


def test_a_stop_whose_save_was_cut_is_a_failure():
    cut = RootCause("terminated", 1, "stopped by SLURM: scancel (SIGTERM); the final checkpoint was NOT saved: x")
    assert "FAILED with exit code 1" in _summary(cut, 1).block()


def test_node_zero_lists_every_node():
    lines = _summary(STOPPED, 143, node_outcomes=NODES).block().splitlines()
    assert "node 0 (n-a): exit 143 (terminated), final checkpoint saved; logs/a" in lines
    assert "node 1: unknown: it never said" in lines
    assert not [line for line in _summary(None, 0).block().splitlines() if line.startswith("node ")]

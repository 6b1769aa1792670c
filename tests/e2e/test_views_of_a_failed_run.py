"""`gpuherd top` and `gpuherd report`, as the commands a user types, on the files a real run
left: the worker's long non-ASCII error that the status channel cut to fit 4 KB (the record
arrives without its message), and lines a crashed or hostile writer appended to
metrics.jsonl. Both views show the run and count what they skipped, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import orjson

from gpuherd import contract
from tests.e2e.helpers import records

TINY = [
    "system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=1",
    "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.max_steps=5", "training.eval_every=0", "training.save_every=0",
]
# A value the worker refuses, quoting it: its error is ~2,000 characters of 3-byte UTF-8
LONG_NON_ASCII = "0:1:" + "节点 3 不再响应。" * 300
APPENDED = [
    b'{"type": "step", "rank": 0, "time": 6.0, "st',  # a line cut by a crash or a full disk
    b"\xff\xfe\x00 binary",
    b'{"type": "step", "rank": 0, "time": 6.0, "step": "seven", "loss": 1.0}',
]


def _view(cwd, python_env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.commands.dispatch", *args], cwd=cwd, env=python_env,
                          capture_output=True, text=True, timeout=120)


def test_top_and_report_read_a_truncated_error_and_garbage_lines(tmp_path, python_env):
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--nproc", "1", "--max-restarts", "0",
           "--run-id", "long"]
    for item in TINY:
        cmd += ["--set", item]
    env = dict(python_env, **{contract.INJECT_BITFLIP: LONG_NON_ASCII})
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr[-3000:]
    run_dir = tmp_path / "logs" / "long"
    (error,) = records(run_dir, "error")
    assert error.get("truncated") and "message" not in error, error  # as found: the channel cut it
    with (run_dir / "metrics.jsonl").open("ab") as metrics:
        metrics.write(b"\n".join(APPENDED) + b"\n")

    top = _view(tmp_path, python_env, "top", str(run_dir), "--once", "--width", "250")
    assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr[-3000:]
    assert "too long for the status channel" in top.stdout, top.stdout
    assert f"{len(APPENDED)} unreadable line(s) in metrics.jsonl skipped" in top.stdout, top.stdout

    report = _view(tmp_path, python_env, "report", str(run_dir))
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr[-3000:]
    page = (run_dir / "report" / "report.html").read_text()
    assert "rank 0: error (its message was too long for the status channel" in page
    assert f"<td>unreadable lines in metrics.jsonl (skipped)</td><td>{len(APPENDED)}</td>" in page
    assert orjson.loads((run_dir / "summary.json").read_bytes())["exit_code"] == 2

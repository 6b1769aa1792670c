"""What gpuherd says about a script's own checkpoints, with real scripts, real saves and real signals.

gpuherd saves nothing for a `--script`; every line about the script's checkpoints says what it
saw (the bootstrap watching torch.save, or gpuherd's Lightning callback), never that the next
attempt "started afresh" or that a Ctrl-C will save, and goodput books the steps after the last
save it saw as `redone`.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.e2e.test_torchrun_dropin import SCRIPTS, _env, gpuherd_run
from tests.supervisor import helpers as sh

SLACK_S = 0.01  # goodput is counted in milliseconds: each painted piece is rounded on its own


def _records(run_dir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def _attempt_records(records: list[dict], attempt: int) -> list[dict]:
    """The records between attempt `attempt`'s start mark and the next attempt's."""
    marks = [i for i, r in enumerate(records) if r["type"] == "timeline" and r.get("event") == "attempt"]
    end = marks[attempt + 1] if attempt + 1 < len(marks) else len(records)
    return records[marks[attempt]:end]


def _redone_bounds(records: list[dict]) -> tuple[float, float]:
    """The productive time after the last save that the goodput must call redone: at least from the
    save's end to the leader's last step record, at most from the save's start."""
    save = [r for r in records if r["type"] == "script_save"][-1]
    last_step = max(r["time"] for r in records if r["type"] == "step" and r["rank"] == 0)
    assert last_step > save["time"], "no step record after the last save: nothing to book"
    return last_step - save["time"] - SLACK_S, last_step - save["time"] + save["seconds"] + SLACK_S


def test_a_killed_script_is_restarted_naming_its_last_torch_save_and_the_steps_after_it_are_redone(tmp_path):
    ckpt = tmp_path / "model.pt"
    result = subprocess.run([*gpuherd_run(), "--nproc-per-node", "1", "--max-restarts", "1",
                             str(SCRIPTS / "saving_script.py"), "--ckpt", str(ckpt), "--steps", "15",
                             # 4 steps of >= 0.2 s after the save: the heartbeat (every 0.5 s) reports one of them
                             "--kill-at", "14", "--sleep", "0.2"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step 10" in result.stdout
    seen = f"the last save gpuherd saw: rank 0's torch.save to {ckpt} after 10 optimizer step(s) of attempt 0, "
    restart = next(line for line in result.stderr.splitlines() if "restart 1 of 1" in line)
    assert "the script starts again with the same command; " + seen in restart, restart
    assert "no checkpoint written yet" not in result.stderr and "started afresh" not in result.stderr
    assert "attempt 1 started the script again; " + seen in result.stderr
    run_dir = sh.run_dir_of(tmp_path)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    first = summary["attempts"][0]["script_saves"]
    assert (first["rank"], first["step"], first["path"], first["api"]) == (0, 10, str(ckpt), "torch.save")
    low, high = _redone_bounds(_attempt_records(_records(run_dir), 0))
    assert low <= summary["goodput"]["badput_s"]["redone"] <= high


@pytest.mark.parametrize("saves_on_interrupt", [False, True])
def test_ctrl_c_tells_the_script_and_says_whether_a_save_followed(tmp_path, saves_on_interrupt):
    """The script decides what Ctrl-C means: one that saves nothing loses the steps after its
    last save (goodput: redone); one that saves on KeyboardInterrupt keeps them."""
    ckpt = tmp_path / "model.pt"
    cmd = [*gpuherd_run(), "--nproc-per-node", "1", str(SCRIPTS / "saving_script.py"), "--ckpt", str(ckpt),
           "--steps", "100000", "--every", "5", "--sleep", "0.1"] + (["--save-on-interrupt"] * saves_on_interrupt)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("CPU0:step 8 "):
                break
        proc.send_signal(signal.SIGINT)
        code, _, err = sh.finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, err[-3000:]
    assert "Ctrl-C: SIGINT to every worker; what the script does with it is its own" in err
    assert "save a checkpoint" not in err
    run_dir = sh.run_dir_of(tmp_path)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    cause = summary["root_cause"]["message"]
    redone = summary["goodput"]["badput_s"]["redone"]
    if saves_on_interrupt:
        assert f"the script saved after the signal: rank 0's torch.save to {ckpt} after " in cause, cause
        assert redone < SLACK_S  # everything it trained was kept
    else:
        assert (f"no save followed the signal (the last save gpuherd saw: rank 0's torch.save to {ckpt} "
                "after 5 optimizer step(s) of attempt 0, ") in cause, cause
        low, high = _redone_bounds(_records(run_dir))
        assert low <= redone <= high
    assert f"root cause: {cause}" in err


@pytest.mark.slow
def test_a_lightning_run_killed_at_step_45_names_its_save_at_step_40_and_books_the_steps_after_it_redone(tmp_path):
    """Lightning's own ModelCheckpoint every 10 steps, `ckpt_path="last"`, gpuherd's callback, DDP over
    gloo on 2 ranks; rank 1 is SIGKILLed at step 45: the restart names the save at step 40 and its path."""
    pytest.importorskip("pytorch_lightning", reason="a dev dependency (pytorch-lightning): pip install -r requirements-dev.txt")
    ckpt = tmp_path / "ckpt"
    result = subprocess.run([*gpuherd_run(), "--nproc-per-node", "2", "--max-restarts", "1",
                             str(SCRIPTS / "lightning_ckpt_train.py"), "--ckpt-dir", str(ckpt), "--steps", "50",
                             "--kill-at", "45", "--callback"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Restored all states from the checkpoint at " + str(ckpt / "last.ckpt") in result.stdout + result.stderr
    seen = f"the last save gpuherd saw: rank 0's Lightning checkpoint {ckpt / 'last.ckpt'} at step 40, "
    restart = next(line for line in result.stderr.splitlines() if "restart 1 of 1" in line)
    assert "the script starts again with the same command; " + seen in restart, restart
    run_dir = sh.run_dir_of(tmp_path)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["attempts"][0]["script_saves"]["step"] == 40
    records = _attempt_records(_records(run_dir), 0)
    assert max(r["step"] for r in records if r["type"] == "step" and r["rank"] == 0) > 40  # reported past the save
    low, high = _redone_bounds(records)
    assert low <= summary["goodput"]["badput_s"]["redone"] <= high

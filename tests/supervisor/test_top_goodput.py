"""`gpuherd top`'s goodput line on a real run: while it trains (after a restart) and once it ended.

Before: `goodput: no training record yet` for the whole run, with or without restarts:
`RunState.refresh` handed the panel the typed records every other panel gets, and the panel
decoded only dicts.
"""

from __future__ import annotations

import re
import sys

import orjson

from supervisor.goodput import Goodput, console_line
from tests.supervisor import helpers as sh
from tests.supervisor.helpers import env as run_env
from tests.supervisor.screen import run_in_terminal

TOP = [sys.executable, "-m", "supervisor.commands.top", "--once"]
RATIO = re.compile(r"goodput (\d\.\d\d)")


def _trains_again_after_a_restart(cwd) -> bool:
    run_dir = sh.run_dir_of(cwd)
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return False
    kinds = [orjson.loads(line).get("type") for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()
             if line.endswith(b"}")]
    return "restart" in kinds and "step" in kinds[kinds.index("restart"):]


def test_top_shows_the_runs_goodput_while_it_trains_and_summary_jsons_once_it_ended(tmp_path):
    # rank 1 fails in attempt 0 (a restart), then both train; rank 0's 400 steps take ~10 s
    proc = sh.start(tmp_path, "train:400", "fail-until:1", args=("--max-restarts", "1"))
    try:
        assert sh.wait_for(lambda: _trains_again_after_a_restart(tmp_path), timeout=60)
        live = run_in_terminal(TOP, tmp_path, run_env())
    finally:
        code, _out, err = sh.finish(proc, timeout=120)
    assert code == 0, err[-2000:]
    assert live.returncode == 0 and "running" in live.text(), live.text()
    assert "no training record" not in live.text(), live.text()
    line = live.lines[live.row_of("goodput ")]
    assert RATIO.search(line) and "last 5 min" in line and "last 15 min" in line, line

    run_dir = sh.run_dir_of(tmp_path)
    block = orjson.loads((run_dir / "summary.json").read_bytes())["goodput"]
    ended = run_in_terminal(TOP, tmp_path, run_env())
    assert ended.returncode == 0 and "finished: success" in ended.text(), ended.text()
    line = ended.lines[ended.row_of("goodput ")]
    assert line.startswith(console_line(Goodput(**block))), (line, block)  # summary.json's, as the run printed it
    assert block["badput_s"]["restart"] > 0  # the restart is in it

"""`gpuherd top` and `gpuherd report` on a real run's summary.json with one field of the wrong type:
the field is skipped, and one line names it; never a traceback.

Before: a summary.json whose `goodput.ratio` is a string ended `gpuherd report` in
`ValueError: Unknown format code 'f'` (exit 1), and most other fields the views read did the same
(`workers[0]` a string: AttributeError in top; `duration_s` a string: TypeError in the report).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.supervisor import helpers as sh
from tests.supervisor.test_views_unreadable import _report, _top

# every field of summary.json that top or the report reads, as the skip line names it
READ = ["goodput", "goodput.ratio", "goodput.wall_s", "goodput.productive_s", "goodput.badput_s",
        "goodput.badput_s.restart", "goodput.shrunk_s", "outcome", "exit_code", "duration_s", "started_at",
        "restarts", "max_restarts", "root_cause", "root_cause.message", "root_cause.rank", "root_cause.stderr_tail",
        "root_cause.stderr_tail[0]", "workers", "workers[1]", "workers[1].rank", "workers[1].role",
        "workers[1].ended", "attempts", "attempts[0]", "attempts[0].attempt", "attempts[0].started_at",
        "attempts[0].duration_s", "attempts[0].outcome", "suspect_devices", "suspect_devices[0]",
        "suspect_devices[0].gpu", "suspect_devices[0].device", "suspect_devices[0].rank",
        "suspect_devices[0].attempt", "suspect_devices[0].transient_faults", "suspect_devices[0].cause",
        "suspect_devices[0].limit", "suspect_devices[0].then", "suspect_devices[0].steps",
        "suspect_devices[0].steps[0]", "suspect_devices[0].evidence", "suspect_devices[0].evidence[0]"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A run that failed twice with a suspect device (exit 8) after one restart: every block the
    views read is in its summary.json (goodput, root_cause, workers, attempts, suspect_devices)."""
    cwd = tmp_path_factory.mktemp("suspect")
    result = sh.run(cwd, "train:10", "suspect:2", args=("--max-restarts", "1"), timeout=120)
    assert result.code == 8, result.err[-2000:]
    summary = result.summary
    summary["suspect_devices"][0]["evidence"] = ["bucket 3 differs in bit 17"]  # an SDC's, so evidence is read too
    (result.run_dir / "summary.json").write_bytes(orjson.dumps(summary))
    return result.run_dir


def _mangled(run: Path, where: Path, path: str) -> Path:
    """A copy of `run` whose summary.json holds a value of the wrong type at `path`."""
    copy = where / "logs" / run.name
    shutil.copytree(run, copy)
    summary = orjson.loads((copy / "summary.json").read_bytes())
    *parents, last = _steps(path)
    holder = summary
    for step in parents:
        holder = holder[step]
    holder[last] = 7 if isinstance(holder[last], str) else "7"
    (copy / "summary.json").write_bytes(orjson.dumps(summary))
    return copy


def _steps(path: str) -> list[str | int]:
    """`workers[1].rank` -> ["workers", 1, "rank"]."""
    steps: list[str | int] = []
    for part in path.split("."):
        name, _, index = part.partition("[")
        steps.append(name)
        if index:
            steps.append(int(index.rstrip("]")))
    return steps


@pytest.mark.parametrize("path", READ)
def test_top_skips_a_field_of_the_wrong_type_and_names_it(real_run, tmp_path, path):
    screen = _top(_mangled(real_run, tmp_path, path))
    assert f"summary.json: 1 unreadable field(s) skipped: {path}\n" in screen, screen
    assert "FAILED with exit code 8" in screen or path in ("exit_code", "root_cause", "root_cause.message"), screen


@pytest.mark.parametrize("path", ["goodput", "goodput.badput_s.restart", "goodput.shrunk_s", "duration_s",
                                  "root_cause", "workers[1]", "attempts[0].duration_s", "suspect_devices[0].steps"])
def test_the_report_skips_a_field_of_the_wrong_type_and_names_it(real_run, tmp_path, path):
    page = _report(_mangled(real_run, tmp_path, path))
    assert f"<td>unreadable fields in summary.json (skipped)</td><td>1: {path}</td>" in page
    assert "<td>exit code</td><td>8</td>" in page or path == "exit_code"


def test_gpuherd_report_on_a_goodput_ratio_that_is_a_string_writes_the_report(real_run, tmp_path):
    """As found: `gpuherd report RUN`, a real process, exit 1 with a traceback before."""
    run_dir = _mangled(real_run, tmp_path, "goodput.ratio")
    done = subprocess.run([sys.executable, "-m", "supervisor.commands.report", str(run_dir)], env=sh.env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"{run_dir / 'report' / 'report.html'}\n"
    assert "1: goodput.ratio" in (run_dir / "report" / "report.html").read_text()


def _not_json(path: Path) -> None:
    path.write_bytes(b'{"outcome": "success", "exit_')


def _a_list(path: Path) -> None:
    path.write_bytes(b'["outcome", "success"]')


def _a_named_pipe(path: Path) -> None:
    os.mkfifo(path)  # nobody writes it: a plain open would wait forever


def _a_device(path: Path) -> None:
    path.symlink_to("/dev/zero")  # never ends


def _view(*argv: str) -> subprocess.CompletedProcess:
    """A view as a real process, bounded: before, a named pipe blocked it for good and /dev/zero
    grew its memory without end (here: a MemoryError within its 4 GiB address space)."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # noqa: E731
    return subprocess.run([sys.executable, "-m", *argv], env=sh.env(), capture_output=True, text=True, timeout=60,
                          preexec_fn=limit)


@pytest.mark.parametrize("damage, words", [(_not_json, "not JSON"), (_a_list, "not a JSON object"),
                                           (_a_named_pipe, "a named pipe"), (_a_device, "a character device")])
def test_a_summary_json_that_cannot_be_read_at_all_is_named_whole(real_run, tmp_path, damage, words):
    copy = tmp_path / "logs" / real_run.name
    shutil.copytree(real_run, copy)
    (copy / "summary.json").unlink()
    damage(copy / "summary.json")
    top = _view("supervisor.commands.top", str(copy), "--once", "--width", "300")
    assert top.returncode == 0 and top.stderr == "", top.stderr[-2000:]
    assert f"summary.json: 1 unreadable field(s) skipped: the whole file: {words}\n" in top.stdout, top.stdout
    assert "ended: summary.json does not say how" in top.stdout
    if damage in (_a_named_pipe, _a_device):  # the two a plain read never returns from
        report = _view("supervisor.commands.report", str(copy))
        assert report.returncode == 0 and report.stderr == "", report.stderr[-2000:]
        assert f"<td>1: the whole file: {words}</td>" in (copy / "report" / "report.html").read_text()

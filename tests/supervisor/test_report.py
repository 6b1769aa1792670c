"""`gpuherd report`: HTML + PNGs for one run and for runs compared, and what a browser shows."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from supervisor.views.figures import FIGURES
from supervisor.views.report import config_diff
from tests.supervisor.helpers import env as run_env

REPORT = [sys.executable, "-m", "supervisor.commands.report"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]


def report(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*REPORT, *args], cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=120)


def assert_drawn(png) -> None:
    """A real figure: a sizeable image with a good share of non-background pixels."""
    image = imread(png)
    assert image.shape[0] > 300 and image.shape[1] >= 1000
    ink = np.any(image[:, :, :3] < 0.9, axis=2).mean()
    assert ink > 0.02, f"{png} is almost blank ({ink:.1%} drawn)"


@pytest.mark.slow
def test_report_of_one_debug_run(finished_debug_run):
    result = report(str(finished_debug_run), cwd=finished_debug_run.parent)
    assert result.returncode == 0, result.stderr
    html_path = finished_debug_run / "report" / "report.html"
    assert result.stdout.strip() == str(html_path)
    for name in FIGURES:
        assert_drawn(finished_debug_run / "report" / f"{name}.png")
    page = html_path.read_text()
    assert page.count("src='data:image/png;base64,") == len(FIGURES)
    assert "<td>success</td>" in page and "CPU0 (rank 0), CPU1 (rank 1)" in page
    assert "checkpoint saved at step 10" in page and "<h2>Key settings</h2>" in page
    # the debug preset saves only at the end: that save blocks, and each rank reports it
    assert re.search(r"<td>checkpoint cost \(median per save\)</td><td>2 saves: loop blocked \d+\.\d{3} s, "
                     r"write \d+\.\d\d s; 0 in the background</td>", page), page


@pytest.mark.slow
def test_report_comparing_two_runs(finished_debug_run, second_debug_run, tmp_path):
    out = tmp_path / "compared"
    result = report(str(finished_debug_run), str(second_debug_run), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in FIGURES:
        assert_drawn(out / f"{name}.png")
    page = (out / "report.html").read_text()
    assert "<h2>Config differences</h2>" in page
    assert "<tr><td>training.learning_rate</td><td>0.0003</td><td>0.001</td></tr>" in page
    assert "<tr><td>system.nproc</td><td>2</td><td>1</td></tr>" in page
    assert f"{finished_debug_run.name} vs {second_debug_run.name}" in page


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
def test_the_report_renders_every_figure_in_a_headless_browser(finished_debug_run, tmp_path):
    """Chromium loads the page from disk, offline; a probe appended to a copy lists each
    image as the browser decoded it."""
    assert report(str(finished_debug_run), cwd=tmp_path).returncode == 0
    page = (finished_debug_run / "report" / "report.html").read_text()
    probe = ("<script>window.addEventListener('load', function () { var p = document.createElement('pre');"
             "p.id = 'probe'; p.textContent = Array.prototype.map.call(document.images, function (i) {"
             "return i.id + '=' + (i.complete ? i.naturalWidth : 0); }).join(' '); document.body.appendChild(p); });"
             "</script></body>")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", probe))
    dom = subprocess.run([CHROMIUM, *HEADLESS, "--dump-dom", probed.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    shown = dict(item.split("=") for item in dom.split('<pre id="probe">')[1].split("</pre>")[0].split())
    assert shown == {f"fig-{name}": "1000" for name in FIGURES}
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *HEADLESS, "--hide-scrollbars", "--window-size=1200,3000", f"--screenshot={shot}",
                    (finished_debug_run / "report" / "report.html").as_uri()], capture_output=True, timeout=120)
    assert_drawn(shot)


def test_a_run_that_does_not_exist_writes_nothing_and_exits_2(tmp_path):
    (tmp_path / "logs" / "real").mkdir(parents=True)
    (tmp_path / "logs" / "real" / "config.json").write_text("{}")
    result = report("real", "ghost", "--logs", str(tmp_path / "logs"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gpuherd report: error: run 'ghost' not found (neither a directory nor a run id under {tmp_path / 'logs'})"]
    assert list((tmp_path / "logs" / "real").iterdir()) == [tmp_path / "logs" / "real" / "config.json"]


def test_config_diff_lists_only_the_settings_that_differ():
    a = {"training": {"learning_rate": 3e-4, "max_steps": 10}, "preset": "debug"}
    b = {"training": {"learning_rate": 1e-3, "max_steps": 10}, "preset": "debug", "extra": {"x": None}}
    assert config_diff([a, b]) == [["extra.x", "-", "null"], ["training.learning_rate", "0.0003", "0.001"]]

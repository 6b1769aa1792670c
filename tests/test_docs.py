"""The docs stay true and walkable: README.md is short and its commands are what CI runs,
the generated reference tables match the code, and `mkdocs build --strict` passes (a broken
link or anchor, a page missing from the navigation, a stale table: each fails it)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuherd.status_channel import RECORD_TYPES

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = ["bash install.sh && bash run_training.sh --debug", "bash install.sh --test && .venv/bin/python -m pytest"]


def _reference_pages():
    spec = importlib.util.spec_from_file_location("reference_pages", ROOT / "scripts" / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_short():
    lines = _readme().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; the rest belongs in docs/"


def test_readme_quick_start_is_the_two_commands():
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", _readme(), re.S)
    assert block, "README.md has no quick-start code block"
    assert block.group(1).splitlines() == QUICK_START


def test_ci_installs_and_tests_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install, test = QUICK_START[1].split(" && ")
    assert install in ci and test in ci
    assert "bash run_training.sh --debug" in ci
    assert any("mkdocs build --strict" in line for line in ci)


def test_readme_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)", _readme()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_no_word_only_the_projects_history_explains():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        found = re.search(r"\bseeds? \d{3}\b", page.read_text(), re.I)
        assert not found, f"{page.relative_to(ROOT)}: '{found.group(0)}' means nothing to a reader"


def test_generated_reference_tables_match_the_code():
    assert _reference_pages().stale() == [], "run python scripts/reference_pages.py"


def test_a_table_that_differs_from_the_code_is_stale(tmp_path):
    pages = _reference_pages()
    page = tmp_path / "docs" / "reference" / "exit-codes.md"
    page.parent.mkdir(parents=True)
    for name, (path, _make) in pages.PAGES.items():
        (tmp_path / path).write_text((ROOT / path).read_text())
    page.write_text(page.read_text().replace("| 124 |", "| 125 |"))
    assert pages.stale(tmp_path) == ["docs/reference/exit-codes.md (exit_codes)"]


def test_every_status_record_type_is_described():
    page = (ROOT / "docs" / "reference" / "status-records.md").read_text()
    described = {name for line in page.splitlines() if line.startswith("| `")
                 for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    missing = [t for t in RECORD_TYPES if t not in described]
    assert not missing, f"status record types without a row in docs/reference/status-records.md: {missing}"


def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip("mkdocs", reason="a dev dependency: pip install -r requirements-dev.txt")
    pytest.importorskip("material", reason="a dev dependency (mkdocs-material): pip install -r requirements-dev.txt")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                            "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "reference" / "exit-codes" / "index.html").exists()


def test_every_record_field_says_what_it_means():
    """The status-records page's field tables come from gpuherd/status_records.py's comments:
    a field declared without one would leave its row empty."""
    page = (ROOT / "docs" / "reference" / "status-records.md").read_text()
    empty = [line for line in page.splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not empty, f"record fields without a comment in gpuherd/status_records.py: {empty}"


def test_the_suspect_devices_fields_the_sdc_guide_names_are_summary_jsons():
    """Before: the guide listed a `strikes` field that summary.json's suspect_devices never had
    (the count is `transient_faults`). Every field is named, as written, and no other."""
    import dataclasses

    from supervisor.summary import SuspectDevice

    text = " ".join((ROOT / "docs" / "guide" / "silent-data-corruption.md").read_text().split())
    listed = re.search(r"`suspect_devices`: (.*?) and `gpuherd report`", text).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == {f.name for f in dataclasses.fields(SuspectDevice)}

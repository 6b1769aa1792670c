"""A damaged cache is detected, reported and rebuilt -- never trained on."""

from __future__ import annotations

import os

import pytest
from tests.dataset_cache.helpers import capture_loguru, data_config, run_prepare_cli

from dataset_cache import CacheCorruptError, DatasetError, open_cache, prepare_cache

caplog_loguru = pytest.fixture(capture_loguru)


@pytest.fixture
def built(tmp_path):
    cfg = data_config(tmp_path)
    info = prepare_cache(cfg)
    return cfg, info, (info.path / "tokens.bin").read_bytes()


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_truncation_is_caught_by_the_cheap_check_and_rebuilt(built, caplog_loguru):
    cfg, info, original = built
    tokens = info.path / "tokens.bin"
    os.truncate(tokens, tokens.stat().st_size - 2)
    with pytest.raises(CacheCorruptError, match="truncated"):
        open_cache(info.path)  # sizes are checked on every open, verify or not
    again = prepare_cache(cfg)
    assert again.built and again.path == info.path
    assert tokens.read_bytes() == original
    assert any("rebuilding" in message for message in caplog_loguru)


def test_flipped_byte_is_caught_by_the_checksum_and_rebuilt(built):
    cfg, info, original = built
    tokens = info.path / "tokens.bin"
    flip_byte(tokens, len(original) // 2)
    open_cache(info.path)  # same size: only a checksum can tell
    with pytest.raises(CacheCorruptError, match="sha256"):
        open_cache(info.path, verify=True)
    assert not prepare_cache(cfg).built  # size check only: data.verify_cache is off
    again = prepare_cache(cfg, verify=True)
    assert again.built
    assert tokens.read_bytes() == original


def test_verify_cache_setting_checks_every_open(built):
    cfg, info, original = built
    flip_byte(info.path / "doc_offsets.bin", 3)
    cfg.verify_cache = True
    assert prepare_cache(cfg).built


@pytest.mark.parametrize("damage", ["no metadata", "bad json", "edited counts", "missing tokens"])
def test_damaged_metadata_or_files(built, damage):
    cfg, info, original = built
    meta = info.path / "metadata.json"
    if damage == "no metadata":
        meta.unlink()
    elif damage == "bad json":
        meta.write_text("{")
    elif damage == "edited counts":
        meta.write_bytes(meta.read_bytes().replace(b'"train":', b'"train":1', 1))
    else:
        (info.path / "tokens.bin").unlink()
    with pytest.raises(CacheCorruptError) as caught:
        open_cache(info.path)
    assert "\n" not in str(caught.value)
    assert prepare_cache(cfg).built
    assert (info.path / "tokens.bin").read_bytes() == original


def test_worker_side_open_refuses_a_missing_cache(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        open_cache(tmp_path / "0123456789abcdef")


def test_another_caches_files_under_this_key_are_replaced(tmp_path):
    a = prepare_cache(data_config(tmp_path, num_samples=50))
    b = prepare_cache(data_config(tmp_path, num_samples=60))
    original = (a.path / "tokens.bin").read_bytes()
    for name in ("tokens.bin", "doc_offsets.bin", "metadata.json"):
        (a.path / name).write_bytes((b.path / name).read_bytes())
    again = prepare_cache(data_config(tmp_path, num_samples=50))
    assert again.built and (a.path / "tokens.bin").read_bytes() == original


def test_out_of_vocabulary_tokens_are_named_exit_3_and_rebuilt_next_run(tmp_path):
    """A cache whose tokens.bin was overwritten with ids past the vocabulary (sizes intact, so the
    cheap check passes): the run names the damaged cache and exits 3 instead of an IndexError
    in the embedding; the next run rebuilds it."""
    import subprocess
    import sys

    import numpy as np
    import orjson

    from tests.supervisor import helpers as sh

    (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question. " * 400)
    flags = ["--debug", "--set", f"data.dataset={tmp_path / 'corpus.txt'}", "--set", "data.tokenizer=byte",
             "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    first = run_prepare_cli(*flags, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (cache,) = [p for p in (tmp_path / "cache").iterdir() if (p / "tokens.bin").is_file()]
    tokens = np.memmap(cache / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[:] = 65535  # every id past the byte tokenizer's 256
    tokens.flush()
    del tokens
    run = subprocess.run([sys.executable, "-m", "supervisor", *flags, "--nproc", "1", "--max-steps", "3",
                          "--no-report", "--skip-checks", "--run-id", "oov"], cwd=tmp_path, env=sh.env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    assert f"dataset cache {cache} is damaged: token id 65535 is outside the vocabulary of tokenizer byte" in run.stderr
    assert "IndexError" not in run.stderr
    summary = orjson.loads((tmp_path / "logs" / "oov" / "summary.json").read_bytes())
    assert summary["exit_code"] == 3 and "is damaged: token id 65535" in summary["root_cause"]["message"]
    again = run_prepare_cli(*flags, cwd=tmp_path)
    assert again.returncode == 0 and "found damaged while training" in again.stderr, again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("status:")][0].split()[1] == "built,"

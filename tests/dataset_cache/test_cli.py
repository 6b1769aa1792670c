"""prepare_dataset.py as a user runs it: from another directory, build, reuse,
verify, list, clean; usage errors exit 2."""

from __future__ import annotations

import os

import pytest
from tests.dataset_cache.helpers import run_prepare_cli


@pytest.fixture
def cli(tmp_path):
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)

    def run(*args: str):
        return run_prepare_cli("--debug", "--set", "data.dataset=dummy", "--set", "data.tokenizer=byte",
                               "--set", "data.num_samples=100", *args, cwd=elsewhere)
    return run, elsewhere / "cache" / "datasets"


def field(output: str, name: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in output.splitlines() if line.startswith(f"{name}:"))


def test_build_reuse_verify_list_clean(cli):
    run, cache_dir = cli
    first = run("--workers", "2")
    assert first.returncode == 0, first.stderr
    key, path = field(first.stdout, "key"), field(first.stdout, "path")
    assert path == str(cache_dir / key)  # relative cache_dir resolved against the caller's directory
    assert field(first.stdout, "status").startswith("built, checksums verified")
    assert "tokens" in first.stdout and "INFO | built dataset cache" in first.stderr

    again = run("--verify-cache")
    assert again.returncode == 0 and field(again.stdout, "key") == key
    assert field(again.stdout, "status").startswith("reused, checksums verified")

    listing = run("--list")
    assert listing.returncode == 0 and key in listing.stdout and "dummy-v1 | byte" in listing.stdout

    assert run("--clean", "ffff").returncode == 3
    cleaned = run("--clean", key[:6])
    assert cleaned.returncode == 0 and "removed 1 cache" in cleaned.stdout
    assert not (cache_dir / key).exists() and "0 caches" in run("--list").stdout


def test_usage_errors_exit_2(cli):
    run, _ = cli
    done = run("--list", "--clean")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert run("--set", "data.nope=1").returncode == 2


def test_dataset_errors_exit_3_in_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff" * 10)
    done = run_prepare_cli("--set", f"data.dataset={bad}", "--set", "data.tokenizer=byte", cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=""))
    assert done.returncode == 3
    assert done.stderr.strip().splitlines()[-1] == (
        f"prepare_dataset.py: error: {bad}: not UTF-8 text (byte 0xff at offset 0); "
        "data.on_bad_record=skip skips the rest of such a file"
    )


def test_file_names_that_are_not_utf8_are_built_and_keyed_by_their_bytes(tmp_path):
    """A corpus directory holding `caf\\xe9.txt` (Latin-1 bytes): built, keyed by the name's exact
    bytes (a differently named copy gets another key), and a UTF-8 name keeps the key it always had."""
    from dataset_cache.hashing import canonical_json, sha256_bytes, sha256_of_parts

    def corpus(name: bytes) -> str:
        root = tmp_path / name.hex()
        root.mkdir()
        with open(os.path.join(os.fsencode(root), name), "wb") as handle:
            handle.write(b"the same text in both corpora " * 400)
        return str(root)

    keys = []
    for name in (b"caf\xe9.txt", b"cafe.txt"):
        done = run_prepare_cli("--debug", "--set", f"data.dataset={corpus(name)}", "--set", "data.tokenizer=byte",
                               cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert field(done.stdout, "status").startswith("built, checksums verified")
        keys.append(field(done.stdout, "key"))
    assert keys[0] != keys[1]
    assert sha256_of_parts([("a/b.txt", "00")]) == sha256_bytes(canonical_json([["a/b.txt", "00"]]))


def test_a_dataset_path_that_is_not_utf8_is_one_line_exit_2(tmp_path):
    latin1 = os.path.join(os.fsencode(tmp_path), b"donn\xe9es")
    os.mkdir(latin1)
    done = run_prepare_cli("--set", f"data.dataset={os.fsdecode(latin1)}", "--set", "data.tokenizer=byte",
                           cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "donn\\xe9es' holds bytes that are not UTF-8" in lines[0], done.stderr
    assert not (tmp_path / "cache").exists()

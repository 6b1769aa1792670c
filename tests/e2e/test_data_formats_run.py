"""Real corpora end to end: each input format, a HF save_to_disk directory and a
two-source mixture build their cache and train under `bash run_training.sh`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.dataset_cache.corpora import documents, jsonl_bytes, write_corpus, write_parquet, zstd

DOCS = documents(400)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return {fmt: write_corpus(root / fmt, fmt, DOCS) for fmt in ("txt", "jsonl.gz", "jsonl.zst", "parquet")}


def train(repo_root: Path, cwd: Path, env: dict[str, str], *args: str) -> str:
    """Three debug steps with the byte tokenizer; the run's console output."""
    result = subprocess.run(
        ["bash", str(repo_root / "run_training.sh"), "--debug", "--max-steps", "3", "--set", "data.tokenizer=byte", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    for rank in range(2 if "--nproc" not in args else 1):
        steps = {int(m) for m in re.findall(rf"^CPU{rank}:INFO \| \[CPU {rank}\] Step \[(\d+)/3\]", out, re.MULTILINE)}
        assert steps == {0, 1, 2}, out[-4000:]
    return out


def built_cache(out: str) -> dict:
    (path,) = re.findall(r"dataset cache built: (\S+) ", out)
    return orjson.loads((Path(path) / "metadata.json").read_bytes())


@pytest.mark.parametrize("fmt", ["txt", "jsonl.gz", "jsonl.zst", "parquet"])
def test_each_format_builds_and_trains(repo_root, tmp_path, python_env, corpora, fmt):
    out = train(repo_root, tmp_path, python_env, "--nproc", "1", "--set", f"data.dataset={corpora[fmt]}")
    meta = built_cache(out)
    assert meta["dataset"]["documents"] == len(DOCS)
    assert f"[CPU 0] data: {corpora[fmt]} (cache {meta['key'][:16]}, byte) | {meta['tokens']['train']:,} train / " in out


def test_huggingface_save_to_disk_builds_and_trains(repo_root, tmp_path, python_env):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(saved))
    out = train(repo_root, tmp_path, python_env, "--nproc", "1", "--set", f"data.dataset={saved}")
    assert built_cache(out)["dataset"]["documents"] == len(DOCS)


def test_parquet_and_zstd_mixture_trains_on_two_workers(repo_root, tmp_path, python_env):
    write_parquet(tmp_path / "web.parquet", documents(300, "abcdefghij", seed=1), field="content")
    (tmp_path / "code.jsonl.zst").write_bytes(zstd(jsonl_bytes(documents(300, "0123456789", seed=2))))
    mix = [{"source": "web.parquet", "weight": 0.7, "text_field": "content"}, {"source": "code.jsonl.zst", "weight": 0.3}]
    out = train(repo_root, tmp_path, python_env, "--set", "training.eval_every=2", "--set", f"data.mix={orjson.dumps(mix).decode()}")
    (line,) = [line for line in out.splitlines() if "] data: mixture " in line]
    assert f"| {tmp_path / 'web.parquet'}: " in line and "70.0% of training samples (weight 0.7)" in line
    assert f"| {tmp_path / 'code.jsonl.zst'}: " in line and "30.0% of training samples (weight 0.3)" in line
    assert re.search(r"dataset mixture [0-9a-f]{16} \(built\): ", out)

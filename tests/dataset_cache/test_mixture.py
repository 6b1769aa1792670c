"""data.mix: one cache per source, shares measured in the sampled batches,
determinism, resume across a world-size change, held-out validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset_cache import DatasetError, MixtureSampler, describe_data, open_data, prepare_cache
from dataset_cache.listing import list_caches
from tests.dataset_cache.corpora import documents, jsonl_bytes, write_parquet, zstd
from tests.dataset_cache.helpers import capture_loguru, data_config

T = 16
LETTERS, DIGITS, HELD = "abcdefghij", "0123456789", "xyz"
caplog_loguru = pytest.fixture(capture_loguru)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A parquet source of letters and a jsonl.zst source of digits: a window's bytes say where it came from."""
    root = tmp_path_factory.mktemp("sources")
    write_parquet(root / "web.parquet", documents(300, LETTERS, seed=1), row_group_size=64)
    (root / "code.jsonl.zst").write_bytes(zstd(jsonl_bytes(documents(150, DIGITS, seed=2))))
    (root / "held.jsonl").write_bytes(jsonl_bytes(documents(60, HELD, seed=3)))
    return {name: str(root / file) for name, file in
            (("web", "web.parquet"), ("code", "code.jsonl.zst"), ("held", "held.jsonl"))}


def mixture(tmp_path, *entries, **overrides):
    cfg = data_config(tmp_path, num_samples=0, context_length=T, mix=[dict(e) for e in entries], **overrides)
    info = prepare_cache(cfg)
    return info, open_data(info.path)


def origin(row: np.ndarray) -> str:
    letters, digits, held = (bool(np.isin(row, [ord(c) for c in chars]).any()) for chars in (LETTERS, DIGITS, HELD))
    assert letters + digits + held == 1, row
    return "web" if letters else "code" if digits else "held"


def global_rows(data, split, batch_size, world_size, steps, seed=7, state=None):
    """Every rank's rows, step by step in rank order: the run's global stream."""
    ranks = [MixtureSampler(data, split, batch_size, T, r, world_size, seed) for r in range(world_size)]
    for sampler in ranks:
        if state is not None:
            sampler.load_state_dict(state)
    rows = []
    for _ in range(steps):
        for sampler in ranks:
            x, y = sampler.next_batch()
            assert (x[:, 1:] == y[:, :-1]).all()
            rows.extend(np.concatenate([x, y[:, -1:]], axis=1))
    return rows, json.loads(json.dumps(ranks[0].state_dict()))


def test_sampled_batches_follow_the_weights(tmp_path, sources):
    info, data = mixture(tmp_path, {"source": sources["web"], "weight": 0.7}, {"source": sources["code"], "weight": 0.3})
    rows, _ = global_rows(data, "train", batch_size=4, world_size=2, steps=512)
    share = sum(origin(r) == "web" for r in rows) / len(rows)
    assert abs(share - 0.7) < 0.02
    assert info.train_tokens == sum(s.cache.tokens("train").size for s in data.sources)


def test_epochs_give_shares_by_tokens(tmp_path, sources):
    _, data = mixture(tmp_path, {"source": sources["web"], "epochs": 1}, {"source": sources["code"], "epochs": 3})
    web, code = (s.cache.tokens("train").size for s in data.sources)
    assert data.sources[1].train_share == pytest.approx(3 * code / (web + 3 * code))
    rows, _ = global_rows(data, "train", batch_size=8, world_size=1, steps=512)
    assert abs(sum(origin(r) == "code" for r in rows) / len(rows) - data.sources[1].train_share) < 0.02


def test_resume_with_another_world_size_continues_the_same_stream(tmp_path, sources):
    _, data = mixture(tmp_path, {"source": sources["web"], "weight": 0.6}, {"source": sources["code"], "weight": 0.4})
    reference, _ = global_rows(data, "train", batch_size=1, world_size=1, steps=4 * 700 + 6 * 120)
    before, state = global_rows(data, "train", batch_size=2, world_size=2, steps=700)  # past a source's epoch end
    after, _ = global_rows(data, "train", batch_size=2, world_size=3, steps=120, state=state)
    assert state["position"] == 2800 and state["world_size"] == 2
    assert min(epoch for epoch, _ in state["streams"]) >= 0 and max(epoch for epoch, _ in state["streams"]) >= 1
    assert all((a == b).all() for a, b in zip(before + after, reference, strict=True))


def test_deterministic_per_seed_and_a_foreign_state_restarts_loudly(tmp_path, sources, caplog_loguru):
    _, data = mixture(tmp_path, {"source": sources["web"], "weight": 1}, {"source": sources["code"], "weight": 1})
    a, _ = global_rows(data, "train", 4, 1, 5, seed=1)
    b, _ = global_rows(data, "train", 4, 1, 5, seed=1)
    c, state = global_rows(data, "train", 4, 1, 5, seed=2)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert any((x != y).any() for x, y in zip(a, c, strict=True))
    restarted, _ = global_rows(data, "train", 4, 1, 5, seed=1, state=state)
    assert all((x == y).all() for x, y in zip(a, restarted, strict=True))
    assert any("does not match this train mixture (seed 2 -> 1)" in m for m in caplog_loguru)


def test_held_out_source_is_the_validation_set(tmp_path, sources):
    _, data = mixture(tmp_path, {"source": sources["web"], "weight": 1}, {"source": sources["code"], "weight": 1},
                      {"source": sources["held"], "held_out": True})
    train, _ = global_rows(data, "train", 4, 2, 60)
    val, _ = global_rows(data, "val", 4, 2, 20)
    assert {origin(r) for r in train} == {"web", "code"} and {origin(r) for r in val} == {"held"}
    web = MixtureSampler(data, "train", 4, T, 0, 1, 0).streams[0]
    assert web.data.size == data.sources[0].cache.total_tokens  # trained on whole, val split included


def test_each_source_is_cached_once_and_weights_rebuild_nothing(tmp_path, sources, caplog_loguru):
    first, data = mixture(tmp_path, {"source": sources["web"], "weight": 0.7}, {"source": sources["code"], "weight": 0.3})
    again, other = mixture(tmp_path, {"source": sources["web"], "weight": 0.5}, {"source": sources["code"], "weight": 0.5})
    assert first.built and not again.built and again.key != first.key
    assert [s.cache.key for s in data.sources] == [s.cache.key for s in other.sources]
    assert any(f"dataset mixture {again.key} (reused): {sources['web']} (cache {data.sources[0].cache.key}, reused): "
               f"{data.sources[0].cache.tokens('train').size:,} train tokens, 50.0% of training samples (weight 0.5)" in m
               for m in caplog_loguru)
    listed = {e.key: e.summary for e in list_caches(tmp_path / "cache")}
    assert listed[first.key] == "mixture: web.parquet 70.0% + code.jsonl.zst 30.0% | byte"


def test_the_same_data_twice_is_refused(tmp_path):
    (tmp_path / "shards").mkdir()
    write_parquet(tmp_path / "shards" / "a.parquet", documents(50))  # as a directory and as a glob: the same files
    with pytest.raises(DatasetError, match=r"hold the same data \(cache [0-9a-f]{16}\); list it once$"):
        mixture(tmp_path, {"source": str(tmp_path / "shards"), "weight": 1},
                {"source": str(tmp_path / "shards" / "*.parquet"), "weight": 1})


def test_start_up_line_names_tokens_shares_and_epochs(tmp_path, sources):
    _, data = mixture(tmp_path, {"source": sources["web"], "weight": 3}, {"source": sources["code"], "weight": 1})
    web = data.sources[0].cache.tokens("train").size
    line = describe_data(data, planned_tokens=40_000)
    assert line.startswith(f"data: mixture {data.key} of 2 sources (byte) | {sources['web']}: {web:,} train tokens, "
                           f"75.0% of training samples (weight 3), {30_000 / web:.2f} epochs in this run | ")
    assert line.endswith("validation: each source's val split, at the training shares")


def test_a_removed_source_cache_is_rebuilt_by_the_next_prepare(tmp_path, sources):
    import shutil

    info, data = mixture(tmp_path, {"source": sources["web"], "weight": 1}, {"source": sources["code"], "weight": 1})
    shutil.rmtree(data.sources[1].cache.path)
    with pytest.raises(DatasetError, match="dataset cache not found"):
        open_data(info.path)
    again, _ = mixture(tmp_path, {"source": sources["web"], "weight": 1}, {"source": sources["code"], "weight": 1})
    assert again.key == info.key and again.built

"""The rank-sharded sampler: disjoint ranks, shifted targets, determinism, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.dataset_cache.helpers import capture_loguru, data_config

from dataset_cache import BatchSampler, DatasetError, open_cache, prepare_cache

T, B = 16, 4
caplog_loguru = pytest.fixture(capture_loguru)


class PositionCache:
    """Stands in for a TokenCache whose every token is its own position, so each
    row says where it was read from. (The real memmap is used in the first test.)"""

    key = "0123456789abcdef"

    def __init__(self, train: int = 3000, val: int = 400) -> None:
        self._splits = {"train": np.arange(train, dtype=np.uint32), "val": np.arange(train, train + val, dtype=np.uint32)}

    def tokens(self, split):
        return self._splits[split]

    def check_tokens(self, rows):  # positions, not token ids: nothing to check against a vocabulary
        return rows


@pytest.fixture(scope="module")
def cache():
    return PositionCache()


def samplers(cache, world_size, seed=7, split="train", batch_size=B):
    return [BatchSampler(cache, split, batch_size, T, rank, world_size, seed) for rank in range(world_size)]


def window_starts(cache, x, split="train"):
    return [int(row[0] - cache.tokens(split)[0]) for row in x]


def test_reads_real_windows_from_the_memmap(tmp_path):
    real = open_cache(prepare_cache(data_config(tmp_path, num_samples=20)).path)
    sampler = BatchSampler(real, "train", B, T, 0, 1, 3)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int64
    assert (x[:, 1:] == y[:, :-1]).all()
    data = np.asarray(real.tokens("train"))
    stream = data.tobytes()
    for row in np.concatenate([x, y[:, -1:]], axis=1):
        assert row.astype(data.dtype).tobytes() in stream  # a contiguous window of the split


def test_targets_are_the_next_tokens(cache):
    (sampler,) = samplers(cache, 1)
    x, y = sampler.next_batch()
    assert (y == x + 1).all() and ((x[:, 0] % T) == (x[0, 0] % T)).all()  # one epoch offset for all rows


def test_ranks_never_share_a_sample_in_a_step_nor_repeat_within_an_epoch(cache):
    ranks = samplers(cache, world_size=3)
    epoch_windows = set()
    windows = (3000 - 1 - (T - 1)) // T
    for _step in range(windows // (3 * B)):
        flat = [s for r in ranks for s in window_starts(cache, r.next_batch()[0])]
        assert len(set(flat)) == len(flat)  # no two ranks (nor rows) read the same window
        assert not epoch_windows & set(flat)  # nor one already read this epoch
        epoch_windows |= set(flat)
        assert len({(r.epoch, r.consumed) for r in ranks}) == 1  # every rank agrees on the position
    assert ranks[0].epoch == 0 and len(epoch_windows) >= windows - 3 * B


def test_deterministic_per_seed_and_split(cache):
    a, b = samplers(cache, 1, seed=1)[0], samplers(cache, 1, seed=1)[0]
    c = samplers(cache, 1, seed=2)[0]
    batches_a = [a.next_batch()[0] for _ in range(5)]
    assert all((x == b.next_batch()[0]).all() for x in batches_a)
    assert any((x != c.next_batch()[0]).any() for x in batches_a)
    val = samplers(cache, 1, split="val", batch_size=2)[0].next_batch()[0]
    assert (val >= 3000).all()  # val windows come from the val split only


def test_exact_resume_through_json(cache):
    ranks = samplers(cache, world_size=2)
    for _ in range(7):
        for r in ranks:
            r.next_batch()
    states = [json.loads(json.dumps(r.state_dict())) for r in ranks]
    expected = [[r.next_batch()[0] for _ in range(40)] for r in ranks]  # crosses an epoch boundary (23 steps)
    assert ranks[0].epoch >= 1
    resumed = samplers(cache, world_size=2)
    for r in resumed:
        r.load_state_dict(states[0])  # rank 0's checkpoint resumes every rank
    for r, batches in zip(resumed, expected, strict=True):
        for x in batches:
            assert (r.next_batch()[0] == x).all()


def test_resume_with_another_world_size_continues_the_epoch(cache):
    (single,) = samplers(cache, world_size=1, batch_size=4)
    seen = set()
    for _ in range(3):
        seen |= set(window_starts(cache, single.next_batch()[0]))
    pair = samplers(cache, world_size=2, batch_size=2)
    for r in pair:
        r.load_state_dict(single.state_dict())
    later = set()
    for r in pair:
        later |= set(window_starts(cache, r.next_batch()[0]))
    assert not seen & later and len(later) == 4


def test_state_from_another_run_restarts_loudly(cache, caplog_loguru):
    (sampler,) = samplers(cache, 1)
    first = sampler.next_batch()[0]
    sampler.next_batch()
    state = sampler.state_dict() | {"seed": 999}
    (fresh,) = samplers(cache, 1)
    fresh.load_state_dict(state)
    assert (fresh.next_batch()[0] == first).all()
    assert any("does not match" in m and "seed 999 -> 7" in m for m in caplog_loguru)


def test_split_too_small_for_one_step(cache):
    with pytest.raises(DatasetError, match="the val split has"):
        BatchSampler(cache, "val", 4, T, 0, 8, 0)
    with pytest.raises(ValueError):
        BatchSampler(cache, "train", B, T, 2, 2, 0)

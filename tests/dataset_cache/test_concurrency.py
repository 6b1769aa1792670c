"""Real builder processes: two at once build once; a SIGKILLed builder leaves
nothing readable and the next run rebuilds."""

from __future__ import annotations

import os
import signal

import pytest
from tests.dataset_cache.helpers import builder_result, data_config, reaped, start_builder, wait_for_line

from dataset_cache import DatasetError, open_cache, prepare_cache


def test_two_builders_started_together_build_once(tmp_path):
    cfg = data_config(tmp_path)
    first = start_builder(cfg, write_delay=0.05)
    second = start_builder(cfg, write_delay=0.05)
    with reaped(first, second):
        (a, log_a), (b, log_b) = builder_result(first), builder_result(second)
    assert a["key"] == b["key"] and a["path"] == b["path"]
    assert sorted([a["built"], b["built"]]) == [False, True]
    assert (log_a + log_b).count("built dataset cache") == 1  # the one build's summary line
    open_cache(tmp_path / "cache" / a["key"], verify=True)


def test_a_builder_arriving_mid_build_waits_and_reuses(tmp_path):
    cfg = data_config(tmp_path)
    first = start_builder(cfg, write_delay=0.3)
    with reaped(first):
        wait_for_line(first, "WROTE")  # first holds the lock and is half done
        second = start_builder(cfg, write_delay=0.0)
        with reaped(second):
            (b, log_b), (a, _) = builder_result(second), builder_result(first)
    assert a["built"] and not b["built"] and a["key"] == b["key"]
    assert "waiting for process" in log_b and "built by another process" in log_b


def test_sigkilled_builder_leaves_nothing_readable_and_the_next_run_rebuilds(tmp_path):
    cfg = data_config(tmp_path)
    reference = prepare_cache(data_config(tmp_path, cache_dir=str(tmp_path / "reference")))
    victim = start_builder(cfg, write_delay=30.0)
    with reaped(victim):
        wait_for_line(victim, "WROTE")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
    assert victim.returncode == -signal.SIGKILL
    cache_dir = tmp_path / "cache"
    final = cache_dir / reference.key
    leftovers = list(cache_dir.glob(f".tmp-{reference.key}-*"))
    assert not final.exists() and len(leftovers) == 1  # the half build is only in its temp dir
    assert (leftovers[0] / "tokens.bin").stat().st_size > 0
    with pytest.raises(DatasetError):
        open_cache(final)
    again = prepare_cache(cfg)
    assert again.built and again.key == reference.key
    assert not list(cache_dir.glob(".tmp-*"))  # the leftover was cleaned under the lock
    assert (final / "tokens.bin").read_bytes() == (reference.path / "tokens.bin").read_bytes()

"""The debug.spike_* / rerun settings: defaults, and one clear line for each bad value."""

from __future__ import annotations

import pytest

from gpuherd.config import Config, ConfigError, resolve


def test_defaults_leave_spikes_off_and_nan_policy_stop():
    d = Config().debug
    assert (d.nan_policy, d.spike_policy, d.max_transient_faults, d.rerun_deterministic) == ("stop", "off", 2, True)
    assert (d.spike_window, d.spike_warmup, d.spike_k, d.spike_grad_norm) == (100, 20, 10.0, True)


def test_rerun_and_spike_settings_resolve(tmp_path):
    cfg = resolve("debug", overrides=["debug.nan_policy=rerun", "debug.spike_policy=skip", "debug.spike_k=4",
                                      "debug.spike_window=50", "debug.spike_warmup=0"], cwd=tmp_path)
    assert (cfg.debug.nan_policy, cfg.debug.spike_policy, cfg.debug.spike_k) == ("rerun", "skip", 4.0)


@pytest.mark.parametrize(("override", "message"), [
    ("debug.spike_policy=restart", "debug.spike_policy must be one of off, stop, skip, rerun; got 'restart'"),
    ("debug.spike_policy=rerunn", "(did you mean 'rerun'?)"),
    ("debug.nan_policy=retry", "debug.nan_policy must be one of stop, skip, rerun; got 'retry'"),
    ("debug.spike_window=2", "debug.spike_window must be >= 3, got 2"),
    ("debug.spike_k=0", "debug.spike_k must be > 0, got 0.0"),
    ("debug.spike_warmup=-1", "debug.spike_warmup must be >= 0, got -1"),
    ("debug.max_transient_faults=-1", "debug.max_transient_faults must be >= 0, got -1"),
    ("debug.spike_k=high", "debug.spike_k must be a number"),
])
def test_bad_values_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        resolve("debug", overrides=[override], cwd=tmp_path)
    assert message in str(err.value)


@pytest.mark.parametrize("policy", ["stop", "skip", "rerun"])
def test_spikes_need_the_per_step_check(tmp_path, policy):
    with pytest.raises(ConfigError, match=f"debug.spike_policy={policy} needs debug.nan_detection=true"):
        resolve("debug", overrides=["debug.nan_detection=false", f"debug.spike_policy={policy}"], cwd=tmp_path)

"""data.text_field, data.on_bad_record and data.mix: what config time can check
(exit 2 before anything runs), and paths and globs stored absolute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuherd.config import Config, ConfigError, resolve


def mix(*entries: dict) -> str:
    return "data.mix=" + json.dumps(list(entries))


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.on_bad_record=drop", "data.on_bad_record must be one of error, skip; got 'drop'"),
        ("data.text_field=", "data.text_field must name the key / column that holds the text, got str ''"),
        ("data.dataset=/nowhere/*.parquet", "data.dataset glob '/nowhere/*.parquet' matches no file"),
        ("data.mix=[]", "data.mix is empty: list {source, weight} entries, or leave it null to train on data.dataset"),
        ("data.mix=[5]", "--set: data.mix must be an object, got int 5"),
        (mix({"source": "dummy", "wieght": 1}),
         "data.mix[0]: unknown key 'wieght' (did you mean 'weight'?); keys: source, weight, epochs, held_out, text_field"),
        (mix({"weight": 1}), "data.mix[0].source must be a path, a glob or a built-in dataset; got null None"),
        (mix({"source": "/nowhere", "weight": 1}),
         "data.mix[0].source '/nowhere' is neither a built-in (shakespeare, dummy) nor an existing path"),
        (mix({"source": "dummy"}),
         "data.mix[0] needs exactly one of weight (share of training samples), epochs (passes over the source) "
         "or held_out: true (validation only); got none"),
        (mix({"source": "dummy", "weight": 1, "epochs": 2}),
         "data.mix[0] needs exactly one of weight (share of training samples), epochs (passes over the source) "
         "or held_out: true (validation only); got weight, epochs"),
        (mix({"source": "dummy", "weight": 0}), "data.mix[0].weight must be a number > 0, got int 0"),
        (mix({"source": "dummy", "epochs": True}), "data.mix[0].epochs must be a number > 0, got bool True"),
        (mix({"source": "dummy", "held_out": False}),
         "data.mix[0].held_out must be true (leave it out for a training source), got bool False"),
        (mix({"source": "dummy", "weight": 1}, {"source": "dummy", "weight": 2}),
         "data.mix[1].source dummy is listed twice in data.mix"),
        (mix({"source": "dummy", "weight": 1}, {"source": "shakespeare", "epochs": 2}),
         "data.mix gives some sources a weight and others epochs: use one kind for every training source"),
        (mix({"source": "dummy", "held_out": True}),
         "data.mix has only held_out sources: give at least one source a weight or epochs"),
        (mix({"source": "dummy", "weight": 1, "text_field": 3}),
         "data.mix[0].text_field must name the key / column that holds the text, got int 3"),
    ],
)
def test_invalid_data_sources_are_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        resolve("debug", overrides=[override])
    assert str(caught.value) == message


def test_sources_and_globs_are_stored_absolute_and_round_trip(tmp_path: Path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(b"")
    (tmp_path / "web.jsonl.zst").write_bytes(b"")
    cfg = resolve("debug", cwd=tmp_path, overrides=[
        "data.dataset=shards/*.parquet",
        mix({"source": "shards/*.parquet", "weight": 0.7, "text_field": "content"},
            {"source": "web.jsonl.zst", "weight": 0.3}, {"source": "dummy", "held_out": True}),
    ])
    assert cfg.data.dataset == str(tmp_path / "shards" / "*.parquet")
    assert [e["source"] for e in cfg.data.mix] == [str(tmp_path / "shards" / "*.parquet"), str(tmp_path / "web.jsonl.zst"), "dummy"]
    assert Config.from_dict(json.loads(cfg.to_json())).data == cfg.data

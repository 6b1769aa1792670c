"""A warm spare rehearses the run's first step before it is needed (worker/spare.py): the
run's own model and shapes, and its compiled blocks when the run compiles them, so the
rank it becomes finds them ready."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.worker import helpers as h

from gpuherd.contract import WorkerIdentity
from worker import spare
from worker.train import run


def _config_file(tmp_path: Path, *extra: str) -> tuple[Path, object]:
    cfg = h.tiny_config(tmp_path, "system.device=cpu", "training.max_steps=1", "training.warmup_steps=1", *extra)
    path = tmp_path / "config.json"
    path.write_bytes(cfg.to_json())
    return path, cfg


def test_the_rehearsal_runs_the_runs_own_shapes_within_memory_reason(tmp_path: Path, monkeypatch):
    path, _ = _config_file(tmp_path)
    from worker import engines

    built = []
    real_build = engines.build_engine

    def recording(cfg, args, *rest, **kw):
        built.append((args.n_layers, args.dim, args.vocab_size, args.max_seq_len))
        return real_build(cfg, args, *rest, **kw)

    monkeypatch.setattr(engines, "build_engine", recording)
    assert spare.rehearse_first_step(str(path), h.VOCAB) == "real"
    cfg = h.tiny_config(tmp_path)
    assert built[-1] == (cfg.model.n_layers, cfg.model.dim, h.VOCAB, cfg.data.context_length)
    monkeypatch.setattr(spare, "REHEARSAL_SHARE", 0.0)  # no memory to spare: the one-layer stand-in
    assert spare.rehearse_first_step(str(path), h.VOCAB) == "stand-in"
    assert built[-1][0] == 1


@pytest.mark.slow  # inductor's C++ code generation on CPU
@pytest.mark.integration  # nn.Module.compile runs g++ in processes
def test_a_spare_compiles_the_runs_blocks_before_it_is_needed(tmp_path: Path):
    """The rehearsal compiles the blocks (training.compile=true); the trainer of the rank the
    spare becomes then trains its first step without compiling anything."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    path, cfg = _config_file(tmp_path, "training.compile=true")
    assert spare.rehearse_first_step(str(path), h.VOCAB) == "real"
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1  # the spare compiled, before any rank was handed to it
    status = tmp_path / "status.jsonl"
    identity = WorkerIdentity(0, 0, 1, 1, "cpu", 0, False)
    assert run(cfg, identity, data=h.bundle(cfg), status=h.status_writer(status, 0), install_signals=False) == 0
    assert [r["step"] for r in h.read_status(status) if r["type"] == "step" and "loss" in r] == [0]
    assert counters["stats"]["unique_graphs"] == compiled  # the trainer's compile found every graph ready


@pytest.mark.parametrize(("said", "nice"), [(None, 19), ("0", 0), ("5", 5), ("19", 19), ("25", 19), ("-3", 19),
                                            ("", 19), ("x", 19)])
def test_the_warm_up_yields_at_nice_19_unless_the_supervisor_says_a_shrunk_group_waits_for_it(monkeypatch, said, nice):
    if said is None:
        monkeypatch.delenv("GPUHERD_SPARE_WARM_UP_NICE", raising=False)
    else:
        monkeypatch.setenv("GPUHERD_SPARE_WARM_UP_NICE", said)
    assert spare.warm_up_nice() == nice

"""`python -m worker.nan.report FILE.pkl` and the `debug.max_dump_mb` limit."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.worker.nan.helpers import PAD, LogCapture, TinyLM, clean_batch, make_config, make_guard, train_step, with_token

from worker.nan import NanStop
from worker.nan.report import main

REPO = Path(__file__).resolve().parents[3]


def _blow_up(tmp_path: Path, model: TinyLM, max_dump_mb: int = 1024, max_norm: float | None = 1.0,
             batch: torch.Tensor | None = None) -> tuple[Path, list[str]]:
    log = LogCapture()
    try:
        guard = make_guard(model, make_config(tmp_path, max_dump_mb=max_dump_mb))
        if batch is None:
            with torch.no_grad():
                model.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
            batch = clean_batch(0, vocab=model.tok_embed.num_embeddings)
        with pytest.raises(NanStop):
            train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), guard, 0, [batch], lr=0.1,
                       max_norm=max_norm)
        guard.detach()
    finally:
        log.close()
    return tmp_path / "debug" / "nan_debug_step_0.pkl", log.messages("ERROR")


def test_report_cli_prints_the_same_banner_as_the_run(tmp_path):
    torch.manual_seed(0)
    dump, logged = _blow_up(tmp_path, TinyLM())
    banner = logged[:logged.index("=" * 40, logged.index("PROBLEMATIC TENSORS:") + 2) + 1]
    proc = subprocess.run([sys.executable, "-m", "worker.nan.report", str(dump)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.splitlines()
    assert printed[:len(banner)] == banner
    assert printed[len(banner)].startswith("Rank 0 of 1 on ")
    assert "Batch token ids: 1 micro-batch(es) of shape [2, 9]" in printed


def test_report_from_a_dump_without_findings_recomputes_them(tmp_path, capsys):
    torch.manual_seed(0)
    dump, _ = _blow_up(tmp_path, TinyLM())
    data = pickle.loads(dump.read_bytes())
    del data["report"]
    bare = tmp_path / "bare.pkl"
    bare.write_bytes(pickle.dumps(data))
    assert main([str(bare)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "NaN LOSS DETECTED [CPU 0]" in out
    assert "⚠️  Gradients with NaN (22 layers):" in out
    assert "    Inf count: 1/512" in out


def test_console_caps_the_bullets_and_all_lists_everything(tmp_path, capsys):
    torch.manual_seed(0)
    model = TinyLM(n_layers=4)  # 40 parameters, all with NaN gradients after the blow-up
    dump, logged = _blow_up(tmp_path, model)
    assert "⚠️  Gradients with NaN (40 layers):" in logged
    assert any(line.startswith("  ... and 10 more (all of them: python -m worker.nan.report --all") for line in logged)
    assert main(["--all", str(dump)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("    Grad values: ") for line in out) == 40
    assert not any(line.startswith("  ... and") for line in out)


def test_unreadable_dump_is_one_line_and_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"not a pickle")
    assert main([str(junk)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"worker.nan.report: error: {junk}")
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"something": 1}))
    assert main([str(other)]) == 2
    assert "not a NaN debug dump" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.pkl")]) == 2


def test_max_dump_mb_keeps_the_affected_layer_first_and_lists_the_rest(tmp_path):
    """4096 x 64 embedding and output: 1 MiB each as float32, over a 1 MiB limit."""
    torch.manual_seed(0)
    model = TinyLM(vocab=4096, dim=64)
    # PAD token without clipping: only magnitude.proj's gradient goes NaN (sqrt(0) in backward)
    batch = with_token(clean_batch(0, vocab=4096), PAD)
    dump, logged = _blow_up(tmp_path, model, max_dump_mb=1, max_norm=None, batch=batch)
    assert "⚠️  Gradients with NaN (1 layers):" in logged
    data = pickle.loads(dump.read_bytes())
    assert data["affected_layers"] == ["magnitude.proj.weight"]
    assert np.isnan(data["gradients"]["magnitude.proj.weight"]).all()
    assert "magnitude.proj.weight" in data["parameters"]
    arrays = list(data["parameters"].values()) + list(data["gradients"].values())
    assert sum(a.nbytes for a in arrays) <= 2**20
    omitted = {(o["name"], o["kind"]) for o in data["omitted"]}
    assert ("output.weight", "parameters") in omitted and ("tok_embed.weight", "gradients") in omitted
    assert not omitted & {(n, "parameters") for n in data["parameters"]}
    assert any(note.startswith("debug.max_dump_mb=1: left out ") for note in data["notes"])
    assert data["shapes"]["tok_embed.weight"] == [4096, 64]  # the shape survives even when the array does not


def test_a_planted_pickle_is_refused_by_name_and_never_runs(tmp_path):
    """A crafted file in .checkpoints/debug/: `gpuherd nan report` names what it asked for, exit 2,
    and the code it carries never runs; a real dump still reads with a plain pickle.load."""
    from tests.worker.nan.helpers import planted_dump

    marker = tmp_path / "the-payload-ran"
    evil = planted_dump(tmp_path / "debug" / "nan_debug_step_3.pkl", marker)
    proc = subprocess.run([sys.executable, "-m", "supervisor.commands.dispatch", "nan", "report", str(evil)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "is not a plain NaN dump: it asks to load posix.mkdir" in err[0], proc.stderr
    assert not marker.exists()

"""The GPU acceptance script (bench/acceptance/) without a GPU: its plan (every GPU-only part
skipped with its reason), the rehearsal's quick end to end run, a part past its limit stopped
while the next one still runs, and the runs it would start on a GPU checked here against the
config's own validation, so that no lent minute goes to a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from bench.acceptance import cases, nanogpt, throughput
from bench.acceptance.__main__ import main
from bench.acceptance.plan import PARTS, Part, chosen
from bench.acceptance.pytest_gpu import tally
from bench.acceptance.run_parts import run_part
from gpuherd.config import resolve

REPO = Path(__file__).resolve().parents[2]
GPU_ONLY = {"mfu-124M", "nanogpt", "save-1B", "mfu-1B"}


def _sets(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, word in enumerate(cmd) if word == "--set"]


def test_the_plan_skips_every_gpu_only_part_with_its_reason_and_rehearses_the_rest():
    assert {p.name for p in PARTS if p.gpu_only} == GPU_ONLY
    assert all(p.gpu_only.strip() for p in PARTS if p.gpu_only)
    assert [p.name for p in chosen(["pytest-gpu", "live"])] == ["live", "pytest-gpu"]  # plan order
    with pytest.raises(ValueError, match="unknown part 'nope'; parts: environment, mfu-124M"):
        chosen(["nope"])


def test_a_wrong_part_is_one_line_and_exit_2(capsys):
    assert main(["--only", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_gpu_only_part_is_skipped_and_one_past_the_budget_is_not_started(tmp_path):
    with open(tmp_path / "log", "wb") as log:
        skipped = run_part(chosen(["nanogpt"])[0], False, 400, tmp_path, log)
        late = run_part(chosen(["sdc"])[0], False, 5, tmp_path, log)
    assert (skipped.status, skipped.detail) == (
        "skipped", "no CUDA GPU here: nanoGPT's train.py puts a torchrun rank on cuda:LOCAL_RANK")
    assert (late.status, late.detail) == ("not run", "the budget ran out (5 s left)")


def test_a_part_past_its_limit_is_stopped_and_said(tmp_path):
    slow = Part("environment", "a part that cannot finish in time", 0.5, "environment")
    with open(tmp_path / "log", "wb") as log:
        got = run_part(slow, False, 400, tmp_path, log)
    assert (got.status, got.detail) == ("timed out", "after 0 s")
    assert "===== environment: timed out" in (tmp_path / "log").read_text()


def test_the_rehearsal_runs_end_to_end_and_writes_its_record(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "bench.acceptance", "--rehearse", "--only", "environment", "--only",
                          "mfu-124M", "--only", "nanogpt"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = orjson.loads((tmp_path / "gpu_acceptance.json").read_bytes())
    assert [(p["name"], p["status"]) for p in record["parts"]] == [
        ("environment", "passed"), ("mfu-124M", "skipped"), ("nanogpt", "skipped")]
    text = (tmp_path / "gpu_acceptance.md").read_text()
    assert "GPU acceptance, rehearsed on a CPU (no GPU figure)" in text
    assert "| mfu-124M | skipped | 0 (0) |  | no CUDA GPU here: MFU needs a CUDA GPU" in text
    assert "| environment | passed |" in text and "| cpu (rehearsal) |" in text
    assert "===== environment: passed" in (tmp_path / "gpu_acceptance.log").read_text()
    assert run.stdout.splitlines()[-1].startswith("acceptance: 3 of 3 part(s) passed or skipped")


def test_the_124m_row_keeps_the_presets_own_choices_and_both_rows_validate(tmp_path):
    cmd = throughput.mfu_command("mfu-124M", tmp_path)
    assert cmd[cmd.index("--preset") + 1] == "gpt2-small"
    chosen_here = {item.split("=", 1)[0] for item in _sets(cmd)}
    assert not chosen_here & {"training.batch_size", "data.context_length", "training.grad_accum_nums",
                               "training.compile", "training.use_amp", "training.strategy", "model.attention"}
    cfg = resolve("gpt2-small", overrides=_sets(cmd), cwd=tmp_path)
    assert (cfg.training.batch_size, cfg.data.context_length, cfg.model.vocab_size) == (16, 1024, 50304)
    big = resolve("production", overrides=_sets(throughput.mfu_command("mfu-1B", tmp_path)), cwd=tmp_path)
    assert (big.model.n_layers, big.model.dim, big.data.context_length, big.training.grad_accum_nums) == (16, 2048,
                                                                                                          2048, 1)


def test_the_recovery_cases_share_one_gpu_on_cuda_and_their_settings_validate(tmp_path):
    on_gpu = cases.command("live", "cuda", [], "--max-restarts", "1")
    assert "system.shared_gpu_for_tests=true" in _sets(on_gpu) and "--force" in on_gpu
    assert "system.device=cpu" in _sets(cases.command("live", "cpu", []))
    cfg = resolve("debug", overrides=_sets(cases.command("fsdp", "cuda", ["training.strategy=fsdp"])), cwd=tmp_path)
    assert cfg.system.shared_gpu_for_tests and cfg.training.strategy == "fsdp" and cfg.training.max_steps == 120


def test_the_logged_figures_are_read_from_the_last_logged_step_and_pytests_tally():
    records = [{"type": "step", "step": 9, "tokens_per_s": 1.0, "mfu": 0.2}, {"type": "step", "step": 12},
               {"type": "step", "step": 39, "tokens_per_s": 2.0, "mfu": 0.41}, {"type": "checkpoint", "step": 40}]
    assert throughput.last_logged(records)["mfu"] == 0.41 and throughput.last_logged([]) is None
    out = "...\nSKIPPED [3] tests/x.py:4: needs a CUDA GPU\n22 passed, 4 skipped, 1 error in 80.2s\n"
    assert tally(out) == {"passed": 22, "skipped": 4, "errors": 1}


def test_nanogpts_config_resumes_by_itself_once_a_checkpoint_exists(tmp_path, monkeypatch):
    source = tmp_path / "nanogpt"
    source.mkdir()
    for name in nanogpt.FILES:
        (source / name).write_text(f"# {name}\n")
    monkeypatch.setenv("GPUHERD_NANOGPT_DIR", str(source))
    work = tmp_path / "work"
    work.mkdir()
    nanogpt.prepare(work)
    tokens = np.fromfile(work / "data" / "acceptance" / "train.bin", dtype=np.uint16)
    assert len(tokens) == 4_000_000 and tokens.max() < 50257
    monkeypatch.chdir(work)
    config = (work / "acceptance_config.py").read_text()
    first: dict = {"os": os}
    exec(config, first)  # as nanoGPT's configurator runs a config file
    (work / "out").mkdir()
    (work / "out" / "ckpt.pt").write_bytes(b"")
    again: dict = {"os": os}
    exec(config, again)
    assert (first["init_from"], again["init_from"], again["max_iters"]) == ("scratch", "resume", nanogpt.ITERS)

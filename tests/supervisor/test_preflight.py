"""`gpuherd check`: every fault the fake NVML can show gives its FAIL or WARN line; the host
items pass here; FAIL ends the command with 4 (a GPU) or 2 (the host)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuherd.config import resolve
from supervisor.health.items import FAIL, NA, PASS, WARN
from supervisor.health.preflight import run_checks
from tests.fake_nvml import GIB, FakeProcess, installed, machine, subprocess_env
from tests.supervisor.helpers import env as run_env

CHECK = [sys.executable, "-m", "supervisor.commands.check"]


def config(tmp_path: Path, *overrides: str):
    return resolve(preset_name="debug", config_file=None, max_steps=None, cwd=tmp_path,
                   overrides=["data.dataset=dummy", *overrides])


def items_of(report, scope: str) -> dict[str, tuple[str, str]]:
    return {i.name: (i.status, i.detail) for i in report.items if i.scope == scope}


def set_attr(name, value):
    return lambda m, lib: setattr(m.gpus[1], name, value)


FAULTS = [  # (what the machine shows on GPU 1, item, status, words of the detail)
    (set_attr("ecc_uncorrected", 2), "ecc errors", FAIL, "2 uncorrectable (double-bit)"),
    (set_attr("ecc_corrected", 7), "ecc errors", WARN, "7 corrected (single-bit)"),
    (set_attr("ecc_mode", (0, 0)), "ecc mode", WARN, "ECC is off"),
    (set_attr("ecc_mode", (1, 0)), "ecc mode", WARN, "off after the next reboot"),
    (set_attr("retired_pages_pending", True), "retired pages", WARN, "page retirement pending"),
    (set_attr("remap_pending", True), "row remapping", WARN, "row remap pending"),
    (set_attr("remap_failure", True), "row remapping", FAIL, "row remapping failed"),
    (lambda m, lib: lib.inject_xid(1, 79), "xid", FAIL, "hardware XID 79"),
    (lambda m, lib: lib.inject_xid(1, 13), "xid", WARN, "XID 13 during the check"),
    (set_attr("clocks_event_reasons", 0x40), "throttle", FAIL, "held back by the hardware now (hw_thermal)"),
    (set_attr("clocks_event_reasons", 0x80), "throttle", FAIL, "hw_power_brake"),
    (set_attr("clocks_event_reasons", 0x4), "throttle", WARN, "capped by the driver now (sw_power_cap)"),
    (set_attr("nvlink_down", [1, 3]), "nvlink", WARN, "NVLink 1, 3 down (2 of 4 up)"),
    (set_attr("pcie", (4, 5, 8, 16)), "pcie link", WARN, "gen 4 x8 (max gen 5 x16)"),
    (set_attr("recovery_action", 1), "recovery action", FAIL, "asks for a GPU reset"),
    (set_attr("recovery_action", 2), "recovery action", FAIL, "asks for a node reboot"),
    (set_attr("mig_mode", (1, 1)), "mig", FAIL, "MIG mode is on"),
    (set_attr("mig_mode", (0, 1)), "mig", WARN, "turns on at the next GPU reset"),
    (set_attr("processes", [FakeProcess(1, 3 * GIB)]), "processes", WARN, "other processes on this GPU: pid 1"),
    (set_attr("memory_used", 40 * GIB), "processes", WARN, "40.0 of 80 GiB in use by processes not visible"),
    (lambda m, lib: lib.lose(1), "present", FAIL, "GPU is lost"),
]


@pytest.mark.parametrize(("fault", "item", "status", "words"), FAULTS, ids=[f"{f[1]}-{f[3][:24]}" for f in FAULTS])
def test_each_fault_mode_gives_its_line(tmp_path, fault, item, status, words):
    m = machine(2, nvlink=True)
    with installed(m) as lib:
        fault(m, lib)
        report = run_checks(config(tmp_path), None)
    gpu1 = items_of(report, "GPU 1")
    assert gpu1[item][0] == status and words in gpu1[item][1], gpu1[item]
    healthy = items_of(report, "GPU 0")
    assert {s for s, _ in healthy.values()} == {PASS}, healthy
    assert report.failed_exit_code == (4 if status == FAIL else 2)  # 2: this CPU-only torch fails the host


def test_a_board_or_driver_that_cannot_answer_reads_n_a():
    m = machine(1)
    m.gpus[0].unsupported = ["nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages",
                             "nvmlDeviceGetRemappedRows", "nvmlDeviceGetMigMode", "nvmlDeviceGetFieldValues"]
    m.missing = ["nvmlEventSetCreate", "nvmlDeviceGetCurrPcieLinkGeneration"]
    with installed(m):
        report = run_checks(config(Path.cwd()), [0])
    gpu0 = items_of(report, "GPU 0")
    assert {k for k, (s, _) in gpu0.items() if s == NA} == {
        "ecc mode", "ecc errors", "retired pages", "row remapping", "xid", "nvlink", "pcie link", "recovery action",
        "mig"}
    assert gpu0["throttle"][0] == PASS and gpu0["processes"][0] == PASS


def test_check_here_passes_the_host_and_says_there_is_no_gpu(tmp_path):
    result = subprocess.run([*CHECK, "--debug", "--set", "data.dataset=dummy"], cwd=tmp_path, env=run_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1] if line.split()[1] != "checkpoint" else "checkpoint disk": line
            for line in result.stdout.splitlines()[1:]}
    assert "no GPU: NVML unavailable" in rows["gpus"] and " n/a " in rows["gpus"]
    for name in ("checkpoint disk", "log", "dataset", "open", "torch"):
        assert " PASS " in rows[name], rows[name]
    assert not (tmp_path / "logs").exists() and not (tmp_path / ".checkpoints").exists()  # it only looks


def test_a_gpu_failure_stops_with_exit_4_naming_the_gpu(tmp_path):
    m = machine(2)
    m.gpus[1].ecc_uncorrected = 1
    result = subprocess.run([*CHECK, "--debug", "--set", "data.dataset=dummy"], cwd=tmp_path,
                            env=subprocess_env(m, tmp_path, run_env()), capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith("gpuherd check: error: GPU 1: ecc errors: 1 uncorrectable")
    assert "GPU 0  ecc errors       PASS" in result.stdout


def test_host_failures_exit_2(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([*CHECK, "--debug", "--set", f"data.cache_dir={tmp_path / 'not-a-dir'}",
                                 "--master-addr", "127.0.0.1", "--master-port", str(port)],
                                cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    failed = [line for line in result.stdout.splitlines() if " FAIL " in line]
    assert len(failed) == 2 and "not a readable directory" in failed[0]
    assert f"--master-port {port} is already in use" in failed[1]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    m = machine(2)
    for args, message in ((["--gpus", "7"], "GPU 7 does not exist (this machine has GPUs 0-1)"),
                          (["--gpus", "x"], "--gpus x: expected GPU ids like 0,2"),
                          (["--master-addr", "h"], "--master-addr and --master-port go together")):
        result = subprocess.run([*CHECK, *args], cwd=tmp_path, env=subprocess_env(m, tmp_path, run_env()),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.splitlines() == [f"gpuherd check: error: {message}"]


def test_a_script_run_is_not_judged_by_the_trainers_model_or_dataset(tmp_path):
    """The production preset's model (~68 GiB a checkpoint) is not what a script trains:
    a script run gets no checkpoint-disk or dataset verdict, the built-in trainer does."""
    cfg = resolve(preset_name="production", config_file=None, max_steps=None, cwd=tmp_path,
                  overrides=[f"data.cache_dir={tmp_path / 'not-a-dir'}"])
    (tmp_path / "not-a-dir").write_text("")
    trainer = items_of(run_checks(cfg, []), "host")
    script = items_of(run_checks(cfg, [], script=True), "host")
    assert trainer["dataset cache"][0] == FAIL and script["dataset cache"][0] == NA
    assert "one checkpoint is about" in trainer["checkpoint disk"][1]
    assert script["checkpoint disk"] == (NA, "a script saves its own checkpoints, of a size gpuherd cannot know")
    assert script["log disk"] == trainer["log disk"]  # the run's own logs are gpuherd's either way


def test_check_judges_the_run_the_same_options_would_start(tmp_path):
    """Its first line names the preset, the model and the workers; a model no host can hold fails
    both the checkpoint disk and the memory item, whatever this machine's disk and RAM are."""
    from tests.supervisor.helpers import HUGE_MODEL

    small = subprocess.run([*CHECK, "--debug", "--set", "data.dataset=dummy", "--set", "system.nproc=3"],
                           cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=60)
    assert small.returncode == 0, small.stderr
    assert small.stdout.splitlines()[0] == ("judged: preset debug: 13.2M parameters (2 layers, dim 128), 10 steps, "
                                            "on 3 CPU worker(s)")
    assert " model memory " in small.stdout and "fits in this host (available RAM / 3 workers)" in small.stdout
    huge = subprocess.run([*CHECK, "--debug", "--set", "data.dataset=dummy", *HUGE_MODEL], cwd=tmp_path,
                          env=run_env(), capture_output=True, text=True, timeout=60)
    assert huge.returncode == 2, huge.stderr
    assert huge.stdout.splitlines()[0].startswith("judged: preset debug: 52.8T parameters (1024 layers")
    failed = {line.split("  ")[1].strip() for line in huge.stdout.splitlines() if " FAIL " in line}
    assert failed == {"checkpoint disk", "model memory"}, huge.stdout
    assert not (tmp_path / "logs").exists()


def test_the_checkpoint_estimate_uses_the_tokenizers_vocabulary(tmp_path):
    """The byte tokenizer's 256 embedding rows, not GPT-2's 50304: with a small body the
    embeddings are most of the model, and of its checkpoint."""
    from gpuherd.model_size import checkpoint_bytes, count_params

    args = ["--debug", "--set", "data.dataset=dummy", "--set", "model.dim=256", "--set", "model.n_layers=1"]
    cfg = resolve("debug", overrides=["model.dim=256", "model.n_layers=1"], cwd=tmp_path)
    for tokenizer, vocab in (("byte", 256), ("gpt2", 50304)):
        done = subprocess.run([*CHECK, *args, "--set", f"data.tokenizer={tokenizer}"], cwd=tmp_path, env=run_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        params = count_params(cfg.model, vocab)
        shown = f"{params / 1e6:.3g}M" if params >= 1e6 else f"{params / 1e3:.3g}k"
        assert done.stdout.splitlines()[0].startswith(f"judged: preset debug: {shown} parameters"), done.stdout
        assert f"one checkpoint is about {checkpoint_bytes(params) / 1024**3:.2f} GiB" in done.stdout

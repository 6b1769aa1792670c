"""Silent data corruption through the whole product: one bit flipped in one replica's parameter,
gradient or optimizer state (GPUHERD_INJECT_BITFLIP) with 2, 3 and 4 DDP ranks, or 2 FSDP ranks,
is detected at the step it happened, the right rank is named, the run heals without restarting a
process, and every loss equals an undisturbed run's, bit for bit; a second strike on the same
device ends its use: the run stops with exit 8, or (live recovery) a warm spare takes the rank,
and the device goes on this host's suspect list for the next start."""

from __future__ import annotations

import socket
import subprocess
import sys

import orjson
import pytest

from tests.e2e.helpers import records

STEPS = 8
OPTIM_EVERY = 2  # optimizer-state flips below land on steps this interval checks (step + 1 even)
SETTINGS = [
    "system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2",
    "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", f"training.max_steps={STEPS}", "training.warmup_steps=2", "training.log_every=1",
    "training.eval_every=0", "training.save_every=0", f"training.sdc_optim_check_every={OPTIM_EVERY}",
]
# RANK:STEP:TARGET; each rank at most once per run (a second strike ends the run: its own test)
FLIPS = {
    2: ["1:1:param,0:3:grad", "1:5:optim"],
    3: ["1:1:param,2:3:grad,0:5:optim"],
    4: ["3:1:param,1:3:grad,2:5:optim"],
}
CASES = [(n, flips) for n, runs in FLIPS.items() for flips in runs]


def _run(cwd, env: dict[str, str], run_id: str, nproc: int, flips: str = "",
         *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--nproc", str(nproc), "--run-id", run_id]
    for item in [*SETTINGS, *extra]:
        cmd += ["--set", item]
    env = dict(env, GPUHERD_INJECT_BITFLIP=flips) if flips else env
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _losses(run_dir) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss; a step recomputed after a rollback counts with its last value."""
    return {(r["rank"], r["step"]): r["loss"] for r in records(run_dir, "step") if "loss" in r}


_UNDISTURBED: dict[int | str, dict[tuple[int, int], float]] = {}


def _undisturbed(tmp_path_factory, env, nproc: int) -> dict[tuple[int, int], float]:
    """A run of the same settings with nothing flipped and the check off."""
    if nproc not in _UNDISTURBED:
        cwd = tmp_path_factory.mktemp(f"plain{nproc}")
        run = _run(cwd, env, "plain", nproc, "", "training.sdc_check_every=0")
        assert run.returncode == 0, run.stderr[-3000:]
        _UNDISTURBED[nproc] = _losses(cwd / "logs" / "plain")
        assert len(_UNDISTURBED[nproc]) == nproc * STEPS
    return _UNDISTURBED[nproc]


@pytest.mark.parametrize(("nproc", "flips"), CASES, ids=[f"{n}ranks-{f}" for n, f in CASES])
def test_a_flipped_bit_is_caught_at_its_step_its_rank_named_and_the_run_healed_in_place(
        tmp_path, tmp_path_factory, python_env, nproc, flips):
    expected = _undisturbed(tmp_path_factory, python_env, nproc)
    run = _run(tmp_path, python_env, "r", nproc, flips)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "logs" / "r"
    wanted = [(int(step), [int(rank)]) for rank, step, _ in (f.split(":") for f in flips.split(","))]
    found = [(r["step"], r["culprits"]) for r in records(run_dir, "sdc")]
    assert found == wanted  # detected at the step of the flip (interval 1), the right rank, every one
    by = {r["step"]: r["blamed_by"] for r in records(run_dir, "sdc")}
    assert set(by.values()) == {"recompute" if nproc == 2 else "majority"}
    host = socket.gethostname()
    for step, (rank,) in wanted:
        assert f"SILENT DATA CORRUPTION on cpu, host {host}, rank {rank}, step {step}:" in run.stderr
    assert sorted(r["rank"] for r in records(run_dir, "suspect")) == sorted(rank for _, (rank,) in wanted)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(records(run_dir, "ready")) == nproc  # no process was restarted
    assert {d["rank"] for d in summary["suspect_devices"]} == {rank for _, (rank,) in wanted}
    assert {d["cause"] for d in summary["suspect_devices"]} == {"silent data corruption"}
    assert _losses(run_dir) == expected  # float equality: bit for bit


def test_a_second_strike_on_the_same_device_ends_its_use_with_exit_8(tmp_path, python_env):
    run = _run(tmp_path, python_env, "twice", 3, "2:1:param,2:3:grad")
    assert run.returncode == 8, run.stderr[-3000:]
    assert "rank 2's device disagreed with its replicas 2 times (steps 1, 3): not used again" in run.stderr
    summary = orjson.loads((tmp_path / "logs" / "twice" / "summary.json").read_bytes())
    (suspect,) = summary["suspect_devices"]
    assert suspect["rank"] == 2 and suspect["transient_faults"] == 2 and suspect["step"] == 3


def test_a_second_strike_moves_the_rank_to_a_warm_spare_and_the_next_start_sees_the_list(tmp_path, python_env):
    """The struck rank alone leaves (exit 8); the other two keep their processes and a warm spare
    takes its rank; the device goes on this host's suspect list, which the next start names (CPU
    workers: nothing to leave out; `gpuherd check` showing and clearing it, and the GPU side, are
    tests/supervisor/test_suspect_list.py's)."""
    run = _run(tmp_path, python_env, "moved", 3, "1:1:param,1:3:param", "system.max_restarts=1",
               "training.max_steps=5")
    assert run.returncode == 0, run.stderr[-3000:]
    host = socket.gethostname()
    assert f"SILENT DATA CORRUPTION on cpu, host {host}, rank 1, step 3:" in run.stderr
    assert "strike 2 of 2" in run.stderr
    run_dir = tmp_path / "logs" / "moved"
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    (rec,) = summary["recoveries"]
    assert rec["rank"] == 1 and rec["outcome"] == "recovered" and rec["action"] == "replaced"
    assert "not used again in this run" in rec["failed"] and summary["restarts"] == 0
    assert ": live recovery 1: warm spare pid " in run.stderr and "takes rank 1;" in run.stderr
    assert sorted(r["rank"] for r in records(run_dir, "ready")) == [0, 1, 1, 2]  # ranks 0 and 2 kept their processes
    (suspect,) = [d for d in summary["suspect_devices"] if d["transient_faults"] == 2]
    assert suspect["rank"] == 1 and suspect["steps"] == [1, 3] and suspect["slot"] == 1
    assert suspect["then"] == "its rank moved to a warm spare (live recovery 1)"
    assert "layers.1.attention.wq.weight" in suspect["evidence"][0]  # the bucket the injector flipped
    listed = orjson.loads((tmp_path / "logs" / ".suspect-devices" / f"{host}.json").read_bytes())
    (device,) = listed["devices"]
    assert device["label"] == "CPU1" and [s["count"] for s in device["strikes"]] == [2]
    assert device["strikes"][0]["run_id"] == "moved" and device["strikes"][0]["step"] == 3

    nxt = _run(tmp_path, python_env, "next", 1, "", "training.max_steps=2")
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    assert "CPU1: 1 strike(s); last: silent data corruption x2, run moved attempt 0, rank 1, step 3" in nxt.stderr
    assert "CPU workers have no device to leave out: starting as asked" in nxt.stderr


FSDP = ["training.strategy=fsdp"]


@pytest.mark.parametrize("flips", ["1:1:param,0:3:optim", "1:5:grad"])
def test_fsdp_shards_are_checked_by_recomputing_the_step_which_names_and_heals_the_flip(
        tmp_path, tmp_path_factory, python_env, flips):
    """Nothing is replicated: at the optimizer-state interval each rank recomputes its step."""
    if "fsdp" not in _UNDISTURBED:
        cwd = tmp_path_factory.mktemp("plainfsdp")
        plain = _run(cwd, python_env, "plain", 2, "", *FSDP, "training.sdc_check_every=0")
        assert plain.returncode == 0, plain.stderr[-3000:]
        _UNDISTURBED["fsdp"] = _losses(cwd / "logs" / "plain")
    run = _run(tmp_path, python_env, "r", 2, flips, *FSDP)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "logs" / "r"
    wanted = [(int(step), [int(rank)]) for rank, step, _ in (f.split(":") for f in flips.split(","))]
    found = [(r["step"], r["culprits"]) for r in records(run_dir, "sdc")]
    assert found == wanted and {r["blamed_by"] for r in records(run_dir, "sdc")} == {"recompute"}
    if "param" in flips:  # the value and bit the injector flipped, named
        assert "layers.1.attention.wq.weight[" in run.stderr and "] bit 22: " in run.stderr
    assert _losses(run_dir) == _UNDISTURBED["fsdp"]

"""`python -m worker.nan.replay`: a NaN recorded by the worker's loop reproduces on
CPU from its checkpoint and pickle; the same batch on healthy weights does not
(exit 8: the recording device is suspect); bad input is one line, exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import StatusWriter
from tests.worker import helpers as h
from worker.main import guarded
from worker.nan.replay import main
from worker.train import run

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A run that blew up (learning rate 1e30) and stopped: `ckpt/` holds its NaN files."""
    tmp = tmp_path_factory.mktemp("replay")
    cfg = h.tiny_config(tmp, "debug.nan_detection=true", "debug.nan_hooks=false", "debug.nan_policy=stop",
                        "training.learning_rate=1e30", "training.warmup_steps=0", "training.max_grad_norm=0")
    identity = WorkerIdentity(0, 0, 1, 1, "cpu", 0, False)
    code = guarded(lambda: run(cfg, identity, data=h.bundle(cfg), status=StatusWriter(None, 0),
                               install_signals=False), StatusWriter(None, 0))
    assert code == ExitCode.NAN
    return tmp / "ckpt"


def dump_of(ckpt: Path) -> Path:
    (path,) = (ckpt / "debug").glob("nan_debug_step_*.pkl")
    return path


def test_the_recorded_nan_reproduces_on_cpu(recorded):
    result = subprocess.run([sys.executable, "-m", "worker.nan.replay", str(dump_of(recorded))], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    step = int(dump_of(recorded).stem.rsplit("_", 1)[1])
    assert out[0].startswith(f"Replay of step {step} on cpu (fp32) from {recorded / f'nan_grad_step_{step}.pt'}")
    assert any(line.endswith("DETECTED [CPU 0]") for line in out)  # the NaN banner, from the replay
    assert "PROBLEMATIC TENSORS:" in out
    assert any(line.startswith("Rank 0: recorded on cpu") and line.endswith("-> reproduces") for line in out)
    # the weights are at fault here: every sample alone gives non-finite gradients, and is located
    rows = [line for line in out if line.startswith("  ! sample loss ")]
    assert len(rows) == 4 and all(", non-finite gradients: rank 0 micro-batch " in line for line in rows)
    assert all(", token offset " in line for line in rows)
    assert out[-1] == ("REPRODUCES on cpu (rank(s) [0]): the batch or the model is at fault,"
                       " not the device it was recorded on")


def test_the_checkpoint_names_the_same_step(recorded, capsys):
    step = int(dump_of(recorded).stem.rsplit("_", 1)[1])
    assert main([str(recorded / f"nan_grad_step_{step}.pt")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("REPRODUCES on cpu")


def test_healthy_weights_do_not_reproduce_it_and_the_device_is_suspected(recorded, tmp_path, capsys):
    """What a flaky GPU leaves behind: a NaN its weights and batch do not explain."""
    from worker.model import ModelArgs, Transformer

    copy = tmp_path / "ckpt"
    shutil.copytree(recorded, copy)
    (ckpt,) = copy.glob("nan_grad_step_*.pt")
    saved = torch.load(ckpt, weights_only=True)
    model = Transformer(ModelArgs(**saved["meta"]["model_args"]))
    model.init_weights(0, torch.device("cpu"))
    saved["model"] = model.state_dict()
    torch.save(saved, ckpt)
    assert main([str(ckpt)]) == ExitCode.DEVICE_SUSPECT == 8
    out = capsys.readouterr().out.splitlines()
    assert "PROBLEMATIC TENSORS:" not in out
    assert any(line.startswith("Rank 0: recorded on cpu") and line.endswith("-> does not reproduce") for line in out)
    assert out[-1].startswith("Does NOT reproduce on cpu: suspect the device it was recorded on (cpu on ")


def test_bad_input_is_one_line_and_exit_2(recorded, tmp_path, capsys):
    lonely = tmp_path / "debug" / "nan_debug_step_3.pkl"
    lonely.parent.mkdir()
    shutil.copy(dump_of(recorded), lonely)
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    cases = {
        str(tmp_path / "missing.pkl"): "does not exist",
        str(tmp_path / "junk.pkl"): "cannot read",
        str(lonely): "no checkpoint",
        str(recorded / "debug"): "is neither a nan_grad_step_N.pt checkpoint nor a nan_debug_step_N*.pkl dump",
    }
    for path, message in cases.items():
        assert main([path]) == ExitCode.USAGE == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("worker.nan.replay: error: ") and message in err[0], err
    assert main([str(dump_of(recorded)), "--device", "tpu:9"]) == 2
    assert "is not a torch device" in capsys.readouterr().err


def test_a_spike_reproduces_when_the_replay_crosses_the_recorded_threshold():
    from worker.nan.banner import NanReport
    from worker.nan.replay import RankReplay

    spike = {"metric": "loss", "thresholds": {"loss": {"threshold": 5.0}, "grad_norm": None}}
    report = NanReport("[GPU 0]", 7, 6.0, 1.0, None, [], [], [])

    def replayed(loss: float) -> RankReplay:
        return RankReplay(Path("x.pkl"), {"kind": "loss_spike", "spike": spike}, loss, 1.0, report, [])

    assert replayed(6.0).reproduces and not replayed(4.0).reproduces
    assert replayed(6.0).threshold() == 5.0


def _replay_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.commands.dispatch", "nan", "replay", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_planted_pickle_never_runs_whether_or_not_the_checkpoint_is_accepted(recorded, tmp_path):
    """`gpuherd nan replay` on a crafted dump: refused in one line (exit 2) before its code could run,
    beside a checkpoint it refuses (nothing unpickled at all) and beside a real one (refused by name)."""
    from tests.worker.nan.helpers import planted_dump

    marker = tmp_path / "the-payload-ran"
    bogus = tmp_path / "bogus"
    (bogus / "nan_grad_step_3.pt").parent.mkdir()
    (bogus / "nan_grad_step_3.pt").write_bytes(b"not a checkpoint")
    refused = _replay_cli(planted_dump(bogus / "debug" / "nan_debug_step_3.pkl", marker))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "posix.mkdir" not in refused.stderr  # the checkpoint was judged first
    assert not marker.exists()

    real = tmp_path / "real"
    shutil.copytree(recorded, real)
    (dump,) = (real / "debug").glob("nan_debug_step_*.pkl")
    planted_dump(dump, marker)
    for path in (dump, real / dump.name.replace("nan_debug_step_", "nan_grad_step_").replace(".pkl", ".pt")):
        proc = _replay_cli(path)
        assert proc.returncode == 2, proc.stderr
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and "is not a plain NaN dump: it asks to load posix.mkdir" in err[0], proc.stderr
        assert not marker.exists()

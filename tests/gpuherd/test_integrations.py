"""gpuherd/integrations/: the Lightning and transformers callbacks, in the real frameworks' Trainers.

Each run trains in this process with a status pipe as `gpuherd run` hands one to a rank; the
records that came through it are the ones the supervisor would read. Outside gpuherd (no pipe)
the callbacks send nothing and leave the script bootstrap's own heartbeats alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import torch

from gpuherd.status_channel import StatusWriter


@pytest.fixture
def status_pipe(monkeypatch):
    """GPUHERD_STATUS_FD for the callbacks made in the test; yields a reader of what came through."""
    monkeypatch.setattr(StatusWriter, "explicit_records", False)
    read, write = os.pipe()
    monkeypatch.setenv("GPUHERD_STATUS_FD", str(write))

    def records() -> list[dict]:
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            return [orjson.loads(line) for line in pipe.read().splitlines()]
    yield records


def _saves_and_phases(records: list[dict]) -> list[tuple]:
    return [(r["type"], r.get("name") or r.get("step"), *((r["path"], r["api"]) if r["type"] == "script_save" else ()))
            for r in records if r["type"] in ("phase", "script_save")]


def _lightning_fit(tmp_path: Path, steps: int = 12) -> None:
    pl = pytest.importorskip("pytorch_lightning", reason="a dev dependency: pip install -r requirements-dev.txt")
    from pytorch_lightning.callbacks import ModelCheckpoint

    from gpuherd.integrations.lightning import GpuherdCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True),
                                    GpuherdCallback()])
    trainer.fit(Regression(), loader)
    assert "save_checkpoint" not in vars(trainer)  # the Trainer's own method again after fit


def test_the_lightning_callback_tells_each_checkpoints_path_and_step_and_the_global_step(tmp_path, status_pipe):
    _lightning_fit(tmp_path)
    records = status_pipe()
    ckpt = tmp_path / "ckpt"
    assert _saves_and_phases(records) == [
        ("phase", "checkpoint"), ("script_save", 5, str(ckpt / "epoch=0-step=5.ckpt"), "lightning"), ("phase", "train"),
        ("phase", "checkpoint"), ("script_save", 5, str(ckpt / "last.ckpt"), "lightning"), ("phase", "train"),
        ("phase", "checkpoint"), ("script_save", 10, str(ckpt / "epoch=0-step=10.ckpt"), "lightning"),
        ("phase", "train"),
        ("phase", "checkpoint"), ("script_save", 10, str(ckpt / "last.ckpt"), "lightning"), ("phase", "train"),
    ]
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps[0] == 1 and steps == sorted(steps) and set(steps) <= set(range(1, 13))  # Lightning's global step
    assert StatusWriter.explicit_records  # it speaks for the script: the bootstrap's step counts stop


def test_outside_gpuherd_the_lightning_callback_does_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUHERD_STATUS_FD", raising=False)
    monkeypatch.setattr(StatusWriter, "explicit_records", False)
    _lightning_fit(tmp_path, steps=6)
    assert (tmp_path / "ckpt" / "last.ckpt").is_file() and not StatusWriter.explicit_records


def test_the_transformers_callback_tells_each_checkpoint_and_the_global_step(tmp_path, status_pipe):
    transformers = pytest.importorskip("transformers", reason="a dev dependency: pip install -r requirements-dev.txt")

    from gpuherd.integrations.transformers import GpuherdCallback

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(7))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4,
                                          max_steps=6, save_strategy="steps", save_steps=3, report_to=[],
                                          disable_tqdm=True, dataloader_num_workers=0, logging_steps=100)
    transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=Tokens(),
                         callbacks=[GpuherdCallback()]).train()
    records = status_pipe()
    out = tmp_path / "out"
    assert _saves_and_phases(records) == [
        ("phase", "checkpoint"), ("script_save", 3, str(out / "checkpoint-3"), "transformers"), ("phase", "train"),
        ("phase", "checkpoint"), ("script_save", 6, str(out / "checkpoint-6"), "transformers"), ("phase", "train")]
    assert (out / "checkpoint-3").is_dir() and (out / "checkpoint-6").is_dir()
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps[0] == 1 and steps == sorted(steps)

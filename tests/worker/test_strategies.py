"""Every strategy trains the same tiny model to the same loss curve on 2 CPU gloo
workers, and every one resumes mid-run bit for bit (real processes, real files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.worker import helpers as h

STRATEGIES = ("ddp", "fsdp", "zero1", "deepspeed")

# The seeds' ZeRO-2 file (000), with its own optimizer, scheduler and clipping that gpuherd overrides.
SEED_DS_CONFIG = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100000, "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False},
    "bf16": {"enabled": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("strategies")
    ds_path = tmp / "ds-config.json"
    ds_path.write_text(json.dumps(SEED_DS_CONFIG))
    ports = iter(range(h.free_port(), 65000, 7))
    items = []
    for name in STRATEGIES:
        extra = [f"training.strategy={name}", f"system.checkpoint_dir={tmp / ('ckpt-' + name)}",
                 "training.save_every=3", "training.max_grad_norm=0.5"]
        if name == "deepspeed":
            extra.append(f"training.deepspeed_config={ds_path}")
        items.append({"name": name, "port": next(ports), "overrides": extra})
    resumed = []
    for item in items:  # fresh processes: nothing survives but the checkpoint files
        name = item["name"]
        ckpt = f"step_0000003{'.pt' if name in ('ddp', 'zero1') else ''}"
        resumed.append({"name": f"{name}-resumed", "port": next(ports),
                        "overrides": [*item["overrides"], f"training.resume={tmp / ('ckpt-' + name) / ckpt}"]})
    # DeepSpeed keeps process-wide state: one engine per process, as in real runs.
    for label, batch in (("straight", items), ("resumed", resumed)):
        spec = tmp / f"spec-{label}.json"
        spec.write_text(json.dumps({"tmp": str(tmp), "status_dir": str(tmp), "runs": batch}))
        envs = [h.worker_env(r, 2, batch[0]["port"]) for r in range(2)]
        results = h.spawn(["tests/worker/helpers.py", "train", str(spec)], envs, timeout=240)
        for rank, res in enumerate(results):
            assert res.returncode == 0, f"{label} rank {rank} exited {res.returncode}:\n{res.stderr[-4000:]}"
    return tmp


def test_every_strategy_follows_the_ddp_loss_curve(runs: Path):
    for rank in (0, 1):
        reference = h.step_losses(runs / f"ddp-rank{rank}.jsonl")
        assert len(reference) == 6 and reference[-1] < reference[0] - 0.3, reference
        for name in STRATEGIES[1:]:
            losses = h.step_losses(runs / f"{name}-rank{rank}.jsonl")
            assert losses == pytest.approx(reference, rel=1e-4, abs=1e-5), name


def test_ranks_see_different_data_but_share_gradients(runs: Path):
    r0, r1 = (h.read_status(runs / f"ddp-rank{r}.jsonl") for r in (0, 1))
    steps0 = [r for r in r0 if r["type"] == "step"]
    steps1 = [r for r in r1 if r["type"] == "step"]
    assert [s["loss"] for s in steps0] != [s["loss"] for s in steps1]  # rank-sharded batches
    assert [s["grad_norm"] for s in steps0] == pytest.approx([s["grad_norm"] for s in steps1])  # one all-reduced gradient


@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_mid_run_is_bit_identical(runs: Path, name: str):
    for rank in (0, 1):
        straight = h.step_losses(runs / f"{name}-rank{rank}.jsonl")
        resumed_records = h.read_status(runs / f"{name}-resumed-rank{rank}.jsonl")
        resumed = [r for r in resumed_records if r["type"] == "step" and "loss" in r]
        assert [r["step"] for r in resumed] == [3, 4, 5]
        assert [r["loss"] for r in resumed] == straight[3:], f"{name} rank {rank}"
        assert resumed_records[-1] == {**resumed_records[-1], "type": "done", "step": 6}


def test_periodic_saves_are_async_where_the_engine_allows(runs: Path):
    """Step 3's save: rank 0 writes DDP's and ZeRO-1's file alone in the background; every FSDP
    rank writes its shards in the background (over the writers' own gloo group); DeepSpeed's
    engine saves itself, so its saves block on every rank."""
    expected = {"ddp": [["async"], []], "zero1": [["async"], []], "fsdp": [["async"], ["async"]],
                "deepspeed": [["blocking"], ["blocking"]]}
    for name, per_rank in expected.items():
        for rank in (0, 1):
            records = h.read_status(runs / f"{name}-rank{rank}.jsonl")
            periodic = [r["mode"] for r in records if r["type"] == "checkpoint" and r["step"] == 3]
            assert periodic == per_rank[rank], (name, rank)
            final = [r["mode"] for r in records if r["type"] == "checkpoint" and r["step"] == 6]
            assert final == ["blocking"], (name, rank)  # the last save is written while the loop waits


def test_checkpoint_layouts(runs: Path):
    from gpuherd.checkpoint_manifest import read_manifest

    assert sorted(p.name for p in (runs / "ckpt-ddp").iterdir()) == [
        "step_0000003.pt", "step_0000003.pt.manifest.json", "step_0000006.pt", "step_0000006.pt.manifest.json"]
    assert (runs / "ckpt-zero1" / "step_0000006.pt").is_file()
    fsdp = runs / "ckpt-fsdp" / "step_0000006"
    assert (fsdp / "meta.pt").is_file() and (fsdp / ".metadata").is_file()
    deepspeed = runs / "ckpt-deepspeed" / "step_0000006"
    assert (deepspeed / "ds").is_dir()
    for sharded in (fsdp, deepspeed):  # the manifest covers every file the ranks wrote, checksummed between them
        manifest = read_manifest(sharded)
        on_disk = sorted(str(p.relative_to(sharded)) for p in sharded.rglob("*") if p.is_file())
        assert sorted(manifest.files) == [name for name in on_disk if name != "manifest.json"]
        assert manifest.step == 6 and "meta.pt" in manifest.files
    assert not list(runs.glob("ckpt-*/*.tmp"))
    meta = torch.load(fsdp / "meta.pt", weights_only=True)
    assert meta["step"] == 6 and meta["world_size"] == 2 and len(meta["rng"]) == 2
    full = torch.load(runs / "ckpt-ddp" / "step_0000006.pt", weights_only=True)
    assert "layers.1.feed_forward.w3.weight" in full["model"] and "output.weight" in full["model"]


def test_generate_loads_every_layout_to_the_same_model(runs: Path):
    from worker.inference import generate, load_for_inference

    paths = {"ddp": runs / "ckpt-ddp", "zero1": runs / "ckpt-zero1" / "step_0000006.pt",
             "fsdp": runs / "ckpt-fsdp" / "step_0000006", "deepspeed": runs / "ckpt-deepspeed"}
    tokens = torch.arange(1, 9)[None]
    loaded = {name: load_for_inference(path, torch.device("cpu")) for name, path in paths.items()}
    assert loaded["ddp"].path.name == "step_0000006.pt" and loaded["ddp"].step == 6
    reference = loaded["ddp"].model(tokens)
    for name, item in loaded.items():
        torch.testing.assert_close(item.model(tokens), reference, rtol=1e-4, atol=1e-4, msg=name)
    gen = torch.Generator().manual_seed(0)
    out = generate(loaded["fsdp"].model, [5, 6, 7], 5, 0.0, 0, gen)
    assert out[:3] == [5, 6, 7] and len(out) == 8

"""The ranks' side of live recovery: what counts as a lost peer, who can be recovered live, and
the state hand-over between two real processes (the whole recovery: tests/e2e/test_live_recovery_run.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from gpuherd import contract
from worker.distributed import is_peer_loss
from worker.live_recovery import why_not_live

# Rank 0 broadcasts a state shaped like a trainer's (parameters, AdamW state with 0-dim step
# tensors, a sampler position, RNG states, odd dtypes); rank 1 saves what it received.
EXCHANGE = """
import sys, torch, torch.distributed as dist
from worker.state_broadcast import broadcast_state
rank, store_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
torch.manual_seed(7)
state = {"model": {"w": torch.randn(3, 5), "b": torch.randn(5).to(torch.bfloat16)},
         "optimizer": {"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(3, 5)}},
                       "param_groups": [{"lr": 3e-4, "params": [0]}]},
         "sampler": {"epoch": 1, "consumed": 96, "rank": 0}, "rng": {"torch": torch.get_rng_state(),
         "python": (3, tuple(range(5)), None)}, "ids": torch.arange(4, dtype=torch.int64), "none": None}
got = broadcast_state(state if rank == 0 else None, 0, torch.device("cpu"))
torch.save(got, out)
dist.destroy_process_group()
"""


def test_a_state_broadcast_from_one_rank_arrives_bit_for_bit_with_its_structure(tmp_path, python_env):
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(tmp_path / f"{r}.pt")],
                              env=python_env, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    sent, got = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    assert got["model"]["b"].dtype == torch.bfloat16 and got["optimizer"]["state"][0]["step"].shape == ()
    assert torch.equal(got["rng"]["torch"], sent["rng"]["torch"])
    for key in ("w", "b"):
        assert torch.equal(got["model"][key], sent["model"][key])
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], sent["optimizer"]["state"][0]["exp_avg"])
    assert got["optimizer"]["param_groups"] == sent["optimizer"]["param_groups"]
    assert got["sampler"] == sent["sampler"] and got["rng"]["python"] == (3, tuple(range(5)), None)
    assert torch.equal(got["ids"], sent["ids"]) and got["none"] is None


@pytest.mark.parametrize(("exc", "lost"), [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36234"), True),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:57483: Connection reset by peer"), True),
    (dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."), True),
    (RuntimeError("CUDA out of memory"), False),
    (ValueError("Connection closed by peer"), False),
])
def test_only_a_peer_lost_mid_collective_sends_a_rank_into_a_rejoin(exc, lost):
    assert is_peer_loss(exc) is lost


def test_who_can_be_recovered_live(monkeypatch):
    monkeypatch.delenv(contract.LIVE_RECOVERY, raising=False)
    assert "no warm spare" in why_not_live("ddp", True, 2)
    monkeypatch.setenv(contract.LIVE_RECOVERY, "1")
    assert why_not_live("ddp", True, 2) is None
    assert "shards its state" in why_not_live("fsdp", False, 2)
    assert "single worker" in why_not_live("single", False, 1)

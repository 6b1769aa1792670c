"""The ranks' side of live recovery: what counts as a lost peer, who can be recovered live, and
the state hand-over between two real processes (the whole recovery: tests/e2e/test_live_recovery_run.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from gpuherd import contract
from tests.worker.helpers import run_pair
from gpuherd.broken_group import is_peer_loss, sever_peer_connections
from worker.engines.ddp import _ddp, gradient_buckets
from worker.live_recovery import why_not_live

# Rank 0 broadcasts a state shaped like a trainer's (parameters, AdamW state with 0-dim step
# tensors, a sampler position, RNG states, odd dtypes); rank 1 saves what it received.
EXCHANGE = """
import sys, torch, torch.distributed as dist
from gpuherd.state_broadcast import broadcast_state
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
    sent, got = (torch.load(out, weights_only=False) for out in run_pair(tmp_path, EXCHANGE, python_env))
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
    assert "shards its state" in why_not_live("zero1", False, 2)
    assert why_not_live("fsdp", True, 2, copies=True) is None  # its shards are copied to a neighbour
    assert "system.shard_copies=false" in why_not_live("fsdp", True, 2, copies=False)
    assert "single worker" in why_not_live("single", False, 1)


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layout(wrapper: torch.nn.Module) -> list[list[int]]:
    params = list(wrapper.module.parameters())
    return [[next(i for i, p in enumerate(params) if p is q) for q in bucket.parameters()]
            for bucket in wrapper.reducer._get_zeros_like_grad_buckets()]


def test_a_rebuilt_group_s_wrapper_reduces_in_the_buckets_of_the_wrapper_it_replaces(group_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2), torch.nn.LayerNorm(2))
    first = _ddp(model, torch.device("cpu"), init_sync=True)
    assert gradient_buckets(first) is None  # DDP's initial buckets: not rebuilt yet
    initial = _layout(first)
    for _ in range(3):
        first(torch.randn(3, 4)).sum().backward()
    rebuilt = gradient_buckets(first)
    assert [list(b) for b in rebuilt] == _layout(first) != initial  # reordered by when gradients became ready

    assert _layout(_ddp(model, torch.device("cpu"), init_sync=False, buckets=rebuilt)) == [list(b) for b in rebuilt]
    assert _layout(_ddp(model, torch.device("cpu"), init_sync=False)) == initial
    two = ((0, 1), (2, 3, 4, 5))
    assert _layout(_ddp(model, torch.device("cpu"), init_sync=False, buckets=two)) == [[0, 1], [2, 3, 4, 5]]
    # buckets of another model (a parameter missing): DDP's own
    assert _layout(_ddp(model, torch.device("cpu"), init_sync=False, buckets=((0, 1, 2),))) == initial


def test_leaving_a_broken_group_shuts_down_every_peer_connection_but_the_store_s(monkeypatch):
    """The survivor that saw the loss frees a survivor waiting on it: its end of their connection
    reads EOF at once, while the store's connection (MASTER_PORT) stays usable."""
    with socket.create_server(("127.0.0.1", 0)) as store_server, socket.create_server(("127.0.0.1", 0)) as peer_server:
        monkeypatch.setenv("MASTER_PORT", str(store_server.getsockname()[1]))
        store = socket.create_connection(store_server.getsockname())
        peer = socket.create_connection(peer_server.getsockname())
        store_end, _ = store_server.accept()
        peer_end, _ = peer_server.accept()
        try:
            assert sever_peer_connections() >= 2  # this rank's end of the pair, and the peer's (same process here)
            peer_end.settimeout(5)
            assert peer_end.recv(1) == b""  # the waiting side is freed
            store.sendall(b"k")
            store_end.settimeout(5)
            assert store_end.recv(1) == b"k"
        finally:
            for sock in (store, peer, store_end, peer_end):
                sock.close()


def _records(path, kind: str) -> list[dict]:
    from tests.worker import helpers as h

    return [r for r in h.read_status(path) if r["type"] == kind]


@pytest.mark.integration  # the new lead forks its checkpoint writer
def test_a_survivor_that_becomes_place_0_of_a_shrunk_group_takes_over_rank_0s_checkpoints_and_scalars(tmp_path):
    """Rank 1 of 2 (rank 0 lost, worker/live_recovery.py `_resize` calls `on_place`): it writes
    no checkpoint while rank 0 leads, then, as place 0, writes and prunes them in the background
    with a writer of its own and opens the run's event file; back at place 1 (a regrow brought
    rank 0 back) it writes none again."""
    from gpuherd.contract import WorkerIdentity
    from gpuherd.liveness import Liveness
    from gpuherd.memory_plan import Layout
    from tests.worker import helpers as h
    from worker import signals as wsignals
    from worker.data import Prefetched
    from worker.train import Trainer

    cfg = h.tiny_config(tmp_path, "training.save_every=2", "training.keep_last=1")
    identity = WorkerIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2, device_kind="cpu",
                              device_id=1, supervised=False)
    status_path, ckpt = tmp_path / "status.jsonl", tmp_path / "ckpt"
    status = h.status_writer(status_path, 1)
    t = Trainer(cfg, identity, torch.device("cpu"), Layout("single"), h.bundle(cfg, 1, 2), status, tmp_path / "run",
                wsignals.SignalState(), Liveness(status), run_id="r1")
    try:
        def save_at(step: int) -> None:
            t._train_step()
            t.step = step
            t.save()
            t.saver.drain_or_raise()

        save_at(1)
        assert not ckpt.exists() and t.saver.writer is None and _records(status_path, "checkpoint") == []
        t.on_place(0)
        assert t.checkpointer.group_rank == 0 and t.saver.writer is not None
        save_at(2)
        save_at(3)
        saves = _records(status_path, "checkpoint")
        assert [(r["step"], r["mode"]) for r in saves] == [(2, "async"), (3, "async")]  # its own writer process
        assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000003.pt", "step_0000003.pt.manifest.json"]
        if t.tb.sinks[0].writer is not None:  # tensorboard installed: the run's event file is this rank's now
            assert list((tmp_path / "run" / "tensorboard").glob("events.*"))
        t.on_place(1)
        save_at(4)
        assert t.tb.sinks[0].writer is None and len(_records(status_path, "checkpoint")) == 2
        assert not (ckpt / "step_0000004.pt").exists()
    finally:
        t.tb.close()
        t.saver.close()
        if isinstance(t.data.train, Prefetched):
            t.data.train.close()


def _trainer_uses(source: str, attribute: str) -> set[tuple[str, bool]]:
    """(member, called) for every `self.<attribute>.<member>`, and `t.<member>` where t = self.<attribute>."""
    import ast

    tree = ast.parse(source)
    aliases = {target.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and isinstance(n.targets[0], ast.Tuple) and isinstance(n.value, ast.Tuple)
               for target, v in zip(n.targets[0].elts, n.value.elts, strict=True)
               if isinstance(target, ast.Name) and isinstance(v, ast.Attribute) and v.attr == attribute}
    aliases |= {n.targets[0].id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Attribute) and n.value.attr == attribute}
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {(n.attr, id(n) in calls) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and (
        (isinstance(n.value, ast.Name) and n.value.id in aliases)
        or (isinstance(n.value, ast.Attribute) and n.value.attr == attribute and isinstance(n.value.value, ast.Name)
            and n.value.value.id == "self"))}


def test_live_recovery_reads_no_trainer_member_and_changes_it_only_through_its_calls():
    """The trainer is a `Recoverable`: its calls only. What live recovery reads (engine, identity,
    status, ...) comes as RecoveryParts; the trainer class has every call the protocol names."""
    import inspect

    from worker import live_recovery
    from worker.live_recovery import Recoverable
    from worker.train import Trainer

    calls = {name for name in vars(Recoverable) if not name.startswith("_")}
    uses = _trainer_uses(inspect.getsource(live_recovery), "t")
    assert uses and all(called and member in calls for member, called in uses), sorted(uses)
    assert all(callable(getattr(Trainer, name, None)) for name in calls)

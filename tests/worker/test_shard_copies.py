"""The buddy copies of sharded state (worker/shard_copies.py): which step a rebuilt group returns
to, the buffers' layout, and the exchange between two real processes, one of which dies with a
copy in flight (the whole recovery: tests/e2e/test_fsdp_live_recovery_run.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.worker.helpers import run_pair
from worker.shard_copies import _Shape, header_of, restore_step


def _report(own: list[int], held: list[int]) -> dict:
    return {"own": own, "held": held, "shapes": None}


def test_the_rebuilt_group_returns_to_the_newest_copy_of_the_lost_shard_that_every_survivor_can_return_to():
    # rank 1 lost: its copy is on rank 2, which got step 8's copy before the loss
    assert restore_step([_report([7, 8], [7, 8]), None, _report([7, 8], [7, 8])]) == (8, "")
    # step 8's copy was cut short: the previous one, whole, and every survivor's own snapshot of step 7
    assert restore_step([_report([7, 8], [7, 8]), None, _report([7, 8], [7])]) == (7, "")
    # the last rank's copy wraps around to rank 0
    assert restore_step([_report([4, 5], [5]), _report([4, 5], [4, 5]), None]) == (5, "")


@pytest.mark.parametrize(("reports", "why"), [
    ([_report([1], []), None], "rank 0 holds no complete copy of rank 1's shard yet"),
    ([None, None, _report([3, 4], [3, 4])], "2 newcomers in the rebuilt group"),
    ([_report([9, 10], [9, 10]), None, _report([9, 10], [7, 8])], "which not every survivor can return to"),
])
def test_a_loss_that_cannot_be_recovered_from_the_copies_says_why(reports, why):
    step, said = restore_step(reports)
    assert step is None and why in said


def test_a_buffer_holds_the_header_and_every_tensor_bit_for_bit_whatever_the_dtypes():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.tensor(12.0), torch.arange(3)]
    shape = _Shape(8192, [(int(t.numel()), t.dtype) for t in tensors])
    assert all(at % 64 == 0 for at in shape.offsets)  # a uint8 slice viewed as float64 must be aligned
    buf = shape.buffer()
    shape.write(buf, tensors, pickle.dumps({"step": 3, "rng": torch.get_rng_state()}))
    back = [torch.zeros_like(t) for t in tensors]
    header = shape.read(buf, back)
    assert header["step"] == 3 and torch.equal(header["rng"], torch.get_rng_state())
    assert header_of(buf)["step"] == 3
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back))
    with pytest.raises(OverflowError, match="outgrew its slot"):
        shape.write(buf, tensors, bytes(8193))


# Two ranks copy their "shard" to each other after steps 1-3 (waiting inside the next step, as the
# trainer does); rank 1 then dies with step 4's copy in flight: before sending it (LANDED False), or
# once it was sent whole (True). Rank 0 settles its copies as a survivor does and writes what it holds.
EXCHANGE = """
import os, sys, torch, torch.distributed as dist
from worker.shard_copies import ShardCopies, header_of
rank, store_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
shard = [torch.zeros(4 + rank), torch.zeros((), dtype=torch.float64)]  # uneven, as FSDP's shards
copies = ShardCopies(lambda: shard, rank, 2)
for step in (1, 2, 3, 4):
    if rank == 1 and step == 4 and not LANDED:
        os._exit(0)  # dies before step 4's copy is sent
    for t in shard:
        t.fill_(10 * rank + step)
    try:
        copies.post(step, {"step": step, "rank": rank})
    except RuntimeError:  # rank 1's connection had closed already: gloo said so at the send, not the wait
        assert rank == 0 and step == 4 and not LANDED
    if step < 4:
        copies.wait()
if rank == 1:
    copies.pending.sent.wait()
    os._exit(0)  # dies once step 4's copy left whole
copies.settle()  # the receive completed, or fails (rank 1's connection closed), or has not ended in a second
report = copies.report()
newest = max(report["held"])
held = copies.received[copies.held_steps.index(newest)]
mine = copies.restore_own(3)
torch.save({"report": report, "own": [t.clone() for t in shard], "header": mine,
            "held": [v.clone() for v in copies.shapes[1].views(held)], "held_header": header_of(held)}, out)
os._exit(0)
"""


@pytest.mark.parametrize("landed", [False, True])
def test_a_copy_that_landed_before_the_loss_counts_and_one_cut_short_leaves_the_previous_one_whole(
        tmp_path, python_env, landed):
    got = torch.load(run_pair(tmp_path, EXCHANGE.replace("LANDED", str(landed)), python_env)[0], weights_only=False)
    # cut short, step 4's never came whole: step 3's is kept (step 2's buffer was the one it was landing in)
    newest = 4 if landed else 3
    assert got["report"]["held"] == ([3, 4] if landed else [3])
    assert got["report"]["own"] == [3, 4]
    assert got["held_header"] == {"step": newest, "rank": 1}
    assert [t.tolist() for t in got["held"]] == [[10.0 + newest] * 5, [10.0 + newest]]  # rank 1's shard, exactly
    assert got["header"] == {"step": 3, "rank": 0}  # this rank back at its own snapshot of step 3
    assert [t.tolist() for t in got["own"]] == [[3.0] * 4, 3.0]

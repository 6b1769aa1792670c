"""A shrunk group's data slots: every slot trained exactly once per step, the same windows in
the same order as an undisturbed run, and the loss scale that keeps the gradient the mean over
all slots (the whole run: tests/e2e/test_shrink_run.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dataset_cache import BatchSampler
from tests.dataset_cache.test_sampler import B, T, PositionCache, window_starts
from worker.checkpoint import per_slot
from worker.data_slots import draw_position, loss_scale, slots_of

W, ACCUM = 4, 2


@pytest.mark.parametrize("survivors", [list(s) for n in range(1, W + 1) for s in itertools.combinations(range(W), n)])
def test_every_slot_goes_to_exactly_one_survivor_each_keeping_its_own(survivors):
    slots = [slots_of(r, survivors, W) for r in survivors]
    assert sorted(s for mine in slots for s in mine) == list(range(W))
    assert all(mine[0] == r for r, mine in zip(survivors, slots))


def test_the_lost_ranks_slot_goes_to_the_survivor_at_its_index_modulo_the_survivors():
    assert [slots_of(r, [0, 1, 3], 4) for r in (0, 1, 3)] == [[0], [1], [3, 2]]
    assert [slots_of(r, [0, 3], 4) for r in (0, 3)] == [[0, 2], [3, 1]]
    with pytest.raises(ValueError, match="not among the survivors"):
        slots_of(2, [0, 1, 3], 4)


def _step_windows(cache, draws) -> list[list[int]]:
    """One optimizer step: each slot's ACCUM micro-batches (window starts), by slot."""
    return [[w for _ in range(ACCUM) for w in window_starts(cache, sampler.next_batch()[0])] for sampler in draws]


def test_a_shrunk_group_draws_every_step_the_windows_of_an_undisturbed_run_in_the_same_order():
    cache = PositionCache(train=20000)
    plain = [BatchSampler(cache, "train", B, T, r, W, 7) for r in range(W)]
    expected = [_step_windows(cache, plain) for _ in range(12)]

    own = [BatchSampler(cache, "train", B, T, r, W, 7) for r in range(W)]
    got = [_step_windows(cache, own) for _ in range(5)]  # five steps with all four ranks
    survivors = [0, 1, 3]  # rank 2 lost: its slot is drawn by a fresh sampler at the survivors' position
    carriers = {}
    for r in survivors:
        for slot in slots_of(r, survivors, W)[1:]:
            carriers[slot] = BatchSampler(cache, "train", B, T, slot, W, 7)
            carriers[slot].load_state_dict({**own[r].state_dict(), "rank": slot})
    by_slot = {**{r: own[r] for r in survivors}, **carriers}
    got += [_step_windows(cache, [by_slot[s] for s in range(W)]) for _ in range(7)]
    assert got == expected
    seen = [w for step in got for slot in step for w in slot]
    assert len(seen) == len(set(seen))  # within this epoch no window twice: none repeated, none skipped


def test_scaled_losses_averaged_over_the_survivors_give_the_gradient_of_the_mean_over_every_slot():
    torch.manual_seed(0)
    weight = torch.randn(5, requires_grad=True)
    data = [torch.randn(ACCUM, 3, 5) for _ in range(W)]  # per slot: ACCUM micro-batches

    def slot_grad(slot: int, scale: float) -> torch.Tensor:  # what a rank's backward adds for one slot
        weight.grad = None
        for micro in data[slot]:
            ((micro @ weight).square().mean() * scale / ACCUM).backward()
        return weight.grad.clone()

    undisturbed = sum(slot_grad(s, 1.0) for s in range(W)) / W  # DDP: the mean over W ranks
    survivors = [0, 1, 3]
    scale = loss_scale(len(survivors), W)
    per_rank = [sum(slot_grad(s, scale) for s in slots_of(r, survivors, W)) for r in survivors]
    shrunk = sum(per_rank) / len(survivors)  # DDP: the mean over the shrunk group
    torch.testing.assert_close(shrunk, undisturbed, rtol=1e-6, atol=1e-7)
    unscaled = sum(sum(slot_grad(s, 1.0) for s in slots_of(r, survivors, W)) for r in survivors) / len(survivors)
    assert not torch.allclose(unscaled, undisturbed)  # without the scale the step would be 4/3 too large


def test_a_checkpoint_written_while_shrunk_holds_every_slots_position():
    gathered = [(0, {"epoch": 1, "consumed": 96, "rank": 0}, "rng0"), (1, {"epoch": 1, "consumed": 96, "rank": 1},
                "rng1"), (3, {"epoch": 1, "consumed": 96, "rank": 3}, "rng3")]
    samplers, rngs = per_slot(gathered, 4)
    assert [s["rank"] for s in samplers] == [0, 1, 2, 3] and {s["consumed"] for s in samplers} == {96}
    assert rngs == ["rng0", "rng1", "rng0", "rng3"]


def test_a_regrow_hands_the_carried_slot_to_the_newcomer_and_the_windows_go_on_unbroken():
    """Shrunk for 4 steps (rank 2's slot carried by rank 3), then a spare takes rank 2 back at a step
    boundary with the group's position: every step still draws the undisturbed run's windows."""
    cache = PositionCache(train=20000)
    plain = [BatchSampler(cache, "train", B, T, r, W, 7) for r in range(W)]
    expected = [_step_windows(cache, plain) for _ in range(12)]
    own = [BatchSampler(cache, "train", B, T, r, W, 7) for r in range(W)]
    got = [_step_windows(cache, own) for _ in range(3)]
    survivors = [0, 1, 3]
    assert slots_of(3, survivors, W) == [3, 2]
    carried = BatchSampler(cache, "train", B, T, 2, W, 7)
    carried.load_state_dict({**own[3].state_dict(), "rank": 2})
    got += [_step_windows(cache, [own[0], own[1], carried, own[3]]) for _ in range(4)]
    assert [slots_of(r, list(range(W)), W) for r in range(W)] == [[r] for r in range(W)]  # nobody carries now
    newcomer = BatchSampler(cache, "train", B, T, 2, W, 7)
    newcomer.load_state_dict({**own[0].state_dict(), "rank": 2})  # the source's position, as the broadcast hands it
    got += [_step_windows(cache, [own[0], own[1], newcomer, own[3]]) for _ in range(5)]
    assert got == expected


def test_a_draw_is_named_by_its_slot_and_the_samplers_position_after_it():
    cache = PositionCache(train=20000)
    sampler = BatchSampler(cache, "train", B, T, 1, W, 7)
    sampler.next_batch()
    assert draw_position(1, sampler.state_dict()) == [1, 0, W * B]
    assert draw_position(2, {"kind": "mixture", "position": 40}) == [2, 0, 40]

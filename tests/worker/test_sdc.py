"""Silent data corruption pieces without processes: the fingerprint sees every single flipped bit
and says which, blame names the odd replica or says it cannot, the injector refuses bad values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.distributed import WorkerError
from worker.sdc import blame, heal, injector
from worker.sdc.fingerprint import Fingerprint, optimizer_state, parameters, word_sum
from worker.sdc.recompute import StepRecompute


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    ints = out.view({2: torch.int16, 4: torch.int32}[out.element_size()])
    ints[index] ^= 1 << bit
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_single_bit_flip_changes_the_sum_by_exactly_a_power_of_two(dtype):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    base, width = int(word_sum(t)), 8 * t.element_size()
    for index in (0, 1, 2, 3, 999):
        for bit in range(width):
            k = blame.single_bit(int(word_sum(_flip(t, index, bit))) - base)
            assert k is not None and k % width == bit and k // width == index % (64 // width)


def test_the_sum_does_not_depend_on_how_the_tensor_is_laid_out_or_split():
    t = torch.randn(64, 48)
    assert int(word_sum(t)) == int(word_sum(t.clone().reshape(-1)))
    halves = (int(word_sum(t[:32])) + int(word_sum(t[32:]))) & blame.MASK
    assert halves == int(word_sum(t)) & blame.MASK


def test_odd_lengths_and_offsets_take_the_exact_widened_path():
    t = torch.randn(7)  # 28 bytes: not whole 64-bit words
    assert int(word_sum(t)) == int(t.view(torch.int32).to(torch.int64).sum())
    assert int(word_sum(_flip(t, 6, 31))) != int(word_sum(t))
    assert int(word_sum(torch.empty(0))) == 0


def test_a_fingerprint_has_one_bucket_per_parameter_and_optimizer_tensor():
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    named = parameters(model) + optimizer_state(model, opt)
    fp = Fingerprint.of(named, torch.device("cpu"))
    assert fp.names == ["weight", "bias", "weight:exp_avg", "weight:exp_avg_sq", "weight:step",
                        "bias:exp_avg", "bias:exp_avg_sq", "bias:step"]
    assert fp.sums.dtype == torch.int64 and fp.sums.shape == (8,)


def test_the_odd_replica_is_named_by_a_strict_majority_only():
    good, bad = (1, 2, 3), (1, 2, 4)
    assert blame.judge([good, good]) == blame.Verdict(True, healthy=(0, 1))
    assert blame.judge([good, bad, good]) == blame.Verdict(False, (1,), (0, 2))
    assert blame.judge([bad, good, good, good]).culprits == (0,)
    assert not blame.judge([good, bad]).decided  # two replicas: the sums alone cannot say
    assert not blame.judge([good, bad, good, bad]).decided  # a tie
    assert not blame.judge([(1,), (2,), (3,)]).decided


def test_the_recompute_names_the_rank_whose_first_result_changed():
    assert blame.against([(5,), (6,)], (5,)) == (1,)
    assert blame.against([(7,), (6,)], (5,)) == (0, 1)


def test_a_difference_names_the_bucket_and_the_bit():
    (d,) = blame.differences(["a", "b"], [32, 32], (10, 20 + (1 << 54)), (10, 20))
    assert d.describe() == "b: one bit flipped (value 1 of its 2-value word, bit 22)"
    (d,) = blame.differences(["a"], [32], (3,), (10,))
    assert d.describe() == "a: several values differ"
    assert blame.single_bit(-(1 << 63)) == 63 and blame.single_bit(0) is None and blame.single_bit(3) is None


def test_locate_names_the_value_and_the_bit():
    healthy = {"w": torch.ones(8)}
    mine = {"w": _flip(healthy["w"], 5, 22)}
    (line,) = heal.locate(mine, healthy)
    assert line.startswith("w[5] bit 22: 1.5 (healthy 1)")


@pytest.mark.parametrize("text", ["1:2", "a:2:param", "1:2:weights", "1:-2:param", "9:2:grad", ""])
def test_a_bad_injector_value_is_refused_in_one_line_with_exit_2(text):
    with pytest.raises(WorkerError) as info:
        injector.parse(text, world_size=4)
    assert info.value.exit_code == 2 and "GPUHERD_INJECT_BITFLIP" in str(info.value) and "\n" not in str(info.value)


def test_the_injector_reads_one_or_several_faults_and_nothing_when_unset(monkeypatch):
    monkeypatch.delenv("GPUHERD_INJECT_BITFLIP", raising=False)
    assert injector.from_env(2) == []
    monkeypatch.setenv("GPUHERD_INJECT_BITFLIP", "1:3:grad, 0:5:optim")
    assert injector.from_env(2) == [injector.Bitflip(1, 3, "grad"), injector.Bitflip(0, 5, "optim")]


@pytest.mark.parametrize("target", injector.TARGETS)
def test_a_flip_fires_once_on_its_rank_at_its_step_only(target):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    twin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters())
    step = {"n": 0}
    injector.arm(injector.Bitflip(0, 1, target), 0, model, opt, lambda: step["n"])
    injector.arm(injector.Bitflip(1, 1, target), 0, twin, twin_opt, lambda: step["n"])  # another rank's fault
    x = torch.randn(3, 4)
    diverged_at = None
    for n in range(3):
        step["n"] = n
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        same = Fingerprint.of(parameters(model) + optimizer_state(model, opt), torch.device("cpu")).sums.equal(
            Fingerprint.of(parameters(twin) + optimizer_state(twin, twin_opt), torch.device("cpu")).sums)
        if not same and diverged_at is None:
            diverged_at = n
    assert diverged_at == 1


def _pair():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    return models, [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_the_recompute_of_a_clean_step_changes_nothing_step_after_step():
    (model, twin), (opt, twin_opt) = _pair()
    check = StepRecompute(model, opt, due=lambda: True)
    for n in range(4):  # every step recomputed: each one from its own inputs, never an earlier step's
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(n))
        _train_step(model, opt, x)
        _train_step(twin, twin_opt, x)
        assert check.verify() == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_value_corrupted_right_after_the_step_is_named_and_replaced_by_the_recomputed_one():
    (model, twin), (opt, twin_opt) = _pair()
    check = StepRecompute(model, opt, due=lambda: True)
    x = torch.randn(3, 4)
    _train_step(model, opt, x)
    _train_step(twin, twin_opt, x)
    index, bit = injector.flip_top_mantissa_bit(model[1].weight)
    (line,) = check.verify()
    assert line.startswith(f"1.weight[{index}] bit {bit}: ")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_sum_equals_the_cpu_one_and_sees_a_flip(dtype):
    """The same bits give the same number on any device (integer sums: no reduction-order rounding)."""
    t = torch.randn(75_000_001, generator=torch.Generator().manual_seed(1)).to(dtype)  # odd: both paths
    gpu = t.cuda()
    assert int(word_sum(gpu)) == int(word_sum(t)) and int(word_sum(gpu[:-1])) == int(word_sum(t[:-1]))
    flipped = _flip(t[:-1], 12345, 3).cuda()
    assert blame.single_bit(int(word_sum(flipped)) - int(word_sum(gpu[:-1]))) is not None

"""The host copy a save takes: tensors through torch's stager, everything else copied here."""

from __future__ import annotations

import abc
from collections import OrderedDict

import torch

from worker.staging import HostStager


class _Abstract(abc.ABC):  # a class whose metaclass is not `type` itself (torch 2.11's stager fails on it)
    pass


def test_a_stager_closed_after_every_stage_still_copies_the_next_state(monkeypatch):
    """torch 2.11's DefaultStager (seen on an H100) closes its state-dict stager after every
    stage, emptying the copier table: the second save ended in `KeyError: <class 'type'>`."""
    from torch.distributed.checkpoint.staging import DefaultStager

    real_stage = DefaultStager._stage

    def as_in_torch_2_11(self, state_dict, **kwargs):
        staged = real_stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", as_in_torch_2_11)
    model = torch.nn.Linear(3, 2)
    stager = HostStager(torch.device("cpu"))
    try:
        for _save in range(3):
            copied = stager.copy({"model": model.state_dict(), "cls": _Abstract, "step": _save})
            assert copied["cls"] is _Abstract and copied["step"] == _save
            assert torch.equal(copied["model"]["weight"], model.weight)
    finally:
        stager.close()


def test_a_state_with_classes_views_and_metadata_is_copied_whole():
    model = torch.nn.Linear(3, 2)
    weights = model.state_dict()
    state = {"model": weights, "cls": _Abstract, "step": 5, "groups": [{"lr": 0.1, "params": (0, 1)}],
             "row": model.weight[0]}
    stager = HostStager(torch.device("cpu"))
    try:
        copied = stager.copy(state)
    finally:
        stager.close()
    assert isinstance(copied["model"], OrderedDict) and copied["model"]._metadata == weights._metadata
    assert copied["cls"] is _Abstract and copied["step"] == 5
    assert copied["groups"] == [{"lr": 0.1, "params": (0, 1)}] and copied["groups"] is not state["groups"]
    before = copied["model"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on changing the live tensors
    assert torch.equal(copied["model"]["weight"], before)
    assert torch.equal(copied["row"], before[0])

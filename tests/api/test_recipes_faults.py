"""All or nothing under faults (review with fault injection): SR-STE's set-up and finalize, and a
permutation interrupted inside one group's tensors."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import sparse24
from sparse24.masks import PermutationGroup
from sparse24.masks import permute_model as pm


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _interrupted_at(call: int, real):
    """``real``, raising KeyboardInterrupt (Ctrl-C) at its ``call``-th call instead."""
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*a, **k)
    return flaky


def test_srste_refuses_a_nan_weight_before_parametrizing_any_layer():
    """The parametrization's first run refused the NaN in the last layer after the first two were
    parametrized: the model changed, and a retry said "SR-STE applied twice?"."""
    model = _mlp()
    with torch.no_grad():
        model[4].weight[0, 0] = float("nan")
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"SRSTE: layer '4''s weight has 1 non-finite value.*exclude it"):
        sparse24.SRSTE(model)
    assert not any(parametrize.is_parametrized(model[i]) for i in (0, 2, 4))
    assert list(model.state_dict()) == list(before.state_dict())
    with torch.no_grad():
        model[4].weight[0, 0] = 0.0
    sparse24.SRSTE(model)   # the retry works
    assert all(parametrize.is_parametrized(model[i]) for i in (0, 2, 4))


def test_srste_interrupted_while_parametrizing_leaves_plain_layers(monkeypatch):
    model = _mlp()
    before = copy.deepcopy(model)
    monkeypatch.setattr(parametrize, "register_parametrization",
                        _interrupted_at(3, parametrize.register_parametrization))
    with pytest.raises(KeyboardInterrupt):
        sparse24.SRSTE(model)
    assert not any(parametrize.is_parametrized(model[i]) for i in (0, 2, 4)) and _same(model, before)


def test_srste_finalize_interrupted_is_finished_by_calling_it_again(monkeypatch):
    model, ref = _mlp(), _mlp()
    srste, srste_ref = sparse24.SRSTE(model), sparse24.SRSTE(ref)
    want = srste_ref.finalize()
    monkeypatch.setattr(parametrize, "remove_parametrizations", _interrupted_at(2, parametrize.remove_parametrizations))
    with pytest.raises(KeyboardInterrupt):
        srste.finalize()
    assert not srste.finalized
    masks = srste.finalize()
    assert masks.keys() == want.keys() and all(torch.equal(masks[k], want[k]) for k in want)
    assert _same(model, ref) and not any(parametrize.is_parametrized(model[i]) for i in (0, 2, 4))


def test_a_permutation_interrupted_inside_a_group_is_undone(monkeypatch):
    """An interrupt after the consumer's columns were permuted and before the producer's rows were
    left them disagreeing (the group was recorded for undo only once whole)."""
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    before = copy.deepcopy(model)
    real_apply, real_copy, state = pm._apply, torch.Tensor.copy_, {"on": False, "n": 0}

    def apply(*a, **k):
        state["on"] = True
        try:
            return real_apply(*a, **k)
        finally:
            state["on"] = False

    def copy_(self, *a, **k):
        if state["on"]:
            state["n"] += 1
            if state["n"] == 2:
                raise KeyboardInterrupt
        return real_copy(self, *a, **k)
    monkeypatch.setattr(pm, "_apply", apply)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(KeyboardInterrupt):
        sparse24.permute_model_(model, [PermutationGroup(["2"], ["0"], name="mlp")], max_iters=50)
    monkeypatch.undo()
    assert state["n"] >= 2 and _same(model, before)

"""prune_layerwise_'s default layer choice is sparsify_'s: an nn.Linear subclass (transformers' FalconLinear)
and a parametrized Linear (weight_norm) stay dense with sparsify_'s reasons; a parametrized layer a filter_fn
picks is refused (its .weight is computed: pruning it changed nothing); selected layers the model never calls
(their parent reads the weight directly, as WavLM's attention) are named in a warning, not silently left out."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune as torch_prune
from torch.nn.utils.parametrizations import weight_norm

import sparse24
from sparse24.masks import prune_layerwise_


class SubLinear(nn.Linear):
    """As transformers' FalconLinear: the same math, an nn.Linear subclass with its own forward."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class ParentRead(nn.Module):
    """As WavLM's attention: reads its child's weight directly, never calls the child."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.sub = SubLinear(64, 64)
        self.wn = weight_norm(nn.Linear(64, 64))
        self.attn = ParentRead()
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        x = torch.relu(self.a(x))
        x = torch.relu(self.sub(x))
        x = torch.relu(self.wn(x))
        return self.b(self.attn(x))


def _net():
    torch.manual_seed(0)
    return Net()


BATCHES = [torch.randn(32, 64, generator=torch.Generator().manual_seed(1))]


def _state(model):
    """Every stored tensor (weight_norm's original0/original1 included), copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before, names):
    for name in names:
        got = {k: v for k, v in model.state_dict().items() if k.startswith(name + ".")}
        assert got, name
        for k, v in got.items():
            assert torch.equal(v, before[k]), f"{k} changed"


def _magnitude_24(w):
    """Independent reference: the float64 weight with the 2 largest |w| of every 4 inputs kept."""
    w = w.detach().to(torch.float64)
    g = w.reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.abs().topk(2, dim=-1).indices, True)
    return (g * keep).reshape(w.shape)


def _layerwise(model, **kw):
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        res = prune_layerwise_(model, BATCHES, method="magnitude", progress=False, **kw)
    return res, [str(w.message) for w in ws if "prune_layerwise_" in str(w.message)]


def test_default_choice_is_sparsify_s():
    """Same layers as sparsify_: subclass and parametrized kept dense, unchanged; the parent-read layer warned of."""
    model, ref = _net(), _net()
    before = _state(model)
    res, warned = _layerwise(model)
    rep = sparse24.sparsify_(ref, mode="masked")
    swapped = {r.fqn for r in rep.changed}
    assert swapped == {"a", "attn.proj", "b"}
    assert set(res) == swapped - {"attn.proj"}, sorted(res)
    assert len(warned) == 1 and "'attn.proj'" in warned[0] and "reads" in warned[0], warned
    _unchanged(model, before, ["sub", "wn", "attn.proj"])
    for name in ("a", "b"):
        assert torch.equal(getattr(model, name).weight.detach().double(), _magnitude_24(before[name + ".weight"]))


def test_kept_dense_reasons_are_sparsify_s():
    """With nothing left to prune the error lists why each layer stays dense, in sparsify_'s words."""
    class Only(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = SubLinear(64, 64)
            self.wn = weight_norm(nn.Linear(64, 64))

        def forward(self, x):
            return self.wn(self.sub(x))

    torch.manual_seed(0)
    model = Only()
    ref = copy.deepcopy(model)
    before = _state(model)
    with pytest.raises(ValueError, match="no nn.Linear layer selected") as e:
        prune_layerwise_(model, BATCHES, method="magnitude", progress=False)
    rep = sparse24.sparsify_(ref, mode="masked")
    for r in rep.skipped:
        assert f"{r.fqn!r}: {r.reason}" in str(e.value), (r.fqn, r.reason, str(e.value))
    _unchanged(model, before, ["sub", "wn"])


def test_filter_refuses_parametrized():
    model = _net()
    before = _state(model)
    with pytest.raises(ValueError, match=r"'wn'.*parametrized"):
        prune_layerwise_(model, BATCHES, method="magnitude", progress=False,
                         filter_fn=lambda m, fqn: fqn in ("a", "wn"))
    _unchanged(model, before, ["a", "sub", "wn", "attn.proj", "b"])


def test_refuses_computed_weight_of_plain_linear():
    """torch.nn.utils.prune makes .weight a tensor recomputed before every forward: writing it changes nothing."""
    model = _net()
    torch_prune.l1_unstructured(model.b, "weight", 0.25)
    before = _state(model)
    with pytest.raises(ValueError, match=r"'b'.*computed"):
        prune_layerwise_(model, BATCHES, method="magnitude", progress=False)
    _unchanged(model, before, ["a", "b"])


def test_filter_prunes_subclass_in_place():
    model = _net()
    before = _state(model)
    res, warned = _layerwise(model, filter_fn=lambda m, fqn: fqn == "sub")
    assert list(res) == ["sub"] and not warned
    assert torch.equal(model.sub.weight.detach().double(), _magnitude_24(before["sub.weight"]))
    _unchanged(model, before, ["a", "wn", "attn.proj", "b"])


def test_uncalled_layers_warned_once():
    """A layer the model never calls and one its parent reads directly: one warning naming both."""
    model = _net()
    model.unused = nn.Linear(64, 64)
    before = _state(model)
    res, warned = _layerwise(model, filter_fn=lambda m, fqn: fqn in ("a", "attn.proj", "unused", "b"))
    assert set(res) == {"a", "b"}
    assert len(warned) == 1 and "'attn.proj'" in warned[0] and "'unused'" in warned[0], warned
    _unchanged(model, before, ["attn.proj", "unused"])
    # the default choice is warned of alike
    model = _net()
    res, warned = _layerwise(model)
    assert "attn.proj" not in res and len(warned) == 1 and "'attn.proj'" in warned[0], warned


def test_no_selected_layer_called_is_refused():
    model = _net()
    before = _state(model)
    with pytest.raises(ValueError, match=r"'attn.proj'"):
        prune_layerwise_(model, BATCHES, method="magnitude", progress=False,
                         filter_fn=lambda m, fqn: fqn == "attn.proj")
    _unchanged(model, before, ["attn.proj"])


def test_a_head_kept_dense_with_a_computed_weight_does_not_refuse_the_call():
    """sparsify_ keeps the output head dense whatever its weight is; prune_layerwise_ checked for a computed
    weight first and refused the whole call over a layer it never prunes (spectral_norm / prune on a head)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 50))
    torch_prune.l1_unstructured(model[3], "weight", 0.25)
    before = _state(model)
    ids = [torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(2))]
    res = prune_layerwise_(model, ids, method="magnitude", progress=False)
    assert list(res) == ["1"]
    _unchanged(model, before, ["3"])
    torch.testing.assert_close(model[1].weight.detach().double(), _magnitude_24(before["1.weight"]))

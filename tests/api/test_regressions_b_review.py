"""Regressions of the review round's own fixes: element-disjoint strided views of one buffer (q/k/v
unfused from a fused weight without copying) are not tied weights; a loader calling
``_load_from_state_dict`` itself (older transformers, DeepSpeed) keeps the dense checkpoint's dtype on an
assigned INT8 layer; an optimizer step leaves the zero check answered (no rescan of the weight)."""
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import dequantized_reference, top2_mask
from test_serialization_review import Refuses
from torch import nn
from torch.overrides import TorchFunctionMode

import sparse24
from sparse24 import Sparse24Linear
from sparse24.masks.kept_dense import _shared_weights
from sparse24.nn import state
from sparse24.nn.masking import _ZERO_CHECKED
from sparse24.recipes import GradualPruner

D = 16


# --- 1. strided views of one buffer: tied only where they share an element ------------------------------

class Attn(nn.Module):
    """q, k, v Linears whose weights are column blocks of one fused (in, 3 * out) Conv1D-style buffer,
    transposed: views, no copies. ``offsets`` are the blocks' first columns."""

    def __init__(self, fused: torch.Tensor, offsets=(0, D, 2 * D)):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        for lin, o in zip((self.q, self.k, self.v), offsets):
            lin.weight = nn.Parameter(fused[:, o:o + D].t())

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)


def test_interleaved_views_of_one_buffer_are_not_tied_and_are_pruned():
    torch.manual_seed(0)
    model = Attn(torch.randn(D, 3 * D))
    assert _shared_weights(model) == {}
    ref = {n: (model.get_submodule(n).weight.detach().double().clone(), model.get_submodule(n).bias.detach().double().clone())
           for n in "qkv"}
    report = sparse24.sparsify_(model, min_features=1)
    assert [r.fqn for r in report.swapped] == ["q", "k", "v"]
    x = torch.randn(5, D, dtype=torch.float64)
    expected = sum(F.linear(x, torch.where(top2_mask(w), w, 0), b) for w, b in ref.values())
    torch.testing.assert_close(model(x.float()).double(), expected, rtol=1e-5, atol=1e-5)
    GradualPruner(Attn(torch.randn(D, 3 * D)), (2, 4), end_step=10, frequency=1, min_features=0)  # a layer is selected


def test_strided_views_sharing_elements_or_dtypes_stay_tied():
    fused = torch.randn(D, 3 * D)
    model = Attn(fused, offsets=(0, D // 2, 2 * D))  # q and k share half their elements
    shared = _shared_weights(model)
    assert shared == {id(model.q.weight): ["q.weight", "k.weight"], id(model.k.weight): ["q.weight", "k.weight"]}
    # another dtype over the same bytes: elements do not line up, counted as tied (conservative)
    model.v.weight = nn.Parameter(fused.view(torch.bfloat16)[:, 4 * D:5 * D].t())
    model.q.weight = nn.Parameter(fused[:, 2 * D:3 * D].t())
    model.k.weight = nn.Parameter(torch.randn(D, D))
    assert sorted(_shared_weights(model)[id(model.v.weight)]) == ["q.weight", "v.weight"]


# --- 2. a loader calling _load_from_state_dict itself ----------------------------------------------------

def _recursive_load(module: nn.Module, sd: dict, assign: bool) -> list:
    """transformers < 4.50's _load_state_dict_into_model / DeepSpeed's load_module_recursive: no
    load_state_dict frame; every module's _load_from_state_dict called in turn."""
    sd, errors = dict(sd), []

    def load(m, prefix=""):
        m._load_from_state_dict(sd, prefix, {"assign_to_params_buffers": assign}, True, [], [], errors)
        for n, c in m._modules.items():
            if c is not None:
                load(c, prefix + n + ".")
    load(module)
    return errors


def _meta_int8():
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    sparse24.sparsify_(big, mode="compressed", quantize="int8", min_features=1)
    return big


def test_recursive_loader_assigns_a_bias_less_int8_layer_the_checkpoints_dtype():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    ws = [dense[i].weight.detach().double().clone() for i in range(2)]
    big = _meta_int8()
    assert _recursive_load(big, dense.state_dict(), assign=True) == []
    for i in range(2):
        assert big[i].dtype == torch.bfloat16 and big[i].dense_weight().dtype == torch.bfloat16
        deq = dequantized_reference(big[i], top2_mask(ws[i]))  # the stored entries at the magnitude mask
        torch.testing.assert_close(big[i].dense_weight().double(), deq, rtol=1e-2, atol=0)
        assert torch.equal(deq != 0, top2_mask(ws[i]) & (deq != 0))
        assert "_checked_entries" not in big[i].__dict__  # nothing (weak references) kept on the layer
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = big(x)
    assert y.dtype == torch.bfloat16
    ref = x.double()
    for i in range(2):  # the stored INT8 entries, dequantized in float64; bf16 between the layers
        ref = F.linear(ref, dequantized_reference(big[i], top2_mask(ws[i]))).bfloat16().double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)
    pickle.dumps(big)


def test_recursive_loader_refused_part_way_leaves_the_model_picklable(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), Refuses(), nn.Linear(64, 64))
    sparse24.sparsify_(model, min_features=1)
    bad = model.state_dict()
    bad["1._extra_state"] = torch.tensor(1)
    with pytest.raises(ValueError, match="refused"):  # after the whole-model check; 2 never loaded
        _recursive_load(model, bad, assign=False)
    assert all("_checked_entries" not in m.__dict__ for m in model.modules())
    pickle.loads(pickle.dumps(model))
    # a later load takes every layer's entries, each layer checked once (by the whole-model check)
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(64, 64), Refuses(), nn.Linear(64, 64))
    dense = [source[i].weight.detach().double().clone() for i in (0, 2)]
    sparse24.sparsify_(source, min_features=1)
    calls = []
    real = state.check_state
    monkeypatch.setattr(state, "check_state", lambda *a: (calls.append(a[2]), real(*a))[1])
    assert _recursive_load(model, source.state_dict(), assign=False) == []
    assert sorted(calls) == ["0.", "2."]
    for layer, w in zip((model[0], model[2]), dense):
        assert torch.equal(layer.weight.double(), torch.where(top2_mask(w), w, 0))
    pickle.dumps(model)


# --- 3. an optimizer step answers the zero check -----------------------------------------------------------

class _CountWhere(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.where
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_optimizer_step_leaves_no_zero_rescan_for_inference(opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
    sparse24.sparsify_(model, min_features=1, skip_output_head=False)
    layers = [m for m in model if isinstance(m, Sparse24Linear)]
    assert len(layers) == 2
    optim = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) if opt == "sgd"
             else torch.optim.AdamW(model.parameters(), lr=0.1))
    x = torch.randn(4, D)
    for _ in range(2):
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()
    for m in layers:  # the zero check holds the step's version
        seen = _ZERO_CHECKED.get(m)
        assert seen is not None and seen[0]() is m.weight and seen[1] == m.weight._version
    ref = x.double()
    for i, m in enumerate(model):
        ref = torch.relu(ref) if i == 1 else F.linear(ref, torch.where(m.mask, m.weight.double(), 0), m.bias.double())
    with torch.no_grad(), _CountWhere() as count:
        y = model(x)
    assert count.calls == 0  # neither the mask where() nor the zero check's scan
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)

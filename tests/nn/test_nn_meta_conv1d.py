"""Sparse24Linear built without weights (meta device), from Hugging Face's Conv1D, and its masked-mode
inference path, each against the masked dense weight in fp64."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import sparse24
from sparse24 import Sparse24Linear

from conftest import assert_matches_reference, dequantized_reference, top2_mask

MODES = ["masked", "compressed", "int8"]


def kwargs(kind):
    return {"mode": "masked"} if kind == "masked" else {"mode": "compressed", "quantize": "int8" if kind == "int8"
                                                                                  else None}


def dense_reference(layer, w_dense, kind):
    """The weight the layer must compute with: W * top2 mask (dequantized int8 values placed by it)."""
    mask = top2_mask(w_dense)
    return dequantized_reference(layer, mask) if kind == "int8" else w_dense.double() * mask


# --- meta device --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", MODES)
@pytest.mark.parametrize("assign", [True, False], ids=["assign", "copy"])
def test_meta_layer_computes_its_mask_when_weights_arrive(kind, assign, gen):
    R, C = 24, 64
    layer = Sparse24Linear(C, R, device="meta", **kwargs(kind))
    assert layer.pending and all(t.is_meta for t in layer.state_dict().values())
    assert "mask pending (magnitude)" in repr(layer)
    w, b = torch.randn(R, C, generator=gen), torch.randn(R, generator=gen)
    x = torch.randn(5, C, generator=gen)
    layer.load_state_dict({"weight": w.clone(), "bias": b}, assign=True) if assign else \
        layer.to_empty(device="cpu").load_state_dict({"weight": w.clone(), "bias": b})
    assert not layer.pending and not layer._holds_meta()
    layer.validate()
    if kind == "masked":
        assert torch.equal(layer.mask, top2_mask(w))
    assert_matches_reference(layer(x), x, dense_reference(layer, w, kind), b)


def test_meta_layer_refuses_to_run_and_methods_that_need_data(gen):
    layer = Sparse24Linear(64, 32, device="meta", mode="compressed").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="built without weights .* cannot run yet"):
        layer(torch.randn(2, 64))
    with pytest.raises(ValueError, match="the 2:4 mask is pending"):
        layer.validate()
    with torch.device("meta"):
        lin = nn.Linear(64, 32)
    for method, msg in [("wanda", "method='wanda' cannot wait"), ("nope", "unknown mask method 'nope'")]:
        with pytest.raises(ValueError, match=msg):
            Sparse24Linear.from_linear(lin, method=method)
    with pytest.raises(ValueError, match=r"rows \(30\) must be divisible by 4"):
        Sparse24Linear.from_linear(nn.Linear(64, 30, device="meta"), method="2d_greedy")
    layer.load_state_dict({"weight": torch.randn(32, 64, generator=gen), "bias": torch.zeros(32)})
    assert not layer.pending  # and now it runs
    assert layer(torch.randn(2, 64)).shape == (2, 32)


def test_meta_layer_takes_sparse_entries_as_they_are(gen):
    src = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed", quantize="int8")
    layer = Sparse24Linear(64, 32, device="meta", mode="compressed", quantize="int8")
    layer.load_state_dict(src.state_dict())  # copy into meta tensors would be a no-op: they are assigned
    x = torch.randn(3, 64, generator=gen)
    assert not layer.pending and torch.equal(layer(x), src(x))


def test_meta_2d_method_is_applied_when_weights_arrive(gen):
    w = torch.randn(32, 64, generator=gen)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32, device="meta"), method="2d_optimal")
    layer.load_state_dict({"weight": w.clone(), "bias": torch.zeros(32)}, assign=True)
    assert torch.equal(layer.mask, sparse24.mask_nm(w, 2, 4, method="2d_optimal"))


# --- Hugging Face Conv1D -------------------------------------------------------------------

@pytest.mark.parametrize("kind", MODES)
def test_conv1d_is_the_linear_it_is(kind, gen):
    R, C = 40, 64
    conv = Conv1D(R, C)  # y = x @ W + b, W stored (C, R)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(C, R, generator=gen))
        conv.bias.copy_(torch.randn(R, generator=gen))
    w_lin, b = conv.weight.detach().t().clone(), conv.bias.detach().clone()
    layer = Sparse24Linear.from_linear(conv, **kwargs(kind))
    assert (layer.out_features, layer.in_features) == (R, C)
    x = torch.randn(2, 7, C, generator=gen)
    ref = dense_reference(layer, w_lin, kind)
    assert_matches_reference(layer(x), x, ref, b)
    back = layer.to_dense_module()
    assert type(back) is Conv1D and back.weight.shape == (C, R) and back.bias is layer.bias
    torch.testing.assert_close(back(x).double(), F.linear(x.double(), ref, b.double()), rtol=1e-6, atol=1e-5)


def test_conv1d_weight_keeps_requires_grad_and_masks_gradients(gen):
    conv = Conv1D(32, 64)
    layer = Sparse24Linear.from_linear(conv)
    assert layer.weight is not conv.weight and layer.weight.requires_grad
    layer(torch.randn(3, 64, generator=gen)).sum().backward()
    assert bool((layer.weight.grad[~layer.mask] == 0).all())
    frozen = Conv1D(32, 64).requires_grad_(False)
    assert not Sparse24Linear.from_linear(frozen).weight.requires_grad


# --- masked-mode inference ----------------------------------------------------------------

def count_where(monkeypatch):
    calls = []
    real = torch.where
    monkeypatch.setattr(torch, "where", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_masked_inference_skips_the_where_once_checked(monkeypatch, gen):
    lin = nn.Linear(64, 32)
    w0 = lin.weight.detach().clone()
    layer = Sparse24Linear.from_linear(lin)
    x = torch.randn(4, 64, generator=gen)
    ref = F.linear(x.double(), w0.double() * top2_mask(w0), lin.bias.detach().double())
    calls = count_where(monkeypatch)
    with torch.no_grad():
        y1, y2 = layer(x), layer(x)
    assert len(calls) == 1  # the check, once; then the stored weight alone
    torch.testing.assert_close(y1.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(y1, y2)
    y_grad = layer(x)  # with a gradient: where() as before (it also masks the module's own gradient)
    assert len(calls) == 2 and torch.equal(y_grad, y1)


def test_masked_inference_rechecks_after_an_in_place_change(monkeypatch, gen):
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(4, 64, generator=gen)
    with torch.no_grad():
        y = layer(x)
        r, c = (~layer.mask).nonzero()[0].tolist()
        layer.weight[r, c] = 100.0  # a tracked in-place write into a pruned slot
        calls = count_where(monkeypatch)
        assert torch.equal(layer(x), y)  # masked anyway: the check saw the write
        assert len(calls) == 2  # the check and the where(); the weight is not clean, so every call masks
        layer.weight[r, c] = 0.0
        layer(x), layer(x)
        assert len(calls) == 3  # one check after the write finds it clean: the stored weight from then on
    # an optimizer step changes the weight: the post-hook re-zeroes, the next call checks again
    layer.weight.grad = torch.ones_like(layer.weight)
    torch.optim.SGD([layer.weight], lr=0.1).step()
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, torch.where(layer.mask, layer.weight, 0), layer.bias))

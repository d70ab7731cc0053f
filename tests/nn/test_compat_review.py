"""Files and states written by earlier versions of sparse24, read by this one."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    return m


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_an_optimizer_state_of_the_old_parameter_order_is_refused_before_any_change(make):
    """Before 2026-12-05 a Sparse24Linear listed (bias, weight); torch pairs a loaded state by position, so
    each weight got its bias's moments and the step failed in torch after changing other tensors."""
    x = torch.randn(4, 16)
    old = _model()
    old_opt = make([p for layer in (old[0], old[2]) for p in (layer.bias, layer.weight)])   # the old order
    old(x).pow(2).mean().backward()
    old_opt.step()
    model = _model()
    opt = make(model.parameters())
    opt.load_state_dict(old_opt.state_dict())
    model(x).pow(2).mean().backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"state '(exp_avg|momentum_buffer)' of .* has the bias's shape \(16,\)"
                                           r".*before 2026-12-05.*nothing was changed"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the same state in today's order steps
    opt = make(model.parameters())
    opt.load_state_dict(make([p for layer in (old[0], old[2]) for p in (layer.weight, layer.bias)]).state_dict())
    opt.step()


def test_a_bias_shaped_state_of_a_weight_alone_is_no_swap():
    """Adafactor keeps a (R,) row factor of a (R, C) weight, bias-shaped: saved and loaded by this version,
    it steps (the order check refused it)."""
    x = torch.randn(4, 16)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(x).pow(2).mean().backward()
    for layer in (model[0], model[2]):   # what a factored optimizer holds: a row factor, a full-shape bias state
        opt.state[layer.weight]["row"] = torch.zeros(layer.out_features)
        opt.state[layer.bias]["row"] = torch.zeros(layer.out_features)
    opt2 = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    opt2.step()


def _unpickled_as_written_before(layer, change):
    """``layer`` pickled, with its state changed by ``change`` into what an earlier sparse24 pickled."""
    state = dict(layer.__dict__, _parameters=dict(layer._parameters), _buffers=dict(layer._buffers))
    change(state)
    old = Sparse24Linear.__new__(Sparse24Linear)
    old.__setstate__(state)
    return old


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_layer_pickled_before_the_decode_layout_works_whole(quantize):
    """Before 2026-11-30 20:40 a compressed layer had no ``_layout`` nor ``_weight_requires_grad``: it unpickled
    and ran forward, then state_dict / repr / to_masked raised AttributeError."""
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed", quantize=quantize)
    ref = layer.dense_weight().double()
    old = _unpickled_as_written_before(layer, lambda s: [s.pop("_layout"), s.pop("_weight_requires_grad")])
    x = torch.randn(5, 64)
    torch.testing.assert_close(old(x).double(), x.double() @ ref.T + layer.bias.double(), atol=1e-4, rtol=1e-4)
    assert old.state_dict().keys() == layer.state_dict().keys() and "Sparse24Linear" in repr(old)
    torch.testing.assert_close(old.to_masked().weight.double(), ref)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_decode_layout_pickled_without_its_mma_sp_words_is_completed(quantize):
    """Before 2026-12-02 an INT8 / INT4 decode layout's meta held the keep masks alone, (NT, 32, KM); the
    mma.sp words after them are rebuilt from those (forward, state_dict and every conversion failed on the
    meta's shape)."""
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(128, 40), mode="compressed", quantize=quantize).to_layout("decode")
    full = layer.meta.clone()
    km = full.shape[-1] // 2

    def drop_words(state):
        state["_buffers"]["meta"] = full[..., :km].clone()
    old = _unpickled_as_written_before(layer, drop_words)
    assert torch.equal(old.meta, full)
    x = torch.randn(3, 128)
    torch.testing.assert_close(old(x), layer(x), atol=0, rtol=0)
    torch.testing.assert_close(old.to_layout("v1").dense_weight(), layer.dense_weight(), atol=0, rtol=0)

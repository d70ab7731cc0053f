"""Review findings on Sparse24Linear's parity with nn.Linear: a dense weight or mask assigned to a
compressed layer, add_to_kept_ on inference tensors, layers made under torch.inference_mode run
outside it, torch.fx.symbolic_trace, and compressed mode's mixed dtypes (documented, pinned here)."""
import copy
import pickle

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear

from conftest import (assert_matches_reference, assert_unchanged, dequantized_reference, int4_dequantized_reference,
                      state, tolerance, top2_mask)

QUANT = {None: {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4", "group_size": 32}}


def distinct_weight(R, C, dtype=torch.float32, seed=0):
    """(R, C) weight whose groups of 4 hold magnitudes 1..4 (permuted, random signs) / 8: exact in every
    float dtype and without ties, so the 2:4 magnitude mask is unique (top2_mask finds it independently)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.stack([torch.randperm(4, generator=g) + 1 for _ in range(R * C // 4)]).view(R, C).double()
    signs = torch.randint(0, 2, (R, C), generator=g) * 2 - 1
    return (mags * signs / 8).to(dtype)


def dense(R=32, C=64, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(C, R, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(distinct_weight(R, C, dtype, seed))
    return lin


def reference_weight(layer, w, quantize):
    """The fp64 dense weight ``layer`` must compute with: the kept entries of ``w`` (the original dense
    weight), or the stored INT8 / INT4 values dequantized as the format defines them."""
    mask = top2_mask(w)
    if quantize is None:
        return torch.where(mask, w, 0).double()
    return (dequantized_reference if quantize == "int8" else int4_dequantized_reference)(layer, mask)


# -- 3: a dense weight / mask assigned to a compressed layer --

@pytest.mark.parametrize("name", ["weight", "mask"])
def test_assigning_a_dense_weight_or_mask_to_a_compressed_layer_is_refused(name):
    """It was accepted and ignored: forward did not change, and the stray tensor went into the state
    dict, which a compressed layer's strict load then refused."""
    layer = Sparse24Linear.from_linear(dense(), mode="compressed")
    before = state(layer)
    value = nn.Parameter(torch.zeros(32, 64)) if name == "weight" else torch.ones(32, 64, dtype=torch.bool)
    with pytest.raises(AttributeError, match=rf"compressed mode has no dense '{name}' to set.*to_masked\(\)"):
        setattr(layer, name, value)
    assert_unchanged(layer, before)
    assert name not in layer.__dict__ and name not in layer._parameters and name not in layer._buffers


def test_mode_switches_copies_and_loads_still_set_the_weight():
    """What sets ``weight`` / ``values`` legitimately keeps working (each result against the fp64 reference)."""
    lin = dense()
    w = lin.weight.detach().clone()
    ref = torch.where(top2_mask(w), w, 0).double()
    x = torch.randn(3, 64)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed")
    layer.to_masked()
    layer.weight = nn.Parameter(layer.weight.detach().clone())   # masked mode: a new weight is fine
    assert_matches_reference(layer(x), x, ref, lin.bias)
    layer.to_compressed().to_masked().to_compressed()
    for c in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert_matches_reference(c(x), x, ref, lin.bias)
    layer.load_state_dict(copy.deepcopy(layer.state_dict()), assign=True)
    assert_matches_reference(layer(x), x, ref, lin.bias)
    model = nn.Sequential(copy.deepcopy(lin), nn.ReLU(), copy.deepcopy(lin))
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False)
    sparse24.decompress_(model)
    sparse24.compress_(model)
    sparse24.densify_(model)
    assert type(model[0]) is nn.Linear
    torch.testing.assert_close(model[0].weight.double(), ref, rtol=0, atol=0)


# -- 4: add_to_kept_ on inference tensors --

@pytest.mark.filterwarnings("ignore:INT4 merge onto the layer's own grid")
@pytest.mark.parametrize("mode, quantize, layout", [("masked", None, None), ("compressed", None, "v1"),
                                                    ("compressed", "int8", "v1"), ("compressed", "int8", "decode"),
                                                    ("compressed", "int4", "v1")])
def test_add_to_kept_on_inference_tensors_outside_inference_mode_changes_nothing(mode, quantize, layout):
    """torch raised 'Inplace update to inference tensor outside InferenceMode' after writing some tensors
    (INT8: new values, old scale; the decode layout left in v1). Refused up front now; under
    torch.inference_mode the same merge runs, and adds delta at the kept positions."""
    with torch.inference_mode():
        layer = Sparse24Linear.from_linear(dense(), mode=mode, **QUANT[quantize])
    if layout == "decode":
        layer.to_layout("decode")
    before, w0 = state(layer), layer.dense_weight().double()
    delta = torch.randn(32, 64) / 64
    with pytest.raises(RuntimeError, match=r"inference tensors.*torch\.inference_mode.*nothing was changed"):
        layer.add_to_kept_(delta)
    assert_unchanged(layer, before)
    assert layer.layout == layout if mode == "compressed" else layer.mode == "masked"
    with torch.inference_mode():
        layer.add_to_kept_(delta)
    expected = torch.where(w0 != 0, w0 + delta.double(), 0)
    step = {None: 0, "int8": 2 * float(w0.abs().max()) / 127, "int4": 1}[quantize]   # (INT4: its own grid)
    torch.testing.assert_close(layer.dense_weight().double(), expected, rtol=1e-6, atol=step)


# -- 5: layers compressed or built under torch.inference_mode, run outside it --

@pytest.mark.parametrize("quantize", list(QUANT))
def test_compressed_under_inference_mode_runs_outside_it_with_a_trainable_bias(quantize):
    """The op saved the weight's (inference) tensors for backward even when only the bias needs a
    gradient: 'Inference tensors cannot be saved for backward', where nn.Linear runs."""
    lin = dense()
    w = lin.weight.detach().clone()
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin))
    with torch.inference_mode():
        layer.to_compressed(**QUANT[quantize])
    assert layer.values.is_inference() and layer.bias.requires_grad
    x = torch.randn(2, 3, 64)
    y = layer(x)
    assert_matches_reference(y, x, reference_weight(layer, w, quantize), lin.bias)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(layer.bias.grad.double(), g.double().sum((0, 1)), **tolerance(torch.float32, 6))


def test_op_gradients_with_the_weight_saved_only_when_needed():
    """The bias alone saves no weight tensor; x's gradient still gets the weight (fp64 reference)."""
    lin = dense(dtype=torch.float64)
    w = torch.where(top2_mask(lin.weight), lin.weight, 0).detach()
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed")
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 32, dtype=torch.float64)
    layer(x).backward(g)
    torch.testing.assert_close(x.grad, g @ w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, g.sum(0), rtol=1e-12, atol=1e-12)


def test_masked_layer_built_under_inference_mode_runs_outside_it():
    """where(mask, w, 0) saved the (inference) mask for backward: the layer raised where nn.Linear runs."""
    lin = dense()
    w = lin.weight.detach().clone()
    with torch.inference_mode():
        layer = Sparse24Linear.from_linear(copy.deepcopy(lin))
    assert layer.mask.is_inference() and layer.weight.requires_grad
    x = torch.randn(4, 64)
    assert_matches_reference(layer(x), x, torch.where(top2_mask(w), w, 0), lin.bias)


# -- 6: torch.fx.symbolic_trace --

@pytest.mark.parametrize("mode, quantize, layout, dtype", [
    ("masked", None, None, torch.float64), ("compressed", None, "v1", torch.float64),
    ("compressed", None, "decode", torch.float16), ("compressed", "int8", "v1", torch.float32),
    ("compressed", "int4", "decode", torch.float32)])
def test_fx_symbolic_trace_of_a_sparsified_model(mode, quantize, layout, dtype):
    """symbolic_trace failed on every Sparse24Linear (masked: control flow on w.requires_grad; compressed:
    'input must be a torch.Tensor, got Proxy'), so create_feature_extractor and FX tooling did too."""
    lins = [dense(64, 64, dtype, seed=0), dense(32, 64, dtype, seed=1)]
    refs = [lin.weight.detach().clone() for lin in lins]
    model = nn.Sequential(copy.deepcopy(lins[0]), nn.ReLU(), copy.deepcopy(lins[1]))
    sparse24.sparsify_(model, mode=mode, skip_output_head=False, **QUANT[quantize])
    x = torch.randn(3, 64, dtype=dtype)
    ref = x.double()
    for i, lin, w in ((0, lins[0], refs[0]), (2, lins[1], refs[1])):   # (from layout v1's tensors)
        ref = F.linear(ref, reference_weight(model[i], w, quantize), lin.bias.double())
        ref = torch.relu(ref) if i == 0 else ref
    if layout == "decode":
        for i in (0, 2):
            model[i].to_layout("decode")
    gm = torch.fx.symbolic_trace(model)
    y = gm(x)
    # (float16: the hidden layer's rounding, 2**-11 relative, passes through the second layer)
    tol = dict(rtol=4e-3, atol=4e-3) if dtype == torch.float16 else tolerance(dtype, 64 * 2)
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    if mode == "masked":   # the traced graph masks: a write at a pruned position changes nothing
        with torch.no_grad():
            model[0].weight.masked_fill_(~model[0].mask, 100.0)
        torch.testing.assert_close(gm(x), y, rtol=0, atol=0)



def test_fx_symbolic_trace_of_a_bare_layer_traces_or_says_why():
    x = torch.randn(3, 64, dtype=torch.float64)
    masked = Sparse24Linear.from_linear(dense(32, 64, torch.float64))
    torch.testing.assert_close(torch.fx.symbolic_trace(masked)(x), masked(x), rtol=0, atol=0)
    compressed = Sparse24Linear.from_linear(dense(32, 64, torch.float64), mode="compressed")
    # (torch's own error came after the trace: "cannot assign 'dict' as buffer 'meta'")
    with pytest.raises(TypeError, match="trace a module holding it"):
        torch.fx.symbolic_trace(compressed)

# -- 7: compressed mode's mixed dtypes (documented: Sparse24Linear.forward, docs/modules.md) --

def test_compressed_mode_casts_an_x_of_another_dtype_where_masked_mode_raises():
    lin = dense()
    w = torch.where(top2_mask(lin.weight), lin.weight, 0).detach()
    x = torch.randn(3, 64, dtype=torch.float64)
    masked = Sparse24Linear.from_linear(copy.deepcopy(lin))
    with pytest.raises(RuntimeError, match="dtype"):
        masked(x)
    y = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed")(x)
    assert y.dtype == torch.float64
    assert_matches_reference(y, x, w, lin.bias)
    assert "x's dtype" in Sparse24Linear.forward.__doc__

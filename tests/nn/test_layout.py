"""A compressed Sparse24Linear in the decode layout (what it holds on CUDA, asked for here with
to_layout("decode") since CI has no GPU): the same outputs, state dicts always in layout v1,
moves and casts that keep the layout right, the decode kernel through the module (interpreter),
and torch.compile / export seeing the op with the decode tensors."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24.ops.linear24 import op

from conftest import assert_matches_reference, dequantized_reference, top2_mask


def _layer(gen, quantize=None, bias=True, dtype=torch.float16, R=72, C=200):
    lin = nn.Linear(C, R, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(R, C, generator=gen))
    lin = lin.to(dtype)
    extra = {"group_size": 64, "symmetric": False} if quantize == "int4" else {}  # zero points and 4 groups
    return Sparse24Linear.from_linear(lin, mode="compressed", quantize=quantize, **extra)


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_decode_layout_keeps_outputs_and_state_dict(quantize, gen):
    layer = _layer(gen, quantize)
    dense = layer.dense_weight()
    v1_state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(5, 200, generator=gen).half()
    with torch.no_grad():
        y_v1 = layer(x)
        assert layer.layout == "v1" and layer.to_layout("decode") is layer and layer.layout == "decode"
        assert layer.values.dim() > 2 and "layout=decode" in repr(layer)
        assert torch.equal(layer(x), y_v1)                      # reference backend on CPU: the same numbers
    assert _same_state(layer.state_dict(), v1_state)            # checkpoints hold layout v1
    assert torch.equal(layer.dense_weight(), dense)             # re-ordered back exactly (INT4: zero points too)
    fresh = _layer(torch.Generator().manual_seed(99), quantize)  # other weights, layout v1
    fresh.load_state_dict(layer.state_dict())
    assert _same_state(fresh.state_dict(), v1_state)
    layer.load_state_dict(v1_state)                             # a v1 checkpoint into a decode-layout layer
    assert layer.layout == "decode" and _same_state(layer.state_dict(), v1_state)
    assert torch.equal(layer.sparse_tensor().values, fresh.sparse_tensor().values)
    layer.to_layout("v1")
    assert layer.layout == "v1" and _same_state(layer.state_dict(), v1_state)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_decode_kernel_runs_through_the_module(quantize, monkeypatch, gen):
    """The module's steady path with the kernel (as on CUDA), here in Triton's interpreter, vs fp64."""
    monkeypatch.setattr(op, "_auto_backend", lambda *a: "triton")
    layer = _layer(gen, quantize).to_layout("decode")
    mask = top2_mask(layer.dense_weight() if quantize is None else layer.sparse_tensor().to_dense())
    dense = dequantized_reference(layer.to_layout("v1"), mask) if quantize else layer.dense_weight().double()
    layer.to_layout("decode")
    for M in (1, 13, 20):  # 20 rows: two programs of 16
        x = torch.randn(M, 200, generator=gen).half()
        with torch.no_grad():
            assert_matches_reference(layer(x), x, dense, layer.bias)


def test_casts_and_moves_keep_the_layout_right(gen):
    layer = _layer(gen).to_layout("decode")
    ref = layer.dense_weight()
    layer.float()                   # fp32 values: the decode layout holds 16-bit or INT8 ones
    assert layer.layout == "v1" and layer.values.dtype == torch.float32
    layer.half()
    assert layer.layout == "decode"  # the layer asked for it and can hold it again
    assert torch.equal(layer.dense_weight(), ref)
    layer.to("cpu")
    assert layer.layout == "decode"
    twin = copy.deepcopy(layer)
    assert twin.layout == "decode" and torch.equal(twin.dense_weight(), ref)
    layer.to_layout("auto")         # the default: the decode layout on CUDA only
    assert layer.layout == "v1"


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_decode_layout_survives_dtype_casts(quantize, gen):
    """Casting a quantized decode-layout layer (model.to(torch.bfloat16), .half()) converts it to
    layout v1, casts, and settles back; the integer tensors it keeps across the cast are taken
    in layout v1 (the decode layout's INT8 values are uint8 where layout v1's are int8: before,
    the decode-layout tensor came back into the v1 slot and the cast raised)."""
    layer = _layer(gen, quantize)
    stored = {k: v.clone() for k, v in layer.state_dict().items() if k != "bias"}   # codes, meta, scales
    layer.to_layout("decode")
    for cast, dtype in ((lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half(), torch.float16),
                        (lambda m: m.to("cpu", torch.float32), torch.float32)):
        cast(layer)
        assert layer.layout == "decode" and layer.values.dim() > 2 and layer.bias.dtype == dtype
        assert _same_state({k: v for k, v in layer.state_dict().items() if k != "bias"}, stored)   # nothing rounded
        layer.to_layout("decode")


def test_trainable_values_stay_in_layout_v1(gen):
    layer = _layer(gen).to_layout("decode")
    layer.to_compressed(trainable_values=True)
    assert layer.layout == "v1" and layer.values.requires_grad
    with pytest.raises(ValueError, match="that do not train"):
        layer.to_layout("decode")
    assert layer.layout == "v1"
    layer.to_compressed(trainable_values=False)
    assert layer.layout == "decode"  # its request stands once the values are frozen again


def test_to_layout_rejects_what_it_cannot_do(gen):
    fp32 = _layer(gen, dtype=torch.float32)
    with pytest.raises(ValueError, match="float16, bfloat16, INT8 or INT4 values"):
        fp32.to_layout("decode")
    assert fp32.layout == "v1"
    with pytest.raises(ValueError, match="layout must be 'v1', 'decode' or 'auto'"):
        fp32.to_layout("v2")
    masked = Sparse24Linear.from_linear(nn.Linear(64, 32))
    with pytest.raises(ValueError, match="only compressed mode has a layout"):
        masked.to_layout("decode")
    assert masked.layout is None


def test_int8_minus_128_is_refused_at_load_and_a_failed_layout_change_changes_nothing(gen):
    # symmetric INT8 holds -127..127; the decode layout (sign-magnitude bytes) cannot hold -128, so a
    # checkpoint holding it must be refused where it is loaded, not on the layer's first move to CUDA
    layer = _layer(gen, "int8")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = {**state, "values": state["values"].clone()}
    bad["values"][3, 5] = -128
    with pytest.raises(RuntimeError, match="-128 is outside the format's range"):
        layer.load_state_dict(bad)
    assert _same_state(layer.state_dict(), state)
    # written in place past every check: the refused conversion leaves the layer as it was
    with torch.no_grad():
        layer.values[3, 5] = -128
    with pytest.raises(ValueError, match="-128"):
        layer.to_layout("decode")
    assert layer.layout == "v1" and layer.__dict__.get("_layout_pref") is None
    assert layer.float().dtype == torch.float32  # later moves and casts are not stuck on the refused layout


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_assign_loading_makes_the_compressed_tensors_contiguous(quantize, gen):
    layer = _layer(gen, quantize)
    dense = layer.dense_weight()
    state = {k: (v.t().contiguous().t() if v.dim() == 2 else v.clone()) for k, v in layer.state_dict().items()}
    assert not all(v.is_contiguous() for v in state.values())
    layer.load_state_dict(state, assign=True)
    assert all(t.is_contiguous() for t in (layer.values, layer.meta, layer.scale) if t is not None)
    assert layer.to_layout("decode").layout == "decode" and torch.equal(layer.dense_weight(), dense)
    assert not layer.values.requires_grad


@pytest.mark.parametrize("kind", ["masked", None, "int8", "int4"])
def test_add_to_kept_refuses_a_non_finite_delta(kind, gen):
    # INT4 rounded NaN to its lowest grid point, silently (a diverged LoRA adapter merged)
    layer = _layer(gen, None if kind == "masked" else kind)
    if kind == "masked":
        layer.to_masked()
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    for bad in (float("nan"), float("inf")):
        delta = torch.zeros(72, 200)
        delta[1, :8] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            layer.add_to_kept_(delta)
        assert _same_state(layer.state_dict(), state)


def test_add_to_kept_and_mode_switches_from_the_decode_layout(gen):
    layer = _layer(gen).to_layout("decode")
    before = layer.dense_weight()
    delta = torch.randn(72, 200, generator=gen)
    layer.add_to_kept_(delta)
    assert layer.layout == "decode"
    mask = before != 0
    assert torch.equal(layer.dense_weight(), torch.where(mask, before + delta.half(), 0))
    dense_now = layer.dense_weight()
    layer.to_masked()
    assert layer.layout is None and torch.equal(layer.dense_weight(), dense_now)


def test_compile_and_export_see_the_op_with_decode_tensors(gen):
    net = nn.Sequential(_layer(gen, R=64, C=128), nn.ReLU(), _layer(gen, "int8", R=32, C=64))
    for m in net:
        if isinstance(m, Sparse24Linear):
            m.to_layout("decode")
    x = torch.randn(3, 128, generator=gen).half()
    with torch.no_grad():
        ref = net(x)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(net)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), ref, rtol=0, atol=0)
    ep = torch.export.export(net, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sparse24.linear.default) == 2
    torch.testing.assert_close(ep.module()(x), ref, rtol=0, atol=0)


def test_add_to_kept_keeps_a_layout_v1_layer_and_its_values_parameter():
    """A frozen float16 layer held in layout v1 where it wants the decode layout (trained a while, frozen for
    a LoRA merge): add_to_kept_ re-packed it into a new values Parameter, and the optimizer built on the old
    one trained nothing once the values were unfrozen again."""
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32).half(), mode="compressed").to_layout("decode")
    x = torch.randn(4, 64, dtype=torch.float16)
    layer.values.requires_grad_(True)
    layer(x).float().sum().backward()             # forward settles layout v1 in the same Parameter
    values = layer.values
    opt = torch.optim.SGD([values], lr=1.0)
    values.requires_grad_(False)
    delta = torch.randn(32, 64) * 0.01
    want = layer.dense_weight().double() + torch.where(layer.dense_weight() != 0, delta.half().double(), 0)
    layer.add_to_kept_(delta)
    assert layer.layout == "v1" and layer.values is values
    torch.testing.assert_close(layer.dense_weight().double(), want, atol=1e-3, rtol=1e-3)
    values.requires_grad_(True)
    opt.zero_grad()
    layer(x).float().sum().backward()
    before = layer.dense_weight().clone()
    opt.step()
    assert not torch.equal(layer.dense_weight(), before)   # the optimizer reaches the layer

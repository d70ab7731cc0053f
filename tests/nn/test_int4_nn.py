"""Sparse24Linear with INT4 weights (quantize="int4"): forward and backward against the dense
fp64 weight computed from the stored codes and scales as the format defines them, dtype moves,
mode switches, and state dicts (self-describing group size, mismatched and corrupt entries)."""
import copy
import io

import pytest
import torch
from torch import nn

from sparse24 import Sparse24Linear, sparsify_

from conftest import (assert_export_keeps_op_and_buffers, assert_matches_reference, int4_dequantized_reference,
                      top2_mask)

GROUPS = [32, 64, 128]


def make_linear(K, N, dtype, gen):
    lin = nn.Linear(K, N, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * torch.logspace(-2, 1, K))  # groups of different scale
        lin.bias.copy_(torch.randn(N, generator=gen))
    return lin


def layer_state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_forward_backward(dtype, group_size, symmetric, gen):
    lin = make_linear(96, 24, dtype, gen)  # 96 columns: the last group is short at 64 and 128
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    mask = top2_mask(w0)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=group_size,
                                       symmetric=symmetric)
    assert layer.quantize == "int4" and layer.symmetric is symmetric and layer.dtype == dtype
    assert layer.values.dtype == torch.uint8 and layer.values.shape == (24, 24)
    assert layer.scale.dtype == torch.float16 and layer.scale.shape == (24, -(-96 // group_size))
    assert (layer.zero is None) is symmetric and int(layer.group_size) == group_size
    assert f"quantize=int4, group_size={group_size}, symmetric={symmetric}" in repr(layer)
    ref_w = int4_dequantized_reference(layer, mask)
    # (u - zero) * scale is exact in fp32, so the dequantized weight is the reference rounded once
    assert torch.equal(layer.dense_weight(), ref_w.to(dtype))
    # round to nearest: each kept weight within half its group's step of the original
    step = layer.scale.double().repeat_interleave(group_size, 1)[:, :96]
    assert bool(((ref_w - (w0 * mask).double()).abs()[mask] <= step[mask] * 0.5 * (1 + 2 ** -10)).all())
    x = torch.randn(3, 5, 96, generator=gen).to(dtype).requires_grad_()
    y = layer(x)
    assert y.dtype == dtype
    assert_matches_reference(y, x.detach(), ref_w.to(dtype), b0)
    gy = torch.randn(3, 5, 24, generator=gen).to(dtype)
    y.backward(gy)
    assert_matches_reference(x.grad, gy, ref_w.to(dtype).t())  # grad_x = gy @ W: a linear with W^T


def test_int4_dtype_moves_keep_codes_scales_and_zero_points(gen):
    layer = Sparse24Linear.from_linear(make_linear(64, 16, torch.float32, gen), mode="compressed", quantize="int4",
                                       group_size=32, symmetric=False)
    before = layer_state(layer)
    w = layer.dense_weight()
    for move, dtype in ((nn.Module.half, torch.float16), (nn.Module.float, torch.float32),
                        (nn.Module.bfloat16, torch.bfloat16), (nn.Module.double, torch.float64)):
        move(layer)
        assert layer.dtype == dtype and layer.scale.dtype == torch.float16 and layer.zero.dtype == torch.uint8
        after = layer_state(layer)
        assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype
                   for k in ("values", "meta", "scale", "zero", "group_size"))
        assert torch.equal(layer.dense_weight(), w.to(dtype))


def test_int4_mode_switches(gen):
    lin = make_linear(128, 16, torch.float16, gen)
    layer = Sparse24Linear.from_linear(lin)
    x = torch.randn(4, 128, generator=gen).half()
    layer.to_compressed(quantize="int4", group_size=64)
    y = layer(x)
    ref_w = int4_dequantized_reference(layer, top2_mask(lin.weight.detach()))
    assert_matches_reference(y, x, ref_w.half(), layer.bias.detach())
    before = layer_state(layer)
    for kwargs in ({"quantize": "int4"}, {"quantize": "int4", "group_size": 64, "symmetric": False},
                   {"quantize": "int8"}):
        with pytest.raises(ValueError, match="already compressed with quantize=int4, group_size=64, symmetric=True; "
                                             "call to_masked"):
            layer.to_compressed(**kwargs)
    assert same_state(before, layer_state(layer))
    layer.to_compressed(quantize="int4", group_size=64)  # the same setting: a no-op
    assert same_state(before, layer_state(layer))
    with pytest.raises(ValueError, match="trainable_values needs mode='compressed' with floating values"):
        layer.to_compressed(quantize="int4", group_size=64, trainable_values=True)
    assert torch.equal(layer.to_masked()(x), y)  # masked mode holds the dequantized weight: same outputs
    assert torch.equal(layer.weight.detach().double(), ref_w.half().double())


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_state_dict_round_trip(symmetric, gen):
    src = Sparse24Linear.from_linear(make_linear(96, 32, torch.float16, gen), mode="compressed", quantize="int4",
                                     group_size=64, symmetric=symmetric)
    x = torch.randn(5, 96, generator=gen).half()
    y = src(x)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(sd) == {"values", "meta", "scale", "group_size", "bias"} | (set() if symmetric else {"zero"})
    assert all(type(v) is torch.Tensor for v in sd.values())  # plain tensors: safetensors-compatible
    assert sd["group_size"].dtype == torch.int32 and sd["group_size"].shape == () and int(sd["group_size"]) == 64
    fresh = Sparse24Linear(96, 32, mode="compressed", quantize="int4", group_size=64, symmetric=symmetric,
                           dtype=torch.float16)
    assert not torch.equal(fresh(x), y)
    fresh.load_state_dict(sd)
    assert same_state(layer_state(fresh), layer_state(src)) and torch.equal(fresh(x), y)
    clone = copy.deepcopy(src)
    assert torch.equal(clone(x), y) and clone.symmetric is symmetric
    # a meta-device layer takes a dense checkpoint: the INT4 entries are computed when it arrives
    dense = make_linear(96, 32, torch.float16, gen)
    pending = Sparse24Linear(96, 32, mode="compressed", quantize="int4", group_size=64, symmetric=symmetric,
                             device="meta", dtype=torch.float16)
    pending.load_state_dict(dense.state_dict(), assign=True)
    built = Sparse24Linear.from_linear(dense, mode="compressed", quantize="int4", group_size=64, symmetric=symmetric)
    assert not pending.pending and same_state(layer_state(pending), layer_state(built))


def test_int4_checkpoint_names_its_group_size(gen):
    # 64 columns: group sizes 64 and 128 give the same (R, 1) scales, only the entry tells them apart
    src = Sparse24Linear.from_linear(make_linear(64, 16, torch.float32, gen), mode="compressed", quantize="int4",
                                     group_size=64)
    other = Sparse24Linear(64, 16, mode="compressed", quantize="int4", group_size=128)
    before = layer_state(other)
    assert other.scale.shape == src.scale.shape
    with pytest.raises(RuntimeError, match="the checkpoint's INT4 group size is 64, this layer's is 128; build the "
                                           "model with group_size=64"):
        other.load_state_dict(src.state_dict())
    assert same_state(before, layer_state(other))


def test_int4_mismatched_and_corrupt_checkpoints(gen):
    lin = make_linear(64, 16, torch.float32, gen)
    sym = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=32)
    asym = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=32, symmetric=False)
    int8 = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int8")
    plain = Sparse24Linear.from_linear(lin, mode="compressed")
    masked = Sparse24Linear.from_linear(lin)
    sd, sda = sym.state_dict(), asym.state_dict()
    zero = sda["zero"].clone()
    zero[2, 1] = 16
    cases = [(int8, sd, r"got an INT4 checkpoint \(group_size \+ scale \+ values\) for an INT8 layer; build the "
                        r"model with quantize='int4' and its group_size"),
             (plain, sd, "got an INT4 checkpoint .* for an unquantized layer"),
             (masked, sd, "got a compressed checkpoint"),
             (sym, int8.state_dict(), r"got an INT8 checkpoint \(scale \+ values\) for an INT4 layer; build the "
                                      "model with quantize='int8'"),
             (sym, plain.state_dict(), "this layer is INT4-quantized but the checkpoint has no scale"),
             (sym, sda, "got an asymmetric INT4 checkpoint .* build it with symmetric=False"),
             (asym, sd, "got a symmetric INT4 checkpoint .* build it with symmetric=True"),
             (asym, {**sda, "zero": zero}, r"corrupt INT4 zero points at row 2, group 1: 16 is not in 0..15"),
             (asym, {**sda, "zero": sda["zero"].int()}, "INT4 zero points must be uint8"),
             (sym, {**sd, "group_size": torch.tensor([32])}, "'group_size' must be a 0-d int32 tensor"),
             (sym, {**sd, "group_size": torch.tensor(32.0)}, "'group_size' must be a 0-d int32 tensor"),
             (sym, {**sd, "scale": sd["scale"].float()}, "INT4 scale must be float16"),
             (sym, {**sd, "scale": sd["scale"][:, :1]}, r"INT4 scale must be float16 of shape \(16, 2\)"),
             (sym, {**sd, "values": sd["values"].to(torch.int8)}, "INT4 values must be uint8"),
             # fuzzing found it (scripts/fuzz.py): float8 values failed in torch.isfinite, an unclear error
             (sym, {**sd, "values": sd["values"].view(torch.float8_e4m3fn)}, "INT4 values must be uint8"),
             (sym, {**sd, "values": sd["values"][:, :8]}, r"values must have shape \(16, 16\)")]
    for bad_scale, msg in ((float("inf"), "non-finite"), (float("nan"), "non-finite"),
                           (0.0, r"corrupt INT4 scales: 'scale'\[3, 1\] is 0.0, not positive"),
                           (-0.5, "not positive")):
        scale = sd["scale"].clone()
        scale[3, 1] = bad_scale
        cases.append((sym, {**sd, "scale": scale}, msg))
    for layer, bad, msg in cases:
        before = layer_state(layer)
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(bad)
        assert same_state(before, layer_state(layer))
    # an entry left out: the rest describes another kind of checkpoint (strict), or is part of this
    # kind's entries (non-strict: a shard boundary may fall anywhere), taken only where it fits the
    # layer's own other entries
    for layer, bad, msg in ((sym, {k: v for k, v in sd.items() if k != "group_size"}, "got an INT8 checkpoint"),
                            (asym, {k: v for k, v in sda.items() if k != "zero"}, "got a symmetric INT4 checkpoint")):
        before = layer_state(layer)
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(bad)
        assert same_state(before, layer_state(layer))
        assert layer.load_state_dict(bad, strict=False).missing_keys == [k for k in layer.state_dict() if k not in bad]
        assert same_state(before, layer_state(layer))    # (its own entries again)
    before = layer_state(sym)
    with pytest.raises(RuntimeError, match=r"not a valid 2:4 layer \(.*\(if these are all "
                                           r"the entries: got an INT8 checkpoint"):
        sym.load_state_dict({k: v for k, v in int8.state_dict().items() if k != "bias"}, strict=False)
    assert same_state(before, layer_state(sym))


# --- torch.compile / torch.export -------------------------------------------------------------

def _int4_model(gen, symmetric):
    """Three INT4 compressed layers (one without bias; 96 and 32 input columns: short groups)."""
    layers = [nn.Linear(64, 96), nn.Linear(96, 32, bias=False), nn.Linear(32, 40)]
    with torch.no_grad():
        for lin in layers:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
    net = nn.Sequential(layers[0], nn.GELU(), layers[1], nn.ReLU(), layers[2])
    sparsify_(net, mode="compressed", quantize="int4", group_size=64, symmetric=symmetric)
    assert [m.quantize for m in net.modules() if isinstance(m, Sparse24Linear)] == ["int4"] * 3
    return net


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_compile_fullgraph_without_graph_breaks(symmetric, gen):
    net = _int4_model(gen, symmetric)
    x = torch.randn(2, 7, 64, generator=gen, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(net)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ours = (torch.ops.sparse24.linear, torch.ops.sparse24.linear.default)
    assert sum(n.op == "call_function" and n.target in ours for g in explained.graphs for n in g.graph.nodes) == 3
    ref = net(x)
    (gref,) = torch.autograd.grad(ref.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(g, gref, rtol=1e-6, atol=1e-6)


def test_int4_export_keeps_codes_scales_and_zero_points(gen):
    net = _int4_model(gen, symmetric=False)
    x = torch.randn(3, 64, generator=gen)
    state = assert_export_keeps_op_and_buffers(net, x, (0, 2, 4), ("values", "meta", "scale", "zero", "group_size"))
    assert all(state[f"{i}.values"].dtype == torch.uint8 and state[f"{i}.scale"].dtype == torch.float16
               for i in (0, 2, 4))


def test_int4_bf16_layer_reads_its_scales_as_bf16_in_the_decode_layout(gen, monkeypatch):
    """A bfloat16 layer's INT4 scales are exact in bfloat16 (format.bf16_exact_scales), so in the
    decode layout it also keeps them as bfloat16 and passes those with bfloat16 x (the kernels
    then scale a register pair in one fma fewer); float16 scales of 11 bits (a layer quantized in
    another dtype, then cast) stay float16. Outputs, state dicts and the float16 scale buffer do
    not change; a replaced scale buffer is never paired with the old copy."""
    from sparse24.nn import linear as nn_linear
    seen, forward = [], nn_linear.linear24.forward

    def spy(x, values, meta, scale, *args, **kwargs):
        seen.append(scale.dtype)
        return forward(x, values, meta, scale, *args, **kwargs)

    monkeypatch.setattr(nn_linear.linear24, "forward", spy)
    lin = make_linear(96, 24, torch.bfloat16, gen)
    mask = top2_mask(lin.weight.detach())
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=32, symmetric=False)
    state = layer_state(layer)
    ref_w = int4_dequantized_reference(layer, mask).to(torch.bfloat16)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    y_v1 = layer(x)
    layer.to_layout("decode")
    scale, _, copy_, _ = layer._scale_bf16
    assert scale is layer.scale and copy_.dtype == torch.bfloat16 and torch.equal(copy_.half(), layer.scale)
    y = layer(x)
    assert seen == [torch.float16, torch.bfloat16] and torch.equal(y, y_v1)
    assert_matches_reference(y, x, ref_w, layer.bias.detach())
    # torch.compile reads the float16 scales (a graph cannot check the copy's version), without a
    # graph break, to the same outputs
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), y)
    assert seen[-1] == torch.float16
    layer(x.half())   # other x dtypes read the float16 scales
    assert seen[-1] == torch.float16 and same_state(layer_state(layer), state)
    with torch.no_grad():
        layer.scale.mul_(2)   # changed in place: the copy is stale, float16 is read (and is right)
    assert_matches_reference(layer(x), x, (2 * ref_w.double()).to(torch.bfloat16), layer.bias.detach())
    assert seen[-1] == torch.float16
    layer.scale = layer.scale.clone()   # a new buffer: the copy no longer belongs to it
    layer(x)
    assert seen[-1] == torch.float16
    layer.to_layout("v1")
    assert layer._scale_bf16 is None
    # new data set through .data (torch's version counter does not move): the copy's storage is gone
    layer.to_layout("decode")
    layer(x)
    assert seen[-1] == torch.bfloat16
    with torch.no_grad():
        layer.scale.data = layer.scale * 2
    assert_matches_reference(layer(x), x, (4 * ref_w.double()).to(torch.bfloat16), layer.bias.detach())
    assert seen[-1] == torch.float16
    # built under inference_mode (a loader's usual context): an inference tensor counts no versions,
    # so an in-place change could not be seen: no copy, float16 is read and follows the change
    with torch.inference_mode():
        inf = Sparse24Linear.from_linear(make_linear(96, 24, torch.bfloat16, gen), mode="compressed",
                                         quantize="int4", group_size=32).to_layout("decode")
        assert inf._scale_bf16 is None
        y0 = inf(x).double() - inf.bias.double()
        inf.scale.mul_(2)
        y1 = inf(x).double() - inf.bias.double()
    assert seen[-1] == torch.float16 and torch.allclose(y1, 2 * y0, rtol=2 ** -7, atol=1e-3)
    # quantized in float32 and then cast: 11-bit scales, no bfloat16 copy
    f32 = Sparse24Linear.from_linear(make_linear(96, 24, torch.float32, gen), mode="compressed", quantize="int4",
                                     group_size=32).bfloat16().to_layout("decode")
    assert not torch.equal(f32.scale.bfloat16().half(), f32.scale) and f32._scale_bf16 is None
    f32(x)
    assert seen[-1] == torch.float16

"""Sparse24Linear against the masked dense weight through F.linear in fp64."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24.ops.linear24 import naive as linear_mod

from conftest import assert_matches_reference, dequantized_reference, tolerance, top2_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["masked", "compressed"]


def make_linear(K, N, bias, dtype, gen):
    lin = nn.Linear(K, N, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(N, generator=gen))
    return lin


def layer_state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- forward / backward -----------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(13,), (2, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_forward_backward_match_masked_dense(mode, dtype, lead, bias, gen):
    N, K = 24, 64
    lin = make_linear(K, N, bias, dtype, gen)
    w0, b0 = lin.weight.detach().clone(), None if not bias else lin.bias.detach().clone()
    mask = top2_mask(w0)
    layer = Sparse24Linear.from_linear(lin, mode=mode, trainable_values=(mode == "compressed"))
    dense = w0 * mask  # the independent reference weight

    x = torch.randn(*lead, K, generator=gen).to(dtype).requires_grad_()
    y = layer(x)
    assert y.dtype == dtype and y.shape == (*lead, N)
    assert_matches_reference(y, x.detach(), dense, b0)

    gy = torch.randn(*lead, N, generator=gen).to(dtype)
    y.backward(gy)
    x64 = x.detach().double().requires_grad_()
    w64 = dense.double().requires_grad_()
    b64 = None if b0 is None else b0.double().requires_grad_()
    F.linear(x64, w64, b64).backward(gy.double())
    M = x64.numel() // K
    torch.testing.assert_close(x.grad.double(), x64.grad, **tolerance(dtype, N))
    if mode == "masked":
        assert torch.equal(layer.mask, mask)
        assert bool((layer.weight.grad[~mask] == 0).all())
        torch.testing.assert_close(layer.weight.grad.double(), w64.grad * mask, **tolerance(dtype, M))
    else:
        # gradients for the kept values only, in storage order (row-major, increasing column)
        ref = w64.grad[mask].view(N, K // 2)
        torch.testing.assert_close(layer.values.grad.double(), ref, **tolerance(dtype, M))
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), b64.grad, **tolerance(dtype, M))


def test_compressed_backward_in_row_chunks(monkeypatch, gen):
    monkeypatch.setattr(linear_mod, "CHUNK_ELEMENTS", 3 * 32)  # 3 rows per chunk, ragged last one
    lin = make_linear(32, 11, True, torch.float64, gen)
    mask = top2_mask(lin.weight)
    dense = lin.weight.detach() * mask
    layer = Sparse24Linear.from_linear(lin, mode="compressed", trainable_values=True)
    x = torch.randn(7, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    w64 = dense.clone().requires_grad_()
    x64 = x.detach().clone().requires_grad_()
    F.linear(x64, w64).sum().backward()
    torch.testing.assert_close(x.grad, x64.grad)
    torch.testing.assert_close(layer.values.grad, w64.grad[mask].view(11, 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mode_switch_keeps_outputs_bit_identical(dtype, gen):
    layer = Sparse24Linear.from_linear(make_linear(96, 40, True, dtype, gen))
    x = torch.randn(3, 7, 96, generator=gen).to(dtype)
    y_masked = layer(x)
    mask = layer.mask.clone()
    assert torch.equal(layer.to_compressed()(x), y_masked)
    assert layer.mode == "compressed"
    assert torch.equal(layer.to_masked()(x), y_masked)
    assert torch.equal(layer.mask, mask)
    assert layer.to_masked() is layer  # no-op


def test_compressed_mode_has_no_dense_weight(gen):
    layer = Sparse24Linear.from_linear(make_linear(32, 16, True, torch.float32, gen), mode="compressed")
    with pytest.raises(AttributeError, match="compressed mode has no dense 'weight'"):
        layer.weight
    assert set(layer.state_dict()) == {"values", "meta", "bias"}


def test_autocast_bf16(gen):
    for mode in MODES:
        lin = make_linear(64, 32, True, torch.float32, gen)
        dense, b = lin.weight.detach() * top2_mask(lin.weight), lin.bias.detach().clone()
        layer = Sparse24Linear.from_linear(lin, mode=mode)
        x = torch.randn(5, 64, generator=gen, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        # autocast rounds x, W and b to bf16 before the product
        xb, wb, bb = (t.bfloat16().double() for t in (x.detach(), dense, b))
        torch.testing.assert_close(y.double(), F.linear(xb, wb, bb), **tolerance(torch.bfloat16, 64))
        y.float().sum().backward()
        assert x.grad is not None and x.grad.dtype == torch.float32


# --- frozen masks under every optimizer --------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
    "adam_wd": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, weight_decay=0.1),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp_bf16"])
def test_pruned_weights_stay_zero(opt_name, amp, gen):
    lin = make_linear(64, 32, True, torch.float32, gen)
    opt = OPTIMIZERS[opt_name](lin.parameters())
    x, target = torch.randn(16, 64, generator=gen), torch.randn(16, 32, generator=gen)
    for _ in range(3):  # dense training first: the optimizer state is dense
        opt.zero_grad()
        F.mse_loss(lin(x), target).backward()
        opt.step()
    layer = Sparse24Linear.from_linear(lin)  # shares lin's Parameters: `opt` keeps working
    mask, w_start = layer.mask.clone(), layer.weight.detach().clone()
    assert layer.weight is lin.weight
    state = next(v for k, v in opt.state[layer.weight].items() if k in ("momentum_buffer", "exp_avg", "square_avg"))
    assert bool((state[~mask] != 0).any())  # stale state would move pruned weights without the post-hook
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.mse_loss(layer(x).float(), target)
        scaler.scale(loss).backward()
        assert bool((layer.weight.grad[~mask] == 0).all())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(layer.parameters(), max_norm=0.1)
        scaler.step(opt)
        scaler.update()
        assert bool((layer.weight.detach()[~mask] == 0).all())
    assert not torch.equal(layer.weight.detach()[mask], w_start[mask])  # the kept weights did train


def test_gradient_masked_for_direct_weight_reads(gen):
    # Code that reads .weight directly (as nn.MultiheadAttention does with out_proj)
    # still sees the masked weight and gets a masked gradient.
    layer = Sparse24Linear.from_linear(make_linear(32, 16, False, torch.float32, gen))
    x = torch.randn(4, 32, generator=gen)
    y = F.linear(x, layer.weight)
    assert_matches_reference(y, x, layer.dense_weight())
    y.sum().backward()
    assert bool((layer.weight.grad[~layer.mask] == 0).all()) and bool((layer.weight.grad[layer.mask] != 0).any())


def test_plain_sgd_step_matches_reference(gen):
    lin = make_linear(32, 8, True, torch.float64, gen)
    mask = top2_mask(lin.weight)
    w_ref, b_ref = lin.weight.detach() * mask, lin.bias.detach().clone()
    layer = Sparse24Linear.from_linear(lin)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64)
    layer(x).square().sum().backward()
    opt.step()
    w = w_ref.clone().requires_grad_()
    F.linear(x, w, b_ref).square().sum().backward()
    torch.testing.assert_close(layer.weight.detach(), w_ref - 0.5 * w.grad * mask)


# --- module plumbing ------------------------------------------------------------------------

def test_deepcopy_is_independent_and_keeps_masking(gen):
    layer = Sparse24Linear.from_linear(make_linear(64, 32, True, torch.float32, gen))
    cp = copy.deepcopy(layer)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(cp(x), layer(x))
    assert cp.weight is not layer.weight and cp.mask is not layer.mask
    opt = torch.optim.SGD(cp.parameters(), lr=0.1, momentum=0.9)
    cp.weight.grad = torch.ones_like(cp.weight)  # a dense gradient, bypassing autograd
    opt.step()
    assert bool((cp.weight.detach()[~cp.mask] == 0).all())  # the post-hook covers the copy
    F.linear(x, cp.weight).sum().backward()
    cp.weight.grad = None
    F.linear(x, cp.weight).sum().backward()
    assert bool((cp.weight.grad[~cp.mask] == 0).all())  # and so does the gradient hook
    assert layer.weight.grad is None  # the original is untouched


@pytest.mark.parametrize("mode", MODES)
def test_to_dtype_and_type_keep_index_buffers(mode, gen):
    layer = Sparse24Linear.from_linear(make_linear(64, 32, True, torch.float32, gen), mode=mode)
    dense = layer.dense_weight()
    layer.half()
    assert layer.dtype == torch.float16 and layer.bias.dtype == torch.float16
    if mode == "masked":
        assert layer.mask.dtype == torch.bool and layer.weight.dtype == torch.float16
    else:
        assert layer.meta.dtype == torch.int32 and layer.values.dtype == torch.float16
    x = torch.randn(5, 64, generator=gen).half()
    assert_matches_reference(layer(x), x, dense.half(), layer.bias.detach())
    layer.type(torch.float64)  # casts *every* tensor in plain nn.Modules
    assert (layer.mask.dtype if mode == "masked" else layer.meta.dtype) in (torch.bool, torch.int32)
    assert layer.dtype == torch.float64
    x = x.double()
    assert_matches_reference(layer(x), x, dense.half().double(), layer.bias.detach())


def test_new_parameter_objects_on_conversion_are_rehooked(gen):
    layer = Sparse24Linear.from_linear(make_linear(32, 16, False, torch.float32, gen))
    old = layer.weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        layer.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert layer.weight is not old
    F.linear(torch.randn(2, 32, dtype=torch.float64), layer.weight).sum().backward()
    assert bool((layer.weight.grad[~layer.mask] == 0).all())


def test_extra_repr_and_trainable_values_toggle(gen):
    layer = Sparse24Linear.from_linear(make_linear(32, 16, True, torch.float32, gen))
    assert "in_features=32, out_features=16, bias=True, mode=masked" in repr(layer)
    x = torch.randn(3, 32, generator=gen)
    y = layer(x)
    layer.to_compressed(trainable_values=True)
    assert "mode=compressed, dtype=torch.float32, trainable_values=True" in repr(layer)
    assert layer.values.requires_grad and "values" in dict(layer.named_parameters())
    layer.to_compressed()  # frozen again; still a Parameter (counted by parameter counts)
    assert not layer.values.requires_grad and "values" in dict(layer.named_parameters())
    assert "trainable_values" not in repr(layer)
    assert torch.equal(layer(x), y)


def test_constructor_builds_pruned_layer():
    layer = Sparse24Linear(64, 32, bias=False, dtype=torch.float64)
    assert layer.bias is None and layer.weight.dtype == torch.float64
    assert torch.equal(layer.mask, top2_mask(layer.weight))
    assert sparse24.is_nm(layer.weight.detach()) and int(layer.mask.sum()) == 32 * 32


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile(mode, gen):
    net = nn.Sequential(Sparse24Linear.from_linear(make_linear(64, 32, True, torch.float32, gen), mode=mode),
                        nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(2, 5, 64, generator=gen, requires_grad=True)
    ref = net(x)
    gref = torch.autograd.grad(ref.sum(), x)[0]
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="eager")
    out = compiled(x)
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], gref)


# --- bad input ------------------------------------------------------------------------------

def test_from_linear_rejects_bad_input(gen):
    lin = make_linear(30, 8, True, torch.float32, gen)
    w = lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"in_features \(30\) must be divisible by 4"):
        Sparse24Linear.from_linear(lin)
    assert torch.equal(lin.weight, w)
    with pytest.raises(TypeError, match=r"expected an nn.Linear \(or a transformers Conv1D\), got Conv1d"):
        Sparse24Linear.from_linear(nn.Conv1d(4, 4, 1))
    lin = make_linear(32, 8, True, torch.float32, gen)
    w = lin.weight.detach().clone()
    dense_mask = torch.ones(8, 32, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask is not 2:4: row 0, group 0 \(columns 0..3\) keeps 4 of 4"):
        Sparse24Linear.from_linear(lin, mask=dense_mask)
    with pytest.raises(ValueError, match="mask shape"):
        Sparse24Linear.from_linear(lin, mask=torch.zeros(8, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode must be one of"):
        Sparse24Linear.from_linear(lin, mode="sparse")
    with pytest.raises(ValueError, match="quantize applies to mode='compressed'"):
        Sparse24Linear.from_linear(lin, quantize="int8")
    with pytest.raises(ValueError, match="quantize must be one of"):
        Sparse24Linear.from_linear(lin, mode="compressed", quantize="int2")
    with pytest.raises(ValueError, match=r"INT4 group_size must be one of \(32, 64, 128\), got 48"):
        Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=48)
    with pytest.raises(ValueError, match="group_size and symmetric apply to quantize='int4', got quantize='int8'"):
        Sparse24Linear.from_linear(lin, mode="compressed", quantize="int8", group_size=64)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", symmetric="no")
    assert torch.equal(lin.weight, w)  # nothing pruned by any failed call


def test_to_compressed_refuses_requantizing(gen):
    layer = Sparse24Linear.from_linear(make_linear(32, 8, True, torch.float32, gen), mode="compressed")
    before = layer_state(layer)
    with pytest.raises(ValueError, match="already compressed with quantize=None; call to_masked"):
        layer.to_compressed(quantize="int8")
    assert same_state(before, layer_state(layer))


# --- state dicts ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip_bit_identical(mode, gen):
    src = Sparse24Linear.from_linear(make_linear(64, 48, True, torch.float16, gen), mode=mode)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())  # plain tensors: safetensors-compatible
    fresh = Sparse24Linear(64, 48, mode=mode, dtype=torch.float16)
    x = torch.randn(9, 64, generator=gen).half()
    assert not torch.equal(fresh(x), src(x))
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), src(x))


@pytest.mark.parametrize("mode", MODES)
def test_loading_dense_checkpoint_is_a_clear_error(mode, gen):
    layer = Sparse24Linear.from_linear(make_linear(32, 16, True, torch.float32, gen), mode=mode)
    before = layer_state(layer)
    dense = nn.Linear(32, 16).state_dict()
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"got a dense checkpoint \('weight' without a 2:4 mask\)"):
            layer.load_state_dict(dense, strict=strict)
    assert same_state(before, layer_state(layer))


def test_loading_corrupt_or_mismatched_checkpoints(gen):
    masked = Sparse24Linear.from_linear(make_linear(64, 16, True, torch.float32, gen))
    comp = copy.deepcopy(masked).to_compressed()
    cases = []
    sd = masked.state_dict()
    cases.append((masked, {**sd, "mask": torch.ones_like(sd["mask"])}, r"mask is not 2:4"))
    bad_w = sd["weight"].clone()
    bad_w[~sd["mask"]] = 1.0
    cases.append((masked, {**sd, "weight": bad_w}, r"'weight' is non-zero where 'mask' is False"))
    cases.append((masked, {**sd, "weight": sd["weight"][:8], "mask": sd["mask"][:8]}, r"'weight' has shape \(8, 64\)"))
    cases.append((masked, comp.state_dict(), "got a compressed checkpoint"))
    cases.append((masked, {**sd, "scale": torch.ones(16)}, r"got a quantized checkpoint \(scale\) for a masked"))
    sd = comp.state_dict()
    meta = sd["meta"].clone()
    meta[0, 3] = 0  # every group of row 3 claims slot 0 twice
    cases.append((comp, {**sd, "meta": meta}, r"corrupt metadata at row 3, group 0"))
    cases.append((comp, {**sd, "values": sd["values"][:, :16]}, r"values must have shape \(16, 32\)"))
    cases.append((comp, {**sd, "values": sd["values"].to(torch.int8)}, "must be floating point"))
    cases.append((comp, {**sd, "scale": torch.ones(16)}, "got an INT8 checkpoint"))
    cases.append((comp, masked.state_dict(), "got a masked-mode checkpoint"))
    for layer, bad, msg in cases:
        before = layer_state(layer)
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(bad)
        assert same_state(before, layer_state(layer))


def test_partial_or_extra_checkpoint_entries_are_checked(gen):
    # A lone mask / meta, or the full set plus extra keys, used to be loaded without any check
    # (strict=False: a dense all-True mask silently turned the layer dense).
    masked = Sparse24Linear.from_linear(make_linear(64, 16, True, torch.float32, gen))
    comp = copy.deepcopy(masked).to_compressed()
    sd, sdc = masked.state_dict(), comp.state_dict()
    bad_w = sd["weight"].clone()
    bad_w[~sd["mask"]] = 1.0
    bad_meta = sdc["meta"].clone()
    bad_meta[0, 3] = 0
    cases = [(masked, {"mask": torch.ones_like(sd["mask"])}, r"incomplete 2:4 entries: got \['mask'\]"),
             (masked, {**sd, "weight": bad_w, "values": sdc["values"]}, "non-zero where 'mask' is False"),
             (masked, {**sd, "mask": [1, 0]}, "'mask' must be a tensor"),
             (comp, {"meta": bad_meta}, r"incomplete 2:4 entries: got \['meta'\]"),
             (comp, {**sdc, "meta": bad_meta, "weight": sd["weight"]}, "corrupt metadata at row 3")]
    for layer, bad, msg in cases:
        before = layer_state(layer)
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(bad, strict=False)
        assert same_state(before, layer_state(layer))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):  # was AttributeError
        comp([0.0] * 64)


# --- INT8 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_forward_backward(dtype, gen):
    lin = make_linear(64, 24, True, dtype, gen)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    mask = top2_mask(w0)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int8")
    assert layer.values.dtype == torch.int8 and layer.scale.dtype == torch.float32 and layer.quantize == "int8"
    assert "quantize=int8" in repr(layer) and layer.dtype == dtype
    ref_w = dequantized_reference(layer, mask)
    # symmetric per-row int8: every kept weight within half a step of the original, plus the
    # fp32 rounding of the scale times |q| <= 127 (ties at x.5 steps hit the half-step exactly)
    step = layer.scale.double()[:, None]
    assert bool(((ref_w - (w0 * mask).double()).abs() <= step * (0.5 + 127 * 2.0 ** -23)).all())
    x = torch.randn(2, 7, 64, generator=gen).to(dtype).requires_grad_()
    y = layer(x)
    assert y.dtype == dtype
    assert_matches_reference(y, x.detach(), ref_w.to(dtype), b0)
    gy = torch.randn(2, 7, 24, generator=gen).to(dtype)
    y.backward(gy)
    torch.testing.assert_close(x.grad.double(), gy.double() @ ref_w.to(dtype).double(), **tolerance(dtype, 24))


def test_int8_dtype_moves_keep_values_and_scales(gen):
    layer = Sparse24Linear.from_linear(make_linear(64, 32, True, torch.float32, gen), mode="compressed",
                                       quantize="int8")
    values, scale = layer.values.clone(), layer.scale.clone()
    layer.half()
    assert torch.equal(layer.values, values) and layer.scale.dtype == torch.float32 and torch.equal(layer.scale, scale)
    assert layer.dtype == torch.float16 and layer.sparse_tensor().to_dense().dtype == torch.float16
    layer.type(torch.bfloat16)
    assert torch.equal(layer.values, values) and torch.equal(layer.scale, scale) and layer.dtype == torch.bfloat16


def test_int8_state_dict_round_trip_and_mode_switch(gen):
    src = Sparse24Linear.from_linear(make_linear(64, 32, True, torch.float16, gen))
    x = torch.randn(5, 64, generator=gen).half()
    src.to_compressed(quantize="int8")
    y = src(x)
    sd = src.state_dict()
    assert set(sd) == {"values", "meta", "scale", "bias"} and all(type(v) is torch.Tensor for v in sd.values())
    fresh = Sparse24Linear(64, 32, mode="compressed", quantize="int8", dtype=torch.float16)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), y)
    plain = Sparse24Linear(64, 32, mode="compressed", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="got an INT8 checkpoint"):
        plain.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="is INT8-quantized but the checkpoint has no scale"):
        fresh.load_state_dict(plain.state_dict())
    assert torch.equal(fresh(x), y)
    assert torch.equal(src.to_masked()(x), y)  # back to masked: the dequantized weight, same outputs
    with pytest.raises(ValueError, match="trainable_values needs mode='compressed' with floating values"):
        src.to_compressed(quantize="int8", trainable_values=True)


def test_assign_load_and_pickling_keep_the_masking(gen):
    src = Sparse24Linear.from_linear(make_linear(32, 16, True, torch.float32, gen))
    x = torch.randn(3, 32, generator=gen)
    y = src(x)
    fresh = Sparse24Linear(32, 16)
    fresh.load_state_dict({k: v.clone() for k, v in src.state_dict().items()}, assign=True)  # new Parameters
    buf = io.BytesIO()
    torch.save(src, buf)  # whole-module pickling
    unpickled = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    for layer in (fresh, unpickled):
        assert torch.equal(layer(x), y)
        F.linear(x, layer.weight).sum().backward()  # a direct read: only the gradient hook masks it
        assert bool((layer.weight.grad[~layer.mask] == 0).all())
        layer.weight.grad = torch.ones_like(layer.weight)
        torch.optim.SGD([layer.weight], lr=1.0).step()  # only the post-hook re-zeroes
        assert bool((layer.weight.detach()[~layer.mask] == 0).all())

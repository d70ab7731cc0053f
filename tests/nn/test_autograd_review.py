"""Review findings on Sparse24Linear and sparse24.linear under torch's other differentiation front ends:
forward-mode AD (torch.autograd.forward_ad's dual tensors), torch.func (jvp, jacfwd, vmap over weights),
batched backward (autograd.grad(is_grads_batched=True), jacobian / hessian(vectorize=True)), trainable
INT8/INT4 scales, and nested-tensor inputs. Every result is checked against fp64 products with the
masked (or dequantized) dense weight, taken from a copy made before the call."""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, jacfwd, jvp, stack_module_state, vmap

import sparse24
from sparse24 import Sparse24Linear
from sparse24 import format as format_mod
from sparse24.nn import linear as linear_mod
from sparse24.ops.linear24 import naive

from conftest import dequantized_reference, top2_mask
from test_fast_path import _layer as decode_layer
from test_fast_path import cuda_route  # noqa: F401  (fixture: the CUDA route on CPU tensors, plans kept)
from test_nn_review import distinct_weight

# nested tensors' "prototype" warning and torch's own torch.jit.script deprecation warning
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _linear(C, R, dtype=torch.float64, seed=0):
    """An ``nn.Linear(C, R)`` whose 2:4 magnitude mask is unique, and that mask."""
    lin = nn.Linear(C, R, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(distinct_weight(R, C, dtype, seed))
        lin.bias.copy_(torch.linspace(-1, 1, R, dtype=dtype))
    return lin, top2_mask(lin.weight)


def _dense(mask, kept):
    """The fp64 ``(R, C)`` matrix holding ``kept`` (``(R, C/2)``, in row-major order) at ``mask``, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float64).masked_scatter(mask, kept.double())


def _dequantized(layer, mask, scale):
    """fp64 dense weight of an INT8 / INT4 layer (layout v1) from its stored codes, as a function of ``scale``."""
    R, C = mask.shape
    if layer.group_size is None:
        return _dense(mask, layer.values.double() * scale[:, None])
    v = layer.values.long()
    codes = torch.stack((v & 15, v >> 4), dim=-1).reshape(R, C // 2).double()
    group = torch.arange(C // 2) // (int(layer.group_size) // 2)
    zero = 8.0 if layer.zero is None else layer.zero.double()[:, group]
    return _dense(mask, (codes - zero) * scale[:, group])


def _randn(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# -- 2. masked mode under forward-mode AD --

@pytest.mark.parametrize("grad_mode", [True, False])
def test_masked_forward_ad_keeps_the_pruned_positions_tangent_out(grad_mode):
    # The inference shortcut (a weight without grad and 0 where pruned: F.linear without the where()) checked
    # only the primal, so a dual weight's tangent at pruned positions reached the output tangent
    lin, mask = _linear(16, 4)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin))
    w, b = torch.where(mask, lin.weight, 0).detach(), lin.bias.detach()
    x, v = _randn(3, 16), _randn(4, 16, seed=2)
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        out = functional_call(layer, {"weight": fwAD.make_dual(layer.weight.detach(), v)}, (x,))
        y, tangent = fwAD.unpack_dual(out)
    torch.testing.assert_close(y, x @ w.T + b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tangent, x @ torch.where(mask, v, 0).T, rtol=1e-12, atol=1e-12)
    with torch.set_grad_enabled(grad_mode):   # torch.func.jvp, the other front end, agrees
        _, tangent = jvp(lambda t: functional_call(layer, {"weight": t}, (x,)), (layer.weight.detach(),), (v,))
    torch.testing.assert_close(tangent, x @ torch.where(mask, v, 0).T, rtol=1e-12, atol=1e-12)


# -- 3. 16-bit kept values under forward-mode derivatives --

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_values_carry_their_tangent(dtype):
    # to_dense moved 16-bit values as int16 bits whenever they did not require grad: a dual or
    # torch.func-wrapped tensor does not, and the dtype view dropped its tangent (jvp / jacfwd gave zeros)
    lin, mask = _linear(16, 4, dtype)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", trainable_values=True)
    vals = layer.values.detach().clone()
    x, v = _randn(3, 16, dtype=dtype), _randn(*vals.shape, dtype=dtype, seed=2)
    want = x.double() @ _dense(mask, v).T
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.float16 else {"rtol": 4e-2, "atol": 4e-2}

    def f(t):
        return functional_call(layer, {"values": t}, (x,))
    torch.testing.assert_close(jvp(f, (vals,), (v,))[1].double(), want, **tol)
    with fwAD.dual_level():   # (grad mode on, the bias requires grad)
        torch.testing.assert_close(fwAD.unpack_dual(f(fwAD.make_dual(vals, v))).tangent.double(), want, **tol)
    # each entry of the Jacobian is one entry of x (or 0): exact in any dtype
    ref = torch.autograd.functional.jacobian(lambda t: x.double() @ _dense(mask, t).T, vals.double())
    assert torch.equal(jacfwd(f)(vals).double(), ref)


# -- 4. compressed layers under forward-mode AD --

def _compressed_case(quantize, chunks, monkeypatch):
    """A float64 compressed layer (trainable values unless quantized), its source Linear and mask, the dense
    ``(6, 16)`` weight it must act as (masked; INT8: dequantized independently) and the tolerance; with
    ``chunks > 1`` the reference's blocks of weight rows are 2 rows each."""
    if chunks > 1:
        monkeypatch.setattr(naive, "CHUNK_ELEMENTS", 2 * 16)
    lin, mask = _linear(16, 6)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", quantize=quantize,
                                       trainable_values=quantize is None)
    w = dequantized_reference(layer, mask) if quantize else torch.where(mask, lin.weight, 0).detach()
    tol = {"rtol": 1e-12, "atol": 1e-12} if quantize is None else {"rtol": 1e-6, "atol": 1e-6}
    return lin, mask, layer, w, tol


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("grad_mode", [True, False])
@pytest.mark.parametrize("chunks", [1, 3])
def test_compressed_forward_ad_gives_the_dense_tangents(quantize, grad_mode, chunks, monkeypatch):
    # with grad mode on (the bias requires grad) the registered op raised "You must implement the jvp function"
    lin, mask, layer, w, tol = _compressed_case(quantize, chunks, monkeypatch)
    b = lin.bias.detach()
    x, t, tb = _randn(2, 5, 16), _randn(2, 5, 16, seed=2), _randn(6, seed=3)
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        y, tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t)))
        torch.testing.assert_close(y, x @ w.T + b, **tol)
        torch.testing.assert_close(tangent, t @ w.T, **tol)
        out = functional_call(layer, {"bias": fwAD.make_dual(b, tb)}, (x,))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, tb.expand(2, 5, 6), rtol=0, atol=0)
        if quantize is None:   # the kept values' tangent
            tv = _randn(*layer.values.shape, seed=4)
            out = functional_call(layer, {"values": fwAD.make_dual(layer.values.detach(), tv)}, (x,))
            torch.testing.assert_close(fwAD.unpack_dual(out).tangent, x @ _dense(mask, tv).T, **tol)


def test_triton_backend_keeps_the_forward_ad_tangent():
    # grad mode off, backend="triton" (what the modules pick on CUDA): the kernel returned an output
    # without tangent, so a residual block silently got the tangent of x alone
    lin, mask = _linear(32, 32, torch.float32)
    p = sparse24.compress(lin.weight.detach(), mask)
    w, b = torch.where(mask, lin.weight, 0).detach().double(), lin.bias.detach()
    x, t = _randn(2, 32, dtype=torch.float32), _randn(2, 32, dtype=torch.float32, seed=2)
    with torch.no_grad(), fwAD.dual_level():
        xd = fwAD.make_dual(x, t)
        h = xd + sparse24.linear(xd, p, b, backend="triton")
        y, tangent = fwAD.unpack_dual(h)
    torch.testing.assert_close(y.double(), x.double() + x.double() @ w.T + b.double(), rtol=1e-5, atol=1e-5)
    assert tangent is not None
    torch.testing.assert_close(tangent.double(), t.double() + t.double() @ w.T, rtol=1e-5, atol=1e-5)


def test_the_fast_path_is_not_taken_for_a_dual_input(cuda_route):
    layer = decode_layer()   # float16, the decode layout, on the CUDA route (interpreted)
    x, t = _randn(2, 128, dtype=torch.float16), _randn(2, 128, dtype=torch.float16, seed=2)
    w = layer.dense_weight().double()
    with torch.no_grad():
        layer(x)                                            # its plan kept
        assert (x.shape, x.dtype) in linear_mod._FAST[layer]
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t))).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent.double(), t.double() @ w.T, rtol=1e-2, atol=1e-2)


# -- 5. trainable INT8 / INT4 scales --

@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("others", ["bias", "x", "none"])
def test_a_trainable_scale_gets_its_gradient(quantize, others):
    # the registered op's backward returned None for the scale, and it was chosen whenever the bias or x
    # required grad: the scale's gradient was silently None then
    lin, mask = _linear(64, 8, torch.float32)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", quantize=quantize,
                                       **({"group_size": 32} if quantize == "int4" else {}))
    layer.bias.requires_grad_(others == "bias")
    x = _randn(3, 64, dtype=torch.float32).requires_grad_(others == "x")
    s = layer.scale.detach().clone().requires_grad_()
    functional_call(layer, {"scale": s}, (x,)).pow(2).sum().backward()
    s64, x64, b64 = (t.detach().double().requires_grad_() for t in (layer.scale, x, lin.bias))
    (x64 @ _dequantized(layer, mask, s64).T + b64).pow(2).sum().backward()
    assert s.grad is not None and s.grad.dtype == s.dtype
    rtol = 1e-4 if quantize == "int8" else 2e-3   # (INT4 scales are float16)
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=rtol, atol=rtol * s64.grad.abs().max().item())
    if others == "x":
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    if others == "bias":
        torch.testing.assert_close(layer.bias.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)


def test_a_trainable_scale_of_a_kept_plan_takes_the_full_path(cuda_route):
    layer = decode_layer("int8")
    layer.bias.requires_grad_(False)
    x = _randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        layer(x)                                            # its plan kept
    layer.scale.requires_grad_()
    layer(x).float().pow(2).sum().backward()
    assert layer.scale.grad is not None and layer.scale.grad.abs().sum() > 0


# -- 6. batched backward --

@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_batched_backward_matches_the_dense_layer(quantize, chunks, monkeypatch):
    # the backward wrote into unbatched buffers (addmm_, slice assignment): torch's vmap over grad_outputs
    # raised "Batching rule not implemented for aten::alias"
    lin, mask, layer, w, tol = _compressed_case(quantize, chunks, monkeypatch)
    x = _randn(3, 16)
    J = torch.autograd.functional.jacobian(layer, x, vectorize=True)
    torch.testing.assert_close(J, torch.einsum("ab,nk->anbk", torch.eye(3, dtype=torch.float64), w), **tol)
    H = torch.autograd.functional.hessian(lambda t: layer(t).pow(2).sum(), x, vectorize=True)
    torch.testing.assert_close(H, torch.einsum("ab,kl->akbl", torch.eye(3, dtype=torch.float64), 2 * w.T @ w), **tol)
    # per-row vector-Jacobian products of x, the bias and the kept values at once
    xg = x.clone().requires_grad_()
    y = layer(xg)
    G = _randn(4, *y.shape, seed=2)
    wanted = [xg, layer.bias] + ([layer.values] if quantize is None else [])
    got = torch.autograd.grad(y, wanted, G, is_grads_batched=True)
    torch.testing.assert_close(got[0], G @ w, **tol)
    torch.testing.assert_close(got[1], G.sum(1), **tol)
    if quantize is None:
        dense = G.transpose(1, 2) @ x                       # (4, N, K) dense weight gradients
        torch.testing.assert_close(got[2], dense[:, mask].view(4, 6, 8), **tol)


# -- 7. vmap over compressed weights --

@pytest.mark.parametrize("quantize", [None, "int8"])
def test_vmap_over_an_ensemble_of_compressed_models(quantize):
    # torch.func.stack_module_state + vmap(functional_call), PyTorch's model-ensembling recipe: to_dense's
    # in-place scatter raised "aten::scatter_ ... Please try to use out-of-place operators"
    models, refs = [], []
    for i in range(3):
        lin1, mask1 = _linear(16, 8, seed=i)
        lin2, mask2 = _linear(8, 4, seed=10 + i)
        ws = [torch.where(mk, lin.weight, 0).detach().clone() for mk, lin in ((mask1, lin1), (mask2, lin2))]
        m = nn.Sequential(*(Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", quantize=quantize)
                            for lin in (lin1, lin2)))
        m.insert(1, nn.ReLU())
        if quantize:
            ws = [dequantized_reference(m[0], mask1), dequantized_reference(m[2], mask2)]
        refs.append((ws, lin1.bias.detach().clone(), lin2.bias.detach().clone()))
        models.append(m)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0])
    x = _randn(5, 16)
    out = vmap(lambda p, b, t: functional_call(base, (p, b), (t,)), in_dims=(0, 0, None))(params, buffers, x)
    want = torch.stack([torch.relu(x @ w1.T + b1) @ w2.T + b2 for (w1, w2), b1, b2 in refs])
    tol = {"rtol": 1e-12, "atol": 1e-12} if quantize is None else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("blocks", [1, 4])
def test_vmap_over_values(dtype, blocks, monkeypatch):
    if blocks > 1:   # to_dense's blocks and the forward's chunks of weight rows: several of each
        monkeypatch.setattr(format_mod, "_DENSE_BLOCK", 2 * 16)
        monkeypatch.setattr(naive, "CHUNK_ELEMENTS", 3 * 16)
    lin, mask = _linear(16, 8, dtype)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed")
    vals = torch.stack([layer.values.detach() * k for k in (1, 2, -3)])   # exact in every dtype
    x = _randn(3, 16, dtype=dtype)
    out = vmap(lambda v: functional_call(layer, {"values": v}, (x,)))(vals)
    want = torch.stack([x.double() @ _dense(mask, v).T + lin.bias.double() for v in vals])
    tol = {torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_plain_to_dense_still_fills_one_buffer_in_place(monkeypatch):
    # the out-of-place path is for torch.func's wrapped values only: a plain call allocates no block per
    # row block (the CPU forward decompresses every call)
    monkeypatch.setattr(format_mod, "_DENSE_BLOCK", 2 * 16)
    lin, mask = _linear(16, 8, torch.float16)
    p = sparse24.compress(lin.weight.detach(), mask)
    calls = []
    real = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(p.to_dense().double(), torch.where(mask, lin.weight, 0).double())
    assert not calls


# -- nested tensors --

@pytest.mark.parametrize("quantize", [None, "int8"])
def test_jagged_nested_input(quantize):
    # raised "NotImplementedError: sparse24.linear.default" (grad mode on)
    lin, mask = _linear(16, 8)
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", quantize=quantize,
                                       trainable_values=quantize is None)
    w = dequantized_reference(layer, mask) if quantize else torch.where(mask, lin.weight, 0).detach()
    b = lin.bias.detach()
    parts = [_randn(3, 16), _randn(5, 16, seed=2)]
    tol = {"rtol": 1e-12, "atol": 1e-12} if quantize is None else {"rtol": 1e-6, "atol": 1e-6}
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    out = layer(nt)
    assert out.is_nested and out.layout == torch.jagged and torch.equal(out.offsets(), nt.offsets())
    for o, part in zip(out.unbind(), parts):
        torch.testing.assert_close(o, part @ w.T + b, **tol)
    out.values().pow(2).sum().backward()
    X, b64 = torch.cat(parts).requires_grad_(), b.clone().requires_grad_()
    W = w.clone().requires_grad_()
    (X @ W.T + b64).pow(2).sum().backward()
    torch.testing.assert_close(nt.grad.values(), X.grad, **tol)
    torch.testing.assert_close(layer.bias.grad, b64.grad, **tol)
    if quantize is None:
        torch.testing.assert_close(layer.values.grad, W.grad[mask].view(8, 8), **tol)
    with torch.no_grad():   # the functional form, and grad mode off
        y = sparse24.linear(nt.detach(), layer.sparse_tensor(), b)
        torch.testing.assert_close(y.values(), torch.cat(parts) @ w.T + b, **tol)
        torch.testing.assert_close(layer(nt.detach()).values(), torch.cat(parts) @ w.T + b, **tol)


def test_strided_nested_input_is_refused_clearly(cuda_route):
    lin, _ = _linear(16, 8)
    layer = Sparse24Linear.from_linear(lin, mode="compressed")
    nt = torch.nested.nested_tensor([_randn(3, 16), _randn(5, 16, seed=2)], layout=torch.strided)
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode), pytest.raises(TypeError, match="nested.*jagged"):
            layer(nt)
    with pytest.raises(TypeError, match="nested.*jagged"):
        sparse24.linear(nt, layer.sparse_tensor())
    fast = decode_layer()   # a layer with a kept plan (the fast path read x.shape first)
    x = _randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        fast(x)
        nt = torch.nested.nested_tensor([x, x[:1]], layout=torch.strided)
        with pytest.raises(TypeError, match="nested.*jagged"):
            fast(nt)


def test_vmap_over_inputs_only_keeps_the_plain_paths(monkeypatch):
    # the transforms check turned off the masked shortcut (a where() over the weight per call: 5.7x) and sent
    # to_dense out of place (1.6x the bytes) whenever any transform ran, also when the weight was not mapped
    torch.manual_seed(0)
    masked = Sparse24Linear.from_linear(nn.Linear(64, 32)).requires_grad_(False)
    compressed = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed")
    x = torch.randn(5, 3, 64)
    refs = [nn.functional.linear(x.double(), m.dense_weight().double(), m.bias.double()) for m in (masked, compressed)]
    masked(x)   # (its one check that the weight is zero where pruned, cached per version)
    calls = {"where": 0, "out_of_place": 0}
    real_where, real_cat = torch.where, torch.cat
    monkeypatch.setattr(torch, "where", lambda *a, **k: calls.__setitem__("where", calls["where"] + 1)
                        or real_where(*a, **k))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.__setitem__("out_of_place", calls["out_of_place"] + 1)
                        or real_cat(*a, **k))
    assert torch.allclose(vmap(masked)(x).double(), refs[0], atol=1e-5)
    assert calls["where"] == 0
    assert torch.allclose(vmap(compressed)(x).double(), refs[1], atol=1e-5)
    assert calls["out_of_place"] == 0
    assert format_mod.transformed(None, torch.ones(1)) is False


def test_numpy_bools_are_bools():
    np = pytest.importorskip("numpy")
    layer = Sparse24Linear.from_linear(nn.Linear(32, 8), mode="compressed", trainable_values=np.True_)
    assert layer.values.requires_grad
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    assert sparse24.compress(w, quantize="int4", symmetric=np.False_).zero is not None
    assert sparse24.compress(w, quantize="int4", symmetric=np.True_).zero is None
    with pytest.raises(TypeError, match="trainable_values must be a bool, got int 1"):
        Sparse24Linear.from_linear(nn.Linear(32, 8), mode="compressed", trainable_values=1)
    with pytest.raises(TypeError, match="symmetric must be a bool, got numpy.float64"):
        sparse24.compress(w, quantize="int4", symmetric=np.float64(0))

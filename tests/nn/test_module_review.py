"""Review findings on Sparse24Linear as an nn.Module among torch's utilities: nn.DataParallel's
replicas, a conversion that fails part way, torch.__future__'s swap_tensors conversions and loads,
parameters replaced through ``.data`` (vector_to_parameters), torch.nn.utils.parametrize, and
share_memory() of the decode layout. Outputs are checked against fp64 products with the masked
(or dequantized) dense weight."""
import copy
import importlib

import pytest
import torch
import torch.nn.utils.parametrize as P
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import sparse24
from sparse24 import Sparse24Linear
from sparse24.nn import linear as linear_mod

from conftest import (assert_matches_reference, assert_model_unchanged, dequantized_reference,
                      int4_dequantized_reference, model_snapshot, top2_mask)
from test_fast_path import cuda_route  # noqa: F401  (fixture: the CUDA route on CPU tensors, plans kept)
from test_nn_review import distinct_weight

KINDS = ["masked", "compressed", "int8", "int4", "trainable", "decode", "decode_int4"]


def _build(kind: str, bias: bool = True, R: int = 32, C: int = 64):
    """A layer of ``kind``, an input, and the fp64 dense weight the layer must compute with (the kept
    entries of a weight with a unique 2:4 magnitude mask, or the stored INT8/INT4 values as the
    format defines them)."""
    dtype = torch.float16 if kind.startswith("decode") else torch.float32
    lin = nn.Linear(C, R, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(distinct_weight(R, C, dtype))
        if bias:
            lin.bias.copy_(torch.linspace(-1, 1, R, dtype=dtype))
    w = lin.weight.detach().clone()
    mask = top2_mask(w)
    quantize = {"int8": "int8", "int4": "int4", "decode_int4": "int4"}.get(kind)
    if kind == "masked":
        layer = Sparse24Linear.from_linear(lin)
    else:
        layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize=quantize,
                                           trainable_values=kind == "trainable",
                                           **({"group_size": 32} if quantize == "int4" else {}))
    ref = {"int8": dequantized_reference, "int4": int4_dequantized_reference}.get(quantize)
    # (INT4: the dequantized weight is the fp64 one rounded once to the layer's dtype)
    w_ref = ref(layer, mask).to(dtype).double() if ref else torch.where(mask, w, 0).double()
    if kind.startswith("decode"):
        layer.to_layout("decode")
    x = torch.randn(3, C, generator=torch.Generator().manual_seed(1)).to(dtype)
    return layer, x, w_ref


@pytest.fixture
def cpu_replicate(monkeypatch):
    """torch.nn.parallel.replicate (what nn.DataParallel runs on 2+ GPUs) on CPU: only the CUDA
    broadcast is swapped for a per-replica clone (Broadcast.apply's copies are such non-leaf tensors)."""
    R = importlib.import_module("torch.nn.parallel.replicate")
    monkeypatch.setattr(R, "_get_device_index", lambda x, optional=False, allow_cpu=False: 0)
    monkeypatch.setattr(R, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t.clone() for t in tensors] for _ in devices])
    return R.replicate


@pytest.fixture
def swap_on():
    """torch.__future__.set_swap_module_params_on_conversion(True) for the test."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


# -- 1. nn.DataParallel replicas --
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_dataparallel_replica_computes_as_the_layer(kind, bias, cpu_replicate):
    """A replica holds its parameters as plain attributes (its _parameters has no 'values'): it
    computes what the layer does, bias included (it raised KeyError 'values')."""
    layer, x, w_ref = _build(kind, bias)
    with torch.no_grad():
        want = layer(x)
        replica = cpu_replicate(nn.Sequential(layer), [0, 1])[1][0]
        assert "values" not in replica._parameters and "weight" not in replica._parameters
        out = replica(x)
    assert_matches_reference(out, x, w_ref, layer.bias)
    assert torch.equal(out, want)


@pytest.mark.parametrize("kind", ["masked", "trainable"])
def test_dataparallel_replica_gradients_reach_the_layer(kind, cpu_replicate):
    layer, x, _ = _build(kind)
    twin = copy.deepcopy(layer)
    twin(x).square().sum().backward()
    cpu_replicate(nn.Sequential(layer), [0, 1])[1](x).square().sum().backward()
    name = "weight" if kind == "masked" else "values"
    for n in (name, "bias"):
        torch.testing.assert_close(getattr(layer, n).grad, getattr(twin, n).grad, rtol=0, atol=0)


def test_parametrized_bias_of_a_compressed_layer_is_applied():
    """A bias moved out of _parameters (parametrize: now a property) is read, not dropped."""
    layer, x, w_ref = _build("compressed")
    b = layer.bias.detach().clone()

    class Double(nn.Module):
        def forward(self, t):
            return 2 * t
    P.register_parametrization(layer, "bias", Double())
    with torch.no_grad():
        assert_matches_reference(layer(x), x, w_ref, 2 * b)


# -- 2. a conversion that fails part way --
def test_refused_conversion_leaves_the_layer_unchanged_and_usable(swap_on):
    """.half() refused by swap_tensors (a live graph holds the frozen values): the logical dtype
    stays float32 beside the float32 values (every later forward raised)."""
    layer, x, w_ref = _build("compressed")
    layer.requires_grad_(False)
    snap = model_snapshot(layer)
    y = layer(x.clone().requires_grad_())  # its graph holds the values
    with pytest.raises(RuntimeError, match="swap"):
        layer.half()
    assert_model_unchanged(layer, snap)
    assert layer.dtype == torch.float32
    assert_matches_reference(layer(x), x, w_ref, layer.bias)
    del y
    layer.half()
    assert layer.dtype == torch.float16
    assert_matches_reference(layer(x.half()), x.half(), w_ref, layer.bias)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_conversion_failing_part_way_keeps_the_decode_layout(quantize):
    """A move that fails at the bias (e.g. out of memory) after the values were converted: the layer
    keeps its decode-layout tensors, dtype and layout (it was left in layout v1)."""
    lin = nn.Linear(64, 32, dtype=torch.bfloat16)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize=quantize,
                                       **({"group_size": 32} if quantize == "int4" else {})).to_layout("decode")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = layer(x)
    snap = model_snapshot(layer)
    values, bias = layer.values, layer.bias

    def fn(t):
        if t is bias:
            raise RuntimeError("injected: out of memory")
        return t.float() if t.is_floating_point() else t
    with pytest.raises(RuntimeError, match="injected"):
        layer._apply(fn)
    assert layer.layout == "decode" and layer.values is values and layer.dtype == torch.bfloat16
    assert_model_unchanged(layer, snap)
    assert torch.equal(layer(x), want)


# -- 3. torch.__future__.set_swap_module_params_on_conversion(True) --
def _masked_model(seed: int):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with torch.no_grad():
        for i in (0, 2):
            model[i].weight.copy_(distinct_weight(*model[i].weight.shape, torch.float32, seed=seed + i))
            model[i].bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(seed))
    sparsify_report = sparse24.sparsify_(model, skip_output_head=False)
    assert len(sparsify_report.layers) == 2
    return model


def _assert_masking_works(model, x):
    """Outputs as the fp64 masked reference; a gradient from a direct read of .weight is masked (the
    hook); pruned entries written into the gradient are re-zeroed by the optimizer post-hook."""
    layer = model[0]
    w_ref = torch.where(layer.mask, layer.weight.detach(), 0).double()
    with torch.no_grad():
        assert_matches_reference(layer(x), x, w_ref, layer.bias)
    assert_matches_reference(layer(x), x, w_ref, layer.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for i in (0, 2):
        model[i].weight.sum().backward()  # all ones, unless the hook masks it
        w, mask = model[i].weight, model[i].mask
        assert bool((w.grad[~mask] == 0).all()) and bool((w.grad[mask] == 1).all())
        with torch.no_grad():
            w.grad[~mask] = 1.0  # as an unmasked gradient would
    opt.step()
    for i in (0, 2):
        assert bool((model[i].weight[~model[i].mask] == 0).all())


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("how", ["double", "meta_to_empty_load", "load"])
def test_masked_model_converts_and_loads_under_swap(how, frozen, swap_on):
    """Each raised "Cannot swap t1 because it has weakref associated with it" (sparse24's weak
    references to the weight); the swapped-in data carries no hook, so the masking is re-armed."""
    model = _masked_model(0)
    if frozen:
        model.requires_grad_(False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        model(x)  # the zero check keeps weak references to weight and mask
    w0 = model[0].weight
    calls = []
    if not frozen:  # a hook of the user's on a masked weight is called after the swap too
        model[2].weight.register_hook(lambda g: calls.append(g.dtype))
    other = _masked_model(10).state_dict()
    if how == "double":
        model.double()
        x = x.double()
        assert w0.dtype == torch.float64
    else:
        if how == "meta_to_empty_load":
            model.to("meta")
            assert w0.is_meta
            model.to_empty(device="cpu")
        model.load_state_dict(copy.deepcopy(other))
        assert torch.equal(w0, other["0.weight"]) and torch.equal(model[0].mask, other["0.mask"])
    assert model[0].weight is w0
    if frozen:
        model.requires_grad_(True)
    _assert_masking_works(model, x)
    assert calls == ([] if frozen else [x.dtype])


def test_densified_model_converts_under_swap(swap_on):
    """densify_ hands the weights back: no hook or weak reference of sparse24 stays on them."""
    model = _masked_model(0)
    sparse24.densify_(model)
    model.double()
    assert model[0].weight.dtype == torch.float64


def test_compressed_layer_with_kept_plans_converts_and_loads_under_swap(cuda_route, swap_on):  # noqa: F811
    """A decode-layout layer that kept launch plans (weak references to its tensors)."""
    layer, x, w_ref = _build("decode")
    with torch.no_grad():
        layer(x)
    assert linear_mod._FAST.get(layer)
    layer.load_state_dict(copy.deepcopy(layer.state_dict()))
    layer.float()
    with torch.no_grad():
        assert_matches_reference(layer(x.float()), x.float(), w_ref, layer.bias)
    layer.half().to_layout("decode")
    with torch.no_grad():
        assert_matches_reference(layer(x), x, w_ref, layer.bias)


# -- 4. parameters replaced through .data --
def test_no_grad_forward_sees_tensors_replaced_through_data():
    """vector_to_parameters sets .data: the cached "zero where pruned" check must not be taken."""
    layer, x, _ = _build("masked")
    with torch.no_grad():
        layer(x)  # caches the check
    v = parameters_to_vector(layer.parameters())
    vector_to_parameters(v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2)),
                         layer.parameters())

    def check():
        with torch.no_grad():
            out = layer(x)
        assert_matches_reference(out, x, torch.where(layer.mask, layer.weight.detach(), 0).double(), layer.bias)
    check()
    layer.weight.data = torch.randn(layer.weight.shape)
    check()
    with torch.no_grad():
        layer.weight.masked_fill_(~layer.mask, 0)
    check()
    layer.mask.data = top2_mask(torch.randn(layer.mask.shape))  # a new mask through .data
    check()


# -- 5. torch.nn.utils.parametrize --
def test_parametrizing_compressed_values_is_refused_with_nothing_changed():
    """torch cannot file a parametrization under 'values' (ModuleDict.values) and failed only after
    removing the Parameter: the layer lost its weight. Refused first now; masked mode's weight works."""
    layer, x, w_ref = _build("trainable")
    want = layer(x)
    snap = model_snapshot(layer)

    class Double(nn.Module):
        def forward(self, t):
            return 2 * t
    with pytest.raises(ValueError, match="values"):
        P.register_parametrization(layer, "values", Double())
    assert type(layer) is Sparse24Linear and not P.is_parametrized(layer)
    assert_model_unchanged(layer, snap)
    assert torch.equal(layer(x), want)
    layer.to_masked()
    P.register_parametrization(layer, "weight", Double())
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert_matches_reference(layer(x), x, 2 * w_ref, layer.bias)


# -- 6. share_memory() --
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_share_memory_shares_the_decode_layout(quantize):
    lin = nn.Linear(64, 32, dtype=torch.float16)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize=quantize,
                                       **({"group_size": 32} if quantize == "int4" else {})).to_layout("decode")
    x = torch.randn(3, 64, dtype=torch.float16)
    want = layer(x)
    layer.share_memory()
    assert layer.layout == "decode"
    tensors = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    assert {"values", "meta", "bias"} <= tensors.keys()
    assert all(t.is_shared() for t in tensors.values()), [n for n, t in tensors.items() if not t.is_shared()]
    assert torch.equal(layer(x), want)


def test_to_layout_decode_again_refreshes_the_bf16_scale_copy():
    """docs/modules.md: an INT4 decode-layout layer's bfloat16 copy of its scales does not see a write
    through .data (no version change, the same storage); to_layout("decode") again takes a new copy."""
    lin = nn.Linear(64, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(distinct_weight(32, 64, torch.bfloat16))
    mask = top2_mask(lin.weight)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=32)
    with torch.no_grad():
        layer.scale.copy_(layer.scale.bfloat16().half())  # scales bfloat16 holds exactly: the copy is kept
    w_ref = int4_dequantized_reference(layer, mask)
    layer.to_layout("decode")
    assert layer.__dict__.get("_scale_bf16") is not None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    layer.scale.data.mul_(2)  # exact; unseen by the version counter
    layer.to_layout("decode")
    with torch.no_grad():
        assert_matches_reference(layer(x), x, (2 * w_ref).to(torch.bfloat16).double(), layer.bias)

"""Inputs of the format and module floors (review round 4): a non-bool trainable_values (it broke the
layer), compress / quantize_values reading symmetric=None as asymmetric, is_nm's int64 count, meta
tensors, dequantized_values' dtype, copy.copy of a masked layer unmasking the original's gradients,
GradualPruner.sparsity_at(nan), learn_masks selecting no layer. Each compared with an independent
reference (float64 masked dense weight, a Python count, a deep copy from before the call)."""
import copy
import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sparse24 import Sparse24Linear, compress, compress_, is_nm, mask_nm, quantize_values, sparsify_
from sparse24.learn import learn_masks
from sparse24.masks import prune_nm
from sparse24.recipes import GradualPruner

from conftest import assert_unchanged, state, top2_mask


def masked_layer(seed=0, C=64, R=8):
    torch.manual_seed(seed)
    return Sparse24Linear.from_linear(nn.Linear(C, R))


# --- bug 1: trainable_values must be a bool ------------------------------------------------------

NOT_BOOL = [0, None, np.float64(0), 1, "yes"]  # (numpy bools are bools: test_numpy_bools_are_bools)


@pytest.mark.parametrize("tv", NOT_BOOL, ids=repr)
def test_to_compressed_refuses_non_bool_trainable_values_and_keeps_the_layer(tv):
    layer = masked_layer()
    x = torch.randn(3, 64)
    ref = F.linear(x.double(), layer.weight.detach().double() * top2_mask(layer.weight.detach()),
                   layer.bias.detach().double())
    before = state(layer)
    with pytest.raises(TypeError, match="trainable_values must be a bool"):
        layer.to_compressed(trainable_values=tv)
    assert layer.mode == "masked"
    assert_unchanged(layer, before)
    torch.testing.assert_close(layer(x).double(), ref)


@pytest.mark.parametrize("tv", NOT_BOOL, ids=repr)
def test_every_door_refuses_non_bool_trainable_values(tv):
    with pytest.raises(TypeError, match="trainable_values must be a bool"):
        Sparse24Linear(64, 8, mode="compressed", trainable_values=tv)
    with pytest.raises(TypeError, match="trainable_values must be a bool"):
        Sparse24Linear.from_linear(nn.Linear(64, 8), mode="compressed", trainable_values=tv)
    model = nn.Sequential(nn.Linear(64, 64))
    before = state(model)
    with pytest.raises(TypeError, match="trainable_values must be a bool"):
        sparsify_(model, mode="compressed", trainable_values=tv, skip_output_head=False)
    assert type(model[0]) is nn.Linear
    assert_unchanged(model, before)
    sparsify_(model, skip_output_head=False)
    before = state(model)
    with pytest.raises(TypeError, match="trainable_values must be a bool"):
        compress_(model, trainable_values=tv)
    assert model[0].mode == "masked"
    assert_unchanged(model, before)


def test_a_failure_making_the_values_parameter_leaves_the_layer_intact(monkeypatch):
    layer = masked_layer()
    weight, mask, before = layer.weight, layer.mask, state(layer)

    class Boom(nn.Parameter):
        def __new__(cls, *args, **kwargs):
            raise MemoryError("no memory for the values")

    monkeypatch.setattr(nn, "Parameter", Boom)
    with pytest.raises(MemoryError):
        layer.to_compressed()
    monkeypatch.undo()
    assert layer.mode == "masked" and layer.weight is weight and layer.mask is mask
    assert_unchanged(layer, before)


# --- bug 2: compress / quantize_values check the INT4 options as quant_options does ---------------

def int4_symmetric_reference(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The documented symmetric INT4 grid, in float64: the top-2 kept weights of each group of 4, per row and
    quantization group of ``group_size`` columns scale = fp16(amax / 7), value = clamp(round(w / scale), -7, 7)
    * scale."""
    kept = w.double() * top2_mask(w)
    R, C = kept.shape
    g = kept.view(R, C // group_size, group_size)
    scale = (g.abs().amax(-1, keepdim=True) / 7).half().double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(g / scale).clamp(-7, 7) * scale).view(R, C)


@pytest.mark.parametrize("call", ["compress", "quantize_values"])
def test_symmetric_none_is_the_default_symmetric_grid(call):
    torch.manual_seed(0)
    w = torch.randn(13, 64)
    if call == "compress":
        q = compress(w, quantize="int4", group_size=32, symmetric=None)
    else:
        q = quantize_values(compress(w), "int4", group_size=32, symmetric=None)
    assert q.zero is None  # asymmetric before the fix: zero points
    assert torch.equal(q.to_dense().double(), int4_symmetric_reference(w, 32))
    # group_size=None is the default (128) too
    q = compress(torch.randn(4, 256), quantize="int4", group_size=None)
    assert q.group_size == 128 and q.zero is None


@pytest.mark.parametrize("symmetric", ["False", 0, np.float64(0)], ids=repr)
def test_symmetric_must_be_a_bool(symmetric):
    w = torch.randn(4, 64)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        compress(w, quantize="int4", symmetric=symmetric)
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        quantize_values(compress(w), "int4", symmetric=symmetric)


@pytest.mark.parametrize("kwargs", [{"group_size": 32}, {"symmetric": False}, {"symmetric": True}], ids=str)
def test_int8_refuses_int4_options(kwargs):
    w = torch.randn(4, 64)
    p = compress(w)
    with pytest.raises(TypeError, match="only apply to quantize='int4'"):
        quantize_values(p, "int8", **kwargs)
    with pytest.raises(TypeError, match="only apply to quantize='int4'"):
        compress(w, quantize="int8", **kwargs)
    # None is "not given", as in quant_options
    q = quantize_values(p, "int8", group_size=None, symmetric=None)
    assert q.quantized == "int8" and q.scale.shape == (4,)


def test_compress_checks_the_options_before_compressing():
    with pytest.raises(ValueError, match="group_size must be one of"):
        compress(torch.randn(4, 64), quantize="int4", group_size=48)
    with pytest.raises(ValueError, match="unknown quantization mode"):
        compress(torch.randn(4, 64), quantize="int3")


# --- bug 3: is_nm counts in a small integer ---------------------------------------------------------

def is_nm_reference(w: torch.Tensor, n: int, m: int) -> bool:
    rows = w.double().reshape(-1, m).tolist()
    return all(sum(1 for v in row if v != 0) <= n for row in rows)


CASES = [  # (shape, n, m, fill): fill "random" (a random share of zeros) or a constant
    ((7, 16), 2, 4, "random"), ((5, 24), 1, 8, "random"), ((3, 2, 32), 3, 4, "random"), ((64,), 0, 4, "random"),
    ((2, 256), 255, 256, 1.0), ((2, 256), 256, 256, 1.0), ((3, 512), 255, 256, 1.0), ((1, 600), 299, 300, 1.0),
    ((1, 600), 300, 300, 1.0), ((4, 8), 2, 4, float("nan")), ((4, 8), 4, 4, float("inf")), ((4, 8), 0, 4, -0.0),
    ((0, 8), 0, 4, 1.0), ((4, 255), 254, 255, 1.0), ((2, 1024), 400, 512, "random"),
    ((2, 1024), 150, 512, "random"),
]


@pytest.mark.parametrize("shape, n, m, fill", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_is_nm_matches_a_python_count(shape, n, m, fill):
    torch.manual_seed(0)
    if fill == "random":
        w = torch.randn(shape) * (torch.rand(shape) < 0.4)
    else:
        w = torch.full(shape, fill)
    assert is_nm(w, n, m) == is_nm_reference(w, n, m)
    assert is_nm(w.half(), n, m) == is_nm_reference(w, n, m)


@pytest.mark.parametrize("m", [4, 300])
def test_is_nm_random_against_python_count(m):
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        w = torch.randn(3, 2 * m, generator=gen) * (torch.rand(3, 2 * m, generator=gen) < 0.5)
        n = int(torch.randint(0, m + 1, (1,), generator=gen))
        assert is_nm(w, n, m) == is_nm_reference(w, n, m), (trial, n)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor (bytes) any torch op returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_is_nm_temporaries_are_at_most_a_byte_per_weight():
    # (the bool sum defaulted to int64: 2 bytes per weight; with the bool tensor 5.5x an fp16 weight in all)
    w = torch.randn(64, 256, dtype=torch.float16)
    with _LargestOutput() as mode:
        assert not is_nm(w, 2, 4)
    assert 0 < mode.largest <= w.numel()


# --- bug 4: meta tensors and dequantized_values' dtype -------------------------------------------------

def test_meta_tensors_are_refused_with_a_clear_error():
    w = torch.empty(8, 16, device="meta")
    for f in (lambda: mask_nm(w), lambda: mask_nm(w, 1, 4), lambda: compress(w), lambda: prune_nm(w)):
        with pytest.raises(ValueError, match="weight is on the meta device"):
            f()
    with pytest.raises(ValueError, match="w is on the meta device"):
        is_nm(w)
    import sparse24
    for method in ("2d_greedy", "2d_optimal"):   # (other methods than magnitude reached torch's .item() error)
        for f in (lambda: sparse24.mask_nm(w, method=method), lambda: sparse24.masks.prune_nm(w, method=method)):
            with pytest.raises(ValueError, match="weight is on the meta device"):
                f()
    with pytest.raises(ValueError, match="sqnr_db: reference is on the meta device"):
        sparse24.sqnr_db(w, torch.zeros(8, 16))
    layer = masked_layer(C=16)
    before = state(layer)
    with pytest.raises(ValueError, match="delta is on the meta device"):
        layer.add_to_kept_(torch.empty(8, 16, device="meta"))
    assert_unchanged(layer, before)
    meta_layer = Sparse24Linear.from_linear(nn.Linear(16, 8)).to("meta")
    with pytest.raises(ValueError, match="weight is on the meta device"):
        meta_layer.add_to_kept_(torch.zeros(8, 16))


def test_meta_layers_still_defer_their_masks():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    sparsify_(model, skip_output_head=False)
    assert model[0].pending and model[2].pending


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_dequantized_values_refuses_non_float_dtypes(quantize):
    torch.manual_seed(0)
    w = torch.randn(4, 64) * 3
    p = compress(w, quantize=quantize)
    for dtype in (torch.int8, torch.bool, torch.int32):
        with pytest.raises(TypeError, match="floating dtype"):
            p.dequantized_values(dtype)
    for bad in (3, "float32"):
        with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
            p.dequantized_values(bad)
    if quantize is None:   # a float dtype still gives the kept values (float64 reference: w at the top-2 mask)
        assert torch.equal(p.dequantized_values(torch.float64), w.double()[top2_mask(w)].view(4, 32))


# --- bug 5: copy.copy of a masked layer -----------------------------------------------------------------

def _attn():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(64, 4, batch_first=True)
    sparsify_(nn.Sequential(attn), skip_output_head=False)
    return attn


def _pruned_grads(attn, layer):
    attn.zero_grad(set_to_none=True)
    x = torch.randn(2, 5, 64)
    attn(x, x, x)[0].pow(2).sum().backward()   # MultiheadAttention reads out_proj.weight directly
    return int((layer.weight.grad[~layer.mask] != 0).sum())


def test_a_dropped_shallow_copy_keeps_the_original_masked():
    attn = _attn()
    layer = attn.out_proj
    assert _pruned_grads(attn, layer) == 0
    shallow = copy.copy(layer)   # as torch.distributed.pipelining's PipeSequential copies children
    assert shallow.weight is layer.weight
    del shallow
    gc.collect()
    assert _pruned_grads(attn, layer) == 0


def test_a_shallow_copy_takes_over_when_the_original_dies():
    attn = _attn()
    shallow = copy.copy(attn.out_proj)
    weight, mask = shallow.weight, shallow.mask.clone()
    attn.out_proj = nn.Linear(64, 64)   # the original layer dies; its copy still masks the weight
    gc.collect()
    out = F.linear(torch.randn(3, 64), weight).pow(2).sum()
    out.backward()
    assert int((weight.grad[~mask] != 0).sum()) == 0 and int((weight.grad[mask] != 0).sum()) > 0


# --- bug 6: GradualPruner.sparsity_at takes an int step ------------------------------------------------

@pytest.mark.parametrize("step", [float("nan"), float("inf"), 5.0, True, np.int64(5)], ids=repr)
def test_sparsity_at_refuses_non_int_steps(step):
    torch.manual_seed(0)
    p = GradualPruner(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), 0.5, start_step=0,
                      end_step=10, frequency=2, skip_output_head=False)
    with pytest.raises(TypeError, match="step must be an int"):
        p.sparsity_at(step)
    assert p.sparsity_at(5) == pytest.approx(0.5 - 0.5 * 0.5 ** 3, abs=1e-12)


# --- bug 7: learn_masks selecting no layer ------------------------------------------------------------

def test_learn_masks_refuses_a_model_with_no_layer_selected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    before = state(model)
    with pytest.raises(ValueError, match="learn_masks: no torch.nn.Linear layer selected in Sequential.*min_features"):
        learn_masks(model, [torch.randn(8, 16)], steps=3, progress=False)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert_unchanged(model, before)

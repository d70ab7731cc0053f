"""Special values (review): a non-finite bias refused up front, overflow past a 16-bit weight's range
refused where a float32/float64 result is cast back (LoRA merge, SparseGPT / reconstruction), pruned
inf weights zeroed (not NaN), and NaN bits kept by compress."""
import pytest
import torch
from torch import nn

import sparse24
from conftest import assert_model_unchanged, assert_unchanged, model_snapshot, state
from sparse24 import Sparse24Linear
from sparse24.format import compress
from sparse24.masks.calibrate import _teacher_target
from sparse24.masks.nm import LayerStats
from sparse24.masks.reconstruct import reconstruct_weight
from sparse24.masks.sparsegpt import sparsegpt_prune
from sparse24.recipes import SRSTE, GradualPruner

INF, NAN = float("inf"), float("nan")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))




def _top2_mask(w: torch.Tensor) -> torch.Tensor:
    """Independent 2:4 magnitude mask in fp64: the 2 largest |w| of each group of 4, ties to the lower column."""
    a = w.detach().double().abs().reshape(-1, 4)
    idx = torch.sort(a, dim=-1, descending=True, stable=True).indices[:, :2]
    return torch.zeros_like(a, dtype=torch.bool).scatter_(-1, idx, True).view(w.shape)


# -- 1. a non-finite bias: refused by sparsify_ / compress_ / from_linear, as load_state_dict refuses it --

@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_sparsify_refuses_a_non_finite_bias_naming_the_layer(mode):
    model = _net()
    with torch.no_grad():
        model[0].bias[3] = NAN
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=r"sparsify_: layer '0': bias has 1 non-finite value\(s\).*index \(3,\)"):
        sparse24.sparsify_(model, mode=mode)
    assert_model_unchanged(model, snap)
    with pytest.raises(ValueError, match="bias has 1 non-finite"):
        Sparse24Linear.from_linear(model[0])


def test_compress_refuses_a_non_finite_bias_naming_the_layer():
    model = _net()
    sparse24.sparsify_(model)
    with torch.no_grad():
        model[0].bias[2] = INF
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=r"compress_: layer '0': bias has 1 non-finite.*nothing was changed"):
        sparse24.compress_(model)
    assert_model_unchanged(model, snap)
    assert model[0].mode == "masked"


def test_a_finite_bias_sparsified_model_reloads():  # the control: what sparsify_ accepts, its own load accepts
    model = _net()
    sparse24.sparsify_(model, mode="compressed")
    again = _net()
    sparse24.sparsify_(again, mode="compressed")
    again.load_state_dict(model.state_dict())


# -- 2. LoRA merge: a non-finite lora_bias is refused whatever safe_merge says --

def test_lora_merge_refuses_a_non_finite_lora_bias():
    pytest.importorskip("peft")
    import sparse24.lora
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    sparse24.sparsify_(model, skip_output_head=False)
    sparse24.lora.register()
    pm = get_peft_model(model, LoraConfig(target_modules=["0"], r=2, init_lora_weights=False, lora_bias=True))
    layer = pm.base_model.model[0]
    base = layer.get_base_layer()
    before = state(base)
    lora_b = layer.lora_B["default"].bias
    with torch.no_grad():
        lora_b[5] = NAN
    with pytest.raises(ValueError, match=r"lora_bias of adapter 'default' has 1 non-finite.*nothing was changed"):
        layer.merge()   # safe_merge=False
    assert_unchanged(base, before)
    assert not layer.merged
    # the control: a finite lora_bias merges as base bias + scaling * lora_bias (fp64 reference)
    with torch.no_grad():
        lora_b[5] = 0.25
    want = (before["bias"].double() + layer.scaling["default"] * lora_b.detach().double()).float()
    layer.merge()
    torch.testing.assert_close(base.bias.detach(), want, rtol=2 ** -23, atol=0)


# -- 3. add_to_kept_: a finite delta whose sum overflows the layer's float16 --

LAYOUTS = [({"mode": "masked"}, None), ({"mode": "compressed"}, "v1"), ({"mode": "compressed"}, "decode"),
           ({"mode": "compressed", "quantize": "int8"}, "v1"),
           ({"mode": "compressed", "quantize": "int8"}, "decode")]


@pytest.mark.parametrize("kw,layout", LAYOUTS, ids=["masked", "fp16-v1", "fp16-decode", "int8-v1", "int8-decode"])
def test_add_to_kept_refuses_a_delta_overflowing_float16(kw, layout):
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(16, 8).half(), **kw)
    if layout is not None:
        layer.to_layout(layout)
    mask = layer.mask.clone() if layer.mode == "masked" else layer.sparse_tensor().kept_mask()
    w0 = layer.dense_weight().double()
    before = state(layer)
    with pytest.raises(ValueError, match=r"the merged weight.*W \+ delta overflows the layer's torch.float16"):
        layer.add_to_kept_(torch.full((8, 16), 1e5))   # finite in float32, past float16's 65504
    assert_unchanged(layer, before)
    if layout is not None:
        assert layer._layout == layout
    # the control: a delta in range merges at the kept positions
    delta = torch.randn(8, 16)
    layer.add_to_kept_(delta)
    ref = torch.where(mask, w0 + delta.half().double(), 0)
    # 16-bit: one rounding of an exact fp16 sum; INT8: within one quantization step of the row
    atol = ref.abs().amax(1, keepdim=True) / 127 if "quantize" in kw else 0.0
    got = layer.dense_weight().double()
    assert bool(((got - ref.half().double()).abs() <= atol).all())
    assert bool((got[~mask] == 0).all())


# -- 4. pruned inf weights become 0, not NaN (GradualPruner, SR-STE); SR-STE's NaN error names the layer --

def test_gradual_pruner_zeroes_a_pruned_inf_weight():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    pruner = GradualPruner(model, (2, 4), start_step=0, end_step=10, frequency=10, min_features=0)
    pruner.step(10)
    mask = pruner.masks["0"]
    r, c = (~mask).nonzero()[0].tolist()
    with torch.no_grad():
        model[0].weight[r, c] = INF   # an optimizer step overflowed this pruned weight
    ref = torch.where(mask, model[0].weight.detach().double(), 0)
    pruner.step(11)
    pruner.step(12)
    assert torch.equal(model[0].weight.detach().double(), ref)
    assert bool(torch.isfinite(model(torch.randn(3, 16))).all())


def test_srste_zeroes_a_pruned_inf_weight_in_forward_and_finalize():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    srste = SRSTE(model, 2, 4, min_features=0)
    with torch.no_grad():
        model[0].parametrizations.weight.original[0, :3] = INF   # 3 infs in one group: one is pruned
    w = model[0].parametrizations.weight.original.detach().clone()
    ref = torch.where(_top2_mask(w), w.double(), 0)
    assert torch.equal(model[0].weight.detach().double(), ref)   # the forward's masked weight
    srste.finalize()
    assert torch.equal(model[0].weight.detach().double(), ref)


def test_srste_nan_weight_error_names_the_layer():
    model = _net()
    srste = SRSTE(model, 2, 4, min_features=0)
    with torch.no_grad():
        model[0].parametrizations.weight.original[1, 2] = NAN   # a diverged step
    with pytest.raises(ValueError, match=r"SRSTE: layer '0': weight contains NaN"):
        model(torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"SRSTE: layer '0': weight contains NaN"):
        srste.finalize()
    assert not srste.finalized and hasattr(model[0], "parametrizations")


# -- 5. SparseGPT / reconstruction / teacher fit: a float32 result past float16's range --

def _collinear_hessian() -> torch.Tensor:
    """Three nearly collinear inputs per group of 4: the compensation moves their kept weights far."""
    torch.manual_seed(0)
    base = torch.randn(512, 1)
    x = torch.cat([base, base, base, torch.randn(512, 1)], 1).repeat(1, 8) + 1e-3 * torch.randn(512, 32)
    return x.T @ x


def test_sparsegpt_and_reconstruct_refuse_a_float16_overflow():
    H = _collinear_hessian()
    w = torch.tensor([[50000., 50000., 50000., 1.0] * 8] * 4).half()   # finite float16
    w0 = w.clone()
    ref, mask = sparsegpt_prune(w.float(), H)
    assert bool(torch.isfinite(ref).all()) and float(ref.abs().max()) > 65504   # the fit itself is finite
    with pytest.raises(ValueError, match=r"SparseGPT's reconstructed weight does not fit torch.float16"):
        sparsegpt_prune(w, H)
    with pytest.raises(ValueError, match=r"the reconstructed weight does not fit torch.float16"):
        sparsegpt_prune(w, H, refit=True)
    refit = reconstruct_weight(w.float(), mask, H)
    assert bool(torch.isfinite(refit).all()) and float(refit.abs().max()) > 65504
    with pytest.raises(ValueError, match=r"the reconstructed weight does not fit torch.float16"):
        reconstruct_weight(w, mask, H)
    assert torch.equal(w, w0)


def test_teacher_target_refuses_a_float16_overflow():
    torch.manual_seed(0)
    x = torch.randn(256, 8, dtype=torch.float64)
    stats = LayerStats(sq_sum=(x ** 2).sum(0), count=256, xtx=x.T @ x, xtx_teacher=x.T @ (10 * x))
    w = torch.full((4, 8), 30000.0).half()
    ref = _teacher_target(w.float(), stats)   # the teacher's inputs are 10x: the target is ~10 W
    assert bool(torch.isfinite(ref).all()) and float(ref.abs().max()) > 65504
    with pytest.raises(ValueError, match=r"the weight fit to the teacher's outputs does not fit torch.float16"):
        _teacher_target(w, stats)


# -- 6. compress keeps every bit of a kept 16-bit value (NaN sign and payload included) --

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compress_is_bit_exact_for_nan_payloads(dtype):
    torch.manual_seed(0)
    bits = torch.randint(-2 ** 15, 2 ** 15, (13, 32), dtype=torch.int32).to(torch.int16)
    bits[0, :4] = torch.tensor([0x7fc1, -0x3f, 0x7f81, 0x7e01], dtype=torch.int16)   # +NaN, -NaN payloads
    w = bits.view(dtype)
    mask = torch.zeros(13, 8, 4, dtype=torch.bool)
    mask.scatter_(-1, torch.rand(13, 8, 4).argsort(-1)[..., :2], True)
    mask = mask.view(13, 32)
    mask[0, :4] = torch.tensor([True, True, False, False])
    want = torch.where(mask, bits, 0)   # the masked weight's bits
    got = compress(w, mask).to_dense().view(torch.int16)
    assert torch.equal(got, want)

"""Review findings on Sparse24Linear and the whole-model calls: the logical dtype after
load_state_dict(assign=True), gradients of a weight frozen when sparsified and read directly,
strict loads refused with nothing changed, forward on the meta device, the output-head
heuristic, the training flag of swapped layers."""
import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear

from conftest import (assert_matches_reference, dequantized_reference, int4_dequantized_reference, model_snapshot,
                      assert_model_unchanged, tolerance, top2_mask)

QUANT = {None: {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4", "group_size": 32}}


def distinct_weight(R, C, dtype, seed=0):
    """(R, C) weight whose groups of 4 hold magnitudes 1..4 (permuted, random signs) times a power of 2:
    exact in every 16-bit dtype and without ties, so the 2:4 magnitude mask is unique."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.stack([torch.randperm(4, generator=g) + 1 for _ in range(R * C // 4)]).view(R, C).double()
    signs = torch.randint(0, 2, (R, C), generator=g) * 2 - 1
    return (mags * signs / 8).to(dtype)


def dense_checkpoint(dtype, bias):
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.ReLU(), nn.Linear(64, 64, bias=bias)).to(dtype)
    with torch.no_grad():
        for i in (0, 2):
            dense[i].weight.copy_(distinct_weight(64, 64, dtype, seed=i))
    return dense.state_dict()


def reference_weight(layer, w, quantize):
    """The fp64 dense weight the layer must compute with: the kept entries of the checkpoint's
    weight, or the stored INT8/INT4 values dequantized as the format defines them."""
    mask = top2_mask(w)
    if quantize is None:
        return torch.where(mask, w, 0).double()
    return (dequantized_reference if quantize == "int8" else int4_dequantized_reference)(layer, mask)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("quantize", list(QUANT))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("source", ["dense", "compressed"])
def test_assign_load_takes_the_checkpoints_dtype(source, dtype, quantize, bias):
    """load_state_dict(assign=True) into a compressed model built on meta (docs/modules.md 'Meta
    device') with a 16-bit checkpoint: the layers' logical dtype is the checkpoint's, as nn.Linear's
    (it stayed float32 beside 16-bit values: every forward, dense_weight and to_masked raised)."""
    sd = dense_checkpoint(dtype, bias)
    if source == "compressed":  # a checkpoint of the compressed model itself (INT: bias the only hint)
        done = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.ReLU(), nn.Linear(64, 64, bias=bias)).to(dtype)
        done.load_state_dict(sd)
        sparse24.sparsify_(done, mode="compressed", skip_output_head=False, **QUANT[quantize])
        sd_in = done.state_dict()
    else:
        sd_in = sd
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.ReLU(), nn.Linear(64, 64, bias=bias))
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False, **QUANT[quantize])
    lone = Sparse24Linear(64, 64, bias=bias, mode="compressed", device="meta", **QUANT[quantize])  # no model hook
    model.load_state_dict(sd_in, assign=True)
    lone.load_state_dict({k[2:]: v for k, v in sd_in.items() if k.startswith("0.")}, assign=True)
    knows = quantize is None or bias or source == "dense"  # a quantized, bias-less compressed file names no dtype
    for layer in (model[0], lone, model[2]):
        assert layer.dtype == (dtype if knows else torch.float32)
        assert not layer.pending
        x = torch.randn(3, 64).to(layer.dtype)
        key = "2." if layer is model[2] else "0."
        b = sd[key + "bias"] if bias else None
        w = reference_weight(layer, sd[key + "weight"], quantize)
        y = layer(x)
        assert y.dtype == layer.dtype
        assert_matches_reference(y, x, w.to(layer.dtype), b)
        assert layer.dense_weight().dtype == layer.dtype
        assert torch.equal(layer.dense_weight().double(), w.to(layer.dtype).double())
        assert layer.to_masked().weight.dtype == layer.dtype


def test_frozen_then_unfrozen_direct_reader_gradient_masked():
    """nn.MultiheadAttention reads out_proj.weight directly (out_proj's forward never runs): a
    layer frozen when sparsified, trained after requires_grad_(True), had its pruned gradients
    unmasked, and clip_grad_norm_ counted them."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.float64)
    model = nn.ModuleDict({"attn": mha}).requires_grad_(False)
    sparse24.sparsify_(model, skip_output_head=False)
    op = mha.out_proj
    assert isinstance(op, Sparse24Linear) and op.mode == "masked"
    model.requires_grad_(True)
    # the reference: a plain fp64 MultiheadAttention with the masked weight, its gradient masked
    ref = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.in_proj_weight)
        ref.in_proj_bias.copy_(mha.in_proj_bias)
        ref.out_proj.weight.copy_(op.dense_weight())
        ref.out_proj.bias.copy_(op.bias)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    for m in (mha, ref):
        out, _ = m(x, x, x)
        out.pow(2).sum().backward()
    assert bool((op.weight.grad[~op.mask] == 0).all())
    ref_grads = [ref.in_proj_weight.grad, ref.in_proj_bias.grad, torch.where(op.mask, ref.out_proj.weight.grad, 0),
                 ref.out_proj.bias.grad]
    torch.testing.assert_close(op.weight.grad, ref_grads[2], **tolerance(torch.float64, 64))
    n = sum(g.numel() for g in ref_grads)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    torch.testing.assert_close(total, torch.cat([g.flatten() for g in ref_grads]).norm(), **tolerance(torch.float64, n))


def test_sparsify_masks_a_gradient_already_there():
    """A gradient accumulated before sparsify_ (mid accumulation) is masked with the weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, dtype=torch.float64))
    model(torch.randn(3, 64, dtype=torch.float64)).pow(2).sum().backward()
    grad = model[0].weight.grad.clone()
    sparse24.sparsify_(model, skip_output_head=False)
    layer = model[0]
    assert layer.weight.grad is not None and torch.equal(layer.weight.grad, torch.where(layer.mask, grad, 0))


def _bn_model(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.Linear(64, 64))
    sparse24.sparsify_(m, skip_output_head=False)
    return m


@pytest.mark.parametrize("case", ["unexpected key", "missing layer", "unexpected under the BatchNorm's parent"])
def test_refused_strict_load_changes_nothing_beside_a_batchnorm(case):
    """A module with its own _load_from_state_dict (BatchNorm) turned the strict-key pre-check off for
    the whole model: the load raised only after every module copied the file's tensors."""
    model, other = _bn_model(0), _bn_model(1)
    sd = other.state_dict()
    sd = {"unexpected key": {**sd, "2.typo": torch.zeros(1)},
          "missing layer": {k: v for k, v in sd.items() if not k.startswith("3.")},
          "unexpected under the BatchNorm's parent": {**sd, "typo": torch.zeros(1)}}[case]
    snap = model_snapshot(model)
    with pytest.raises(RuntimeError, match="load_state_dict copied nothing"):
        model.load_state_dict(sd)
    assert_model_unchanged(model, snap)
    report = model.load_state_dict(sd, strict=False)  # non-strict: torch's report, the rest loads
    assert report.unexpected_keys + report.missing_keys
    assert torch.equal(model[1].running_mean, other[1].running_mean)


def test_keys_under_a_module_with_its_own_loading_are_its_business():
    """The pre-check cannot foresee what BatchNorm does with its entries (it adds num_batches_tracked
    to a checkpoint without version metadata): a strict load lacking it is torch's to accept."""
    model, other = _bn_model(0), _bn_model(1)
    sd = {k: v for k, v in other.state_dict().items() if k != "1.num_batches_tracked"}
    model.load_state_dict(sd)
    assert torch.equal(model[1].running_mean, other[1].running_mean)
    assert torch.equal(model[2].weight, other[2].weight)


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_lone_layer_refuses_an_unexpected_key_with_nothing_changed(mode):
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32), mode=mode)
    sd = {**Sparse24Linear.from_linear(nn.Linear(64, 32), mode=mode).state_dict(), "typo": torch.zeros(1)}
    snap = model_snapshot(layer)
    with pytest.raises(RuntimeError, match="Unexpected key.*typo"):
        layer.load_state_dict(sd)
    assert_model_unchanged(layer, snap)
    assert layer.load_state_dict(sd, strict=False).unexpected_keys == ["typo"]
    assert torch.equal(layer.bias, sd["bias"])


QUANT_ON_META = [("masked", None), ("compressed", None), ("compressed", "int8"), ("compressed", "int4")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,quantize", QUANT_ON_META)
def test_forward_on_meta_as_nn_linear(mode, quantize, dtype):
    """Shape inference on meta: the compressed forward raised 'unknown device type for autocast'."""
    dense = nn.Linear(64, 32, dtype=dtype)
    layer = Sparse24Linear.from_linear(dense, mode=mode, **QUANT[quantize]).to("meta")
    x = torch.empty(2, 3, 64, device="meta", dtype=dtype)
    want = dense.to("meta")(x)
    y = layer(x)
    assert (y.shape, y.dtype, y.device) == (want.shape, want.dtype, want.device)


class ByteLM(nn.Module):
    """A byte-level LM: the vocabulary (256) is the model width, so every D -> D layer is as wide as it."""

    def __init__(self, V=256, D=256, tied=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
            self.extra = nn.Linear(D, V)  # after the tied head: the tied one is still the head


def test_one_output_head_only():
    report = sparse24.sparsify_(ByteLM())
    assert [r.fqn for r in report.skipped] == ["emb", "head"]
    assert report.skipped[1].reason.startswith("output head (256 outputs")
    report = sparse24.sparsify_(ByteLM(tied=True))
    assert [r.fqn for r in report.skipped] == ["emb", "head"]
    assert "tied" in report.skipped[1].reason
    assert {r.fqn for r in report.layers if r.action != "skipped"} == {"q", "k", "v", "o", "up", "down", "extra"}


@pytest.mark.parametrize("call", ["sparsify_", "from_linear", "to_dense_module"])
@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_swapped_layers_keep_the_training_flag(call, mode):
    for training in (False, True):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).train(training)
        if call == "from_linear":
            assert Sparse24Linear.from_linear(model[0], mode=mode).training is training
            continue
        sparse24.sparsify_(model, mode=mode, skip_output_head=False)
        if call == "to_dense_module":
            assert model[0].to_dense_module().training is training
            sparse24.densify_(model)
        assert [m.training for m in model.modules()] == [training] * 4


# --- found by the op review ---------------------------------------------------------------

def test_unfreezing_a_decode_layout_layer_trains_the_parameter_the_optimizer_holds():
    # The first forward after unfreezing moved the values to layout v1 in a NEW Parameter: the optimizer
    # built before kept the old one and the weight never trained. The twin never leaves layout v1.
    lin = nn.Linear(64, 16).half()
    twin, layer = (Sparse24Linear.from_linear(nn.Linear(64, 16).half(), mode="compressed") for _ in range(2))
    for m in (twin, layer):
        m.load_state_dict(Sparse24Linear.from_linear(lin, mode="compressed").state_dict())
    layer.to_layout("decode")  # what a CUDA layer holds
    x = torch.randn(8, 64).half()
    for m in (twin, layer):
        for p in m.parameters():
            p.requires_grad_(p.is_floating_point())  # docs/modules.md's unfreeze recipe
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            m(x).float().square().sum().backward()
            opt.step()
        assert any(p is m.values for g in opt.param_groups for p in g["params"])
    assert not torch.equal(layer.dense_weight(), Sparse24Linear.from_linear(lin, mode="compressed").dense_weight())
    assert torch.equal(layer.dense_weight(), twin.dense_weight()) and torch.equal(layer.bias, twin.bias)


def test_compiled_int4_bf16_forward_sees_scales_changed_in_place():
    # The decode layout's bfloat16 copy of INT4 scales was trusted under torch.compile without its
    # version check: after scale.mul_(2) every compiled call used the old scales (error 1.25, eager 0.004)
    lin = nn.Linear(64, 16).bfloat16()
    mask = top2_mask(lin.weight)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=32).to_layout("decode")
    with torch.no_grad():
        layer.scale.mul_(2)
    x = torch.randn(3, 64).bfloat16()
    torch._dynamo.reset()
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    # the weight in the layer's bfloat16 (one rounding of the exact dequantized value), then fp64
    w = int4_dequantized_reference(layer.to_layout("v1"), mask).bfloat16().double()
    assert_matches_reference(out, x, w, layer.bias)


def test_autocast_leaves_float64_input_in_float64():
    lin = nn.Linear(32, 8).double()
    layer = Sparse24Linear.from_linear(lin, mode="compressed")
    x = torch.randn(4, 32, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = layer(x), nn.functional.linear(x, layer.dense_weight(), layer.bias)
    assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-12, atol=1e-12)

"""Whole-model swaps against the same model with its dense weights multiplied by the mask."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear

from conftest import dequantized_reference, top2_mask

D, VOCAB = 32, 50
# Layers of TinyLM that sparsify_ swaps by default; the others are skipped for a stated reason.
SWAPPED = {"proj", "shared", *(f"enc.layers.{i}.{n}" for i in range(2)
                               for n in ("self_attn.out_proj", "linear1", "linear2"))}
DIRECT = {n for n in SWAPPED if n.startswith("enc.")}  # weights read directly by torch's modules
SKIPPED = {"odd_in": "too small to gain", "odd": "in_features=30 is not divisible by 4",
           "head": "weight is shared with emb.weight (tied)", "cls": "too small to gain",
           # modules holding a weight matrix that sparsify_ does not handle are listed too
           "emb": "not handled: Embedding: a lookup table, not a matmul",
           **{f"enc.layers.{i}.self_attn": "not handled: MultiheadAttention: its in_proj_weight is used inside "
                                           "F.multi_head_attention_forward" for i in range(2)}}


class TinyLM(nn.Module):
    """A model with every case sparsify_ must handle: torch's TransformerEncoder (MultiheadAttention
    out_proj and the encoder-layer fast path read Linear weights directly), a Linear reused under two
    names, a tied embedding/head, in_features not divisible by 4, and layers too small to gain."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.proj = nn.Linear(D, D)
        self.shared = nn.Linear(D, D)
        self.side = nn.Sequential(self.shared)  # the same module under a second name
        self.odd_in, self.odd = nn.Linear(D, 30), nn.Linear(30, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.cls = nn.Linear(D, 10)

    def forward(self, tokens, pad=None):
        h = self.enc(self.emb(tokens), src_key_padding_mask=pad)
        h = self.proj(h) + self.side(h) + self.odd(torch.relu(self.odd_in(h)))
        return self.head(h), self.cls(h.mean(1))


def build(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def batch(seed=0, n=3, t=7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, t), generator=g)
    pad = torch.zeros(n, t, dtype=torch.bool)
    pad[0, -2:] = True  # a left-aligned padding mask: lets the nested-tensor fast path run
    return tokens, pad


def masked_reference(model):
    """Deep copy of the dense model with each SWAPPED weight multiplied by its independent 2:4 mask."""
    ref = copy.deepcopy(model)
    masks = {}
    with torch.no_grad():
        for fqn in SWAPPED:
            w = ref.get_submodule(fqn).weight
            masks[fqn] = top2_mask(w)
            w.mul_(masks[fqn])
    return ref, masks


def run(model, tokens, pad, train):
    model.train(train)
    if train:
        return model(tokens)
    with torch.no_grad():
        return model(tokens, pad)


def assert_same_outputs(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_sparsify_matches_masked_dense_model(mode, monkeypatch):
    model = build()
    ref, masks = masked_reference(model)
    report = sparse24.sparsify_(model, mode=mode)
    assert {r.fqn for r in report.swapped} == SWAPPED
    for fqn in SWAPPED:
        m = model.get_submodule(fqn)
        assert isinstance(m, Sparse24Linear)
        assert m.mode == ("masked" if fqn in DIRECT else mode)
        assert torch.equal(m.dense_weight() != 0, masks[fqn])
    assert model.side[0] is model.shared  # every reference to a reused module is swapped

    calls = []
    real = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens, pad = batch()
    for train in (True, False):  # eval + no_grad runs torch's fused fast path on the weights directly
        assert_same_outputs(run(model, tokens, pad, train), run(ref, tokens, pad, train))
    assert len(calls) == 4  # 2 layers x (model, ref): the fast path did read the masked weights


def test_report_lists_skips_with_reasons_and_bytes():
    model = build()
    report = sparse24.sparsify_(model, filter_fn=lambda mod, fqn: fqn != "proj")
    reasons = {r.fqn: r.reason for r in report.skipped}
    assert reasons.keys() == {*SKIPPED, "proj"}
    for fqn, why in SKIPPED.items():
        assert why in reasons[fqn]
    assert reasons["proj"] == "excluded by filter_fn"
    text = str(report)
    assert "sparse24.sparsify_(mode='masked', method='magnitude'): 7 layer(s) changed, 8 skipped" in text
    assert all(f"{fqn}" in text and why in text for fqn, why in reasons.items())
    assert "nn.MultiheadAttention reads out_proj.weight" in text
    assert report.dense_bytes == sum(4 * r.shape[0] * r.shape[1] for r in report.swapped)
    # the predicted compressed size is what compress_ then holds (values + packed 2-bit slots)
    held = {r.fqn: r.compressed_bytes for r in report.swapped}
    creport = sparse24.compress_(model)
    assert {r.fqn for r in creport.changed} == {"shared"}
    for r in creport.changed:
        m = model.get_submodule(r.fqn)
        assert m.values.nbytes + m.meta.nbytes == held[r.fqn] == r.memory_bytes
    assert {r.fqn for r in creport.skipped} == DIRECT
    assert "kept in masked mode" in str(creport)


def test_compress_decompress_densify_keep_outputs():
    model = build()
    sparse24.sparsify_(model)
    tokens, pad = batch(1)
    outs = [run(model, tokens, pad, train) for train in (True, False)]
    sparse24.compress_(model)
    assert model.shared.mode == "compressed"
    for train, out in zip((True, False), outs):
        assert_same_outputs(run(model, tokens, pad, train), out)
    sparse24.decompress_(model)
    assert model.shared.mode == "masked"
    weights = {fqn: model.get_submodule(fqn).weight for fqn in SWAPPED}
    report = sparse24.densify_(model)
    assert {r.fqn for r in report.changed} == SWAPPED
    assert not any(isinstance(m, Sparse24Linear) for m in model.modules())
    assert type(model.enc.layers[0].self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model.proj) is nn.Linear and model.side[0] is model.shared
    assert all(model.get_submodule(f).weight is w for f, w in weights.items())  # same Parameters
    for train, out in zip((True, False), outs):
        assert_same_outputs(run(model, tokens, pad, train), out)
    # densified: no more masking (the optimizer post-hook and gradient hook let go)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(tokens)[0].square().mean().backward()
    opt.step()
    assert bool((model.proj.weight != 0).all())


def prune_then_retrain_reference(ref, ref_opt, masks, steps, data):
    """The recipe written out by hand: mask weights and optimizer state, then mask the gradients before
    and the weights after every step."""
    mods = {fqn: ref.get_submodule(fqn) for fqn in masks}
    with torch.no_grad():
        for fqn, m in mods.items():
            for v in ref_opt.state[m.weight].values():
                if isinstance(v, torch.Tensor) and v.shape == masks[fqn].shape:
                    v.mul_(masks[fqn])
    for _ in range(steps):
        ref_opt.zero_grad()
        loss_fn(ref, data).backward()
        for fqn, m in mods.items():
            m.weight.grad.mul_(masks[fqn])
        ref_opt.step()
        with torch.no_grad():
            for fqn, m in mods.items():
                m.weight.mul_(masks[fqn])


def loss_fn(model, data):
    tokens, target = data
    logits, _ = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def test_prune_trained_model_matches_hand_written_recipe():
    model = build()
    model.train()
    tokens, _ = batch(2, n=4, t=6)
    data = (tokens, torch.roll(tokens, 1, dims=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):  # "trained" dense model with dense optimizer state
        opt.zero_grad()
        loss_fn(model, data).backward()
        opt.step()
    ref, masks = masked_reference(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may share the tensors

    params_before = [p for g in opt.param_groups for p in g["params"]]
    report = sparse24.prune_trained_model(model, opt)
    assert {r.fqn for r in report.swapped} == SWAPPED and report.operation == "prune_trained_model"
    assert [p for g in opt.param_groups for p in g["params"]] == params_before
    for fqn in SWAPPED:  # the optimizer still holds the very Parameters the model trains
        assert any(model.get_submodule(fqn).weight is p for p in params_before)
        assert bool((opt.state[model.get_submodule(fqn).weight]["exp_avg"][~masks[fqn]] == 0).all())

    for _ in range(4):
        opt.zero_grad()
        loss_fn(model, data).backward()
        out_proj = model.enc.layers[0].self_attn.out_proj  # read directly by MultiheadAttention
        assert bool((out_proj.weight.grad[~out_proj.mask] == 0).all())
        opt.step()
    prune_then_retrain_reference(ref, ref_opt, masks, 4, data)
    for fqn in SWAPPED:
        w, w_ref = model.get_submodule(fqn).weight.detach(), ref.get_submodule(fqn).weight.detach()
        assert bool((w[~masks[fqn]] == 0).all())
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_mask_methods_and_calibration_are_forwarded():
    model = build()
    tokens, pad = batch(3)
    sparse24.sparsify_(model, method="2d_optimal")
    for fqn in SWAPPED:  # transposable: W^T is 2:4 too
        m = model.get_submodule(fqn).mask
        assert sparse24.is_nm(m) and sparse24.is_nm(m.t().contiguous())

    model = build()
    stats = sparse24.calibrate(model, [tokens])
    del stats["proj"]
    weights = {f: model.get_submodule(f).weight.detach().clone() for f in SWAPPED}
    with pytest.raises(ValueError, match="no statistics for 1 layer.s. that method='wanda' would prune: 'proj'"):
        sparse24.sparsify_(model, method="wanda", calibration=stats)  # a layer left out is an error, as None is
    report = sparse24.sparsify_(model, lambda mod, fqn: fqn != "proj", method="wanda", calibration=stats)
    reasons = {r.fqn: r.reason for r in report.skipped}
    assert reasons["proj"] == "excluded by filter_fn"
    out_projs = {f"enc.layers.{i}.self_attn.out_proj" for i in range(2)}  # MultiheadAttention never calls them
    assert all("reads out_proj.weight in its functional forward, so calibrate() never sees" in reasons[f]
               for f in out_projs)
    assert {r.fqn for r in report.swapped} == SWAPPED - {"proj"} - out_projs
    for fqn in SWAPPED - {"proj"} - out_projs:  # Wanda score |W_ij| * ||x_j||, computed here independently
        score = weights[fqn].double().abs() * stats[fqn].act_norm.double()
        assert torch.equal(model.get_submodule(fqn).mask, top2_mask(score))

    model = build()
    stats = sparse24.calibrate(model, [tokens], hessian=True)
    w0 = model.proj.weight.detach().clone()
    sparse24.sparsify_(model, method="sparsegpt", calibration=stats)
    new_w, mask = sparse24.masks.sparsegpt_prune(w0, stats["proj"].hessian)
    assert torch.equal(model.proj.weight.detach(), new_w) and torch.equal(model.proj.mask, mask)
    assert not torch.equal(new_w, w0 * mask)  # the reconstructed weights are the ones stored


@pytest.mark.parametrize("kind", ["masked", "compressed", "int8"])
def test_checkpoint_loads_into_fresh_model_bit_identical(kind):
    def prepared(seed):
        model = build(seed)
        sparse24.sparsify_(model)
        if kind != "masked":
            sparse24.compress_(model, quantize="int8" if kind == "int8" else None)
        return model.eval()

    src = prepared(0)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())  # plain tensors: safetensors-compatible
    fresh = prepared(1)
    tokens, pad = batch(4)
    with torch.no_grad():
        assert not torch.equal(fresh(tokens, pad)[0], src(tokens, pad)[0])
        fresh.load_state_dict(sd)
        for a, b in zip(fresh(tokens, pad), src(tokens, pad)):
            assert torch.equal(a, b)


def test_dense_checkpoint_into_sparse_model_is_a_clear_error():
    dense_sd = build(0).state_dict()
    model = build(1)
    sparse24.sparsify_(model)
    before = {k: v.clone() for k, v in model.shared.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"shared: got a dense checkpoint \('shared.weight' without a 2:4 mask\)"):
        model.load_state_dict(dense_sd)
    assert all(torch.equal(v, model.shared.state_dict()[k]) for k, v in before.items())


def test_bad_arguments_change_nothing():
    model = build()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="mode must be one of"):
        sparse24.sparsify_(model, mode="dense")
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        sparse24.sparsify_(model, filter_fn=3)
    with pytest.raises(ValueError, match="quantize applies to mode='compressed'"):
        sparse24.sparsify_(model, quantize="int8")
    with pytest.raises(TypeError, match="calibration must be a dict"):
        sparse24.sparsify_(model, method="wanda", calibration=[1])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        sparse24.sparsify_("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        sparse24.prune_trained_model(model, [])
    with pytest.raises(ValueError, match="prune_trained_model retrains in masked mode"):
        sparse24.prune_trained_model(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="compressed")
    with pytest.raises(ValueError, match="optimizer goes with mode='masked'"):
        sparse24.sparsify_(model, mode="compressed", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for bad in (0, 1, 2.0):
        with pytest.raises(TypeError, match="skip_output_head must be True, False, a layer name or a list"):
            sparse24.sparsify_(model, skip_output_head=bad)
    assert not any(isinstance(m, Sparse24Linear) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    sparse24.sparsify_(model, mode="compressed")
    with pytest.raises(ValueError, match="layer 'proj' is already compressed with quantize=None"):
        sparse24.compress_(model, quantize="int8")
    assert model.proj.quantize is None and model.shared.quantize is None


def test_a_failing_layer_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 34))  # 34 rows: no 4x4 blocks for 2-D masks
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"sparsify_: layer '1': .*rows \(34\) must be divisible by m=4.*"
                                         r"\(nothing was changed\)"):
        sparse24.sparsify_(model, method="2d_optimal")
    assert all(type(m) is nn.Linear for m in model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())


def test_compress_int8_failing_layer_leaves_the_model_untouched():
    # compress_ used to compress layer '0' and then raise on layer '1' (inf weight cannot be int8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    sparse24.sparsify_(model)
    with torch.no_grad():
        model[1].weight[0, model[1].mask[0].nonzero()[0, 0]] = float("inf")
    for quantize in ("int8", None):  # inf is refused with or without quantization
        with pytest.raises(ValueError, match=r"compress_: layer '1': weight has 1 non-finite value.*"
                                             r"\(nothing was changed\)"):
            sparse24.compress_(model, quantize=quantize)
        assert [m.mode for m in model] == ["masked", "masked"]


def test_sparsify_compressed_int8_matches_dequantized_model():
    model = build()
    ref, masks = masked_reference(model)
    report = sparse24.sparsify_(model, mode="compressed", quantize="int8")
    assert "quantize='int8'" in str(report)
    for r in report.swapped:
        m = model.get_submodule(r.fqn)
        if r.fqn in DIRECT:
            assert m.mode == "masked" and r.reason.startswith("kept in masked mode")
            continue
        assert m.quantize == "int8" and m.values.dtype == torch.int8
        R, C = r.shape
        held = m.values.nbytes + m.meta.nbytes + m.scale.nbytes
        assert held == r.compressed_bytes == r.memory_bytes == R * C // 2 + R * C // 8 + 4 * R
        with torch.no_grad():  # the reference holds the dequantized weight, placed by the independent mask
            ref.get_submodule(r.fqn).weight.copy_(dequantized_reference(m, masks[r.fqn]))
    tokens, pad = batch(5)
    for train in (True, False):
        assert_same_outputs(run(model, tokens, pad, train), run(ref, tokens, pad, train))


def test_sparsify_reports_kept_magnitude_per_layer():
    # Independent check: sum |W| under the layer's final mask over sum |W|, in fp64 on a copy
    # of the weight taken before pruning; magnitude keeps the most a 2:4 mask can.
    kept = {}
    for method in ("magnitude", "2d_optimal"):
        torch.manual_seed(0)  # the same weights for both methods
        model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
        before = {"0": model[0].weight.detach().double().clone(), "2": model[2].weight.detach().double().clone()}
        report = sparse24.sparsify_(model, method=method)
        for r in report.swapped:
            w, mask = before[r.fqn], model[int(r.fqn)].mask
            expect = float((w.abs() * mask).sum() / w.abs().sum())
            assert r.kept_fraction == pytest.approx(expect, rel=1e-12)
            kept[method, r.fqn] = r.kept_fraction
        assert "kept |W|" in str(report)
    assert all(kept["magnitude", f] > kept["2d_optimal", f] for f in ("0", "2"))


def test_swaps_carry_the_layers_hooks_over():
    # a user's activation and gradient hooks keep firing on the swapped layer, and their handles still
    # remove them (torch.ao.quantization's swap_module carries hooks over too)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    seen = []
    handles = [model[0].register_forward_pre_hook(lambda m, a: seen.append("pre")),
               model[0].register_forward_hook(lambda m, a, y: seen.append(("out", type(m).__name__))),
               model[0].register_full_backward_hook(lambda m, gi, go: seen.append("backward"))]
    sparse24.sparsify_(model, skip_output_head=False)
    x = torch.randn(2, 64, requires_grad=True)
    model(x).sum().backward()
    assert seen == ["pre", ("out", "Sparse24Linear"), "backward"]
    sparse24.densify_(model)
    seen.clear()
    model(x).sum().backward()
    assert seen == ["pre", ("out", "Linear"), "backward"]
    for h in handles:
        h.remove()
    seen.clear()
    model(x).sum().backward()
    assert seen == []

"""Whole-model calls are all or nothing (a failure injected at each layer leaves the model exactly as it
was), keep frozen layers frozen, keep the output head dense, list what they do not handle, and work on
the meta device."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import sparse24
from sparse24 import Sparse24Linear
from sparse24.api import swap, walk

from conftest import assert_model_unchanged as assert_unchanged, fail_on_call, model_snapshot as snapshot, top2_mask

VOCAB, D = 96, 64


class LM(nn.Module):
    """Embedding, Linears, a GPT-2 Conv1D, a frozen Linear, an output head as wide as the vocabulary."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, 128)
        self.conv = Conv1D(D, 128)  # 128 -> 64, weight stored (128, 64)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.frozen(self.conv(F.gelu(self.fc1(h))))
        return self.head(h)


SPARSE = ["fc1", "conv", "frozen"]


def build(seed=0):
    torch.manual_seed(seed)
    return LM()


def assert_gradient_masked(model, name="fc1"):
    """A backward pass through the model leaves the layer's pruned weights without gradient."""
    model(torch.randint(0, VOCAB, (2, 5))).sum().backward()
    layer = model.get_submodule(name)
    assert bool((layer.weight.grad[~layer.mask] == 0).all())


@pytest.mark.parametrize("where", ["_prepare", "_adopt", "_set_child"])
@pytest.mark.parametrize("k", range(len(SPARSE)))
def test_sparsify_fails_at_any_layer_and_changes_nothing(monkeypatch, where, k):
    model = build()
    snap = snapshot(model)
    owner = {"_adopt": Sparse24Linear, "_prepare": swap, "_set_child": walk}[where]
    fail_on_call(monkeypatch, owner, where, k)
    with pytest.raises(RuntimeError, match=f"injected failure at call {k}"):
        sparse24.sparsify_(model)
    assert_unchanged(model, snap)
    monkeypatch.undo()
    sparse24.sparsify_(model)  # and it still works afterwards, masking gradients as it should
    assert_gradient_masked(model)


@pytest.mark.parametrize("k", range(len(SPARSE)))
def test_prune_trained_model_fails_at_any_layer_and_changes_nothing(monkeypatch, k):
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randint(0, VOCAB, (2, 5))).sum().backward()
    opt.step()
    snap = snapshot(model, opt)
    fail_on_call(monkeypatch, walk, "_set_child", k)
    with pytest.raises(RuntimeError, match="injected failure"):
        sparse24.prune_trained_model(model, opt)
    assert_unchanged(model, snap, opt)


@pytest.mark.parametrize("call", ["compress_", "decompress_", "densify_"])
@pytest.mark.parametrize("k", range(len(SPARSE)))
def test_mode_switches_fail_at_any_layer_and_change_nothing(monkeypatch, call, k):
    model = build()
    sparse24.sparsify_(model, mode="compressed" if call == "decompress_" else "masked")
    snap = snapshot(model)
    modes = {n: m.mode for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}
    if call == "densify_":
        fail_on_call(monkeypatch, walk, "_set_child", k)
    else:
        fail_on_call(monkeypatch, Sparse24Linear, "_set_compressed" if call == "compress_" else "to_masked", k)
    with pytest.raises(RuntimeError, match="injected failure"):
        getattr(sparse24, call)(model)
    assert_unchanged(model, snap)
    assert {n: m.mode for n, m in model.named_modules() if isinstance(m, Sparse24Linear)} == modes
    if call != "decompress_":  # the masked layers still mask their gradients
        monkeypatch.undo()
        assert_gradient_masked(model)


def test_prune_trained_model_hands_the_optimizer_the_conv1d_weight():
    model = build()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ids = torch.randint(0, VOCAB, (2, 5))
    model(ids).sum().backward()
    opt.step()
    old = model.conv.weight
    momentum = opt.state[old]["momentum_buffer"].clone()
    sparse24.prune_trained_model(model, opt)
    new = model.conv.weight
    assert new.shape == (D, 128) and any(p is new for g in opt.param_groups for p in g["params"])
    assert not any(p is old for g in opt.param_groups for p in g["params"])
    # the state moved along, transposed, and zeroed where pruned
    assert torch.equal(opt.state[new]["momentum_buffer"], momentum.t() * model.conv.mask)
    for _ in range(2):
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()
    assert bool((new.detach()[~model.conv.mask] == 0).all()) and bool((new.detach() != 0).any())


def test_frozen_layers_are_sparsified_and_stay_frozen():
    model = build()
    report = sparse24.sparsify_(model)
    assert {r.fqn for r in report.swapped} == set(SPARSE)
    assert not model.frozen.weight.requires_grad and not model.frozen.bias.requires_grad
    assert torch.equal(model.frozen.mask, top2_mask(model.frozen.weight))
    sparse24.compress_(model, trainable_values=True)
    assert not model.frozen.values.requires_grad and model.fc1.values.requires_grad
    sparse24.decompress_(model)
    assert not model.frozen.weight.requires_grad and model.fc1.weight.requires_grad
    model.frozen.weight.requires_grad_(True)  # unfrozen later: its gradient is masked too
    assert_gradient_masked(model, "frozen")


def test_output_head_stays_dense_unless_asked():
    model = build()
    report = sparse24.sparsify_(model)
    reasons = {r.fqn: r.reason for r in report.skipped}
    assert type(model.head) is nn.Linear
    assert "output head (96 outputs = the vocabulary of the input embedding 'emb')" in reasons["head"]
    # names replace the automatic choice: exactly those stay dense
    for option, swapped in [(False, {*SPARSE, "head"}), ("fc1", {"conv", "frozen", "head"}),
                            (["fc1", "head"], {"conv", "frozen"})]:
        report = sparse24.sparsify_(build(), skip_output_head=option)
        assert {r.fqn for r in report.swapped} == swapped
    with pytest.raises(ValueError, match="skip_output_head names 'nope', which is no nn.Linear"):
        sparse24.sparsify_(build(), skip_output_head="nope")


def test_report_lists_every_module_type_it_does_not_handle():
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.Linear(64, 64), nn.LSTM(64, 64),
                          nn.Embedding(10, 64), nn.Bilinear(8, 8, 8), nn.LayerNorm(64))
    model.add_module("custom", nn.Module())
    model.custom.table = nn.Parameter(torch.zeros(4, 4))
    report = sparse24.sparsify_(model)
    reasons = {r.fqn: r.reason for r in report.skipped}
    assert [r.fqn for r in report.swapped] == ["2"]
    assert "not handled: Conv2d: a convolution" in reasons["0"] and "(64, 3, 3, 3)" in str(report)
    assert "not handled: LSTM: recurrent weights" in reasons["3"]
    assert "not handled: Embedding: a lookup table" in reasons["4"]
    assert "not handled: Bilinear" in reasons["5"]
    assert "not handled: Module: holds a weight matrix ('table')" in reasons["custom"]
    assert "6" not in reasons  # LayerNorm: no weight matrix
    assert "already a Sparse24Linear" in {r.fqn: r.reason for r in sparse24.sparsify_(model).skipped}["2"]


def test_meta_model_reports_shapes_and_bytes_then_loads():
    dense = build()
    with torch.device("meta"):
        model = LM()
    report = sparse24.sparsify_(model, mode="compressed")
    expected = sparse24.sparsify_(copy.deepcopy(dense), mode="compressed")
    assert [(r.fqn, r.shape, r.dense_bytes, r.compressed_bytes) for r in report.swapped] == \
        [(r.fqn, r.shape, r.dense_bytes, r.compressed_bytes) for r in expected.swapped]
    assert all(r.kept_fraction is None and "mask pending" in r.reason for r in report.swapped)
    model.load_state_dict(dense.state_dict(), assign=True)
    ids = torch.randint(0, VOCAB, (2, 5))
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for name in SPARSE:
            w = ref.get_submodule(name).weight
            w.mul_(top2_mask(w.t()).t() if name == "conv" else top2_mask(w))
        torch.testing.assert_close(model(ids).double(), ref(ids), rtol=1e-5, atol=1e-5)


def test_count_parameters_means_the_same_in_both_modes():
    model = build()
    dense_total = sum(p.numel() for p in model.parameters())
    pruned = sum(model.get_submodule(n).weight.numel() // 2 for n in SPARSE)
    sparse24.sparsify_(model)
    masked = sparse24.count_parameters(model)
    sparse24.compress_(model)
    compressed = sparse24.count_parameters(model)
    assert masked["dense"] == compressed["dense"] == dense_total
    assert masked["nonzero"] == compressed["nonzero"] == dense_total - pruned
    assert masked["parameters"] == dense_total and compressed["parameters"] == dense_total - pruned

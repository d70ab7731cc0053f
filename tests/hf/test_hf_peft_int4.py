"""PEFT LoRA on an INT4 2:4 base (QLoRA-style): the base stays frozen and untouched while adapters train,
outputs equal base + adapter in fp64 (the base dequantized from its stored codes), and merging moves each kept
weight to the point of the layer's own INT4 grid nearest the exact merge (scales and zero points kept)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import sparse24
from sparse24 import Sparse24Linear
from sparse24.lora import Sparse24LoraLinear

from conftest import int4_dequantized_reference, tolerance, top2_mask
from hf_models import tiny_llama, tokens
from test_hf_peft import TARGETS, base_tensors, lora, train_adapters


def test_lora_on_an_int4_base_trains_merges_onto_its_grid_and_unmerges():
    dense = tiny_llama()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=32)
    pm = lora(model)
    wrapped = {n: m for n, m in pm.named_modules() if isinstance(m, Sparse24LoraLinear)}
    assert len(wrapped) == 2 * len(TARGETS)
    assert all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)  # the base is frozen
    before = base_tensors(pm)
    ids = tokens()
    losses = train_adapters(pm, ids)
    assert losses[-1] < losses[0]
    after = base_tensors(pm)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # codes, scales, group sizes untouched

    layer = wrapped["base_model.model.model.layers.1.mlp.down_proj"]
    base = layer.get_base_layer()
    assert isinstance(base, Sparse24Linear) and base.quantize == "int4"
    mask = top2_mask(dense.model.layers[1].mlp.down_proj.weight.detach())
    w = int4_dequantized_reference(base, mask)
    A, B = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
    s = layer.scaling["default"]
    x = torch.randn(3, 5, base.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), F.linear(x.double(), w) + s * (x.double() @ A.T @ B.T),
                                   **tolerance(torch.float32, base.in_features))
    # the merge: each kept weight at the point of the layer's grid nearest the exact merge
    with torch.no_grad():
        layer.lora_B["default"].weight.mul_(3.0)  # a few steps: codes move, some past the grid's ends
    B = layer.lora_B["default"].weight.detach().double()
    with torch.no_grad():
        y_all = pm(input_ids=ids).logits
        scale = base.scale.clone()
        with pytest.warns(UserWarning, match=r"INT4 merge onto the layer's own grid .* changed code, [1-9]\d* "
                                             "clipped at their group's range"):
            layer.merge()
    exact = w + mask * (s * B @ A)
    merged = int4_dequantized_reference(base, mask)
    assert torch.equal(base.scale, scale) and torch.equal(base.dense_weight().double(), merged.float().double())
    # the grid of each kept weight (symmetric: codes -7..7 times its group's fp16 scale), built here
    step = base.scale.double().repeat_interleave(32, 1)[:, :base.in_features]
    nearest = (exact / step).round().clamp(-7, 7) * step
    ties = ((exact / step).abs().frac() - 0.5).abs() < 1e-6  # half-way: either neighbour is nearest
    assert bool(((merged == nearest) | ties)[mask].all()) and not bool(merged[~mask].any())
    inside = (exact / step).abs() <= 7.5
    assert bool(((merged - exact).abs()[mask & inside] <= step[mask & inside] / 2 * (1 + 2 ** -20)).all())
    assert not torch.equal(merged, w) and bool((mask & ~inside).any())  # codes moved, some clipped
    layer.unmerge()
    assert all(torch.equal(base_tensors(pm)[k], v) for k, v in before.items())  # exactly as before
    with torch.no_grad():
        assert torch.equal(pm(input_ids=ids).logits, y_all)


def test_merge_and_unload_of_an_asymmetric_int4_base_keeps_its_format():
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", quantize="int4", symmetric=False)
    pm = lora(model)
    scales = {n: b.clone() for n, b in model.named_buffers() if n.endswith(("scale", "zero", "group_size"))}
    with pytest.warns(UserWarning, match="INT4 merge onto the layer's own grid"):
        merged = pm.merge_and_unload()
    layer = merged.get_submodule("model.layers.0.mlp.up_proj")
    assert type(layer) is Sparse24Linear and layer.quantize == "int4" and layer.symmetric is False
    assert all(torch.equal(b, scales[n]) for n, b in merged.named_buffers() if n in scales)
    assert sparse24.is_nm(layer.dense_weight()) and not any("lora_" in n for n, _ in merged.named_parameters())

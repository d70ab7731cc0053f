"""PEFT LoRA on 2:4 layers (masked, compressed, INT8), with the peft package: adapters train, the base stays
2:4 and untouched, outputs equal the unwrapped computation in fp64, merge keeps 2:4, unmerge restores."""
import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model

import sparse24
from sparse24 import Sparse24Linear
from sparse24.lora import Sparse24LoraLinear

from conftest import tolerance, top2_mask
from hf_models import tiny_gpt2, tiny_llama, tokens

KINDS = {"masked": {"mode": "masked"}, "compressed": {"mode": "compressed"},
         "int8": {"mode": "compressed", "quantize": "int8"}}
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def lora(model, **kw):
    cfg = dict(target_modules=TARGETS, r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, LoraConfig(**{**cfg, **kw}))


def base_tensors(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}


def train_adapters(pm, ids, steps=4):
    """A few AdamW steps on the trainable (adapter) parameters; the losses."""
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def independent_weight(dense_w, layer):
    """fp64 (R, C) weight the base must compute with: the dense weight under the independent top-2 mask,
    or the stored int8 values dequantized and placed by it."""
    mask = top2_mask(dense_w)
    if layer.quantize == "int8":
        w = torch.zeros_like(dense_w, dtype=torch.float64)
        w[mask] = (layer.values.double() * layer.scale.double()[:, None]).flatten()
        return w, mask
    return dense_w.double() * mask, mask


@pytest.mark.parametrize("kind", KINDS)
def test_lora_trains_on_an_untouched_2of4_base(kind):
    dense = tiny_llama()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, **KINDS[kind])
    pm = lora(model)
    wrapped = {n: m for n, m in pm.named_modules() if isinstance(m, Sparse24LoraLinear)}
    assert len(wrapped) == 2 * len(TARGETS)
    before = base_tensors(pm)
    assert all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    ids = tokens()
    losses = train_adapters(pm, ids)
    assert losses[-1] < losses[0]
    after = base_tensors(pm)
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    # one wrapped layer against the unwrapped computation: base(x) + scaling * B(A(x)), in fp64
    name = "base_model.model.model.layers.1.mlp.down_proj"
    layer = wrapped[name]
    base = layer.get_base_layer()
    assert isinstance(base, Sparse24Linear) and base.mode == KINDS[kind]["mode"]
    w, mask = independent_weight(dense.model.layers[1].mlp.down_proj.weight.detach(), base)
    A, B = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
    s = layer.scaling["default"]
    x = torch.randn(3, 5, base.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
    ref = F.linear(x.double(), w) + s * (x.double() @ A.T @ B.T)
    torch.testing.assert_close(y.double(), ref, **tolerance(torch.float32, base.in_features))

    # merge: the update at the kept positions only; the layer stays 2:4 in its mode
    with torch.no_grad():
        y_all = pm(input_ids=ids).logits
        layer.merge()
        merged = base.dense_weight().double()
        assert base.mode == KINDS[kind]["mode"] and sparse24.is_nm(base.dense_weight())
        expected = w + mask * (s * B @ A)
        if kind == "int8":  # requantized: within half an int8 step of the exact merge
            step = base.scale.double()[:, None] / 2
            assert bool(((merged - expected).abs() <= step + 1e-7).all()) and not bool(merged[~mask].any())
        else:
            torch.testing.assert_close(merged, expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(layer(x).double(), F.linear(x.double(), expected),
                                       **tolerance(torch.float32, base.in_features))
        layer.unmerge()
    assert all(torch.equal(base_tensors(pm)[k], v) for k, v in before.items())  # exactly as before
    with torch.no_grad():
        assert torch.equal(pm(input_ids=ids).logits, y_all)


def test_merge_and_unload_keeps_2of4_layers():
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    pm = lora(model)
    merged = pm.merge_and_unload()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        layer = merged.get_submodule(name)
        assert type(layer) is Sparse24Linear and layer.mode == "compressed" and sparse24.is_nm(layer.dense_weight())
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_all_linear_targets_the_2of4_layers_and_not_the_head():
    model = tiny_llama()
    sparse24.sparsify_(model)
    pm = get_peft_model(model, LoraConfig(target_modules="all-linear", r=2))
    wrapped = {n for n, m in pm.named_modules() if isinstance(m, Sparse24LoraLinear)}
    assert len(wrapped) == 14 and not any("lm_head" in n for n in wrapped)


def test_dora_needs_a_dense_weight_and_is_refused():
    model = tiny_llama()
    sparse24.sparsify_(model)
    with pytest.raises(ValueError, match="unsupported variant combination"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"], use_dora=True))


@pytest.mark.parametrize("init", ["pissa", "olora", "corda"])   # (loftq: its config needs scipy)
@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_inits_that_rewrite_the_base_weight_are_refused(init, mode):
    """PiSSA / OLoRA & co. write the dense residual back into the base: on a masked base PiSSA changed
    the layer's output by 30% (entries written at pruned positions), OLoRA's in-place write went
    unseen by the zero check; a compressed base failed with an AttributeError whose advice
    (to_masked()) led to the silent case. Refused in every mode, with the base untouched; a second
    adapter asking for one is refused too."""
    model = tiny_llama()
    sparse24.sparsify_(model, mode=mode)
    before = base_tensors(model)
    with pytest.raises(ValueError, match=rf"init_lora_weights='{init}' rewrites the base weight"):
        lora(model, init_lora_weights=init)
    after = base_tensors(model)
    assert all(torch.equal(before[k], after[k]) for k in before if k in after)
    model = tiny_llama()
    sparse24.sparsify_(model, mode=mode)
    pm = lora(model)
    with pytest.raises(ValueError, match="rewrites the base weight"):
        pm.add_adapter("second", LoraConfig(target_modules=TARGETS, r=4, init_lora_weights=init))


def test_adapter_saves_and_loads_onto_a_fresh_2of4_base(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    base_copy = copy.deepcopy(model)
    pm = lora(model)
    pm.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(base_copy, tmp_path)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, pm(input_ids=ids).logits)


def test_gpt2_conv1d_base_with_lora():
    dense = tiny_gpt2()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed")
    pm = get_peft_model(model, LoraConfig(target_modules=["c_attn"], r=4, lora_alpha=4, init_lora_weights=False,
                                          fan_in_fan_out=True))  # what a dense GPT-2 needs: ignored by 2:4 layers
    layer = pm.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(layer, Sparse24LoraLinear) and not layer.fan_in_fan_out
    w, _ = independent_weight(dense.transformer.h[0].attn.c_attn.weight.detach().t(), layer.get_base_layer())
    A, B = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    b = dense.transformer.h[0].attn.c_attn.bias.detach().double()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), F.linear(x.double(), w, b) + x.double() @ A.T @ B.T,
                                   **tolerance(torch.float32, 64))


DECODE_KINDS = {"fp16": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4", "group_size": 32}}


def decode_layout_lora(kind, bias=True, **lora_kw):
    """A fp16 64x64 2:4 layer in the decode layout (what a frozen one holds on CUDA) under a LoRA adapter."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=bias).half())
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False, **DECODE_KINDS[kind])
    model[0].to_layout("decode")
    # a plain PyTorch model: PEFT knows Sparse24Linear once registered (docs/modules.md); an xdist worker
    # that imported sparse24 before peft and ran no transformers test yet had not (PEFT refused the layer)
    sparse24.lora.register()
    cfg = dict(target_modules=["0"], r=4, init_lora_weights=False, **lora_kw)
    return get_peft_model(model, LoraConfig(**cfg)).base_model.model[0]


@pytest.mark.parametrize("kind", DECODE_KINDS)
def test_a_refused_merge_leaves_a_decode_layout_base_as_it_was(kind):
    # add_to_kept_ gives a decode-layout base new tensor objects: the merge must undo by the module's
    # own tables, not by the tensors it held before (which the NaN check then read, and missed)
    layer = decode_layout_lora(kind)
    base = layer.get_base_layer()
    held, entries = dict(base._parameters) | dict(base._buffers), base_tensors(base)
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        layer.merge(safe_merge=True)
    assert not layer.merged and base.layout == "decode"
    assert all(t is held[n] for n, t in (dict(base._parameters) | dict(base._buffers)).items())
    assert all(torch.equal(base_tensors(base)[k], v) for k, v in entries.items())

    layer = decode_layout_lora(kind, bias=False, lora_bias=True)  # fails after the weight's update
    base = layer.get_base_layer()
    entries = base_tensors(base)
    with pytest.raises(RuntimeError, match="no bias"):
        layer.merge()
    assert not layer.merged and base.layout == "decode"
    assert all(torch.equal(base_tensors(base)[k], v) for k, v in entries.items())


@pytest.mark.parametrize("kind", DECODE_KINDS)
def test_unmerge_after_a_layout_change_restores_the_base(kind):
    layer = decode_layout_lora(kind)
    base = layer.get_base_layer()
    base.to_layout("v1")
    entries = base_tensors(base)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).half()
    with torch.no_grad():
        y = layer(x)
        layer.merge()
        assert not torch.equal(base.state_dict()["values"], entries["values"])
        base.to_layout("decode")  # e.g. the model moved to CUDA after merging
        layer.unmerge()
        assert base.layout == "decode" and not layer.merged
        assert all(torch.equal(base_tensors(base)[k], v) for k, v in entries.items())
        assert torch.equal(layer(x), y)


def test_sparsify_leaves_the_layers_of_a_peft_model_alone():
    # PEFT's merge writes a dense update into its base layer's weight: pruning that base (or the adapters)
    # under PEFT would come undone at merge; sparsify_ the base model first
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))
    pm = get_peft_model(model, LoraConfig(target_modules=["0"], r=32, init_lora_weights=False))
    report = sparse24.sparsify_(pm, skip_output_head=False)
    assert [r.fqn for r in report.swapped] == ["base_model.model.2"]
    inside = {r.fqn: r.reason for r in report.skipped if ".0." in r.fqn}
    assert set(inside) == {f"base_model.model.0.{n}" for n in ("base_layer", "lora_A.default", "lora_B.default")}
    assert all("sparsify_ the base model before get_peft_model" in why for why in inside.values())

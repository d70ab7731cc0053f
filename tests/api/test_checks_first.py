"""Whole-model calls check their inputs before changing anything: non-finite weights and
checkpoint entries, calibration dicts that do not fit the model, mode switches on a model
that was never sparsified. Each error names the layer (or key) and leaves the model as it was."""
import re

import pytest
import torch
from torch import nn

import sparse24

from conftest import assert_model_unchanged, model_snapshot


def mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model.add_module("block", nn.Sequential(nn.Linear(64, 64)))
    return model


@pytest.mark.parametrize("mode", ["masked", "compressed"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_sparsify_refuses_non_finite_weights_naming_the_layer(mode, bad):
    model = mlp()
    with torch.no_grad():
        model[2].weight[5, 7] = bad
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=r"sparsify_: layer '2': weight has 1 non-finite value\(s\) \(inf/NaN\), "
                                         r"the first at index \(5, 7\).*\(nothing was changed\)"):
        sparse24.sparsify_(model, mode=mode)
    assert_model_unchanged(model, snap)
    with pytest.raises(ValueError, match="non-finite"):  # the single-layer path too
        sparse24.Sparse24Linear.from_linear(model[2], mode=mode)


def test_calibration_dict_must_name_the_models_layers():
    model = mlp()
    batches = [torch.randn(16, 64) for _ in range(2)]
    stats = sparse24.calibrate(model, batches, hessian=True)
    snap = model_snapshot(model)
    for method in ("wanda", "sparsegpt"):
        with pytest.raises(ValueError, match=r"no statistics for 3 layer\(s\) that method='.*' would prune: "
                                             r"'0', '2', 'block.0'"):
            sparse24.sparsify_(model, method=method, calibration={})  # refused, as calibration=None is
        with pytest.raises(ValueError, match=r"no statistics for 1 layer\(s\) .* 'block.0' \(did calibrate\(\) run"):
            sparse24.sparsify_(model, method=method, calibration={k: v for k, v in stats.items() if k != "block.0"})
    # statistics of a submodule carry its own names: '0' is a layer of the model, but the submodule's
    # '0' is the model's 'block.0'; an unknown name is refused whatever the method
    sub = sparse24.calibrate(model.block, batches, hessian=True)
    with pytest.raises(ValueError, match=r"calibration names 1 layer\(s\) the model does not have: 'nope'"):
        sparse24.sparsify_(model, calibration={**stats, "nope": stats["0"]})
    with pytest.raises(ValueError, match=r"calibration names 1 layer\(s\) the model does not have: 'x.0'"):
        sparse24.sparsify_(model, method="sparsegpt", calibration={f"x.{k}": v for k, v in sub.items()})
    assert_model_unchanged(model, snap)
    # the way out the message names: leave the layer out
    report = sparse24.sparsify_(model, lambda m, fqn: fqn != "block.0", method="wanda",
                                calibration={k: v for k, v in stats.items() if k != "block.0"})
    assert [r.fqn for r in report.swapped] == ["0", "2"]


@pytest.mark.parametrize("call", ["compress_", "decompress_", "densify_"])
def test_mode_switches_on_a_model_never_sparsified_are_errors(call):
    model = mlp()
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=f"{call}: the model has no Sparse24Linear layer, so there is nothing"):
        getattr(sparse24, call)(model)
    assert_model_unchanged(model, snap)


@pytest.mark.parametrize("kind, key", [("masked", "weight"), ("compressed", "values"), ("int8", "scale")])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_checkpoint_with_non_finite_values_is_refused_naming_the_key(kind, key, bad):
    def sparse(seed):
        model = mlp(seed)
        sparse24.sparsify_(model, mode="masked" if kind == "masked" else "compressed",
                           quantize="int8" if kind == "int8" else None)
        return model
    sd = {k: v.clone() for k, v in sparse(0).state_dict().items()}
    t = sd[f"block.0.{key}"].view(-1)
    t[int(t.abs().argmax())] = bad  # a kept position (non-zero in a masked weight)
    model = sparse(1)
    snap = model_snapshot(model)
    with pytest.raises(RuntimeError, match=rf"block.0: 'block.0.{key}' has \d+ non-finite value"):
        model.load_state_dict(sd)
    # torch loads the other layers before reporting: those are the checkpoint's, this one is untouched
    layer_keys = [k for k in snap["state"] if k.startswith("block.0.")]
    assert all(torch.equal(model.state_dict()[k], snap["state"][k]) for k in layer_keys)


@pytest.mark.parametrize("arch, layer, entry", [
    ("llama", "model.layers.1.mlp.up_proj", "values"),
    # a NaN bias loaded without a word (the finiteness checks covered weight, values and scale);
    # GPT-2's Conv1D layers have biases
    ("gpt2", "transformer.h.0.mlp.c_fc", "bias"),
])
def test_transformers_folder_with_non_finite_entries_is_refused_naming_the_layer(tmp_path, arch, layer, entry):
    from safetensors.torch import load_file, save_file
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    from hf_models import tiny_gpt2, tiny_llama
    model = {"llama": tiny_llama, "gpt2": tiny_gpt2}[arch]()
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    tensors[f"{layer}.{entry}"].view(-1)[3] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"layer '{re.escape(layer)}': corrupt 2:4 layer .*'{entry}' has 1 "
                                         r"non-finite value"):
        sparse24.from_pretrained({"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}[arch], tmp_path)

"""save_pretrained / from_pretrained of INT4 2:4 transformers models: the same model back bit for
bit (outputs checked against the fp64 dense weight dequantized from the stored codes), the section
naming mode and group size, and loud errors for folders that do not fit."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import sparse24
from sparse24 import Sparse24Linear

from hf_models import masked_reference, tiny_gpt2, tiny_llama, tokens
from test_hf_transformers import logits, same_state


@pytest.mark.parametrize("build, symmetric", [(tiny_llama, False), (tiny_gpt2, True)], ids=["llama", "gpt2"])
def test_int4_round_trip_is_bit_exact(tmp_path, build, symmetric):
    dense = build()
    model = copy.deepcopy(dense)
    # 160-column down_proj at group 64: a short last group
    report = sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=64, symmetric=symmetric)
    ids = tokens()
    y = logits(model, ids)
    torch.testing.assert_close(y.double(), logits(masked_reference(dense, model), ids), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    section = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert section["quantization"] == "int4" and section["group_size"] == 64 and section["mode"] == "compressed"
    kind = "conv1d" if build is tiny_gpt2 else "linear"
    assert section["layers"] == {r.fqn: {"mode": "compressed", "quantize": "int4", "group_size": 64,
                                         "symmetric": symmetric, "kind": kind} for r in report.swapped}
    stored = load_file(tmp_path / "model.safetensors")
    fqn = report.swapped[0].fqn
    assert stored[f"{fqn}.values"].dtype == torch.uint8 and stored[f"{fqn}.scale"].dtype == torch.float16
    assert int(stored[f"{fqn}.group_size"]) == 64 and (f"{fqn}.zero" in stored) is not symmetric
    loaded = sparse24.from_pretrained(type(model), tmp_path)
    assert same_state(loaded, model) and torch.equal(logits(loaded, ids), y)
    for r in report.swapped:
        layer = loaded.get_submodule(r.fqn)
        assert isinstance(layer, Sparse24Linear) and layer.quantize == "int4" and layer.symmetric is symmetric
        assert not layer.values.requires_grad and not layer.pending
    # another logical dtype: codes, fp16 scales and zero points load as stored
    half = sparse24.from_pretrained(type(model), tmp_path, dtype=torch.bfloat16)
    layer, src = half.get_submodule(fqn), model.get_submodule(fqn)
    assert layer.dtype == torch.bfloat16 and layer.scale.dtype == torch.float16
    assert all(torch.equal(getattr(layer, k), getattr(src, k)) for k in ("values", "meta", "scale", "group_size"))


def test_int4_folders_that_do_not_fit_are_loud_errors(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=32, symmetric=False)
    model.save_pretrained(tmp_path)
    cfg_path, w_path = tmp_path / "config.json", tmp_path / "model.safetensors"
    cfg, weights = json.loads(cfg_path.read_text()), load_file(w_path)
    qc = cfg["quantization_config"]
    name = "model.layers.0.mlp.up_proj"

    def load_with(layer_entry=None, tensors=None):
        section = qc if layer_entry is None else {**qc, "layers": {**qc["layers"], name: layer_entry}}
        cfg_path.write_text(json.dumps({**cfg, "quantization_config": section}))
        save_file(tensors or weights, w_path, metadata={"format": "pt"})
        return sparse24.from_pretrained(LlamaForCausalLM, tmp_path)

    entry = qc["layers"][name]
    for bad in ({**entry, "group_size": 48}, {**entry, "group_size": True}, {**entry, "symmetric": "yes"},
                {k: v for k, v in entry.items() if k != "group_size"}, {**entry, "quantize": "int8"}):
        with pytest.raises(ValueError, match=f"layer '{name}' has an unreadable entry"):
            load_with(bad)
    # the section and the file disagree on the group size: other scale shapes, or (64 columns at 64 and
    # 128: one group either way) the same shapes and only the group_size entry to tell
    with pytest.raises(ValueError, match=rf"'{name}.scale' has shape \(160, 2\); the 2:4 compressed INT4 layer "
                                         rf"config.json describes \(160x\d+, group_size 64\) needs \(160, 1\)"):
        load_with({**entry, "group_size": 64})
    wide = tiny_llama()
    sparse24.sparsify_(wide, mode="compressed", quantize="int4", group_size=64)
    wide.save_pretrained(tmp_path / "g64")
    g64 = json.loads((tmp_path / "g64" / "config.json").read_text())
    g64["quantization_config"]["layers"][name]["group_size"] = 128
    (tmp_path / "g64" / "config.json").write_text(json.dumps(g64))
    with pytest.raises(ValueError, match=f"layer '{name}': .* the checkpoint's INT4 group size is 64, this layer's "
                                         "is 128"):
        sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "g64")
    cases = [({**weights, f"{name}.values": weights[f"{name}.values"].view(torch.int8)},
              f"'{name}.values' is stored as I8; the 2:4 compressed INT4 layer needs U8"),
             ({**weights, f"{name}.scale": weights[f"{name}.scale"].float()},
              f"'{name}.scale' is stored as F32; the 2:4 compressed INT4 layer needs F16"),
             ({**weights, f"{name}.group_size": weights[f"{name}.group_size"].long()},
              f"'{name}.group_size' is stored as I64"),
             ({k: v for k, v in weights.items() if k != f"{name}.zero"}, f"lacks {name}.zero for the 2:4 compressed"),
             ({k: v for k, v in weights.items() if k != f"{name}.group_size"}, f"lacks {name}.group_size")]
    zero = weights[f"{name}.zero"].clone()
    zero[1, 0] = 200
    cases.append(({**weights, f"{name}.zero": zero}, "corrupt INT4 zero points at row 1, group 0: 200"))
    scale = weights[f"{name}.scale"].clone()
    scale[0, 1] = 0
    cases.append(({**weights, f"{name}.scale": scale}, "corrupt INT4 scales"))
    gs = torch.tensor(64, dtype=torch.int32)
    cases.append(({**weights, f"{name}.group_size": gs}, "the checkpoint's INT4 group size is 64, this layer's is 32"))
    for tensors, msg in cases:
        with pytest.raises(ValueError, match=msg):
            load_with(tensors=tensors)
    assert same_state(load_with(), model)  # the folder as saved still loads

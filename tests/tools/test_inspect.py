"""python -m sparse24 inspect: per layer mode, exact 2:4 check, kept |w|, bytes, dtype and totals; checked
against independent references (top-2 per group in fp64, byte counts from the format's definition)."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import sparse24
from hf_models import tiny_llama
from test_cli import assert_one_line_error, run


def _models():
    torch.manual_seed(0)
    return {name: nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)) for name in ("m", "c", "q")}


def _mixed_checkpoint(tmp_path):
    """One file with masked, compressed, INT8 and dense layers, and the dense original beside it."""
    models = _models()
    dense = {f"{k}.{n}": v.clone() for k, m in models.items() for n, v in m.state_dict().items()}
    dense["head.weight"] = torch.randn(10, 32)
    sparse24.sparsify_(models["m"], min_features=0)
    sparse24.sparsify_(models["c"], mode="compressed", min_features=0)
    sparse24.sparsify_(models["q"], mode="compressed", quantize="int8", min_features=0)
    sd = {f"{k}.{n}": v for k, m in models.items() for n, v in m.state_dict().items()}
    sd["head.weight"] = dense["head.weight"]
    torch.save(sd, tmp_path / "sparse.pt")
    torch.save(dense, tmp_path / "dense.pt")
    return sd, dense


def _rows(out: str) -> dict:
    return {m.group(1): m.group(2).split() for m in re.finditer(r"^  ([a-z]\.\d|head)\s+(.*)$", out, re.M)}


def _top2_kept(w: torch.Tensor) -> float:
    a = w.double().abs().view(w.shape[0], -1, 4)
    return float(a.topk(2, dim=-1).values.sum() / a.sum())


def test_inspect_with_a_dense_file_matching_no_layer_says_so(capsys, tmp_path):
    # it printed "-" for every kept share, exit 0, as if --dense had not been given
    _mixed_checkpoint(tmp_path)
    torch.save({"other.weight": torch.randn(8, 8)}, tmp_path / "other.pt")
    rc, _, err = run(capsys, "inspect", str(tmp_path / "sparse.pt"), "--dense", str(tmp_path / "other.pt"))
    assert rc == 2
    assert_one_line_error(err, "matched a weight in it by name and shape")


def test_inspect_a_mixed_file(capsys, tmp_path):
    sd, dense = _mixed_checkpoint(tmp_path)
    rc, out, err = run(capsys, "inspect", str(tmp_path / "sparse.pt"), "--dense", str(tmp_path / "dense.pt"))
    assert rc == 0, err
    rows = _rows(out)
    assert set(rows) == {"m.0", "m.2", "c.0", "c.2", "q.0", "q.2", "head"}
    for p, mode in (("m", "masked"), ("c", "compressed"), ("q", "INT8")):
        for i, (R, C) in (("0", (96, 64)), ("2", (32, 96))):
            cells = rows[f"{p}.{i}"]
            assert cells[0] == mode and cells[-1] == "exact", cells
            assert " ".join(cells[1:3]) == f"({R}, {C})"
            assert cells[3] == ("int8" if p == "q" else "float32")
            # kept |w|: every method here is magnitude, so the top-2 share of the dense original
            assert cells[4] == f"{100 * _top2_kept(dense[f'{p}.{i}.weight']):.1f}%"
            want_bytes = {"m": R * C * 4 + R * C,                                  # fp32 weight + bool mask
                          "c": R * C // 2 * 4 + (C + 31) // 32 * R * 4,            # values + int32 meta words
                          "q": R * C // 2 + (C + 31) // 32 * R * 4 + 4 * R}[p]     # int8 values + meta + scales
            assert int(cells[5]) == want_bytes
    assert rows["head"][0] == "dense" and rows["head"][-1] == "-"
    assert "6 2:4 layer(s) (2 compressed, 2 INT8, 2 masked), 1 dense; 6 of 6 with an exact 2:4 pattern" in out
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "sparse.pt"))  # without the original: no kept share
    assert rc == 0 and _rows(out)["c.0"][4] == "-"


@pytest.mark.parametrize("damage, problem", [
    ("meta", "corrupt metadata at row 0, group 0"),
    ("mask", "mask"),
    ("weight", "non-zero where"),
    ("nan", "values has 1 non-finite value(s) (inf/NaN), the first at"),
])
def test_inspect_names_a_broken_layer(capsys, tmp_path, damage, problem):
    sd, _ = _mixed_checkpoint(tmp_path)
    if damage == "meta":
        sd["c.0.meta"] = sd["c.0.meta"].clone()
        sd["c.0.meta"][0, 0] = 0  # every slot of row 0's first words 0: a slot claimed twice
    elif damage == "mask":
        sd["m.0.mask"] = sd["m.0.mask"].clone()
        sd["m.0.mask"][0, :4] = True  # 4 of 4 kept
    elif damage == "weight":
        sd["m.0.weight"] = sd["m.0.weight"].detach().clone()
        sd["m.0.weight"][~sd["m.0.mask"]] = 1.0
    else:
        sd["c.0.values"] = sd["c.0.values"].clone()
        sd["c.0.values"][3, 5] = float("nan")
    torch.save(sd, tmp_path / "bad.pt")
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "bad.pt"))
    assert rc == 1
    layer = "m.0" if damage in ("mask", "weight") else "c.0"
    line = next(li for li in out.splitlines() if li.startswith(f"  {layer} "))
    assert "INVALID:" in line and problem in line, line
    assert "5 of 6 with an exact 2:4 pattern" in out


def test_inspect_a_folder_and_a_dense_weight_that_is_2_4(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse"), "--quantize", "int8")
    assert rc == 0, err
    rc, out, err = run(capsys, "inspect", str(tmp_path / "sparse"), "--dense", str(tmp_path / "dense"))
    assert rc == 0, err
    assert "sparse24 format 1, 14 2:4 layer(s) listed" in out and "14 2:4 layer(s) (14 INT8), 2 dense" in out
    dense = tiny_llama().state_dict()
    line = next(li for li in out.splitlines() if li.startswith("  model.layers.1.mlp.up_proj "))
    assert f"{100 * _top2_kept(dense['model.layers.1.mlp.up_proj.weight']):.1f}%" in line and "exact" in line
    # a dense weight that already is 2:4 (prune_layerwise_'s output before sparsify_) says so
    w = torch.randn(8, 16)
    save_file({"fc.weight": w * sparse24.mask_nm(w), "other.weight": w}, tmp_path / "d.safetensors")
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "d.safetensors"))
    assert rc == 0 and "exact (stored dense)" in next(li for li in out.splitlines() if "fc " in li)
    # config.json listing a 2:4 layer the weights lack
    cfg = json.loads((tmp_path / "sparse" / "config.json").read_text())
    cfg["quantization_config"]["layers"]["model.layers.9.mlp.up_proj"] = {"mode": "compressed", "quantize": None}
    (tmp_path / "sparse" / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "sparse"))
    assert rc == 1 and "config.json lists 1 2:4 layer(s) with no entries here: model.layers.9.mlp.up_proj" in out


def test_inspect_a_gpt2_folder_transposes_its_square_conv1d_weights(capsys, tmp_path):
    # a Conv1D weight is stored (in, out): a square one (attn.c_proj) was compared untransposed with its
    # mask, which gave a random mask's ~50% where prune's own table said ~75%
    from hf_models import tiny_gpt2
    tiny_gpt2().save_pretrained(tmp_path / "dense")
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse"))
    assert rc == 0, err
    rc, out, err = run(capsys, "inspect", str(tmp_path / "sparse"), "--dense", str(tmp_path / "dense"))
    assert rc == 0, err
    dense = tiny_gpt2().state_dict()
    for name in ("transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_fc"):
        w = dense[name + ".weight"].t()  # (out, in), as the 2:4 layer holds it
        line = next(li for li in out.splitlines() if li.startswith(f"  {name} "))
        assert f"{100 * _top2_kept(w):.1f}%" in line, line


@pytest.mark.parametrize("section, needle", [
    (["a list"], "config.json must hold a JSON object"),
    ({"quantization_config": {"quant_method": "sparse24", "layers": ["fc"]}}, "'layers' must map layer names"),
    ({"quantization_config": {"quant_method": "sparse24", "layers": 3}}, "'layers' must map layer names"),
    ({"quantization_config": {"quant_method": "sparse24", "layers": {"fc": {"mode": "dense"}}}}, "unreadable entry")])
def test_inspect_a_folder_with_a_broken_config_is_one_line(capsys, tmp_path, section, needle):
    tiny_llama().save_pretrained(tmp_path / "folder")
    (tmp_path / "folder" / "config.json").write_text(json.dumps(section))
    capsys.readouterr()
    rc, out, err = run(capsys, "inspect", str(tmp_path / "folder"))
    assert rc == 2 and out == "", out
    assert_one_line_error(err, "config.json", needle)


def test_sparse_layout_tensors_are_left_alone(capsys, tmp_path):
    # a sparse-layout "*.weight" (prune copies those as they are) crashed inspect in is_nm and prune's
    # safetensors writer (which stores dense tensors only) after the work was done
    torch.save({"fc.weight": torch.randn(64, 64), "emb.weight": torch.randn(64, 64).to_sparse()}, tmp_path / "mix.pt")
    rc, out, err = run(capsys, "inspect", str(tmp_path / "mix.pt"))
    assert rc == 0 and "emb" not in out and "  fc  " in out, err
    rc, out, err = run(capsys, "prune", str(tmp_path / "mix.pt"), "--out", str(tmp_path / "o.safetensors"))
    assert rc == 2 and out == ""
    assert_one_line_error(err, "safetensors stores dense tensors only", "'emb.weight' is a sparse_coo tensor")
    rc, _, err = run(capsys, "prune", str(tmp_path / "mix.pt"), "--out", str(tmp_path / "o.pt"), "--min-features", "0")
    assert rc == 0, err
    got = torch.load(tmp_path / "o.pt")
    assert got["emb.weight"].layout == torch.sparse_coo and "fc.values" in got
    assert not (tmp_path / "o.safetensors").exists()


def test_inspect_bad_files_are_one_line(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "folder")
    shard = tmp_path / "folder" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    (tmp_path / "rand.pt").write_bytes(os.urandom(200))
    (tmp_path / "empty").mkdir()
    torch.save({"step": torch.tensor(3)}, tmp_path / "noweights.pt")
    capsys.readouterr()
    for path, needles in [(tmp_path / "missing.pt", ["no such checkpoint"]),
                          (tmp_path / "folder", [f"cannot read {shard} as a safetensors file"]),
                          (tmp_path / "rand.pt", ["cannot read", "as a torch checkpoint"]),
                          (tmp_path / "empty", ["a folder without config.json"]),
                          (tmp_path / "noweights.pt", ["no weight matrix in it"])]:
        rc, out, err = run(capsys, "inspect", str(path))
        assert rc == 2 and out == "", (path, out)
        assert_one_line_error(err, *needles)

"""prune FOLDER of folders made by other tools (review "foreign", round 8). Each test failed before its fix:
int8 / fp8 weight codes with their scale beside them pruned as weights by the calibrated methods (exit 0),
a layer missing or stored as codes found by the shard-by-shard and block-by-block paths only after shards
were written, a compressed-tensors "dense" folder refused with the advice to prune its dense original (it is
one), and errors of another type re-created with a constructor that does not take a message."""
import json

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import sparse24
import sparse24.recipes as recipes
from hf_models import VOCAB, tiny_llama
from sparse24.nn import Sparse24Linear
from sparse24.tools.hf_folder import prune_folder
from test_cli import assert_one_line_error
from test_cli_review3 import one_thread  # noqa: F401  (autouse: one thread, as the CLI tests)
from test_untrusted_review import run
from test_cli_calibrated import TEXTS, _tokenizer


@pytest.fixture
def written(monkeypatch):
    """The output shards written (every path writes them with safetensors.torch.save_file)."""
    names = []
    real = safetensors.torch.save_file

    def spy(tensors, filename, metadata=None):
        names.append(str(filename))
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    return names


def _codes(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as another tool stores it: per-row codes and their float scale (compressed-tensors' channel
    int-quantized layout; fp8 as DeepSeek-V3 / FP8 checkpoints keep it)."""
    top = 127.0 if dtype == torch.int8 else 448.0
    scale = w.abs().amax(1, keepdim=True).float() / top
    q = w / scale
    return (torch.round(q).to(dtype) if dtype == torch.int8 else q.to(dtype)), scale


# --- F1: the calibrated methods took int8 / fp8 codes for the weights -----------------------------------------

@pytest.mark.parametrize("method, dtype, stored", [("wanda", torch.int8, "I8"),
                                                    ("layerwise", torch.float8_e4m3fn, "F8_E4M3")])
def test_calibrated_prune_refuses_weight_codes_with_their_scale(capsys, tmp_path, written, method, dtype, stored):
    """transformers casts the codes to float and drops the scale: the folder written held the codes as a
    2:4 model (max |w| 127 where the weights reach 0.08), exit 0."""
    folder = tmp_path / "src"
    tiny_llama().save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text("\n".join(TEXTS))
    sd = load_file(folder / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    sd[key], sd[key + "_scale"] = _codes(sd[key], dtype)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())   # (the legacy key, which transformers ignores)
    cfg["compression_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--method", method,
                     "--calibration", str(tmp_path / "calib.txt"), "--samples", "3", "--no-progress")
    assert rc == 2, err
    assert_one_line_error(err, f"{folder / 'model.safetensors'}: '{key}': weight must be floating point",
                          f"stored as {stored}", f"'{key}_scale'", "prune its dense original")
    assert not (tmp_path / "out").exists() and written == []


# --- F2: the shard-by-shard and block-by-block paths found a bad layer only after writing shards ---------------

def _sharded(tmp_path, variant: str):
    """A 7-shard bf16 Llama folder whose last shard holds one layer as another tool stores it: GPTQ's
    ``qweight`` instead of ``weight`` ("missing"), or int8 codes with their scale beside them."""
    folder = tmp_path / "src"
    tiny_llama(seed=5).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    last = shards[-1]
    key = next(k for k, s in index["weight_map"].items() if s == last and k.endswith("proj.weight"))
    assert len(shards) > 2 and key.startswith("model.layers.1.")  # (the last block: found late before the fix)
    sd = load_file(folder / last)
    w = sd.pop(key)
    if variant == "missing":
        sd[key[:-len("weight")] + "qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
    else:
        sd[key], sd[key + "_scale"] = _codes(w, torch.int8)
    save_file(sd, folder / last, metadata={"format": "pt"})
    index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if k != key}, **dict.fromkeys(sd, last)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, key, last


@pytest.mark.parametrize("variant", ["missing", "int8"])
@pytest.mark.parametrize("blockwise", [False, True])
def test_prune_folder_refuses_a_layer_it_cannot_prune_before_writing(capsys, tmp_path, written, variant, blockwise):
    """Magnitude: all 7 (missing) or 6 of 7 (int8) shards pruned and written first, and the int8 error named no
    cause; block by block: decoder block 0 pruned and written first."""
    folder, key, shard = _sharded(tmp_path, variant)
    extra = []
    if blockwise:
        torch.save(torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)), tmp_path / "ids.pt")
        extra = ["--method", "wanda", "--calibration-ids", str(tmp_path / "ids.pt")]
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress", *extra)
    assert rc == 2, err
    if variant == "missing":
        assert_one_line_error(err, "the checkpoint has no weight for layer(s) " + key[:-len(".weight")],
                              f"'{key[:-len('weight')]}qweight' (in {shard}) instead", "quantized by another tool")
    else:
        assert_one_line_error(err, f"{folder / shard}: '{key}': weight must be floating point", "stored as I8",
                              f"'{key}_scale'", "quantized by another tool")
    assert written == [] and not (tmp_path / "out").exists()


# --- F5: a compressed-tensors "dense" folder is a dense original ----------------------------------------------

def _top2_masked(w: torch.Tensor) -> torch.Tensor:
    """Independent 2:4 magnitude pruning in float64: the 2 largest |w| of each group of 4 (lower index on ties)."""
    rows, cols = w.shape
    g = w.double().abs().reshape(rows, cols // 4, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, torch.argsort(-g, dim=-1, stable=True)[..., :2], True)
    return torch.where(keep.reshape(rows, cols), w.double(), 0.0)


def _ct_folder(tmp_path, qc: dict):
    """llm-compressor's sparsity-only export: plain float weights, already 2:4, and a compressed-tensors
    quantization_config."""
    folder = tmp_path / "ct"
    tiny_llama().save_pretrained(folder)
    sd = load_file(folder / "model.safetensors")
    pruned = {k: _top2_masked(v).float() for k, v in sd.items()
              if k.endswith("proj.weight") and k.startswith("model.layers.")}
    save_file({**sd, **pruned}, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, pruned


SPARSITY = {"format": "dense", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"],
            "global_sparsity": 0.45, "registry_requires_subclass": False}
CT_DENSE = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "quantization_status": "compressed", "sparsity_config": SPARSITY, "version": "0.9.0"}


def test_compressed_tensors_dense_folder_says_what_to_do(capsys, tmp_path):
    """It was told to "prune its dense original", which it is; the advice given now works."""
    folder, pruned = _ct_folder(tmp_path, CT_DENSE)
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2, err
    assert_one_line_error(err, f"{folder / 'config.json'}: ", "compressed-tensors, format 'dense'",
                          "plain dense weights", 'delete "quantization_config" from config.json')
    assert "prune its dense original" not in err and not (tmp_path / "out").exists()
    # the advice followed: the 2:4 pattern the folder holds is kept exactly
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 0, err
    got = sparse24.from_pretrained(type(tiny_llama()), tmp_path / "out")
    layers = {f"{fqn}.weight": m for fqn, m in got.named_modules() if isinstance(m, Sparse24Linear)}
    assert sorted(layers) == sorted(pruned)
    for key, w in pruned.items():
        assert torch.equal(layers[key].dense_weight().double(), w.double()), key


@pytest.mark.parametrize("qc", [
    {**CT_DENSE, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}},
     "format": "int-quantized"},
    {**CT_DENSE, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}}},
    {**CT_DENSE, "sparsity_config": {**SPARSITY, "format": "sparse-24-bitmask"}},
    {**CT_DENSE, "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
])
def test_compressed_tensors_folder_with_quantization_or_compression_stays_refused(capsys, tmp_path, qc):
    folder, _ = _ct_folder(tmp_path, qc)
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2, err
    assert_one_line_error(err, "is already quantized or compressed (compressed-tensors); prune its dense original")


# --- (g) an error of another type is not re-created with a message it does not take -----------------------------

class _TwoArgError(ValueError):
    """A ValueError subclass whose constructor takes other arguments (as a model's own error types may)."""

    def __init__(self, got, want):
        super().__init__(f"got {got}, want {want}")


def test_prune_folder_keeps_an_error_subclass_and_adds_where(tmp_path, monkeypatch):
    """`raise type(e)(message)` called _TwoArgError(message): a TypeError about its constructor instead."""
    folder = tmp_path / "src"
    tiny_llama().save_pretrained(folder)

    def fail(self, w):
        raise _TwoArgError(1, 2)
    monkeypatch.setattr(Sparse24Linear, "entries_from_dense", fail)
    with pytest.raises(_TwoArgError, match="got 1, want 2") as info:
        prune_folder(folder, tmp_path / "out", progress=False)
    assert any(str(folder / "model.safetensors") in n and "model.layers.0." in n for n in info.value.__notes__)
    assert not (tmp_path / "out").exists()


def test_recipe_layer_selection_keeps_an_error_subclass(monkeypatch):
    def fail(model, skip_output_head):
        raise _TwoArgError(3, 4)
    monkeypatch.setattr(recipes, "_kept_dense", fail)
    with pytest.raises(_TwoArgError, match="got 3, want 4") as info:
        recipes.SRSTE(nn.Sequential(nn.Linear(64, 64)))
    assert "SRSTE" in info.value.__notes__
    monkeypatch.setattr(recipes, "_kept_dense", lambda model, skip: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="^SRSTE: bad$"):
        recipes.SRSTE(nn.Sequential(nn.Linear(64, 64)))

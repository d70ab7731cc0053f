"""Pruning a Hugging Face folder block by block with calibration equals pruning the whole fp32 model in
memory layer by layer (prune_layerwise_), stored in the checkpoint's dtype: weights and masks bit for bit."""
import pytest
import torch
from transformers import LlamaForCausalLM

import sparse24
from sparse24 import Sparse24Linear
from sparse24 import compress
from sparse24.masks import nm, prune_layerwise_
from sparse24.tools.blockwise import prune_folder_blockwise

from hf_models import tiny_llama, tokens
from test_cli import run

BATCHES = [tokens(seed=s, shape=(2, 11)) for s in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    tiny_llama().half().save_pretrained(path, max_shard_size="40KB")  # fp16, several shards
    return path


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_block_by_block_equals_in_memory(tmp_path, folder, method):
    rows = prune_folder_blockwise(folder, tmp_path / "out", BATCHES, method=method)
    assert len(rows) == 14

    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    results = prune_layerwise_(ref, BATCHES, method=method, filter_fn=lambda m, f: f.startswith("model.layers."))
    dense = LlamaForCausalLM.from_pretrained(folder)  # fp16, unpruned
    out = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "out")
    layers = {fqn: m for fqn, m in out.named_modules() if isinstance(m, Sparse24Linear)}
    assert set(layers) == set(results)
    for fqn, r in results.items():
        m = layers[fqn]
        assert m.mode == "compressed" and m.dtype == torch.float16
        assert torch.equal(m.sparse_tensor().kept_mask(), r.mask), fqn
        assert torch.equal(m.dense_weight(), r.weight.half()), fqn
    for k, v in dense.state_dict().items():  # everything else as it was
        if k.rpartition(".")[0] not in layers:
            assert torch.equal(out.state_dict()[k], v), k


def test_int8_compressed_row_chunk_by_chunk_equals_compressing_whole(tmp_path, folder, monkeypatch):
    """Each layer is compressed a few rows at a time (2 here); values, meta words and scales are those of
    compressing the whole in-memory result at once."""
    from safetensors.torch import load_file
    monkeypatch.setattr(nm, "_CHUNK", 2 * 64)
    prune_folder_blockwise(folder, tmp_path / "out", BATCHES, method="wanda", quantize="int8")
    monkeypatch.undo()
    stored = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    results = prune_layerwise_(ref, BATCHES, method="wanda", filter_fn=lambda m, f: f.startswith("model.layers."))
    for fqn, r in results.items():
        want = compress(r.weight.half(), r.mask, quantize="int8").state_tensors()
        assert set(want) == {"values", "meta", "scale"}
        for n, t in want.items():
            assert torch.equal(stored[f"{fqn}.{n}"], t), (fqn, n)


def test_bad_calibration_input_changes_nothing(tmp_path, folder):
    with pytest.raises(TypeError, match="list of"):
        prune_folder_blockwise(folder, tmp_path / "out", torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids must lie in"):
        prune_folder_blockwise(folder, tmp_path / "out", [torch.full((1, 4), 10_000)])
    assert not (tmp_path / "out").exists() and not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_cli_prunes_block_by_block(capsys, tmp_path, folder):
    torch.save(torch.cat(BATCHES), tmp_path / "ids.pt")
    rc, out, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "cli"), "--method", "wanda",
                       "--calibration-ids", str(tmp_path / "ids.pt"), "--batch-size", "2")
    assert rc == 0, err
    assert "block by block on 6 x 11 tokens" in out
    prune_folder_blockwise(folder, tmp_path / "api", list(torch.cat(BATCHES).split(2)), method="wanda")
    a, b = (sparse24.from_pretrained(LlamaForCausalLM, tmp_path / n).state_dict() for n in ("cli", "api"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.save(torch.zeros(3), tmp_path / "bad.pt")
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--method", "sparsegpt",
                     "--calibration-ids", str(tmp_path / "bad.pt"))
    assert rc == 2 and "expected an (N, L) int64 tensor of token ids" in err
    assert not (tmp_path / "o").exists()
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--method", "wanda",
                     "--calibration-ids", str(tmp_path / "ids.pt"), "--prune-head")   # (it was ignored)
    assert rc == 2 and "the output head stays dense; give it without --prune-head" in err
    for empty in ((0, 11), (6, 0)):  # ids.min() of no ids raised a traceback
        torch.save(torch.zeros(empty, dtype=torch.long), tmp_path / "empty.pt")
        rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--method", "sparsegpt",
                         "--calibration-ids", str(tmp_path / "empty.pt"))
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "holds no token ids" in err, err
        assert not (tmp_path / "o").exists()

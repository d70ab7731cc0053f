"""The same prune, run twice, writes the same bytes: a torch.save file (its zip records were named after
write_together's pid-bearing temporary file) and safetensors shards (two metadata keys came out in the
random order of the safetensors library's hash map)."""
import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_models import tiny_llama, tokens
from test_cli import run
from sparse24.tools.blockwise import prune_folder_blockwise


def _digests(path: Path) -> dict:
    """sha256 of a file, or of every file under a folder by relative name."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)) if path.is_dir() else "": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def _check_metadata(folder: Path):
    shards = sorted(folder.glob("*.safetensors"))
    assert shards
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            # one key: safetensors writes a metadata map in hash order, random from call to call
            assert f.metadata() == {"format": "pt"}, shard.name


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_state_dict_prune_twice_same_bytes(capsys, tmp_path, suffix):
    sd = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    torch.save(sd, tmp_path / "dense.pt")
    outs = [tmp_path / f"out{i}{suffix}" for i in range(2)]  # other names: the file must not depend on its own name
    for out in outs:
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(out), "--no-progress")
        assert rc == 0, err
    a, b = (_digests(o)[""] for o in outs)
    assert a == b
    if suffix == ".pt":
        loaded = torch.load(outs[0], weights_only=True)
        assert "model.layers.0.mlp.up_proj.values" in loaded


def test_folder_prune_twice_same_bytes(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    outs = [tmp_path / f"sparse{i}" for i in range(2)]
    for out in outs:
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(out), "--no-progress")
        assert rc == 0, err
    _check_metadata(outs[0])
    assert _digests(outs[0]) == _digests(outs[1])


def test_blockwise_prune_twice_same_bytes(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    batches = [tokens(shape=(1, 5))]
    outs = [tmp_path / f"sparse{i}" for i in range(2)]
    for out in outs:
        prune_folder_blockwise(tmp_path / "dense", out, batches, method="wanda")
    _check_metadata(outs[0])
    assert _digests(outs[0]) == _digests(outs[1])

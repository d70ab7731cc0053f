"""Reviews of the Hugging Face entry points: wrong argument types, byte-identical saves."""
import hashlib

import pytest
import torch
from transformers import LlamaForCausalLM

import sparse24
from sparse24 import hf

from hf_models import tiny_llama, tokens


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_saves_of_one_sparse_model_are_byte_identical(tmp_path):
    # the safetensors header held two metadata keys in random order: saves differed at random
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    for i in range(4):
        model.save_pretrained(tmp_path / str(i))
    first = _digests(tmp_path / "0")
    assert all(_digests(tmp_path / str(i)) == first for i in range(1, 4))
    back = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "0")
    x = tokens()
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


def test_entry_points_name_a_wrong_argument_type(tmp_path):
    with pytest.raises(TypeError, match="sparsity_config: model must be a torch.nn.Module"):
        hf.sparsity_config("model")
    with pytest.raises(TypeError, match="attach: model must be a torch.nn.Module"):
        hf.attach(None)
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    # a valid config.json was blamed ("transformers cannot build the model it describes")
    for cls in ("LlamaForCausalLM", torch.nn.Linear):
        with pytest.raises(TypeError, match="cls must be a transformers model class"):
            sparse24.from_pretrained(cls, tmp_path)

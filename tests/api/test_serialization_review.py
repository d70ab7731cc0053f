"""Loading and reading files, review round 4: a load_state_dict refused part way by another module's
loader leaves the model picklable and a later load works; deeply nested JSON in a folder's config.json
or shard index is one ValueError naming the file (the command line's side: tests/tools/test_loaders_review.py)."""
import io
import pickle

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import LearnableMask, Sparse24Linear
from sparse24.nn import state

from conftest import top2_mask

DEEP = "[" * 5000 + "]" * 5000  # 10 KB: past Python's recursion limit in json's decoder


# --- a load refused part way --------------------------------------------------------------------------

class Refuses(nn.Module):
    """A user's module whose own loading code refuses a state (any value but 0)."""

    def get_extra_state(self):
        return torch.tensor(0)

    def set_extra_state(self, s):
        if int(s) != 0:
            raise ValueError("refused by a user's set_extra_state")


class Net(nn.Module):
    def __init__(self, refuser: str):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.mid = LearnableMask((16, 16)) if refuser == "learnable_mask" else Refuses()
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)


def _net(refuser: str, seed: int):
    torch.manual_seed(seed)
    model = Net(refuser)
    dense = {n: model.get_submodule(n).weight.detach().double().clone() for n in "abc"}  # before sparsify_
    sparse24.sparsify_(model)
    return model, dense


@pytest.mark.parametrize("refuser", ["learnable_mask", "user_module"])
def test_a_load_refused_part_way_leaves_the_model_picklable_and_loadable(refuser, monkeypatch):
    model, _ = _net(refuser, 0)
    bad = model.state_dict()
    bad["mid._extra_state"] = torch.tensor([1, 4]) if refuser == "learnable_mask" else torch.tensor(1)
    with pytest.raises(ValueError):  # b and c come after the refusing module: torch never reached them
        model.load_state_dict(bad)
    x = torch.randn(3, 64)
    ref = model.c(model.b(model.a(x))).detach()
    copies = [pickle.loads(pickle.dumps(model))]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies.append(torch.load(buf, weights_only=False))
    for c in copies:
        assert torch.equal(c.c(c.b(c.a(x))), ref)
    # a later, valid load takes every layer's entries, each layer's checked once (by the whole-model check)
    source, dense = _net(refuser, 1)
    calls = []
    real = state.check_state
    monkeypatch.setattr(state, "check_state", lambda *a: (calls.append(a[2]), real(*a))[1])
    model.load_state_dict(source.state_dict())
    assert sorted(calls) == ["a.", "b.", "c."]
    for n, w in dense.items():
        layer = model.get_submodule(n)
        assert isinstance(layer, Sparse24Linear)
        assert torch.equal(layer.mask, top2_mask(w))
        assert torch.equal(layer.weight.double(), w * top2_mask(w))
    pickle.dumps(model)


# --- deeply nested JSON in a folder -------------------------------------------------------------------

def _folder(tmp_path):
    from hf_models import tiny_llama
    model = tiny_llama()
    sparse24.sparsify_(model)
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m", type(model)


def test_nested_config_json_is_a_value_error_naming_the_file(tmp_path):
    from sparse24 import hf
    folder, cls = _folder(tmp_path)
    (folder / "config.json").write_text(DEEP)
    for call in (lambda: hf.read_config(folder), lambda: hf.read_section(folder),
                 lambda: sparse24.from_pretrained(cls, str(folder))):
        with pytest.raises(ValueError, match="config.json"):
            call()


def test_nested_shard_index_is_a_value_error_naming_the_file(tmp_path):
    from sparse24 import hf
    folder, cls = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(DEEP)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        hf.read_shard_index(folder)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        sparse24.from_pretrained(cls, str(folder))

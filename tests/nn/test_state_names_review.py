"""The entry names a strict load expects of a 2:4 layer, computed without building its state (layout v1 of a
decode-layout layer), are the names its state dict holds."""
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear


class WithExtraState(Sparse24Linear):
    def get_extra_state(self):
        return {"note": 1}

    def set_extra_state(self, state):
        self.note = state["note"]


def test_a_layer_class_with_extra_state_loads_its_own_state_dict_strictly():
    """``_extra_state`` (torch saves it where the class defines get_extra_state) was missing from the names,
    so a strict load of the model's own state dict reported it as unexpected."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    sparse24.sparsify_(model, min_features=0, skip_output_head=False)   # (the model's load guard: strict checks)
    model[0].__class__ = WithExtraState
    sd = model.state_dict()
    assert "0._extra_state" in sd
    assert not model.load_state_dict(sd, strict=True).unexpected_keys
    del sd["0._extra_state"]
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        assert "Missing key(s) in state_dict: '0._extra_state'" in str(e)
    else:
        raise AssertionError("a strict load without the layer's extra state was accepted")

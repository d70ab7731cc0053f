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


# --- a masked layer whose weight is parametrized (torch.nn.utils.parametrize, docs/modules.md) ---------------

class _Twice(nn.Module):
    def forward(self, w):
        return 2 * w


def _parametrized_model(seed: int) -> nn.Sequential:
    """Two masked layers, the first's weight parametrized with a dense original (as SR-STE trains it)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    sparse24.sparsify_(model, min_features=0, skip_output_head=False)
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Twice())
    with torch.no_grad():
        model[0].parametrizations.weight.original.copy_(torch.randn(16, 16))   # dense where pruned too
    return model


def _reference(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """float64: the parametrization's output times the mask, by hand, then the second masked layer."""
    d = {k: v.double() for k, v in sd.items()}
    w0 = 2 * d["0.parametrizations.weight.original"] * d["0.mask"]
    h = x.double() @ w0.T + d["0.bias"]
    return h @ (d["1.weight"] * d["1.mask"]).T + d["1.bias"]


def test_a_parametrized_masked_weight_round_trips_its_state_dict():
    """The layer's 2:4 entries were looked for as 'weight' + 'mask', but a parametrized weight is saved as
    'parametrizations.weight.original': a strict load of the model's own state dict was refused as incomplete,
    a non-strict one raised a bare KeyError('weight'), a lone layer refused its own."""
    import copy
    sd = copy.deepcopy(_parametrized_model(0).state_dict())
    assert "0.parametrizations.weight.original" in sd and "0.weight" not in sd
    x = torch.randn(3, 16)
    want = _reference(sd, x)
    for strict in (True, False):
        model = _parametrized_model(1)
        assert not torch.allclose(model(x).double(), want, atol=1e-3)   # (the load must change it)
        result = model.load_state_dict(sd, strict=strict)
        assert not result.missing_keys and not result.unexpected_keys
        torch.testing.assert_close(model(x).double(), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(model[0].mask, sd["0.mask"])
    layer = _parametrized_model(1)[0]
    layer.load_state_dict({k[2:]: v for k, v in sd.items() if k.startswith("0.")})
    torch.testing.assert_close(layer(x).double(), x.double() @ (2 * sd["0.parametrizations.weight.original"].double()
                                                                 * sd["0.mask"]).T + sd["0.bias"].double(),
                               atol=1e-5, rtol=1e-5)


def test_a_parametrized_masked_weight_refuses_a_corrupt_mask_and_changes_nothing():
    import copy
    sd = copy.deepcopy(_parametrized_model(0).state_dict())
    sd["0.mask"][0, :4] = torch.tensor([True, True, True, False])
    for strict in (True, False):
        model = _parametrized_model(1)
        before = copy.deepcopy(model.state_dict())
        try:
            model.load_state_dict(sd, strict=strict)
        except RuntimeError as e:
            assert "0: mask is not 2:4: row 0, group 0" in str(e), str(e)
        else:
            raise AssertionError(f"a mask keeping 3 of 4 was loaded (strict={strict})")
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_parametrized_masked_weight_loads_a_shard_split_between_mask_and_original():
    """A sharded checkpoint loaded one shard per non-strict call (Trainer's resume) may split the mask from the
    original: each part is taken (the mask alone is checked whole)."""
    import copy
    sd = copy.deepcopy(_parametrized_model(0).state_dict())
    model = _parametrized_model(1)
    keys = list(sd)
    cut = keys.index("0.parametrizations.weight.original")
    for part in (keys[:cut], keys[cut:]):
        model.load_state_dict({k: sd[k] for k in part}, strict=False)
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x).double(), _reference(sd, x), atol=1e-5, rtol=1e-5)

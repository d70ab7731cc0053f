"""Unusual model graphs through the whole-model calls (review "graphs", round 8): a weight read through
a deeper path (``self.block.fc.weight``, ``self.layers[1].weight``, ``self.heads[k].weight``), a weight a
buffer aliases, and a Linear's state_dict / load_state_dict hooks across the swap. References are plain
torch: float64 copies of the weights times masks computed here (top-2 |w| of each group of 4)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear


def mask24(w: torch.Tensor) -> torch.Tensor:
    """The magnitude 2:4 mask, in plain torch: the two largest |w| of each group of 4 along a row."""
    g = w.detach().abs().reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(2, dim=-1).indices, True)
    return keep.reshape(w.shape)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)


class GrandRead(nn.Module):
    """Calls ``block`` and reads its child's weight: ``self.block.fc.weight``."""
    readers = {"block.fc"}

    def __init__(self):
        super().__init__()
        self.block, self.out = _Inner(), nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.block(x) + F.linear(x, self.block.fc.weight))


class ListRead(nn.Module):
    """Calls ``layers[0]``, reads ``self.layers[1].weight`` (a literal index: that layer only)."""
    readers = {"layers.1"}

    def __init__(self):
        super().__init__()
        self.layers, self.out = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)]), nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.layers[0](x) + x @ self.layers[1].weight.t())


class DictRead(nn.Module):
    """Calls ``heads["v"]``, reads ``self.heads['q'].weight`` (a literal key: that layer only)."""
    readers = {"heads.q"}

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"q": nn.Linear(64, 64), "v": nn.Linear(64, 64)})
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.heads["v"](x) + F.linear(x, self.heads['q'].weight, self.heads["q"].bias))


class IndexRead(nn.Module):
    """Reads ``self.heads[k].weight`` with ``k`` known at run time: every head is read."""
    readers = {"heads.0", "heads.1", "heads.2"}

    def __init__(self):
        super().__init__()
        self.heads, self.out = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)]), nn.Linear(64, 64)

    def forward(self, x):
        h = 0
        for k in range(len(self.heads)):
            h = h + x @ self.heads[k].weight.t()
        return self.out(h)


def _reference(dense: nn.Module, weights: dict, masks: dict) -> nn.Module:
    """A float64 plain-torch copy of ``dense`` whose Linear weights are ``weights[fqn] * masks[fqn]``."""
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for fqn, w in weights.items():
            ref.get_submodule(fqn).weight.copy_(w.double() * masks[fqn])
    return ref


@pytest.mark.parametrize("cls", [GrandRead, ListRead, DictRead, IndexRead])
def test_a_weight_read_through_a_deeper_path_keeps_its_layer_masked_and_masks_in_place_writes(cls):
    torch.manual_seed(0)
    dense = cls().eval()
    x = torch.randn(5, 64)
    linears = [fqn for fqn, m in dense.named_modules() if isinstance(m, nn.Linear)]
    masks = {fqn: mask24(dense.get_submodule(fqn).weight) for fqn in linears}
    model = copy.deepcopy(dense)
    report = sparse24.sparsify_(model, skip_output_head=False)
    reasons = {r.fqn: r.reason for r in report.layers}
    for fqn in linears:
        assert ("reads self." in reasons[fqn]) == (fqn in cls.readers), reasons
        assert torch.equal(model.get_submodule(fqn).mask, masks[fqn])
    # a user's in-place write (as vector_to_parameters, copy_ under no_grad): the directly read layers'
    # forwards never run, the parent's pre-hook must re-zero their pruned entries
    new = {fqn: torch.randn(64, 64) / 8 for fqn in linears}
    with torch.no_grad():
        for fqn, w in new.items():
            model.get_submodule(fqn).weight.copy_(w)
        y = model(x)
        y_ref = _reference(dense, new, masks)(x.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)
    # compress_: the read layers stay masked (a compressed layer has no weight to read), the model runs
    compressed = copy.deepcopy(dense)
    sparse24.sparsify_(compressed, skip_output_head=False)
    sparse24.compress_(compressed)
    assert {fqn: compressed.get_submodule(fqn).mode for fqn in linears} == \
        {fqn: "masked" if fqn in cls.readers else "compressed" for fqn in linears}
    with torch.no_grad():
        y = compressed(x)
        y_ref = _reference(dense, {f: dense.get_submodule(f).weight for f in linears}, masks)(x.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_weight_a_buffer_aliases_is_kept_dense_as_tied(persistent):
    class Model(nn.Module):
        """A head whose weight also serves, frozen, as the embedding table (a buffer over its memory)."""

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 64)
            self.head = nn.Linear(64, 64, bias=False)
            self.register_buffer("table", self.head.weight.detach(), persistent=persistent)

        def forward(self, ids):
            return self.head(torch.relu(self.body(F.embedding(ids, self.table))))

    torch.manual_seed(0)
    dense = Model().eval()
    torch.manual_seed(0)
    model = Model().eval()   # (not deepcopy, which copies the buffer's memory apart from the weight's)
    ids = torch.randint(0, 64, (4, 8))
    table = model.table.clone()
    report = sparse24.sparsify_(model, skip_output_head=False)
    lines = {r.fqn: r for r in report.layers}
    assert lines["head"].action == "skipped" and "shared with buffer table" in lines["head"].reason
    assert type(model.head) is nn.Linear and isinstance(model.body, Sparse24Linear)
    assert torch.equal(model.table, table) and model.table.data_ptr() == model.head.weight.data_ptr()
    with torch.no_grad():
        y = model(ids)
        y_ref = _reference(dense, {"body": dense.body.weight}, {"body": mask24(dense.body.weight)})(ids)
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)


def test_state_dict_hooks_are_carried_over_and_see_the_new_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    seen = []
    handles = [
        model[0].register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append(("pre", type(m).__name__))),
        model[0].register_state_dict_post_hook(
            lambda m, sd, prefix, meta: sd.__setitem__(prefix + "version", torch.tensor(2))),
        model[0].register_load_state_dict_post_hook(lambda m, keys: seen.append(("loaded", type(m).__name__))),
    ]
    sparse24.sparsify_(model, skip_output_head=False)
    assert isinstance(model[0], Sparse24Linear)
    sd = model.state_dict()
    assert sorted(sd) == ["0.bias", "0.mask", "0.version", "0.weight", "2.bias", "2.mask", "2.weight"]
    assert seen == [("pre", "Sparse24Linear")]
    seen.clear()
    model.load_state_dict({k: v for k, v in sd.items() if k != "0.version"})
    assert seen == [("loaded", "Sparse24Linear")]
    sparse24.compress_(model)
    assert sorted(model.state_dict()) == ["0.bias", "0.meta", "0.values", "0.version", "2.bias", "2.meta", "2.values"]
    sparse24.densify_(model)
    assert type(model[0]) is nn.Linear and "0.version" in model.state_dict()
    for h in handles:   # the handles the user holds still remove the hooks
        h.remove()
    seen.clear()
    assert "0.version" not in model.state_dict() and seen == []


def test_a_layer_with_a_load_state_dict_pre_hook_is_not_swapped_and_keeps_the_hook():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    def rename_old(module, sd, prefix, *args):   # old checkpoints named the weight 'w'
        if prefix + "w" in sd:
            sd[prefix + "weight"] = sd.pop(prefix + "w")
    model[0].register_load_state_dict_pre_hook(rename_old)
    old = {"0.w": torch.randn(64, 64), "0.bias": torch.randn(64)}
    report = sparse24.sparsify_(model, skip_output_head=False)
    line = next(r for r in report.layers if r.fqn == "0")
    assert line.action == "skipped" and "load_state_dict pre-hook" in line.reason
    assert type(model[0]) is nn.Linear and isinstance(model[2], Sparse24Linear)
    model.load_state_dict(old, strict=False)   # the hook still renames an old checkpoint's keys
    assert torch.equal(model[0].weight, old["0.w"]) and torch.equal(model[0].bias, old["0.bias"])


def test_densify_refuses_a_layer_with_load_state_dict_pre_hooks_changing_nothing():
    """densify_ dropped a load_state_dict pre-hook registered on a 2:4 layer without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    sparse24.sparsify_(model, min_features=0, skip_output_head=False)
    seen = []
    model[2]._register_load_state_dict_pre_hook(lambda *a, **k: seen.append(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"densify_: layer '2' has load_state_dict pre-hooks.*nothing was changed"):
        sparse24.densify_(model)
    assert all(isinstance(model[i], Sparse24Linear) for i in (0, 2))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    model.load_state_dict(before)
    assert seen == [1]   # the hook is still there and runs

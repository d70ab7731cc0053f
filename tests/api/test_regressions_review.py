"""Regressions found in the review of the training-loop fixes: a weight pruned sparser than 2:4 with whole
dead inputs (SparseGPT zeroes their columns) kept exactly; identity inits of small layers trainable; the
Conv1D replacement record written only by a swap; GradualPruner states of another layer selection named;
learn_masks with a filter written for nn.Linear. Each against an independent reference: masks from the
weight's own non-zeros or an independent sort, deep copies taken before the call."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear, is_nm, sparsify_
from sparse24.masks import prune_layerwise_
from sparse24.recipes import GradualPruner


def top2_mask(w: torch.Tensor) -> torch.Tensor:
    """Independent 2:4 magnitude mask of an (out, in) weight: a stable sort of each group of 4 inputs."""
    idx = torch.sort(w.abs().reshape(-1, 4), dim=-1, descending=True, stable=True).indices[:, :2]
    return torch.zeros(w.numel() // 4, 4, dtype=torch.bool).scatter_(-1, idx, True).view_as(w)


def _nm_weight(R, C, n, m, dead=(), seed=0):
    """float64 (R, C) weight keeping n random entries of every m inputs, columns ``dead`` zero in every row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(R, C, generator=g, dtype=torch.float64)
    keep = torch.zeros(R, C // m, m, dtype=torch.bool)
    keep.scatter_(-1, torch.rand(R, C // m, m, generator=g).argsort(-1)[..., :n], True)
    w = w.masked_fill(~keep.view(R, C), 0)
    w[:, list(dead)] = 0
    return w


# --- 1. a sparser-than-2:4 weight with dead inputs keeps exactly its non-zeros ---------------------------

@pytest.mark.parametrize("n,m", [(1, 8), (2, 8), (1, 4)])
@pytest.mark.parametrize("dead", [range(8), range(16, 32)], ids=["8 dead", "16 dead"])
def test_sparser_weight_with_dead_inputs_keeps_exactly_its_non_zeros(n, m, dead):
    w = _nm_weight(32, 64, n, m, dead)
    lin = nn.Linear(64, 32).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    model = nn.Sequential(lin)
    rep = sparsify_(model, min_features=0, skip_output_head=False)
    assert torch.equal(model[0].mask, w != 0)                  # not the 2:4 fill of the dead columns
    assert "fewer than 2 of 4" in rep.changed[0].reason
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 64, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    assert torch.equal(model[0].weight != 0, w != 0) and is_nm(model[0].weight.detach(), n, m)


@pytest.mark.parametrize("n,m", [(1, 8), (2, 8), (1, 4)])
def test_sparsegpt_prune_with_dead_inputs_then_sparsify_keeps_the_pattern(n, m):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    with torch.no_grad():   # features 0..7 of the second layer's input never active: SparseGPT zeroes their columns
        model[0].weight[:8] = 0
        model[0].bias[:8] = 0
    prune_layerwise_(model, [torch.randn(16, 32) for _ in range(2)], n=n, m=m, method="sparsegpt", progress=False)
    w = model[1].weight.detach().clone()
    assert not w[:, :8].any() and is_nm(w, n, m)
    sparsify_(model, min_features=0, skip_output_head=False)
    assert torch.equal(model[1].mask, w != 0)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (8, 64), (16, 16), (8, 8), (4, 4), (32, 8), (8, 32)])
def test_identity_init_of_any_size_gets_a_full_24_mask(shape):
    R, C = shape
    lin = nn.Linear(C, R).double()
    nn.init.eye_(lin.weight)
    w0 = lin.weight.detach().clone()
    layer = Sparse24Linear.from_linear(lin)
    assert torch.equal(layer.mask, top2_mask(w0))               # 2 of every 4, the diagonal among them
    assert torch.equal(layer.mask & (w0 != 0), w0 != 0)


def test_a_pruned_row_beside_a_zero_row_and_dead_inputs():
    w = _nm_weight(16, 32, 1, 8, dead=range(8, 16))
    w[5] = 0                                                   # an empty row: a full 2:4 row
    lin = nn.Linear(32, 16).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Sparse24Linear.from_linear(lin)
    rows = torch.arange(16) != 5
    assert torch.equal(layer.mask[rows], (w != 0)[rows])
    assert torch.equal(layer.mask[5], top2_mask(w)[5]) and int(layer.mask[5].sum()) == 16


# --- 2. the Conv1D replacement record: written by the swap only ------------------------------------------

def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def _gpt2_step(model, opt):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    model(ids, labels=ids).loss.backward()
    opt.step()


def test_from_linear_of_a_conv1d_left_in_the_model_does_not_refuse_its_optimizer():
    model = _tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    conv = model.transformer.h[0].mlp.c_fc
    w0 = conv.weight.detach().clone()
    probe = Sparse24Linear.from_linear(conv)                 # a 2:4 copy; the Conv1D stays the model's layer
    assert torch.equal(probe.weight, w0.t() * top2_mask(w0.t()))
    _gpt2_step(model, opt)                                   # the dense model trains on
    assert not torch.equal(conv.weight, w0)
    assert model.transformer.h[0].mlp.c_fc is conv


def test_sparsify_then_an_old_optimizer_is_still_refused_and_a_failed_one_leaves_no_record():
    from sparse24.nn import masking
    model = _tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convs = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    with torch.no_grad():
        convs[-1].weight[0, 0] = float("inf")               # the last layer's prepare fails
    with pytest.raises(ValueError, match="nothing was changed"):
        sparsify_(model)
    assert not any(c.weight in masking._REPLACED for c in convs)
    with torch.no_grad():
        convs[-1].weight[0, 0] = 0.5
    _gpt2_step(model, opt)                                   # the dense model still trains
    sparsify_(model)
    assert all(c.weight in masking._REPLACED for c in convs)
    with pytest.raises(RuntimeError, match="Conv1D.*that sparsify_ replaced"):
        _gpt2_step(model, opt)


def test_sparsify_failing_in_its_swap_section_leaves_no_record(monkeypatch):
    from sparse24.api import swap
    from sparse24.nn import masking
    model = _tiny_gpt2()
    convs = [m for m in model.modules() if type(m).__name__ == "Conv1D"]

    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(swap, "_after_change", boom)         # the last step of the undoable section
    with pytest.raises(RuntimeError, match="boom"):
        sparsify_(model)
    assert not any(c.weight in masking._REPLACED for c in convs)
    assert [m for m in model.modules() if type(m).__name__ == "Conv1D"] == convs


# --- 3. GradualPruner.load_state_dict of another layer selection ----------------------------------------

class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc, self.head = nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100)

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


def test_gradual_pruner_state_with_the_output_head_names_it_and_the_fix():
    model = _TinyLM()
    old = GradualPruner(model, (2, 4), end_step=10, frequency=2, skip_output_head=False)
    old.step(4)
    saved = copy.deepcopy(old.state_dict())
    new = GradualPruner(model, (2, 4), end_step=10, frequency=2)
    before = copy.deepcopy(new.state_dict())
    with pytest.raises(ValueError, match=r"the state has 'head', which this pruner leaves out \(output head"
                                         r".*skip_output_head=False"):
        new.load_state_dict(saved)
    after = new.state_dict()
    assert after["pruned_k"] == before["pruned_k"]
    assert all(torch.equal(after["masks"][k], before["masks"][k]) for k in before["masks"])
    again = GradualPruner(model, (2, 4), end_step=10, frequency=2, skip_output_head=False)
    again.load_state_dict(saved)                             # the suggested pruner resumes
    assert all(torch.equal(again.masks[k], saved["masks"][k]) for k in saved["masks"])


def test_gradual_pruner_state_missing_a_layer_names_it():
    model = _TinyLM()
    saved = GradualPruner(model, (2, 4), end_step=10, frequency=2).state_dict()
    whole = GradualPruner(model, (2, 4), end_step=10, frequency=2, skip_output_head=False)
    with pytest.raises(ValueError, match=r"this pruner prunes 'head', which the state lacks"):
        whole.load_state_dict(saved)


# --- 4. learn_masks with a filter written for nn.Linear --------------------------------------------------

def test_learn_masks_with_an_nn_linear_filter_learns_the_swapped_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    dense = {f: model.get_submodule(f).weight.detach().clone() for f in ("0", "2", "4")}
    flt = lambda m, fqn: isinstance(m, nn.Linear) and fqn != "0"  # noqa: E731
    batches = [torch.randn(8, 64) for _ in range(2)]
    rep = sparse24.learn_masks(model, batches, 3, loss_fn=lambda out, b: out.pow(2).mean(), filter_fn=flt,
                               min_features=0, skip_output_head=False, check_batches=0, progress=False)
    assert sorted(rep.layers) == ["2", "4"]                   # a mask learned for each swapped layer
    assert isinstance(model[0], nn.Linear) and torch.equal(model[0].weight, dense["0"])
    for f in ("2", "4"):
        layer = model.get_submodule(f)
        assert is_nm(layer.mask.double(), 2, 4) and int(layer.mask.sum()) == 64 * 32
        assert torch.equal(layer.weight, dense[f] * layer.mask)


def test_learn_masks_filter_still_selects_among_layers_sparse_before_the_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    teacher = copy.deepcopy(model)
    sparsify_(model, min_features=0, skip_output_head=False)
    batches = [torch.randn(8, 64) for _ in range(2)]
    rep = sparse24.learn_masks(model, batches, 2, teacher=teacher, filter_fn=lambda m, fqn: fqn == "2",
                               min_features=0, skip_output_head=False, check_batches=0, progress=False)
    assert sorted(rep.layers) == ["2"]

"""Recipes: the cubic gradual-pruning schedule and SR-STE, checked against
values and gradients computed by hand or by an independent sort."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from sparse24 import is_nm
from sparse24.recipes import SRSTE, GradualPruner


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)).to(dtype)


def train_steps(model, pruner, steps, start=0, lr=1e-2, seed=0):
    """A real loop: Adam moves pruned weights too, so pruner.step must re-zero them."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr)
    history = []
    for t in range(start, start + steps):
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        pruner.step(t)
        history.append({k: v.clone() for k, v in pruner.masks.items()})
    return history


def kept_magnitudes_dominate(w, mask):
    """Independent check that a mask keeps the largest magnitudes: every
    kept |w| >= every pruned |w|."""
    a = w.detach().abs()
    return bool(a[mask].min() >= a[~mask].max())


# --- schedule ----------------------------------------------------------------

def test_schedule_matches_cubic_formula_by_hand():
    p = GradualPruner(mlp(), 0.9, initial_sparsity=0.1, start_step=10, end_step=110, frequency=10, min_features=0)
    # s_t = 0.9 + (0.1 - 0.9) * (1 - (t - 10) / 100) ** 3, evaluated by hand:
    expected = {0: 0.0, 9: 0.0,             # nothing pruned before t0
                10: 0.1,                    # t0: s_i
                20: 0.9 - 0.8 * 0.729,      # (0.9)^3 = 0.729
                60: 0.9 - 0.8 * 0.125,      # (0.5)^3
                100: 0.9 - 0.8 * 0.001,     # (0.1)^3
                110: 0.9, 500: 0.9}         # end and after: s_f
    for t, s in expected.items():
        assert p.sparsity_at(t) == pytest.approx(s, abs=1e-12), t


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_unstructured_counts_follow_schedule_and_end_exact(scope):
    model = mlp()
    p = GradualPruner(model, 0.75, start_step=2, end_step=10, frequency=4, scope=scope, min_features=0)
    hist = train_steps(model, p, 14)
    total = sum(m.numel() for m in p.masks.values())
    for t, masks in enumerate(hist):
        pruned_at = 0 if t < 2 else (2 if t < 6 else (6 if t < 10 else 10))
        s = 0.0 if t < 2 else p.sparsity_at(pruned_at)
        if scope == "layer":
            for k, mk in masks.items():
                assert int((~mk).sum()) == round(s * mk.numel()), (t, k)
        else:
            assert sum(int((~mk).sum()) for mk in masks.values()) == round(s * total), t
    assert p.sparsity() == 0.75  # 0.75 * 1536 is an integer: exact
    for _, lin in p.layers:  # the weights really are zero where pruned
        assert torch.equal(lin.weight != 0, p.masks[_] & (lin.weight != 0))
        assert int((lin.weight[~p.masks[_]] != 0).sum()) == 0


def test_first_pruning_keeps_largest_magnitudes_per_layer_and_globally():
    for scope in ("layer", "global"):
        model = mlp(3)
        p = GradualPruner(model, 0.6, initial_sparsity=0.4, start_step=0, end_step=5, frequency=5, scope=scope,
                          min_features=0)
        dense = {k: lin.weight.detach().clone() for k, lin in p.layers}
        p.step(0)  # prunes to s_i = 0.4 from the untouched weights
        if scope == "layer":
            for k, mk in p.masks.items():
                assert kept_magnitudes_dominate(dense[k], mk)
        else:
            w = torch.cat([dense[k].flatten() for k in p.masks])
            mk = torch.cat([p.masks[k].flatten() for k in p.masks])
            assert kept_magnitudes_dominate(w, mk)
            assert int((~mk).sum()) == round(0.4 * w.numel())


def test_masks_frozen_between_pruning_steps_and_monotone():
    model = mlp(1)
    p = GradualPruner(model, 0.8, start_step=3, end_step=15, frequency=4, min_features=0)
    hist = train_steps(model, p, 20, lr=5e-2)
    prune_steps = {3, 7, 11, 15}
    for t in range(1, 20):
        for k in hist[t]:
            if t not in prune_steps:
                assert torch.equal(hist[t][k], hist[t - 1][k]), (t, k)
            else:
                assert not bool((hist[t][k] & ~hist[t - 1][k]).any()), (t, k)  # nothing revived
                if t != 3:  # at t0 the schedule gives s_i = 0: nothing pruned yet
                    assert not torch.equal(hist[t][k], hist[t - 1][k])


@pytest.mark.parametrize("nm, scope", [((2, 4), "layer"), ((2, 4), "global"), ("1:4", "layer"), ((3, 8), "layer")])
def test_nm_target_is_reached_exactly_and_gradually(nm, scope):
    n, m = (1, 4) if nm == "1:4" else nm
    model = mlp(2)
    p = GradualPruner(model, nm, start_step=0, end_step=12, frequency=3, scope=scope, min_features=0)
    hist = train_steps(model, p, 16)
    for t, masks in enumerate(hist):
        for k, mk in masks.items():
            pruned_per_group = (~mk).view(-1, m).sum(-1)
            assert int(pruned_per_group.max()) <= m - n, (t, k)  # never past n:m
    for k, lin in p.layers:
        assert is_nm(lin.weight, n, m)
        assert torch.equal(p.masks[k].view(-1, m).sum(-1), torch.full((lin.weight.numel() // m,), n))
    # intermediate steps sit strictly between dense and N:M
    mid = sum(int((~mk).sum()) for mk in hist[3].values()) / sum(mk.numel() for mk in hist[3].values())
    assert 0.0 < mid < 1 - n / m


def test_nm_candidates_are_the_weights_nm_would_drop():
    """One N:M pruning step from dense keeps, in every group, at least the n
    largest magnitudes (computed here by an independent sort)."""
    model = mlp(4)
    p = GradualPruner(model, (2, 4), initial_sparsity=0.3, start_step=0, end_step=4, frequency=4, min_features=0)
    dense = {k: lin.weight.detach().clone() for k, lin in p.layers}
    p.step(0)
    for k, w in dense.items():
        top2 = w.abs().view(-1, 4).sort(-1, descending=True).indices[:, :2]
        assert bool(p.masks[k].view(-1, 4).gather(-1, top2).all()), k
        assert int((~p.masks[k]).sum()) == round(0.3 * w.numel())


def test_skipped_pruning_step_is_caught_up_and_state_roundtrips():
    model = mlp(5)
    p = GradualPruner(model, 0.5, start_step=0, end_step=10, frequency=5, min_features=0)
    p.step(7)  # step 5 was never called: prune to s(5)
    assert p.sparsity() == pytest.approx(round(p.sparsity_at(5) * 1536) / 1536)
    q = GradualPruner(copy.deepcopy(model), 0.5, start_step=0, end_step=10, frequency=5, min_features=0)
    q.load_state_dict(p.state_dict())
    assert all(torch.equal(q.masks[k], p.masks[k]) for k in p.masks)
    q.step(8)  # same pruning interval: no change
    assert all(torch.equal(q.masks[k], p.masks[k]) for k in p.masks)


def test_load_state_dict_checks_everything_before_changing_anything():
    # a state without 'pruned_k' used to replace the masks and then raise KeyError;
    # float masks were silently cast to bool, lists raised AttributeError
    p = GradualPruner(mlp(5), 0.5, start_step=0, end_step=10, frequency=5, min_features=0)
    p.step(5)
    good = p.state_dict()
    before = {k: v.clone() for k, v in p.masks.items()}
    zeros = {k: torch.zeros_like(v) for k, v in good["masks"].items()}
    for bad, msg in [({"masks": zeros}, "keys"), ([1], "keys"),
                     ({"masks": {k: v.float() for k, v in good["masks"].items()}, "pruned_k": 1}, "masks do not match"),
                     ({"masks": {k: [1] for k in good["masks"]}, "pruned_k": 1}, "masks do not match"),
                     ({"masks": zeros, "pruned_k": "1"}, "pruned_k must be an int"),
                     ({"masks": zeros, "pruned_k": 3}, r"pruned_k must be an int in \[-1, 2\]")]:
        with pytest.raises(ValueError, match=msg):
            p.load_state_dict(bad)
        assert all(torch.equal(before[k], p.masks[k]) for k in before) and p._pruned_k == 1


def test_filter_fn_selects_layers():
    model = mlp()
    p = GradualPruner(model, 0.5, end_step=1, frequency=1, filter_fn=lambda mod, fqn: fqn != "4",
                      min_features=0)
    assert [k for k, _ in p.layers] == ["0", "2"]
    p.step(1)
    assert bool((model[4].weight != 0).all())



@pytest.mark.parametrize("recipe", ["gradual", "srste"])
def test_recipes_leave_peft_adapter_layers_alone_as_sparsify_does(recipe):
    # a LoRA layer's adapters (and its base, which PEFT's merge writes densely) are no layers to prune
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    pm = peft.get_peft_model(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)),
                             peft.LoraConfig(target_modules=["0"], r=4, init_lora_weights=False))
    before = {k: v.detach().clone() for k, v in pm.state_dict().items() if ".0." in k}
    p = (GradualPruner(pm, 0.5, end_step=1, frequency=1, min_features=0) if recipe == "gradual"
         else SRSTE(pm, min_features=0))
    assert [k for k, _ in p.layers] == ["base_model.model.2"]
    assert all("PEFT adapter layer" in why for k, why in p.skipped.items() if ".0." in k)
    if recipe == "gradual":
        p.step(1)
    after = {k: v for k, v in pm.state_dict().items() if ".0." in k}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

# --- SR-STE ---------------------------------------------------------------------

def tiny_layer():
    lin = nn.Linear(8, 2, bias=True).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.5, -0.2, -4.0],
                                       [-2.5, 0.3, -0.4, 1.2, 0.7, -0.6, 0.9, 0.05]], dtype=torch.float64))
        lin.bias.copy_(torch.tensor([0.5, -1.0], dtype=torch.float64))
    # 2:4 magnitude mask worked out by hand from the numbers above
    hand_mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1],
                              [1, 0, 0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    return lin, hand_mask


def test_srste_forward_and_gradient_by_hand():
    lin, mask = tiny_layer()
    w0 = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)  # built BEFORE SRSTE: must still train the dense weight
    decay = 0.3
    SRSTE(nn.Sequential(lin), n=2, m=4, decay=decay, min_features=0)
    x = torch.linspace(-1, 1, 24, dtype=torch.float64).view(3, 8)
    r = torch.tensor([[1.0, -2.0], [0.5, 0.25], [-1.5, 3.0]], dtype=torch.float64)
    out = lin(x)
    torch.testing.assert_close(out, F.linear(x, w0 * mask, lin.bias), rtol=0, atol=1e-14)
    (out * r).sum().backward()
    # L = sum(r * (x W~^T + b)): dL/dW~ = r^T x; SR-STE passes it straight to W
    # and adds decay * W on the pruned entries.
    expected = r.t() @ x + decay * w0 * (~mask)
    original = lin.parametrizations.weight.original
    torch.testing.assert_close(original.grad, expected, rtol=0, atol=1e-13)
    opt.step()
    torch.testing.assert_close(original.detach(), w0 - 0.1 * expected, rtol=0, atol=1e-13)


def test_srste_mask_follows_the_weights():
    lin, mask = tiny_layer()
    SRSTE(nn.Sequential(lin), decay=0.0, min_features=0)
    with torch.no_grad():
        lin.parametrizations.weight.original[0, 0] = 10.0  # now beats 2.0 in group 0
    new_mask = mask.clone()
    new_mask[0, :4] = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    w = lin.parametrizations.weight.original.detach()
    torch.testing.assert_close(lin.weight, w * new_mask, rtol=0, atol=0)


def test_srste_finalize_gives_exact_nm_plain_linears():
    torch.manual_seed(0)
    model = mlp(6, torch.float64)
    srste = SRSTE(model, 2, 4, decay=2e-4, min_features=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        model(torch.randn(4, 16, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dense = {k: lin.parametrizations.weight.original.detach().clone() for k, lin in srste.layers}
    x = torch.randn(5, 16, dtype=torch.float64)
    before = model(x).detach()
    masks = srste.finalize()
    # reference: each layer's dense weight masked by an independent top-2 sort
    h = x
    for k in ("0", "2", "4"):
        w = dense[k]
        top2 = torch.sort(w.abs().view(-1, 4), dim=-1, descending=True, stable=True).indices[:, :2]
        ref_mask = torch.zeros_like(w, dtype=torch.bool).view(-1, 4).scatter_(-1, top2, True).view_as(w)
        assert torch.equal(masks[k], ref_mask)
        assert type(model[int(k)]) is nn.Linear and not parametrize.is_parametrized(model[int(k)])
        assert is_nm(model[int(k)].weight)
        h = F.linear(h, w * ref_mask, model[int(k)].bias)
        h = h.relu() if k != "4" else h
    torch.testing.assert_close(model(x), h, rtol=0, atol=1e-13)
    torch.testing.assert_close(before, h, rtol=0, atol=1e-13)
    assert set(model.state_dict()) == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    with pytest.raises(RuntimeError, match="already finalized"):
        srste.finalize()


# --- bad input ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err, msg", [
    (dict(target=1.5, end_step=10), ValueError, r"target sparsity must be in \(0, 1\)"),
    (dict(target=(3, 2), end_step=10), ValueError, "1 <= n < m"),
    (dict(target="2:x", end_step=10), ValueError, "N:M target"),
    (dict(target=0.5, start_step=10, end_step=10), ValueError, "start_step < end_step"),
    (dict(target=0.5, end_step=10, frequency=3), ValueError, "dividing"),
    (dict(target=0.5, end_step=10.0), TypeError, "end_step must be an int"),
    (dict(target=0.5, end_step=10, frequency=1, initial_sparsity=0.6), ValueError, "initial_sparsity"),
    (dict(target=0.5, end_step=10, frequency=1, scope="row"), ValueError, "scope must be"),
    (dict(target=(2, 16), end_step=10, frequency=1), ValueError, r"layer '4' has in_features=24, not divisible by m=16"),
])
def test_gradual_pruner_bad_input_changes_nothing(kwargs, err, msg):
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(err, match=msg):
        GradualPruner(model, **kwargs, min_features=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_models_and_steps():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        GradualPruner("net", 0.5, end_step=2, frequency=1)
    with pytest.raises(ValueError, match="no torch.nn.Linear layer selected"):
        SRSTE(nn.Sequential(nn.ReLU()))
    p = GradualPruner(mlp(), 0.5, end_step=2, frequency=1, min_features=0)
    with pytest.raises(TypeError, match="step must be an int"):
        p.step(1.0)
    assert p.sparsity() == 0.0


@pytest.mark.parametrize("kwargs, msg", [
    (dict(n=4, m=4), "1 <= n < m"), (dict(decay=-1.0), "decay must be a finite number >= 0"),
    (dict(m=16), r"layer '4' has in_features=24"),
])
def test_srste_bad_input_changes_nothing(kwargs, msg):
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=msg):
        SRSTE(model, **kwargs, min_features=0)
    assert not any(parametrize.is_parametrized(mod) for mod in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_srste_twice_is_rejected_without_change():
    model = mlp()
    SRSTE(model, min_features=0)
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match="already has a parametrized weight"):
        SRSTE(model, min_features=0)
    assert set(model.state_dict()) == keys


def test_an_optimizer_checkpoint_resumes_after_pruning():
    """An optimizer's state dict pairs entries with parameters by position: Sparse24Linear listed
    (bias, weight) where nn.Linear lists (weight, bias), so the state of the optimizer prune_trained_model
    kept loaded into one built from model.parameters() with the moments swapped (the first step then
    raised a broadcast error)."""
    import copy
    import sparse24

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def train(model, opt, steps=2):
        for i in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            opt.step()

    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt)
    sparse24.prune_trained_model(model, opt, min_features=0, skip_output_head=False)
    train(model, opt)
    saved, state = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    resumed = make()
    sparse24.sparsify_(resumed, min_features=0, skip_output_head=False)
    resumed.load_state_dict(state)
    assert [n for n, _ in resumed.named_parameters()] == [n for n, _ in make().named_parameters()]
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
    train(model, opt)
    train(resumed, opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_non_finite_weights_are_refused_not_left_unpruned():
    # an infinite weight could never be pruned (its score is never among the smallest): the layer ended
    # above its 2:4 target without a word, where NaN was already refused
    for bad in (float("inf"), float("nan")):
        model = mlp(5)
        with torch.no_grad():
            model[0].weight[0, :4] = bad
        with pytest.raises(ValueError, match="contains NaN or inf"):
            GradualPruner(model, (2, 4), start_step=0, end_step=2, frequency=1, min_features=0).step(2)


# --- layer selection: a real weight Parameter, sparsify_'s min_features ---------------

def _prune_hooked(lin):
    prune.l1_unstructured(lin, "weight", amount=0.2)   # weight_orig * weight_mask, a pre-hook


def _old_weight_norm(lin):
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(lin)   # weight_g / weight_v, a pre-hook


@pytest.mark.parametrize("hook", [_prune_hooked, _old_weight_norm], ids=["prune", "weight_norm"])
@pytest.mark.parametrize("recipe", ["gradual", "srste"])
def test_a_layer_whose_weight_a_hook_recomputes_is_refused_without_change(recipe, hook):
    # GradualPruner zeroed the temporary the pre-hook rebuilds at every forward: the layer was never pruned,
    # while sparsity() said 0.5
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    hook(model[0])
    before = copy.deepcopy(model.state_dict())
    make = ((lambda **kw: GradualPruner(model, (2, 4), end_step=1, frequency=1, **kw)) if recipe == "gradual"
            else (lambda **kw: SRSTE(model, **kw)))
    with pytest.raises(ValueError, match=r"layer '0': its weight is a computed tensor .*not a Parameter of the layer"):
        make(skip_output_head=False)
    assert before.keys() == model.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert all(p._backward_hooks is None or not p._backward_hooks for p in model.parameters())
    # left out, the other layer is pruned as before
    p = make(skip_output_head=False, filter_fn=lambda mod, fqn: fqn != "0")
    assert [k for k, _ in p.layers] == ["2"]


def small_and_large(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 32))


@pytest.mark.parametrize("recipe", ["gradual", "srste"])
def test_recipes_skip_small_layers_as_sparsify_does(recipe):
    # they pruned the 64x16 and 16x32 layers, which sparsify_ then skipped (min_features=32): the documented
    # conversion left them plain nn.Linear, and retraining revived their pruned weights
    import sparse24
    make = ((lambda m, **kw: GradualPruner(m, (2, 4), end_step=1, frequency=1, skip_output_head=False, **kw))
            if recipe == "gradual" else (lambda m, **kw: SRSTE(m, skip_output_head=False, **kw)))
    model = small_and_large()
    p = make(model)
    report = sparse24.sparsify_(small_and_large(), skip_output_head=False)
    assert [k for k, _ in p.layers] == [r.fqn for r in report.swapped] == ["0"]
    assert p.skipped == {r.fqn: r.reason for r in report.skipped} and set(p.skipped) == {"2", "4"}
    assert p.skipped["2"] == "smaller than min_features=32 (16x64): too small to gain"
    assert [k for k, _ in make(small_and_large(), min_features=16).layers] == ["0", "2", "4"]


def test_recipes_min_features_end_to_end_and_bad_values():
    import sparse24
    model = small_and_large()
    pruner = GradualPruner(model, (2, 4), start_step=0, end_step=2, frequency=1, skip_output_head=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        pruner.step(t)
    report = sparse24.sparsify_(model, skip_output_head=False)
    assert {r.fqn for r in report.swapped} == set(pruner.masks) == {"0"}
    assert torch.equal(model[0].mask, pruner.masks["0"])
    for bad in (-1, 1.5, "32", True):
        for make in (lambda m: GradualPruner(m, 0.5, end_step=1, frequency=1, min_features=bad),
                     lambda m: SRSTE(m, min_features=bad)):
            model = small_and_large()
            before = copy.deepcopy(model.state_dict())
            with pytest.raises(ValueError, match="min_features must be a non-negative int"):
                make(model)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert not any(parametrize.is_parametrized(m) for m in model.modules())
    with pytest.raises(ValueError, match=r"no torch.nn.Linear layer selected.*'2': smaller than min_features=64"):
        SRSTE(small_and_large(), min_features=64)


# --- GradualPruner masks the gradient at pruned positions -----------------------

def two_layers(kind):
    torch.manual_seed(0)
    if kind == "conv1d":   # GPT-2's layer: weight (in, out), masks (out, in)
        Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
        return nn.Sequential(Conv1D(64, 32), nn.ReLU(), Conv1D(32, 64)).double()
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).double()


def hand_grads(model, x, r, masks=None, conv1d=False):
    """d sum(r * model(x)) / dW computed on fresh float64 leaves, then masked with ``masks`` ((out, in))."""
    ws = [model[i].weight.detach().clone().requires_grad_() for i in (0, 2)]
    lin = (lambda h, w, b: h @ w + b) if conv1d else (lambda h, w, b: h @ w.t() + b)
    out = lin(lin(x, ws[0], model[0].bias.detach()).relu(), ws[1], model[2].bias.detach())
    (out * r).sum().backward()
    if masks is None:
        return [w.grad for w in ws]
    return [w.grad.masked_fill(~(masks[k].t() if conv1d else masks[k]), 0) for w, k in zip(ws, ("0", "2"))]


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_gradual_pruner_masks_gradients_as_masked_training_does(kind):
    # the gradient at pruned positions reached clip_grad_norm_ and the optimizer's moments: Zhu & Gupta's
    # masked forward (and torch.nn.utils.prune) gives zero there
    model = two_layers(kind)
    x, r = torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)
    p = GradualPruner(model, (2, 4), start_step=0, end_step=2, frequency=2, skip_output_head=False)

    def grads():
        model.zero_grad()
        (model(x) * r).sum().backward()
        return [model[i].weight.grad for i in (0, 2)]

    conv1d = kind == "conv1d"
    for g, ref in zip(grads(), hand_grads(model, x, r, conv1d=conv1d)):    # nothing pruned yet: passed through
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)
    p.step(0)
    p.step(2)   # final 2:4 masks
    assert p.sparsity() == 0.5
    ref = hand_grads(model, x, r, p.masks, conv1d)
    got = grads()
    for g, want in zip(got, ref):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    want = torch.cat([g.flatten() for g in ref] + [model[i].bias.grad.flatten() for i in (0, 2)]).norm()
    torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
    # the mask is read when the gradient comes: a loaded state's masks apply at once
    state = p.state_dict()
    state["masks"] = {k: torch.rand(v.shape, generator=torch.Generator().manual_seed(1)) < 0.5
                      for k, v in state["masks"].items()}
    p.load_state_dict(state)
    for g, want in zip(grads(), hand_grads(model, x, r, state["masks"], conv1d)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def test_gradual_pruner_gradient_hooks_one_per_weight_and_removed_with_the_pruner():
    import gc
    model = two_layers("linear")
    x, r = torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)

    def hooks(m):
        return [len(m[i].weight._backward_hooks or {}) for i in (0, 2)]

    def grads(m):
        m.zero_grad()
        (m(x) * r).sum().backward()
        return [m[i].weight.grad for i in (0, 2)]

    p = GradualPruner(model, (2, 4), start_step=0, end_step=1, frequency=1, skip_output_head=False)
    p.step(1)
    assert hooks(model) == [1, 1]
    # a temporary second pruner, once freed, leaves the first one's hooks in place
    assert GradualPruner(model, (2, 4), start_step=0, end_step=1, frequency=1, skip_output_head=False).skipped == {}
    gc.collect()
    assert hooks(model) == [1, 1]
    # two live pruners on the same layers: each masks with its own masks
    p2 = GradualPruner(model, "1:4", start_step=0, end_step=1, frequency=1, skip_output_head=False)
    p2.step(1)
    assert hooks(model) == [2, 2]
    both = {k: p.masks[k] & p2.masks[k] for k in p.masks}
    for g, want in zip(grads(model), hand_grads(model, x, r, both)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    del p2
    gc.collect()
    assert hooks(model) == [1, 1]
    # new Parameters (a resume through load_state_dict(assign=True)): hooked at the next step
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert hooks(model) == [0, 0]
    p.step(2)
    assert hooks(model) == [1, 1]
    for g, want in zip(grads(model), hand_grads(model, x, r, p.masks)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    # a deep copy of model and pruner: the copy's weights are hooked once, reading the copy's masks
    model2, q = copy.deepcopy((model, p))
    assert hooks(model2) == [1, 1] and hooks(model) == [1, 1]
    q.masks = {k: torch.ones_like(v) for k, v in q.masks.items()}
    for g, want in zip(grads(model2), hand_grads(model2, x, r)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    for g, want in zip(grads(model), hand_grads(model, x, r, p.masks)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    # remove() ends the masking; a pruner garbage-collected leaves no hook behind
    p.remove()
    assert hooks(model) == [0, 0]
    for g, want in zip(grads(model), hand_grads(model, x, r)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    del q
    gc.collect()
    assert hooks(model2) == [0, 0]


def test_gradual_pruner_hooks_a_frozen_weight_too():
    # a layer unfrozen later (staged fine-tuning) gets its gradient masked as well
    model = two_layers("linear")
    model[0].weight.requires_grad_(False)
    p = GradualPruner(model, (2, 4), start_step=0, end_step=1, frequency=1, skip_output_head=False)
    assert not model[0].weight.requires_grad
    p.step(1)
    model[0].weight.requires_grad_(True)
    x, r = torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)
    (model(x) * r).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, hand_grads(model, x, r, p.masks)[0], rtol=0, atol=1e-12)


# --- EMA of a model with compressed layers ---------------------------------------

@pytest.mark.parametrize("use_buffers", [True, False])
def test_ema_multi_avg_fn_averages_floats_and_copies_integer_tensors(use_buffers):
    # torch's get_ema_multi_avg_fn (which recipes.md recommended) averaged the int32 meta buffers as numbers,
    # rewriting every 2:4 slot index (use_buffers=True), and rounds INT8 codes at some decays (either way)
    import sparse24
    from sparse24.recipes import ema_multi_avg_fn
    from torch.optim.swa_utils import AveragedModel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))
    sparse24.sparsify_(model, lambda m, f: f == "0", mode="compressed", trainable_values=True, skip_output_head=False)
    sparse24.sparsify_(model, lambda m, f: f == "2", mode="compressed", quantize="int8", skip_output_head=False)
    sparse24.sparsify_(model, lambda m, f: f == "4", skip_output_head=False)   # masked: a bool mask
    decay = 0.9   # (torch's average rounds 80 of the 256 int8 codes down at this decay)
    avg = AveragedModel(model, multi_avg_fn=ema_multi_avg_fn(decay), use_buffers=use_buffers)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(16, 32)
    ref = None
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        avg.update_parameters(model)
        now = {k: v.detach().double() for k, v in model.state_dict().items() if v.is_floating_point()}
        ref = now if ref is None else {k: decay * ref[k] + (1 - decay) * now[k] for k in now}
    got = avg.module.state_dict()
    assert not torch.allclose(ref["0.values"], now["0.values"])   # the values moved: an average to check
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k].double(), ref[k], rtol=0, atol=1e-6)
        else:   # meta, the INT8 codes, the mask: the model's, bit for bit
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # the averaged layer computes with the averaged values at the model's slots
    dense = sparse24.Sparse24Tensor(got["0.values"], model[0].meta, (64, 32), torch.float32).to_dense()
    torch.testing.assert_close(avg.module[0].dense_weight(), dense, rtol=0, atol=0)
    for bad in (1.5, -0.1, "0.9", True, float("nan")):
        with pytest.raises(ValueError, match="decay must be a number in"):
            ema_multi_avg_fn(bad)

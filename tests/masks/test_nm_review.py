"""N:M patterns other than 2:4 across the pruning entry points (review fixes): sparser-than-2:4 prunes kept
by sparsify_, patterns validated before anything changes, pruner and learnable-mask states that remember
their pattern, all-or-nothing permutations, SparseGPT's default block size; each against an independent
reference (float64 dense products, deep copies taken before the call, exact mask counts)."""
import copy
import io

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear, is_nm, sparsify_
from sparse24.masks import (LearnableMask, PermutationGroup, calibrate, mask_nm, permute_model_, prune_layerwise_,
                            prune_nm, search_permutation, sparsegpt_prune)
from sparse24.masks import permute_model as permute_model_module
from sparse24.recipes import GradualPruner


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mlp(seed=0, widths=(64, 64, 32)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _batches(c=64, k=2, seed=0):
    g = _gen(seed)
    return [torch.randn(32, c, generator=g) for _ in range(k)]


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _linears(model):
    return [(fqn, mod) for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear)]


# --- 1. sparsify_ keeps a weight already sparser than 2:4 -----------------------------------------------

def _layerwise(model, n, m):
    prune_layerwise_(model, _batches(), n=n, m=m, method="magnitude", progress=False)


def _gradual(model, n, m):
    pruner = GradualPruner(model, (n, m), start_step=0, end_step=4, frequency=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for t, x in enumerate(_batches(k=6, seed=1)):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        pruner.step(t)


@pytest.mark.parametrize("prune", [_layerwise, _gradual], ids=["prune_layerwise_", "GradualPruner"])
@pytest.mark.parametrize("n,m", [(1, 4), (2, 8), (1, 8)])
def test_sparsify_keeps_a_sparser_pattern_through_retraining(prune, n, m):
    model = _mlp()
    prune(model, n, m)
    nonzero = {fqn: lin.weight.detach() != 0 for fqn, lin in _linears(model)}
    for fqn, nz in nonzero.items():   # the prune left exactly n of every m
        assert int(nz.sum()) == nz.numel() * n // m, fqn
    sparsify_(model, skip_output_head=False, min_features=0)
    for fqn, nz in nonzero.items():
        assert torch.equal(model.get_submodule(fqn).mask, nz), fqn   # not filled up to 2 of every 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x in _batches(seed=2) * 3:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for fqn, nz in nonzero.items():
        w = model.get_submodule(fqn).dense_weight()
        assert torch.equal(w != 0, nz) and is_nm(w, n, m), fqn   # trained, still n:m, nothing grown back


def test_sparsify_magnitude_of_a_weight_not_within_24_is_the_plain_24_mask():
    w = torch.randn(16, 64, generator=_gen(), dtype=torch.float64)
    w[0, :4] = 0           # one group with no non-zero, but other groups hold 4: not "already 2:4"
    lin = nn.Linear(64, 16).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Sparse24Linear.from_linear(lin)
    assert torch.equal(layer.mask, mask_nm(w, 2, 4))
    assert int(layer.mask.sum()) == w.numel() // 2   # exactly 2 of every 4, the zeros of row 0 included
    x = torch.randn(5, 64, generator=_gen(1), dtype=torch.float64)
    ref = x @ (w * mask_nm(w, 2, 4)).T + lin.bias.detach()
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_meta_layer_keeps_a_sparser_pattern_when_weights_load(mode):
    src = _mlp()
    _layerwise(src, 1, 4)
    state = copy.deepcopy(src.state_dict())
    with torch.device("meta"):
        model = _mlp()
    sparsify_(model, mode=mode, skip_output_head=False, min_features=0)
    model.load_state_dict(state, assign=True)
    x = _batches(seed=3)[0]
    for fqn, lin in _linears(src):
        layer = model.get_submodule(fqn)
        assert not layer.pending
        nz = lin.weight.detach() != 0
        if mode == "masked":
            assert torch.equal(layer.mask, nz)
        assert torch.equal(layer.sparse_tensor().kept_mask() & nz, nz)
        assert torch.equal(layer.dense_weight(), lin.weight.detach())
        ref = x.double() @ lin.weight.detach().double().T + lin.bias.detach().double()
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


# --- 2. patterns and layer widths checked before anything changes ----------------------------------------

@pytest.mark.parametrize("n,m", [(2, 0), (2, "4"), (5, 4), (-1, 4), (2, 2.5), (True, 4)])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt", "2d_greedy"])
def test_prune_nm_refuses_a_bad_pattern_first(n, m, method):
    w = torch.randn(8, 16, generator=_gen())
    kw = {"act_norm": torch.ones(16)} if method == "wanda" else {"hessian": torch.eye(16)} if method == "sparsegpt" \
        else {}
    before = w.clone()
    with pytest.raises(ValueError, match=r"need integers 0 <= n <= m and m >= 1"):
        prune_nm(w, n, m, method=method, **kw)
    assert torch.equal(w, before)


@pytest.mark.parametrize("n,m", [(2, 0), (2, "4"), (5, 4), (True, 4)])
def test_prune_layerwise_refuses_a_bad_pattern_before_any_change(n, m):
    model = _mlp()
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"need integers 0 <= n <= m and m >= 1"):
        prune_layerwise_(model, _batches(), n=n, m=m, progress=False)
    assert _same_state(model, dense)


def test_prune_layerwise_refuses_when_m_divides_no_layer():
    model = _mlp()
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"'0' \(in_features=64\), '2' \(in_features=64\).*m=6.*filter_fn"):
        prune_layerwise_(model, _batches(), n=2, m=6, method="magnitude", progress=False)
    assert _same_state(model, dense)


def test_prune_layerwise_refuses_the_layers_m_does_not_divide_and_prunes_the_rest_when_excluded():
    model = _mlp(widths=(64, 48, 8))   # m=32 divides 64 (layer '0'), not 48 (layer '2')
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"'2' \(in_features=48\).*m=32.*exclude them with filter_fn"):
        prune_layerwise_(model, _batches(), n=8, m=32, method="magnitude", progress=False)
    assert _same_state(model, dense)
    res = prune_layerwise_(model, _batches(), n=8, m=32, method="magnitude", progress=False,
                           filter_fn=lambda mod, fqn: fqn != "2")
    assert list(res) == ["0"]
    w0 = dense[0].weight.detach()
    assert torch.equal(model[0].weight.detach(), w0 * mask_nm(w0, 8, 32))
    assert int((model[0].weight != 0).sum()) == w0.numel() // 4
    assert torch.equal(model[2].weight, dense[2].weight)


def test_prune_layerwise_refuses_when_no_layer_is_selected():
    model = _mlp()
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"no nn.Linear layer selected"):
        prune_layerwise_(model, _batches(), progress=False, filter_fn=lambda mod, fqn: False)
    assert _same_state(model, dense)


@pytest.mark.parametrize("n,m", [(2, 0), (True, 4), (5, 4)])
def test_permute_model_refuses_a_bad_pattern_first(n, m):
    model = _mlp(widths=(8, 32, 8))
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"need integers 0 <= n <= m and m >= 1"):
        permute_model_(model, [PermutationGroup(["2"], ["0"], name="a")], n=n, m=m, max_iters=5)
    assert _same_state(model, dense)


# --- 3. GradualPruner states remember their target ------------------------------------------------------

def _run_pruner(model, pruner, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = _gen(5)
    for t in steps:
        opt.zero_grad()
        model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        opt.step()
        pruner.step(t)


@pytest.mark.parametrize("saved,loaded", [("2:4", "1:4"), ("1:4", "2:4"), ("2:4", 0.5), (0.8, 0.5), ((2, 8), "1:4")])
def test_gradual_pruner_refuses_a_state_of_another_target(saved, loaded):
    a = nn.Linear(32, 32)
    pa = GradualPruner(a, saved, start_step=0, end_step=4, frequency=1)
    _run_pruner(a, pa, range(6))
    state = pa.state_dict()
    b = copy.deepcopy(a)
    pb = GradualPruner(b, loaded, start_step=0, end_step=4, frequency=1)
    masks_before = {k: v.clone() for k, v in pb.masks.items()}
    with pytest.raises(ValueError, match=r"GradualPruner.load_state_dict: .*target.*nothing was changed"):
        pb.load_state_dict(state)
    assert pb._pruned_k == -1 and all(torch.equal(pb.masks[k], v) for k, v in masks_before.items())


def test_gradual_pruner_state_roundtrip_and_older_states():
    a = nn.Linear(32, 32)
    pa = GradualPruner(a, "1:4", start_step=0, end_step=4, frequency=1)
    _run_pruner(a, pa, range(3))
    state = pa.state_dict()
    assert state["nm"] == (1, 4) and state["final_sparsity"] == 0.75
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for st in (loaded, {"masks": state["masks"], "pruned_k": state["pruned_k"]}):  # a state of an older version
        b = copy.deepcopy(a)
        pb = GradualPruner(b, (1, 4), start_step=0, end_step=4, frequency=1)
        pb.load_state_dict(st)
        assert pb._pruned_k == pa._pruned_k and all(torch.equal(pb.masks[k], pa.masks[k]) for k in pa.masks)
        _run_pruner(b, pb, range(3, 6))
        w = b.weight.detach()
        assert is_nm(w, 1, 4) and int((w != 0).sum()) == w.numel() // 4


# --- 4. permute_model_ is all or nothing ---------------------------------------------------------------

def _two_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 24), nn.GELU(), nn.Linear(24, 8))
    groups = [PermutationGroup(["2"], ["0"], name="a"), PermutationGroup(["4"], ["2"], name="b")]  # 32, 24 wide
    return model, groups


def _stats_tensors(stats):
    return {k: (v.sq_sum, v.xtx, v.xtx_teacher) for k, v in stats.items()}


def _same_stats(stats, saved):
    return stats.keys() == saved.keys() and all(
        all(a is b for a, b in zip((v.sq_sum, v.xtx, v.xtx_teacher), saved[k])) for k, v in stats.items())


@pytest.mark.parametrize("example", [True, False], ids=["example", "no-example"])
def test_permute_model_refuses_a_group_m_does_not_divide_before_any_change(example):
    model, groups = _two_groups()
    x = torch.randn(4, 8, generator=_gen())
    stats = calibrate(model, [x], hessian=True)
    dense, saved = copy.deepcopy(model), _stats_tensors(stats)
    with pytest.raises(ValueError, match=r"group 'b'.*24 channels.*m=16"):
        permute_model_(model, groups, score="sparsegpt", calibration=stats, n=2, m=16, max_iters=20,
                       example=x if example else None)
    assert _same_state(model, dense) and _same_stats(stats, saved)


@pytest.mark.parametrize("example", [True, False], ids=["example", "no-example"])
def test_permute_model_undoes_the_groups_done_when_a_later_one_fails(example, monkeypatch):
    model, groups = _two_groups()
    x = torch.randn(4, 8, generator=_gen())
    stats = calibrate(model, [x], hessian=True)
    dense, saved = copy.deepcopy(model), _stats_tensors(stats)
    real, calls = permute_model_module.search_permutation, []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        perm = real(*args, **kwargs)
        assert not torch.equal(perm, torch.arange(perm.numel()))   # the first group really was permuted
        return perm
    monkeypatch.setattr(permute_model_module, "search_permutation", failing_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        permute_model_(model, groups, score="wanda", calibration=stats, n=2, m=4, max_iters=30,
                       example=x if example else None)
    assert len(calls) == 2
    assert _same_state(model, dense) and _same_stats(stats, saved)


def test_permute_model_success_is_unchanged_function():
    model, groups = _two_groups()
    x = torch.randn(16, 8, generator=_gen(), dtype=torch.float64)
    model = model.double()
    ref = model(x)
    gains = permute_model_(model, groups, n=2, m=4, max_iters=30, example=x)
    assert set(gains) == {"a", "b"} and all(g >= 0 for g in gains.values())
    torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-12)


# --- 5. SparseGPT's default block size fits every m -----------------------------------------------------

@pytest.mark.parametrize("n,m", [(2, 6), (1, 3), (2, 3), (2, 5), (3, 6), (2, 4), (8, 16)])
def test_sparsegpt_default_blocksize_takes_any_m(n, m):
    C = 240 if m != 16 else 256   # several blocks of the default size
    g = _gen(1)
    x = torch.randn(512, C, generator=g, dtype=torch.float64)
    w = torch.randn(16, C, generator=g, dtype=torch.float64)
    r = prune_nm(w, n, m, method="sparsegpt", hessian=x.T @ x)
    assert torch.equal(r.mask.view(16, -1, m).sum(-1), torch.full((16, C // m), n))   # exactly n of every m
    assert bool((r.weight[~r.mask] == 0).all())
    # Lazy block updates are exact: one block over every column gives the same prune
    w1, mask1 = sparsegpt_prune(w, x.T @ x, n, m, blocksize=C)
    assert torch.equal(r.mask, mask1)
    torch.testing.assert_close(r.weight, w1, rtol=0, atol=1e-9)
    if m == 4:  # the default for m dividing 128 is still 128
        w128, mask128 = sparsegpt_prune(w, x.T @ x, n, m, blocksize=128)
        assert torch.equal(r.mask, mask128) and torch.equal(r.weight, w128)


def test_prune_layerwise_default_method_takes_2_of_6():
    model = _mlp(widths=(96, 96, 48))
    res = prune_layerwise_(model, _batches(c=96), n=2, m=6, progress=False)
    assert list(res) == ["0", "2"]
    for fqn, lin in _linears(model):
        w = lin.weight.detach()
        assert torch.equal(res[fqn].weight, w) and is_nm(w, 2, 6)
        assert int(res[fqn].mask.sum()) == w.numel() // 3


# --- 6. sparsify_ / from_linear take n=2, m=4 and refuse other patterns ----------------------------------

def test_sparsify_takes_n2_m4():
    a = _mlp()
    b = copy.deepcopy(a)
    sparsify_(a, n=2, m=4, skip_output_head=False)
    sparsify_(b, skip_output_head=False)
    assert _same_state(a, b)
    lin = nn.Linear(64, 8)
    assert torch.equal(Sparse24Linear.from_linear(copy.deepcopy(lin), n=2, m=4).mask,
                       mask_nm(lin.weight.detach(), 2, 4))
    layer = Sparse24Linear.from_linear(nn.Linear(64, 8, device="meta"), n=2, m=4)   # pending, then computed
    w = torch.randn(8, 64, generator=_gen())
    layer.load_state_dict({"weight": w.clone(), "bias": torch.zeros(8)}, assign=True)
    assert torch.equal(layer.mask, mask_nm(w, 2, 4))


@pytest.mark.parametrize("kw", [dict(n=1, m=4), dict(m=8), dict(n=4, m=8), dict(n=1), dict(n=True, m=4)])
@pytest.mark.parametrize("method", ["magnitude", "2d_greedy"])
def test_sparsify_refuses_another_pattern_before_any_change(kw, method):
    model = _mlp()
    dense = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"Sparse24Linear stores 2:4.*prune first .*then sparsify_.*mask="):
        sparsify_(model, method=method, skip_output_head=False, **kw)
    assert _same_state(model, dense) and all(type(mod) is nn.Linear for _, mod in _linears(model))
    lin = nn.Linear(64, 8)
    before = lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"Sparse24Linear stores 2:4"):
        Sparse24Linear.from_linear(lin, method=method, **kw)
    assert torch.equal(lin.weight, before)


# --- 7. LearnableMask states remember their pattern ----------------------------------------------------

@pytest.mark.parametrize("saved,loaded", [((1, 4), (3, 4)), ((2, 6), (4, 6)), ((1, 8), (7, 8)), ((2, 4), (2, 8))])
def test_learnable_mask_refuses_a_state_of_another_pattern(saved, loaded):
    w = torch.randn(8, 48, generator=_gen())
    a = LearnableMask(w.shape, *saved, prior=mask_nm(w, *saved))
    b = LearnableMask(w.shape, *loaded)
    before = b.logits.detach().clone()
    with pytest.raises(ValueError, match=rf"{saved[0]}:{saved[1]} mask.*this mask is {loaded[0]}:{loaded[1]}"):
        b.load_state_dict(a.state_dict())
    assert torch.equal(b.logits, before)


def test_learnable_mask_state_roundtrip_nested_and_older_states():
    w = torch.randn(8, 16, generator=_gen())
    prior = mask_nm(w, 1, 4)
    a = LearnableMask(w.shape, 1, 4, prior=prior)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    b = LearnableMask(w.shape, 1, 4)
    b.load_state_dict(state)
    assert torch.equal(b.hard_mask(), prior)
    old = {"logits": a.logits.detach().clone()}   # saved before the pattern was
    c = LearnableMask(w.shape, 1, 4)
    c.load_state_dict(old)
    assert torch.equal(c.hard_mask(), prior)
    parent_a, parent_b = nn.ModuleDict({"lm": a}), nn.ModuleDict({"lm": LearnableMask(w.shape, 3, 4)})
    with pytest.raises(ValueError, match=r"1:4 mask.*this mask is 3:4"):
        parent_b.load_state_dict(parent_a.state_dict())
    parent_c = nn.ModuleDict({"lm": LearnableMask(w.shape, 1, 4)})
    parent_c.load_state_dict(parent_a.state_dict())
    assert torch.equal(parent_c["lm"].hard_mask(), prior)


# --- nits ------------------------------------------------------------------------------------------------

def test_bool_pattern_sizes_are_refused():
    w = torch.randn(8, 16, generator=_gen())
    for call in (lambda: mask_nm(w, True, 4), lambda: sparse24.mask_nm(w, 2, True),
                 lambda: search_permutation(w, True, 4, max_iters=2, progress=False),
                 lambda: is_nm(w, True, 4)):
        with pytest.raises(ValueError, match=r"need integers 0 <= n <= m and m >= 1"):
            call()


@pytest.mark.parametrize("target", ["-1:4", "a:b", "2:4.0", "4:2"])
def test_gradual_pruner_names_the_target_given(target):
    with pytest.raises(ValueError, match=rf"got '{target}'"):
        GradualPruner(nn.Linear(8, 8), target, end_step=2, frequency=1)

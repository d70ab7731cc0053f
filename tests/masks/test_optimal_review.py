"""Layer-by-layer pruning fit to a teacher (percdamp= / shrink= with every method, the kept fraction of the
layer's own dense weight) and Wanda's scores (exact products, not float32-rounded), each against an
independent float64 reference."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24.masks import nm, prune_layerwise_, prune_nm


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _top_n(score, n, m):
    """Per group of ``m``: keep an entry when fewer than ``n`` entries rank before it (a larger score, or an
    equal score at a lower column): the library's documented order, computed without it."""
    s = score.view(-1, m)
    col = torch.arange(m)
    before = (s[:, None, :] > s[:, :, None]) | ((s[:, None, :] == s[:, :, None]) & (col[None, :] < col[:, None]))
    return (before.sum(-1) < n).view(score.shape)


def _kept(w, mask):
    a = w.double().abs()
    return float((a * mask).sum() / a.sum())


# --- prune_layerwise_(teacher=...): percdamp= and shrink= with every method ------------------------------------

def _mlp(seed=0, k=8, h=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(k, h), nn.Tanh(), nn.Linear(h, 8)).double()


def _batches(k=8):
    return [torch.randn(32, k, generator=_gen(i), dtype=torch.float64) for i in range(2)]


def _teacher_fit(w, h, h_t, percdamp, shrink):
    """argmin_V (1 - a)/N ||h V^T - h_t W^T||^2 + a ||sqrt(D) (V - W)^T||^2 + lam ||V - W||^2 as one stacked
    least-squares problem (D = diag(h^T h / N), lam = percdamp x its mean): not the library's closed form."""
    N, C = h.shape
    d = (h * h).sum(0) / N
    lam = percdamp * float(d.mean())
    s = ((1 - shrink) / N) ** 0.5
    A = torch.cat([s * h, torch.diag(d.sqrt()) * shrink ** 0.5, lam ** 0.5 * torch.eye(C, dtype=h.dtype)])
    B = torch.cat([s * h_t @ w.T, (torch.diag(d.sqrt()) * shrink ** 0.5) @ w.T, lam ** 0.5 * w.T])
    return torch.linalg.lstsq(A, B).solution.T


@pytest.mark.parametrize("method", ["magnitude", "wanda", "2d_greedy"])
@pytest.mark.parametrize("kw", [{"percdamp": 0.1}, {"shrink": 0.3}, {"percdamp": 0.5, "shrink": 0.5}],
                         ids=["percdamp", "shrink", "both"])
def test_teacher_fit_takes_percdamp_and_shrink_with_every_method(method, kw):
    """Were they passed on to the mask method (which takes none), this was a TypeError after the first pass."""
    model, teacher, batches = _mlp(), _mlp(), _batches()
    with torch.no_grad():  # an earlier layer already pruned: the second layer's inputs differ from the teacher's
        model[0].weight.mul_(torch.rand(16, 8, generator=_gen(5)) < 0.5)
    w0, w2 = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    res = prune_layerwise_(model, batches, method=method, teacher=teacher, **kw)
    x = torch.cat(batches)
    p, a = kw.get("percdamp", 0.01), kw.get("shrink", 0.0)
    # layer 0 reads the teacher's own inputs: its fit is its dense weight
    fit0 = _teacher_fit(w0, x, x, p, a)
    torch.testing.assert_close(fit0, w0, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        h, h_t = torch.tanh(model[0](x)), torch.tanh(teacher[0](x))  # model[0] as pruned
    fit2 = _teacher_fit(w2, h, h_t, p, a)
    other = _teacher_fit(w2, h, h_t, 0.01 if "percdamp" in kw else p, 0.0 if "shrink" in kw else a)
    assert (fit2 - other).abs().max() > 1e-3  # the option changes the fit: the comparison below can fail
    score = fit2.abs() * ((h * h).mean(0).sqrt() if method == "wanda" else 1)
    if method == "2d_greedy":
        mask = sparse24.mask_nm(fit2, 2, 4, method="2d_greedy")  # its own tests pin the greedy order
    else:
        mask = _top_n(score, 2, 4)
    assert torch.equal(res["2"].mask, mask)
    torch.testing.assert_close(model[2].weight.detach(), fit2 * mask, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "2d_optimal"])
@pytest.mark.parametrize("kw", [{"percdamp": 0.1}, {"shrink": 0.3}], ids=["percdamp", "shrink"])
def test_percdamp_and_shrink_without_teacher_are_refused_before_any_pass(method, kw):
    """They apply to SparseGPT and to the teacher fit only: with neither they are refused up front, with no
    forward pass run (before: a TypeError after the check pass and the first calibration pass)."""
    model, batches = _mlp(), _batches()
    before = copy.deepcopy(model.state_dict())
    calls = []
    model[0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    with pytest.raises(TypeError, match=f"{next(iter(kw))}=.*method={method!r}.*teacher="):
        prune_layerwise_(model, batches, method=method, **kw)
    assert not calls
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_sparsegpt_without_teacher_still_takes_percdamp():
    model, batches = _mlp(), _batches()
    a = prune_layerwise_(copy.deepcopy(model), batches, percdamp=0.1)
    b = prune_layerwise_(copy.deepcopy(model), batches, percdamp=0.5)
    assert not torch.equal(a["2"].weight, b["2"].weight)


# --- prune_layerwise_(teacher=...): kept_fraction of the layer's dense weight -----------------------------------

@pytest.mark.parametrize("method, kw", [("sparsegpt", {}), ("magnitude", {"percdamp": 0.1}),
                                        ("sparsegpt", {"quantize": "int4", "group_size": 32})],
                         ids=["sparsegpt", "magnitude", "sparsegpt-int4"])
def test_teacher_kept_fraction_is_of_the_layers_dense_weight(method, kw):
    """PruneResult.kept_fraction is documented as of the ORIGINAL weight: with a teacher it was the fraction
    of the internal fit W_t, which the CLI's figure (of the dense weight) did not match."""
    k = 32 if kw.get("quantize") else 8  # INT4 groups are 32 columns at least
    model, teacher, batches = _mlp(k=k, h=k), _mlp(k=k, h=k), _batches(k)
    with torch.no_grad():
        model[0].weight.mul_(torch.rand(k, k, generator=_gen(5)) < 0.5)
    dense = {k: copy.deepcopy(model[int(k)].weight.detach()) for k in ("0", "2")}
    seen = {}
    res = prune_layerwise_(model, batches, method=method, teacher=teacher,
                           on_layer=lambda fqn, r: seen.setdefault(fqn, r), **kw)
    for k, r in res.items():
        assert r is seen[k]
        assert r.kept_fraction == pytest.approx(_kept(dense[k], r.mask), rel=1e-12, abs=1e-12)
        assert r.weight.data_ptr() == model[int(k)].weight.data_ptr()  # still the layer's own memory
        assert torch.equal(r.weight, model[int(k)].weight.detach().masked_fill(~r.mask, 0))
    if kw.get("quantize"):
        assert torch.equal(res["2"].packed.to_dense(), model[2].weight.detach())


# --- Wanda: the largest exact |W_ij| * ||x_j|| ----------------------------------------------------------------

def test_wanda_near_ties_keep_the_larger_exact_score():
    """fp32 products of 24-bit values rounded two different scores to one, and the lower column won."""
    u = 2.0 ** -23
    w = torch.tensor([[1 + 2 * u, 1 + u, 4.0, 0.5]])
    act = torch.tensor([1.0, 1 + u, 1.0, 1.0])
    assert sparse24.mask_nm(w, 2, 4, method="wanda", act_norm=act).tolist() == [[False, True, True, False]]
    h = torch.tensor([[1.0, 1.0 + 2 ** -10, 4.0, 0.5]], dtype=torch.float16)
    act_h = torch.tensor([1 + 2 ** -10 + 2 ** -22, 1 + 2 ** -22, 1.0, 1.0])
    assert sparse24.mask_nm(h, 2, 4, method="wanda", act_norm=act_h).tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 8)])
def test_wanda_mask_is_the_exact_scores_top_n_in_every_dtype(monkeypatch, dtype, n, m):
    """|W| = 1 + k e (e the weight dtype's ulp), ||x|| = 1 + a e + b 2^-22: (k, a) = (0, 1) and (1, 0) give
    products that differ by b e 2^-22 only, below float32's step, so a float32 score ties them. Row chunks of
    a few rows (mask_nm and prune_nm alike) give the reference's mask too."""
    monkeypatch.setattr(nm, "_CHUNK", 40)
    e = torch.finfo(dtype).eps
    w = (1 + e * torch.randint(0, 3, (13, 32), generator=_gen(1))).to(dtype)
    w = w * torch.where(torch.rand(13, 32, generator=_gen(2)) < 0.5, -1, 1).to(dtype)
    a, b = torch.randint(0, 3, (2, 32), generator=_gen(3)).double()
    act = (1 + a * e + b * 2.0 ** -22).float()
    assert torch.equal(act.double(), 1 + a * e + b * 2.0 ** -22)  # exact in float32
    ref = _top_n(w.double().abs() * act.double(), n, m)  # exact: 24 x 24 bits fit float64's 53
    assert torch.equal(sparse24.mask_nm(w, n, m, method="wanda", act_norm=act), ref)
    assert torch.equal(prune_nm(w, n, m, "wanda", act_norm=act).mask, ref)
    assert torch.equal(sparse24.mask_nm(w.double(), n, m, method="wanda", act_norm=act), ref)

"""Mask methods, calibration and permutations against independent references:
brute-force enumerations, hand-computed statistics, dense fp64 products."""
import copy
import functools
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import is_nm, mask_nm
from sparse24.masks import (LayerStats, apply_permutation, block_patterns, calibrate, kept_magnitude_fraction,
                            prune_layerwise_, prune_nm, search_permutation, sparsegpt_prune)
from sparse24.masks import nm
from sparse24.masks.permutation import _TabuWindows


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


# --- brute-force references (built without the code under test) -------------------

def _brute_1d(score, n, m):
    """Per group of m, the n-subset with the largest total score (itertools over all C(m, n))."""
    R, C = score.shape
    mask = torch.zeros(R, C, dtype=torch.bool)
    for r in range(R):
        for g in range(0, C, m):
            best = max(itertools.combinations(range(m), n), key=lambda s: sum(float(score[r, g + j]) for j in s))
            for j in best:
                mask[r, g + j] = True
    return mask


@functools.lru_cache(maxsize=None)
def _brute_2d_patterns(n, m=4):
    """All 0/1 m x m matrices with at most n ones per row and per column, by exhaustive itertools
    over 2^(m*m) (each returned as the tuple of its kept row-major indices)."""
    out = []
    for bits in itertools.product((0, 1), repeat=m * m):
        rows = [sum(bits[m * i:m * i + m]) for i in range(m)]
        cols = [sum(bits[j::m]) for j in range(m)]
        if max(rows) <= n and max(cols) <= n:
            out.append(tuple(k for k in range(m * m) if bits[k]))
    return out


def _brute_2d(w, n, m=4):
    """Per m x m block, the valid block (of every one enumerated above) with the largest kept |w|,
    scored in float64."""
    R, C = w.shape
    pats = torch.zeros(len(_brute_2d_patterns(n, m)), m * m, dtype=torch.float64)
    for i, pat in enumerate(_brute_2d_patterns(n, m)):
        pats[i, list(pat)] = 1
    blocks = w.double().abs().view(R // m, m, C // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)
    best = pats[(blocks @ pats.T).argmax(1)].bool()
    return best.view(R // m, C // m, m, m).permute(0, 2, 1, 3).reshape(R, C)


def _greedy_2d_reference(w, n, m):
    """Plain-Python transposable greedy: largest first, accept while row and column have room."""
    R, C = w.shape
    mask = torch.zeros(R, C, dtype=torch.bool)
    for i in range(0, R, m):
        for j in range(0, C, m):
            entries = sorted(((abs(float(w[i + a, j + b])), a, b) for a in range(m) for b in range(m)), reverse=True)
            rows, cols = [0] * m, [0] * m
            for _, a, b in entries:
                if rows[a] < n and cols[b] < n:
                    mask[i + a, j + b] = True
                    rows[a] += 1
                    cols[b] += 1
    return mask


# --- 1-D magnitude (sparse24.format.mask_nm) ----------------------------------------

@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (4, 8)], ids=lambda v: str(v))
def test_magnitude_is_bruteforce_optimal(n, m):
    w = _randn(5, 4 * m, seed=n * 10 + m)
    mask = mask_nm(w, n, m)
    assert torch.equal(mask, _brute_1d(w.abs(), n, m))
    assert is_nm(mask.to(w.dtype), n, m)


# --- 2-D transposable masks ------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 1, 3])
def test_2d_optimal_is_bruteforce_optimal(n):
    valid = set(map(frozenset, _brute_2d_patterns(n)))
    maximal = {p for p in valid if not any(p | {k} in valid for k in range(16) if k not in p)}
    assert len(maximal) == {2: 186, 1: 24, 3: 184}[n]
    pats = block_patterns(n, 4)
    assert {frozenset(torch.nonzero(p).flatten().tolist()) for p in pats} == maximal and len(pats) == len(maximal)
    w = _randn(12, 16, seed=n)
    mask = mask_nm(w, n, 4, method="2d_optimal")
    assert torch.equal(mask, _brute_2d(w, n))  # continuous random values: the optimum is unique


def test_2d_optimal_beats_blocks_with_exactly_n_per_row():
    # 2d_optimal searched only blocks keeping exactly n per row and column, so on this block (and 78 of
    # 2000 random 4x4 ones) 2d_greedy, under the same rule of at most n, kept more than the "optimum"
    w = torch.tensor([[0.1861, 2.2573, 1.5289], [0.0877, 0.9174, 0.9862], [0.0269, 0.3772, 0.2464]],
                     dtype=torch.float64)
    opt, greedy = (mask_nm(w, 2, 3, method=meth) for meth in ("2d_optimal", "2d_greedy"))
    assert torch.equal(opt, _brute_2d(w, 2, 3)) and is_nm(opt.T, 2, 3)
    assert kept_magnitude_fraction(w, opt) == pytest.approx(kept_magnitude_fraction(w, greedy))
    w = _randn(64, 64, seed=11)
    for n in (2, 3):
        assert torch.equal(mask_nm(w, n, 4, method="2d_optimal"), _brute_2d(w, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_2d_optimal_other_dtypes_keep_the_optimum(dtype):
    w = _randn(8, 24, seed=3).to(dtype)
    got = kept_magnitude_fraction(w, mask_nm(w, 2, 4, method="2d_optimal"))
    want = kept_magnitude_fraction(w, _brute_2d(w.double(), 2))
    assert got == pytest.approx(want, rel=1e-6)


def test_2d_methods_refuse_nan_and_keep_inf():
    # 2d_optimal scored a block holding inf as NaN (0 x inf in its pattern sums) and could drop it; both
    # 2-D methods took NaN without a word, where magnitude refuses it
    w = _randn(8, 16, seed=4)
    for method in ("2d_optimal", "2d_greedy"):
        bad = w.clone()
        bad[2, 5] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            mask_nm(bad, 2, 4, method=method)
        for sign in (1, -1):
            big = w.clone()
            big[2, 5] = sign * float("inf")
            mask = mask_nm(big, 2, 4, method=method)
            assert mask[2, 5] and is_nm(mask, 2, 4) and is_nm(mask.T, 2, 4)
    big = w.clone()
    big[2, 5] = float("inf")  # the finite weights keep their optimum around it
    finite = w.clone()
    finite[2, 5] = 1e6
    assert torch.equal(mask_nm(big, 2, 4, method="2d_optimal"), _brute_2d(finite, 2))


def test_2d_greedy_matches_reference_and_is_transposable():
    w = _randn(16, 24, seed=5)
    for n, m in [(2, 4), (1, 4), (2, 8), (3, 8)]:
        ww = w[:, :16] if m == 8 else w
        mask = mask_nm(ww, n, m, method="2d_greedy")
        assert torch.equal(mask, _greedy_2d_reference(ww, n, m)), (n, m)
        assert is_nm(mask, n, m) and is_nm(mask.T, n, m)


def test_2d_greedy_counts_past_127_per_row():
    # 128:256 is 50% sparsity like 2:4; int8 counters wrapped at n >= 128 and pruned every weight
    w = _randn(256, 256, seed=7)
    mask = mask_nm(w, 128, 256, method="2d_greedy")
    assert torch.equal(mask, _greedy_2d_reference(w, 128, 256))
    assert int(mask.sum()) > 0.9 * w.numel() // 2


def test_2d_orders_and_transposability():
    w = _randn(64, 128, seed=6)
    kept = {meth: kept_magnitude_fraction(w, mask_nm(w, 2, 4, method=meth))
            for meth in ("magnitude", "2d_greedy", "2d_optimal")}
    # 1-D is a relaxation of 2-D; greedy is one of the 2-D masks the optimum beats
    assert kept["magnitude"] > kept["2d_optimal"] > kept["2d_greedy"]
    mask = mask_nm(w, 2, 4, method="2d_optimal")
    assert is_nm(mask, 2, 4) and is_nm(mask.T, 2, 4)
    assert w.numel() // 2 * 0.9 < int(mask.sum()) <= w.numel() // 2  # at most 2 per row and column
    assert torch.equal(mask_nm(w.t().contiguous(), 2, 4, method="2d_optimal"), mask.t())


def test_2d_bad_input():
    w = _randn(6, 8)
    before = w.clone()
    with pytest.raises(ValueError, match=r"rows \(6\) must be divisible by m=4"):
        mask_nm(w, 2, 4, method="2d_optimal")
    with pytest.raises(ValueError, match=r"last dimension \(6\) must be divisible by m=4"):
        mask_nm(w.t(), 2, 4, method="2d_greedy")
    with pytest.raises(ValueError, match="use method='2d_greedy' for 2:8"):
        mask_nm(_randn(8, 8), 2, 8, method="2d_optimal")
    with pytest.raises(ValueError, match=r"need integers 0 <= n <= m and m >= 1, got n=2, m=0"):
        mask_nm(w, 2, 0, method="wanda", act_norm=torch.ones(8))
    with pytest.raises(ValueError, match="unknown mask method 'optimal'"):
        mask_nm(w, 2, 4, method="optimal")
    with pytest.raises(TypeError, match=r"unexpected arguments for method='2d_optimal': \['act_norm'\]"):
        mask_nm(_randn(8, 8), 2, 4, method="2d_optimal", act_norm=torch.ones(8))
    assert torch.equal(w, before)


# --- Wanda -------------------------------------------------------------------------

def test_wanda_equals_magnitude_with_unit_norms_and_is_optimal_for_its_score():
    w = _randn(8, 32, seed=7)
    assert torch.equal(mask_nm(w, 2, 4, method="wanda", act_norm=torch.ones(32)), mask_nm(w, 2, 4))
    norms = torch.rand(32, generator=_gen(8), dtype=torch.float64) * 3
    for n, m in [(2, 4), (4, 8)]:
        mask = mask_nm(w, n, m, method="wanda", act_norm=norms)
        assert torch.equal(mask, _brute_1d(w.abs() * norms, n, m))
    # a big norm on column 3 makes it survive against larger weights
    w2 = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert mask_nm(w2, 2, 4, method="wanda", act_norm=torch.tensor([1.0, 1.0, 1.0, 10.0])).tolist() == \
        [[True, False, False, True]]


def test_wanda_bad_input():
    w = _randn(4, 8)
    with pytest.raises(ValueError, match="method='wanda' needs act_norm="):
        mask_nm(w, 2, 4, method="wanda")
    with pytest.raises(ValueError, match=r"act_norm must have shape \(8,\)"):
        mask_nm(w, 2, 4, method="wanda", act_norm=torch.ones(4))
    with pytest.raises(ValueError, match="act_norm must be non-negative"):
        mask_nm(w, 2, 4, method="wanda", act_norm=-torch.ones(8))
    with pytest.raises(TypeError, match="calibration must be a LayerStats"):
        mask_nm(w, 2, 4, method="wanda", calibration={"act_norm": torch.ones(8)})


# --- SparseGPT ---------------------------------------------------------------------

def _correlated_problem(seed=0, K=64, N=2048, R=32):
    g = _gen(seed)
    mix = torch.randn(K, K, generator=g, dtype=torch.float64) / K ** 0.5
    x = (torch.randn(N, K, generator=g, dtype=torch.float64) @ mix + 0.2 * torch.randn(N, K, generator=g,
                                                                                          dtype=torch.float64))
    x = x * (0.2 + 3 * torch.rand(K, generator=g, dtype=torch.float64))  # uneven channel scales
    return x, torch.randn(R, K, generator=g, dtype=torch.float64)


def test_sparsegpt_beats_magnitude_and_wanda_on_reconstruction():
    x, w = _correlated_problem()
    net = nn.Linear(64, 32, bias=False).double()
    net.weight.data.copy_(w)
    stats = calibrate(net, [x[:1000], x[1000:]], hessian=True)[""]
    ref = F.linear(x, w)

    def err(new_w):
        return float((ref - F.linear(x, new_w)).norm() / ref.norm())

    errs = {meth: err(prune_nm(w, 2, 4, meth, calibration=stats).weight)
            for meth in ("magnitude", "wanda", "sparsegpt")}
    assert errs["sparsegpt"] < 0.9 * errs["wanda"] < 0.9 * errs["magnitude"], errs
    new_w, mask = sparsegpt_prune(w, stats.hessian, 2, 4, blocksize=16)
    assert is_nm(new_w, 2, 4) and bool((new_w[~mask] == 0).all())
    assert torch.equal(mask, mask_nm(w, 2, 4, method="sparsegpt", hessian=stats.hessian, blocksize=16))
    assert err(new_w) < errs["wanda"]


def _sparsegpt_naive(w, h, n, m, percdamp=0.01):
    """SparseGPT's OBS recursion written plainly: U from the explicit inverse, every
    pruned column's error pushed onto ALL later columns at once (no lazy blocks)."""
    w, h = w.clone(), h.clone()
    h += percdamp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    keep = torch.ones_like(w, dtype=torch.bool)
    for j in range(w.shape[1]):
        if j % m == 0:
            score = w[:, j:j + m] ** 2 / u.diagonal()[j:j + m] ** 2
            for r in range(w.shape[0]):
                for c in sorted(range(m), key=lambda c: float(score[r, c]))[:m - n]:
                    keep[r, j + c] = False
        err = torch.where(keep[:, j], 0.0, w[:, j]) / u[j, j]
        w[:, j:] -= err[:, None] * u[j, j:][None, :]
    return w * keep, keep


@pytest.mark.parametrize("n,m,blocksize", [(2, 4, 8), (2, 4, 128), (1, 4, 4), (4, 8, 16)])
def test_sparsegpt_matches_plain_recursion(n, m, blocksize):
    x, w = _correlated_problem(seed=5, K=32, N=256, R=6)
    h = x.T @ x
    want_w, want_mask = _sparsegpt_naive(w, h, n, m)
    got_w, got_mask = sparsegpt_prune(w, h, n, m, blocksize=blocksize)
    assert torch.equal(got_mask, want_mask)
    torch.testing.assert_close(got_w, want_w, rtol=1e-9, atol=1e-9)


def test_sparsegpt_with_white_inputs_is_magnitude_pruning():
    # H = c * I: no cross-column compensation, the score is w^2 / const -> exactly the magnitude mask
    w = _randn(16, 32, seed=11)
    new_w, mask = sparsegpt_prune(w, 5.0 * torch.eye(32, dtype=torch.float64), 2, 4)
    assert torch.equal(mask, mask_nm(w, 2, 4))
    torch.testing.assert_close(new_w, w * mask, rtol=0, atol=1e-12)


def test_sparsegpt_dead_inputs_and_dtype():
    x, w = _correlated_problem(seed=2, K=32, R=8)
    x[:, 5] = 0  # a channel that never fires
    h = x.T @ x
    new_w, mask = sparsegpt_prune(w.float(), h, 2, 4)
    assert new_w.dtype == torch.float32 and new_w[:, 5].eq(0).all() and not mask[:, 5].any()


def test_sparsegpt_bad_input():
    w = _randn(4, 8)
    before = w.clone()
    with pytest.raises(ValueError, match="method='sparsegpt' needs hessian="):
        mask_nm(w, 2, 4, method="sparsegpt")
    with pytest.raises(ValueError, match=r"hessian must be a \(8, 8\) tensor .* got \(4, 4\)"):
        sparsegpt_prune(w, torch.eye(4))
    with pytest.raises(ValueError, match="blocksize must be a positive multiple of m=4"):
        sparsegpt_prune(w, torch.eye(8), blocksize=6)
    with pytest.raises(ValueError, match=r"calibrate\(\.\.\., hessian=True\)"):
        prune_nm(w, 2, 4, "sparsegpt", calibration=LayerStats(torch.ones(8), 3))
    assert torch.equal(w, before)


def test_prune_layerwise_calibrates_each_layer_on_pruned_inputs():
    x, _ = _correlated_problem(seed=4, K=16, N=512)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8, bias=False)).double()
    filt = lambda mod, fqn: fqn != "3"  # noqa: E731
    dense = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        ref_out = net(x)
    results = prune_layerwise_(net, [x[:200], x[200:]], method="sparsegpt", blocksize=8, filter_fn=filt)
    assert list(results) == ["0", "2"]
    # by hand: layer 0 from the raw inputs, layer 2 from the outputs of the PRUNED layer 0
    w0, _ = sparsegpt_prune(dense[0], x.T @ x, 2, 4, blocksize=8)
    h1 = torch.relu(F.linear(x, w0, dense[1]))
    w2, _ = sparsegpt_prune(dense[2], h1.T @ h1, 2, 4, blocksize=8)
    torch.testing.assert_close(net[0].weight.detach(), w0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(net[2].weight.detach(), w2, rtol=1e-9, atol=1e-9)
    assert torch.equal(net[3].weight, dense[4])  # filtered out: untouched
    assert torch.equal(results["2"].weight, net[2].weight.detach())
    # and the whole network is closer to the dense one than with magnitude masks on the same layers
    w0m, w2m = (dense[i] * mask_nm(dense[i], 2, 4) for i in (0, 2))
    mag_out = F.linear(F.linear(torch.relu(F.linear(x, w0m, dense[1])), w2m, dense[3]), dense[4])
    with torch.no_grad():
        out = net(x)
    assert (out - ref_out).norm() < 0.8 * (mag_out - ref_out).norm()
    with pytest.raises(TypeError, match="batches must be re-iterable"):
        prune_layerwise_(net, iter([x]))


# --- calibrate -----------------------------------------------------------------------

class _KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        return self.b(self.drop(torch.relu(self.a(x))) * scale)


def test_calibrate_statistics_match_hand_computation():
    torch.manual_seed(0)
    net = _KwNet().double().train()
    x1 = _randn(2, 5, 3, seed=1)  # (batch, seq, features): rows are flattened
    x2, x3 = _randn(4, 3, seed=2), _randn(3, 3, seed=3)
    batches = [x1, (x2,), {"x": x3, "scale": 2.0}]
    stats = calibrate(net, batches, hessian=True)
    assert net.training and net.drop.training  # mode restored
    assert all(not mod._forward_pre_hooks for mod in net.modules())
    with torch.no_grad():  # by hand, dropout off (calibrate runs in eval mode)
        xa = torch.cat([x1.reshape(-1, 3), x2, x3])
        xb = torch.cat([torch.relu(net.a(x1)).reshape(-1, 4), torch.relu(net.a(x2)), 2.0 * torch.relu(net.a(x3))])
    for name, x in (("a", xa), ("b", xb)):
        s = stats[name]
        assert s.count == x.shape[0] == 17
        torch.testing.assert_close(s.sq_sum, (x ** 2).sum(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.act_norm, x.norm(dim=0) / 17 ** 0.5, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.xtx, x.T @ x, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.hessian, x.T @ x / 17, rtol=1e-12, atol=1e-12)
    only_b = calibrate(net, [x2], filter_fn=lambda mod, fqn: fqn == "b")
    assert list(only_b) == ["b"] and only_b["b"].xtx is None
    with pytest.raises(ValueError, match="no Hessian collected"):
        only_b["b"].hessian


def test_calibrate_and_layerwise_see_a_linear_called_with_its_input_by_name():
    # lin(input=x) gave the hooks no positional argument: IndexError
    class ByName(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16).double(), nn.Linear(16, 4).double()

        def forward(self, x):
            return self.b(input=torch.relu(self.a(input=x)))

    torch.manual_seed(0)
    net, x = ByName(), _randn(6, 8, seed=4)
    stats = calibrate(net, [x], hessian=True, teacher=copy.deepcopy(net))
    with torch.no_grad():
        h = torch.relu(net.a(x))
    torch.testing.assert_close(stats["a"].xtx, x.T @ x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats["b"].xtx_teacher, h.T @ h, rtol=1e-12, atol=1e-12)
    assert set(prune_layerwise_(net, [x], method="wanda")) == {"a", "b"}


def test_calibrate_removes_hooks_on_error_and_feeds_sparsify_methods():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    with pytest.raises(RuntimeError):
        calibrate(net, [torch.randn(2, 8), torch.randn(2, 7)])
    assert all(not mod._forward_pre_hooks for mod in net.modules()) and net.training
    stats = calibrate(net, [torch.randn(32, 8)])
    w = net[2].weight
    assert torch.equal(mask_nm(w, 2, 4, method="wanda", calibration=stats["2"]),
                       mask_nm(w, 2, 4, method="wanda", act_norm=stats["2"].act_norm))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        calibrate(lambda x: x, [torch.randn(2, 8)])


# --- reporting -------------------------------------------------------------------------

def test_kept_magnitude_fraction_and_prune_nm():
    w = torch.tensor([[4.0, -3.0, 2.0, 1.0], [0.5, 0.0, -0.25, 1.0]])
    assert kept_magnitude_fraction(w, mask_nm(w, 2, 4)) == pytest.approx((7 + 1.5) / (10 + 1.75))
    assert kept_magnitude_fraction(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool)) == 1.0
    r = prune_nm(_randn(8, 16), 2, 4, "2d_optimal")
    assert torch.equal(r.weight, _randn(8, 16) * r.mask) and r.method == "2d_optimal"
    assert r.kept_fraction == pytest.approx(kept_magnitude_fraction(_randn(8, 16), r.mask))
    with pytest.raises(ValueError, match=r"mask shape \(2, 2\) does not match weight shape \(2, 4\)"):
        kept_magnitude_fraction(w, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        kept_magnitude_fraction(w, torch.ones(2, 4))


def test_pruned_infinite_weights_become_zero_not_nan():
    # w * mask turned a pruned inf into NaN (inf * 0), in PruneResult.weight, in out= and so in the
    # model through prune_layerwise_; kept_fraction was inf / inf = NaN
    inf = math.inf
    w = torch.tensor([[inf, -inf, inf, 1.0, 0.5, 0.25, 2.0, 3.0]]).repeat(4, 1)
    for method in ("magnitude", "2d_greedy", "2d_optimal"):
        r = prune_nm(w, 2, 4, method)
        out = prune_nm(w, 2, 4, method, out=torch.empty_like(w)).weight
        for got in (r.weight, out):
            assert torch.equal(got, torch.where(r.mask, w, torch.zeros(())))  # zeros, no NaN
        n_inf_kept = int((r.mask & w.isinf()).sum())
        assert r.kept_fraction == n_inf_kept / int(w.isinf().sum())
    net = nn.Sequential(nn.Linear(8, 4))
    with torch.no_grad():
        net[0].weight[0, :3] = inf
    prune_layerwise_(net, [torch.randn(4, 8)], method="magnitude", progress=False)
    assert not bool(net[0].weight.isnan().any()) and int(net[0].weight[0, :4].isinf().sum()) == 2
    # Wanda: an infinite weight on a dead input channel scores 0, not NaN ("weight contains NaN")
    mask = mask_nm(w[:1], 2, 4, method="wanda", act_norm=torch.tensor([0.0, 1, 1, 1, 1, 1, 1, 1]))
    assert mask[0, :4].tolist() == [False, True, True, False]


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_sparsegpt_takes_a_weight_of_zero_rows(quantize):
    r = prune_nm(torch.randn(0, 256), 2, 4, "sparsegpt", hessian=torch.eye(256), quantize=quantize)
    assert r.weight.shape == r.mask.shape == (0, 256)
    if quantize:
        assert r.packed.shape == (0, 256) and r.packed.quantized == "int4"


@pytest.mark.parametrize("method", ["magnitude", "wanda", "2d_greedy", "sparsegpt"])
def test_prune_nm_in_place(monkeypatch, method):
    """out=w prunes w itself (row chunks of 3 rows here), as a fresh result would: w * mask (or SparseGPT's
    weight), the kept fraction of the original w; a bad out is refused before anything changes."""
    monkeypatch.setattr(nm, "_CHUNK", 48)
    w = _randn(16, 16)
    kw = ({"act_norm": _randn(16, seed=1).abs()} if method == "wanda" else
          {"hessian": (lambda x: x.T @ x)(_randn(64, 16, seed=2)), "blocksize": 8} if method == "sparsegpt" else {})
    fresh = prune_nm(w, 2, 4, method, **kw)
    inplace = w.clone()
    r = prune_nm(inplace, 2, 4, method, out=inplace, **kw)
    assert r.weight.data_ptr() == inplace.data_ptr() and torch.equal(r.mask, fresh.mask)
    ref = torch.where(fresh.mask, w, 0) if method != "sparsegpt" else fresh.weight
    assert torch.equal(inplace, ref) and r.kept_fraction == kept_magnitude_fraction(w, fresh.mask)
    for bad in (torch.zeros(16, 8, dtype=torch.float64), torch.zeros(16, 16)):
        before = w.clone()
        with pytest.raises(ValueError, match="out must be a tensor of w's shape, dtype and device"):
            prune_nm(w, 2, 4, method, out=bad, **kw)
        assert torch.equal(w, before) and not bad.any()


def test_prune_layerwise_on_layer_sees_each_result_once():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).double()
    ref = copy.deepcopy(net)
    batches = [torch.randn(20, 16, dtype=torch.float64)]
    expected = prune_layerwise_(ref, batches, method="wanda")
    seen = []

    def on_layer(fqn, r):  # called with the layer's weight already pruned
        assert r.weight.data_ptr() == net.get_submodule(fqn).weight.data_ptr()
        assert torch.equal(r.weight, expected[fqn].weight) and torch.equal(r.mask, expected[fqn].mask)
        seen.append(fqn)
        return int(r.mask.sum())

    out = prune_layerwise_(net, batches, method="wanda", on_layer=on_layer, rollback=False)
    assert seen == ["0", "2"] and out == {"0": 32 * 8, "2": 8 * 16}


def test_public_names():
    assert sparse24.calibrate is calibrate and sparse24.search_permutation is search_permutation
    assert sparse24.apply_permutation is apply_permutation
    assert sparse24.kept_magnitude_fraction is kept_magnitude_fraction


# --- permutations -------------------------------------------------------------------

def _kept(w, perm, n=2, m=4):
    v = w[:, perm]
    return kept_magnitude_fraction(v, mask_nm(v, n, m))


@pytest.mark.parametrize("R,C,n,m,wg", [(8, 32, 2, 4, 8), (8, 40, 2, 4, 4), (6, 32, 2, 8, 4), (6, 24, 1, 4, 3)])
def test_swap_gains_are_exact(R, C, n, m, wg):
    """Every swap's predicted gain equals the brute-force change of the best N:M kept magnitude
    (including a padded last window: 10 groups in windows of 4)."""
    a = torch.cat([_randn(R, C, seed=C).abs(), torch.zeros(R, 1, dtype=torch.float64)], 1)
    perm = torch.randperm(C, generator=_gen(1))
    t = _TabuWindows(a, perm.view(-1, m), n, m, wg, tenure=3, deadline=math.inf)
    t.start()
    for _ in range(4):
        t.step()
    cols = t.cols.gather(1, t.loc)
    g_loc = t.gain.gather(2, t.loc[:, None, :].expand(-1, t.P, -1))
    delta = g_loc + g_loc.transpose(1, 2)
    checked = 0
    for b, p, q in itertools.product(range(t.B), range(t.P), range(t.P)):
        if not t.fixed[b, p, q]:
            c = cols[b].clone()
            before = float(a[:, c].reshape(R, -1, m).topk(n, -1).values.sum())
            c[[p, q]] = c[[q, p]]
            after = float(a[:, c].reshape(R, -1, m).topk(n, -1).values.sum())
            assert after - before == pytest.approx(float(delta[b, p, q]), abs=1e-10)
            checked += 1
    assert checked > 0


def test_search_permutation_gains_and_is_deterministic():
    w = _randn(64, 128, seed=12, dtype=torch.float32)
    perm = search_permutation(w, time_limit=30, max_iters=150, seed=3, progress=False)
    assert torch.equal(torch.sort(perm).values, torch.arange(128))
    gain = _kept(w, perm) / _kept(w, torch.arange(128)) - 1
    assert gain > 0.02  # about +3% at convergence; 150 steps get most of it
    assert torch.equal(perm, search_permutation(w, time_limit=30, max_iters=150, seed=3, progress=False))


def test_search_permutation_windows_and_other_nm(capsys):
    w = _randn(32, 256, seed=13, dtype=torch.float32)
    perm = search_permutation(w, time_limit=30, max_iters=60, window=32, round_iters=15, seed=0, progress=True)
    assert torch.equal(torch.sort(perm).values, torch.arange(256))
    assert _kept(w, perm) > _kept(w, torch.arange(256)) * 1.01
    err = capsys.readouterr().err
    assert "search_permutation:" in err and "%/s" in err and "kept +" in err  # tqdm bar with the gain
    for n, m in [(1, 4), (2, 8)]:
        perm = search_permutation(w[:, :64], n, m, time_limit=30, max_iters=40, progress=False)
        assert _kept(w[:, :64], perm, n, m) > _kept(w[:, :64], torch.arange(64), n, m)
    assert torch.equal(search_permutation(w, 4, 4, progress=False), torch.arange(256))  # nothing to gain


def test_search_permutation_respects_time_limit():
    w = torch.randn(512, 2048, generator=_gen(0))
    t0 = time.perf_counter()
    perm = search_permutation(w, time_limit=0.5, progress=False)
    assert time.perf_counter() - t0 < 3.0  # the first deadline check lands within one chunk
    assert torch.equal(torch.sort(perm).values, torch.arange(2048))


def test_search_permutation_bad_input():
    w = _randn(4, 8)
    with pytest.raises(ValueError, match="time_limit must be a positive number of seconds"):
        search_permutation(w, time_limit=0)
    with pytest.raises(ValueError, match="window must be a positive int"):
        search_permutation(w, window=0)
    with pytest.raises(ValueError, match=r"last dimension \(6\) must be divisible by m=4"):
        search_permutation(_randn(4, 6))


def test_apply_permutation_keeps_an_mlp_exactly():
    g = _gen(21)
    # Small integers: every product and sum is exact in fp32, so equality is bit-exact.
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randint(-4, 5, p.shape, generator=g).float())
    x = torch.randint(-3, 4, (7, 8), generator=g).float()
    before, w2 = mlp(x), mlp[2].weight.detach().clone()
    params = [id(p) for p in mlp.parameters()]
    perm = search_permutation(w2, time_limit=10, max_iters=30, progress=False)
    assert not torch.equal(perm, torch.arange(16))
    apply_permutation(mlp[0], mlp[2], perm)
    assert torch.equal(mlp(x), before)
    assert torch.equal(mlp[2].weight, w2[:, perm]) and [id(p) for p in mlp.parameters()] == params


def test_apply_permutation_bad_input():
    a, b, c = nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(6, 4)
    state = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    cases = [
        ((a, c, torch.arange(8)), ValueError, r"producer.out_features \(8\) must equal consumer.in_features \(6\)"),
        ((a, b, torch.arange(6)), ValueError, r"perm must be an integer tensor of shape \(8,\)"),
        ((a, b, torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])), ValueError, "perm must be a permutation of 0..7"),
        ((a, b, torch.arange(8.0)), ValueError, "perm must be an integer tensor"),
        ((a, nn.ReLU(), torch.arange(8)), TypeError, "consumer must be an nn.Linear, got ReLU"),
        ((b, b, torch.arange(4)), ValueError, "producer and consumer are the same module"),
    ]
    for args, err, msg in cases:
        with pytest.raises(err, match=msg):
            apply_permutation(*args)
    assert all(torch.equal(p, q) for p, q in zip(state, (*a.parameters(), *b.parameters())))


def test_sparsegpt_rejects_inputs_that_used_to_give_nan_zero_or_raw_errors():
    w = _randn(8, 16)
    with pytest.raises(ValueError, match="not positive semi-definite"):  # was torch's _LinAlgError
        sparsegpt_prune(w, -torch.eye(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="all zero"):  # used to zero every weight
        sparsegpt_prune(w, torch.zeros(16, 16))
    with pytest.raises(ValueError, match="percdamp must be a finite number"):  # inf gave NaN weights
        sparsegpt_prune(w, torch.eye(16), percdamp=math.inf)
    bad = w.clone()
    bad[0, 0] = math.nan  # spread NaN into the row
    with pytest.raises(ValueError, match="NaN or inf"):
        sparsegpt_prune(bad, torch.eye(16))


def test_calibrate_drops_layers_that_saw_no_rows():
    # 0-row batches used to give count-0 stats (all-zero Hessian): sparsify_ then zeroed the weights
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    assert calibrate(model, [torch.randn(0, 32)], hessian=True) == {}
    with pytest.raises(ValueError, match="batches is empty"):  # was StopIteration
        prune_layerwise_(model, [])


def test_permutation_edge_cases():
    assert torch.equal(search_permutation(torch.randn(0, 16), progress=False), torch.arange(16))  # was RuntimeError
    # a parametrized producer's .weight is a computed copy: the permutation used to be lost silently
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    nn.utils.parametrize.register_parametrization(mlp[0], "weight", nn.Identity())
    before = [p.detach().clone() for p in mlp.parameters()]
    with pytest.raises(ValueError, match="producer's weight is parametrized"):
        apply_permutation(mlp[0], mlp[2], torch.randperm(16))
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.parameters()))


class _ThreeHeads(nn.Module):
    """q, k, v read the same input (one wave), then an output layer reads their sum."""

    def __init__(self, twice=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.twice = twice

    def forward(self, x):
        h = torch.relu(self.q(x)) + torch.relu(self.k(x)) * self.v(x)
        out = self.o(h)
        return self.o(torch.tanh(out)) if self.twice else out  # twice: o is called two times per forward


@pytest.mark.parametrize("twice", [False, True])
def test_prune_layerwise_waves_match_one_layer_at_a_time(twice):
    torch.manual_seed(7)
    net = _ThreeHeads(twice).double()
    ref = copy.deepcopy(net)
    batches = [torch.randn(40, 16, dtype=torch.float64) for _ in range(2)]
    results = prune_layerwise_(net, batches, method="sparsegpt", blocksize=8)
    assert list(results) == ["q", "k", "v", "o"]
    for fqn in ["q", "k", "v", "o"]:  # the reference: a full pass per layer, in call order
        stats = calibrate(ref, batches, hessian=True, filter_fn=lambda mod, name, fqn=fqn: name == fqn)
        lin = ref.get_submodule(fqn)
        with torch.no_grad():
            lin.weight.copy_(sparsegpt_prune(lin.weight, stats[fqn].hessian, blocksize=8)[0])
        torch.testing.assert_close(net.get_submodule(fqn).weight, lin.weight, rtol=1e-9, atol=1e-9)


def test_calibrate_stop_early_skips_the_rest_of_the_forward():
    net = _ThreeHeads().double()
    ran = []
    net.o.register_forward_pre_hook(lambda mod, args: ran.append(1))
    x = torch.randn(8, 16, dtype=torch.float64)
    early = calibrate(net, [x, x], filter_fn=lambda mod, name: name in ("q", "k"), stop_early=True)
    assert not ran and set(early) == {"q", "k"}  # o never ran
    full = calibrate(net, [x, x], filter_fn=lambda mod, name: name in ("q", "k"))
    assert len(ran) == 2 and all(torch.equal(early[k].sq_sum, full[k].sq_sum) for k in early)

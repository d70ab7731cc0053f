"""Least-squares reconstruction for a fixed mask and padding-free calibration, against
independent references: per-row least squares of the augmented system, and statistics
of the same tokens without padding."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24 import is_nm, mask_nm
from sparse24.masks import calibrate, prune_layerwise_, reconstruct_weight, sparsegpt_prune
from sparse24.masks.reconstruct import LAYERWISE_PERCDAMP


def _data(R=12, C=32, N=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, dtype=torch.float64) @ torch.randn(C, C, generator=g, dtype=torch.float64)
    return x, torch.randn(R, C, generator=g, dtype=torch.float64)


def _reference(w, mask, x, percdamp, x_teacher=None, shrink=0.0):
    """Row by row: min (1 - a) ||X v - X_t w_r||^2 + (v - w_r)^T (a D + lam I) (v - w_r) over v zero
    off the mask (X_t = X without a teacher; a = shrink, D = diag(X^T X)), as an ordinary
    least-squares problem on the kept columns of the stacked system [sqrt(1 - a) X; sqrt(a D + lam)]
    with right side [sqrt(1 - a) X_t w_r; sqrt(a D + lam) w_r]."""
    d = (x * x).sum(0)
    lam = percdamp * float(d.mean())
    root = torch.diag((shrink * d + lam).sqrt())
    keep = (1 - shrink) ** 0.5
    A, T = torch.cat([keep * x, root]), torch.cat([keep * (x if x_teacher is None else x_teacher), root])
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        keep = mask[r].nonzero().flatten()
        if len(keep):
            out[r, keep] = torch.linalg.lstsq(A[:, keep], (T @ w[r]).unsqueeze(1)).solution.flatten()
    return out


@pytest.mark.parametrize("kind", ["nm", "ragged"])
def test_reconstruct_matches_least_squares(kind):
    x, w = _data()
    g = torch.Generator().manual_seed(1)
    mask = mask_nm(w) if kind == "nm" else torch.rand(w.shape, generator=g) < 0.4
    if kind == "ragged":
        mask[0] = False  # a row that keeps nothing
        mask[1] = True  # and one that keeps everything
    got = reconstruct_weight(w, mask, x.T @ x, percdamp=0.01)
    torch.testing.assert_close(got, _reference(w, mask, x, 0.01), rtol=1e-9, atol=1e-9)
    assert bool((got[~mask] == 0).all())
    if kind == "ragged":
        torch.testing.assert_close(got[1], w[1])  # nothing pruned: nothing to change
        assert bool((got[0] == 0).all())


def test_refit_beats_sparsegpt_sweep_and_keeps_its_mask():
    x, w = _data(R=16, C=64, N=400, seed=2)
    h = x.T @ x
    w_sweep, mask = sparsegpt_prune(w, h, blocksize=16)
    w_refit, mask2 = sparsegpt_prune(w, h, blocksize=16, refit=True)
    assert torch.equal(mask, mask2) and is_nm(w_refit)
    err = lambda v: float((x @ (v - w).T).norm())  # noqa: E731
    assert err(w_refit) < err(w_sweep) < err(w * mask)
    torch.testing.assert_close(w_refit, reconstruct_weight(w, mask, h), rtol=0, atol=0)
    assert w_refit.dtype == w.dtype and sparsegpt_prune(w.float(), h, refit=True)[0].dtype == torch.float32


def test_reconstruct_dead_inputs_and_rejects_bad_input():
    x, w = _data(R=4, C=8, N=50)
    x[:, 3] = 0  # an input that never fires
    mask = mask_nm(w)
    got = reconstruct_weight(w, mask, x.T @ x)
    assert bool((got[:, 3] == 0).all()) and torch.isfinite(got).all()
    h = x.T @ x
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        reconstruct_weight(w, mask, h[:4, :4])
    with pytest.raises(TypeError, match="bool"):
        reconstruct_weight(w, mask.float(), h)
    with pytest.raises(ValueError, match="percdamp"):
        reconstruct_weight(w, mask, h, percdamp=0)
    with pytest.raises(ValueError, match="NaN"):
        reconstruct_weight(w.clone().fill_(float("nan")), mask, h)
    with pytest.raises(ValueError, match="all zero"):
        reconstruct_weight(w, mask, torch.zeros(8, 8))
    with pytest.raises(ValueError, match="positive semi-definite"):
        reconstruct_weight(w, mask, -torch.eye(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="refit"):
        sparsegpt_prune(w, h, refit=1)


class _Tok(nn.Module):
    """Embedding + Linear over (ids, mask) batches, like a padded language model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = nn.Embedding(20, 8), nn.Linear(8, 8)

    def forward(self, ids, mask):
        return self.lin(self.emb(ids))


def test_calibrate_token_mask_equals_unpadded_batches():
    model = _Tok()
    seqs = [torch.tensor(s) for s in ([3, 4, 5, 6], [7, 8], [9, 10, 11], [12])]
    padded = torch.zeros(4, 4, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    masked = calibrate(model, [(padded, padded != 0)], hessian=True, token_mask=lambda b: b[1])["lin"]
    plain = calibrate(model, [(s[None], None) for s in seqs], hessian=True)["lin"]
    assert masked.count == plain.count == 10
    torch.testing.assert_close(masked.xtx, plain.xtx)
    torch.testing.assert_close(masked.sq_sum, plain.sq_sum)
    unmasked = calibrate(model, [(padded, None)], hessian=True)["lin"]
    assert unmasked.count == 16 and not torch.allclose(unmasked.xtx, plain.xtx)  # padding would count
    # 0/1 integer masks work too; layer-wise pruning passes the mask on
    ints = calibrate(model, [(padded, (padded != 0).long())], token_mask=lambda b: b[1])["lin"]
    assert ints.count == 10
    res = prune_layerwise_(model, [(padded, padded != 0)], token_mask=lambda b: b[1])
    assert is_nm(res["lin"].weight)


def test_calibrate_token_mask_errors():
    model = _Tok()
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="callable"):
        calibrate(model, [(ids, None)], token_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"token_mask gave shape \(3, 2\)"):
        calibrate(model, [(ids, None)], token_mask=lambda b: torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        calibrate(model, [(ids, None)], token_mask=lambda b: torch.ones(2, 3))
    with pytest.raises(ValueError, match="other than 0 and 1"):
        calibrate(model, [(ids, None)], token_mask=lambda b: torch.full((2, 3), 2))


def test_sparsify_with_refit_stores_the_least_squares_weights():
    import sparse24
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)).double()
    x = torch.randn(300, 32, dtype=torch.float64)
    stats = calibrate(net, [x], hessian=True)
    w0 = net[0].weight.detach().clone()
    ref_w, ref_mask = sparsegpt_prune(w0, stats["0"].hessian)
    sparse24.sparsify_(net, method="sparsegpt", calibration=stats, refit=True, min_features=8,
                       skip_output_head=False)
    got = net[0].dense_weight()
    assert torch.equal(got != 0, ref_mask)
    torch.testing.assert_close(got, reconstruct_weight(w0, ref_mask, stats["0"].hessian), rtol=0, atol=0)
    assert not torch.allclose(got, ref_w)  # not the sweep's weights


# --- fitting each layer to a teacher's outputs (asymmetric, layer by layer) ---------------

def _two_layers(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).double()
    x, _ = _data(C=16, N=300, seed=seed + 1)
    return net, [x[:120], x[120:]], x


def test_calibrate_with_teacher_pairs_the_inputs_of_the_same_tokens():
    net, batches, x = _two_layers()
    teacher = copy.deepcopy(net)
    with torch.no_grad():
        net[0].weight.mul_(mask_nm(net[0].weight))  # the model's second layer now reads other inputs
    stats = calibrate(net, batches, teacher=teacher, stop_early=True)  # implies the Hessian
    with torch.no_grad():
        h, h_t = F.gelu(net[0](x)), F.gelu(teacher[0](x))
    torch.testing.assert_close(stats["2"].xtx_teacher, h.T @ h_t)
    torch.testing.assert_close(stats["2"].xtx, h.T @ h)
    torch.testing.assert_close(stats["0"].xtx_teacher, x.T @ x)
    assert stats["2"].count == 300 and calibrate(net, batches)["2"].xtx_teacher is None


@pytest.mark.parametrize("percdamp", [0.01, LAYERWISE_PERCDAMP])  # SparseGPT's, the recommended recipe's
def test_prune_layerwise_with_teacher_fits_the_teachers_outputs(percdamp):
    net, batches, x = _two_layers()
    teacher, plain = copy.deepcopy(net), copy.deepcopy(net)
    res = prune_layerwise_(net, batches, method="sparsegpt", refit=True, percdamp=percdamp, teacher=teacher)
    prune_layerwise_(plain, batches, method="sparsegpt", refit=True, percdamp=percdamp)
    # the first layer reads the teacher's own inputs: the same problem as without a teacher
    torch.testing.assert_close(net[0].weight, plain[0].weight, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        h, h_t = F.gelu(net[0](x)), F.gelu(teacher[0](x))
    # the second layer: exact least squares from the pruned model's inputs to the teacher's outputs
    want = _reference(teacher[2].weight.detach(), res["2"].mask, h, percdamp, x_teacher=h_t)
    torch.testing.assert_close(net[2].weight.detach(), want, rtol=1e-8, atol=1e-10)
    assert is_nm(net[2].weight) and is_nm(net[0].weight)
    with torch.no_grad():  # and the whole network ends closer to the teacher than without it
        ref = teacher(x)
        assert (net(x) - ref).norm() < 0.9 * (plain(x) - ref).norm()


def test_prune_layerwise_teacher_errors_change_nothing():
    net, batches, _ = _two_layers()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="shares parameters"):
        prune_layerwise_(net, batches, teacher=net)
    aliased = copy.deepcopy(net)
    aliased[0].weight = nn.Parameter(net[0].weight.data)  # another Parameter over the same memory
    with pytest.raises(ValueError, match="shares parameters"):
        prune_layerwise_(net, batches, teacher=aliased)
    with pytest.raises(TypeError, match="teacher must be an nn.Module"):
        prune_layerwise_(net, batches, teacher=net.state_dict())
    narrow = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(16, 8)).double()
    with pytest.raises(ValueError, match=r"no nn.Linear '2' with in_features=32"):
        prune_layerwise_(net, batches, teacher=narrow)
    with pytest.raises(ValueError, match=r"no nn.Linear '2'"):
        prune_layerwise_(net, batches, teacher=nn.Sequential(nn.Linear(16, 32)).double())
    shortcut = copy.deepcopy(net)
    shortcut.forward = lambda x: shortcut[0](x)  # never calls its layer '2'
    with pytest.raises(ValueError, match="the teacher calls its layers in another order"):
        prune_layerwise_(net, batches, teacher=shortcut)
    with pytest.raises(ValueError, match=r"teacher's layer '2' did not see the same inputs"):
        calibrate(net, batches, teacher=shortcut)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("shrink", [0.3, 1.0])
def test_shrink_matches_the_mixed_least_squares(shrink):
    x, w = _data()
    mask = mask_nm(w)
    got = reconstruct_weight(w, mask, x.T @ x, percdamp=0.01, shrink=shrink)
    torch.testing.assert_close(got, _reference(w, mask, x, 0.01, shrink=shrink), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got, reconstruct_weight(w, mask, x.T @ x, percdamp=0.01), atol=1e-3)
    # SparseGPT's sweep with refit solves the same problem for its own mask
    w_sg, mask_sg = sparsegpt_prune(w, x.T @ x, percdamp=0.01, shrink=shrink, refit=True)
    torch.testing.assert_close(w_sg, _reference(w, mask_sg, x, 0.01, shrink=shrink), rtol=1e-9, atol=1e-9)


def test_shrink_one_is_a_diagonal_hessian():
    # no correlation kept: no compensation, the kept weights stay, the mask keeps the largest w^2 (h_jj + lam)
    x, w = _data(R=16, C=32)
    d = (x * x).sum(0)
    new_w, mask = sparsegpt_prune(w, x.T @ x, percdamp=0.01, shrink=1.0)
    assert torch.equal(mask, mask_nm(w * (d + 0.01 * d.mean()).sqrt()))
    torch.testing.assert_close(new_w, w * mask, rtol=0, atol=1e-12)
    assert not torch.equal(mask, sparsegpt_prune(w, x.T @ x, percdamp=0.01)[1])


def test_prune_layerwise_teacher_fit_with_shrink():
    net, batches, x = _two_layers()
    teacher = copy.deepcopy(net)
    res = prune_layerwise_(net, batches, method="sparsegpt", refit=True, percdamp=0.01, shrink=0.5, teacher=teacher)
    with torch.no_grad():
        h, h_t = F.gelu(net[0](x)), F.gelu(teacher[0](x))
    for name, inp, inp_t in (("0", x, x), ("2", h, h_t)):  # the mixed problem, from the pruned model's inputs
        want = _reference(teacher.get_submodule(name).weight.detach(), res[name].mask, inp, 0.01, x_teacher=inp_t,
                          shrink=0.5)
        torch.testing.assert_close(net.get_submodule(name).weight.detach(), want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5", float("nan")])
def test_bad_shrink_is_refused_and_changes_nothing(bad):
    x, w = _data(R=4, C=8, N=50)
    with pytest.raises(ValueError, match="shrink must be a number in"):
        reconstruct_weight(w, mask_nm(w), x.T @ x, shrink=bad)
    with pytest.raises(ValueError, match="shrink must be a number in"):
        sparsegpt_prune(w, x.T @ x, shrink=bad)
    net, batches, _ = _two_layers()
    teacher, before = copy.deepcopy(net), copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="shrink must be a number in"):
        prune_layerwise_(net, batches, method="sparsegpt", shrink=bad, teacher=teacher)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_damping_is_the_same_at_any_scale_with_dead_inputs():
    # SparseGPT's code gives dead inputs a unit diagonal before taking the mean it damps by: with small
    # activations those 1s set the damping, so the mask and the refit changed with the Hessian's scale
    x, w = _data(R=16, C=64, N=400)
    x[:, :16] = 0  # inputs that never fire (a ReLU layer's dead units)
    h = (x.T @ x).double()
    ref_w, ref_mask = sparsegpt_prune(w.double(), h, 2, 4)
    ref_fit = reconstruct_weight(w.double(), ref_mask, h)
    for scale in (1e-4, 1e4):
        new_w, mask = sparsegpt_prune(w.double(), h * scale, 2, 4)
        assert torch.equal(mask, ref_mask)
        torch.testing.assert_close(new_w, ref_w, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(reconstruct_weight(w.double(), ref_mask, h * scale), ref_fit, rtol=1e-9, atol=1e-12)

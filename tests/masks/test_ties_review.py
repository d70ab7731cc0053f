"""Exact and near ties in the mask choices: SparseGPT breaks exact ties as format.mask_nm documents (the
lower column keeps), 2d_optimal finds the optimum of float32 blocks whose pattern sums differ by less than
a float32 rounding step, and SparseGPT's result does not depend on the weight's memory layout."""
import pytest
import torch

import sparse24
from sparse24.format import mask_nm as format_mask_nm
from sparse24.masks import block_patterns, sparsegpt_prune

from test_masks import _brute_2d


def _lower_column_reference(w, n, m):
    """Keep an entry when fewer than ``n`` entries of its group rank before it: a larger |w|, or an equal
    |w| at a lower column (float64, independent of the library's sort)."""
    a = w.double().abs().view(-1, m)
    col = torch.arange(m)
    before = (a[:, None, :] > a[:, :, None]) | ((a[:, None, :] == a[:, :, None]) & (col[None, :] < col[:, None]))
    return (before.sum(-1) < n).view(w.shape)


def _tied_weight(rows=32, cols=64, levels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    s = x.abs().amax(1, keepdim=True) / levels
    return (x / s).round().clamp(-levels, levels) * s  # a coarse INT grid: most groups hold exact ties


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 4)])
def test_sparsegpt_white_hessian_breaks_ties_like_mask_nm(n, m):
    w = _tied_weight()
    w0 = w.clone()
    ref = _lower_column_reference(w, n, m)
    ties = int((w.abs().view(-1, m, 1) == w.abs().view(-1, 1, m)).sum(-1).gt(1).any(-1).sum())
    assert ties > w.numel() // m // 2  # the test is about ties: most groups hold some
    new_w, mask = sparsegpt_prune(w, 5.0 * torch.eye(w.shape[1]), n, m)
    assert torch.equal(w, w0)
    assert torch.equal(mask, ref)
    assert torch.equal(mask, format_mask_nm(w, n, m))
    # white inputs: nothing to compensate, the kept weights stay as they were
    assert torch.equal(new_w.double(), w0.double() * ref)


def test_sparsegpt_white_hessian_small_example():
    e = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    assert sparsegpt_prune(e, torch.eye(4), 2, 4)[1].int().tolist() == [[0, 1, 1, 0]]


U = 2.0 ** -23  # float32 spacing at 1: pattern sums of these differ below a float32 rounding step of 8
NEAR_TIE_BLOCK = [[1, 1, 1, 1 + 3 * U],
                  [1, 1 + U, 1 + 3 * U, 1],
                  [1, 1 + 3 * U, 1 + 2 * U, 1 + 3 * U],
                  [1 + U, 1, 1 + 3 * U, 1]]


def _kept(w, mask):
    return (w.double().abs() * mask).view(w.shape[0] // 4, 4, w.shape[1] // 4, 4).sum((1, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_2d_optimal_reviewer_block_is_optimal(dtype):
    w = torch.tensor(NEAR_TIE_BLOCK, dtype=dtype)
    w0 = w.clone()
    mask = sparse24.mask_nm(w, 2, 4, method="2d_optimal")
    assert torch.equal(w, w0)
    best = _brute_2d(w0, 2)  # exhaustive, float64 (every sum exact here)
    assert _kept(w0, mask).item() == _kept(w0, best).item() == 8 + 17 * U
    assert torch.equal(mask, best)  # the optimum is unique here


def test_2d_optimal_near_ties_float32_equals_float64_copy():
    g = torch.Generator().manual_seed(0)
    B = 512
    w = 1 + U * torch.randint(0, 4, (B * 4, 4), generator=g).double()
    w = (w * torch.where(torch.rand(B * 4, 4, generator=g) < 0.5, -1.0, 1.0)).view(B, 4, 4)
    w = w.permute(1, 0, 2).reshape(4, B * 4).float()  # B blocks side by side
    m32 = sparse24.mask_nm(w, 2, 4, method="2d_optimal")
    m64 = sparse24.mask_nm(w.double(), 2, 4, method="2d_optimal")
    assert torch.equal(m32, m64)
    assert torch.equal(_kept(w, m32), _kept(w, _brute_2d(w, 2)))
    assert sparse24.is_nm(m32, 2, 4) and sparse24.is_nm(m32.t().contiguous(), 2, 4)
    assert block_patterns(2, 4).shape[0] == 186


@pytest.mark.parametrize("kw", [{}, {"shrink": 0.3}, {"refit": True}, {"quantize": "int4", "group_size": 32}])
def test_sparsegpt_result_does_not_depend_on_weight_layout(kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(384, 256, generator=g)
    w = torch.randn(32, 256, generator=g)
    h = x.T @ x
    col_major = w.t().contiguous().t()  # the same values, column-major
    assert not col_major.is_contiguous() and torch.equal(col_major, w)
    a, b = sparsegpt_prune(w, h, **kw), sparsegpt_prune(col_major, h, **kw)
    if isinstance(a, tuple):
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    else:
        assert torch.equal(a.to_dense(), b.to_dense())


def test_gradual_pruner_breaks_ties_like_mask_nm():
    # its N:M protection took torch.topk, whose order among equal scores is unspecified
    from torch import nn
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(_tied_weight())
    w0 = lin.weight.detach().clone()
    pruner = sparse24.GradualPruner(nn.Sequential(lin), (2, 4), start_step=0, end_step=1, frequency=1,
                                    skip_output_head=False)
    for step in range(2):
        pruner.step(step)
    assert torch.equal(pruner.masks["0"], _lower_column_reference(w0, 2, 4))

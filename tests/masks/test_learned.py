"""Learnable N:M masks (the per-tensor piece): pattern tables against a brute
force, prior initialisation by hand, exact N:M draws and final masks, the
straight-through gradient, determinism, and the memory bound."""
import itertools
import math

import pytest
import torch

from sparse24 import is_nm, mask_nm
from sparse24.masks import LearnableMask, nm_patterns


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (4, 8), (3, 5)])
def test_patterns_are_every_n_of_m_choice(n, m):
    table = nm_patterns(n, m)
    brute = {bits for bits in itertools.product((0, 1), repeat=m) if sum(bits) == n}  # independent enumeration
    assert table.shape == (math.comb(m, n), m) and table.dtype == torch.bool
    assert {tuple(int(v) for v in row) for row in table} == brute


def test_prior_logits_by_hand():
    prior = torch.tensor([[True, False, True, False]])  # slots {0, 2}
    lm = LearnableMask((1, 4), prior=prior, confidence=2.0)
    # patterns in order {0,1} {0,2} {0,3} {1,2} {1,3} {2,3}: overlap with {0,2} is 1 2 1 1 0 1
    expected = 2.0 * (torch.tensor([1, 2, 1, 1, 0, 1.0]) - 2)
    assert torch.equal(lm.logits.detach().view(-1), expected)
    assert torch.equal(lm.hard_mask(), prior)
    p = lm.probs().detach().view(-1)
    assert float(p[1]) == pytest.approx(1 / (1 + 4 * math.exp(-2) + math.exp(-4)), rel=1e-6)


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (1, 4)])
def test_final_mask_is_exact_nm_and_the_argmax_pattern(n, m):
    torch.manual_seed(0)
    lm = LearnableMask((13, 8 * m), n, m)
    with torch.no_grad():
        lm.logits.normal_()
    mask = lm.hard_mask()
    assert mask.dtype == torch.bool and is_nm(mask, n, m)
    assert torch.equal(mask.view(-1, m).sum(-1), torch.full((13 * 8,), n))  # exactly n in EVERY group
    table = nm_patterns(n, m)
    for r, g in [(0, 0), (5, 3), (12, 7)]:  # independent: the best logit's pattern, group by group
        best = int(lm.logits[:, r, g].argmax())
        assert torch.equal(mask[r, g * m:(g + 1) * m], table[best])


def test_prior_survives_as_the_most_probable_pattern():
    torch.manual_seed(1)
    w = torch.randn(24, 64)
    prior = mask_nm(w, 2, 4)
    for conf in (0.5, 3.0):
        assert torch.equal(LearnableMask(w.shape, prior=prior, confidence=conf).hard_mask(), prior)
    assert torch.equal(LearnableMask(w.shape, prior=prior, confidence=0.0).logits.detach(), torch.zeros(6, 24, 16))


def test_soft_draws_sum_to_n_per_group_and_hard_draws_are_exact():
    torch.manual_seed(2)
    lm = LearnableMask((9, 32), prior=mask_nm(torch.randn(9, 32), 2, 4))
    g = torch.Generator().manual_seed(0)
    soft = lm.sample(tau=1.0, generator=g)
    assert soft.shape == (9, 32) and soft.dtype == torch.float32
    assert bool((soft >= 0).all() and (soft <= 1).all())
    torch.testing.assert_close(soft.view(-1, 4).sum(-1), torch.full((72,), 2.0))
    assert 0 < int(((soft > 1e-3) & (soft < 1 - 1e-3)).sum())  # really soft
    hard = lm.sample(tau=1.0, hard=True, generator=g)
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0} and is_nm(hard.detach(), 2, 4)
    assert torch.equal(hard.detach().view(-1, 4).sum(-1), torch.full((72,), 2.0))


def test_hard_draw_passes_the_soft_gradient_straight_through():
    torch.manual_seed(3)
    lm = LearnableMask((4, 16))
    with torch.no_grad():
        lm.logits.normal_()
    target = torch.randn(4, 16)
    grads = []
    for hard in (False, True):
        lm.logits.grad = None
        (lm.sample(0.7, hard=hard, generator=torch.Generator().manual_seed(5)) * target).sum().backward()
        grads.append(lm.logits.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])  # same noise: the hard draw's gradient is the soft one's


def test_draws_are_deterministic_under_a_seed():
    lm = LearnableMask((8, 16))
    a = lm.sample(1.0, generator=torch.Generator().manual_seed(7))
    b = lm.sample(1.0, generator=torch.Generator().manual_seed(7))
    c = lm.sample(1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # no noise, low temperature: the draw is the most probable pattern
    torch.manual_seed(4)
    with torch.no_grad():
        lm.logits.normal_()
    assert torch.equal(lm.sample(1e-4, noise=0.0) > 0.5, lm.hard_mask())


def test_hard_draws_follow_the_pattern_probabilities():
    """Gumbel-max: with unit noise the drawn pattern is distributed as softmax(logits)."""
    lm = LearnableMask((1, 4000))
    with torch.no_grad():
        lm.logits.copy_(torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -0.5])[:, None, None].expand(6, 1, 1000))
    draw = lm.sample(1e-3, hard=True, generator=torch.Generator().manual_seed(0)).detach().view(1000, 4).bool()
    pats = nm_patterns(2, 4)
    counts = torch.stack([(draw == p).all(-1) for p in pats]).sum(1).double()
    expect = 1000 * torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -0.5], dtype=torch.float64).softmax(0)
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001


@pytest.mark.parametrize("dtype,bytes_per_group", [(torch.float32, 24), (torch.bfloat16, 12)])
def test_memory_is_six_floats_per_group_for_a_4096_square_layer(dtype, bytes_per_group):
    lm = LearnableMask((4096, 4096), dtype=dtype, device="meta")  # shapes only: nothing allocated
    groups = 4096 * 4096 // 4
    assert lm.logits.shape == (6, 4096, 1024) and lm.logits.numel() == 6 * groups
    state = sum(t.numel() * t.element_size() for t in [*lm.parameters(), *lm.buffers()])
    assert state == bytes_per_group * groups + 6 * 4  # + the 6x4 bool pattern table
    assert list(lm.state_dict()) == ["logits", "_extra_state"]  # the pattern table is not saved (its n, m are)


def test_bad_input_raises_and_changes_nothing():
    lm = LearnableMask((4, 8))
    before = lm.logits.detach().clone()
    bad_prior = torch.zeros(4, 8, dtype=torch.bool)
    bad_prior[:, 0] = True  # 1 kept per group: not exactly 2:4
    with pytest.raises(ValueError, match="exactly n=2"):
        lm.init_from_mask(bad_prior)
    with pytest.raises(ValueError, match="shape"):
        lm.init_from_mask(torch.ones(4, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        lm.init_from_mask(torch.ones(4, 8))
    with pytest.raises(ValueError, match="confidence"):
        lm.init_from_mask(mask_nm(torch.randn(4, 8), 2, 4), confidence=-1)
    assert torch.equal(lm.logits.detach(), before)
    with pytest.raises(ValueError, match="tau"):
        lm.sample(tau=0)
    with pytest.raises(ValueError, match="divisible by m=4"):
        LearnableMask((4, 6))
    with pytest.raises(ValueError, match="1 <= n < m"):
        LearnableMask((4, 8), n=4, m=4)
    with pytest.raises(TypeError, match="dtype"):
        LearnableMask((4, 8), dtype=torch.int32)

"""Review fixes for activation (gradient) checkpointing: learn_masks' Gumbel draws are the same when a
checkpointed forward is recomputed in backward, and hidden= under reentrant checkpointing (whose first
forward runs under no_grad, so the layer-wise term would train nothing) is refused with nothing changed."""
import copy

import pytest
import torch
from conftest import assert_model_unchanged, model_snapshot
from hf_models import tiny_llama, tokens
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from sparse24 import Sparse24Linear, sparsify_
from sparse24.learn import distill_, learn_masks


class Net(nn.Module):
    """A Linear, two residual MLP blocks run under ``checkpoint(use_reentrant=ckpt)`` (None: not
    checkpointed), a head. The first Linear is outside so a reentrant segment's input requires grad."""

    def __init__(self, ckpt=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 16)
        self.ckpt = ckpt

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + (b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt))
        return self.head(x)


def data(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def first_step_grads(run):
    """``run()``'s result and every gradient the optimizer held at its first step."""
    grads = []

    def grab(opt, args, kwargs):
        if not grads:
            grads.extend(p.grad.clone() for g in opt.param_groups for p in g["params"])
    handle = register_optimizer_step_pre_hook(grab)
    try:
        return run(), grads
    finally:
        handle.remove()


def assert_same_grads(grads, ref):
    """Equal up to rounding (the recomputation may sum in another order), relative to each tensor's largest."""
    assert len(grads) == len(ref) > 0 and all(r.abs().max() > 0 for r in ref)
    for g, r in zip(grads, ref):
        assert float((g - r).abs().max()) <= 1e-4 * float(r.abs().max())


def masks(model):
    return {n: m.mask.clone() for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


# --- 1. learn_masks: the recomputed forward draws the same masks ---------------------------------------------

def test_learn_masks_without_checkpointing_gives_the_numbers_from_before_the_fix():
    # Recorded before the fix (the draw order of the Gumbel noise is part of the seeded determinism promise).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    rep = learn_masks(model, data(), steps=6, lr=0.5, hard_fraction=0.5, min_features=0, check_batches=2, seed=5,
                      progress=False)
    pinned = [0.4144871234893799, 0.23793332278728485, 0.2517566978931427, 0.25026679039001465,
              0.19592830538749695, 0.17971330881118774]
    assert rep.losses == pytest.approx(pinned, rel=1e-6, abs=0)
    assert rep.learned_loss == pytest.approx(0.18040776252746582, rel=1e-6, abs=0)
    assert rep.prior_loss == pytest.approx(0.2947056293487549, rel=1e-6, abs=0)
    assert rep.layers == {"0": 0.125, "2": 0.171875}
    checksums = [int((m.mask.flatten().long() * torch.arange(m.mask.numel())).sum()) for m in (model[0], model[2])]
    assert checksums == [65409, 65412]


@pytest.mark.parametrize("reentrant", [False, True])
def test_learn_masks_under_checkpoint_trains_on_the_gradient_of_its_loss(reentrant):
    runs = {}
    for ckpt in (None, reentrant):
        model = Net(ckpt)
        rep, grads = first_step_grads(lambda: learn_masks(model, data(), steps=3, lr=0.5, hard_fraction=0.34,
                                                          min_features=0, check_batches=0, seed=2, progress=False))
        runs[ckpt] = (rep.losses, grads, masks(model))
    (losses, grads, final), (ref_losses, ref_grads, ref_final) = runs[reentrant], runs[None]
    assert len(ref_grads) >= 4
    assert_same_grads(grads, ref_grads)   # the same forward as the loss's, so the same gradient
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)


@pytest.mark.parametrize("reentrant", [False, True])
def test_learn_masks_hf_gradient_checkpointing(reentrant):
    batches = [{"input_ids": tokens(s, (2, 8))} for s in range(2)]
    runs = {}
    for ckpt in (None, reentrant):
        model = tiny_llama().train()
        if ckpt is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
        rep, grads = first_step_grads(lambda: learn_masks(model, batches, steps=1, min_features=0, check_batches=0,
                                                          progress=False))
        runs[ckpt] = (rep.losses, grads)
    assert_same_grads(runs[reentrant][1], runs[None][1])
    assert runs[reentrant][0] == pytest.approx(runs[None][0], rel=1e-5)


# --- 2. hidden= under reentrant checkpointing: refused before anything changes --------------------------------

def student_and_teacher(ckpt):
    teacher = Net().eval()
    student = Net(ckpt)
    student.load_state_dict(teacher.state_dict())
    sparsify_(student, min_features=0)
    return student, teacher


def test_distill_hidden_under_reentrant_checkpoint_is_refused_and_changes_nothing():
    student, teacher = student_and_teacher(True)
    snap = model_snapshot(student)
    with pytest.raises(ValueError, match=r"hidden='blocks\.0'.*use_reentrant=False.*activation_checkpointing_enable"):
        distill_(student, data(), steps=2, teacher=teacher, hidden=["blocks.0"], progress=False)
    assert_model_unchanged(student, snap)


def test_learn_masks_hidden_under_reentrant_checkpoint_is_refused_and_changes_nothing():
    model, teacher = Net(True), Net().eval()
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=r"hidden='blocks\.1'.*use_reentrant=False"):
        learn_masks(model, data(), steps=2, teacher=teacher, hidden=["blocks.1"], min_features=0, progress=False)
    assert_model_unchanged(model, snap)


def test_distill_hidden_under_non_reentrant_checkpoint_trains_the_hidden_term():
    # the output term switched off: only the layer-wise term gives gradients, the same as without checkpointing
    grads = {}
    for ckpt in (None, False):
        student, teacher = student_and_teacher(ckpt)
        _, grads[ckpt] = first_step_grads(lambda: distill_(
            student, data(), steps=1, teacher=teacher, hidden=["blocks.0"], output_loss=lambda s, t: (s * 0).sum(),
            clip=None, progress=False))
    # inp's and blocks.0's parameters get a gradient from it, the later ones none
    assert sum(float(g.abs().sum()) for g in grads[None]) > 0
    for g, r in zip(grads[False], grads[None]):
        assert float((g - r).abs().max()) <= 1e-4 * float(r.abs().max()) or not r.any() and not g.any()


def test_hidden_under_reentrant_checkpoint_is_fine_where_no_gradient_is_needed():
    # the prior-vs-learned check runs under no_grad: nothing to refuse there, nor for a hidden module outside
    model, teacher = Net(True), Net().eval()
    rep = learn_masks(model, data(), steps=2, teacher=teacher, hidden=["inp"], min_features=0, check_batches=1,
                      progress=False)
    assert rep.prior_loss is not None and len(rep.losses) == 2

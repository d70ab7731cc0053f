"""Review fix: the calls that train (learn_masks, distill_, the demo's train) run with autograd on whatever the
caller's grad mode: inside ``torch.no_grad()`` / ``torch.set_grad_enabled(False)`` (around a whole pruning
pipeline, or at the top of a script) they train as with autograd on, and give the caller's mode back; under
``torch.inference_mode()`` they are refused up front, naming the call and the cause, with nothing changed
(they failed at step 0 with torch's bare "element 0 of tensors does not require grad")."""
import contextlib
import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_model_unchanged, model_snapshot
from torch import nn

from sparse24 import sparsify_
from sparse24.learn import distill_, learn_masks
from sparse24.tools.demo import CharMLP, TrainConfig, train

MODES = {"grad on": contextlib.nullcontext, "no_grad": torch.no_grad,
         "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False)}


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).to(dtype)


def batches(n=2, dtype=torch.float64):
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + i), dtype=dtype) for i in range(n)]


def magnitude_mask(w: torch.Tensor) -> torch.Tensor:
    """The 2 largest |w| of every 4 consecutive weights along a row (plain torch)."""
    idx = w.abs().reshape(-1, 4).topk(2, dim=-1).indices
    return torch.zeros(w.numel() // 4, 4, dtype=torch.bool).scatter_(1, idx, True).reshape(w.shape)


def is_24(mask: torch.Tensor) -> bool:
    return bool((mask.reshape(-1, 4).sum(-1) == 2).all())


# --- distill_ against a plain-torch float64 loop -----------------------------------------------------------

def distill_reference(dense: nn.Sequential, xs: list, steps: int, lr: float):
    """The recovery recipe by hand: every Linear masked (W * M, M the magnitude 2:4 mask; a Sequential has
    no output head sparsify_ would keep dense), relative MSE to the dense model's output, AdamW at a constant
    lr (steps=2 with warmup=0.02 and final_lr=0: the warmup step and the cosine's first step are both lr)."""
    layers = [dense[0], dense[2], dense[4]]
    masks = [magnitude_mask(l.weight.detach()) for l in layers]
    ws = [nn.Parameter(l.weight.detach() * m) for l, m in zip(layers, masks)]
    bs = [nn.Parameter(l.bias.detach().clone()) for l in layers]
    opt = torch.optim.AdamW([p for pair in zip(ws, bs) for p in pair], lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x = xs[step % len(xs)]
        with torch.no_grad():
            t = dense(x)
        h = x
        for i, (w, b, m) in enumerate(zip(ws, bs, masks)):
            h = F.linear(h, w * m, b)
            h = F.relu(h) if i < 2 else h
        loss = (h - t).pow(2).sum() / t.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [w.detach() for w in ws], [b.detach() for b in bs], masks, losses


@pytest.mark.parametrize("mode", list(MODES))
def test_distill_under_any_grad_mode_trains_as_a_plain_torch_loop(mode):
    dense = mlp()
    student = copy.deepcopy(dense)
    sparsify_(student, min_features=1)
    xs = batches()
    ref_w, ref_b, ref_m, ref_losses = distill_reference(dense, xs, steps=2, lr=1e-2)
    before = torch.is_grad_enabled()
    with MODES[mode]():
        rep = distill_(student, xs, steps=2, teacher=dense, lr=1e-2, clip=None, progress=False)
        assert torch.is_grad_enabled() == (mode == "grad on")   # the caller's mode, given back
    assert torch.is_grad_enabled() == before
    # distill_ sums the relative MSE in float32 (n = 8 x 8 = 64 squares, twice: relative error < 2 n u32 = 8e-6);
    # the gradients inherit it, and each AdamW step is lr x a ratio of them (the weights move by ~2 lr = 2e-2
    # in all, and would not move at all if the steps were lost)
    assert rep.losses == pytest.approx(ref_losses, rel=1e-5)
    for i, layer in enumerate([student[0], student[2], student[4]]):
        assert torch.equal(layer.mask, ref_m[i])
        torch.testing.assert_close(layer.dense_weight().detach(), ref_w[i], rtol=0, atol=2e-2 * 1e-5)
        torch.testing.assert_close(layer.bias.detach(), ref_b[i], rtol=0, atol=2e-2 * 1e-5)


# --- learn_masks: trains inside no_grad as with autograd on -----------------------------------------------------

@pytest.mark.parametrize("train_weights", [False, True])
@pytest.mark.parametrize("mode", ["no_grad", "set_grad_enabled(False)"])
def test_learn_masks_under_no_grad_learns_the_masks_it_learns_with_autograd_on(mode, train_weights):
    def run(ctx):
        m = mlp()
        dense = [l.weight.detach().clone() for l in (m[0], m[2])]
        with ctx():
            mode_before = torch.is_grad_enabled()
            rep = learn_masks(m, batches(3), steps=6, lr=0.5, min_features=1, train_weights=train_weights,
                              weight_lr=1e-2, check_batches=0, progress=False)
            assert torch.is_grad_enabled() == mode_before   # the caller's mode, given back
        return m, dense, rep

    on, dense, rep_on = run(contextlib.nullcontext)
    off, _, rep_off = run(MODES[mode])
    assert len(rep_off.losses) == 6 and all(math.isfinite(v) for v in rep_off.losses)
    assert rep_off.losses == rep_on.losses
    for i, (a, b) in enumerate(((off[0], on[0]), (off[2], on[2]))):
        assert is_24(a.mask) and torch.equal(a.mask, b.mask)
        w = a.dense_weight().detach()
        assert torch.equal(w, b.dense_weight().detach())
        assert bool((w[~a.mask] == 0).all())
        if train_weights:   # kept weights trained (the step runs with autograd on)
            assert not torch.equal(w[a.mask], dense[i][a.mask])
        else:               # kept weights are the dense model's, exactly
            assert torch.equal(w, torch.where(a.mask, dense[i], torch.zeros((), dtype=torch.float64)))


# --- the demo's train: inside no_grad, as a plain torch loop -------------------------------------------------------

def test_demo_train_under_no_grad_trains_as_a_plain_torch_loop():
    torch.manual_seed(0)
    model = CharMLP(ctx=4, emb=4, hidden=16).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 101, (400,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    cfg = TrainConfig(steps=3, batch=8, lr=1e-2, warmup=2, weight_decay=0.01, seed=5)
    # the reference: AdamW, linear warmup times cosine, windows drawn from the seed
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    ref.train()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        starts = torch.randint(0, ids.numel() - 4 - 1, (cfg.batch,), generator=gen)
        win = ids[starts[:, None] + torch.arange(5)].long()
        loss = F.cross_entropy(ref(win[:, :4]), win[:, 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        train(model, ids, cfg, progress=False)
        assert not torch.is_grad_enabled()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=n)


# --- inference mode: refused up front, nothing changed -------------------------------------------------------------

def _learn(m):
    return learn_masks(m, batches(), steps=2, min_features=1, progress=False)


def _distill(m):
    sparsify_(m, min_features=1)   # (outside inference mode: a model one distils)
    return m


@pytest.mark.parametrize("call", ["learn_masks", "distill_", "train"])
def test_training_calls_under_inference_mode_are_refused_up_front(call):
    if call == "train":
        model = CharMLP(ctx=4, emb=4, hidden=16)
        ids = torch.randint(0, 101, (400,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
        run = lambda: train(model, ids, TrainConfig(steps=2, batch=8), progress=False)  # noqa: E731
    elif call == "distill_":
        model, teacher = _distill(mlp()), mlp()
        run = lambda: distill_(model, batches(), steps=2, teacher=teacher, progress=False)  # noqa: E731
    else:
        model = mlp()
        run = lambda: _learn(model)  # noqa: E731
    snap = model_snapshot(model)
    with torch.inference_mode():
        who = re.escape("sparse24.tools.demo.train" if call == "train" else call)
        with pytest.raises(RuntimeError, match=rf"^{who} trains .*torch\.inference_mode\(\).*nothing was changed"):
            run()
    assert_model_unchanged(model, snap)

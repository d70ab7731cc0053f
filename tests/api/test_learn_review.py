"""Review fixes for the training recipes: a Conv1D's optimizer state after a swap, SR-STE's decay under
loss scaling and gradient accumulation, float16 training refused up front, KL with logits that both models
rule out, and hidden= on modules returning a transformers ModelOutput."""
import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import EPS, assert_model_unchanged, model_snapshot
from torch import nn
from transformers import BertConfig, BertModel
from transformers.pytorch_utils import Conv1D

from sparse24 import prune_trained_model, sparsify_
from sparse24.format import mask_nm
from sparse24.learn import distill_, learn_masks
from sparse24.learn.objective import _distill_loss
from sparse24.masks import LearnableMask
from sparse24.recipes import SRSTE


# --- 1. a Conv1D's new weight Parameter takes over the old one's optimizer state ---------------------------

def conv1d_model_and_adam():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(48, 32), nn.GELU(), Conv1D(32, 48), nn.GELU(), nn.Linear(32, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_prune_trained_model_conv1d_leaves_no_stale_optimizer_state():
    model, opt = conv1d_model_and_adam()
    old = [model[0].weight, model[2].weight]
    prune_trained_model(model, opt, min_features=0)
    in_groups = [p for g in opt.param_groups for p in g["params"]]
    assert all(p not in opt.state for p in old)  # (nor kept alive: dense weight and moments)
    assert {id(p) for p in opt.state} == {id(p) for p in in_groups}
    sd = opt.state_dict()  # raised KeyError on the stale entry
    assert sorted(sd["state"]) == list(range(len(in_groups)))
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a checkpoint loads back
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[model[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


class FailingSecondSet(collections.defaultdict):
    """Optimizer state whose second new entry fails (as a Ctrl-C would): the swap must be undone."""

    def __init__(self, src):
        super().__init__(dict, src)
        self.sets = 0

    def __setitem__(self, k, v):
        self.sets += 1
        if self.sets == 2:
            raise KeyboardInterrupt("interrupted")
        super().__setitem__(k, v)


def test_failed_swap_gives_the_optimizer_its_old_state_back():
    model, opt = conv1d_model_and_adam()
    snap = model_snapshot(model, opt)
    objects = {p: dict(s) for p, s in opt.state.items()}
    opt.state = FailingSecondSet(opt.state)
    with pytest.raises(KeyboardInterrupt):
        sparsify_(model, min_features=0, optimizer=opt)
    assert_model_unchanged(model, snap, opt)  # the old Parameters in the groups, their state's values
    assert all(opt.state[p][k] is v for p, s in objects.items() for k, v in s.items())  # and its tensors
    opt.state_dict()


# --- 2. SR-STE's decay with GradScaler and gradient accumulation ---------------------------------------------

def srste_setup(decay=0.1):
    torch.manual_seed(0)
    lin = nn.Linear(16, 4, dtype=torch.float64)
    W0 = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    srste = SRSTE(nn.Sequential(lin), 2, 4, decay=decay, optimizer=opt, min_features=0)
    W = lin.parametrizations.weight.original
    seen = []  # the gradient optimizer.step() uses (step pre-hooks run in the order registered)
    opt.register_step_pre_hook(lambda o, a, k: seen.append(W.grad.clone()))
    xs = [torch.randn(8, 16, dtype=torch.float64) for _ in range(3)]
    gouts = [torch.randn(8, 4, dtype=torch.float64) for _ in range(3)]
    return lin, W0, opt, srste, seen, xs, gouts


def test_srste_decay_survives_gradscaler_unscale():
    lin, W0, opt, srste, seen, xs, gouts = srste_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scaler.scale((lin(xs[0]) * gouts[0]).sum()).backward()
    scaler.step(opt)  # unscale_, then optimizer.step()
    scaler.update()
    M = mask_nm(W0, 2, 4)
    ref = gouts[0].T @ xs[0] + 0.1 * (~M) * W0  # float64 by hand: straight-through g + decay on the pruned
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], ref)


def test_srste_decay_comes_once_per_step_with_accumulation():
    lin, W0, opt, srste, seen, xs, gouts = srste_setup()
    for x, g in zip(xs, gouts):
        (lin(x) * g).sum().backward()
    opt.step()
    M = mask_nm(W0, 2, 4)
    ref = sum(g.T @ x for x, g in zip(xs, gouts)) + 0.1 * (~M) * W0
    torch.testing.assert_close(seen[0], ref)
    srste.finalize()  # removes the hook: a plain step adds no decay
    opt.zero_grad()
    lin(xs[0]).sum().backward()
    g = lin.weight.grad.clone()
    opt.step()
    assert len(seen) == 2 and torch.equal(seen[1], g)


def test_srste_without_optimizer_keeps_the_decay_in_backward():
    torch.manual_seed(0)
    lin = nn.Linear(16, 4, dtype=torch.float64)
    W0 = lin.weight.detach().clone()
    SRSTE(nn.Sequential(lin), 2, 4, decay=0.1, min_features=0)
    x, g = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    (lin(x) * g).sum().backward()
    torch.testing.assert_close(lin.parametrizations.weight.original.grad,
                               g.T @ x + 0.1 * (~mask_nm(W0, 2, 4)) * W0)


def test_srste_optimizer_must_train_the_weights():
    lin, other = nn.Linear(16, 4), nn.Linear(4, 4)
    model = nn.Sequential(lin)
    with pytest.raises(ValueError, match="optimizer"):
        SRSTE(model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), min_features=0)
    with pytest.raises(TypeError, match="optimizer"):
        SRSTE(model, optimizer="sgd", min_features=0)
    assert type(model[0].weight) is nn.Parameter and not hasattr(model[0], "parametrizations")


# --- 3 and 4. float16 training refused before anything changes ----------------------------------------------

def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(dtype)


def test_distill_refuses_float16_weights_before_changing_anything():
    dense = mlp(torch.float16)
    student = copy.deepcopy(dense)
    sparsify_(student, min_features=0)
    before = copy.deepcopy(student.state_dict())
    with pytest.raises(TypeError, match="float16.*bfloat16.*autocast"):
        distill_(student, [torch.randn(16, 64).half()], 2, teacher=dense, progress=False)
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_learn_masks_train_weights_refuses_float16_weights_before_changing_anything():
    model = mlp(torch.float16)
    before = copy.deepcopy(model)
    with pytest.raises(TypeError, match="float16.*bfloat16.*autocast"):
        learn_masks(model, [torch.randn(16, 64).half()], steps=2, train_weights=True, min_features=0,
                    progress=False)
    assert [type(m) for m in model] == [type(m) for m in before]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))


def test_float16_logits_are_refused():
    model = mlp()
    with pytest.raises(TypeError, match="float16"):
        learn_masks(model, [torch.randn(16, 64)], steps=2, min_features=0, logits_dtype=torch.float16,
                    progress=False)
    assert type(model[0]) is nn.Linear
    with pytest.raises(TypeError, match="float16"):
        LearnableMask((8, 16), dtype=torch.float16)


# --- 5. KL with classes both models rule out ----------------------------------------------------------------

def test_kl_with_shared_neg_inf_logits_is_the_float64_reference():
    torch.manual_seed(0)
    s, t = torch.randn(4, 6), torch.randn(4, 6)
    s[:, -1] = t[:, -1] = -math.inf  # a class masked out in both models
    s[0, 2] = t[0, 2] = -math.inf
    s.requires_grad_(True)
    ps, pt = s.detach().double().softmax(-1), t.double().softmax(-1)
    ref = torch.where(pt > 0, pt * (pt.log() - ps.log()), 0).sum(-1).mean()  # 0 log 0 = 0
    got = _distill_loss("kl", s, t)
    torch.testing.assert_close(got, ref.float())
    got.backward()
    assert bool(torch.isfinite(s.grad).all()) and bool((s.grad[:, -1] == 0).all())


def test_kl_is_unchanged_on_finite_logits_and_infinite_where_the_student_drops_teacher_mass():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    before = F.kl_div(s.flatten(0, -2).log_softmax(-1), t.flatten(0, -2).log_softmax(-1), log_target=True,
                      reduction="batchmean")   # the previous formula
    torch.testing.assert_close(_distill_loss("kl", s, t), before)
    s[0, 0, 1] = -math.inf  # the teacher gives that class mass: a real divergence
    assert _distill_loss("kl", s, t).item() == math.inf
    t2 = t.clone()
    t2[0, 0, 1] = -math.inf  # only the teacher rules it out: adds nothing
    assert math.isfinite(_distill_loss("kl", t, t2).item())


def test_distill_kl_trains_a_classifier_with_a_disabled_class():
    class Clf(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(32, 8)

        def forward(self, x):
            return self.l(x).masked_fill(torch.arange(8) == 7, -math.inf)
    torch.manual_seed(0)
    dense = Clf()
    student = copy.deepcopy(dense)
    sparsify_(student, min_features=0)
    rep = distill_(student, [torch.randn(4, 32)], 2, teacher=dense, output_loss="kl", progress=False)
    assert all(math.isfinite(x) for x in rep.losses)


# --- 6. hidden= on a module returning a ModelOutput --------------------------------------------------------

def test_hidden_module_returning_a_model_output_uses_its_last_hidden_state():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)
    dense = BertModel(cfg).eval()
    student = copy.deepcopy(dense)
    sparsify_(student, min_features=0)
    batch = {"input_ids": torch.randint(0, 50, (2, 6))}
    seen = {}

    def keep(key):
        def hook(mod, args, out):
            seen[key] = out.last_hidden_state
        return hook
    handles = [m.encoder.register_forward_hook(keep(k)) for k, m in (("s", student), ("t", dense))]
    with torch.no_grad():
        student(**batch), dense(**batch)
    for h in handles:
        h.remove()
    hs, ht = seen["s"].double(), seen["t"].double()
    ref = ((hs - ht).pow(2).sum() / ht.pow(2).sum()).item()
    # hidden only (the output loss is 0): step 0's loss is the relative MSE of the encoders' last_hidden_state
    rep = distill_(student, [batch], 1, teacher=dense, hidden=["encoder"], output_loss=lambda s, t: s.sum() * 0,
                   progress=False)
    # float32 sums of n positive terms (numerator and denominator): n + 3 roundings each
    assert abs(rep.losses[0] - ref) <= 2 * (hs.numel() + 3) * EPS[torch.float32] * ref

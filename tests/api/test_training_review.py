"""Training-loop review findings: SR-STE's step-time decay with a fused optimizer under GradScaler and with
``optimizer.step(closure)``; an optimizer that steps GPT-2's orphaned Conv1D weights or holds a dense model's
(transposed) state; the recipes' layer selection on GPT-2 (tied head, Conv1D); zero- and identity-initialized
layers; averaged (EMA) copies. Each against an independent reference: float64 copies taken before the call,
masks from an independent sort."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear, is_nm, sparsify_
from sparse24.recipes import SRSTE, GradualPruner


def top2_mask(w: torch.Tensor) -> torch.Tensor:
    """Independent 2:4 magnitude mask of an (out, in) weight: a stable sort of each group of 4 inputs."""
    idx = torch.sort(w.abs().reshape(-1, 4), dim=-1, descending=True, stable=True).indices[:, :2]
    return torch.zeros(w.numel() // 4, 4, dtype=torch.bool).scatter_(-1, idx, True).view_as(w)


def tiny_gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_step(model, opt, seed=0):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(ids, labels=ids).loss.backward()
    opt.step()


CONV1D = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
          "transformer.h.0.mlp.c_proj"]


# --- 1. SRSTE(optimizer=) with a fused optimizer under GradScaler ----------------------------------------

def _srste_sgd(fused: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
    sr = SRSTE(model, 2, 4, decay=0.1, optimizer=opt, min_features=0)
    return model, opt, sr, sr.layers[0][1].parametrizations.weight.original


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_srste_decay_is_unscaled_with_grad_scaler(fused):
    """A fused optimizer unscales inside its step (GradScaler hands it grad_scale): the decay was added to
    the still-scaled gradient and divided by 65536 with it."""
    model, opt, sr, w = _srste_sgd(fused)
    w0 = w.detach().double().clone()
    pruned = ~top2_mask(w0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    opt.zero_grad()
    scaler.scale((model(torch.randn(4, 16)) * 0).sum()).backward()   # task gradient 0: only the decay moves W
    scaler.step(opt)
    scaler.update()
    ref = w0 - 1.0 * 0.1 * w0 * pruned                                # W <- W - lr * decay * (~M) * W
    torch.testing.assert_close(w.detach().double(), ref, rtol=1e-6, atol=1e-7)
    assert not hasattr(opt, "grad_scale")


def test_srste_fused_step_with_inf_gradient_is_still_skipped():
    model, opt, sr, w = _srste_sgd(True)
    w0 = w.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 16)).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), w0)            # found_inf: the step changed nothing
    assert scaler.get_scale() == 2.0 ** 15


# --- 2. SRSTE(optimizer=) with optimizer.step(closure) ---------------------------------------------------

@pytest.mark.parametrize("how", ["positional", "keyword", "lbfgs"])
def test_srste_decay_reaches_the_gradient_a_closure_computes(how):
    """The closure recomputes the gradient inside step, after the pre-hook had added the decay: dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).double()
    lbfgs = how == "lbfgs"
    opt = (torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=1) if lbfgs
           else torch.optim.SGD(model.parameters(), lr=1.0))
    sr = SRSTE(model, 2, 4, decay=0.1, optimizer=opt, min_features=0)
    w = sr.layers[0][1].parametrizations.weight.original
    w0 = w.detach().clone()
    pruned = ~top2_mask(w0)
    x = torch.randn(4, 16, dtype=torch.float64)

    def closure():
        opt.zero_grad()
        loss = (model(x) * 0).sum()          # task gradient 0
        loss.backward()
        return loss

    if how == "keyword":
        opt.step(closure=closure)
    else:
        opt.step(closure)
    assert torch.equal(w.grad, 0.1 * w0 * pruned)   # the closure's gradient plus the decay, once
    if not lbfgs:   # (LBFGS's first step is lr * min(1, 1/|g|_1) long)
        torch.testing.assert_close(w.detach(), w0 - 0.1 * w0 * pruned, rtol=0, atol=1e-15)
    else:
        assert not torch.equal(w.detach()[pruned], w0[pruned])


# --- 3. an optimizer built before sparsify_ steps GPT-2's orphaned Conv1D weights ------------------------

@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_optimizer_stepping_replaced_conv1d_weights_is_refused(named):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=1e-2)
    sparsify_(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"Conv1D.*new Parameter.*optimizer=.*after sparsify_") as e:
        gpt2_step(model, opt)
    if named:
        assert "'transformer.h.0.attn.c_attn.weight'" in str(e.value)
    sd = model.state_dict()
    assert all(torch.equal(before[k], sd[k]) for k in sd)   # the step was refused before changing anything
    assert not opt.state


@pytest.mark.parametrize("order", ["after", "optimizer="])
def test_optimizer_that_trains_the_new_conv1d_weights_steps(order):
    model = tiny_gpt2()
    if order == "after":
        sparsify_(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sparsify_(model, optimizer=opt)
    before = {f: model.get_submodule(f).weight.detach().clone() for f in CONV1D}
    gpt2_step(model, opt)
    for f in CONV1D:
        layer = model.get_submodule(f)
        assert not torch.equal(layer.weight, before[f]) and torch.equal(layer.weight != 0, layer.mask), f


# --- 4. the recipes on GPT-2: tied head skipped, Conv1D layers pruned along their inputs ------------------

def test_gradual_pruner_on_gpt2_prunes_the_conv1d_layers_not_the_tied_head():
    model = tiny_gpt2()
    ref = {f: model.get_submodule(f).weight.detach().double().t().clone() for f in CONV1D}  # (out, in)
    wte = model.transformer.wte.weight.detach().clone()
    pr = GradualPruner(model, (2, 4), start_step=0, end_step=1, frequency=1)
    assert [f for f, _ in pr.layers] == CONV1D
    assert "shared with transformer.wte.weight" in pr.skipped["lm_head"]
    pr.step(0)
    pr.step(1)
    assert torch.equal(model.transformer.wte.weight, wte)   # the embedding the head is tied to: untouched
    for f in CONV1D:
        w = model.get_submodule(f).weight.detach()           # Conv1D: (in, out)
        assert pr.masks[f].shape == ref[f].shape
        assert torch.equal(pr.masks[f], top2_mask(ref[f])), f
        torch.testing.assert_close(w.t().double(), ref[f] * top2_mask(ref[f]), rtol=0, atol=0)


def test_srste_on_a_conv1d_masks_along_the_inputs_and_finalizes():
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    conv = Conv1D(8, 16).double()                    # y = x @ W + b, W (in=16, out=8)
    w0 = conv.weight.detach().clone()
    mask = top2_mask(w0.t())                         # (out, in)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    sr = SRSTE(nn.Sequential(conv), 2, 4, decay=0.3, min_features=0)
    x = torch.randn(3, 16, dtype=torch.float64)
    r = torch.randn(3, 8, dtype=torch.float64)
    out = conv(x)
    torch.testing.assert_close(out, x @ (w0.t() * mask).t() + conv.bias, rtol=0, atol=1e-14)
    (out * r).sum().backward()
    orig = conv.parametrizations.weight.original
    torch.testing.assert_close(orig.grad, x.t() @ r + 0.3 * w0 * mask.t().logical_not(), rtol=0, atol=1e-13)
    opt.step()
    assert torch.equal(sr.current_masks()["0"], top2_mask(orig.detach().t()))
    masks = sr.finalize()
    assert masks["0"].shape == (8, 16) and is_nm(conv.weight.detach().t())


def test_recipes_skip_an_untied_output_head_by_default():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 40))
    pr = GradualPruner(model, (2, 4), start_step=0, end_step=1, frequency=1, min_features=0)
    assert [f for f, _ in pr.layers] == ["1"] and "output head" in pr.skipped["3"]
    whole = GradualPruner(model, 0.5, end_step=1, frequency=1, skip_output_head=False, min_features=0)
    assert [f for f, _ in whole.layers] == ["1", "3"] and whole.skipped == {}
    sr = SRSTE(model, min_features=0)
    assert [f for f, _ in sr.layers] == ["1"] and "output head" in sr.skipped["3"]


# --- 5. zero- and identity-initialized layers get a full 2:4 mask ---------------------------------------

@pytest.mark.parametrize("init", ["zeros", "eye"])
def test_sparsify_gives_a_fresh_zero_or_identity_layer_a_full_24_mask(init):
    lin = nn.Linear(64, 32).double()
    (nn.init.zeros_ if init == "zeros" else nn.init.eye_)(lin.weight)
    w0 = lin.weight.detach().clone()
    layer = Sparse24Linear.from_linear(lin)
    assert int(layer.mask.sum()) == w0.numel() // 2              # 2 of every 4, not 0 (or 1 per row)
    assert torch.equal(layer.mask & (w0 != 0), w0 != 0)          # every non-zero (the diagonal) kept
    assert is_nm(layer.mask.double(), 2, 4)
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ w0.t() + lin.bias.detach(), rtol=0, atol=1e-13)


def test_sparser_rows_keep_their_non_zeros_while_an_empty_row_is_filled():
    w = torch.randn(16, 64, dtype=torch.float64)
    keep1 = torch.zeros(16, 16, 4, dtype=torch.bool)
    keep1[..., 0] = True                                          # 1:4, the first of each group
    w = w.masked_fill(~keep1.view(16, 64), 0)
    w[3] = 0                                                      # one row of a pruned weight left all zero
    lin = nn.Linear(64, 16).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Sparse24Linear.from_linear(lin)
    nz = w != 0
    rows = torch.arange(16) != 3
    assert torch.equal(layer.mask[rows], nz[rows])                # 1:4 rows: exactly their non-zeros
    assert int(layer.mask[3].sum()) == 32                         # the empty row: a full 2:4 row


def test_sparser_note_counts_the_groups_a_mask_keeps_fewer_than_2_of():
    from sparse24.nn.prepare import sparser_note
    full = top2_mask(torch.randn(4, 16, dtype=torch.float64))
    assert sparser_note(full) == ""
    thin = full.clone()
    thin[0, :4] = torch.tensor([True, False, False, False])
    thin[2, 8:12] = False
    assert "fewer than 2 of 4 in 2 of 16 groups (29 of 64 weights)" in sparser_note(thin)


# --- 6. a dense GPT-2 optimizer state loaded after sparsify_ ---------------------------------------------

def _dense_checkpoint():
    """A dense GPT-2 after one Adam step, its optimizer, a copy of that one's state, and a fresh model holding
    its weights."""
    dense = tiny_gpt2()
    opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    gpt2_step(dense, opt)
    model = tiny_gpt2()
    model.load_state_dict(dense.state_dict())
    return dense, opt, copy.deepcopy(opt.state_dict()), model


def test_dense_conv1d_optimizer_state_loaded_after_sparsify_is_refused():
    _, _, saved, model = _dense_checkpoint()
    sparsify_(model)
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt2.load_state_dict(saved)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"optimizer state 'exp_avg' has shape \(32, 96\).*\(96, 32\)"
                                           r".*prune_trained_model"):
        gpt2_step(model, opt2)
    sd = model.state_dict()
    assert all(torch.equal(before[k], sd[k]) for k in sd)


def test_dense_optimizer_state_then_prune_trained_model_resumes():
    """The documented order: load the checkpoint into the dense model and its optimizer, then prune."""
    dense, opt, saved, model = _dense_checkpoint()
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt2.load_state_dict(saved)
    sparse24.prune_trained_model(model, opt2)
    for f in CONV1D:
        layer, old = model.get_submodule(f), dense.get_submodule(f).weight
        ref = opt.state[old]["exp_avg"].double().t() * layer.mask
        torch.testing.assert_close(opt2.state[layer.weight]["exp_avg"].double(), ref, rtol=0, atol=0)
    gpt2_step(model, opt2, seed=1)


# --- 7. averaged copies (the documented EMA) ------------------------------------------------------------

def test_ema_averaged_model_with_buffers_keeps_the_masks():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    sparsify_(model, min_features=0, skip_output_head=False)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    ref = None
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ema.update_parameters(model)
        w = model[0].weight.detach().double()
        ref = w.clone() if ref is None else 0.9 * ref + 0.1 * w
    torch.testing.assert_close(ema.module[0].weight.detach().double(), ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(ema.module[0].mask, model[0].mask) and ema.module[0].mask.dtype == torch.bool
    assert torch.equal(ema.module[0].weight != 0, model[0].mask)


def test_state_shapes_are_checked_again_after_a_later_load_only():
    # the check runs once per optimizer.state object (a load replaces it; steps only add right shapes)
    from sparse24.nn import masking
    _, _, saved, model = _dense_checkpoint()
    sparsify_(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gpt2_step(model, opt)
    assert masking._STATE_CHECKED.get(opt) == id(opt.state)
    gpt2_step(model, opt, seed=1)                      # (checked: no re-scan, and the step runs)
    opt.load_state_dict(saved)                          # the dense model's transposed moments, loaded later
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"optimizer state 'exp_avg' has shape"):
        gpt2_step(model, opt)
    sd = model.state_dict()
    assert all(torch.equal(before[k], sd[k]) for k in sd)

"""Learned masks and frozen-mask distillation on whole (toy) models: exact 2:4
results in Sparse24Linear masked layers, determinism, learning that beats its
prior on a problem built so the magnitude mask is wrong, the prior guard, the
memory figure, and bad input refused with nothing changed."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24 import Sparse24Linear, compress_, is_nm, sparsify_
from sparse24.learn import distill_, learn_masks


def teacher_and_data(seed=0, d=32, batches=6):
    """A dense MLP whose inputs have very unequal channel scales: the weights
    that matter most are not the largest ones, so the magnitude mask is a poor
    prior that learning can beat."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
    scale = torch.logspace(-1.5, 1, d)[torch.randperm(d)]
    data = [torch.randn(64, d) * scale for _ in range(batches)]
    return model, data


def output_loss(model, teacher, data):
    """Independent reference: the relative MSE of the outputs, summed over the batches."""
    with torch.no_grad():
        return sum(float((model(x) - teacher(x)).pow(2).sum() / teacher(x).pow(2).sum()) for x in data)


def layer_masks(model):
    return {fqn: m.mask.clone() for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def test_learned_masks_are_exact_24_in_masked_layers_and_beat_the_magnitude_prior():
    dense, data = teacher_and_data()
    prior_model = copy.deepcopy(dense)
    sparsify_(prior_model)
    model = copy.deepcopy(dense)
    rep = learn_masks(model, data, steps=60, lr=0.1, check_batches=0, seed=0)
    for fqn, m in model.named_modules():
        if isinstance(m, Sparse24Linear):
            assert m.mode == "masked" and is_nm(m.dense_weight(), 2, 4)
            assert torch.equal(m.mask.view(-1, 4).sum(-1), torch.full((m.mask.numel() // 4,), 2))  # every group
            # weights frozen: the kept weights are the dense ones, zero elsewhere
            assert torch.equal(m.weight.detach(), torch.where(m.mask, dense.get_submodule(fqn).weight.detach(), 0))
    assert len(rep.layers) == 2 and all(0 < v < 1 for v in rep.layers.values())  # some groups changed
    assert output_loss(model, dense, data) < 0.9 * output_loss(prior_model, dense, data)


def test_deterministic_under_a_seed():
    dense, data = teacher_and_data(1)
    runs = []
    for _ in range(2):
        model = copy.deepcopy(dense)
        rep = learn_masks(model, data, steps=12, lr=0.2, seed=3)
        runs.append((layer_masks(model), rep.losses))
    assert runs[0][1] == runs[1][1]
    assert all(torch.equal(runs[0][0][k], runs[1][0][k]) for k in runs[0][0])


def test_the_guard_restores_the_prior_when_the_learned_masks_are_worse():
    dense, data = teacher_and_data(2)
    teacher = copy.deepcopy(dense)
    phase = {"train": True}

    def loss_fn(out, batch):  # training rewards moving away from the teacher; the check judges closeness
        err = F.mse_loss(out, teacher(batch))
        return -err if phase["train"] else err

    def cb(step, loss):
        phase["train"] = step < 19

    model = copy.deepcopy(dense)
    rep = learn_masks(model, data, steps=20, loss_fn=loss_fn, lr=0.3, callback=cb)
    prior = copy.deepcopy(dense)
    sparsify_(prior)
    assert rep.kept == "prior" and rep.learned_loss > rep.prior_loss
    assert all(torch.equal(v, layer_masks(prior)[k]) for k, v in layer_masks(model).items())


def test_report_memory_and_what_stays_usable():
    dense, data = teacher_and_data(3)
    model = copy.deepcopy(dense)
    rep = learn_masks(model, data, steps=3, logits_dtype=torch.bfloat16)
    groups = sum(m.mask.numel() // 4 for m in model.modules() if isinstance(m, Sparse24Linear))
    assert rep.logit_bytes == 6 * 2 * groups  # 6 bf16 logits per group of 4 weights, nothing else per group
    assert "learned over 3 steps" in str(rep)
    x = data[0]
    y = model(x)
    fresh = copy.deepcopy(dense)
    sparsify_(fresh)  # a checkpoint of the learned model loads into any masked 2:4 copy of the architecture
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), y)
    compress_(model)  # the learned masks live in ordinary Sparse24Linear layers
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_prior_from_sparsegpt_keeps_its_rebuilt_weights_and_weights_can_train():
    dense, data = teacher_and_data(4)
    from sparse24 import calibrate
    stats = calibrate(dense, data, hessian=True)
    ref = copy.deepcopy(dense)
    sparsify_(ref, method="sparsegpt", calibration=stats)
    model = copy.deepcopy(dense)
    learn_masks(model, data, steps=1, lr=1e-9, prior="sparsegpt", calibration=stats, check_batches=0)
    for (fqn, m), r in zip(layer_masks(model).items(), layer_masks(ref).values()):
        assert torch.equal(m, r)  # a tiny step changes no pattern: SparseGPT's model exactly
        assert torch.equal(model.get_submodule(fqn).weight, ref.get_submodule(fqn).weight)
    model = copy.deepcopy(dense)
    learn_masks(model, data, steps=5, train_weights=True, weight_lr=1e-2)
    for fqn, m in model.named_modules():
        if isinstance(m, Sparse24Linear):
            assert is_nm(m.dense_weight(), 2, 4)
            kept = m.mask
            assert not torch.equal(m.weight[kept], dense.get_submodule(fqn).weight[kept])  # trained


def test_bad_input_raises_and_changes_nothing():
    dense, data = teacher_and_data(5)
    before = copy.deepcopy(dense)
    for kwargs, err, msg in [({"steps": 0}, ValueError, "steps"), ({"prior": "best"}, ValueError, "prior"),
                             ({"tau": (1.0, 0.0)}, ValueError, "tau"), ({"lr": -1}, ValueError, "lr"),
                             ({"hard_fraction": 2}, ValueError, "hard_fraction"),
                             ({"output_loss": "l1"}, ValueError, "output_loss"),
                             ({"hidden": ["nope"]}, ValueError, "hidden modules"),
                             ({"loss_fn": 3}, TypeError, "loss_fn"), ({"confidence": -1}, ValueError, "confidence"),
                             ({"logits_dtype": torch.int8}, TypeError, "logits_dtype"),
                             ({"noise": (1.0, -1.0)}, ValueError, "noise"), ({"clip": 0}, ValueError, "clip")]:
        kw = {"steps": 2, **kwargs}
        with pytest.raises(err, match=msg):
            learn_masks(dense, data, **kw)
        assert all(type(m) is type(b) for m, b in zip(dense.modules(), before.modules()))
        assert all(torch.equal(p, q) for p, q in zip(dense.parameters(), before.parameters()))
    for empty in ([], iter([])):
        with pytest.raises(ValueError, match="batches is empty"):
            learn_masks(dense, empty, steps=2)
    with pytest.raises(TypeError, match="iterable of batches"):
        learn_masks(dense, data[0], steps=2)
    assert all(type(m) is type(b) for m, b in zip(dense.modules(), before.modules()))
    sparse = copy.deepcopy(dense)
    sparsify_(sparse)
    with pytest.raises(ValueError, match="pass teacher="):
        learn_masks(sparse, data, steps=2)
    with pytest.raises(ValueError, match="ran out after 2"):
        learn_masks(copy.deepcopy(dense), iter(data[:2]), steps=3)


def test_masked_model_with_a_teacher_learns_from_its_mask():
    dense, data = teacher_and_data(6)
    model = copy.deepcopy(dense)
    sparsify_(model)  # already 2:4: the teacher supplies the pruned weights
    prior = layer_masks(model)
    learn_masks(model, data, steps=40, lr=0.1, teacher=dense, check_batches=0)
    after = layer_masks(model)
    assert any(not torch.equal(prior[k], after[k]) for k in prior)
    for fqn, m in model.named_modules():
        if isinstance(m, Sparse24Linear):  # newly kept weights come from the teacher's layer
            assert torch.equal(m.weight.detach(), torch.where(m.mask, dense.get_submodule(fqn).weight.detach(), 0))


def test_distill_trains_with_masks_frozen_and_layerwise_losses():
    dense, data = teacher_and_data(7)
    student = copy.deepcopy(dense)
    sparsify_(student)
    masks = layer_masks(student)
    before = output_loss(student, dense, data)
    rep = distill_(student, data, steps=40, teacher=dense, lr=3e-3, hidden=["1"], hidden_weight=0.5)
    assert len(rep.losses) == 40 and rep.losses[-1] < rep.losses[0]
    assert output_loss(student, dense, data) < 0.7 * before
    for k, m in layer_masks(student).items():
        assert torch.equal(m, masks[k]) and is_nm(student.get_submodule(k).dense_weight(), 2, 4)
    assert not student[1]._forward_hooks and not dense[1]._forward_hooks  # hooks removed
    with pytest.raises(ValueError, match="nothing to train on"):
        distill_(student, data, steps=1)
    with pytest.raises(ValueError, match="warmup"):
        distill_(student, data, steps=1, teacher=dense, warmup=2)


def test_distill_refuses_itself_as_teacher_leaks_no_hook_and_ignores_stale_gradients():
    dense, data = teacher_and_data(7)
    student = copy.deepcopy(dense)
    sparsify_(student)
    state = {k: v.clone() for k, v in student.state_dict().items()}
    for teacher in (student, nn.Sequential(*student)):  # itself, or its very layers (loss 0: nothing trained)
        with pytest.raises(ValueError, match="teacher shares parameters with the model"):
            distill_(student, data, steps=2, teacher=teacher)
        with pytest.raises(ValueError, match="teacher shares parameters with the model"):
            learn_masks(student, data, steps=2, teacher=teacher)
    with pytest.raises(ValueError, match="weight_decay"):  # torch's optimizer refuses it: no hook left behind
        distill_(student, data, steps=2, teacher=dense, hidden=["0"], weight_decay=-0.1)
    assert not student[0]._forward_hooks and not dense[0]._forward_hooks
    assert all(torch.equal(v, student.state_dict()[k]) for k, v in state.items())
    # gradients on the model before the call do not enter the first step
    runs = []
    for stale in (False, True):
        s = copy.deepcopy(student)
        if stale:
            (s(data[0]).sum() * 1000).backward()
        distill_(s, data, steps=1, teacher=dense, lr=1e-2)
        runs.append(s.state_dict())
    assert all(torch.equal(v, runs[1][k]) for k, v in runs[0].items())
    # and no gradient is left behind: parameters not trained (outside parameters=, or every weight of
    # learn_masks without train_weights) held the sum of every step's
    s = copy.deepcopy(student)
    distill_(s, data, steps=3, teacher=dense, parameters=[s[0].weight])
    assert all(p.grad is None for p in s.parameters())
    s = copy.deepcopy(dense)
    learn_masks(s, data, steps=3)
    assert all(p.grad is None for p in s.parameters())


def test_learning_without_noise_and_distillation_under_cpu_bf16_autocast():
    """What scripts/eval_minilm.py runs: mask learning with the noise off (the softmax relaxation, hard
    draws at the end) and distillation, both inside torch.autocast(bf16) on CPU. Weights, logits and masks
    stay fp32 / exact 2:4, the masks stay frozen while distilling, and the result (judged in fp32) beats
    the magnitude prior."""
    dense, data = teacher_and_data()
    prior_model = copy.deepcopy(dense)
    sparsify_(prior_model)
    model = copy.deepcopy(dense)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rep = learn_masks(model, data, steps=60, lr=0.1, noise=0.0, check_batches=0, seed=0)
        masks = layer_masks(model)
        distill_(model, data, steps=20, teacher=dense, lr=3e-3)
    assert all(0 < v < 1 for v in rep.layers.values())
    for fqn, m in layer_masks(model).items():
        layer = model.get_submodule(fqn)
        assert layer.weight.dtype == torch.float32 and is_nm(layer.dense_weight(), 2, 4)
        assert torch.equal(m, masks[fqn])
    assert output_loss(model, dense, data) < 0.9 * output_loss(prior_model, dense, data)


def test_kl_and_cosine_output_losses():
    dense, data = teacher_and_data(8)
    for kind in ("kl", "cosine"):
        student = copy.deepcopy(dense)
        sparsify_(student)
        rep = distill_(student, data, steps=20, teacher=dense, lr=3e-3, output_loss=kind)
        assert rep.losses[-1] < rep.losses[0]
    x = torch.randn(5, 7)
    from sparse24.learn.objective import _distill_loss
    assert float(_distill_loss("kl", x, x)) == pytest.approx(0.0, abs=1e-6)
    ref = (F.softmax(x, -1) * (F.log_softmax(x, -1) - F.log_softmax(2 * x, -1))).sum(-1).mean()
    assert float(_distill_loss("kl", 2 * x, x)) == pytest.approx(float(ref), rel=1e-5)
    assert float(_distill_loss("cosine", x, 3 * x)) == pytest.approx(0.0, abs=1e-6)


def test_output_head_stays_dense_unless_asked():
    def lm():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64))
    data = [torch.randint(0, 64, (4, 8)) for _ in range(2)]
    model = lm()
    learn_masks(model, data, steps=2)
    assert type(model[3]) is nn.Linear and isinstance(model[1], Sparse24Linear)
    model = lm()
    learn_masks(model, data, steps=2, skip_output_head=False)
    assert isinstance(model[3], Sparse24Linear) and is_nm(model[3].dense_weight())


def test_a_non_finite_loss_fails_the_call_and_puts_the_model_back():
    # NaN from step 2 on trained every weight to NaN and reported the prior as kept (nan <= nan is False)
    dense, data = teacher_and_data(3)
    for call in ("learn", "distill"):
        model = copy.deepcopy(dense)
        if call == "distill":
            sparsify_(model)
        before = copy.deepcopy(model.state_dict())
        calls = [0]

        def loss_fn(out, batch):
            calls[0] += 1
            return out.pow(2).mean() * (float("nan") if calls[0] >= 3 else 1.0)
        with pytest.raises(FloatingPointError, match="the loss is nan"):
            if call == "learn":
                learn_masks(model, data, steps=6, loss_fn=loss_fn, train_weights=True)
            else:
                distill_(model, data, steps=6, loss_fn=loss_fn)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_prior_guard_scores_both_masks_on_the_same_batches_of_an_iterator():
    # with an iterator the check drew fresh batches for each mask (and failed when exactly `steps`
    # were given): identical masks were judged apart by batch noise
    dense, data = teacher_and_data(4, batches=3)
    model = copy.deepcopy(dense)
    rep = learn_masks(model, iter(data), steps=3, teacher=dense, lr=1e-9, check_batches=2)
    assert rep.learned_loss == rep.prior_loss and rep.kept == "learned"   # the same masks, the same batches
    assert all(v == 0 for v in rep.layers.values())

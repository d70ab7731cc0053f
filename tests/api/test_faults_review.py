"""Whole-model calls stay all or nothing when the failure (an exception, or KeyboardInterrupt: Ctrl-C)
comes late: while sparsify_ / prune_trained_model prune the shared weights in place, while learn_masks
writes the learned masks back, while densify_ releases the layers, after compress_ / decompress_ switched
every layer, in the transformers config update, before distill_ / learn_masks start training. The model
(module tree, values, gradients, hooks, masking registries, config) and the optimizer are as before, and
the model trains as an untouched copy does."""
import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import sparse24
import sparse24.hf  # (sparse24.hf is imported lazily: the config tests patch it)
from sparse24 import Sparse24Linear
from sparse24._rollback import TensorBackup
from sparse24.api import swap
from sparse24.learn import objective
from sparse24.masks import LearnableMask
from sparse24.nn import masking

from conftest import assert_model_unchanged, model_snapshot
from hf_models import tiny_llama

HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def mlp(seed=0, hook=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    if hook:
        model[2].register_forward_hook(lambda *a: None)
    return model


def snapshot(model, optimizer=None) -> dict:
    """model_snapshot plus what it leaves out: hook tables, masking registries, tensor hooks."""
    snap = model_snapshot(model, optimizer)
    snap["extra"] = extra(model)
    return snap


def extra(model) -> dict:
    owners = {}
    for n, p in model.named_parameters():
        ref = masking._GRAD_HOOKED.get(p)
        owners[n] = None if ref is None else ref()
    return {"hooks": {n: {t: list(getattr(m, t).items()) for t in HOOK_TABLES} for n, m in model.named_modules()},
            "masked": [m in masking._MASKED_MODULES for m in model.modules()],
            "owners": owners,
            "tensor_hooks": {n: len(p._backward_hooks or {}) for n, p in model.named_parameters()},
            "attrs": {n: sorted(vars(m)) for n, m in model.named_modules()}}


def assert_unchanged(model, snap, optimizer=None):
    assert_model_unchanged(model, snap, optimizer)
    assert extra(model) == snap["extra"]


def assert_trains_like(model, reference, x):
    """One SGD step (momentum, weight decay) gives the same loss and weights as on the untouched copy:
    no gradient or optimizer step is masked that was not before, none left unmasked that was."""
    results = []
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5, momentum=0.9,
                              weight_decay=0.1)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        results.append((loss.detach(), [p.detach().clone() for p in m.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def raise_on_call(monkeypatch, owner, name, k, exc=KeyboardInterrupt, after=False):
    """``owner.name`` raises ``exc`` on its k-th call (0-based): before running, or just after (``after``)."""
    real = getattr(owner, name)
    calls = []

    def wrapper(*a, **kw):
        calls.append(1)
        if len(calls) == k + 1 and not after:
            raise exc("injected")
        out = real(*a, **kw)
        if len(calls) == k + 1:
            raise exc("injected")
        return out
    monkeypatch.setattr(owner, name, wrapper)


X = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))


# --- 1. sparsify_ / prune_trained_model: the in-place pruning is part of the undoable section ---------------

@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_sparsify_interrupted_while_pruning_in_place_changes_nothing(monkeypatch, k, after, exc):
    model = mlp()
    model(X).pow(2).mean().backward()  # mid accumulation: the gradients are pruned in place too
    snap, before = snapshot(model), copy.deepcopy(model)
    raise_on_call(monkeypatch, Sparse24Linear, "_finish", k, exc, after)
    with pytest.raises(exc, match="injected"):
        sparse24.sparsify_(model, skip_output_head=False)
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert_trains_like(model, before, X)
    report = sparse24.sparsify_(model, skip_output_head=False)  # a retry swaps every layer
    assert [r.action for r in report.layers] == ["swapped"] * 3


@pytest.mark.parametrize("where", ["_after_change", "_entry"])
def test_sparsify_failing_after_the_last_layer_changes_nothing(monkeypatch, where):
    model = mlp()
    snap, before = snapshot(model), copy.deepcopy(model)
    raise_on_call(monkeypatch, swap, where, {"_after_change": 0, "_entry": 2}[where], after=True)
    with pytest.raises(KeyboardInterrupt):
        sparse24.sparsify_(model, skip_output_head=False)
    monkeypatch.undo()
    assert_unchanged(model, snap)  # the load_state_dict pre-hook guard_loading added is gone too
    assert_trains_like(model, before, X)


class WithConv1D(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 64)
        self.conv = Conv1D(64, 64)  # a new (transposed) weight Parameter: the optimizer gets it and its state

    def forward(self, x):
        return self.conv(torch.relu(self.fc(x)))


@pytest.mark.parametrize("where, k, after", [("_finish", 0, True), ("_finish", 1, False), ("_finish", 1, True),
                                             ("_after_change", 0, True)])
def test_prune_trained_model_interrupted_leaves_model_and_optimizer_state(monkeypatch, where, k, after):
    model = WithConv1D()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(X).pow(2).mean().backward()
    opt.step()
    model(X).pow(2).mean().backward()  # and a gradient mid accumulation
    snap = snapshot(model, opt)
    owner = Sparse24Linear if where == "_finish" else swap
    raise_on_call(monkeypatch, owner, where, k, after=after)
    with pytest.raises(KeyboardInterrupt):
        sparse24.prune_trained_model(model, opt, skip_output_head=False, min_features=16)
    monkeypatch.undo()
    assert_unchanged(model, snap, opt)
    report = sparse24.prune_trained_model(model, opt, skip_output_head=False, min_features=16)
    assert report.operation == "prune_trained_model" and len(report.changed) == 2
    for m in (model.fc, model.conv):
        assert all(bool((v[~m.mask] == 0).all()) for v in opt.state[m.weight].values() if v.dim() == 2)


def hf_state(model) -> dict:
    return {"model": dict(vars(model)), "config": dict(vars(model.config)),
            "config_dict": model.config.to_dict(),
            "quantizer": None if getattr(model, "hf_quantizer", None) is None else dict(vars(model.hf_quantizer))}


@pytest.mark.parametrize("already", [False, True])
def test_sparsify_failing_in_the_transformers_config_update_leaves_the_config(monkeypatch, already):
    model = tiny_llama()
    if already:  # a sparse24 section and quantizer exist: they stay as they were (the same objects)
        sparse24.sparsify_(model, filter_fn=lambda m, fqn: "mlp" in fqn)
    snap, config = snapshot(model), hf_state(model)
    raise_on_call(monkeypatch, sparse24.hf, "attach", 0, after=True)
    with pytest.raises(KeyboardInterrupt):
        sparse24.sparsify_(model)
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert hf_state(model) == config
    assert hasattr(model.config, "quantization_config") == already


# --- 2. learn_masks on a masked model: the write-back is undone --------------------------------------------

@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", [1, 2])
def test_learn_masks_write_back_failure_leaves_the_masked_model_as_it_was(monkeypatch, k, exc):
    teacher = mlp(hook=False)
    model = copy.deepcopy(teacher)
    sparse24.sparsify_(model, min_features=16, skip_output_head=False)
    snap, before = snapshot(model), copy.deepcopy(model)
    raise_on_call(monkeypatch, LearnableMask, "hard_mask", k, exc)  # the write-back of layer k (of 3)
    batches = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with pytest.raises(exc) as err:
        sparse24.learn_masks(model, batches, steps=10, lr=0.5, teacher=teacher, check_batches=0, progress=False)
    monkeypatch.undo()
    assert "the model is as it was" in " ".join(err.value.__notes__)
    assert_unchanged(model, snap)
    assert_trains_like(model, before, X)


# --- 3. distill_ / learn_masks with hidden=: no hook outlives the call -------------------------------------

def run_hidden(fn, model, teacher):
    batches = [torch.randn(8, 64)]
    if fn == "distill_":
        return sparse24.distill_(model, batches, steps=2, teacher=teacher, hidden=["2"], progress=False)
    return sparse24.learn_masks(model, batches, steps=2, teacher=teacher, hidden=["2"], check_batches=0,
                                min_features=16, skip_output_head=False, progress=False)


@pytest.mark.parametrize("where", ["rollback copy", "closing after the last step"])
@pytest.mark.parametrize("fn", ["distill_", "learn_masks"])
def test_interrupted_training_calls_leak_no_hidden_output_hooks(monkeypatch, fn, where):
    teacher = mlp(hook=False)
    model = copy.deepcopy(teacher)
    sparse24.sparsify_(model, min_features=16, skip_output_head=False)
    snap, t_snap = snapshot(model), snapshot(teacher)
    if where == "rollback copy":  # Ctrl-C while the trained parameters are copied aside
        raise_on_call(monkeypatch, TensorBackup, "keep", 0)
    else:  # after training, while the hooks are removed: the call fails, so the model is put back too
        raise_on_call(monkeypatch, objective._Objective, "close", 0)
    with pytest.raises(KeyboardInterrupt):
        run_hidden(fn, model, teacher)
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert_unchanged(teacher, t_snap)
    run_hidden(fn, model, teacher)  # and a clean call leaves no hook either
    assert not model[2]._forward_hooks and not teacher[2]._forward_hooks


# --- 4. densify_: the release is undone with the swaps ---------------------------------------------------

@pytest.mark.parametrize("where, k", [("_release", 1), ("_release", 2), ("_after_change", 0)])
def test_densify_interrupted_while_releasing_changes_nothing(monkeypatch, where, k):
    model = mlp()
    sparse24.sparsify_(model, skip_output_head=False)
    snap, before = snapshot(model), copy.deepcopy(model)
    raise_on_call(monkeypatch, Sparse24Linear if where == "_release" else swap, where, k, after=where != "_release")
    with pytest.raises(KeyboardInterrupt):
        sparse24.densify_(model)
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert_trains_like(model, before, X)  # still 2:4 and masked, as before: the same training step
    sparse24.densify_(model)
    assert not any(m in masking._MASKED_MODULES for m in model.modules())


# --- 5. compress_ / decompress_: the report and the config update are inside the undoable section ---------

@pytest.mark.parametrize("where", ["_after_change", "_entry"])
@pytest.mark.parametrize("call", ["compress_", "decompress_"])
def test_mode_switch_failing_after_the_switches_changes_nothing(monkeypatch, call, where):
    model = mlp()
    sparse24.sparsify_(model, skip_output_head=False, mode="masked" if call == "compress_" else "compressed")
    snap, modes = snapshot(model), [m.mode for m in model.modules() if isinstance(m, Sparse24Linear)]
    raise_on_call(monkeypatch, swap, where, 0, after=True)
    with pytest.raises(KeyboardInterrupt):
        getattr(sparse24, call)(model)
    monkeypatch.undo()
    assert_unchanged(model, snap)
    assert [m.mode for m in model.modules() if isinstance(m, Sparse24Linear)] == modes


def test_a_failed_training_call_leaves_the_load_state_dict_pre_hooks_as_they_were():
    model = mlp()
    handle = model.register_load_state_dict_pre_hook(lambda *a: None)
    snap = snapshot(model)

    def stop(step, loss):
        raise RuntimeError("stop")
    with pytest.raises(RuntimeError, match="stop"):
        sparse24.learn_masks(model, [torch.randn(8, 64)], steps=3, callback=stop, check_batches=0,
                             skip_output_head=False, progress=False)
    assert_unchanged(model, snap)  # guard_loading's pre-hook is not left behind
    handle.remove()  # the user's handle still removes the user's hook
    assert not model._load_state_dict_pre_hooks

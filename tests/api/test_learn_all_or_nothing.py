"""learn_masks and distill_ are all or nothing: a failure injected at each stage (building the
learnable masks, any training step, a batch the model cannot run, the final check) leaves the
model exactly as it was (module objects, parameters, buffers, requires_grad, no leftover masking
of gradients or optimizer steps), and the error notes the step and the batch."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear, sparsify_
from sparse24.learn import distill_, learn_masks, learned_masks

from conftest import assert_model_unchanged, fail_on_call, model_snapshot
from hf_models import tiny_llama, tokens


def net(seed=0):
    """Linears around a BatchNorm in train mode (its running statistics move on every forward)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 32))


def data(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 32, generator=gen) for _ in range(n)]


def fail_at(step):
    def callback(s, loss):
        if s == step:
            raise RuntimeError(f"injected failure at step {step}")
    return callback


def notes(err) -> str:
    return " | ".join(getattr(err.value, "__notes__", []))


def assert_trains_like(model, reference, batch):
    """After a failed call the model trains as its untouched copy does: no gradient masked, no
    optimizer step re-zeroing weights a 2:4 mask would have pruned."""
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(batch).pow(2).sum().backward()
        opt.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), n


STAGES = [("mask", 0), ("mask", 2), ("step", 0), ("step", 3), ("step", 5), ("batch", 2), ("check", 0)]


@pytest.mark.parametrize("train_weights", [False, True])
@pytest.mark.parametrize("stage, k", STAGES)
def test_learn_masks_fails_at_any_stage_and_changes_nothing(monkeypatch, stage, k, train_weights):
    model, batches = net(), data()
    before = copy.deepcopy(model)
    snap = model_snapshot(model)
    kw = {"steps": 6, "lr": 0.1, "train_weights": train_weights, "check_batches": 2}
    if stage == "mask":  # building the k-th layer's learnable mask (after the prior's swaps)
        fail_on_call(monkeypatch, learned_masks, "LearnableMask", k)
    elif stage == "step":
        kw["callback"] = fail_at(k)
    elif stage == "batch":  # the model cannot run batches[2], first drawn at step 2
        batches[k] = torch.randn(16, 31)
    else:  # comparing the learned and prior masks on the check batches
        def check(*a, **kw2):
            raise RuntimeError("injected failure in the check")
        monkeypatch.setattr(learned_masks, "_mean_loss", check)
    with pytest.raises(RuntimeError) as err:
        learn_masks(model, batches, **kw)
    monkeypatch.undo()
    assert_model_unchanged(model, snap)
    assert not any(isinstance(m, Sparse24Linear) for m in model.modules())
    assert "the model is as it was before the call" in notes(err)
    if stage in ("step", "batch"):
        assert f"learn_masks: failed at step {k} of 6, on batches[{k % 4}]" in notes(err)  # 4 batches, cycled
    assert_trains_like(model, before, batches[0])
    rep = learn_masks(model, data(), steps=2)  # and it still works
    assert len(rep.layers) == 3


def test_learn_masks_on_a_masked_model_with_a_teacher_keeps_its_masks_on_failure():
    dense, batches = net(), data()
    model = copy.deepcopy(dense)
    sparsify_(model)
    snap = model_snapshot(model)
    with pytest.raises(RuntimeError, match="injected failure at step 4"):
        learn_masks(model, batches, steps=8, lr=0.3, teacher=dense, train_weights=True, callback=fail_at(4))
    assert_model_unchanged(model, snap)
    with pytest.raises(RuntimeError, match="injected failure at step 1"):  # an iterator: no index to give
        learn_masks(model, iter(batches * 2), steps=8, teacher=dense, callback=fail_at(1))
    assert_model_unchanged(model, snap)


def test_learn_masks_on_a_transformers_model_fails_and_leaves_model_and_config_as_they_were():
    model = tiny_llama()
    config = model.config.to_dict()
    snap = model_snapshot(model)
    batches = [tokens(i, (2, 8)) for i in range(3)]
    with pytest.raises(RuntimeError, match="injected failure at step 2") as err:
        learn_masks(model, batches, steps=4, callback=fail_at(2))
    assert "learn_masks: failed at step 2 of 4, on batches[2]" in notes(err)
    assert_model_unchanged(model, snap)
    assert model.config.to_dict() == config and "quantization_config" not in model.config.to_dict()
    assert getattr(model, "hf_quantizer", None) is None
    learn_masks(model, batches, steps=2)  # and it still works: the config records the 2:4 layers
    assert model.config.quantization_config.quant_method == "sparse24"


@pytest.mark.parametrize("k", [0, 3])
def test_distill_fails_at_any_step_and_changes_nothing(k):
    dense, batches = net(), data(3)
    model = copy.deepcopy(dense)
    sparsify_(model)
    snap = model_snapshot(model)
    with pytest.raises(RuntimeError, match=f"injected failure at step {k}") as err:
        distill_(model, batches, steps=6, teacher=dense, lr=1e-2, callback=fail_at(k))
    assert f"distill_: failed at step {k} of 6, on batches[{k % 3}]" in notes(err)
    assert_model_unchanged(model, snap)
    broken = batches[:2] + [torch.randn(16, 31)]
    with pytest.raises(RuntimeError) as err:  # a batch the model cannot run, first drawn at step 2
        distill_(model, broken, steps=6, teacher=dense, lr=1e-2)
    assert "distill_: failed at step 2 of 6, on batches[2]" in notes(err)
    assert_model_unchanged(model, snap)
    distill_(model, batches, steps=2, teacher=dense, lr=1e-2)  # and it still trains, masks frozen
    assert all(sparse24.is_nm(m.dense_weight()) for m in model.modules() if isinstance(m, Sparse24Linear))


def test_learn_masks_failing_leaves_no_hook_on_a_parent_reading_a_weight_directly():
    # its sparsify_ puts a pre-hook on the attention (it reads out_proj.weight): a failure left it behind
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.out = nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 32)

        def forward(self, x):
            return self.out(self.attn(x[:, None], x[:, None], x[:, None])[0][:, 0])
    torch.manual_seed(0)
    model = Attn()
    snap = model_snapshot(model)
    with pytest.raises(RuntimeError, match="injected failure at step 1"):
        learn_masks(model, data(), steps=4, callback=fail_at(1))
    assert_model_unchanged(model, snap)


def test_learn_masks_refuses_a_model_with_nothing_to_learn():
    # every layer compressed: it returned "0 layer(s) learned over 0 steps", the reason only in the report
    dense, batches = net(), data()
    model = copy.deepcopy(dense)
    sparsify_(model)
    sparse24.compress_(model, quantize="int8")
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match="no layer to learn: .*compressed mode"):
        learn_masks(model, batches, steps=5, teacher=dense)
    assert_model_unchanged(model, snap)

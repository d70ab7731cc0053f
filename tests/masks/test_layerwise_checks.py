"""prune_layerwise_ checks every batch against every layer before it prunes anything (on a
transformers BertModel the pooler reads one row per sequence under a (B, L) token mask), and a
failure at any later stage puts every weight back."""
import copy
import sys

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from sparse24 import is_nm
from sparse24.masks import calibrate, prune_layerwise_

from conftest import assert_model_unchanged, fail_on_call, model_snapshot, top2_mask

layerwise = sys.modules["sparse24.masks.calibrate"]  # the package's `calibrate` attribute is the function


def tiny_bert(seed=0):
    cfg = BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(seed)
    return BertModel(cfg).eval()  # with its pooler: dense over the first token of each sequence


def padded_batches(n=2, B=4, L=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(2, L + 1, (B,), generator=gen)
        mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": torch.randint(3, 96, (B, L), generator=gen) * mask, "attention_mask": mask})
    return out


def inputs_of(model, name, batches, keep=None):
    """Rows the layer ``name`` reads over ``batches`` (those ``keep(batch)`` marks, if given), via a hook."""
    rows = []

    def hook(mod, args):
        x = args[0].detach()
        rows.append(x[keep[0]] if keep[0] is not None and x.shape[:-1] == keep[0].shape else x.reshape(-1, x.shape[-1]))
    keep = [None] if keep is None else keep
    h = model.get_submodule(name).register_forward_pre_hook(hook)
    with torch.no_grad():
        for b in batches:
            if len(keep) == 2:
                keep[0] = keep[1](b).bool()
            model(**b)
    h.remove()
    return torch.cat(rows).double()


def test_bert_pooler_is_calibrated_on_every_sequence_and_padding_is_left_out():
    model, batches = tiny_bert(), padded_batches()
    dense = copy.deepcopy(model)
    stats = calibrate(dense, batches, token_mask=lambda b: b["attention_mask"])  # one pass: the same rule
    assert stats["pooler.dense"].count == 8 and stats["encoder.layer.0.attention.self.query"].count == int(
        sum(b["attention_mask"].sum() for b in batches))
    res = prune_layerwise_(model, batches, method="wanda", token_mask=lambda b: b["attention_mask"])
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert list(res) == linears and "pooler.dense" in res and all(is_nm(model.get_submodule(n).weight) for n in linears)
    # Independent reference: the final model feeds each layer what the pruned layers before it give
    # (a layer's input does not depend on itself or on later layers); Wanda keeps the top-2 |W_ij| ||x_j||.
    for name, keep in [("pooler.dense", None), ("encoder.layer.1.output.dense", [None, lambda b: b["attention_mask"]])]:
        x = inputs_of(model, name, batches, keep)
        assert x.shape[0] == (8 if name == "pooler.dense" else int(sum(b["attention_mask"].sum() for b in batches)))
        w0 = dense.get_submodule(name).weight.detach().double()
        want = top2_mask(w0.abs() * x.pow(2).sum(0).sqrt())
        assert torch.equal(model.get_submodule(name).weight.detach() != 0, want)


def test_a_token_mask_that_does_not_fit_a_later_batch_is_refused_before_anything_changes():
    model, batches = tiny_bert(), padded_batches(3)
    snap = model_snapshot(model)
    bad = lambda b: b["attention_mask"][:, :-1] if b is batches[2] else b["attention_mask"]  # noqa: E731
    with pytest.raises(ValueError, match=r"batch 2: token_mask gave shape \(4, 7\) but layer "
                                         r"'encoder.layer.0.attention.self.query' reads an input of shape \(4, 8, 64\)"
                                         r".*nothing was changed"):
        prune_layerwise_(model, batches, method="wanda", token_mask=bad)
    assert_model_unchanged(model, snap)
    with pytest.raises(ValueError, match=r"batch 1: .*input_ids"):  # a batch the model cannot run
        prune_layerwise_(model, [batches[0], {"input_ids": None}], method="wanda")
    with pytest.raises(ValueError, match=r"received no input rows.*nothing was changed"):
        prune_layerwise_(model, batches, method="wanda", token_mask=lambda b: torch.zeros_like(b["attention_mask"]))
    assert_model_unchanged(model, snap)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)).double()


def count_calls(monkeypatch, name, run):
    calls = []
    real = getattr(layerwise, name)
    monkeypatch.setattr(layerwise, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    run()
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("teacher", [False, True])
@pytest.mark.parametrize("stage", ["calibrate", "prune_nm"])
def test_a_failure_at_any_stage_leaves_every_weight_as_it_was(monkeypatch, stage, teacher):
    """`calibrate` runs the check pass (one call per batch, the teacher's on the first batch) and one
    pass per layer; `prune_nm` runs once per layer. A failure injected at each call puts back every weight."""
    batches = [torch.randn(40, 16, dtype=torch.float64) for _ in range(2)]
    kw = {"method": "sparsegpt", "refit": True}
    run = lambda model: prune_layerwise_(model, batches, teacher=mlp() if teacher else None, **kw)  # noqa: E731
    n = count_calls(monkeypatch, stage, lambda: run(mlp()))
    assert n == (3 if stage == "prune_nm" else 2 + teacher + 3)
    for k in range(n):
        model = mlp()
        snap = model_snapshot(model)
        fail_on_call(monkeypatch, layerwise, stage, k)
        with pytest.raises(RuntimeError, match=f"injected failure at call {k}") as err:
            run(model)
        monkeypatch.undo()
        assert_model_unchanged(model, snap)
        notes = " | ".join(err.value.__notes__)
        if stage == "prune_nm" or k >= 2 + teacher:  # past the check pass: i layers were pruned and restored
            i = k if stage == "prune_nm" else k - 2 - teacher
            where = f"layer '{'024'[i]}'" if stage == "prune_nm" else f"the calibration pass of layer(s) ['{'024'[i]}']"
            assert f"prune_layerwise_: failed at {where} (the {i} layer(s) pruned before were restored" in notes
        else:
            assert "failed in the check before pruning (nothing was changed)" in notes
    run(model)  # and it still works afterwards
    assert all(is_nm(model[i].weight) for i in (0, 2, 4))


def test_without_rollback_a_failure_leaves_the_layers_pruned_before(monkeypatch):
    batches = [torch.randn(40, 16, dtype=torch.float64)]
    model = mlp()
    snap = model_snapshot(model)
    fail_on_call(monkeypatch, layerwise, "prune_nm", 1)
    with pytest.raises(RuntimeError, match="injected failure at call 1") as err:
        prune_layerwise_(model, batches, method="wanda", rollback=False)
    assert "rollback=False: the 1 layer(s) pruned before stay pruned" in " | ".join(err.value.__notes__)
    assert is_nm(model[0].weight) and not torch.equal(model[0].weight, snap["state"]["0.weight"])
    assert torch.equal(model[2].weight, snap["state"]["2.weight"])  # the failing layer: untouched

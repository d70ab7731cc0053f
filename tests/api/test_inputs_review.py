"""Inputs refused at the door (review round 4): an empty example proves no permutation group,
non-Modules where a model is due, numpy batches, a teacher whose output shape differs from the
student's, bools as search sizes. Each refusal names the argument and changes nothing."""
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24 import bits_per_char, calibrate, embedding_fidelity, prune_layerwise_, search_permutation, \
    sentence_embeddings
from sparse24.learn import distill_, learn_masks
from sparse24.masks import PermutationGroup, check_group, find_permutation_groups, group_importance, permute_model_

from conftest import assert_unchanged, state


def mlp(seed=0, d=16, h=32, out=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, out))


# --- bug 2: an empty example proves nothing --------------------------------------------------------

class EmptyHead(nn.Module):
    """An MLP whose output keeps no feature: any permutation leaves ``(B, 0)`` unchanged."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x)[:, :0]


def test_an_empty_example_is_refused_by_every_door_and_changes_nothing():
    model = mlp()
    x = torch.randn(8, 16)
    wrong = PermutationGroup(consumers=["0"], producers=["2"])   # not exact: output rows with input columns
    assert not check_group(model, wrong, x)                      # (the reference: 8 rows see it)
    before = state(model)
    for empty in (x[:0], (x[:0],), {"input": x[:0]}):
        with pytest.raises(ValueError, match="example.*0 elements"):
            check_group(model, wrong, empty)
        with pytest.raises(ValueError, match="example.*0 elements"):
            find_permutation_groups(model, empty)
        with pytest.raises(ValueError, match="example.*0 elements"):
            permute_model_(model, [wrong], example=empty, max_iters=5)
    assert_unchanged(model, before)
    # a non-empty input whose outputs hold nothing cannot tell a permutation either
    head = EmptyHead()
    before = state(head)
    with pytest.raises(ValueError, match="outputs.*no element"):
        check_group(head, PermutationGroup(["body.0"], ["body.2"]), x)
    with pytest.raises(ValueError, match="outputs.*no element"):
        find_permutation_groups(head, x)
    with pytest.raises(ValueError, match="outputs.*no element"):
        permute_model_(head, [PermutationGroup(["body.0"], ["body.2"])], example=x, max_iters=5)
    assert_unchanged(head, before)
    # the ordinary case still works
    assert [(g.producers, g.consumers) for g in find_permutation_groups(model, x)] == [(["0"], ["2"])]


# --- bug 4: a model that is not one -----------------------------------------------------------------

class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 8)

    def forward(self, input_ids=None, attention_mask=None):
        return self.e(input_ids)


def test_embedding_fidelity_takes_numpy_reference_embeddings():
    torch.manual_seed(0)
    enc, ref_enc = Enc().eval(), Enc().eval()
    batches = [dict(input_ids=torch.randint(0, 10, (3, 5)), attention_mask=torch.ones(3, 5, dtype=torch.long))]
    ref_np = sentence_embeddings(ref_enc, batches).numpy()     # what sentence-transformers' encode() returns
    # independent reference: float64 mean pooling and cosines
    def pooled(e):
        return F.normalize(e.e.weight.detach().double()[batches[0]["input_ids"]].mean(1), dim=-1)
    want = float((pooled(enc) * pooled(ref_enc)).sum(-1).mean())
    assert embedding_fidelity(enc, batches, ref_np) == pytest.approx(want, abs=1e-6)
    assert embedding_fidelity(enc, batches, ref_np) == pytest.approx(embedding_fidelity(enc, batches, ref_enc), abs=1e-7)
    with pytest.raises(TypeError, match="reference must be"):
        embedding_fidelity(enc, batches, "path/to/model")
    with pytest.raises(ValueError, match="reference embeddings have shape"):
        embedding_fidelity(enc, batches, ref_np[:2])


def test_a_model_that_is_not_a_module_is_a_type_error_naming_it():
    batches = [torch.randint(0, 10, (2, 5))]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        sentence_embeddings("path/to/model", batches)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got ndarray"):
        embedding_fidelity(np.zeros((2, 8)), batches, Enc())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        bits_per_char(None, torch.randint(0, 8, (100,)), 8, 2)
    model = mlp()
    group = PermutationGroup(["2"], ["0"])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        check_group("m", group, torch.randn(4, 16))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        permute_model_(None, [group], example=torch.randn(4, 16))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        group_importance(None, group)
    with pytest.raises(TypeError, match="group must be a PermutationGroup, got list"):
        check_group(model, [group], torch.randn(4, 16))
    with pytest.raises(TypeError, match="group must be a PermutationGroup, got str"):
        group_importance(model, "2")
    with pytest.raises(ValueError, match="consumer '2' is not an nn.Linear of the model"):
        group_importance(nn.Sequential(nn.ReLU()), group)   # was KeyError '2'
    # the reference: |W| of the consumer
    assert torch.equal(group_importance(model, group), model[2].weight.detach().double().abs())


# --- bug 7: numpy batches -----------------------------------------------------------------------------

class KwMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, scale=1.0):
        return self.net(x * scale)


def test_numpy_batches_are_refused_naming_the_batch_and_other_containers_still_work():
    x = torch.randn(8, 16)
    xn = x.numpy()
    with pytest.raises(TypeError, match=r"batch 0 is a numpy.ndarray"):
        calibrate(mlp(), [xn], progress=False)
    with pytest.raises(TypeError, match=r"batch 1 is a numpy.ndarray"):
        calibrate(mlp(), [x, xn], progress=False)
    with pytest.raises(TypeError, match=r"batch 0\[0\] is a numpy.ndarray"):
        calibrate(mlp(), [(xn,)], progress=False)
    with pytest.raises(TypeError, match=r"batch 0\['x'\] is a numpy.ndarray"):
        calibrate(KwMLP(), [{"x": xn}], progress=False)
    for method in ("magnitude", "sparsegpt"):
        model = mlp()
        before = state(model)
        with pytest.raises(TypeError, match=r"batch 1 is a numpy.ndarray"):
            prune_layerwise_(model, [x, xn], method=method, progress=False)
        assert_unchanged(model, before)
    # tensors, tuples and dicts (with a non-tensor keyword) keep working; reference: float64 sums of squares
    want = (x.double() ** 2).sum(0)
    for model, batch in ((mlp(), x), (mlp(), (x,)), (mlp(), [x]), (KwMLP(), {"x": x, "scale": 1.0})):
        stats = calibrate(model, [batch], progress=False)
        first = "net.0" if isinstance(model, KwMLP) else "0"
        torch.testing.assert_close(stats[first].sq_sum, want)
    model = KwMLP()
    prune_layerwise_(model, [{"x": x, "scale": 1.0}], method="magnitude", progress=False)
    assert (model.net[0].weight == 0).float().mean() == 0.5


def test_a_layer_called_on_something_else_than_a_tensor_is_named():
    class ListIn(nn.Module):   # hands a Python list to its Linear
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x.tolist())
    with pytest.raises(TypeError, match="layer 'lin' was called on a list"):
        calibrate(ListIn(), [torch.randn(2, 4)], progress=False)
    model = ListIn()
    before = state(model)
    with pytest.raises(TypeError, match="layer 'lin' was called on a list"):
        prune_layerwise_(model, [torch.randn(2, 4)], method="magnitude", progress=False)
    assert_unchanged(model, before)


# --- bug 8: a teacher of another output shape; bools as sizes ----------------------------------------

def test_a_teacher_with_another_output_shape_is_a_value_error_naming_both():
    torch.manual_seed(0)
    data = [torch.randn(8, 32) for _ in range(2)]
    student, teacher = mlp(0, d=32, h=64, out=12), mlp(1, d=32, h=64, out=10)   # (learn_masks: in_features >= 32)
    before = state(student)
    with pytest.raises(ValueError, match=r"\(8, 10\).*\(8, 12\)"):
        distill_(student, data, steps=2, teacher=teacher, progress=False)
    assert_unchanged(student, before)
    with pytest.raises(ValueError, match=r"\(8, 10\).*\(8, 12\)"):
        learn_masks(student, data, steps=2, teacher=teacher, progress=False)
    assert_unchanged(student, before)
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential) for m in student.modules())
    # a loss of its own may compare other shapes (e.g. the first 10 logits)
    rep = distill_(student, data, steps=1, teacher=teacher, output_loss=lambda s, t: F.mse_loss(s[:, :10], t),
                   progress=False)
    assert len(rep.losses) == 1


@pytest.mark.parametrize("kw", [dict(max_iters=True), dict(window=True), dict(tenure=False),
                                dict(round_iters=True), dict(time_limit=True), dict(time_limit=math.inf),
                                dict(time_limit=-1.0), dict(time_limit=math.nan), dict(seed=True),
                                dict(max_iters=2.0)])
def test_bools_and_non_finite_limits_are_refused(kw):
    (name,) = kw
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match=name):
        search_permutation(w, progress=False, **{"max_iters": 5, **kw})   # (inf alone never stopped)
    if name in ("window", "tenure", "round_iters"):
        return   # (not arguments of permute_model_)
    model = mlp()
    before = state(model)
    with pytest.raises(ValueError, match=name):
        permute_model_(model, [PermutationGroup(["2"], ["0"])], **{"max_iters": 5, **kw})
    assert_unchanged(model, before)


def test_permute_model_by_default_does_not_depend_on_the_machine_speed(monkeypatch):
    # its default stopped each search at 10 s: a busy machine got another permutation
    from sparse24.masks import permutation
    groups = [PermutationGroup(["2"], ["0"])]
    fast, slow = mlp(d=64, h=128, out=64), mlp(d=64, h=128, out=64)
    permute_model_(fast, groups, max_iters=40, progress=False)
    clock = iter(range(0, 10 ** 9, 7))     # every clock read 7 s later: past 10 s within two steps
    monkeypatch.setattr(permutation.time, "perf_counter", lambda: float(next(clock)))
    permute_model_(slow, groups, max_iters=40, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(fast.parameters(), slow.parameters()))
    assert not torch.equal(fast[0].weight, mlp(d=64, h=128, out=64)[0].weight)   # it did permute
    with pytest.raises(ValueError, match="time_limit=None .* needs max_iters"):
        search_permutation(torch.randn(8, 32), time_limit=None, max_iters=None)

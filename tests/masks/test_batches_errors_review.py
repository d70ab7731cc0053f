"""Batches and errors of the user's own types: a namedtuple batch (a tuple, run as ``model(*batch)``)
moved to a device or copied in float64, an exception class of the user's model with its own
constructor passing through ``prune_layerwise_`` unchanged, and the checks on a checkpoint's shard
files and on ``hidden_weight``."""
import collections
import copy
import math
import sys

import pytest
import torch
from torch import nn

from sparse24 import find_permutation_groups
from sparse24._checks import safetensors_headers, with_context
from sparse24.learn.objective import _Objective
from sparse24.masks import calibrate, prune_layerwise_

from conftest import assert_model_unchanged, model_snapshot

permute_model = sys.modules["sparse24.masks.permute_model"]
layerwise = sys.modules["sparse24.masks.calibrate"]  # the package's `calibrate` attribute is the function

Batch = collections.namedtuple("Batch", "x scale")


class Scaled(nn.Module):
    """a -> relu -> b -> relu -> c, on ``x * scale``: both fields of a Batch are read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x, scale):
        return self.c(torch.relu(self.b(torch.relu(self.a(x * scale)))))


def batches(n=2):
    gen = torch.Generator().manual_seed(1)
    return [Batch(torch.randn(6, 16, generator=gen), torch.rand(16, generator=gen) + 0.5) for _ in range(n)]


def test_calibrate_with_device_runs_namedtuple_batches_as_model_star_batch():
    model, data = Scaled(), batches()
    stats = calibrate(model, data, device="cpu")
    with torch.no_grad():  # plain torch: each layer's input rows
        xa = torch.cat([b.x * b.scale for b in data])
        xb = torch.relu(model.a(xa))
        xc = torch.relu(model.b(xb))
    for name, x in (("a", xa), ("b", xb), ("c", xc)):
        torch.testing.assert_close(stats[name].sq_sum, x.double().pow(2).sum(0))
        assert stats[name].count == x.shape[0]


def test_prune_layerwise_with_device_prunes_on_namedtuple_batches():
    model, data = Scaled(), batches()
    ref = copy.deepcopy(model).double()
    prune_layerwise_(model, data, method="wanda", device="cpu", filter_fn=lambda mod, fqn: fqn in ("a", "b"))
    with torch.no_grad():  # float64 Wanda: |W| * ||x_j|| over the inputs of the layers pruned before, top 2 of 4
        x = torch.cat([b.x * b.scale for b in data]).double()
        for name in ("a", "b"):
            layer = getattr(ref, name)
            score = (layer.weight.abs() * x.pow(2).sum(0).sqrt()).reshape(-1, 4)
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.argsort(1, descending=True)[:, :2], True)
            layer.weight.mul_(keep.view(layer.weight.shape))
            x = torch.relu(layer(x))
    for name in ("a", "b"):
        w = getattr(model, name).weight.detach()
        assert torch.equal(w != 0, getattr(ref, name).weight != 0)
        torch.testing.assert_close(w.double(), getattr(ref, name).weight, rtol=0, atol=0)
    assert torch.equal(model.c.weight, Scaled().c.weight)  # left out by filter_fn


def test_namedtuple_batch_helpers_keep_the_type_and_every_field():
    b = Batch(torch.randn(2, 4), torch.arange(4))
    moved = layerwise._to_device(b, "cpu")
    assert type(moved) is Batch and torch.equal(moved.x, b.x) and torch.equal(moved.scale, b.scale)
    doubled = permute_model._double(b)
    assert type(doubled) is Batch and doubled.x.dtype == torch.float64 and torch.equal(doubled.x, b.x.double())
    assert doubled.scale.dtype == torch.int64  # only floating tensors become float64
    assert permute_model._double([b.x, (b.x,)])[1][0].dtype == torch.float64  # lists and plain tuples as before


def test_find_permutation_groups_takes_a_namedtuple_example():
    groups = find_permutation_groups(Scaled(), batches(1)[0])
    assert [(g.producers, g.consumers) for g in groups] == [(["a"], ["b"]), (["b"], ["c"])]


class ShapeError(ValueError):
    """A user's error whose constructor takes other arguments than a message."""

    def __init__(self, got, want):
        super().__init__(f"got {got} features, want {want}")
        self.got, self.want = got, want


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        if x.shape[-1] != 16:
            raise ShapeError(x.shape[-1], 16)
        return self.b(self.a(x))


def test_prune_layerwise_passes_the_models_own_exception_through_unchanged():
    model = Checked()
    snap = model_snapshot(model)
    with pytest.raises(ShapeError) as err:
        prune_layerwise_(model, [torch.randn(4, 16), torch.randn(4, 12)], method="wanda")
    assert (err.value.got, err.value.want) == (12, 16)  # the same object, with its attributes
    assert str(err.value) == "got 12 features, want 16"
    assert "prune_layerwise_: batch 1 failed in the check before pruning (nothing was changed)" in err.value.__notes__
    assert_model_unchanged(model, snap)


def test_with_context_rewords_plain_errors_and_notes_subclasses():
    plain = ValueError("bad shape")
    new = with_context(plain, "layer 'fc': bad shape", "layer 'fc'")
    assert type(new) is ValueError and str(new) == "layer 'fc': bad shape" and new.__cause__ is plain
    own = ShapeError(3, 4)
    assert with_context(own, "layer 'fc': ...", "layer 'fc'") is own and own.__notes__ == ["layer 'fc'"]
    err = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")  # a TypeError(str) would fail to build
    assert with_context(err, "m", "n") is err


def test_safetensors_headers_names_a_missing_shard_and_a_folder(tmp_path):
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors does not exist: the checkpoint names it"):
        safetensors_headers([tmp_path / "model-00002-of-00002.safetensors"])
    (tmp_path / "shard.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"shard.safetensors is not a file") as err:
        safetensors_headers([tmp_path / "shard.safetensors"])
    assert "truncated" not in str(err.value)
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match=r"cut.safetensors as a safetensors file \(truncated, or not one\)"):
        safetensors_headers([tmp_path / "cut.safetensors"])


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, True, "1"])
def test_the_objective_itself_refuses_a_bad_hidden_weight(bad):
    # (distill_ and learn_masks check it first; the objective they share holds the same rule)
    teacher = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match="hidden_weight must be a finite number >= 0"):
        _Objective(copy.deepcopy(teacher), teacher, None, "mse", ["0"], bad)
    assert _Objective(copy.deepcopy(teacher), teacher, None, "mse", ["0"], 2).hidden_weight == 2.0

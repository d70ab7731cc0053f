"""Data-parallel calibration: 2 gloo processes, each with part of the calibration batches, get the
statistics, masks and weights of one process with all of them (fp64)."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparse24
from sparse24.masks import calibrate, prune_layerwise_

from distributed import spawn

WORLD = 2
# uneven shares: rank 0 gets batches 0, 2, 4 (36 rows), rank 1 gets 1, 3 (16 rows)
BATCHES = [torch.randn(n, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
           for i, n in enumerate((12, 7, 10, 9, 14))]


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).double()


def run(batches, group=None):
    """Teacher statistics, layer-wise SparseGPT fit to a teacher with refit, and Wanda masks."""
    model = build()
    stats = calibrate(model, batches, teacher=build(), group=group)
    pruned = build()
    fit = prune_layerwise_(pruned, batches, method="sparsegpt", teacher=build(), refit=True, group=group)
    wanda = build()
    sparse24.sparsify_(wanda, method="wanda", calibration=calibrate(wanda, batches, group=group), min_features=0,
                       skip_output_head=False)
    return {"stats": {k: (s.count, s.sq_sum, s.xtx, s.xtx_teacher) for k, s in stats.items()},
            "fit": {k: (r.mask, r.weight) for k, r in fit.items()},
            "wanda": {k: v for k, v in wanda.state_dict().items() if k.endswith("mask")}}


def _worker(rank):
    out = run(BATCHES[rank::WORLD], group=dist.group.WORLD)
    every = [None] * WORLD
    dist.all_gather_object(every, out)
    return every


def test_ranks_with_parts_of_the_data_equal_one_with_all():
    every = spawn(_worker, WORLD)
    ref = run(BATCHES)
    assert len(ref["stats"]) == 3 and len(ref["fit"]) == 3 and len(ref["wanda"]) == 3
    for out in every:  # every rank holds the same result
        for fqn, (count, *sums) in ref["stats"].items():
            assert out["stats"][fqn][0] == count == sum(b.shape[0] for b in BATCHES)
            for got, want in zip(out["stats"][fqn][1:], sums):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # fp64 sums in another order
        for fqn, (mask, weight) in ref["fit"].items():
            assert torch.equal(out["fit"][fqn][0], mask), fqn
            torch.testing.assert_close(out["fit"][fqn][1], weight, rtol=1e-9, atol=1e-12)
        for k, mask in ref["wanda"].items():
            assert torch.equal(out["wanda"][k], mask), k
    # one rank's own share alone gives other statistics: the sums did cross the processes
    alone = calibrate(build(), BATCHES[::WORLD])
    assert alone["0"].count != ref["stats"]["0"][0]


def test_group_needs_an_initialized_process_group():
    model, before = build(), copy.deepcopy(build().state_dict())
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        calibrate(model, BATCHES, group=object())
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        prune_layerwise_(model, BATCHES, group=object())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _one_rank_fails(rank):
    """Rank 1 alone has bad input; every rank must raise (not wait in a collective) and stay in step."""
    group, out = dist.group.WORLD, {}
    wrong_width = [torch.randn(4, 15, dtype=torch.float64)]
    cases = {"calibrate: a batch of the wrong width": (calibrate, wrong_width),
             "prune_layerwise_: a batch of the wrong width": (prune_layerwise_, wrong_width),
             "prune_layerwise_: no batches": (prune_layerwise_, [])}
    for name, (call, bad) in cases.items():
        model_before = build().state_dict()
        try:
            call(build(), bad if rank == 1 else BATCHES[rank::WORLD], group=group)
            out[name] = "returned"
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            out[name] = f"{type(e).__name__}: {e}"
        assert all(torch.equal(v, model_before[k]) for k, v in build().state_dict().items())
    step = torch.ones(1)
    dist.all_reduce(step)  # the ranks are still in step: the next collective meets
    out["next collective"] = float(step)
    every = [None] * WORLD
    dist.all_gather_object(every, out)
    return every


class Routed(nn.Module):
    """A branch per batch (an MoE expert, a conditional path): b runs on some batches, c on others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(16, 16).double() for _ in range(3))

    def forward(self, x, route):
        h = self.a(x)
        return self.b(h) if route else self.c(h)


def _routed_batches(routes):
    return [(torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)), r)
            for i, r in enumerate(routes)]


def test_a_layer_the_first_batch_does_not_run_is_refused():
    # b ran on batch 1 only: its statistics were there, but the layer list came from batch 0 and b
    # was left dense without a word (then sparsify_ pruned it by magnitude)
    model = Routed()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"layer\(s\) \['b'\] run on later batches but not on the first"):
        prune_layerwise_(model, _routed_batches([False, True]), method="wanda")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _ranks_route_apart(rank):
    model = Routed()
    before = copy.deepcopy(model.state_dict())
    try:
        prune_layerwise_(model, _routed_batches([bool(rank)] * 2), method="wanda", group=dist.group.WORLD)
        out = "returned"
    except ValueError as e:
        out = str(e)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    every = [None] * WORLD
    dist.all_gather_object(every, out)
    return every


def test_ranks_pruning_different_layers_are_refused_on_every_rank():
    # rank 0 pruned [a, c], rank 1 [a, b]: the widths matched, so rank 0's c took rank 1's b statistics
    for out in spawn(_ranks_route_apart, WORLD, timeout=60):
        assert "run different layers or orders" in out, out


def test_a_check_failing_on_one_rank_raises_on_every_rank():
    rank0, rank1 = spawn(_one_rank_fails, WORLD, timeout=60)  # without the agreement rank 0 waited: timeout
    for name in ("calibrate: a batch of the wrong width", "prune_layerwise_: a batch of the wrong width",
                 "prune_layerwise_: no batches"):
        assert rank0[name].startswith("RuntimeError: ") and "failed on rank(s) [1] of the process group" in rank0[name]
        assert "failed on rank(s)" not in rank1[name] and rank1[name] != "returned", rank1[name]
    assert "batches is empty" in rank1["prune_layerwise_: no batches"]
    assert rank0["next collective"] == rank1["next collective"] == 2.0

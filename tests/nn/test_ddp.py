"""Frozen-mask retraining under DistributedDataParallel: 2 CPU processes, gloo, loopback."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparse24

from distributed import spawn

WORLD, STEPS, GLOBAL_BATCH = 2, 5, 16


def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    report = sparse24.sparsify_(model)  # masks from this process's own weights
    assert [r.fqn for r in report.swapped] == ["0", "2"]
    return model


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, GLOBAL_BATCH, 32, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g)


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.05)


def train(model, opt, xs, ys):
    for x, y in zip(xs, ys):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank):
    model = build(seed=100 + rank)  # different init and masks per rank on purpose
    ddp = DDP(model)  # broadcasts rank 0's parameters AND buffers (the masks) to every rank
    opt = make_opt(ddp.parameters())
    xs, ys = data()
    per = GLOBAL_BATCH // WORLD
    train(ddp, opt, xs[:, rank * per:(rank + 1) * per], ys[:, rank * per:(rank + 1) * per])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, state)
    return gathered


def test_ddp_matches_single_process():
    states = spawn(_worker, WORLD)

    single = build(seed=100)  # rank 0's model, trained on the whole global batch
    xs, ys = data()
    train(single, make_opt(single.parameters()), xs, ys)
    expected = single.state_dict()

    for fqn in ("0", "2"):
        masks = [s[f"{fqn}.mask"] for s in states]
        assert all(torch.equal(m, masks[0]) for m in masks)  # identical on every rank
        assert torch.equal(masks[0], expected[f"{fqn}.mask"])
        for s in states:
            assert bool((s[f"{fqn}.weight"][~masks[0]] == 0).all())  # pruned weights stayed zero
    for s in states:
        assert s.keys() == expected.keys()
        for k in expected:
            # gradient averaging across ranks reorders fp32 sums: a few ulps
            torch.testing.assert_close(s[k], expected[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(states[0]["0.weight"], build(seed=100).state_dict()["0.weight"])  # it trained

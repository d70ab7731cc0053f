"""A corrupt distributed checkpoint loaded into an FSDP2 model with the documented recipe
(get_model_state_dict, dcp.load, set_model_state_dict; docs/distributed.md) where only rank 1's
part is bad: every rank refuses it with sparse24's error naming the entry, nothing changes on any
rank, and no rank is left waiting in a collective. Also: the tensor-level calls refuse a DTensor
weight with a message saying so. 2 CPU processes on gloo."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import sparse24

from distributed import NO_INTEGER_FSDP2, fsdp2_shards_integer_parameters, spawn

WORLD = 2

# name: (mode, corruption of a plain state dict of build(mode), placement, words both ranks' errors hold).
# Layer "2" is 24 x 40: row 13 lies on rank 1 under FSDP2's row sharding (12 + 12 rows), column 39 (and
# kept value 15) on rank 1 under column sharding (20 + 20 columns, 10 + 10 kept values).
CASES = {
    "masked-weight-nan-rows": ("masked", ("2.weight", (13, 0), float("nan")), "rows", ["'2.weight'", "non-finite"]),
    "masked-weight-nan-cols": ("masked", ("2.weight", (13, 39), float("nan")), "cols", ["'2.weight'", "non-finite"]),
    "bias-nan-rows": ("masked", ("2.bias", (13,), float("nan")), "rows", ["'2.bias'", "non-finite"]),
    "values-nan-rows": ("compressed", ("2.values", (13, 3), float("nan")), "rows", ["'2.values'", "non-finite"]),
    "int8-128-rows": ("int8", ("2.values", (13, 3), -128), "rows", ["corrupt INT8 values at row 13", "-128"]),
    "int8-128-cols": ("int8", ("2.values", (13, 15), -128), "cols", ["corrupt INT8 values at row 13, kept value 15"]),
    "mask-4of4-rows": ("masked", ("2.mask", (13, slice(0, 4)), True), "rows", ["mask is not 2:4: row 13, group 0"]),
    # sharded across 2:4 groups: every rank checks the gathered whole mask, and raises the error itself
    "mask-4of4-cols": ("masked", ("2.mask", (13, slice(36, 40)), True), "cols", ["mask is not 2:4: row 13, group 9"]),
}
WHOLE = {"mask-4of4-cols"}


def build(mode, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 24))
    kw = {"masked": {}, "compressed": {"mode": "compressed"}, "int8": {"mode": "compressed", "quantize": "int8"}}
    sparse24.sparsify_(model, min_features=1, skip_output_head=False, **kw[mode])
    return model


def full_state(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _bad_loads(rank, mesh, folder):
    out = {}
    int8 = fsdp2_shards_integer_parameters(mesh)   # torch < 2.13 cannot shard INT8 layers: those cases skip
    for name, (mode, (key, index, value), place, _) in CASES.items():
        if mode == "int8" and not int8:
            continue
        path = f"{folder}/{name}"
        if rank == 0:
            sd = build(mode, 0).state_dict()
            sd[key][index] = value
            dcp.save(sd, checkpoint_id=path, no_dist=True)
        dist.barrier()
        model = build(mode, 1)
        spf = (lambda p: Shard(1) if p.dim() == 2 else None) if place == "cols" else None
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh, shard_placement_fn=spf)
        fully_shard(model, mesh=mesh, shard_placement_fn=spf)
        before = full_state(model)
        # into empty tensors: dcp.load writes in place, so model.state_dict()'s own would change the model
        sd = {k: torch.empty_like(v) for k, v in get_model_state_dict(model).items()}
        dcp.load(sd, checkpoint_id=path)
        try:
            set_model_state_dict(model, sd)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        after = full_state(model)
        unchanged = after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        results = [None] * WORLD
        dist.all_gather_object(results, (error, unchanged))
        out[name] = results
    return out


def _clean_load(rank, mesh, folder):
    path = f"{folder}/clean"
    src = build("masked", 0)
    if rank == 0:
        dcp.save(src.state_dict(), checkpoint_id=path, no_dist=True)
    dist.barrier()
    model = build("masked", 1)
    fully_shard(model, mesh=mesh)
    sd = {k: torch.empty_like(v) for k, v in get_model_state_dict(model).items()}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd)
    return full_state(model), full_state(src)


def _plain_load(rank):
    """A plain model's load under an initialized process group, refused and accepted: (the number of
    all_reduce calls made, the refusal)."""
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        src, plain = build("masked", 0), build("masked", 1)
        bad = copy.deepcopy(src.state_dict())
        bad["2.weight"][13, 0] = float("nan")
        try:
            plain.load_state_dict(bad)
            error = None
        except RuntimeError as e:
            error = str(e)
        plain.load_state_dict(src.state_dict())
    finally:
        dist.all_reduce = real
    return len(calls), error


def _dtensor_weight_calls(mesh):
    w = distribute_tensor(torch.randn(16, 32), mesh, [Shard(0)])
    refused = {}
    calls = {"mask_nm": lambda: sparse24.mask_nm(w), "compress": lambda: sparse24.compress(w),
             "prune_nm": lambda: sparse24.masks.prune_nm(w),
             "search_permutation": lambda: sparse24.search_permutation(w, time_limit=0.1, progress=False)}
    for name, f in calls.items():
        try:
            f()
            refused[name] = None
        except Exception as e:
            refused[name] = f"{type(e).__name__}: {e}"
    return refused


def _worker(rank, folder):
    mesh = init_device_mesh("cpu", (WORLD,))
    return {"bad": _bad_loads(rank, mesh, folder), "clean": _clean_load(rank, mesh, folder),
            "plain": _plain_load(rank), "dtensor calls": _dtensor_weight_calls(mesh)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # one pair of processes for every case (starting them is most of the time); a rank left waiting in a
    # collective fails at the timeout
    return spawn(_worker, WORLD, str(tmp_path_factory.mktemp("dcp")), timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_part_on_one_rank_is_refused_on_every_rank(results, name):
    words = CASES[name][3]
    if name not in results["bad"]:
        pytest.skip(NO_INTEGER_FSDP2)
    (err0, same0), (err1, same1) = results["bad"][name]
    assert same0 and same1, (name, "the model changed")
    assert err0 is not None and err1 is not None, (name, err0, err1)
    assert err1.startswith("RuntimeError: Error(s) in loading state_dict"), (name, err1)
    assert err0.startswith("RuntimeError: Error(s) in loading state_dict"), (name, err0)
    assert "\t2: " in err1 and "refused on rank" not in err1, (name, err1)
    if name in WHOLE:
        assert err0 == err1, (name, err0, err1)
    else:
        assert "\t2: refused on rank(s) [1] of the mesh, where rank 1 says: " in err0, (name, err0)
    for w in words:   # rank 1 its own error, rank 0 quoting it
        assert w in err1 and w in err0, (name, w, err0, err1)


def test_clean_sharded_load_still_loads(results):
    loaded, src = results["clean"]
    assert loaded.keys() == src.keys()
    for k, v in src.items():
        assert torch.equal(loaded[k], v), k


def test_plain_load_makes_no_collective(results):
    calls, error = results["plain"]
    assert calls == 0
    assert "'2.weight' has 1 non-finite value(s) (inf/NaN), the first at index (13, 0)" in error, error


def test_tensor_calls_refuse_a_dtensor_weight(results):
    for name, e in results["dtensor calls"].items():
        assert e is not None and "weight is a DTensor (sharded): call full_tensor() first" in e, (name, e)

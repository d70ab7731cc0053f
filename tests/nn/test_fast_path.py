"""Sparse24Linear's fast path (forward replays the plan a call of the same shape and dtype launched):
taken on CPU tensors with the CUDA route decision (the interpreter computes), it gives the full path's
result bit for bit, and anything that could change what the full path launches sends the call back
there. It keeps no module or tensor alive and is not copied with a module."""
import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import sparse24
from sparse24.nn import linear as linear_mod
from sparse24.ops import config_store
from sparse24.ops import linear24
from sparse24.ops.linear24 import launch, op

from conftest import load_script

_bench = load_script("bench_host")


@pytest.fixture
def cuda_route(monkeypatch):
    """The CUDA route decision on CPU tensors (launches run in the interpreter); counts the full path's
    calls (each goes through sparse24.ops.linear24.forward)."""
    real = op._auto_backend
    monkeypatch.setattr(op, "_auto_backend", lambda x, *rest: real(_bench._AsCuda(x), *rest))
    monkeypatch.setattr(op, "_triton_available", lambda: True)
    monkeypatch.setattr(config_store, "device_info", _bench.as_cuda_device_info(config_store.device_info))
    config_store.clear_cache()
    op._AUTO.clear()
    full = []
    real_forward = linear24.forward
    monkeypatch.setattr(linear24, "forward", lambda *a, **k: full.append(1) or real_forward(*a, **k))
    yield full
    config_store.clear_cache()
    op._AUTO.clear()
    launch._PLANS.clear()


def _layer(quantize=None, N=64, K=128, bias=True):
    torch.manual_seed(0)
    return sparse24.Sparse24Linear.from_linear(nn.Linear(K, N, bias=bias, dtype=torch.float16), mode="compressed",
                                               quantize=quantize).to_layout("decode")


def _full_path(layer, x):
    """The result with the fast path forgotten first (for x's shape and dtype)."""
    linear_mod._FAST.get(layer, {}).pop((x.shape, x.dtype), None)
    return layer(x)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_path_gives_the_full_paths_bits(quantize, dtype, bias, cuda_route):
    layer = _layer(quantize, bias=bias)
    if quantize == "int4" and dtype == torch.bfloat16:
        # scales bfloat16 holds exactly: the module passes their bfloat16 copy (checked per call), which
        # the fast path does not keep
        layer.to_layout("v1")
        with torch.no_grad():
            layer.scale.copy_(layer.scale.bfloat16().half())
        layer.to_layout("decode")
        assert layer.__dict__.get("_scale_bf16") is not None
    with torch.no_grad():
        for shape in ((1, 128), (5, 128), (2, 1, 128), (16, 128)):
            x = torch.randn(*shape, dtype=dtype)
            n = len(cuda_route)
            y1 = layer(x)                                  # full path, plan kept
            assert len(cuda_route) == n + 1
            y2 = layer(x)
            kept = quantize != "int4" or dtype != torch.bfloat16   # INT4 + bf16 x: the scales' exact copy
            assert len(cuda_route) == n + 1 + (not kept)           # the fast path: no full path
            assert y2.shape == (*shape[:-1], 64) and torch.equal(y1, y2) and torch.equal(y2, _full_path(layer, x))
        if kept:   # the shapes seen are all kept
            assert len(linear_mod._FAST[layer]) == 4


def test_anything_that_changes_the_launch_takes_the_full_path(cuda_route):
    layer = _layer()
    x = torch.randn(3, 128, dtype=torch.float16)

    def full_path_taken(change=None):
        if change is not None:
            change()
        n = len(cuda_route)
        with torch.no_grad():
            y = layer(x)
            assert torch.equal(y, _full_path(layer, x))
        return len(cuda_route) > n + 1    # (the _full_path call itself counts one)

    assert full_path_taken()              # first call
    assert not full_path_taken()          # kept
    assert full_path_taken(lambda: setattr(layer, "bias", nn.Parameter(torch.zeros(64, dtype=torch.float16))))
    assert not full_path_taken()
    assert full_path_taken(config_store.clear_cache)        # tuned files re-read
    assert full_path_taken(launch.release_workspaces)       # plans and workspaces dropped
    det = torch.are_deterministic_algorithms_enabled()
    try:
        assert full_path_taken(lambda: torch.use_deterministic_algorithms(True))
        assert not full_path_taken()
    finally:
        torch.use_deterministic_algorithms(det)
    assert full_path_taken()
    layer.to_layout("v1")                                   # new tensors, layout v1: no kernel plan kept
    with torch.no_grad():
        layer(x)
        n = len(cuda_route)
        layer(x)
    assert len(cuda_route) == n + 1


def test_autograd_and_autocast_go_the_full_way(cuda_route):
    layer = _layer()
    x = torch.randn(3, 128, dtype=torch.float16)
    with torch.no_grad():
        layer(x)                                            # kept
    xg = x.clone().requires_grad_()
    layer(xg).float().sum().backward()                      # the registered op: x gets its gradient
    assert xg.grad is not None and xg.grad.shape == x.shape
    n = len(cuda_route)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)                                        # cast to bfloat16 first, as F.linear would be
    assert y.dtype == torch.bfloat16 and len(cuda_route) == n + 1


def test_the_fast_path_keeps_nothing_alive_and_is_not_copied(cuda_route):
    layer = _layer()
    x = torch.randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        y = layer(x)
    old = weakref.ref(layer.values)
    layer.to_layout("v1")                                   # the decode-layout tensors are dropped
    gc.collect()
    assert old() is None
    layer.to_layout("decode")
    with torch.no_grad():
        layer(x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone not in linear_mod._FAST
        with torch.no_grad():
            assert torch.equal(clone(x), y)
    gone = weakref.ref(layer)
    # release_workspaces() drops the plans a module keeps too (they hold split-K workspaces), and the
    # next call makes a new one
    plans = {id(e[0]) for e in linear_mod._FAST[layer].values()}
    launch.release_workspaces()
    assert layer not in linear_mod._FAST
    with torch.no_grad():
        assert torch.equal(layer(x), y)
    assert {id(e[0]) for e in linear_mod._FAST[layer].values()}.isdisjoint(plans)
    del layer
    gc.collect()
    assert gone() is None


def test_a_mode_switch_after_the_weight_is_gone_takes_the_full_path(cuda_route):
    """A kept plan's weak references die with the decode-layout tensors; a layer switched to the masked
    mode (no kept values at all) must not read that as a match."""
    layer = _layer()
    x = torch.randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        layer(x)                                           # kept
        layer.to_masked()
        gc.collect()
        assert linear_mod._FAST[layer][(x.shape, x.dtype)][1]() is None   # the kept values are gone
        w = layer.weight * layer.mask
        y = layer(x)
    assert torch.equal(y, torch.nn.functional.linear(x, w, layer.bias))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the tampered layer's full path computes nonsense
def test_a_scale_set_to_none_is_not_a_match(cuda_route):
    """An INT8 layer whose scale a user drops (and whose old scale dies) must not replay the scaled plan."""
    layer = _layer("int8")
    x = torch.randn(2, 128, dtype=torch.float16)
    with torch.no_grad():
        layer(x)                                           # kept, with the scale
        layer._buffers["scale"] = None
        gc.collect()
        n = len(cuda_route)
        try:
            layer(x)
        except Exception:   # noqa: BLE001 (the full path may refuse the tampered layer: what matters is it ran)
            pass
    assert len(cuda_route) == n + 1

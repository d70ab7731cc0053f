"""Sparse24Linear tensors shared with other processes or held elsewhere (review of process-level use):
a decode-layout layer updated in place (add_to_kept_, load_state_dict) writes into the tensors it holds
(shared memory, CUDA IPC, an optimizer see the update), a non-strict load without the layer's entries
re-packs nothing, to_empty from the meta device packs no uninitialized memory, and a masked layer's
zero check does not trust its version-counter cache for a weight in shared memory (another process's
writes bump no counter here)."""
import copy

import pytest
import torch
from torch import nn

import sparse24.nn.layout as layout_mod
from sparse24 import Sparse24Linear

from conftest import assert_matches_reference

KINDS = {  # name: (dtype, quantize, extra)
    "fp16": (torch.float16, None, {}),
    "bf16": (torch.bfloat16, None, {}),
    "int8": (torch.float16, "int8", {}),
    "int4": (torch.float16, "int4", {"group_size": 32}),
    "int4-asym": (torch.bfloat16, "int4", {"group_size": 32, "symmetric": False}),
}


def make(kind, seed=0, K=64, N=24):
    dtype, quantize, extra = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g))
        lin.bias.copy_(torch.randn(N, generator=g))
    return Sparse24Linear.from_linear(lin.to(dtype), mode="compressed", quantize=quantize, **extra)


def held(layer):
    """The compressed tensors the layer holds, as objects."""
    return {n: getattr(layer, n) for n in ("values", "meta", "scale", "zero")}


def assert_same_objects(layer, before):
    for n, t in held(layer).items():
        assert t is before[n], f"{n} was replaced by a new tensor"


def out(layer, x):
    with torch.no_grad():
        return layer(x)


# --- bug 1: decode layout updated in place ------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:INT4 merge onto the layer's own grid")
@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_add_to_kept_writes_into_held_tensors(kind):
    layer = make(kind).to_layout("decode")
    before, view = held(layer), layer.values.detach().view(-1)   # a second tensor on the same memory
    view_before = view.clone()
    delta = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)) * 0.5
    w0 = layer.dense_weight().double()
    ref = copy.deepcopy(layer).to_layout("v1").add_to_kept_(delta)   # the same merge in layout v1
    layer.add_to_kept_(delta)
    assert layer.layout == "decode"
    assert_same_objects(layer, before)
    assert not torch.equal(view, view_before)   # the memory held before sees the update
    assert torch.equal(layer.dense_weight(), ref.dense_weight())
    if KINDS[kind][1] is None:   # unquantized: W + delta (in the layer's dtype) at the kept positions, one rounding
        mask = copy.deepcopy(ref).to_masked().mask
        w_ref = torch.where(mask, w0 + delta.to(layer.dtype).double(), 0).to(layer.dtype)
        assert torch.equal(layer.dense_weight(), w_ref)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(layer.dtype)
    assert_matches_reference(out(layer, x), x, ref.dense_weight().double(), layer.bias.detach())


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_load_state_dict_writes_into_held_tensors(kind):
    layer = make(kind).to_layout("decode")
    other = make(kind, seed=1)
    before, view = held(layer), layer.values.detach().view(-1)
    w_ref = other.dense_weight().double()   # the independent reference: the loaded layer's masked weight
    layer.load_state_dict(other.state_dict())
    assert layer.layout == "decode"
    assert_same_objects(layer, before)
    assert torch.equal(view, layer.values.detach().view(-1))   # (the same memory, not a copy)
    assert torch.equal(layer.dense_weight().double(), w_ref)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(layer.dtype)
    assert_matches_reference(out(layer, x), x, w_ref, other.bias.detach())


def test_decode_shared_memory_sees_load():
    layer = make("int8").to_layout("decode")
    layer.share_memory()
    storage = layer.values.untyped_storage()   # what another process maps
    layer.load_state_dict(make("int8", seed=1).state_dict())
    assert layer.values.untyped_storage().data_ptr() == storage.data_ptr()
    assert layer.values.is_shared() and layer.meta.is_shared()


def test_decode_refused_load_changes_nothing():
    layer = make("int4-asym").to_layout("decode")
    before, sd_before = held(layer), {k: v.clone() for k, v in layer.state_dict().items()}
    bad = {k: v.clone() for k, v in make("int4-asym", seed=1).state_dict().items()}
    bad["scale"][0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="scale"):
        layer.load_state_dict(bad)
    assert_same_objects(layer, before)
    assert all(torch.equal(v, sd_before[k]) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_decode_non_strict_load_without_entries_does_not_repack(kind, monkeypatch):
    layer = make(kind).to_layout("decode")
    before, ptr = held(layer), layer.values.data_ptr()
    packed = []
    real = layout_mod.pack_decode
    monkeypatch.setattr(layout_mod, "pack_decode", lambda p: packed.append(p) or real(p))
    result = layer.load_state_dict({}, strict=False)
    assert packed == []
    assert_same_objects(layer, before)
    assert layer.values.data_ptr() == ptr
    assert set(result.missing_keys) >= {"values", "meta"}
    # and a whole model's non-strict load of other modules' entries (PEFT's adapter load) alike
    model = nn.Sequential(layer, nn.Linear(24, 8))
    model.load_state_dict({"1.weight": torch.zeros(8, 24)}, strict=False)
    assert packed == [] and layer.values is before["values"]


# --- bug 2: to_empty from the meta device -----------------------------------------------------------------

def test_decode_to_empty_from_meta_packs_no_uninitialized_memory(monkeypatch):
    layer = make("int8").to_layout("decode")
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    w_ref = layer.dense_weight().double()
    layer.to("meta")
    real = torch.empty_like

    def empty_like(t, *args, **kwargs):   # uninitialized memory that happens to hold -128 bytes
        e = real(t, *args, **kwargs)
        return e.fill_(-128) if e.dtype == torch.int8 else e

    monkeypatch.setattr(torch, "empty_like", empty_like)
    layer.to_empty(device="cpu")
    monkeypatch.undo()
    assert layer.layout == "v1"   # nothing to pack yet
    layer.load_state_dict(sd)
    assert layer.layout == "decode"   # settled by the load
    assert torch.equal(layer.dense_weight().double(), w_ref)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).half()
    assert_matches_reference(out(layer, x), x, w_ref, layer.bias.detach())


# --- bug 3: a masked weight in shared memory ---------------------------------------------------------------

def test_masked_shared_weight_zero_check_sees_write_from_elsewhere():
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 24)).eval()
    layer.share_memory()
    x = torch.randn(3, 64)
    out(layer, x)   # the zero check is made (and, unshared, cached)
    version = layer.weight._version
    # another process writes the shared memory: a tensor of its own over the same storage, whose writes
    # bump no version counter of this one
    other = torch.empty(0).set_(layer.weight.untyped_storage(), 0, layer.weight.shape)
    with torch.no_grad():
        other.normal_()
    assert layer.weight._version == version
    ref = nn.functional.linear(x.double(), torch.where(layer.mask, layer.weight.detach(), 0).double(),
                               layer.bias.detach().double())
    assert torch.allclose(out(layer, x).double(), ref, atol=1e-4)

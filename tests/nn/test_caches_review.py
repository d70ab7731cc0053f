"""Review findings on what sparse24 caches about a layer's tensors: the "weight is 0 where pruned" check,
the INT4 decode layout's bfloat16 copy of the scales, the optimizer-state shape check, the per-class
table of directly read weights, and the INT4 merge warning. A cache keyed by an address or an id()
was trusted after the memory was freed and new data landed at the same address. The same-address case
is forced deterministically: tensors made with ``torch.frombuffer`` over one Python buffer are distinct
storages at one address (what the allocator does by chance after ``.data =`` frees the old storage).
Outputs are checked against fp64 products with the masked (or dequantized) dense weight."""
import builtins
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24.nn import masking

from conftest import int4_dequantized_reference, top2_mask


def _at(buf: bytearray, like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new tensor (a new storage) over ``buf``'s memory, shaped like ``like``, holding ``values``."""
    t = torch.frombuffer(buf, dtype=like.dtype, count=like.numel()).view(like.shape)
    t.copy_(values)
    return t


def _buffer(t: torch.Tensor) -> bytearray:
    return bytearray(t.numel() * t.element_size())


def _masked_layer(R: int = 16, C: int = 32) -> Sparse24Linear:
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(C, R)).double()
    layer.requires_grad_(False)
    return layer


def _reference(layer: Sparse24Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), torch.where(layer.mask, layer.weight.double(), 0), layer.bias.double())


def _set_weight_at(layer: Sparse24Linear, buf: bytearray, values: torch.Tensor) -> None:
    """``layer.weight.data =`` a new storage at ``buf``'s address; the previous storage is freed."""
    layer.weight.data = _at(buf, layer.weight, values)


def test_zero_check_sees_new_weight_data_at_the_checked_address():
    layer = _masked_layer()
    x = torch.randn(3, 32, dtype=torch.float64)
    buf = _buffer(layer.weight)
    _set_weight_at(layer, buf, torch.where(layer.mask, layer.weight, 0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))   # zero where pruned: recorded
    checked = layer.weight.data_ptr()
    dense = torch.randn(16, 32, dtype=torch.float64)
    layer.weight.data = torch.zeros_like(dense)                      # the checked storage is freed
    _set_weight_at(layer, buf, dense)                                # new data at its address
    assert layer.weight.data_ptr() == checked and bool(layer.weight[~layer.mask].any())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))


def test_zero_check_sees_a_transposed_view_of_the_checked_storage():
    layer = _masked_layer(32, 32)
    x = torch.randn(3, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.masked_fill_(~layer.mask, 0)
        torch.testing.assert_close(layer(x), _reference(layer, x))
    ptr = layer.weight.data_ptr()
    layer.weight.data = layer.weight.data.t()          # same storage, address and version: other data
    assert layer.weight.data_ptr() == ptr and bool(layer.weight[~layer.mask].any())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))


def test_zero_check_sees_a_new_mask_at_the_checked_address():
    layer = _masked_layer()
    x = torch.randn(3, 32, dtype=torch.float64)
    buf = _buffer(layer.mask)
    layer.mask.data = _at(buf, layer.mask, layer.mask)
    with torch.no_grad():
        layer.weight.masked_fill_(~layer.mask, 0)
        layer(x)                                             # recorded
    other = top2_mask(torch.randn(16, 32))
    assert not torch.equal(other, layer.mask)
    layer.mask.data = torch.zeros_like(other)                # the checked mask's storage is freed
    layer.mask.data = _at(buf, layer.mask, other)            # a new mask at its address
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))


def test_zero_check_recorded_by_an_optimizer_step_sees_new_data_at_its_address():
    layer = _masked_layer()
    layer.weight.requires_grad_(True)
    x = torch.randn(3, 32, dtype=torch.float64)
    buf = _buffer(layer.weight)
    _set_weight_at(layer, buf, layer.weight)
    opt = torch.optim.SGD([layer.weight], lr=0.1)
    layer(x).sum().backward()
    opt.step()                                               # re-zeroes and records (masking._note_zero)
    assert masking._ZERO_CHECKED.get(layer) is not None
    checked = layer.weight.data_ptr()
    layer.weight.data = torch.zeros(16, 32, dtype=torch.float64)
    _set_weight_at(layer, buf, torch.randn(16, 32, dtype=torch.float64))
    assert layer.weight.data_ptr() == checked
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x))


def test_direct_read_hook_sees_new_weight_data_at_the_checked_address():
    # MultiheadAttention reads out_proj.weight directly: a forward pre-hook re-zeroes it when the zero
    # check fails; a stale check let the unmasked weight through, with autograd on too
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(32, 4, batch_first=True))
    sparse24.sparsify_(model, min_features=1, skip_output_head=False)
    mha = model[0]
    op = mha.out_proj
    assert isinstance(op, Sparse24Linear) and op.mode == "masked"
    x = torch.randn(2, 5, 32)
    buf = _buffer(op.weight)
    _set_weight_at(op, buf, torch.where(op.mask, torch.randn(32, 32), 0))
    model[0](x, x, x, need_weights=False)                   # the hook's check: zero where pruned, recorded
    checked = op.weight.data_ptr()
    op.weight.data = torch.zeros(32, 32)
    _set_weight_at(op, buf, torch.randn(32, 32))
    assert op.weight.data_ptr() == checked
    ref = copy.deepcopy(mha)
    with torch.no_grad():
        ref.out_proj.weight.masked_fill_(~ref.out_proj.mask, 0)
    y = model[0](x, x, x, need_weights=False)[0]
    assert not bool(op.weight[~op.mask].any())
    torch.testing.assert_close(y, ref(x, x, x, need_weights=False)[0])


def test_unchanged_weight_keeps_its_zero_check():
    # the entry must still be trusted while nothing changed (no per-call scan: a host sync on a GPU)
    layer = _masked_layer()
    with torch.no_grad():
        layer.weight.masked_fill_(~layer.mask, 0)
        layer(torch.randn(1, 32, dtype=torch.float64))
    gc.collect()   # the storage objects the entry refers to stay (torch keeps one per live storage)
    calls = []
    orig = torch.where

    def counting(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    try:
        torch.where = counting
        assert layer._zero_where_pruned(layer.weight) and not calls
    finally:
        torch.where = orig


def test_bf16_scale_copy_is_not_used_for_new_scales_at_its_address():
    torch.manual_seed(0)
    lin = nn.Linear(128, 16, bias=False).to(torch.bfloat16)
    mask = top2_mask(lin.weight.detach())
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4")
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert layer.symmetric   # doubled scales: a doubled dequantized weight
    ref = 2 * int4_dequantized_reference(layer, mask)
    orig = layer.scale.detach().clone()
    buf = _buffer(layer.scale)
    layer.scale.data = _at(buf, layer.scale, orig)
    layer.to_layout("decode")                                # the bfloat16 copy of the scales at buf
    assert layer.__dict__["_scale_bf16"] is not None
    layer.scale.data = orig.clone()                          # the copied storage is freed
    layer.scale.data = _at(buf, layer.scale, orig * 2)       # new scales (bfloat16-exact) at its address
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y.double(), x.double() @ ref.t(), rtol=2e-2, atol=2e-2)


def _adam_state_checked_after(load_twice: bool):
    """A sparsified Conv1D model whose optimizer, after a checked step, gets the dense model's optimizer
    checkpoint (the Conv1D moments transposed) loaded; before it, the sparsified model's own if
    ``load_twice``. Returns (model, optimizer, input)."""
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Conv1D(16, 8), nn.ReLU(), nn.Linear(16, 4))

    x = torch.randn(4, 8)
    dense = build()
    dense_opt = torch.optim.Adam(dense.parameters(), lr=1e-2, foreach=False)
    dense(x).sum().backward()
    dense_opt.step()
    model = build()
    sparse24.sparsify_(model, min_features=1, skip_output_head=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    model(x).sum().backward()
    opt.step()                                               # shapes checked for this state
    if load_twice:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(dense_opt.state_dict())
    return model, opt, x


@pytest.mark.parametrize("load_twice", [False, True])
def test_state_shapes_are_checked_after_every_load(load_twice, monkeypatch):
    # a loaded state dict may get the freed checked one's id(): force that, every dict the same id
    monkeypatch.setattr(masking, "id", lambda o: 0 if isinstance(o, dict) else builtins.id(o), raising=False)
    model, opt, x = _adam_state_checked_after(load_twice)
    before = copy.deepcopy(model.state_dict())
    steps = [float(s["step"]) for s in opt.state.values()]
    model.zero_grad()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"optimizer step refused: optimizer state 'exp_avg' has shape"):
        opt.step()
    sd = model.state_dict()
    assert all(torch.equal(before[k], sd[k]) for k in sd)
    assert steps == [float(s["step"]) for s in opt.state.values()]


def test_weight_reads_table_keeps_no_class_alive():
    def traced():
        g = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))
        sparse24.sparsify_(g, min_features=1, skip_output_head=False)
        return weakref.ref(type(g))

    refs = [traced() for _ in range(3)]
    gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_int4_merge_warning_points_at_the_caller_once_per_layer():
    torch.manual_seed(0)
    layers = [Sparse24Linear.from_linear(nn.Linear(64, 16)).to_compressed(quantize="int4") for _ in range(2)]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(3):
            for layer in layers:
                layer.add_to_kept_(0.5 * torch.randn(16, 64))   # codes move: each merge would warn
    merge = [w for w in ws if "INT4 merge" in str(w.message)]
    assert len(merge) == 2, [str(w.message) for w in ws]         # once per layer
    assert all(w.filename == __file__ for w in merge), [(w.filename, w.lineno) for w in merge]
    assert "Sparse24Linear(in_features=64, out_features=16)" in str(merge[0].message)


def test_int4_decode_layer_with_a_bf16_scale_copy_pickles_and_deep_copies():
    # the copy's key holds a weak reference to the scales' storage: it pickles (and deep-copies) as a
    # dead one, so the copy never matches the new scales' storage
    import io
    torch.manual_seed(0)
    lin = nn.Linear(128, 16).bfloat16()
    mask = top2_mask(lin.weight.detach())
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4")
    ref = int4_dequantized_reference(layer, mask)
    layer.to_layout("decode")
    assert layer.__dict__["_scale_bf16"] is not None
    buf = io.BytesIO()
    torch.save(layer, buf)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    for other in (torch.load(io.BytesIO(buf.getvalue()), weights_only=False), copy.deepcopy(layer)):
        assert other.__dict__["_scale_bf16"][3][0]() is None
        with torch.no_grad():
            torch.testing.assert_close(other(x).double(), F.linear(x.double(), ref, lin.bias.double()),
                                       rtol=2e-2, atol=2e-2)

"""The reference backend on a decode-layout weight, and tracing (review).

* The reference forward and its x-gradient decompress a decode-layout weight a block of 128-row
  tiles at a time (``DecodePacked.to_dense(rows=)``): never re-ordered whole to layout v1 (which
  they did on every call and every backward: a whole re-order costs several times the dense weight).
* ``torch.jit.trace`` of a compressed layer records the registered op (the reference's
  ``view(torch.uint8)`` of the weight's bytes failed torch's tracer with an internal assert).
"""

import copy
import io

import pytest
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24.decode_format import DecodePacked, pack_decode
from sparse24.ops.linear24 import naive

N, K = 384, 256      # three 128-row tiles


def _sparse_weight(dtype=torch.float32):
    """A dense weight that is already 2:4 (two zeros in every group of four): the masked dense
    reference is the weight itself."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    keep = torch.rand(N, K // 4, 4, generator=g).argsort(-1)[..., :2]
    mask = torch.zeros(N, K // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).view(N, K)
    return (w * mask).to(dtype)


def _weights():
    w = _sparse_weight()
    return {"fp16": (sparse24.compress(w.half()), w.half().double()),
            "int8": sparse24.compress(w, quantize="int8"),
            "int4": sparse24.compress(w.half(), quantize="int4", group_size=128)}


@pytest.fixture
def no_whole_reorder(monkeypatch):
    """The reference's blocks are 128 weight rows (three here), and re-ordering the whole decode-layout
    weight to layout v1 raises."""
    monkeypatch.setattr(naive, "CHUNK_ELEMENTS", 128 * K)
    real = DecodePacked.to_sparse24

    def to_sparse24(self):
        if tuple(self.shape) == (N, K):
            raise AssertionError("the whole decode-layout weight was re-ordered to layout v1")
        return real(self)
    monkeypatch.setattr(DecodePacked, "to_sparse24", to_sparse24)


def _cases():
    for kind, p in _weights().items():
        p, ref = p if isinstance(p, tuple) else (p, p.to_dense().double())   # (quantized: its dequantized weight)
        yield kind, p, ref


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
def test_reference_forward_reads_the_decode_layout_block_by_block(no_whole_reorder, x_dtype):
    x = torch.randn(5, K, dtype=x_dtype, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N, dtype=x_dtype)
    tol = 1e-12 if x_dtype == torch.float64 else 1e-4
    for kind, p, ref in _cases():
        d = pack_decode(p)
        want = x.double() @ ref.t() + bias.double()
        y = sparse24.linear(x, d, bias, backend="reference")
        assert y.dtype == x_dtype
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol, msg=kind)
        assert torch.equal(y, sparse24.linear(x, p, bias, backend="reference")), kind   # the same blocks as v1
        assert torch.equal(sparse24.linear(x, d, bias), y), kind   # "auto" on CPU: the reference


@pytest.mark.parametrize("kind", ["fp16", "int8", "int4"])
def test_grad_x_through_a_frozen_decode_layout_layer_reads_it_block_by_block(no_whole_reorder, kind):
    """What a frozen compressed base under LoRA runs on every backward."""
    w = _sparse_weight(torch.float16 if kind == "fp16" else torch.float32)
    dense = nn.Linear(K, N, dtype=w.dtype)
    with torch.no_grad():
        dense.weight.copy_(w)
    layer = Sparse24Linear.from_linear(dense, mode="compressed", quantize=None if kind == "fp16" else kind)
    # the independent reference: the masked weight itself (quantized: its dequantized layout-v1 weight)
    ref_w = w.double() if kind == "fp16" else layer.sparse_tensor().to_dense().double()
    ref_b = layer.bias.detach().double().clone()
    layer.requires_grad_(False).to_layout("decode")
    assert layer.layout == "decode"
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2)).to(w.dtype).requires_grad_()
    gy = torch.randn(4, N, generator=torch.Generator().manual_seed(3)).to(w.dtype)
    y = layer(x)
    y.backward(gy)
    tol = 2e-2 if kind == "fp16" else 1e-4
    torch.testing.assert_close(y.double(), x.detach().double() @ ref_w.t() + ref_b, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), gy.double() @ ref_w, rtol=tol, atol=tol)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "error::torch.jit.TracerWarning")  # (none of ours)
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_jit_trace_save_and_load_of_a_compressed_layer(quantize):
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed", quantize=quantize).eval()
    before = copy.deepcopy(layer)
    ref = layer.sparse_tensor().to_dense().double()
    bias = layer.bias.detach().double()
    with torch.no_grad():
        traced = torch.jit.trace(layer, torch.randn(3, 64))
        buf = io.BytesIO()
        torch.jit.save(traced, buf)
        buf.seek(0)
        loaded = torch.jit.load(buf)
        x = torch.randn(5, 64)   # another shape than the traced one
        y = layer(x)
        torch.testing.assert_close(y.double(), x.double() @ ref.t() + bias, rtol=1e-5, atol=1e-5)
        assert torch.equal(traced(x), y) and torch.equal(loaded(x), y)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), before.state_dict().values()))

"""Sparse24Tensor.to_dense against a plain decoding of the documented bit layout (sparse24/format.py's
module docstring), its byte -> column table built once per device in eager mode but never handed to a
trace, and the route a decode-layout layer takes on CPU (the reference, not the interpreter)."""
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import sparse24
import sparse24.format as fmt
from sparse24 import Sparse24Linear
from sparse24.format import Sparse24Tensor
from sparse24.ops.linear24 import launch, op

from conftest import assert_matches_reference, dequantized_reference, top2_mask

ROOT = pathlib.Path(__file__).resolve().parents[2]

# C % 8 == 4 (an odd group count: a padding group in the last metadata byte) and C % 8 == 0; one row,
# fewer rows than a word's groups, and (300, 1028): 255-row CPU blocks, so to_dense takes two blocks
SHAPES = [(1, 4), (3, 12), (5, 8), (7, 36), (33, 100), (16, 128), (300, 1028)]


def plain_dense(p: Sparse24Tensor) -> torch.Tensor:
    """The dense (R, C) weight decoded from the module docstring alone: value j of row r has the
    slot in bits 2(j % 16), 2(j % 16) + 1 of meta[j // 16, r], dense column 4 (j // 2) + slot;
    INT8 ``q * scale[r]`` and INT4 ``(u - zero) * scale[r, k]`` (u: the low nibble of byte j // 2 for
    even j, the high one for odd j; zero 8 when symmetric), exact in float64 and rounded once to
    float32 as documented (then to the logical dtype); unquantized values as stored."""
    R, C = p.shape
    j = torch.arange(C // 2)
    word = p.meta.t().long()[:, j // 16]                                 # (R, C // 2)
    slot = (word >> (2 * (j % 16))) & 3
    col = 4 * (j // 2) + slot
    if p.quantized is None:
        v = p.values.double()
    elif p.quantized == "int8":
        v = p.values.double() * p.scale.double()[:, None]
    else:
        byte = p.values.long()[:, j // 2]
        u = torch.where(j % 2 == 0, byte & 15, byte >> 4).double()
        k = 2 * j // p.group_size                                          # quantization group of value j
        zero = 8.0 if p.zero is None else p.zero.double()[:, k]
        v = (u - zero) * p.scale.double()[:, k]
    if p.quantized is not None and p.dtype != torch.float64:
        v = v.float()   # the documented float32 product (exact for INT4, rounded once for INT8)
    dense = torch.zeros(R, C, dtype=torch.float64)
    dense.scatter_(1, col, v.double())
    return dense.to(p.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (+0.0 and -0.0 differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ity = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.numel() == 0 or torch.equal(a.contiguous().view(ity), b.contiguous().view(ity))


def _compressed(R, C, dtype, quantize, gen):
    w = torch.randn(R, C, generator=gen, dtype=torch.float64).to(dtype)
    mask = top2_mask(w)
    if quantize == "int4":
        p = sparse24.compress(w, mask, quantize="int4", group_size=32, symmetric=R % 2 == 0)
    else:
        p = sparse24.compress(w, mask, quantize=quantize)
    return w, mask, p


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_to_dense_is_the_documented_decoding_bit_for_bit(R, C, dtype, quantize, gen):
    w, mask, p = _compressed(R, C, dtype, quantize, gen)
    ref = plain_dense(p)
    if quantize is None:   # and the masked weight it was compressed from (+0.0 where dropped)
        assert same_bits(ref, torch.where(mask, w, torch.zeros((), dtype=dtype)))
    for _ in range(2):     # the second call reads the kept table
        assert same_bits(p.to_dense(), ref)
    for rows in (slice(1, None, 2), slice(R - 1, R), slice(0, 0)):
        assert same_bits(p.to_dense(rows), ref[rows])


@pytest.mark.parametrize("C", [36, 64])
def test_out_of_place_blocks_forward_ad_and_vmap(C, gen):
    """Dual values (forward-mode AD) and vmap over stacked values take the out-of-place blocks."""
    import torch.autograd.forward_ad as fwAD
    _, _, p = _compressed(6, C, torch.float32, None, gen)
    tangent = torch.randn(p.values.shape, generator=gen)
    with fwAD.dual_level():
        d = Sparse24Tensor(fwAD.make_dual(p.values, tangent), p.meta, p.shape, check=False)
        y, t = fwAD.unpack_dual(d.to_dense())
    assert same_bits(y, plain_dense(p))
    assert same_bits(t, plain_dense(Sparse24Tensor(tangent, p.meta, p.shape)))
    stacked = torch.stack((p.values, tangent))
    out = torch.func.vmap(lambda v: Sparse24Tensor(v, p.meta, p.shape, check=False).to_dense())(stacked)
    assert same_bits(out[0], plain_dense(p))
    assert same_bits(out[1], plain_dense(Sparse24Tensor(tangent, p.meta, p.shape)))


def test_the_byte_table_is_built_once_per_device(monkeypatch, gen):
    """A to_dense call, and a reference linear call that decompresses its weight in several row blocks,
    reuse one table: not one per call, nor one per block."""
    built = []
    real = fmt._build_byte_columns
    monkeypatch.setattr(fmt, "_build_byte_columns", lambda device: built.append(device) or real(device))
    monkeypatch.setattr(fmt, "_BYTE_COLUMNS", {})
    _, _, p = _compressed(1100, 1024, torch.float32, None, gen)   # 1 M elements per block: 2 blocks
    x = torch.randn(3, 1024, generator=gen)
    for _ in range(3):
        y = sparse24.linear(x, p, backend="reference")
        p.to_dense()
    assert built == [torch.device("cpu")]
    assert_matches_reference(y, x, plain_dense(p))
    assert fmt._byte_columns(torch.device("cpu")) is fmt._byte_columns(torch.device("cpu"))


def test_a_table_built_under_torch_func_is_not_kept(monkeypatch, gen):
    """Inside torch.func.grad a new tensor wraps that call's level: such a table is not kept, and later
    eager calls (and traces: opcheck reads storages) get a plain one."""
    monkeypatch.setattr(fmt, "_BYTE_COLUMNS", {})
    _, _, p = _compressed(8, 36, torch.float32, None, gen)
    x = torch.randn(3, 36, generator=gen, dtype=torch.float64).float()

    def loss(v):
        return Sparse24Tensor(v, p.meta, p.shape, check=False).to_dense().mul(x[0]).sum()
    grad = torch.func.grad(loss)(p.values)
    kept_cols = plain_dense(Sparse24Tensor(torch.ones_like(p.values), p.meta, p.shape)).bool()
    assert same_bits(grad, x[0].expand(8, 36)[kept_cols].view(8, 18))
    assert not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in fmt._BYTE_COLUMNS.values())
    assert same_bits(p.to_dense(), plain_dense(p))
    table = fmt._byte_columns(torch.device("cpu"))
    assert not torch._C._functorch.is_functorch_wrapped_tensor(table) and table.untyped_storage().nbytes() == 8192


def test_the_kept_table_never_meets_a_trace(gen):
    """With the eager table kept, to_dense still runs on fake tensors, traced by make_fx, and in the
    registered op's backward under torch.compile (aot_eager: fake tensors again); nothing traced is kept."""
    _, _, p = _compressed(12, 36, torch.float32, None, gen)
    ref = plain_dense(p)
    p.to_dense()
    kept = dict(fmt._BYTE_COLUMNS)
    assert kept
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = Sparse24Tensor(mode.from_tensor(p.values), mode.from_tensor(p.meta), p.shape, check=False)
        assert fake.to_dense().shape == (12, 36)
    traced = make_fx(lambda v, m: Sparse24Tensor(v, m, (12, 36), check=False).to_dense(),
                     tracing_mode="fake")(p.values, p.meta)
    assert same_bits(traced(p.values, p.meta), ref)
    values = p.values.clone().requires_grad_(True)
    x = torch.randn(4, 36, generator=gen, dtype=torch.float64).float()
    lin = torch.compile(lambda x, v: op.forward(x, v, p.meta, None, None, torch.float32, 12, "reference"),
                        backend="aot_eager", fullgraph=True)
    lin(x, values).sum().backward()
    dense_grad = torch.ones(4, 12, dtype=torch.float64).t() @ x.double()   # dL/dW of sum(x W^T)
    kept_cols = plain_dense(Sparse24Tensor(torch.ones_like(p.values), p.meta, p.shape)).bool()
    torch.testing.assert_close(values.grad.double(), dense_grad[kept_cols].view(12, 18), rtol=1e-6, atol=1e-6)
    assert fmt._BYTE_COLUMNS.keys() == kept.keys() and all(fmt._BYTE_COLUMNS[k] is kept[k] for k in kept)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_decode_layout_layer_on_cpu_runs_the_reference(quantize, monkeypatch, gen):
    """What docs/kernels.md and to_layout's docstring say: on CPU a decode-layout layer's forward runs
    the reference (re-ordering its 128-row blocks per call), never the decode kernel (the interpreter
    runs only through sparse24.linear(..., backend="triton"))."""
    route = []
    for mod, name in ((op, "linear_reference"), (launch, "run"), (launch, "run_prefill")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: route.append(_name) or _real(*a, **k))
    lin = torch.nn.Linear(256, 160).half()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 256, generator=gen))
    mask = top2_mask(lin.weight)
    layer = Sparse24Linear.from_linear(lin, mode="compressed", quantize=quantize)
    if quantize is None:
        w = torch.where(mask, lin.weight.double(), 0.0)
    else:   # the layer's layout v1 INT8 values times its fp32 scales, placed at the mask; the reference
        # computes in x's dtype: the float32 product rounded to float16
        w = dequantized_reference(layer, mask).float().half().double()
    layer.to_layout("decode")
    assert layer.layout == "decode"
    with torch.no_grad():
        for m in (2, 40):   # the decode kernel's and the prefill kernel's M on CUDA
            x = torch.randn(m, 256, generator=gen).half()
            assert_matches_reference(layer(x), x, w, lin.bias.double())
    assert route == ["linear_reference", "linear_reference"]
    # and the docs no longer claim the layer runs the kernel in the interpreter on CPU
    kernels_md = " ".join((ROOT / "docs" / "kernels.md").read_text().split())
    assert "CPU tensors run the kernel in Triton's interpreter, as the tests do" not in kernels_md
    assert "run the decode kernel on CPU" not in Sparse24Linear.to_layout.__doc__

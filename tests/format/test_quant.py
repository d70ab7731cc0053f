"""INT8 quantization of 2:4 weights: scales, exact storage figures, SQNR, errors."""
import math

import pytest
import torch

import sparse24
from sparse24.quant import quantize_values, sqnr_db


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_matches_spec(dtype, gen):
    w = torch.randn(48, 96, generator=gen).to(dtype)
    w[7] = 0  # an all-zero row
    p = sparse24.compress(w)
    q = quantize_values(p, "int8")
    assert q.values.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.scale.shape == (48,)
    assert q.meta is p.meta and q.dtype == dtype and q.shape == p.shape
    # the spec, computed independently: symmetric per row, scale = max|row| / 127
    v = p.values.float()
    scale = v.abs().amax(dim=1) / 127
    scale[7] = 1.0
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.values, torch.round(v / scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert int(q.values.abs().amax(dim=1)[0]) == 127  # each non-zero row uses the full range
    # to_dense gives the dequantized masked weight, error at most half a step per value
    deq = q.to_dense()
    assert deq.dtype == dtype
    err = (deq.double() - p.to_dense().double()).abs()
    step = scale.double()[:, None].expand_as(err)
    slack = 0.0 if dtype == torch.float32 else float(deq.double().abs().max()) * 2 ** -8  # rounding to dtype
    assert bool((err <= step / 2 * (1 + 1e-6) + slack).all())
    assert bool((deq[p.to_dense() == 0] == 0).all())  # pruned entries stay exactly zero



def test_float64_int8_dequantizes_exactly(gen):
    # q * scale (int8 times a float32 scale) is exact in float64: a float64 weight dequantized in float32
    # was off that grid by up to 3e-8 relative
    w = torch.randn(32, 64, generator=gen, dtype=torch.float64)
    q = sparse24.compress(w, quantize="int8")
    kept = sparse24.compress(w).to_dense() != 0
    exact = torch.zeros_like(w)
    exact[kept] = (q.values.double() * q.scale.double()[:, None]).flatten()   # (kept values row-major, in order)
    assert torch.equal(q.to_dense(), exact)
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(sparse24.linear(x, q), x @ exact.t(), rtol=1e-13, atol=1e-13)

def test_compress_quantize_option_and_storage(gen):
    w = torch.randn(64, 128, generator=gen).half()
    q = sparse24.compress(w, quantize="int8")
    assert torch.equal(q.values, quantize_values(sparse24.compress(w)).values)
    # int8 values + 2-bit indices = 62.5% of dense int8, scales reported apart
    assert q.nbytes == 64 * 64 + 64 * 64 // 4
    assert q.nbytes / q.dense_nbytes == 0.625
    assert q.scale_nbytes == 64 * 4
    p = sparse24.compress(w)
    assert p.nbytes / p.dense_nbytes == 0.5625  # fp16 for comparison


def test_sqnr(gen):
    p = sparse24.compress(torch.randn(128, 256, generator=gen))
    q = quantize_values(p)
    db = sqnr_db(p, q)
    # Uniform rounding noise has power step^2 / 12 per kept value (step = the
    # row's scale); pruned entries are exact. Expected SQNR from that model:
    v = p.values.double()
    model = 10 * math.log10(float((v ** 2).sum()) / float((q.scale.double() ** 2 / 12).sum() * v.shape[1]))
    assert db == pytest.approx(model, abs=0.5)
    x = torch.randn(100, generator=gen, dtype=torch.float64)
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, x + 0.1 * x) == pytest.approx(20.0)   # noise power 1% of the signal
    with pytest.raises(ValueError, match="equal shapes"):
        sqnr_db(x, x[:10])
    for bad in (float("inf"), float("nan")):   # ("math domain error" on inf; nan without a word)
        y = x.clone()
        y[3] = bad
        with pytest.raises(ValueError, match="approx has NaN or infinite values"):
            sqnr_db(x, y)
    tiny = torch.full((4,), 1e-160, dtype=torch.float64)   # signal / noise underflows to 0
    assert sqnr_db(tiny, torch.full((4,), 1e10, dtype=torch.float64)) == -math.inf
    with pytest.raises(TypeError, match="approx must be a tensor or Sparse24Tensor, got list"):
        sqnr_db(x, [1.0])


def test_bad_modes_and_inputs(gen):
    p = sparse24.compress(torch.randn(8, 32, generator=gen))
    before = p.values.clone()
    with pytest.raises(ValueError, match="unknown quantization mode 'int2'; supported: 'int8', 'int4'"):
        quantize_values(p, "int2")
    with pytest.raises(ValueError, match="unknown quantization mode 'INT8'"):
        sparse24.compress(torch.randn(8, 32), quantize="INT8")
    with pytest.raises(TypeError, match="quantization mode must be a string"):
        quantize_values(p, 8)
    with pytest.raises(TypeError, match="needs a Sparse24Tensor"):
        quantize_values(torch.randn(8, 32), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_values(quantize_values(p), "int8")
    w = torch.randn(8, 32, generator=gen)
    w[0, 0] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        sparse24.compress(w, quantize="int8")
    assert torch.equal(before, p.values)

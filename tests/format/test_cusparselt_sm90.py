"""The predicted cuSPARSELt sm_90 16-bit buffer (``sparse24.interop._cusparselt_sm90_buffer``):
exact round trips, the values region as layout v1's, and one group's metadata field found where
the layout (worked out by hand from torchao's index arithmetic) puts it. Whether cuSPARSELt agrees
is checked on a GPU by ``scripts/gpu_sparse_mm.py --layout``."""
import pytest
import torch

import sparse24
from sparse24.interop import _cusparselt_sm90_buffer, _from_cusparselt_sm90_buffer


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (192, 128)])
def test_round_trip_keeps_every_bit(dtype, shape, gen):
    p = sparse24.compress(torch.randn(*shape, generator=gen).to(dtype))
    buf = _cusparselt_sm90_buffer(p)
    R, C = shape
    assert buf.dtype == dtype and buf.shape == (R * C * 9 // 16,)
    assert torch.equal(bits(buf[:R * C // 2]), bits(p.values.reshape(-1)))   # the values: layout v1's, row-major
    q = _from_cusparselt_sm90_buffer(buf, shape)
    assert torch.equal(bits(q.values), bits(p.values)) and torch.equal(q.meta, p.meta)


def test_one_groups_field_is_where_the_layout_puts_it():
    R, C = 64, 64
    mask = torch.zeros(R, C // 4, 4, dtype=torch.bool)
    mask[..., :2] = True                     # every group keeps slots 0, 1: field 0 | 1 << 2 = 4
    mask[9, 5] = torch.tensor([False, False, True, True])   # row 9, group 5 keeps 2, 3: 2 | 3 << 2 = 14
    w = torch.arange(1, R * C + 1, dtype=torch.float16).view(R, C) * mask.view(R, C)
    meta = _cusparselt_sm90_buffer(sparse24.compress(w, mask=mask.view(R, C)))[R * C // 2:].view(torch.uint8)
    fields = torch.stack([meta & 15, meta >> 4], 1).reshape(-1)
    # row 9 = the high nibble of row 1's bytes (rows r, r + 8 share one); group 5 of the 32-column chunk:
    # byte 8 * 1 + 4 * ((5 // 2) % 2) + 2 * (5 % 2) + 5 // 4 = 11; high nibble: field 23
    assert int(fields[23]) == 14
    assert (fields == 4).sum() == fields.numel() - 1


def test_int8_weights_export_dequantized(gen):
    p8 = sparse24.compress(torch.randn(64, 128, generator=gen), quantize="int8")
    q = _from_cusparselt_sm90_buffer(_cusparselt_sm90_buffer(p8, dtype=torch.bfloat16), (64, 128))
    assert torch.equal(q.to_dense(), p8.to_dense().bfloat16())


def test_the_buffer_is_a_copy(gen):
    p = sparse24.compress(torch.randn(64, 64, generator=gen).half())
    saved = p.values.clone()
    _cusparselt_sm90_buffer(p).zero_()
    assert torch.equal(p.values, saved)


def test_bad_input_is_refused(gen):
    p = sparse24.compress(torch.randn(64, 64, generator=gen).half())
    with pytest.raises(TypeError, match="Sparse24Tensor"):
        _cusparselt_sm90_buffer(p.to_dense())
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _cusparselt_sm90_buffer(sparse24.compress(torch.randn(64, 64, generator=gen)))
    with pytest.raises(ValueError, match="multiples of 64"):
        _cusparselt_sm90_buffer(sparse24.compress(torch.randn(32, 64, generator=gen).half()))
    buf = _cusparselt_sm90_buffer(p)
    with pytest.raises(ValueError, match="2304 elements"):
        _from_cusparselt_sm90_buffer(buf[:-1], (64, 64))
    with pytest.raises(ValueError, match="multiples of 64"):
        _from_cusparselt_sm90_buffer(buf, (32, 128))

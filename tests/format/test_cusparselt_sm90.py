"""The predicted cuSPARSELt sm_90 16-bit buffer (``sparse24.interop._cusparselt_sm90_buffer``):
exact round trips, the values region as layout v1's, and one group's metadata field found where
the layout (worked out by hand from torchao's index arithmetic) puts it. Whether cuSPARSELt agrees
is checked on a GPU by ``scripts/gpu_sparse_mm.py --layout``."""
import pytest
import torch

import sparse24
from sparse24.interop import _cusparselt_sm90_buffer, _from_cusparselt_sm90_buffer, cusparselt_layout_known


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
    # a bfloat16 weight's INT8 values exported as float16: rounded to bfloat16 first, as to_dense() gives them
    b8 = sparse24.compress(torch.randn(64, 128, generator=gen).bfloat16(), quantize="int8")
    q = _from_cusparselt_sm90_buffer(_cusparselt_sm90_buffer(b8, dtype=torch.float16), (64, 128))
    assert torch.equal(q.to_dense(), b8.to_dense().half())


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


def test_import_stores_a_short_group_our_way():
    """A group with one non-zero may name any free slot (torch's encoder names 2 and 3); read back,
    it is stored as ``compress(dense, mask=dense != 0)`` stores it, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    R, C = 64, 64
    mask = torch.zeros(R, C // 4, 4, dtype=torch.bool)
    keep = torch.rand(R, C // 4, 4, generator=gen).argsort(-1)[..., :2]
    mask.scatter_(-1, keep, True)
    mask[5, 2] = torch.tensor([False, False, True, False])        # row 5, group 2: one non-zero, slot 2
    dense = (torch.randn(R, C, generator=gen).abs() + 1).half() * mask.view(R, C)
    ours = sparse24.compress(dense, mask=dense != 0)
    vals, meta = ours.values.clone(), ours.meta.clone()
    vals[5, 4:6] = torch.tensor([float(dense[5, 10]), 0.0])         # torch's way: slots (2, 3), values (x, 0)
    meta[0, 5] = (meta[0, 5] & ~(0xF << 8)) | ((2 | 3 << 2) << 8)
    theirs = sparse24.Sparse24Tensor(vals, meta, (R, C))
    assert not torch.equal(theirs.meta, ours.meta) and torch.equal(theirs.to_dense(), ours.to_dense())
    q = _from_cusparselt_sm90_buffer(_cusparselt_sm90_buffer(theirs), (R, C))
    assert torch.equal(bits(q.values), bits(ours.values)) and torch.equal(q.meta, ours.meta)


def test_layout_known_only_where_the_probe_matches_byte_for_byte():
    calls = []

    def predicted(dense):   # what the layout predicts cuSPARSELt writes
        calls.append(dense.dtype)
        return _cusparselt_sm90_buffer(sparse24.compress(dense, mask=dense != 0))

    def other_metadata(dense):
        b = predicted(dense)
        return torch.cat([b[:dense.numel() // 2], b[dense.numel() // 2:].flip(0)])

    def refuses(dense):
        raise RuntimeError("cuSPARSELt not supported on your machine")

    cpu = torch.device("cpu")
    assert cusparselt_layout_known(cpu, predicted) and calls == [torch.float16, torch.bfloat16]
    assert cusparselt_layout_known(cpu, predicted) and len(calls) == 2   # checked once per device
    assert not cusparselt_layout_known(cpu, other_metadata)
    assert not cusparselt_layout_known(cpu, refuses)
    assert not cusparselt_layout_known(cpu)   # the default: CUDA devices of compute capability 9.x only

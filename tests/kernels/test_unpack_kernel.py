"""The unpack kernel (kernels/sparse24_unpack.py, Triton's interpreter here): a decode-layout
weight written out dense equals the masked dense weight it was packed from, bit for bit
(INT8: each kept q times its row's float32 scale, rounded once to the output dtype)."""
import pytest
import torch

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import launch


@pytest.mark.parametrize("R,C", [(16, 64), (37, 200), (130, 260)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_16bit_equals_the_masked_weight(R, C, dtype, gen):
    w = torch.randn(R, C, generator=gen).to(dtype)
    masked = w * sparse24.mask_nm(w)
    d = pack_decode(sparse24.compress(w))
    out = launch.unpack_dense(d.values, d.meta, None, (R, C), dtype)
    assert out.shape == (R, C) and out.dtype == dtype
    assert torch.equal(out, masked)


@pytest.mark.parametrize("R,C", [(16, 64), (37, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_int8_equals_the_dequantized_weight(R, C, dtype, gen):
    w = torch.randn(R, C, generator=gen)
    q = sparse24.quantize_values(sparse24.compress(w), "int8")
    # independent of the layouts: the kept positions from the mask, q = round(w / scale)
    kept = sparse24.mask_nm(w).bool()
    scale = w.masked_fill(~kept, 0).abs().amax(1).clamp_min(1e-30) / 127
    expect = torch.where(kept, (w / scale[:, None]).round().clamp(-127, 127) * scale[:, None], 0.0).to(dtype)
    assert torch.equal(q.scale, scale.float())
    d = pack_decode(q)
    out = launch.unpack_dense(d.values, d.meta, d.scale, (R, C), dtype)
    assert torch.equal(out, expect)


def test_unpack_reuses_one_scratch_per_device(gen):
    d = pack_decode(sparse24.compress(torch.randn(32, 128, generator=gen).half()))
    a = launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16)
    small = pack_decode(sparse24.compress(torch.randn(16, 64, generator=gen).half()))
    b = launch.unpack_dense(small.values, small.meta, None, (16, 64), torch.float16)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()

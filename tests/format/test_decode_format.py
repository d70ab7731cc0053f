"""Decode layout version 1 (sparse24.decode_format.DecodePacked): exact round trips,
the documented bit positions, and validation of corrupt input."""
import pytest
import torch

import sparse24
from sparse24.decode_format import DECODE_LAYOUT_VERSION, DecodePacked, pack_decode

SHAPES = [(40, 100), (1, 4), (16, 64), (33, 200), (130, 1100), (0, 8), (7, 0)]


def _case(R, C, dtype):
    return pytest.param(R, C, dtype, id=f"R{R}-C{C}-{str(dtype)[6:]}")


@pytest.mark.parametrize("R,C,dtype", [_case(R, C, dt) for R, C in SHAPES for dt in (torch.float16, torch.bfloat16)])
def test_round_trip_is_exact(R, C, dtype, gen):
    w = torch.randn(R, C, generator=gen).to(dtype)
    p = sparse24.compress(w)
    d = pack_decode(p)
    assert d.version == DECODE_LAYOUT_VERSION == 1
    assert torch.equal(d.to_dense(), w * sparse24.mask_nm(w))     # bit-identical to the masked weight
    q = d.to_sparse24()
    assert torch.equal(q.values, p.values) and torch.equal(q.meta, p.meta)
    assert torch.equal(d.slots(), p.slots())
    d.validate()


@pytest.mark.parametrize("R,C", [(40, 100), (16, 64), (130, 1100)])
def test_int8_round_trip_is_exact(R, C, gen):
    p = sparse24.compress(torch.randn(R, C, generator=gen), quantize="int8")
    d = pack_decode(p)
    assert d.values.dtype == torch.uint8 and d.scale is p.scale
    q = d.to_sparse24()
    assert torch.equal(q.values, p.values) and torch.equal(q.meta, p.meta)
    assert torch.equal(d.to_dense(), p.to_dense())


def test_shapes_and_padding():
    d = pack_decode(sparse24.compress(torch.randn(40, 100).half()))
    # rows padded to 128 (8 row tiles), 100 columns -> 2 atoms, meta atoms to 16
    assert d.values.shape == (2, 2, 8, 32, 8) and d.meta.shape == (8, 32, 16)
    assert d.nbytes == d.values.numel() * 2 + d.meta.numel() * 4
    d8 = pack_decode(sparse24.compress(torch.randn(40, 100), quantize="int8"))
    assert d8.values.shape == (2, 8, 32, 16)


def test_documented_bit_positions():
    """Place one known group and find it where the format comment says."""
    R, C = 16, 128
    w = torch.zeros(R, C, dtype=torch.float16)
    r, col = 8 * 1 + 5, 64 * 1 + 16 * 2 + 4 * 3           # b = 1, i = 5; atom 1, q = 2, j = 3
    w[r, col + 1], w[r, col + 3] = 1.5, -2.0                # slots 1 and 3 kept
    d = pack_decode(sparse24.compress(w))
    lane, g = 4 * 5 + 3, 2 * 2 + 1                          # lane 4i + j, group 2q + b
    code = (int(d.meta[0, lane, 1]) >> (4 * g)) & 15
    assert code == 0b0110                                   # bits: slot 0, slot 1, slot 3, slot 2
    vals = d.values[1, 1, 0, lane, 4 * 0 + 2 * 1:4 * 0 + 2 * 1 + 2]   # h = q // 2, index 4 (q % 2) + 2b + v
    assert vals.tolist() == [1.5, -2.0]
    assert torch.equal(d.to_dense(), w)


def test_int8_sign_magnitude_bytes():
    w = torch.zeros(16, 64)
    w[0, 0], w[0, 1] = -1.0, 0.5                           # quantized to -127 and 64 (scale 1/127)
    p = sparse24.compress(w, quantize="int8")
    d = pack_decode(p)
    # row 0: b = 0, i = 0; columns 0, 1: q = 0, j = 0 -> lane 0, bytes 4q + 2v + b = 0 (lo), 2 (hi)
    assert d.values[0, 0, 0, 0].item() == 0x80 | 127 and d.values[0, 0, 0, 2].item() == 64
    assert torch.equal(d.to_dense(), p.to_dense())


def test_corrupt_keep_mask_is_rejected_with_its_place():
    d = pack_decode(sparse24.compress(torch.randn(40, 100).half()))
    meta = d.meta.clone()
    # row 8*1 + 2 (t 0, b 1, i 2), group column 16*1 + 4*2 + 0 (a 1, q 2, j 0): lane 8, g 5
    meta[0, 8, 1] ^= 1 << 20                                # one keep bit flipped: 1 or 3 slots kept
    with pytest.raises(ValueError, match=r"corrupt decode metadata at row 10, group 24 \(columns 96..99\)"):
        DecodePacked(d.values, meta, d.shape, d.dtype)
    values = d.values.clone()
    values[0, 0, 7, 0, 0] = 1.0                            # row tile 7: rows 112..127, all padding
    with pytest.raises(ValueError, match="padding past the logical shape"):
        DecodePacked(values, d.meta, d.shape, d.dtype)
    with pytest.raises(ValueError, match="meta must be int32 of shape"):
        DecodePacked(d.values, d.meta[:, :, :8], d.shape, d.dtype)


def test_rejects_what_the_layout_cannot_hold(gen):
    with pytest.raises(TypeError, match="float16, bfloat16, INT8 or INT4 values, got torch.float32"):
        pack_decode(sparse24.compress(torch.randn(8, 16, generator=gen)))
    p = sparse24.compress(torch.randn(8, 16, generator=gen), quantize="int8")
    with pytest.raises(ValueError, match="-128 is outside the format's range"):  # validation refuses it first
        sparse24.Sparse24Tensor(torch.full_like(p.values, -128), p.meta, p.shape, p.dtype, p.scale)
    bad = sparse24.Sparse24Tensor(torch.full_like(p.values, -128), p.meta, p.shape, p.dtype, p.scale, check=False)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        pack_decode(bad)
    with pytest.raises(TypeError, match="needs a Sparse24Tensor"):
        pack_decode(torch.randn(8, 16))


INT4_CASES = [(40, 100, 32, True), (130, 260, 64, False), (5, 128, 128, True), (16, 200, 128, False),
              (0, 64, 32, False), (17, 4, 64, True), (3, 0, 32, True)]


@pytest.mark.parametrize("R,C,gs,symmetric", INT4_CASES, ids=[f"R{r}-C{c}-g{g}-{'sym' if s else 'asym'}"
                                                               for r, c, g, s in INT4_CASES])
def test_int4_round_trip_is_exact(R, C, gs, symmetric, gen):
    p = sparse24.compress(torch.randn(R, C, generator=gen), quantize="int4", group_size=gs, symmetric=symmetric)
    d = pack_decode(p)
    assert d.quantized == "int4" and d.group_size == gs and d.values.dtype == torch.uint8
    assert d.values.shape == (-(-C // 64), 8 * -(-R // 128), 32, 8)
    assert d.scale is p.scale and d.zero is p.zero                       # the same tensors as layout v1
    assert (d.zero is None) == symmetric
    q = d.to_sparse24()
    for name in ("values", "meta", "scale", "zero"):
        a, b = getattr(q, name), getattr(p, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert q.group_size == gs and torch.equal(d.slots(), p.slots())
    assert torch.equal(d.to_dense(), p.to_dense())
    d.validate()


def test_int4_documented_bit_positions():
    """One known group, codes and scale found where the layout comment says."""
    R, C = 16, 128
    r, col = 8 * 1 + 5, 64 * 1 + 16 * 3 + 4 * 2           # b = 1, i = 5; atom 1, q = 3 (h 1, qq 1), j = 2
    w = torch.zeros(R, C)
    w[r, col + 0], w[r, col + 2] = 3.0, -7.0                # slots 0 and 2 kept
    p = sparse24.compress(w, quantize="int4", group_size=32)
    assert p.int4_codes()[r, col // 2:col // 2 + 2].tolist() == [11, 1]   # 3 / 1 + 8, -7 / 1 + 8 (scale 1)
    d = pack_decode(p)
    lane = 4 * 5 + 2
    word = int.from_bytes(bytes(d.values[1, 0, lane, 4:8].tolist()), "little")   # h = 1: bytes 4..7
    n = 2 * 1 + 1                                           # nibble 2 qq + b (+ 4 for the higher slot)
    assert (word >> 4 * n) & 15 == 11 and (word >> 4 * (n + 4)) & 15 == 1
    assert torch.equal(d.to_dense(), p.to_dense())


def test_int4_corrupt_input_is_rejected():
    p = sparse24.compress(torch.randn(40, 100), quantize="int4", group_size=32, symmetric=False)
    d = pack_decode(p)
    with pytest.raises(ValueError, match=r"INT4 scale must be float16 of shape \(40, 4\)"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale[:, :3], zero=d.zero, group_size=32)
    with pytest.raises(ValueError, match=r"INT4 zero points must be uint8 of shape \(40, 4\)"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale, zero=d.zero.t(), group_size=32)
    with pytest.raises(ValueError, match="INT4 scale must be float16"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale.float(), zero=d.zero, group_size=32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale, zero=d.zero, group_size=48)
    with pytest.raises(ValueError, match="zero points belong to INT4"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale, zero=d.zero)
    with pytest.raises(ValueError, match=r"values must be torch.uint8 of shape \(2, 8, 32, 8\)"):
        DecodePacked(d.values[:, :, :, :4].contiguous(), d.meta, d.shape, d.dtype, d.scale, group_size=32)
    zero = d.zero.clone()
    zero[7, 2] = 16
    with pytest.raises(ValueError, match="corrupt INT4 zero points at row 7, group 2: 16"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, d.scale, zero=zero, group_size=32)
    scale = d.scale.clone()
    scale[3, 1] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        DecodePacked(d.values, d.meta, d.shape, d.dtype, scale, zero=d.zero, group_size=32)
    values = d.values.clone()
    values[0, 7, 0, 0] = 0x10                               # row tile 7: padding rows
    with pytest.raises(ValueError, match="padding past the logical shape"):
        DecodePacked(values, d.meta, d.shape, d.dtype, d.scale, zero=d.zero, group_size=32)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_to_dense_rows_decodes_only_those_blocks(quantize):
    """``to_dense(rows=...)`` equals the rows of the whole decompression, for slices inside,
    across and at the end of the 128-row blocks (the reference backend's pieces)."""
    w = torch.randn(300, 72, generator=torch.Generator().manual_seed(3))
    p = sparse24.compress(w, quantize=quantize, **({"group_size": 32, "symmetric": False} if quantize == "int4"
                                                   else {})) if quantize else sparse24.compress(w.half())
    d = pack_decode(p)
    full = d.to_dense()
    for sl in (slice(0, 128), slice(5, 17), slice(100, 260), slice(256, 300), slice(290, 400), slice(0, 300),
               slice(128, 128)):
        assert torch.equal(d.to_dense(rows=sl), full[sl]), sl
    with pytest.raises(TypeError, match="step 1"):
        d.to_dense(rows=slice(0, 10, 2))


def test_a_dtype_other_than_the_values_is_refused_and_strided_int4_scales_pack(gen):
    # DecodePacked took a 16-bit layout under another dtype and failed later in to_dense; pack_decode
    # refused a valid INT4 weight whose scales are a strided view
    d = pack_decode(sparse24.compress(torch.randn(8, 64, generator=gen).half()))
    with pytest.raises(ValueError, match="dtype torch.bfloat16 does not match the 16-bit values' torch.float16"):
        sparse24.DecodePacked(d.values, d.meta, d.shape, torch.bfloat16)
    p = sparse24.compress(torch.randn(8, 64, generator=gen), quantize="int4", group_size=32, symmetric=False)
    q = sparse24.Sparse24Tensor(p.values, p.meta, p.shape, p.dtype, torch.stack((p.scale, p.scale), -1)[..., 0],
                                zero=torch.stack((p.zero, p.zero), -1)[..., 0], group_size=32)
    assert not q.scale.is_contiguous()
    assert torch.equal(pack_decode(q).to_sparse24().to_dense(), p.to_dense())
    assert pack_decode(p).scale is p.scale   # contiguous ones stay the very tensors

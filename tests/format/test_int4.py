"""INT4 2:4 storage (layout in sparse24/format.py): the grid against an independent
float64 / numpy reference built from the dense masked weight, the byte count, and
the constructor's refusals."""
import numpy as np
import pytest
import torch

from sparse24.format import Sparse24Tensor, bf16_exact_scales, compress, mask_nm, quantize_values


def _both_exact() -> np.ndarray:
    """Every positive finite float16 value that bfloat16 also holds exactly, ascending (by enumeration)."""
    h = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    return h[h.bfloat16().float() == h].double().numpy()


BOTH_EXACT = _both_exact()


def _bf16_scale(s: float) -> float:
    """The smallest value of BOTH_EXACT at or above s (at most the largest)."""
    return float(BOTH_EXACT[min(np.searchsorted(BOTH_EXACT, s), len(BOTH_EXACT) - 1)])


def _f16_scale(v: float) -> float:
    """The float16 scale of v: the nearest (at least 2**-24), or where that is a subnormal below v the next
    one up (rounded down there, a group's largest weights clipped by up to several steps)."""
    h = np.float16(max(v, 2.0 ** -24))
    if h < v and h < 2.0 ** -14:
        h = np.nextafter(h, np.float16(np.inf))
    return float(h)


def _reference(w: torch.Tensor, group_size: int, symmetric: bool, bf16: bool = False) -> np.ndarray:
    """Dense dequantized 2:4 INT4 weight, computed from the dense masked weight column group
    by column group in numpy (float16 scales as the format stores them; ``bf16``: the smallest
    float16 value at or above the scale that bfloat16 holds too, as for bfloat16 weights)."""
    rnd = _bf16_scale if bf16 else _f16_scale
    wm = (w * mask_nm(w)).double().numpy()
    keep = mask_nm(w).numpy()
    out = np.zeros_like(wm)
    R, C = wm.shape
    for r in range(R):
        for c0 in range(0, C, group_size):
            cols = np.arange(c0, min(C, c0 + group_size))
            kept = wm[r, cols][keep[r, cols]]
            if symmetric:
                amax = np.abs(kept).max(initial=0.0)
                s = rnd(amax / 7) if amax > 0 else 1.0
                q = np.clip(np.round(kept / s), -7, 7)
            else:
                lo, hi = min(kept.min(initial=0.0), 0.0), max(kept.max(initial=0.0), 0.0)
                s = rnd((hi - lo) / 15) if hi > lo else 1.0
                z = np.clip(np.round(-lo / s), 0, 15)
                q = np.clip(np.round(kept / s) + z, 0, 15) - z
            dense = np.zeros(len(cols))
            dense[keep[r, cols]] = q * s
            out[r, cols] = dense
    return out


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(5, 128), (3, 200), (7, 36), (1, 4)])
@pytest.mark.parametrize("magnitude", [1.0, 1e-5])   # 1e-5: scales in float16's subnormals
def test_int4_grid_matches_independent_reference(group_size, symmetric, shape, magnitude):
    torch.manual_seed(sum(shape) + group_size)
    w = torch.randn(*shape) * torch.logspace(-2, 1, shape[1]) * magnitude  # groups of very different scale
    q = compress(w, quantize="int4", group_size=group_size, symmetric=symmetric)
    assert q.quantized == "int4" and q.values.dtype == torch.uint8 and q.scale.dtype == torch.float16
    got = q.to_dense().double().numpy()
    np.testing.assert_array_equal(got, _reference(w, group_size, symmetric).astype(np.float32))
    # error of each kept value <= half its group's scale (times the float16 rounding of the scale)
    s = q.scale.double().repeat_interleave(group_size, 1)[:, :shape[1]]
    kept = mask_nm(w)
    err = (torch.from_numpy(got) - (w * kept).double()).abs()
    assert bool((err[kept] <= s[kept] * 0.5 * (1 + 2 ** -10)).all())


def test_bf16_exact_scales_are_the_nearest_above_that_both_types_hold():
    """bf16_exact_scales against an enumeration of every float16 value bfloat16 holds exactly:
    the smallest at or above each scale, from below float16's subnormals (2**-24 at least) to
    past 65280 (the largest such: 65504 has 11 significant bits), float16 and bfloat16 alike."""
    gen = torch.Generator().manual_seed(3)
    s = torch.cat([torch.rand(4000, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(-30, 17, (4000,),
                                                                                                generator=gen),
                   torch.tensor([2.0 ** -26, 2.0 ** -24, 2.0 ** -17 + 2.0 ** -24, 129 * 2.0 ** -17, 1.0,
                                 1 + 2.0 ** -10, 1 + 2.0 ** -7, 65280.0, 65281.0, 65504.0], dtype=torch.float64)])
    got = bf16_exact_scales(s)
    assert got.dtype == torch.float16
    assert torch.equal(got.float().bfloat16().float(), got.float())   # bfloat16 holds each
    want = torch.tensor([_bf16_scale(v) for v in s.tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert bool((got.double() >= s.clamp(max=65280)).all())


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_bf16_weights_get_scales_bfloat16_holds(group_size, symmetric):
    """A bfloat16 weight's INT4 grid: the scales rounded up to values bfloat16 holds exactly (so
    bfloat16 x scales a code in one step: docs/kernels.md), the rest of the rule unchanged, every
    kept value within half its scale; other dtypes keep float16's nearest scale."""
    torch.manual_seed(group_size)
    w = (torch.randn(6, 200) * torch.logspace(-2, 1, 200)).bfloat16()
    q = compress(w, quantize="int4", group_size=group_size, symmetric=symmetric)
    assert torch.equal(q.scale.float().bfloat16().float(), q.scale.float())
    assert q.dtype == torch.bfloat16
    got = q.to(dtype=torch.float32).to_dense().double().numpy()   # (u - z) * s, exact in float32
    np.testing.assert_array_equal(got, _reference(w.float(), group_size, symmetric, bf16=True))
    kept = mask_nm(w.float())
    s = q.scale.double().repeat_interleave(group_size, 1)[:, :200]
    assert bool(((torch.from_numpy(got) - (w * kept).double()).abs()[kept] <= s[kept] * 0.5).all())
    f16 = compress(w.half(), quantize="int4", group_size=group_size, symmetric=symmetric)
    assert not torch.equal(f16.scale.float().bfloat16().float(), f16.scale.float())   # 11 bits where needed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int4_keeps_logical_dtype_and_rows(dtype):
    w = torch.randn(9, 96).to(dtype)
    q = compress(w, quantize="int4", group_size=32)
    assert q.dtype == dtype and q.to_dense().dtype == dtype
    assert torch.equal(q.to_dense(rows=slice(2, 7)), q.to_dense()[2:7])
    assert torch.equal(q.to_dense(rows=slice(1, 9, 3)), q.to_dense()[1:9:3])
    assert torch.equal(q.dequantized_values(torch.float64).float(), q.dequantized_values(torch.float32))
    back = q.to(dtype=torch.float32)
    assert back.dtype == torch.float32 and torch.equal(back.values, q.values)


def test_int4_codes_and_layout():
    """One byte per group, lower slot in the low nibble; codes 1..15 when symmetric."""
    w = torch.tensor([[0.0, 7.0, 0.0, -3.5] * 8])  # 32 columns: one group of 32
    q = compress(w, quantize="int4", group_size=32)
    assert float(q.scale[0, 0]) == 1.0
    assert q.values.tolist() == [[(8 + 7) | ((8 - 4) << 4)] * 8]  # -3.5 rounds half to even: -4
    assert q.int4_codes()[0, :2].tolist() == [15, 4]


def test_int4_storage_is_under_a_fifth_of_fp16():
    w = torch.randn(64, 1024, dtype=torch.float16)
    for symmetric, frac in ((True, 0.1953125), (False, 0.19921875)):
        q = compress(w, quantize="int4", group_size=128, symmetric=symmetric)
        assert (q.nbytes + q.scale_nbytes) / (w.numel() * 2) == frac
    q = compress(w, quantize="int4", group_size=32)
    assert (q.nbytes + q.scale_nbytes) / (w.numel() * 2) == (0.25 + 0.125 + 2 / 32) / 2


def test_int4_refusals():
    w = torch.randn(4, 64)
    q = compress(w, quantize="int4", group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        compress(w, quantize="int4", group_size=48)
    with pytest.raises(TypeError, match="only apply to quantize='int4'"):
        compress(w, quantize="int8", group_size=64)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_values(q, "int4")
    with pytest.raises(ValueError, match="non-finite"):
        compress(torch.full((4, 64), float("inf")), quantize="int4")
    with pytest.raises(ValueError, match="float16's range"):
        compress(torch.full((4, 64), 1e6), quantize="int4")
    with pytest.raises(TypeError, match="uint8"):
        Sparse24Tensor(q.values.to(torch.int8), q.meta, (4, 64), torch.float32, q.scale, group_size=64)
    with pytest.raises(ValueError, match="one byte per group"):
        Sparse24Tensor(q.values[:, :8], q.meta, (4, 64), torch.float32, q.scale, group_size=64)
    with pytest.raises(ValueError, match="float16 of shape"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, q.scale.float(), group_size=64)
    with pytest.raises(ValueError, match="float16 of shape"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, q.scale, group_size=32)
    with pytest.raises(ValueError, match="need scales"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, None, group_size=64)
    with pytest.raises(ValueError, match="pass group_size"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, q.scale, zero=q.values)
    zero = torch.full((4, 1), 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zero points at row 0, group 0"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, q.scale, zero=zero, group_size=64)
    with pytest.raises(ValueError, match="non-finite"):
        Sparse24Tensor(q.values, q.meta, (4, 64), torch.float32, torch.full_like(q.scale, float("nan")),
                       group_size=64)


def test_int4_state_tensors_round_trip():
    w = torch.randn(6, 160)
    q = compress(w, quantize="int4", group_size=64, symmetric=False)
    st = q.state_tensors()
    assert set(st) == {"values", "meta", "scale", "zero"}
    again = Sparse24Tensor(st["values"], st["meta"], q.shape, q.dtype, st["scale"], zero=st["zero"],
                           group_size=64)
    assert torch.equal(again.to_dense(), q.to_dense())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("lo", [0.0, -1000.0, -65504.0])
def test_float16_grids_stay_inside_float16(symmetric, lo):
    """A float16 weight reaching float16's largest value, 65504: the float16-rounded scale put the
    grid's end at 65520 (symmetric: fp16(65504 / 7) = 9360, 7 x 9360; asymmetric all-positive:
    15 x fp16(65504 / 15) = 15 x 4368), which every float16 dequantization (to_dense, the reference
    backend, a kernel's 16-bit operands) rounds to inf. Float16 weights' grids end inside
    float16's range, each value still within half a step of its grid point."""
    w = torch.zeros(4, 64, dtype=torch.float16)
    w[:, 0], w[:, 5], w[1, 9], w[2, 12], w[3, 33] = 65504.0, lo, 1.0, -0.5, 300.0
    q = quantize_values(compress(w), "int4", group_size=32, symmetric=symmetric)
    dense = q.to_dense()
    assert torch.isfinite(dense).all()
    # each kept value within half a step of the original (plus the scale's float16 rounding)
    scale = q.scale.double().repeat_interleave(32, dim=1)
    err = (dense.double() - w.double()).abs()
    assert bool((err <= scale * (0.5 + 15 * 2.0 ** -11)).all()), (err / scale).max()
    # symmetric: every code of every group's grid (1..15: -7..7 steps) inside float16
    if symmetric:
        assert bool((7 * q.scale.double() <= 65504).all())
    # bfloat16 and float32 weights keep their grids (their types hold 65520)
    for dtype in (torch.float32, torch.bfloat16):
        q2 = quantize_values(compress(w.to(dtype)), "int4", group_size=32, symmetric=symmetric)
        assert torch.isfinite(q2.to_dense()).all()


def test_int4_weight_with_no_rows_unpacks():
    """0 output rows (an empty shard): the codes, the dequantized values and a merge are empty, as INT8's
    (``_unpack_nibbles`` reshaped with -1, ambiguous for 0 elements)."""
    from torch import nn
    from sparse24 import Sparse24Linear
    p = compress(torch.empty(0, 64), quantize="int4", group_size=32)
    assert p.int4_codes().shape == (0, 32)
    assert p.dequantized_values().shape == (0, 32)
    layer = Sparse24Linear.from_linear(nn.Linear(64, 0), mode="compressed", quantize="int4", group_size=32)
    assert layer.add_to_kept_(torch.zeros(0, 64)) is layer
    assert layer(torch.randn(3, 64)).shape == (3, 0)

"""N:M masks and the compressed 2:4 format, against independent brute force."""
import io
import itertools

import pytest
import torch

import sparse24
from sparse24.format import Sparse24Tensor

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(1, 4), (13, 36), (67, 100), (16, 128), (5, 32)]


def brute_force_best(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Max kept magnitude per group, by trying every way to keep n of m (float64)."""
    a = w.abs().double().view(-1, m)
    best = torch.full((a.shape[0],), -1.0, dtype=torch.float64)
    for combo in itertools.combinations(range(m), n):
        best = torch.maximum(best, a[:, list(combo)].sum(-1))
    return best


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (4, 8), (3, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_keeps_the_optimum(n, m, dtype, gen):
    w = torch.randn(24, 8 * m, generator=gen).to(dtype)
    mask = sparse24.mask_nm(w, n, m)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    assert bool((mask.view(-1, m).sum(-1) == n).all())
    kept = (w.abs().double() * mask).view(-1, m).sum(-1)
    torch.testing.assert_close(kept, brute_force_best(w, n, m), rtol=0, atol=0)


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8)])
def test_mask_ties_go_to_lower_columns(n, m):
    # Many ties: small integers with random signs; the lowest columns win.
    g = torch.Generator().manual_seed(7)
    w = torch.randint(-2, 3, (40, 4 * m), generator=g).float()
    mask = sparse24.mask_nm(w, n, m)
    a, keep = w.abs().view(-1, m), mask.view(-1, m)
    # Independent rule: column j is kept iff fewer than n columns beat it,
    # where i beats j if |w_i| > |w_j|, or equal and i < j.
    idx = torch.arange(m)
    beats = (a[:, :, None] > a[:, None, :]) | ((a[:, :, None] == a[:, None, :]) & (idx[:, None] < idx[None, :]))
    expected = beats.sum(1) < n
    assert torch.equal(keep, expected)
    assert torch.equal(sparse24.mask_nm(torch.ones(3, 8), 2, 4)[0], torch.tensor([1, 1, 0, 0] * 2, dtype=torch.bool))


def test_mask_handles_inf_and_signed_zero():
    w = torch.tensor([[float("-inf"), 0.0, -0.0, 1.0], [0.0, -0.0, 0.0, -0.0]])
    mask = sparse24.mask_nm(w)
    assert mask.tolist() == [[True, False, False, True], [True, True, False, False]]


def test_mask_rejects_nan_and_bad_arguments():
    w = torch.randn(4, 8)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sparse24.mask_nm(w)
    with pytest.raises(ValueError, match="divisible by m=4"):
        sparse24.mask_nm(torch.randn(4, 6))
    with pytest.raises(ValueError, match="2-D"):
        sparse24.mask_nm(torch.randn(4, 4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        sparse24.mask_nm(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="0 <= n <= m"):
        sparse24.mask_nm(torch.randn(4, 8), 5, 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        sparse24.mask_nm([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(TypeError, match="unexpected arguments"):
        sparse24.mask_nm(torch.randn(4, 8), act_norm=torch.ones(8))


def test_is_nm():
    w = torch.randn(8, 16)
    assert not sparse24.is_nm(w)
    assert sparse24.is_nm(w * sparse24.mask_nm(w))
    assert sparse24.is_nm(w * sparse24.mask_nm(w, 1, 4), 1, 4)
    assert not sparse24.is_nm(w * sparse24.mask_nm(w, 2, 4), 1, 4)
    assert sparse24.is_nm(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="divisible"):
        sparse24.is_nm(torch.zeros(2, 6))


def _bits(t: torch.Tensor) -> torch.Tensor:
    ity = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ity)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(shape, dtype, gen):
    w = torch.randn(*shape, generator=gen).to(dtype)
    mask = sparse24.mask_nm(w)
    masked = torch.where(mask, w, torch.zeros((), dtype=dtype))
    for p in (sparse24.compress(w), sparse24.compress(w, mask=mask)):
        assert p.dtype == dtype and p.shape == w.shape
        assert p.values.shape == (shape[0], shape[1] // 2) and p.values.dtype == dtype
        assert p.meta.shape == ((shape[1] + 31) // 32, shape[0]) and p.meta.dtype == torch.int32
        dense = p.validate().to_dense()
        assert torch.equal(dense, w * mask)
        assert torch.equal(_bits(dense), _bits(masked))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_with_sparser_masks(dtype, gen):
    # Groups keeping 0 or 1 columns (1:4 masks, all-zero rows) are 2:4 too.
    w = torch.randn(13, 68, generator=gen).to(dtype)
    mask = sparse24.mask_nm(w, 1, 4)
    mask[3] = False
    mask[5, :8] = True
    mask[5, :8:2] = False  # groups of row 5 keep columns 1 and 3
    for m in (mask, torch.zeros_like(mask)):
        p = sparse24.compress(w, mask=m).validate()
        assert torch.equal(p.to_dense(), torch.where(m, w, torch.zeros((), dtype=dtype)))


def test_layout_matches_the_documented_bits():
    # One row, 16 groups (2 words): slots chosen by hand, words built by hand from the docstring.
    w = torch.arange(1, 65, dtype=torch.float32).view(1, 64)
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 3), (1, 2)] * 2
    mask = torch.zeros(1, 64, dtype=torch.bool)
    for g, (a, b) in enumerate(pairs):
        mask[0, 4 * g + a] = mask[0, 4 * g + b] = True
    p = sparse24.compress(w, mask=mask)
    word = 0
    for g, (a, b) in enumerate(pairs[:8]):
        word |= (a | b << 2) << (4 * g)
    expected = torch.tensor([word], dtype=torch.int64).to(torch.int32)  # wraps like the int32 storage
    assert p.meta.shape == (2, 1) and p.meta[:, 0].tolist() == [int(expected)] * 2
    assert p.values[0].tolist() == [4 * g + s + 1.0 for g, pair in enumerate(pairs) for s in pair]


@pytest.mark.parametrize("dtype,ratio", [(torch.float16, 0.5625), (torch.bfloat16, 0.5625),
                                         (torch.float32, 0.53125), (torch.float64, 0.515625)])
@pytest.mark.parametrize("shape", [(64, 128), (16, 32), (13, 36), (1, 4)], ids=str)
def test_storage_figures_are_exact(dtype, ratio, shape):
    p = sparse24.compress(torch.randn(*shape).to(dtype))
    R, C = shape
    size = torch.empty((), dtype=dtype).element_size()
    assert p.dense_nbytes == R * C * size
    assert p.nbytes == R * C // 2 * size + -(-R * C // 8)  # index bits rounded up to bytes
    if R * C % 8 == 0:
        assert p.nbytes / p.dense_nbytes == ratio
    assert p.scale_nbytes == 0


def _corrupt(p: Sparse24Tensor, row: int, group: int, lo: int, hi: int) -> Sparse24Tensor:
    meta = p.meta.clone()
    word, pos = divmod(group, 8)
    v = int(meta[word, row]) & ~(0xF << (4 * pos))
    v |= (lo | hi << 2) << (4 * pos)
    meta[word, row] = torch.tensor(v, dtype=torch.int64).to(torch.int32)
    return Sparse24Tensor(p.values, meta, p.shape, p.dtype, check=False)


def test_validate_reports_corrupt_metadata(gen):
    p = sparse24.compress(torch.randn(6, 72, generator=gen))
    with pytest.raises(ValueError, match=r"row 4, group 9 .*slots 2 and 2"):
        _corrupt(p, 4, 9, 2, 2).validate()
    with pytest.raises(ValueError, match=r"row 0, group 17 .*slots 3 and 1"):
        _corrupt(p, 0, 17, 3, 1).validate()
    meta = p.meta.clone()
    meta[-1, 2] |= 1 << 20  # past column 72: padding
    with pytest.raises(ValueError, match="row 2: padding bits"):
        Sparse24Tensor(p.values, meta, p.shape, check=False).validate()
    assert p.validate() is p


def test_constructor_validates_hand_built_metadata(gen):
    # Without the check, one slot claimed twice decodes to a wrong matrix that
    # linear would use silently.
    p = sparse24.compress(torch.randn(6, 72, generator=gen))
    bad = _corrupt(p, 4, 9, 2, 2)
    with pytest.raises(ValueError, match=r"row 4, group 9 .*slots 2 and 2"):
        Sparse24Tensor(bad.values, bad.meta, bad.shape)
    q = sparse24.compress(torch.randn(6, 72, generator=gen), quantize="int8")
    with pytest.raises(ValueError, match="non-finite"):
        Sparse24Tensor(q.values, q.meta, q.shape, torch.float32, torch.full((6,), float("inf")))
    assert torch.equal(Sparse24Tensor(p.values, p.meta, p.shape).to_dense(), p.to_dense())


def test_constructor_rejects_inconsistent_parts(gen):
    p = sparse24.compress(torch.randn(8, 64, generator=gen))
    with pytest.raises(ValueError, match="values must have shape"):
        Sparse24Tensor(p.values[:, :-1], p.meta, p.shape)
    with pytest.raises(ValueError, match="meta must be int32"):
        Sparse24Tensor(p.values, p.meta.long(), p.shape)
    with pytest.raises(ValueError, match="divisible by 4"):
        Sparse24Tensor(p.values, p.meta, (8, 66))
    with pytest.raises(TypeError, match="floating point"):
        Sparse24Tensor(p.values.int(), p.meta, p.shape)
    with pytest.raises(ValueError, match="one device"):
        Sparse24Tensor(p.values, p.meta.to("meta"), p.shape)


def test_compress_rejects_bad_input_and_changes_nothing(gen):
    w = torch.randn(8, 16, generator=gen)
    w_before = w.clone()
    with pytest.raises(ValueError, match="divisible by m=4"):
        sparse24.compress(torch.randn(8, 10))
    with pytest.raises(ValueError, match="2-D"):
        sparse24.compress(torch.randn(16))
    with pytest.raises(TypeError, match="floating-point"):
        sparse24.compress(torch.ones(8, 16, dtype=torch.int8))
    mask = sparse24.mask_nm(w)
    mask[5, 8:12] = torch.tensor([True, True, True, False])  # group 2 of row 5 keeps 3
    mask_before = mask.clone()
    with pytest.raises(ValueError, match=r"not 2:4: row 5, group 2 \(columns 8..11\) keeps 3 of 4"):
        sparse24.compress(w, mask=mask)
    with pytest.raises(TypeError, match="mask must be bool"):
        sparse24.compress(w, mask=mask_before.float())
    with pytest.raises(ValueError, match="does not match weight shape"):
        sparse24.compress(w, mask=mask_before[:, :8])
    with pytest.raises(ValueError, match="mask is on meta"):
        sparse24.compress(w, mask=mask_before.to("meta"))
    with pytest.raises(TypeError, match="unexpected arguments"):
        sparse24.compress(w, masks=mask)
    assert torch.equal(w, w_before) and torch.equal(mask, mask_before)


def test_to_moves_and_casts(gen):
    w = torch.randn(8, 32, generator=gen)
    p = sparse24.compress(w)
    q = p.to(dtype=torch.float16)
    assert q.dtype == torch.float16 and q.values.dtype == torch.float16
    assert torch.equal(q.to_dense(), p.to_dense().half())
    m = p.to("meta")
    assert m.device.type == "meta" and m.meta.device.type == "meta"
    with pytest.raises(TypeError, match="cannot cast"):
        p.to(dtype=torch.int32)


def test_state_tensors_round_trip_through_torch_save(gen):
    w = torch.randn(12, 40, generator=gen).half()
    p = sparse24.compress(w)
    buf = io.BytesIO()
    torch.save(p.state_tensors(), buf)
    buf.seek(0)
    d = torch.load(buf, weights_only=True)
    q = Sparse24Tensor(d["values"], d["meta"], (12, 40)).validate()
    assert torch.equal(q.to_dense(), p.to_dense())


def test_to_dense_rows_slice(gen):
    p = sparse24.compress(torch.randn(20, 36, generator=gen))
    assert torch.equal(p.to_dense(rows=slice(5, 11)), p.to_dense()[5:11])
    with pytest.raises(TypeError, match="slice"):
        p.to_dense(rows=5)


def test_is_nm_on_non_contiguous_input(gen):
    w = torch.randn(16, 16, generator=gen)
    mask = sparse24.mask_nm(w, method="2d_optimal")
    assert sparse24.is_nm((w * mask).t())  # transposable: columns are 2:4 too
    assert not sparse24.is_nm(w.t())


def test_bad_arguments_give_clear_errors(gen):
    # is_nm on a list / 0-d tensor used to raise AttributeError / IndexError
    with pytest.raises(TypeError, match="torch.Tensor"):
        sparse24.is_nm([[1.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="at least 1 dimension"):
        sparse24.is_nm(torch.tensor(1.0))
    p = sparse24.compress(torch.randn(8, 32, generator=gen), quantize="int8")
    with pytest.raises(TypeError, match="scale must be a tensor"):  # was AttributeError
        Sparse24Tensor(p.values, p.meta, p.shape, torch.float32, [1.0] * 8)
    with pytest.raises(ValueError, match=r"logical \(R, C\) pair"):
        Sparse24Tensor(p.values, p.meta, (8, 32, 1), torch.float32, p.scale)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_zero_row_weight_compresses(quantize):
    # (0, C) weights used to fail in the metadata packing with a reshape RuntimeError
    p = sparse24.compress(torch.randn(0, 40), quantize=quantize)
    assert p.meta.shape == (2, 0) and p.values.shape == (0, 20)
    assert p.validate().to_dense().shape == (0, 40)
    assert sparse24.linear(torch.randn(3, 40), p).shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_dense_over_several_cpu_blocks_keeps_every_bit(dtype, monkeypatch, gen):
    # Blocks of 2 rows (to_dense writes a CPU weight a cache-sized block at a time; 16-bit floats
    # move as int16 bits): special values too, compared bit for bit with the masked weight.
    monkeypatch.setattr(sparse24.format, "_DENSE_BLOCK", 2 * 68)
    w = torch.randn(9, 68, generator=gen).to(dtype)
    w[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]).to(dtype)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, 0::4] = mask[:, 1::4] = True
    dense = sparse24.compress(w, mask=mask).to_dense()
    assert torch.equal(_bits(dense), _bits(torch.where(mask, w, torch.zeros((), dtype=dtype))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_to_dense_passes_gradients_to_trainable_values(dtype, gen):
    # Values that require grad take the float scatter (the int16 bit path would drop the gradient).
    w = torch.randn(6, 32, generator=gen).to(dtype)
    p = sparse24.compress(w)
    p.values.requires_grad_(True)
    g = torch.randn(6, 32, generator=gen).to(dtype)
    (p.to_dense() * g).sum().backward()
    mask = sparse24.mask_nm(w)
    assert torch.equal(p.values.grad, g[mask].view(6, 16))  # d/dvalues: g at the kept positions, row order


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_kept_mask_is_the_mask_compressed(quantize):
    """kept_mask() reads the 2-bit slots back: the mask given to compress, even where a kept value
    is zero (so it cannot be read off the values)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 40, generator=g)
    mask = sparse24.mask_nm(w)
    w[0, mask[0].nonzero()[0]] = 0.0  # a kept zero
    p = sparse24.compress(w, mask, quantize=quantize)
    assert p.kept_mask().dtype == torch.bool and torch.equal(p.kept_mask(), mask)


def test_one_metadata_word_per_row_in_a_loaded_buffer():
    # in_features 32: meta is (1, R). Loaded from a file its strides are (R, 1), and the decompression's
    # meta[:, rows].t().contiguous() kept that transposed view (a size-1 dim's stride does not count), which
    # view(uint8) refused: every forward of such a layer loaded by from_pretrained raised
    w = torch.randn(48, 32, dtype=torch.float64)
    p = sparse24.compress(w)
    meta = torch.empty(p.meta.shape, dtype=p.meta.dtype)
    meta.copy_(p.meta)
    assert p.meta.shape[0] == 1 and meta.stride() == (48, 1)
    loaded = Sparse24Tensor(p.values.clone(), meta, (48, 32), torch.float64)
    want = w * sparse24.mask_nm(w)
    assert torch.equal(loaded.to_dense(), want) and torch.equal(loaded.to_dense(rows=slice(5, 40)), want[5:40])

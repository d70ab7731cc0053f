"""Export/import with torch's 2:4 (CUTLASS) layout, checked on CPU against
torch's own pure-torch conversions: every comparison is bit for bit (values
compared as integers, so the sign of a zero counts)."""
import itertools
import warnings

import pytest
import torch
from torch.sparse import SparseSemiStructuredTensorCUTLASS
from torch.sparse._semi_structured_conversions import (_calculate_meta_reordering_scatter_offsets,
                                                        sparse_semi_structured_from_dense_cutlass as torch_from_dense,
                                                        sparse_semi_structured_to_dense_cutlass as torch_to_dense)

import sparse24
from sparse24.interop import from_cutlass_layout, from_semi_structured, to_cutlass_layout, to_semi_structured

SHAPES = [(32, 64), (64, 192), (96, 128)]
HALF = [torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor: equality of bits, -0.0 != +0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def every_group_encoding():
    """Every valid way to store one 2:4 group: ``(signs, lo, hi, zero_signs)``.

    ``signs``: each of the 4 positions zero / positive / negative with at most
    two non-zeros (33 of the 3^4 = 81 patterns; more non-zeros is not 2:4).
    ``lo < hi``: every pair of stored slots that holds the non-zeros (a short
    group may name any free slot). ``zero_signs``: the sign of each stored zero
    (+0.0 or -0.0: a pruned negative weight times a mask is -0.0).
    """
    out = []
    for signs in itertools.product((0, 1, -1), repeat=4):
        nonzero = {i for i, s in enumerate(signs) if s}
        if len(nonzero) > 2:
            continue
        for lo, hi in itertools.combinations(range(4), 2):
            if nonzero <= {lo, hi}:
                stored_zeros = [s for s in (lo, hi) if s not in nonzero]
                for zs in itertools.product((1.0, -1.0), repeat=len(stored_zeros)):
                    out.append((signs, lo, hi, dict(zip(stored_zeros, zs))))
    return out


ENCODINGS = every_group_encoding()


def test_the_encoding_list_is_complete():
    patterns = {e[0] for e in ENCODINGS}
    assert len(patterns) == 1 + 4 * 2 + 6 * 4 == 33
    # 24 full groups; 8 one-non-zero patterns x 3 slot pairs x 2 zero signs; 6 pairs x 4 zero signs
    assert len(ENCODINGS) == 24 + 8 * 3 * 2 + 6 * 4 == 96


def encoding_matrix(dtype, gen, R=64, C=128):
    """A matrix holding every encoding of :data:`ENCODINGS`, each at each of the
    4 group positions of a metadata int16 and in several rows and words.

    Returns ``dense`` (R, C) (stored zeros with their sign, +0.0 elsewhere),
    ``keep`` (R, C) bool (the stored slots), ``nib`` (R, C/4) int nibbles
    ``lo | hi << 2`` and ``vals`` (R, C/4, 2) stored values.
    """
    G = C // 4
    f = torch.arange(R * G)
    # the 4 groups of one int16 hold 4 different encodings; each encoding visits each position
    enc = (f // 4 + 24 * (f % 4)) % len(ENCODINGS)
    assert all(len(set(enc[f % 4 == i].tolist())) == len(ENCODINGS) for i in range(4))
    mag = torch.rand(R * G, 4, generator=gen) + 0.5
    dense = torch.zeros(R * G, 4)
    keep = torch.zeros(R * G, 4, dtype=torch.bool)
    nib = torch.zeros(R * G, dtype=torch.int64)
    for g, e in enumerate(enc.tolist()):
        signs, lo, hi, zero_signs = ENCODINGS[e]
        dense[g] = torch.tensor(signs) * mag[g]
        for s, z in zero_signs.items():
            dense[g, s] = z * 0.0
        keep[g, [lo, hi]] = True
        nib[g] = lo | hi << 2
    dense = dense.to(dtype)
    vals = dense[keep].view(R, G, 2)
    return dense.view(R, C), keep.view(R, C), nib.view(R, G), vals


def cutlass_bits(nib, vals):
    """torch's CUTLASS layout of an arbitrary valid encoding (torch's encoder
    only produces its own choice): 4 nibbles per int16, lowest group in the
    lowest bits, then torch's reordering. Checked against torch's decoder."""
    R, G = nib.shape
    n = nib.view(R, G // 4, 4)
    halves = n[..., 0] | n[..., 1] << 4 | n[..., 2] << 8 | n[..., 3] << 12
    halves = halves - ((halves >> 15) << 16)  # as signed 16-bit values
    meta = torch.empty(R * G // 4, dtype=torch.int16)
    meta.scatter_(0, _calculate_meta_reordering_scatter_offsets(R, G // 4, torch.int16, "cpu"),
                  halves.to(torch.int16).view(-1))
    return vals.reshape(R, 2 * G).clone(), meta.view(R, G // 4)


@pytest.mark.parametrize("dtype", HALF)
def test_export_equals_torch_encoder_for_every_group_encoding(dtype, gen):
    dense, keep, _, _ = encoding_matrix(dtype, gen)
    p = sparse24.compress(dense, mask=keep)  # stores exactly the slots in keep, zeros with their sign
    assert same_bits(p.to_dense(), dense)
    packed, meta = to_cutlass_layout(p)
    ref_packed, ref_meta = torch_from_dense(dense)
    assert same_bits(packed, ref_packed) and same_bits(meta, ref_meta)


def test_export_re_picks_the_slots_of_a_short_group_as_torch_does():
    # the example: [0, 0, x, 0]; ours stores slots (0, 2), torch's encoder (2, 3)
    w = torch.zeros(32, 64, dtype=torch.float16)
    w[:, 2::4] = 3.0
    p = sparse24.compress(w)
    assert p.slots()[0, 0].tolist() == [0, 2] and p.values[0, :2].tolist() == [0.0, 3.0]
    packed, meta = to_cutlass_layout(p)
    assert packed[0, :2].tolist() == [3.0, 0.0]
    assert same_bits(meta, torch_from_dense(w)[1]) and int(meta[0, 0]) & 0xF == 2 | 3 << 2


def short_groups(p) -> int:
    """Groups of ``p`` holding fewer than two non-zeros (where the encodings differ)."""
    return int(((p.dequantized_values().reshape(-1, 2) != 0).sum(-1) < 2).sum())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", HALF)
def test_export_of_weights_with_zeros_matches_torch_bit_for_bit(shape, dtype, gen):
    w = torch.randn(*shape, generator=gen).to(dtype)
    w[w.abs() < 0.3] = 0  # exact zeros (~24% of entries): short groups in every matrix
    p = sparse24.compress(w)
    assert short_groups(p) > 0
    packed, meta = to_cutlass_layout(p)
    assert same_bits(torch_to_dense(packed, meta), p.to_dense())
    assert torch.equal(p.to_dense(), w * sparse24.mask_nm(w))
    ref_packed, ref_meta = torch_from_dense(p.to_dense())
    assert same_bits(packed, ref_packed) and same_bits(meta, ref_meta)


@pytest.mark.parametrize("dtype", HALF)
def test_export_of_2d_greedy_and_int8_weights_matches_torch(dtype, gen):
    w = torch.randn(128, 256, generator=gen)
    # 2-D greedy masks keep fewer than 2 in some groups (3.9% of a random matrix)
    p = sparse24.compress(w, mask=sparse24.mask_nm(w, method="2d_greedy"))
    # INT8 rounds small values to exact zeros: short groups appear after dequantization
    p8 = sparse24.compress(w * torch.linspace(1e-3, 1, 256), quantize="int8")
    # a quantized weight of the other 16-bit logical dtype: its dequantized values are rounded to that dtype
    # first, as to_dense() gives them (cast straight to the export dtype, 5245 of 6144 values differed)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    cross = [sparse24.compress(w.to(other) * torch.linspace(1e-3, 1, 256).to(other), **kw)
             for kw in (dict(quantize="int8"), dict(quantize="int4", group_size=32, symmetric=False))]
    # values not contiguous (a loaded strided tensor): torch's internal "view size is not compatible"
    strided = sparse24.Sparse24Tensor(p.values.t().contiguous().t(), p.meta, p.shape)
    assert short_groups(p) > 0 and short_groups(p8) > 0
    for q in (p, p8, *cross, strided):
        packed, meta = to_cutlass_layout(q, dtype=dtype)
        ref_packed, ref_meta = torch_from_dense(q.to_dense().to(dtype))
        assert same_bits(packed, ref_packed) and same_bits(meta, ref_meta)


@pytest.mark.parametrize("dtype", HALF)
def test_import_accepts_any_encoding_and_stores_ours(dtype, gen):
    dense, _, nib, vals = encoding_matrix(dtype, gen)
    ours = sparse24.compress(dense, mask=dense != 0)  # our encoding of the same matrix (+0.0 fillers)
    torch_packed, torch_meta = torch_from_dense(dense)
    any_packed, any_meta = cutlass_bits(nib, vals)  # every slot pair, every zero sign
    assert same_bits(torch_to_dense(any_packed, any_meta), dense)  # the helper writes valid bits
    for packed, meta in ((any_packed, any_meta), (torch_packed, torch_meta), to_cutlass_layout(ours)):
        saved = (packed.clone(), meta.clone())
        q = from_cutlass_layout(packed, meta)
        assert q.shape == dense.shape and q.dtype == dtype
        assert torch.equal(q.to_dense(), torch_to_dense(packed, meta))
        assert same_bits(q.values, ours.values) and torch.equal(q.meta, ours.meta)
        assert same_bits(packed, saved[0]) and same_bits(meta, saved[1])  # inputs untouched
        # torch -> ours -> torch: the metadata comes back exactly, the values up to
        # the sign of a filler zero (ours are +0.0, see from_cutlass_layout) ...
        packed2, meta2 = to_cutlass_layout(q)
        assert same_bits(meta2, torch_meta)
        differ = bits(packed2) != bits(torch_packed)
        assert bool((torch_packed[differ] == 0).all()) and bool((packed2[differ] == 0).all())
    # ... and this matrix has such zeros, so the check above was not empty
    assert bool(differ.any())


def test_round_trip_through_torch_keeps_our_bits(gen):
    w = torch.randn(64, 256, generator=gen).half()
    zeros = w.clone()
    zeros[3] = 0                                # groups with no non-zero
    zeros[5, 1::4] = zeros[5, 2::4] = 0         # groups with one non-zero
    # a 2-D mask keeps fewer than 2 in some groups (its kept entries are non-zero)
    for p in (sparse24.compress(zeros), sparse24.compress(w, mask=sparse24.mask_nm(w.float(), method="2d_greedy"))):
        assert short_groups(p) > 0
        q = from_cutlass_layout(*to_cutlass_layout(p))
        assert same_bits(q.values, p.values) and torch.equal(q.meta, p.meta)


def test_round_trip_of_a_mask_keeping_zeros_keeps_the_matrix(gen):
    # A mask may keep an exact zero (slots (2, 3) of a zero row): torch's layout
    # cannot tell it from any other zero, so it comes back in our convention.
    w = torch.randn(32, 64, generator=gen).half()
    w[7] = 0
    keep = torch.zeros(32, 64, dtype=torch.bool)
    keep[:, 2::4] = keep[:, 3::4] = True
    p = sparse24.compress(w, mask=keep)
    q = from_cutlass_layout(*to_cutlass_layout(p))
    assert same_bits(q.to_dense(), p.to_dense())
    assert not torch.equal(q.meta, p.meta)
    ref = sparse24.compress(p.to_dense(), mask=p.to_dense() != 0)
    assert same_bits(q.values, ref.values) and torch.equal(q.meta, ref.meta)


def test_int8_exports_dequantized(gen):
    w = torch.randn(64, 256, generator=gen)
    p8 = sparse24.compress(w, quantize="int8")
    packed, meta = to_cutlass_layout(p8, dtype=torch.bfloat16)
    assert same_bits(torch_to_dense(packed, meta), p8.to_dense().bfloat16())


def test_export_does_not_share_or_change_our_tensors(gen):
    w = torch.randn(32, 64, generator=gen).half()
    w[:, 0::4] = 0
    p = sparse24.compress(w)
    saved = (p.values.clone(), p.meta.clone())
    packed, _ = to_cutlass_layout(p)
    packed.zero_()
    assert same_bits(p.values, saved[0]) and torch.equal(p.meta, saved[1])


def test_from_semi_structured_reads_a_cutlass_tensor(gen):
    w = torch.randn(32, 64, generator=gen).half()
    p = sparse24.compress(w)
    packed, meta = to_cutlass_layout(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "prototype" notice
        # Built on CPU through torch's constructor (its matmuls would need CUDA).
        t = SparseSemiStructuredTensorCUTLASS(p.shape, packed=packed, meta=meta, packed_t=None, meta_t=None,
                                              compressed_swizzled_bitmask=None)
    q = from_semi_structured(t)
    assert torch.equal(q.to_dense(), t.to_dense()) and torch.equal(q.to_dense(), p.to_dense())


def test_bad_input_is_rejected_clearly(gen):
    w = torch.randn(32, 64, generator=gen)
    p = sparse24.compress(w)
    saved = (p.values.clone(), p.meta.clone())
    with pytest.raises(ValueError, match="CUDA-only, but the weight is on cpu"):
        to_semi_structured(p.to(dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        to_semi_structured(p, backend="cuda")
    with pytest.raises(TypeError, match="float32 layout is 1:2, not 2:4"):
        to_cutlass_layout(p)
    with pytest.raises(ValueError, match="rows a positive multiple of 32 and columns a multiple of 64"):
        to_cutlass_layout(sparse24.compress(torch.randn(16, 64).half()))
    with pytest.raises(TypeError, match="expected a Sparse24Tensor, got Tensor"):
        to_cutlass_layout(w)
    with pytest.raises(TypeError, match="expected a torch.sparse.SparseSemiStructuredTensor, got Tensor"):
        from_semi_structured(w)
    with pytest.raises(TypeError, match="float32.s is 1:2"):
        from_cutlass_layout(torch.zeros(32, 32), torch.zeros(32, 4, dtype=torch.int16))
    with pytest.raises(ValueError, match="need packed \\(R, C/2\\) and int16 meta"):
        from_cutlass_layout(torch.zeros(32, 32).half(), torch.zeros(32, 3, dtype=torch.int16))
    assert torch.equal(saved[0], p.values) and torch.equal(saved[1], p.meta)


@pytest.mark.parametrize("nibble", [0b0000, 0b0101, 0b0001], ids=["slot0-twice", "slot1-twice", "unordered"])
@pytest.mark.parametrize("values", ["non-zero", "zero"])
def test_import_rejects_metadata_naming_a_slot_twice(nibble, values, gen):
    packed, meta = torch_from_dense(sparse24.compress(torch.randn(32, 64, generator=gen).half()).to_dense())
    R, G = 32, 16
    nib = torch.full((R, G), 0b1110)  # slots (2, 3) everywhere ...
    nib[5, 7] = nibble                # ... but one corrupt group
    vals = packed.view(R, G, 2).clone()
    if values == "zero":              # the corrupt group must be reported whatever its values
        vals[5, 7] = 0
    bad_packed, bad_meta = cutlass_bits(nib, vals)
    with pytest.raises(ValueError, match="corrupt metadata at row 5, group 7"):
        from_cutlass_layout(bad_packed, bad_meta)


def test_backend_follows_the_gpu_and_refuses_cutlass_off_ampere():
    """torch's CUTLASS 2:4 matmul runs on compute capability 8.x alone (an H200 raised at the
    first product): the default there is cuSPARSELt, and asking for CUTLASS is an error."""
    from sparse24.interop import backend_for
    assert backend_for((8, 0)) == backend_for((8, 9)) == "cutlass"
    assert backend_for((9, 0)) == backend_for((10, 0)) == "cusparselt"
    assert backend_for((8, 6), "cusparselt") == "cusparselt" and backend_for((9, 0), "cusparselt") == "cusparselt"
    with pytest.raises(ValueError, match="8.x only, this GPU is 9.0"):
        backend_for((9, 0), "cutlass")


def test_a_transposed_cutlass_view_without_packed_data_is_refused_clearly():
    # torch's own to_dense() failed on a bare assertion ("meta and packed must not be None")
    import warnings
    from torch.sparse import SparseSemiStructuredTensorCUTLASS

    from sparse24.interop import from_semi_structured, to_cutlass_layout
    p = sparse24.compress(torch.randn(64, 128).half())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = SparseSemiStructuredTensorCUTLASS(p.shape, *to_cutlass_layout(p), packed_t=None, meta_t=None,
                                              compressed_swizzled_bitmask=None)
        with pytest.raises(ValueError, match="holds no packed data"):
            from_semi_structured(t.t())
        assert torch.equal(from_semi_structured(t).to_dense(), p.to_dense())

"""Property tests (hypothesis) of the format's pure functions, each against an
independent reference: masks against a brute force over every choice, round trips
against the masked dense weight, validate() against a decoding of the documented
bits written here, INT8 against its documented bounds, interop against torch's own
CUTLASS conversions. Derandomized: the same examples every run (a few seconds each)."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

import sparse24
from sparse24.format import Sparse24Tensor
from sparse24.interop import from_cutlass_layout, to_cutlass_layout

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# derandomize: the examples are a function of the test alone (CI sees the same ones every run)
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=60,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Values with many ties and signed zeros, and ordinary ones.
_VALUES = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5]),
                    st.floats(-1e4, 1e4, allow_nan=False, width=16))


@st.composite
def weights(draw, m=4, max_rows=6, max_groups=10):
    dtype = draw(st.sampled_from(DTYPES))
    R = draw(st.integers(0, max_rows))
    C = m * draw(st.integers(1, max_groups))
    vals = draw(st.lists(_VALUES, min_size=R * C, max_size=R * C))
    return torch.tensor(vals, dtype=torch.float64).view(R, C).to(dtype)


@st.composite
def masks24(draw, R, C):
    """Any valid 2:4 mask: each group keeps 0, 1 or 2 of its 4 columns."""
    choices = [c for k in range(3) for c in itertools.combinations(range(4), k)]
    mask = torch.zeros(R, C // 4, 4, dtype=torch.bool)
    for r, g in itertools.product(range(R), range(C // 4)):
        mask[r, g, list(draw(st.sampled_from(choices)))] = True
    return mask.view(R, C)


@PROPERTY
@given(data=st.data(), nm=st.sampled_from([(2, 4), (1, 4), (2, 8), (4, 8), (3, 4)]))
def test_masks_are_valid_and_optimal(data, nm):
    n, m = nm
    w = data.draw(weights(m=m))
    mask = sparse24.mask_nm(w, n, m)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    groups = mask.view(-1, m)
    assert bool((groups.sum(-1) == n).all())
    a = w.double().abs().view(-1, m)
    best = torch.stack([a[:, list(c)].sum(-1) for c in itertools.combinations(range(m), n)], -1).amax(-1) \
        if a.shape[0] else a.new_zeros(0)
    assert torch.equal((a * groups).sum(-1), best)
    assert sparse24.is_nm(torch.where(mask, w, 0), n, m)


@PROPERTY
@given(data=st.data(), quantize=st.sampled_from([None, "int8"]))
def test_compress_round_trip_every_dtype_and_odd_shapes(data, quantize):
    w = data.draw(weights(max_groups=19))  # up to 76 columns: C % 32 != 0 and several meta words
    R, C = w.shape
    mask = data.draw(st.one_of(st.none(), masks24(R, C)))
    expected = torch.where(sparse24.mask_nm(w) if mask is None else mask, w, 0)  # the masked dense weight
    p = sparse24.compress(w, mask=mask, quantize=quantize)
    assert p.values.shape == (R, C // 2) and p.meta.shape == ((C + 31) // 32, R)
    p.validate()
    dense = p.to_dense()
    assert dense.dtype == w.dtype and dense.shape == w.shape
    if quantize is None:
        assert torch.equal(dense.view(torch.uint8), expected.view(torch.uint8))  # bit for bit (-0.0 too)
        return
    # INT8: |q| <= 127, scale = max |kept| / 127 per row (1 for an all-zero row), error <= scale / 2
    # per kept value (plus the rounding of the dequantized value to the logical dtype)
    assert p.values.dtype == torch.int8 and (p.values.numel() == 0 or int(p.values.abs().max()) <= 127)
    amax = expected.double().abs().amax(1) if C else torch.zeros(R, dtype=torch.float64)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    torch.testing.assert_close(p.scale.double(), scale, rtol=2 ** -22, atol=0)
    err = (dense.double() - expected.double()).abs()
    rounding = dense.double().abs() * {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}.get(w.dtype, 2 ** -24)
    assert bool((err <= p.scale.double()[:, None] / 2 * (1 + 2 ** -20) + rounding).all())
    assert bool((dense[expected == 0] == 0).all())  # pruned (and kept zero) entries stay exactly zero


def _decode_first_problem(meta: torch.Tensor, R: int, C: int):
    """Independent reading of the documented bits: (row, group) of the first group (row-major)
    whose nibble is not two increasing slots, else ("padding", row) of the first row whose bits
    past column C are set, else None."""
    words = meta.to(torch.int64) & 0xFFFFFFFF
    for r in range(R):
        for g in range(C // 4):
            nib = (int(words[g // 8, r]) >> (4 * (g % 8))) & 15
            if (nib & 3) >= (nib >> 2):
                return (r, g)
    used = 4 * ((C // 4) % 8)
    if used:
        for r in range(R):
            if int(words[-1, r]) >> used:
                return ("padding", r)
    return None


@PROPERTY
@given(R=st.integers(1, 5), groups=st.integers(1, 20), data=st.data())
def test_validate_reports_every_invalid_pattern_with_its_place(R, groups, data):
    C = 4 * groups
    W = (C + 31) // 32
    # each word: mostly valid nibbles, sometimes any of the 16 (duplicate or unordered slots)
    valid = [lo | hi << 2 for lo, hi in itertools.combinations(range(4), 2)]
    nib = st.one_of(st.sampled_from(valid), st.integers(0, 15))
    words = [[sum(data.draw(nib) << (4 * i) for i in range(8)) for _ in range(R)] for _ in range(W)]
    if data.draw(st.booleans()):  # the padding of the last word: zero unless corrupted
        used = 4 * (groups % 8)
        for r in range(R):
            if used:
                words[-1][r] &= (1 << used) - 1
    meta = torch.tensor(words, dtype=torch.int64)
    meta = torch.where(meta >= 2 ** 31, meta - 2 ** 32, meta).to(torch.int32)
    values = torch.randn(R, C // 2)
    p = Sparse24Tensor(values, meta, (R, C), check=False)
    problem = _decode_first_problem(meta, R, C)
    if problem is None:
        assert p.validate() is p
        Sparse24Tensor(values, meta, (R, C))  # the checking constructor accepts it too
        return
    if problem[0] == "padding":
        match = f"row {problem[1]}: padding bits past column {C}"
    else:
        match = f"row {problem[0]}, group {problem[1]} "
    with pytest.raises(ValueError, match=match):
        p.validate()
    with pytest.raises(ValueError, match=match):
        Sparse24Tensor(values, meta, (R, C))


@settings(PROPERTY, max_examples=25)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       shape=st.sampled_from([(32, 64), (64, 64), (32, 128)]))
def test_interop_export_import_round_trips(data, dtype, shape):
    R, C = shape
    seed = data.draw(st.integers(0, 2 ** 16))
    w = torch.randn(R, C, generator=torch.Generator().manual_seed(seed)).to(dtype)
    zeros = data.draw(st.sampled_from([0.0, 0.3, 0.8]))  # short groups: fewer than two non-zeros
    w[torch.rand(R, C, generator=torch.Generator().manual_seed(seed + 1)) < zeros] = 0
    mask = data.draw(st.one_of(st.none(), masks24(R, C)))
    p = sparse24.compress(w, mask=mask)
    dense = p.to_dense()
    packed, meta = to_cutlass_layout(p)
    assert torch.equal(sparse_semi_structured_to_dense_cutlass(packed, meta), dense)  # torch's own decoder
    q = from_cutlass_layout(packed, meta)
    assert torch.equal(q.to_dense(), dense)
    packed2, meta2 = to_cutlass_layout(q)
    assert torch.equal(meta2, meta) and torch.equal(packed2, packed)

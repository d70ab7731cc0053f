"""Peak memory of the passes over a whole compressed weight (found by review: VmHWM of a fresh process
grew 2.5-9x a bf16 weight's bytes in compress, validate, kept_mask, the values' gradient, pack_decode and
sparsify_'s magnitude mask and report note). Checked here deterministically: the peak of the bytes held
allocated during one call, summed from torch.profiler's allocation events, with the row block made small
so that a small weight spans many blocks; every result is compared bit for bit with the whole-tensor
computation or an independent (float64) reference."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import sparse24
import sparse24._checks as checks
from sparse24.decode_format import pack_decode
from sparse24.format import Sparse24Tensor, quantize_values
from sparse24.nn.prepare import sparser_note
from sparse24.ops.linear24 import naive

R, C = 67, 512            # 67 rows: not a multiple of the 8-row blocks below
BLOCK = 8 * C             # elements per row block in these tests (8 rows; decode layout: 128-row tiles)
PER_BLOCK = 8 * BLOCK     # bytes one block's temporaries may take (its int64 slots: 4 B per weight)


def _peak(call) -> tuple[int, object]:
    """``(peak, result)``: the most bytes ``call()`` held allocated at once on the CPU beyond what it
    started with (the result included; temporaries inside aten ops too, e.g. a bool sum's cast to
    int64), summed from the allocation events of torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = call()
    held = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak, out


@pytest.fixture
def small_blocks(monkeypatch):
    # raising=False: on a build without row blocks the memory assertions fail, not the fixture
    monkeypatch.setattr(checks, "ROW_BLOCK", BLOCK, raising=False)


def _weight(rows=R, cols=C, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Tie-heavy, finite: small integers (many equal magnitudes and zeros) plus some normals, zero rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-3, 4, (rows, cols), generator=g).double() * 0.5
    normal = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w = torch.where(torch.rand(rows, cols, generator=g) < 0.3, normal, w)
    w[5] = 0
    return w.to(dtype)


def _thin_mask(w: torch.Tensor) -> torch.Tensor:
    """A 2:4 mask keeping 2 of 4 mostly, 1 or 0 in some groups (short groups get filler slots)."""
    mask = sparse24.mask_nm(w, 2, 4)
    g = torch.Generator().manual_seed(1)
    drop = torch.rand(w.shape, generator=g) < 0.2
    return mask & ~drop


def _bits(t: torch.Tensor | None):
    if t is None or not t.is_floating_point():
        return t
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _same(a: Sparse24Tensor, b: Sparse24Tensor) -> bool:
    return all(((x is None) == (y is None)) and (x is None or (x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))))
               for x, y in ((a.values, b.values), (a.meta, b.meta), (a.scale, b.scale), (a.zero, b.zero))) \
        and (a.shape, a.dtype, a.group_size) == (b.shape, b.dtype, b.group_size)


# --- compress -------------------------------------------------------------------------------------

QUANTS = [{}, {"quantize": "int8"}, {"quantize": "int4"}, {"quantize": "int4", "group_size": 32, "symmetric": False}]


@pytest.mark.parametrize("quant", QUANTS, ids=["none", "int8", "int4", "int4-g32-asym"])
@pytest.mark.parametrize("given", [False, True], ids=["magnitude", "mask"])
def test_compress_allocates_a_row_block_at_a_time(small_blocks, quant, given):
    """Whole, compress made int64 slots (4 B per weight) and float32 copies of every kept value."""
    w = _weight()
    mask = _thin_mask(w) if given else None
    peak, p = _peak(lambda: sparse24.compress(w, mask, **quant))
    results = sum(t.untyped_storage().nbytes() for t in (p.values, p.meta, p.scale, p.zero) if t is not None)
    # the results, the nibbles (a byte per group) and one block's temporaries (whole: 3.7-10x a bf16 weight)
    assert peak <= results + R * C // 4 + 24 * BLOCK, (peak, results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("quant", QUANTS, ids=["none", "int8", "int4", "int4-g32-asym"])
@pytest.mark.parametrize("given", [False, True], ids=["magnitude", "mask"])
def test_compress_in_row_blocks_is_bit_identical(small_blocks, monkeypatch, dtype, quant, given):
    """Row blocks stitched == the whole-tensor computation: compress in one piece; without quantization
    the float64 masked weight; quantization, quantize_values of the whole (which is one piece)."""
    w = _weight(dtype=dtype, seed=3)
    mask = _thin_mask(w) if given else sparse24.mask_nm(w, 2, 4)
    with monkeypatch.context() as m:
        m.setattr(checks, "ROW_BLOCK", 1 << 40, raising=False)
        whole = sparse24.compress(w, mask if given else None, **quant)
    plain = sparse24.compress(w, mask if given else None)
    assert torch.equal(plain.to_dense().double(), w.double() * mask)
    assert torch.equal(plain.kept_mask() & mask, mask)
    got = sparse24.compress(w, mask if given else None, **quant)
    mode = quant.get("quantize")
    want = plain if mode is None else quantize_values(
        plain, mode, **{k: v for k, v in quant.items() if k != "quantize"})
    assert _same(got, want) and _same(got, whole)


def test_compress_names_the_bad_row_of_a_later_block(small_blocks):
    w = _weight(dtype=torch.float32)
    mask = sparse24.mask_nm(w, 2, 4)
    mask[50, 8:12] = True
    with pytest.raises(ValueError, match=r"mask is not 2:4: row 50, group 2 \(columns 8\.\.11\) keeps 4 of 4"):
        sparse24.compress(w, mask)
    w[60, 3] = float("nan")
    with pytest.raises(ValueError, match="weight contains NaN"):
        sparse24.compress(w)


# --- validate, kept_mask / decompress_ ------------------------------------------------------------

def test_validate_allocates_a_row_block_at_a_time(small_blocks):
    """Whole, validate (every load_state_dict of a compressed layer) unpacked int64 slots: 12.8x an
    INT4 layer's stored bytes."""
    p = sparse24.compress(_weight(), quantize="int4")
    peak, _ = _peak(p.validate)
    assert peak <= PER_BLOCK, peak                 # whole: 5 B per weight


@pytest.mark.parametrize("row", [0, 9, 66])
def test_validate_names_the_first_bad_group_in_any_block(small_blocks, row):
    p = sparse24.compress(_weight(dtype=torch.float32), quantize="int8")
    meta = p.meta.clone()
    group = 21                                              # word 2, nibble 5: slots (2, 1), unordered
    meta[group // 8, row] = (meta[group // 8, row] & ~(15 << 4 * (group % 8))) | (6 << 4 * (group % 8))
    meta[0, 66] = meta[0, 66] & ~15 | 5                     # row 66, group 0: slots (1, 1), a duplicate
    first = (row, group, 2, 1) if row < 66 else (66, 0, 1, 1)
    r, g, lo, hi = first
    msg = (f"corrupt metadata at row {r}, group {g} (columns {4 * g}..{4 * g + 3}): kept values claim slots "
           f"{lo} and {hi}; need two distinct slots in increasing order")
    with pytest.raises(ValueError) as e:
        Sparse24Tensor(p.values, meta, p.shape, p.dtype, p.scale)
    assert str(e.value) == msg
    values = p.values.clone()
    values[40, 7] = -128
    with pytest.raises(ValueError, match=r"corrupt INT8 values at row 40, kept value 7: -128 is outside"):
        Sparse24Tensor(values, p.meta, p.shape, p.dtype, p.scale)


def test_kept_mask_allocates_a_row_block_at_a_time(small_blocks):
    """decompress_ / to_masked rebuild the mask from the slots: whole, through int64 slots (4 B per weight)."""
    w = _weight()
    mask = _thin_mask(w)
    p = sparse24.compress(w, mask, quantize="int4")
    peak, got = _peak(lambda: p.kept_mask())
    assert peak <= R * C + PER_BLOCK, peak         # the (R, C) bool result and one block
    # independent: the mask given to compress, plus the filler slots of its short groups (lowest free ones)
    want = mask.clone().view(-1, 4)
    for i in range(want.shape[0]):
        free = [c for c in range(4) if not want[i, c]]
        for c in free[:max(0, 2 - int(want[i].sum()))]:
            want[i, c] = True
    assert torch.equal(got, want.view(R, C)) and torch.equal(p.kept_mask(), got)


# --- the kept values' gradient ----------------------------------------------------------------------

def test_values_gradient_unpacks_the_slots_of_one_block(small_blocks, monkeypatch):
    """The reference backward promises a block of rows at a time; the values' gradient unpacked every
    row's int64 slots (2x a bf16 layer's dense bytes)."""
    monkeypatch.setattr(naive, "CHUNK_ELEMENTS", BLOCK)
    w = _weight(dtype=torch.float32)
    p = sparse24.compress(w)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (3, C), generator=g).float()     # small integers: every product and sum exact
    gy = torch.randint(-3, 4, (3, R), generator=g).float()
    peak, (_, grad_values, _) = _peak(lambda: naive.linear_backward_reference(gy, x, p, False, True, False))
    assert peak <= R * C // 2 * 4 + 2 * PER_BLOCK, peak   # the (R, C/2) float32 gradient, one block
    dense = (gy.double().t() @ x.double()).view(R, C // 4, 4)
    keep = p.kept_mask().view(R, C // 4, 4)
    want = dense[keep].view(R, C // 2)                         # kept slots in increasing order
    assert torch.equal(grad_values.double(), want)


# --- pack_decode --------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", [{}, {"quantize": "int8"}, {"quantize": "int4", "symmetric": False}],
                         ids=["bf16", "int8", "int4-asym"])
def test_pack_decode_in_tile_blocks_is_bit_identical(small_blocks, monkeypatch, quant):
    """Blocks of 128-row tiles (1100 rows: the last block short) == the whole weight packed in one piece,
    and an exact inverse; whole, the int64 slots and codes took 6.3x the dense bf16 bytes."""
    rows = 1100
    p = sparse24.compress(_weight(rows, C, seed=4), **quant)
    peak, d = _peak(lambda: pack_decode(p))
    results = sum(t.untyped_storage().nbytes() for t in (d.values, d.meta))
    assert peak <= results + 24 * 128 * C, (peak, results)   # the results, one 128-row block
    monkeypatch.setattr(checks, "ROW_BLOCK", 1 << 40, raising=False)
    whole = pack_decode(p)
    assert torch.equal(_bits(d.values), _bits(whole.values)) and torch.equal(d.meta, whole.meta)
    assert d.scale is p.scale or torch.equal(d.scale, p.scale)
    assert _same(d.to_sparse24(), p)


# --- sparsify_'s report note ------------------------------------------------------------------------

def test_sparser_note_counts_a_row_block_at_a_time(small_blocks):
    """Whole, the note summed the bool mask into int64 (8 B per group: 4x a bf16 weight's bytes)."""
    mask = _thin_mask(_weight())
    peak, note = _peak(lambda: sparser_note(mask))
    assert peak <= PER_BLOCK, peak
    kept = [int(mask.view(-1, 4)[i].sum()) for i in range(R * C // 4)]
    fewer = sum(k < 2 for k in kept)
    assert f"fewer than 2 of 4 in {fewer} of {R * C // 4} groups ({sum(kept)} of {R * C} weights)" in note
    assert sparser_note(sparse24.mask_nm(_weight(), 2, 4)) == ""


# --- sparsify_'s magnitude mask ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_magnitude_mask_in_row_blocks(small_blocks, dtype):
    """Whole, mask_nm's table lookup made an int64 index per group (1x a bf16 weight); ties to the lower
    column, checked against a stable sort of each group's float64 magnitudes."""
    w = _weight(dtype=dtype, seed=5)
    peak, mask = _peak(lambda: sparse24.mask_nm(w, 2, 4))
    assert peak <= R * C + PER_BLOCK, peak          # the (R, C) bool result and one block
    order = torch.sort(w.double().abs().view(-1, 4), dim=-1, descending=True, stable=True).indices
    want = torch.zeros(R * C // 4, 4, dtype=torch.bool).scatter_(-1, order[:, :2], True).view(R, C)
    assert torch.equal(mask, want)


def test_pruned_rows_counts_a_row_block_at_a_time(small_blocks):
    """sparsify_ of an already pruned weight: whole, the per-column and per-row counts summed the bool
    (R, C) mask into int64 (4x a bf16 weight's bytes)."""
    from sparse24.nn.prepare import _pruned_rows
    w = _weight()
    w = torch.where(w == 0, 1.0, w) * sparse24.mask_nm(_weight(seed=6), 1, 4)   # pruned to 1:4
    w[5], w[9, 64:72] = 0, 0                   # an all-zero row, a row with a dead group of 8
    peak, got = _peak(lambda: _pruned_rows(w))
    assert peak <= R * C + PER_BLOCK, peak          # the (R, C) bool of the non-zeros, one block
    nz8 = (w != 0).view(R, -1, 8).any(-1)                      # the rule, written out whole
    assert bool(nz8.any(0).all())                              # (every group of 8 is live somewhere)
    assert torch.equal(got, nz8.all(-1, keepdim=True)) and int(got.sum()) == R - 2 and not (got[5] or got[9])
    eye = torch.eye(R, C, dtype=torch.bfloat16)          # one non-zero per row and column: a fresh init
    assert not bool(_pruned_rows(eye).any())
    eye[3, 100] = 1                                      # two in row 3: rows with one live group in 8 are not pruned
    assert not bool(_pruned_rows(eye).any())


def test_check_finite_finds_a_nan_in_a_later_block_of_rows():
    # check_finite scans blocks of rows (2**18 elements on a CPU): a value in the last block is found, and the
    # message counts and places it over the whole tensor
    from sparse24._checks import check_finite
    w = torch.zeros(600, 1024, dtype=torch.bfloat16)
    w[550, 7], w[599, 3] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"weight has 2 non-finite value\(s\) \(inf/NaN\), the first at index "
                                         r"\(550, 7\)"):
        check_finite(w)
    check_finite(torch.zeros(600, 1024))

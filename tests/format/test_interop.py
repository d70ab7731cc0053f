"""Export/import with torch's 2:4 (CUTLASS) layout, checked on CPU against
torch's own pure-torch conversions."""
import warnings

import pytest
import torch
from torch.sparse import SparseSemiStructuredTensorCUTLASS
from torch.sparse._semi_structured_conversions import (sparse_semi_structured_from_dense_cutlass as torch_from_dense,
                                                        sparse_semi_structured_to_dense_cutlass as torch_to_dense)

import sparse24
from sparse24.interop import from_cutlass_layout, from_semi_structured, to_cutlass_layout, to_semi_structured

SHAPES = [(32, 64), (64, 192), (96, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_export_matches_torch_layout_bit_for_bit(shape, dtype, gen):
    w = torch.randn(*shape, generator=gen).to(dtype)
    p = sparse24.compress(w)
    packed, meta = to_cutlass_layout(p)
    # torch's decoder gives back the masked weight exactly ...
    assert torch.equal(torch_to_dense(packed, meta), w * sparse24.mask_nm(w))
    # ... and torch's encoder of that dense weight produces the same bits
    # (random weights: every group has two non-zeros, so the encoding is unique).
    ref_packed, ref_meta = torch_from_dense(p.to_dense())
    assert torch.equal(packed, ref_packed) and torch.equal(meta, ref_meta)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_import_from_torch_layout_including_degenerate_groups(dtype, gen):
    w = torch.randn(64, 128, generator=gen).to(dtype)
    w = w * sparse24.mask_nm(w)
    w[3] = 0                      # groups with no non-zero
    w[5, 1::4] = 0                # groups with one non-zero ...
    w[5, 2::4] = 0
    w[7, :64] = 0
    packed, meta = torch_from_dense(w)
    q = from_cutlass_layout(packed, meta)
    assert q.shape == w.shape and q.dtype == dtype
    assert torch.equal(q.to_dense(), w)
    # and back: the same bits torch had
    packed2, meta2 = to_cutlass_layout(q)
    assert torch.equal(packed2, packed) and torch.equal(meta2, meta)


def test_round_trip_keeps_our_bits_and_int8_exports_dequantized(gen):
    w = torch.randn(64, 256, generator=gen)
    p = sparse24.compress(w.half())
    q = from_cutlass_layout(*to_cutlass_layout(p))
    assert torch.equal(q.values, p.values) and torch.equal(q.meta, p.meta)
    # float32 and INT8 weights export their values in the chosen half dtype
    p8 = sparse24.compress(w, quantize="int8")
    packed, meta = to_cutlass_layout(p8, dtype=torch.bfloat16)
    assert torch.equal(torch_to_dense(packed, meta), p8.to_dense().bfloat16())


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
    with pytest.raises(TypeError, match="float32 is 1:2"):
        from_cutlass_layout(torch.zeros(32, 32), torch.zeros(32, 4, dtype=torch.int16))
    with pytest.raises(ValueError, match="need packed \\(R, C/2\\) and int16 meta"):
        from_cutlass_layout(torch.zeros(32, 32).half(), torch.zeros(32, 3, dtype=torch.int16))
    assert torch.equal(saved[0], p.values) and torch.equal(saved[1], p.meta)

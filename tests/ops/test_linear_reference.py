"""The pure-torch reference backend of sparse24.linear, against F.linear in fp64."""
import pytest
import torch

import sparse24
from sparse24.ops.linear24 import naive as linear_mod

from conftest import assert_matches_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("lead", [(), (1,), (13,), (0,), (2, 3), (2, 0, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_reference_matches_masked_dense(lead, dtype, bias, gen):
    N, K = 40, 100
    w = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    x = torch.randn(*lead, K, generator=gen).to(dtype)
    p = sparse24.compress(w)
    for backend in ("reference", "auto"):
        y = sparse24.linear(x, p, b, backend=backend)
        assert y.dtype == dtype and y.shape == (*lead, N)
        assert_matches_reference(y, x, w * sparse24.mask_nm(w), b)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_chunked_decompression_matches(monkeypatch, bias, gen):
    # Force many row chunks (and a ragged last one) on a small layer.
    monkeypatch.setattr(linear_mod, "CHUNK_ELEMENTS", 3 * 64)
    N, K = 67, 64
    w = torch.randn(N, K, generator=gen, dtype=torch.float64)
    b = torch.randn(N, generator=gen, dtype=torch.float64) if bias else None
    x = torch.randn(5, 7, K, generator=gen, dtype=torch.float64)
    p = sparse24.compress(w)
    assert_matches_reference(sparse24.linear(x, p, b), x, w * sparse24.mask_nm(w), b)


def test_block_rows_per_device():
    # CPU blocks fit in cache; GPU blocks are larger (fewer launches); never 0 rows
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert linear_mod.chunk_rows(1024, cpu) * 1024 == linear_mod.CHUNK_ELEMENTS
    assert linear_mod.chunk_rows(1024, cuda) * 1024 == linear_mod.CUDA_CHUNK_ELEMENTS
    assert linear_mod.chunk_rows(10 ** 9, cpu) == 1


def test_strided_input(gen):
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(64, 9, generator=gen).t()[:, :32]  # non-contiguous (9, 32)
    assert not x.is_contiguous()
    assert_matches_reference(sparse24.linear(x, sparse24.compress(w)), x, w * sparse24.mask_nm(w))


def test_fp16_weight_with_fp32_input(gen):
    w = torch.randn(16, 32, generator=gen).half()
    x = torch.randn(3, 32, generator=gen)
    y = sparse24.linear(x, sparse24.compress(w))
    assert y.dtype == torch.float32
    assert_matches_reference(y, x, (w * sparse24.mask_nm(w)).float())


def test_linear_rejects_bad_input_and_changes_nothing(gen):
    w = torch.randn(8, 16, generator=gen)
    p = sparse24.compress(w)
    x = torch.randn(3, 16, generator=gen)
    b = torch.randn(8, generator=gen)
    saved = [t.clone() for t in (x, b, p.values, p.meta)]
    with pytest.raises(ValueError, match="x has 12 features but the weight expects 16"):
        sparse24.linear(torch.randn(3, 12), p)
    with pytest.raises(TypeError, match="must be a Sparse24Tensor"):
        sparse24.linear(x, w)
    with pytest.raises(TypeError, match="x must be floating point"):
        sparse24.linear(x.long(), p)
    with pytest.raises(ValueError, match="bias must have shape"):
        sparse24.linear(x, p, b[:4])
    for bad in (b.to(torch.complex64), b.long(), b > 0):  # complex lost its imaginary part; F.linear refuses these
        for backend in ("reference", "auto"):
            with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
                sparse24.linear(x, p, bad, backend=backend)
    with pytest.raises(ValueError, match="x is on meta but the weight is on cpu"):
        sparse24.linear(x.to("meta"), p)
    with pytest.raises(ValueError, match="bias is on meta"):
        sparse24.linear(x, p, b.to("meta"))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        sparse24.linear(x, p, backend="cuda")
    for before, after in zip(saved, (x, b, p.values, p.meta)):
        assert torch.equal(before, after)


def test_auto_uses_the_reference_off_gpu(gen):
    from sparse24.ops.linear24 import choose_backend
    p = sparse24.compress(torch.randn(8, 16, generator=gen))
    for dtype in (torch.float32, torch.float16, torch.float64):
        assert choose_backend(torch.randn(2, 16).to(dtype), p) == "reference"


def test_reference_reads_the_decode_layout_in_row_blocks(monkeypatch):
    """A decode-layout weight is decompressed a block of 128-row tiles at a time (never
    re-ordered whole): with 1-row chunks requested, blocks of 128 rows, same result."""
    from sparse24.decode_format import pack_decode
    from sparse24.ops.linear24 import naive

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 64, generator=gen).half()
    d = pack_decode(sparse24.compress(w))
    x, b = torch.randn(7, 64, generator=gen), torch.randn(300, generator=gen)
    dense = (w * sparse24.mask_nm(w)).double()
    monkeypatch.setattr(naive, "CHUNK_ELEMENTS", 1)
    seen = []
    real = type(d).to_dense
    monkeypatch.setattr(type(d), "to_dense", lambda self, rows=None: seen.append(rows) or real(self, rows))
    out = naive.linear_reference(x, d, b)
    assert seen == [slice(0, 128), slice(128, 256), slice(256, 300)]
    assert_matches_reference(out, x, dense, b)

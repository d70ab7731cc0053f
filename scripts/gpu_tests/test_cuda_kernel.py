"""The 2:4 Triton kernel compiled on a CUDA GPU, against F.linear in fp64 on
the masked (dequantized) dense weight. Run by scripts/gpu_check.sh; not part
of the CPU suite (CI has no GPU): ``python -m pytest -q scripts/gpu_tests``.

Same error bound as the CPU tests (tests/conftest.py, error_bound). Outputs are
poisoned with NaN before each call, so an unwritten element fails.
"""

import pytest
import torch

import sparse24
from sparse24.tools import tuning
from sparse24.ops.linear24 import linear_triton

from _cuda import ACT, DEV, assert_matches_reference, gen  # noqa: F401  (gen: the fixture)


def _poison(numel: int, dtype) -> None:
    """Leave NaNs in the caching allocator's next block of this size."""
    t = torch.full((numel,), float("nan"), dtype=dtype, device=DEV)
    del t


def _run(x, p, b=None, **kw):
    _poison(x[..., 0].numel() * p.shape[0], x.dtype)
    y = linear_triton(x, p, b, **kw)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    return y


def _weight(N, K, dtype_key, gen):
    """(compressed weight, fp64 dense weight the kernel must reproduce)."""
    int8 = dtype_key.startswith("int8-")
    act = ACT[dtype_key.removeprefix("int8-")]
    w = torch.randn(N, K, generator=gen, device=DEV)
    if int8:
        p = sparse24.compress(w, quantize="int8")
        wm = (w * sparse24.mask_nm(w)).float()
        scale = wm.abs().amax(dim=1) / 127  # the quantization spec, computed independently
        dense = torch.round(wm / scale[:, None]).clamp(-127, 127).double() * scale.double()[:, None]
    else:
        w = w.to(act)
        p = sparse24.compress(w)
        dense = (w * sparse24.mask_nm(w)).double()
    return p, dense, act


@pytest.mark.parametrize("dtype_key", ["fp16", "bf16", "fp32", "int8-fp16", "int8-bf16"])
@pytest.mark.parametrize("N,K", [(40, 100), (4096, 4096), (11008, 4096), (4096, 11008), (1000, 1060)], ids=str)
@pytest.mark.parametrize("M", [1, 3, 8, 16, 67, 300])
def test_default_configs_match_reference(M, N, K, dtype_key, gen):
    p, dense, act = _weight(N, K, dtype_key, gen)
    x = torch.randn(M, K, generator=gen, device=DEV).to(act)
    b = torch.randn(N, generator=gen, device=DEV).to(act)
    assert_matches_reference(_run(x, p, b), x, dense, b)


def test_split_k_strided_3d_and_empty(gen):
    p, dense, act = _weight(1000, 1060, "fp16", gen)
    for cfg in (tuning.KernelConfig(16, 32, 64, split_k=3), tuning.KernelConfig(32, 64, 32, split_k=5)):
        x = torch.randn(13, 1060, generator=gen, device=DEV).half()
        b = torch.randn(1000, generator=gen, device=DEV).half()
        assert_matches_reference(_run(x, p, b, config=cfg), x, dense, b)
    xs = torch.randn(1060, 13, generator=gen, device=DEV).half().t()
    x3 = torch.randn(2, 3, 1200, generator=gen, device=DEV).half()[..., 40:1100]
    for x in (xs, x3):
        assert not x.is_contiguous()
        assert_matches_reference(_run(x, p), x, dense)
    assert linear_triton(torch.randn(0, 1060, device=DEV).half(), p).shape == (0, 1000)
    # backend="auto" takes the kernel on CUDA
    x = torch.randn(5, 1060, generator=gen, device=DEV).half()
    assert_matches_reference(sparse24.linear(x, p), x, dense)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cusparselt_export_without_a_dense_copy(dtype, gen):
    """Where this GPU's cuSPARSELt stores what sparse24.interop._cusparselt_sm90_buffer predicts
    (cusparselt_layout_known: a byte-for-byte probe, once per device), the export is that buffer;
    either way the product and the import are right."""
    from sparse24.interop import (_cusparselt_sm90_buffer, cusparselt_layout_known, from_semi_structured,
                                  to_semi_structured)
    if not torch.backends.cusparselt.is_available():
        pytest.fail("cuSPARSELt is not available in this torch build")
    p = sparse24.compress(torch.randn(128, 256, generator=gen, device=DEV).to(dtype))
    t = to_semi_structured(p, backend="cusparselt")
    if cusparselt_layout_known(DEV):
        assert torch.equal(t.packed.view(torch.int16), _cusparselt_sm90_buffer(p).view(torch.int16))
    x = torch.randn(32, 256, generator=gen, device=DEV).to(dtype)
    assert_matches_reference(torch.nn.functional.linear(x, t), x, p.to_dense().double())
    assert torch.equal(from_semi_structured(t).to_dense(), p.to_dense())


@pytest.mark.parametrize("backend", ["cutlass", "cusparselt", None])
def test_interop_on_cuda(backend, gen):
    from sparse24.interop import from_semi_structured, to_semi_structured
    if backend == "cusparselt" and not torch.backends.cusparselt.is_available():
        pytest.fail("cuSPARSELt is not available in this torch build")
    w = torch.randn(256, 512, generator=gen, device=DEV).half()
    p = sparse24.compress(w)
    if backend == "cutlass" and torch.cuda.get_device_capability()[0] != 8:  # torch's CUTLASS 2:4: 8.x only
        with pytest.raises(ValueError, match="8.x only"):
            to_semi_structured(p, backend=backend)
        return
    t = to_semi_structured(p, backend=backend)
    x = torch.randn(64, 512, generator=gen, device=DEV).half()
    assert_matches_reference(torch.nn.functional.linear(x, t), x, (w * sparse24.mask_nm(w)).double())
    q = from_semi_structured(t)
    assert torch.equal(q.to_dense(), p.to_dense())

"""The decode-path kernel (M <= 16) compiled on a CUDA GPU, against F.linear in
fp64 on the masked (dequantized) dense weight. Run by scripts/gpu_check.sh
(``python -m pytest -q scripts/gpu_tests``); not part of the CPU suite.

What only a GPU can check: libdevice's byte_perm (PRMT) behaves as the
interpreter's emulation (kernels/interpreter.py), and the tensor cores take
INT8 values as exact float16 subnormals (value * 2**-24, no flush to zero).
"""

import pytest
import torch

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.config_space import decode_configs
from sparse24.ops.linear24 import linear_triton as linear_decode

from _cuda import ACT, DEV, assert_matches_reference, gen  # noqa: F401  (gen: the fixture)


def _weight(N, K, wtype, act, gen):
    """(decode-layout weight, fp64 dense weight the kernel must reproduce)."""
    w = torch.randn(N, K, generator=gen, device=DEV)
    if wtype == "int8":
        p = sparse24.compress(w, quantize="int8")
        wm = (w * sparse24.mask_nm(w)).float()
        scale = wm.abs().amax(dim=1) / 127  # the quantization spec, computed independently
        dense = torch.round(wm / scale[:, None]).clamp(-127, 127).double() * scale.double()[:, None]
        return pack_decode(p), dense
    w = w.to(torch.bfloat16 if wtype == "bf16" else torch.float16)
    return pack_decode(sparse24.compress(w)), (w * sparse24.mask_nm(w)).double()


def _run(x, d, b, cfg):
    y = torch.full((x.shape[0], d.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    del y  # poison the allocator's next block: an unwritten element fails
    y = linear_decode(x, d, b, config=cfg)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    return y


@pytest.mark.parametrize("wtype,xtype", [("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32"),
                                         ("int8", "fp16"), ("int8", "bf16"), ("int8", "fp32")])
@pytest.mark.parametrize("M", [1, 2, 4, 8, 13, 16])
def test_default_config_matches_reference(M, wtype, xtype, gen):
    d, dense = _weight(72, 200, wtype, ACT[xtype], gen)
    x = torch.randn(M, 200, generator=gen, device=DEV).to(ACT[xtype])
    b = torch.randn(72, generator=gen, device=DEV)
    assert_matches_reference(_run(x, d, b, None), x, dense, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8-float16"])
def test_every_tile_of_the_space_matches_reference(dtype, gen):
    """Every (BLOCK_N, BLOCK_K) of the space with one stage and no split, plus the space's
    deepest pipelined split-K configs, on the 4096 x 4096 layer it was measured on (about
    8 compiles per dtype: the gpu_check.sh test step has 100 s)."""
    wtype = {"float16": "fp16", "bfloat16": "bf16", "int8-float16": "int8"}[dtype]
    act = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    d, dense = _weight(4096, 4096, wtype, act, gen)
    x = torch.randn(16, 4096, generator=gen, device=DEV).to(act)
    space = decode_configs(16, 4096, 4096, dtype)
    deepest = max(c.num_stages for c in space)
    picked = [c for c in space if (c.num_stages, c.split_k) == (1, 1)]
    picked += [c for c in space if c.num_stages == deepest and c.split_k == 8][:2]
    for cfg in picked:
        assert_matches_reference(_run(x, d, None, cfg), x, dense)


@pytest.mark.parametrize("wtype,xtype", [("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp16"), ("int8", "bf16")])
def test_untuned_call_is_one_deterministic_kernel(wtype, xtype, gen):
    """The 4096 x 4096 untuned default splits K (serial split-K inside the launch): one
    CUDA kernel per call in the profiler, the same bits on every call, right against fp64."""
    d, dense = _weight(4096, 4096, wtype, ACT[xtype], gen)
    x = torch.randn(1, 4096, generator=gen, device=DEV).to(ACT[xtype])
    y1 = _run(x, d, None, None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y2 = linear_decode(x, d)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    assert torch.equal(y1, y2)
    assert_matches_reference(y1, x, dense)

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


# --- INT8 / INT4 on the sparse tensor cores (kernels/sparse24_sp.py) ------------------

def _words_other_reading(d):
    """The mma.sp words under the other plausible reading of the PTX metadata figure for
    m16n8k32 (lane 4g + 2s + c holds ALL 8 groups of the selector's chunk for row g + 8c),
    for the diagnosis below; the layout's own reading: sparse24/decode_format.py."""
    from sparse24.decode_format import _DEC_COLS, _DEC_ROWS, _int32, decode_dims
    R, C = d.shape
    NT, KA, KM = decode_dims(R, C)
    slots = d.slots()
    idx = torch.full((NT * _DEC_ROWS, KA * _DEC_COLS // 4), 0b0100, dtype=torch.int64, device=slots.device)
    idx[:R, :C // 4] = slots[..., 0] | slots[..., 1] << 2
    nib = idx.view(NT, 2, 8, KA, 2, 8).permute(0, 2, 4, 1, 3, 5)          # (t, g, h, c, a, grp)
    words = (nib << (4 * torch.arange(8, device=slots.device))).sum(-1).reshape(NT, 32, KA)
    out = torch.zeros(NT, 32, KM, dtype=torch.int64, device=slots.device)
    out[..., :KA] = words
    meta = d.meta.clone()
    meta[..., KM:] = _int32(out)
    return meta


def test_sparse_tensor_core_metadata_layout(gen):
    """The hardware reads the layout's mma.sp words as the interpreter's emulation does. If
    not, say whether the other reading of the PTX figure matches (a host-side re-pack fixes it)."""
    from sparse24.decode_format import DecodePacked
    d, dense = _weight(128, 256, "int8", torch.float16, gen)
    x = torch.randn(8, 256, generator=gen, device=DEV).half()
    y = _run(x, d, None, None)
    from conftest import matches_reference
    if matches_reference(y, x, dense):
        return
    other = DecodePacked(d.values, _words_other_reading(d), d.shape, d.dtype, d.scale, check=False)
    y2 = _run(x, other, None, None)
    pytest.fail("mma.sp metadata: the layout's reading is wrong; the other reading (lane 4g + 2s + c: "
                "row g + 8c, all 8 groups) " + ("MATCHES: switch _sp_words to it" if matches_reference(y2, x, dense)
                                                  else "does not match either"))


@pytest.mark.parametrize("xtype", ["fp16", "bf16"])
@pytest.mark.parametrize("gs,sym", [(32, False), (128, True)])
@pytest.mark.parametrize("M", [1, 13, 40])
def test_int4_default_config_matches_reference(M, gs, sym, xtype, gen):
    """INT4 weights on the sparse tensor cores against the exact dequantized weight (the mma
    takes u - z exactly, the scale multiplies each group's fp32 partial sums), K off the tiles
    and the groups; 40 rows: two programs of 32 rows along z with the default's serial
    split-K (the route to SP_MAX_M rows), their atomics and workspace blocks on real hardware."""
    p = sparse24.compress(torch.randn(72, 200, generator=gen, device=DEV), quantize="int4", group_size=gs,
                          symmetric=sym)
    dense = p.to_dense().double()
    x = torch.randn(M, 200, generator=gen, device=DEV).to(ACT[xtype])
    b = torch.randn(72, generator=gen, device=DEV)
    assert_matches_reference(_run(x, pack_decode(p), b, None), x, dense, b)


@pytest.mark.parametrize("wtype,xtype", [("int8", "fp16"), ("int8", "bf16"), ("int4", "fp16"), ("int4", "bf16"),
                                         ("fp16", "fp16"), ("bf16", "bf16")])
@pytest.mark.parametrize("M", [20, 32, 64])
def test_sparse_tensor_cores_at_17_to_64_rows(M, wtype, xtype, gen):
    """17-64 rows with INT8 / INT4 weights or 16-bit weights of x's dtype (whose mma.sp words the
    kernel builds from the keep masks): 32 rows of x per program (block_m 32, two 16-row
    blocks on the same weight registers; 64 rows: two programs along z), the 4096 x 4096
    config with its serial split-K, one kernel per call, against fp64 on the exact
    (dequantized) weight. INT8 / INT4: the default route; 16-bit weights: the sparse kernel's
    config given by hand (the route takes it only where this GPU's tuned entry chose it, and
    the committed H200 file has none at 4096 x 4096 past 16 rows: config_space.sp_tunable), the
    default route being the prefill kernel, one kernel too."""
    from sparse24.ops.config_space import builtin_config, decode_default
    act = ACT[xtype]
    key = ('float16' if xtype == 'fp16' else 'bfloat16') if wtype in ("fp16", "bf16") else \
        f"{wtype}-{'float16' if xtype == 'fp16' else 'bfloat16'}"
    if wtype != "int4":
        d, dense = _weight(4096, 4096, wtype, act, gen)
    else:
        p = sparse24.compress(torch.randn(4096, 4096, generator=gen, device=DEV), quantize="int4")
        d, dense = pack_decode(p), p.to_dense().double()
    half = wtype in ("fp16", "bf16")
    cfg = decode_default(4096, 4096, key, rows=32) if half else builtin_config(M, 4096, 4096, layout="decode",
                                                                                dtype=key)
    assert cfg.block_m == 32 and cfg.split_k > 1, cfg
    x = torch.randn(M, 4096, generator=gen, device=DEV).to(act)
    b = torch.randn(4096, generator=gen, device=DEV)
    y = _run(x, d, b, cfg if half else None)
    assert_matches_reference(y, x, dense, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y2 = sparse24.linear(x, d, b)   # backend="auto"
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and ("prefill" if half else "_sp") in kernels[0], kernels
    if half:
        assert_matches_reference(y2, x, dense, b)
    else:
        assert torch.equal(y, y2)

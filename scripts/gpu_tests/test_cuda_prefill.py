"""The prefill kernel (M > 16, decode layout) compiled on a CUDA GPU, against
F.linear in fp64 on the masked (dequantized) dense weight, through the route
``sparse24.linear`` takes on CUDA. Run by scripts/gpu_check.sh; not part of the
CPU suite (there: tests/kernels/test_prefill_kernel.py, in the interpreter).

Tolerances: the CPU suite's table, whose fp32 atol was calibrated on CPU
products; a long-K fp32 failure here is the accumulation-order question of
issue 22 item 6, not necessarily a wrong byte.
"""
import pytest
import torch

import sparse24
from sparse24.ops.linear24 import launch, op
from sparse24.ops.config_space import SP_MAX_M
from sparse24.ops.linear24.prefill import prefill_configs

from _cuda import ACT, DEV, assert_matches_reference, gen  # noqa: F401  (gen: the fixture)
from test_cuda_decode import _weight


@pytest.mark.parametrize("wtype,xtype", [("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp16"), ("int8", "bf16")])
@pytest.mark.parametrize("M", [17, 67, 130, 1000])
def test_auto_route_matches_reference(M, wtype, xtype, gen):
    d, dense = _weight(200, 328, wtype, ACT[xtype], gen)
    x = torch.randn(M, 328, generator=gen, device=DEV).to(ACT[xtype])
    b = torch.randn(200, generator=gen, device=DEV)
    # INT8 runs the sparse tensor-core kernel up to SP_MAX_M rows (config_space); 16-bit weights run it
    # there only where this GPU's tuned entry chose it (config_space.sp_tunable; the committed H200 file
    # has no 200 x 328 entry), else the prefill kernel; every weight the unpack route from UNPACK_MIN_M
    # rows, whose float32 bias here sends the call to the prefill kernel (one rounding, the exact INT8 scale)
    expect = ("triton" if wtype == "int8" else "prefill") if M <= SP_MAX_M else \
        "unpack" if M >= op.UNPACK_MIN_M else "prefill"
    assert op.choose_backend(x, d) == expect
    y = sparse24.linear(x, d, b)
    torch.cuda.synchronize()
    assert_matches_reference(y, x, dense, b)


@pytest.mark.parametrize("wtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_unpack_route_matches_reference(wtype, bias, gen):
    """From UNPACK_MIN_M rows a 16-bit weight is unpacked into the dense scratch (bit-exact: the
    masked weight itself) and multiplied by cuBLAS; 2-D and 3-D x, a bias of x's dtype or none."""
    d, dense = _weight(200, 328, wtype, ACT[wtype], gen)
    act = ACT[wtype]
    u = launch.unpack_dense(d.values, d.meta, None, (200, 328), act)
    torch.cuda.synchronize()
    assert torch.equal(u.double(), dense)
    b = torch.randn(200, generator=gen, device=DEV).to(act) if bias else None
    for shape in ((op.UNPACK_MIN_M, 328), (3, 300, 328)):
        x = torch.randn(*shape, generator=gen, device=DEV).to(act)
        assert op.choose_backend(x, d) == "unpack"
        y = sparse24.linear(x, d, b)
        torch.cuda.synchronize()
        assert y.shape == (*shape[:-1], 200)
        assert_matches_reference(y.reshape(-1, 200), x.reshape(-1, 328), dense, b)


@pytest.mark.parametrize("xtype,gs,sym", [("fp16", 32, False), ("fp16", 128, True), ("bf16", 64, False),
                                          ("bf16", 128, True)])
def test_int4_unpack_route_matches_reference(xtype, gs, sym, gen):
    """INT4 with 16-bit x from UNPACK_MIN_M rows: unpacked into the scratch as (u - z) * s rounded
    once to x's dtype (bit-exact: the operand the kernels multiply), then cuBLAS; a bias of x's
    dtype; odd N and K (a partial quantization group)."""
    act = ACT[xtype]
    p = sparse24.compress(torch.randn(200, 328, generator=gen, device=DEV), quantize="int4", group_size=gs,
                          symmetric=sym)
    d, dense = sparse24.pack_decode(p), p.to_dense().to(act).double()   # exact in fp32, rounded once
    u = launch.unpack_dense(d.values, d.meta, d.scale, (200, 328), act, zero=d.zero, group_size=gs)
    torch.cuda.synchronize()
    assert torch.equal(u.double(), dense)
    b = torch.randn(200, generator=gen, device=DEV).to(act)
    x = torch.randn(300, 328, generator=gen, device=DEV).to(act)
    assert op.choose_backend(x, d) == "unpack"
    y = sparse24.linear(x, d, b)
    torch.cuda.synchronize()
    assert_matches_reference(y, x, dense, b)


# one test per config: the workers share the compiles (32 configs, 2-4 s each, were two serial chains)
PREFILL_CONFIGS = sorted({c for M in (32, 64, 4096) for c in prefill_configs(M)}, key=str)


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
@pytest.mark.parametrize("cfg", PREFILL_CONFIGS, ids=[f"BM{c.block_m}_BN{c.block_n}_BK{c.block_k}_G{c.group_m}_W"
                                                       f"{c.num_warps}_S{c.num_stages}_SK{c.split_k}"
                                                       for c in PREFILL_CONFIGS])
def test_every_config_matches_reference(cfg, wtype, gen):
    d, dense = _weight(264, 520, wtype, torch.float16, gen)
    x = torch.randn(300, 520, generator=gen, device=DEV).half()
    y = launch.linear_prefill(x, d, None, config=cfg)
    torch.cuda.synchronize()
    assert_matches_reference(y, x, dense)


@pytest.mark.parametrize("bm,bn,bk,split", [(32, 64, 128, 2), (64, 128, 128, 4), (32, 128, 256, 4), (128, 64, 64, 2),
                                              (128, 256, 64, 2), (128, 128, 64, 16), (128, 256, 64, 8)])
def test_split_k_matches_reference(bm, bn, bk, split, gen):
    """The prefill kernel's split-K on the GPU (partial sums added as a pairwise tree through the
    workspace, an arrival counter per node, programs racing for real): against fp64, then four
    more calls bit-identical (the counters are back at zero after each, and the sum's order does
    not depend on which program arrives first)."""
    import dataclasses
    from sparse24.ops.config_space import KernelConfig
    from sparse24.ops.linear24.prefill import natural_tile
    if bn == 256 and not natural_tile(128, 256):
        return   # the wide tile needs Triton >= 3.6 (refused there: the CPU tests)
    cfg = dataclasses.replace(KernelConfig(bm, bn, bk, 8, 1, min(bn, 128) // 16, 2, kernel="prefill"), split_k=split)
    d, dense = _weight(264, 1000, "int8", torch.float16, gen)
    x = torch.randn(40, 1000, generator=gen, device=DEV).half()
    b = torch.randn(264, generator=gen, device=DEV)
    y = launch.linear_prefill(x, d, b, config=cfg)
    torch.cuda.synchronize()
    assert_matches_reference(y, x, dense, b)
    for _ in range(4):
        assert torch.equal(launch.linear_prefill(x, d, b, config=cfg), y)


def test_int8_bf16_natural_tiles_match_reference(gen):
    """INT8 weights with bf16 x in the natural-order tiles (from 128 rows, 2 stages): the
    sign-magnitude lanes enter the dot as bf16 subnormals scaled by 2**126 in one fma.rn.bf16x2
    (v * 2**-7; the interpreter emulates it, the GPU's subnormal handling is what this checks)
    and the sums are scaled back by 2**7 after the loop."""
    from sparse24.ops.linear24.prefill import natural_tile
    d, dense = _weight(264, 520, "int8", torch.bfloat16, gen)
    x = torch.randn(300, 520, generator=gen, device=DEV).bfloat16()
    b = torch.randn(264, generator=gen, device=DEV)
    tiles = [c for c in prefill_configs(4096) if natural_tile(c.block_m, c.block_n) and c.num_stages == 2]
    assert tiles
    for cfg in tiles:
        y = launch.linear_prefill(x, d, b, config=cfg)
        torch.cuda.synchronize()
        assert_matches_reference(y, x, dense, b)


@pytest.mark.parametrize("xtype,gs,sym", [("fp16", 32, False), ("fp16", 128, True), ("bf16", 32, False),
                                          ("bf16", 128, True), ("fp32", 64, False)])
def test_int4_wide_tiles_match_reference(xtype, gs, sym, gen):
    """INT4 weights in the two large-M tiles (256 x 128; 128 x 256, two halves of W against one x
    tile, BLOCK_K 64 and 128, where this Triton has it); their decode permutes the value word
    itself and takes u - z by one fma.rn.f16x2 (fp16 / fp32 x) or, bf16 x, reads the codes as
    bfloat16 subnormals (three fma.rn.bf16x2 per pair: int4_bf16_dequant; the interpreter can
    run only its emulation, so this is the check that the GPU takes bf16 subnormal operands).
    N = 264 puts the last block's second half past N, K = 520 a partial K-tile, against the exact
    dequantized weight rounded once to x's dtype (the dot's operand;
    tests/kernels/test_int4_kernel.py, _operand)."""
    p = sparse24.compress(torch.randn(264, 520, generator=gen, device=DEV), quantize="int4", group_size=gs,
                          symmetric=sym)
    d, dense = sparse24.pack_decode(p), p.to_dense().to(ACT[xtype]).double()
    x = torch.randn(300, 520, generator=gen, device=DEV).to(ACT[xtype])
    for cfg in prefill_configs(4096):
        if cfg.block_m * cfg.block_n == 256 * 128 and cfg.num_stages == 2:
            y = launch.linear_prefill(x, d, None, config=cfg)
            torch.cuda.synchronize()
            assert_matches_reference(y, x, dense)


@pytest.mark.parametrize("gs,sym", [(32, False), (128, True)])
def test_int4_bf16_exact_scales_match_reference(gs, sym, gen):
    """A bfloat16 weight's INT4 scales (8 significant bits: format.bf16_exact_scales) read as
    bfloat16, as a bfloat16 module passes them: two fma.rn.bf16x2 per pair (_SCALE_BF16X2) in
    the three kinds of prefill tile at 2 stages (64 x 64: x permuted; 128 x 64: x in its own
    order, two accumulators; 128 x 256: the large-M default; three compiles, for the step's
    time limit), and a module's route end to end (the sparse tensor cores at 8 rows, taking the
    exact grid; at 300 rows the unpack route, reading the bfloat16 scales, rounding once to
    bfloat16, as to_dense of a bfloat16 weight)."""
    w = torch.randn(264, 520, generator=gen, device=DEV).bfloat16()
    p = sparse24.compress(w, quantize="int4", group_size=gs, symmetric=sym)
    d, dense = sparse24.pack_decode(p), p.to_dense().double()
    sb = d.scale.bfloat16()
    assert torch.equal(sb.half(), d.scale)
    x = torch.randn(300, 520, generator=gen, device=DEV).bfloat16()
    tiles = {(64, 64), (128, 64), (128, 256)}
    cfgs = {(c.block_m, c.block_n): c for c in prefill_configs(4096) + prefill_configs(64)
            if (c.block_m, c.block_n) in tiles and c.num_stages == 2 and c.block_k == (128 if c.block_m < 128 else 64)}
    assert len(cfgs) == 3, cfgs
    for cfg in cfgs.values():
        y = launch.run_prefill(x, d.values, d.meta, sb, None, 264, cfg, d.zero, gs)
        torch.cuda.synchronize()
        assert_matches_reference(y, x, dense)
    lin = torch.nn.Linear(520, 264, device=DEV, dtype=torch.bfloat16)
    layer = sparse24.Sparse24Linear.from_linear(lin, mode="compressed", quantize="int4", group_size=gs,
                                                symmetric=sym)
    assert layer.layout == "decode" and layer._scale_bf16 is not None
    exact = layer.sparse_tensor().to(dtype=torch.float32).to_dense().double()   # (u - z) * s, exact in fp32
    for M, ref in ((8, exact), (300, exact.bfloat16().double())):
        y = layer(x[:M])
        torch.cuda.synchronize()
        assert_matches_reference(y, x[:M], ref, layer.bias.detach())


def test_a_captured_unpack_keeps_its_scratch_when_a_larger_layer_grows_it(gen):
    """A CUDA graph captured on the unpack route writes the dense scratch it saw on every replay:
    after a larger layer grows the scratch, that buffer must not go back to the allocator (a
    tensor taking it would be overwritten by the replay). The replay still matches fp64 and a
    buffer of the old scratch's size allocated after the growth is left untouched."""
    launch.release_workspaces()
    d, dense = _weight(200, 328, "fp16", torch.float16, gen)
    x = torch.randn(op.UNPACK_MIN_M + 44, 328, generator=gen, device=DEV).half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up off the capture stream: plans, compile, scratch
        for _ in range(2):
            sparse24.linear(x, d)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sparse24.linear(x, d)
    (scratch,) = launch._DENSE_SCRATCH.values()   # (one device since release_workspaces)
    old_bytes = scratch.numel()
    del scratch
    big, big_dense = _weight(1024, 2048, "fp16", torch.float16, gen)
    xb = torch.randn(op.UNPACK_MIN_M, 2048, generator=gen, device=DEV).half()
    yb = sparse24.linear(xb, big)                       # grows the scratch
    filler = torch.zeros(old_bytes, dtype=torch.uint8, device=DEV)
    x.copy_(torch.randn(x.shape, generator=gen, device=DEV).half())
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(y, x, dense)
    assert not filler.any()
    assert_matches_reference(yb, xb, big_dense)
    del graph
    launch.release_workspaces()

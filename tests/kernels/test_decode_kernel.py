"""The decode-path kernel (M <= 16), run on CPU tensors in Triton's interpreter
(the same source the GPU compiles; libdevice's byte_perm bound to its exact
emulation), against F.linear in fp64 on the masked dense weight. Plus the
byte-permute selectors, the config space, and an ahead-of-time sm_90 compile."""
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import triton.language as tl

import sparse24
from sparse24.decode_format import DecodePacked, pack_decode
from sparse24.kernels.interpreter import InterpretedKernel, byte_perm_reference
from sparse24.kernels.sparse24_decode import SELECTORS, SM_MASK, int8_bf16_words
from sparse24.ops.config_space import KernelConfig, check_decode_config, decode_configs
from sparse24.ops.linear24 import launch
from sparse24.ops.linear24 import linear_triton as linear_decode

from conftest import assert_matches_reference, load_script, matches_reference

ROOT = Path(__file__).resolve().parents[2]
CASES = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
CODE_BIT = (0, 1, 3, 2)   # the decode layout's keep-mask bit of each slot


# --- byte_perm and the selectors -------------------------------------------------

def test_byte_perm_reference_follows_the_cuda_definition():
    rng = np.random.default_rng(0)
    x, y, s = (rng.integers(-2 ** 31, 2 ** 31, 64, dtype=np.int64).astype(np.int32) for _ in range(3))
    out = byte_perm_reference(x, y, s)
    for xi, yi, si, oi in zip(x.tolist(), y.tolist(), s.tolist(), out.tolist()):
        src = (xi & 0xFFFFFFFF) | (yi & 0xFFFFFFFF) << 32
        want = sum(((src >> (8 * ((si >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))
        assert oi & 0xFFFFFFFF == want
    assert byte_perm_reference(0x03020100, 0x07060504, 0x3210) == 0x03020100
    assert byte_perm_reference(0x03020100, 0x07060504, 0x7654 | 0x8888 | 0x12340000) == 0x07060504  # bits ignored
    assert byte_perm_reference(0x44332211, 0, 0x4401) == 0x00001122             # nibble n picks byte n


@pytest.mark.parametrize("int8,b", [(False, 0), (True, 0), (True, 1)], ids=["16bit", "int8-b0", "int8-b1"])
def test_selectors_decode_every_slot_pair(int8, b):
    """S = field * MUL + ADD, byte-permuted as the kernel does, gives each dense
    slot exactly its value (or zero) for all six slot pairs."""
    mul01, add01, mul23, add23 = SELECTORS[(int8, b)]
    for lo_slot, hi_slot in CASES:
        code = (1 << CODE_BIT[lo_slot]) | (1 << CODE_BIT[hi_slot])
        if int8:   # word bytes (lo_0, lo_1, hi_0, hi_1), sign-magnitude
            lo, hi = (0x85, 0x13) if b == 0 else (0x7F, 0xFF)
            word = (lo << 8 * b) | (hi << (16 + 8 * b)) | ((0x2A << 8 * (1 - b)) | (0x91 << (16 + 8 * (1 - b))))
            lane = lambda v: (v & 0x80) << 8 | (v & 0x7F)   # noqa: E731  the exact fp16 subnormal bits
        else:
            lo, hi = 0xAB12, 0xCD34
            word = lo | hi << 16
            lane = lambda v: v                              # noqa: E731
        d01 = int(byte_perm_reference(word, 0, (code & 3) * mul01 + add01)) & 0xFFFFFFFF
        d23 = int(byte_perm_reference(word, 0, ((code >> 2) & 3) * mul23 + add23)) & 0xFFFFFFFF
        if int8:
            d01, d23 = d01 & SM_MASK, d23 & SM_MASK
        want = [0, 0, 0, 0]
        want[lo_slot], want[hi_slot] = lane(lo), lane(hi)
        assert [d01 & 0xFFFF, d01 >> 16, d23 & 0xFFFF, d23 >> 16] == want, (lo_slot, hi_slot)


@pytest.mark.parametrize("kind", list(SELECTORS), ids=str)
def test_one_multiply_add_gives_two_groups_selectors(kind):
    """The kernel computes the selectors of groups g and g + 4 (fields 16 bits apart in
    the lane's word) with ONE multiply-add: (f_lo | f_hi << 16) * MUL + ADD * 0x10001 in
    32 bits must hold S(f_lo) in its low half and S(f_hi) in its high half, which needs
    S = f * MUL + ADD within 0..0xFFFF for every field (a carry out of the low half
    would change the high selector's byte choice: the old slots 3,2 constant 0x43E6
    + 0x6E66 carried at f = 3)."""
    mul01, add01, mul23, add23 = SELECTORS[kind]
    for mul, add in ((mul01, add01), (mul23, add23)):
        assert all(0 <= f * mul + add <= 0xFFFF for f in range(4))
        for lo in range(4):
            for hi in range(4):
                packed = ((lo | hi << 16) * mul + add * 0x10001) & 0xFFFFFFFF
                assert (packed & 0x7777, (packed >> 16) & 0x7777) == ((lo * mul + add) & 0x7777,
                                                                      (hi * mul + add) & 0x7777)
    # the premise fails for the constants before the change: the test can fail
    assert not all(0 <= f * 0x43E6 + 0x6E66 <= 0xFFFF for f in range(4))


# --- the kernel against fp64 ---------------------------------------------------

def _cfg(bn, bk, split=1, stages=1):
    return KernelConfig(16, bn, bk, 1, split, bn // 16, stages, kernel="decode")


def _weight(N, K, wtype, gen):
    w = torch.randn(N, K, generator=gen)
    if wtype == "int8":
        p = sparse24.compress(w, quantize="int8")
        return pack_decode(p), p.to_dense().double()
    w = w.half()
    return pack_decode(sparse24.compress(w)), (w * sparse24.mask_nm(w)).double()


def _case(M, N, K, xtype, wtype, bias, cfg):
    ids = f"M{M}-N{N}-K{K}-x{str(xtype)[6:]}-w{wtype}-{'bias' if bias else 'nobias'}-" \
          f"{cfg.block_n}x{cfg.block_k}s{cfg.split_k}"
    return pytest.param(M, N, K, xtype, wtype, bias, cfg, id=ids)


@pytest.mark.parametrize("M,N,K,xtype,wtype,bias,cfg", [
    # every M bucket, odd M, both activation dtypes, both weight kinds, bias on/off
    _case(1, 40, 100, torch.float16, "fp16", True, _cfg(32, 64)),
    _case(2, 72, 200, torch.float32, "fp16", False, _cfg(64, 128)),
    _case(4, 40, 256, torch.float16, "int8", True, _cfg(64, 64)),
    _case(8, 72, 200, torch.float32, "int8", False, _cfg(128, 128)),
    _case(16, 40, 100, torch.float16, "fp16", False, _cfg(128, 256)),
    _case(13, 72, 200, torch.float16, "int8", True, _cfg(64, 128, split=2)),
    _case(3, 40, 300, torch.float32, "fp16", True, _cfg(32, 64, split=3)),    # 5 K-tiles (last partial), 3 splits
    _case(16, 200, 64, torch.float16, "fp16", True, _cfg(128, 64)),           # 2 programs, one K-tile
    _case(13, 40, 200, torch.float32, "int8", True, _cfg(64, 64, split=8)),   # 4 K-tiles: splits 4..7 own none
    # serial split-K where K divides into tiles (no partial-tile code), odd M, both activation dtypes
    _case(5, 72, 256, torch.float32, "int8", True, _cfg(64, 64, split=3, stages=3)),  # split 2 owns no tile
    _case(7, 40, 256, torch.float16, "fp16", True, _cfg(64, 128, split=2, stages=2)),
    _case(11, 136, 512, torch.float16, "int8", False, _cfg(128, 64, split=5)),         # 8 tiles in 5 splits
    # one K-tile per split (SPLIT_K == K-tiles, the small layers' default): the loop-free variant
    _case(5, 72, 256, torch.float16, "fp16", True, _cfg(64, 64, split=4)),
    _case(3, 40, 200, torch.float32, "int8", False, _cfg(64, 64, split=4)),            # the last tile partial
])
def test_kernel_matches_reference(M, N, K, xtype, wtype, bias, cfg, gen):
    d, dense = _weight(N, K, wtype, gen)
    x = torch.randn(M, K, generator=gen).to(xtype)
    b = torch.randn(N, generator=gen) if bias else None
    tri = linear_decode(x, d, b, config=cfg)
    assert tri.dtype == xtype and tri.shape == (M, N)
    assert_matches_reference(tri, x, dense, b)


def _space(dtype: str) -> list[KernelConfig]:
    """One config per distinct (BLOCK_N, BLOCK_K, SPLIT_K) the tuner may pick (stages do not
    change the interpreted result)."""
    seen = {}
    for c in decode_configs(16, 4096, 4096, dtype):
        seen.setdefault((c.block_n, c.block_k, c.split_k), c)
    return list(seen.values())


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
def test_every_config_in_the_space_matches_reference(wtype, gen):
    # Each config the tuner may pick must be right before device time is spent on it. N = 72 and
    # K = 200 leave a partial row block, a partial K-tile and a partial metadata atom; deep
    # split-K leaves splits with no K-tile.
    d, dense = _weight(72, 200, wtype, gen)
    b = torch.randn(72, generator=gen)
    for cfg in _space("int8-float16" if wtype == "int8" else "float16"):
        x = torch.randn(5, 200, generator=gen).half()
        assert_matches_reference(linear_decode(x, d, b, config=cfg), x, dense, b)


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
def test_a_wrong_keep_bit_fails_the_check(wtype, gen):
    """The error bound catches one mis-decoded group, and the kernel really decodes
    the keep masks: with one group's kept pair moved to the other two slots it
    matches the dense weight those bits describe, not the original."""
    N, K = 40, 128
    d, dense = _weight(N, K, wtype, gen)
    meta = d.meta.clone()
    # row 5 (b 0, i 5), columns 16..19 (atom 0, q 1, j 0): lane 20, group 2, bits 8..11
    meta[0, 20, 0] ^= 0b1111 << 8                           # complement: the other two slots
    bad = DecodePacked(d.values, meta, d.shape, d.dtype, d.scale, check=False)   # valid, wrong positions
    bad = pack_decode(bad.to_sparse24())   # INT8: its mma.sp words follow the keep masks
    assert not torch.equal(bad.to_dense(), d.to_dense())
    x = torch.randn(13, K, generator=gen)
    tri = linear_decode(x, bad, config=_cfg(64, 64))
    assert not matches_reference(tri, x, dense)
    assert_matches_reference(tri, x, bad.to_dense().double())


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
def test_a_wrong_value_byte_fails_the_check(wtype, gen):
    """One kept value with its least significant byte changed (fp16: the low 8
    mantissa bits complemented; INT8: the lowest magnitude bit flipped, one
    quantization step) is outside the error bound, at the K of these tests."""
    N, K = 40, 128
    d, dense = _weight(N, K, wtype, gen)
    # Both layouts start with atom 0, row tile 0, 16 bytes per lane: byte 0 of lane 20 is the
    # low byte of the lower kept value of row 5, columns 0..3.
    flat = d.values.view(torch.uint8).flatten().clone()
    flat[20 * 16] ^= 0xFF if wtype == "fp16" else 0x01
    bad = DecodePacked(flat.view(d.values.dtype).view(d.values.shape), d.meta, d.shape, d.dtype, d.scale)
    assert not torch.equal(bad.to_dense(), d.to_dense())
    x = torch.randn(13, K, generator=gen)
    tri = linear_decode(x, bad, config=_cfg(64, 64))
    assert not matches_reference(tri, x, dense)
    assert_matches_reference(tri, x, bad.to_dense().double())


def test_strided_3d_and_empty_inputs(gen):
    d, dense = _weight(40, 64, "fp16", gen)
    x2 = torch.randn(64, 13, generator=gen).half().t()            # (13, 64), strides (1, 13)
    x3 = torch.randn(2, 3, 80, generator=gen).half()[:, :, 8:72]   # (2, 3, 64), rows 80 apart
    for x in (x2, x3):
        assert not x.is_contiguous()
        y = linear_decode(x, d, config=_cfg(32, 64))
        assert y.shape == (*x.shape[:-1], 40)
        assert_matches_reference(y, x, dense)
    assert linear_decode(torch.randn(0, 64).half(), d).shape == (0, 40)
    z = pack_decode(sparse24.compress(torch.randn(5, 0).half()))
    b = torch.randn(5, generator=gen)
    assert torch.equal(linear_decode(torch.randn(3, 0), z, b), b.expand(3, 5))


def test_split_k_is_one_launch_and_deterministic(monkeypatch, gen):
    """Serial split-K: one launch, output in x's dtype (no fp32 buffer, no cast), the
    counters left at zero for the next launch, and the same bits on every call, in
    deterministic mode too (the last program adds the partials in split order)."""
    seen = []
    real = launch._Plan.launch
    monkeypatch.setattr(launch._Plan, "launch", lambda plan, grid, *a: seen.append(grid) or real(plan, grid, *a))
    d, dense = _weight(72, 300, "fp16", gen)
    x, b = torch.randn(3, 300, generator=gen).half(), torch.randn(72, generator=gen)
    cfg = _cfg(64, 64, split=4)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        y1 = linear_decode(x, d, b, config=cfg)
        torch.use_deterministic_algorithms(True)
        y2 = linear_decode(x, d, b, config=cfg)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [(2, 4, 1), (2, 4, 1)]
    assert y1.dtype == torch.float16 and torch.equal(y1, y2)
    assert_matches_reference(y1, x, dense, b)
    counts = next(plan.extra[1] for key, plan in launch._PLANS.items() if key[8] == 4 and plan.config == cfg)
    assert counts.numel() >= 2 and not counts.any()


def test_rejects_bad_input_and_changes_nothing(gen):
    d, _ = _weight(40, 64, "fp16", gen)
    x = torch.randn(3, 64, generator=gen)
    saved = [t.clone() for t in (x, d.values, d.meta)]
    with pytest.raises(ValueError, match="a Sparse24Tensor weight runs the 'matmul' kernel, got a config for 'decode'"):
        linear_decode(x, sparse24.compress(torch.randn(40, 64).half()), config=_cfg(64, 64))
    with pytest.raises(ValueError, match="a DecodePacked weight runs the 'decode' kernel, got a config for 'matmul'"):
        linear_decode(x, d, config=KernelConfig(16, 64, 64))
    # the internal launch, which callers reach with configs unchecked, refuses the other layout's
    # kernel too (it once computed garbage: a probe's 'matmul' tile on a decode-layout weight)
    v1 = sparse24.compress(torch.randn(40, 64).half())
    with pytest.raises(ValueError, match="a 'matmul' config cannot read a layout-decode weight"):
        launch.run_prefill(x.half(), d.values, d.meta, None, None, 40, KernelConfig(32, 64, 64, num_warps=4))
    with pytest.raises(ValueError, match="a 'prefill' config cannot read a layout-v1 weight"):
        launch.run(x.half(), v1.values, v1.meta, None, None, 40, KernelConfig(32, 64, 64, kernel="prefill"))
    with pytest.raises(TypeError, match="no bfloat16 arithmetic"):
        linear_decode(x.bfloat16(), d)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32, got torch.float64"):
        linear_decode(x.double(), d)
    with pytest.raises(ValueError, match="x has 32 features but the weight expects 64"):
        linear_decode(x[:, :32], d)
    with pytest.raises(ValueError, match=r"bias must have shape \(40,\)"):
        linear_decode(x, d, torch.randn(39))
    with pytest.raises(ValueError, match="num_warps == block_n // 16"):
        linear_decode(x, d, config=KernelConfig(16, 64, 64, 1, 1, 2, 1, kernel="decode"))
    with pytest.raises(ValueError, match="block_k >= 64"):
        linear_decode(x, d, config=KernelConfig(16, 64, 32, 1, 1, 4, 1, kernel="decode"))
    with pytest.raises(ValueError, match="M must be >= 1"):
        decode_configs(0, 4096, 4096)
    for before, after in zip(saved, (x, d.values, d.meta)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("M", [17, 37])
def test_rows_past_16_run_in_more_programs(M, gen):
    """Above decode sizes each program takes 16 rows of x (a third grid dimension)."""
    for wtype in ("fp16", "int8"):
        d, dense = _weight(72, 200, wtype, gen)
        x, b = torch.randn(M, 200, generator=gen).half(), torch.randn(72, generator=gen)
        assert_matches_reference(linear_decode(x, d, b, config=_cfg(64, 64, split=2)), x, dense, b)


def test_interpreted_launch_restores_the_libdevice_stub(gen):
    from triton.language.extra import libdevice
    stub = libdevice.byte_perm
    d, dense = _weight(40, 64, "fp16", gen)
    x = torch.randn(2, 64, generator=gen)
    assert_matches_reference(linear_decode(x, d, config=_cfg(32, 64)), x, dense)
    assert libdevice.byte_perm is stub


# --- the config space and its measured budget -------------------------------------

def test_config_space():
    from sparse24.ops.config_space import SP_LOAD_WORDS, sp_load_words
    for dtype in ("float16", "bfloat16", "int8-float16"):
        space = decode_configs(1, 4096, 4096, dtype)
        # M does not change the kernel; the sparse tensor-core kernel (INT8) holds a K-tile's x words
        # for rows 8-15 too from 9 rows: the tiles over SP_LOAD_WORDS then leave its space
        assert [c for c in space if sp_load_words(c.block_n, c.block_k, c.num_warps, dtype, 16) <= SP_LOAD_WORDS
                or not dtype.startswith("int8-")] == decode_configs(16, 4096, 4096, dtype)
        for c in space:
            check_decode_config(c)
            assert -(-4096 // c.block_n) * c.split_k <= 4 * 132 and 4096 >= 2 * c.split_k * c.block_k
        assert {c.block_n for c in space} == {64, 128}
    assert all(c.split_k == 1 for c in decode_configs(4, 40, 100))   # too short to split


def test_untuned_default_fills_the_gpu_at_the_listed_shapes():
    """decode_default (scripts/kernel_static_check.py --occupancy has the bytes in flight): every
    listed shape gives each of 132 SMs a program, splits K only into whole K-tiles, pipelines
    exactly where a program has a later K-tile to prefetch (never on the sparse tensor-core
    kernel of INT8 / INT4 with 16-bit x, which loads into registers), and is a config of the kernel."""
    from sparse24.ops.config_space import LISTED_SHAPES, decode_default
    for dtype in ("float16", "bfloat16", "int8-float16", "int8-bfloat16", "int8-float32", "int4-float16",
                  "int4-bfloat16"):
        sparse = dtype.startswith(("int8-", "int4-")) and not dtype.endswith("float32")
        for N, K in LISTED_SHAPES:
            c = check_decode_config(decode_default(N, K, dtype))
            tiles = -(-K // c.block_k)
            per_split = -(-tiles // c.split_k)
            assert -(-N // c.block_n) * c.split_k >= 132, (dtype, N, K, c)
            assert -(-tiles // per_split) == c.split_k                     # no split without a K-tile
            assert (c.num_stages == 1) == (sparse or per_split == 1), (dtype, N, K, c)
    assert decode_default(4096, 4096).split_k == 4 and decode_default(28672, 8192).split_k == 1


def _committed_csvs() -> list[Path]:
    return sorted((ROOT / "results" / "static-sm90").glob("decode-triton-*.csv"))


@pytest.mark.parametrize("path", _committed_csvs(), ids=lambda p: p.name)
def test_committed_sass_counts_cover_the_space_within_budget(path):
    """The committed SASS counts (scripts/kernel_static_check.py --sass) cover every config
    decode_configs returns for the 4096 x 4096 layer at M = 1..16, and all are within budget:
    change the space, re-run the tool."""
    budget = {"float16": 0.15, "bfloat16": 0.15, "int8-float16": 0.20}
    lines = path.read_text().splitlines()
    rows = [line.split(",") for line in lines if line and not line.startswith(("#", "kernel,"))]
    have = {(r[1], int(r[2]), r[3]): float(r[6]) for r in rows}
    name = "BM{}_BN{}_BK{}_W{}_S{}_SK{}"
    for dtype, m in itertools.product(budget, (1, 2, 4, 8, 16)):
        for c in decode_configs(m, 4096, 4096, dtype):
            key = (dtype, m, name.format(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k))
            assert key in have, f"{path.name} lacks {key}"
            assert have[key] <= budget[dtype], key
    summary = re.search(r"max warp_instr_per_byte at M<=16: fp16 ([\d.]+), bf16 ([\d.]+), int8 ([\d.]+)",
                        "\n".join(lines))
    assert summary, lines[-1]
    assert all(float(v) <= b for v, b in zip(summary.groups(), (0.15, 0.15, 0.22)))


def test_sass_counts_are_committed_for_both_tritons():
    names = {p.name for p in _committed_csvs()}
    assert any(n.startswith("decode-triton-3.9") for n in names) and any(n.startswith("decode-triton-3.6")
                                                                       for n in names), names


# --- ahead-of-time compile for sm_90 -----------------------------------------------

def _static_check():
    return load_script("kernel_static_check")


@pytest.mark.parametrize("x_dtype,wtype,bias,cfg,cap", [
    pytest.param(torch.float16, "fp16", False, _cfg(64, 128), 90, id="fp16-sm90"),
    pytest.param(torch.bfloat16, "bf16", True, _cfg(128, 64, split=2, stages=3), 90, id="bf16-bias-splitk-sm90"),
    pytest.param(torch.float16, "int8", True, _cfg(128, 128, stages=2), 90, id="int8-fp16-bias-sm90"),
    pytest.param(torch.bfloat16, "int8", False, _cfg(32, 64), 80, id="int8-bf16-mma-sm80"),
])
def test_kernel_compiles_for_gpus(x_dtype, wtype, bias, cfg, cap, monkeypatch):
    """No GPU here: compile ahead of time (Triton -> PTX -> cubin with the ptxas in
    Triton's wheel) with the launcher's exact arguments; on sm_90 also count the main
    loop's SASS as scripts/kernel_static_check.py does and hold it to the budget."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    N, K = 256, 512
    w = torch.randn(N, K)
    if wtype == "int8":
        d = pack_decode(sparse24.compress(w, quantize="int8"))
    else:
        d = pack_decode(sparse24.compress(w.to(torch.bfloat16 if wtype == "bf16" else torch.float16)))
    x = torch.randn(16, K).to(x_dtype)
    target = torch.empty(16, N, dtype=x_dtype)
    b = torch.randn(N) if bias else None
    compiled = launch.aot_compile(x, d, b, target, cfg, cfg.split_k, (cap // 10, cap % 10))
    ptx = compiled.asm["ptx"]
    assert "prmt.b32" in ptx                                            # the byte permutes
    if wtype == "int8":  # INT8 x fp16/bf16: the sparse tensor-core kernel, no dense dot
        assert "mma.sp::ordered_metadata.sync.aligned.m16n8k32" in ptx and "wgmma" not in ptx and "mma.sync" not in ptx
    else:
        assert ("wgmma" in ptx) == (cap == 90 and cfg.block_n >= 64)
    if cfg.split_k > 1:
        assert "atom.global" in ptx or "red.global" in ptx
    if cap == 90:
        tool = _static_check()
        loop = tool.main_loop(tool.sass_instructions(compiled.asm["cubin"]))
        value_bytes = 1 if wtype == "int8" else 2
        tile = cfg.block_n * cfg.block_k * value_bytes // 2 + cfg.block_n * cfg.block_k // 8
        assert len(loop) * cfg.num_warps / tile <= (0.20 if wtype == "int8" else 0.15)



def _bf16_words_kernel(d_ptr, y_ptr, c_ptr, n: tl.constexpr):
    d = tl.load(d_ptr + tl.arange(0, n))
    y, c = int8_bf16_words(d)
    tl.store(y_ptr + tl.arange(0, n), y)
    tl.store(c_ptr + tl.arange(0, n), c)


def test_int8_bf16_words_build_every_value_exactly():
    """INT8 weights with bfloat16 activations: the kernel's integer bit building
    (int8_bf16_words, run here in Triton's interpreter on every pair of
    sign-magnitude values, as the permute + AND leave them, and on zero lanes)
    gives bfloat16 words y, c whose difference is the INT8 value exactly
    (bfloat16 subtraction emulated by torch: fp32 arithmetic rounded to bfloat16,
    as the GPU's round-to-nearest subtraction)."""
    v = torch.arange(-127, 128)
    lane = torch.where(v < 0, 0x8000, 0) | v.abs()                    # sign bit 15, |v| in bits 0-6
    lo, hi = lane.repeat(255), lane.repeat_interleave(255)           # every pair of values in one word
    d = torch.cat([lo | hi << 16, torch.zeros(65536 - 255 * 255, dtype=torch.int64)])  # + zero lanes
    d = torch.where(d >= 2 ** 31, d - 2 ** 32, d).to(torch.int32)
    y, c = torch.empty_like(d), torch.empty_like(d)
    InterpretedKernel(_bf16_words_kernel)[(1,)](d, y, c, n=65536)
    got = (y.view(torch.bfloat16) - c.view(torch.bfloat16)).view(-1, 2).float()   # (low, high) lanes
    assert torch.equal(got[:255 * 255], torch.stack([v.repeat(255), v.repeat_interleave(255)], 1).float())
    assert not got[255 * 255:].any()


@pytest.mark.parametrize("dtype,N,K", [("float16", 4096, 4096), ("bfloat16", 4096, 4096),
                                       ("int8-float16", 4096, 4096), ("int8-bfloat16", 4096, 4096),
                                       ("int4-float16", 4096, 4096), ("int4-bfloat16", 4096, 4096),
                                       # the listed layer closest to the budget: one K-tile per program
                                       ("float16", 3072, 768), ("bfloat16", 3072, 768),
                                       ("int8-float16", 3072, 768), ("int8-bfloat16", 3072, 768),
                                       ("int4-float16", 3072, 768), ("int4-bfloat16", 3072, 768)])
def test_default_config_within_budget_live_sm90(dtype, N, K, monkeypatch):
    """Compiled here and now for sm_90 (not a committed CSV): the config an N x K
    decode-layout layer of each (weight, activation) pair uses untuned, its SASS counted
    as scripts/kernel_static_check.py does, prologue and epilogue amortized over the
    program's K range: all instructions and integer-pipe ones within budget."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.delenv("SPARSE24_CONFIG_DIR", raising=False)
    tool = _static_check()
    cfg, source = tool.default_config(dtype, N, K, tuned=False)   # (an H200 file ships for float16 too)
    assert source == "builtin" and cfg.split_k > 1        # the serial split-K epilogue is counted too
    total, ints = tool.amortized(tool.compile_listed(dtype, cfg, 90, N, K))
    assert total <= tool.BUDGET[dtype], total
    assert ints <= tool.INT_BUDGET, ints

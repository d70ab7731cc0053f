"""The sparse tensor-core kernel (kernels/sparse24_sp.py: INT8 / INT4 weights with
float16 x at M <= 16), run in Triton's interpreter with its inline PTX emulated,
against F.linear in fp64 on the dense weight; the emulation of ``mma.sp`` against
a dense product built from the PTX fragment definitions; the layout's mma.sp
metadata words against the layout-v1 slots; and the route that picks the kernel.

What no CPU can check (the hardware's reading of the metadata operand and the
fragments) is tested on a GPU by scripts/gpu_check.sh (scripts/gpu_tests)."""
import collections
import dataclasses
import itertools

import numpy as np
import pytest
import torch

import sparse24
from sparse24.decode_format import DecodePacked, decode_dims, pack_decode
from sparse24.kernels.sparse24_sp import SP_META_NIBBLE_PAD, mma_sp_reference
from sparse24.ops.config_space import SP_MAX_M, KernelConfig, builtin_config, decode_configs, decode_default, m_bucket
from sparse24.ops.linear24 import launch
from sparse24.ops.linear24 import linear_triton as linear_decode

from conftest import assert_matches_reference, load_script, matches_reference


def _cfg(bn, bk, split=1, stages=1, tiles_per_warp=1, rows=16):
    return KernelConfig(rows, bn, bk, 1, split, bn // (16 * tiles_per_warp), stages, kernel="decode")


def _words(h):
    """float16 (..., 2) -> int32 words (low half first)."""
    return np.ascontiguousarray(h.astype(np.float16)).view(np.int32)[..., 0]


# --- the mma.sp emulation ------------------------------------------------------------

@pytest.mark.parametrize("selector", [0, 1])
def test_mma_sp_emulation_computes_the_documented_product(selector):
    """Fragments built from the PTX definitions (A: the m16n8k16 A layout over the 16 x 16
    kept values; metadata: lane 4g + 2 selector + c, columns 16c .. 16c + 15, rows g in bits
    0-15 and g + 8 in bits 16-31; B: k = 2t + 8i (+1), n = g; C/D: rows g, g + 8, columns 2t,
    2t + 1) give D = A B + C of the dense 2:4 A, in two warps at once."""
    rng = np.random.default_rng(selector)
    warps = 2
    A = np.zeros((warps, 16, 32))
    slots = np.zeros((warps, 16, 8, 2), dtype=np.int64)
    for w, r, grp in itertools.product(range(warps), range(16), range(8)):
        lo, hi = sorted(rng.choice(4, 2, replace=False))
        slots[w, r, grp] = lo, hi
        A[w, r, 4 * grp + lo], A[w, r, 4 * grp + hi] = rng.integers(-8, 8, 2) / 4
    B = rng.integers(-8, 8, (warps, 32, 8)) / 8
    C = rng.integers(-8, 8, (warps, 16, 8)) / 2
    L = 32 * warps
    a = np.zeros((4, L), np.int32)
    b = np.zeros((4, L), np.int32)
    c = np.zeros((4, L), np.float32)
    e = np.full(L, 0x44444444, np.int64)         # lanes the selector does not name: never read
    for w, lane in itertools.product(range(warps), range(32)):
        g, t = divmod(lane, 4)
        i = 32 * w + lane
        for reg, (row, grp) in enumerate(((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4))):
            lo, hi = slots[w, row, grp]
            a[reg, i] = _words(np.array([A[w, row, 4 * grp + lo], A[w, row, 4 * grp + hi]]))
        for reg in range(4):
            b[reg, i] = _words(np.array([B[w, 2 * t + 8 * reg, g], B[w, 2 * t + 8 * reg + 1, g]]))
        c[:, i] = C[w, g, 2 * t], C[w, g, 2 * t + 1], C[w, g + 8, 2 * t], C[w, g + 8, 2 * t + 1]
        if t // 2 == selector:                   # this lane holds columns 16 (t % 2) .. + 15
            word = 0
            for half, jj in itertools.product(range(2), range(4)):
                lo, hi = slots[w, g + 8 * half, 4 * (t % 2) + jj]
                word |= int(lo | hi << 2) << (16 * half + 4 * jj)
            e[i] = word
    e = np.where(e >= 2 ** 31, e - 2 ** 32, e).astype(np.int32)
    d = mma_sp_reference(selector)(*a, *b, *c, e)
    D = A @ B + C
    for w, lane in itertools.product(range(warps), range(32)):
        g, t = divmod(lane, 4)
        want = (D[w, g, 2 * t], D[w, g, 2 * t + 1], D[w, g + 8, 2 * t], D[w, g + 8, 2 * t + 1])
        assert [float(d[k][32 * w + lane]) for k in range(4)] == list(want)   # small exact values
    bad = e.copy()
    bad[2 * selector] = 0                        # lane (0, 2 selector): 0b0000 is not a valid index pair
    with pytest.raises(ValueError, match="invalid mma.sp metadata"):
        mma_sp_reference(selector)(*a, *b, *c, bad)


# --- the layout's mma.sp words ---------------------------------------------------------

@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_sp_words_hold_the_kept_slots(quantize):
    """Word meta[t, 4g + q, KM + a] read by the layout's definition (group j of 16-column
    chunk q of atom a, rows 16t + g in bits 4j.. and 16t + g + 8 in bits 16 + 4j..) gives
    layout v1's slots; padding groups hold the valid pair (0, 1); 16-bit weights carry none."""
    R, C = 40, 200
    w = torch.randn(R, C, generator=torch.Generator().manual_seed(1))
    p = sparse24.compress(w, quantize="int8") if quantize == "int8" else \
        sparse24.compress(w, quantize="int4", group_size=32)
    d = pack_decode(p)
    NT, KA, KM = decode_dims(R, C)
    assert d.meta.shape == (NT, 32, 2 * KM)
    sp = d.meta[..., KM:].long() & 0xFFFFFFFF
    slots = p.slots()
    for r, grp in itertools.product(range(NT * 16), range(KA * 16)):
        t, rr = divmod(r, 16)
        g, half = rr % 8, rr // 8
        a, q, j = grp // 16, (grp % 16) // 4, grp % 4
        nib = int(sp[t, 4 * g + q, a] >> (16 * half + 4 * j)) & 15
        want = SP_META_NIBBLE_PAD if r >= R or grp >= C // 4 else int(slots[r, grp, 0] | slots[r, grp, 1] << 2)
        assert nib == want, (r, grp)
    assert not sp[..., KA:].any()
    assert pack_decode(sparse24.compress(w.half())).meta.shape == (NT, 32, KM)


def test_corrupt_sp_words_are_refused():
    d = pack_decode(sparse24.compress(torch.randn(40, 128), quantize="int8"))
    meta = d.meta.clone()
    meta[0, 5, decode_dims(40, 128)[2]] ^= 0b1111   # one group's index pair: not the keep masks' slots
    with pytest.raises(ValueError, match="corrupt mma.sp metadata"):
        DecodePacked(d.values, meta, d.shape, d.dtype, d.scale)
    with pytest.raises(ValueError, match="meta must be int32 of shape"):
        DecodePacked(d.values, d.meta[..., :decode_dims(40, 128)[2]].contiguous(), d.shape, d.dtype, d.scale)


# --- the route -----------------------------------------------------------------------

def test_quantized_weights_with_half_x_take_the_sparse_kernel():
    cfg = _cfg(64, 128)
    for x_dtype, has_scale, want in ((torch.float16, True, launch._DecodeSP), (torch.bfloat16, True, launch._DecodeSP),
                                     (torch.float32, True, launch._Decode), (torch.float16, False, launch._Decode)):
        assert launch.variant_of(cfg, x_dtype, has_scale) is want
    assert launch.variant_of(KernelConfig(16, 64, 64, 1, 1, 4, 1, kernel="prefill"), torch.float16, True) \
        is launch._Prefill
    # 16-bit weights: the sparse kernel at 32 rows per program (17 to SP_MAX_M rows) with x of their dtype only
    for rows, w_dtype, x_dtype, want in ((32, torch.float16, torch.float16, launch._DecodeSP),
                                         (32, torch.bfloat16, torch.bfloat16, launch._DecodeSP),
                                         (16, torch.float16, torch.float16, launch._Decode),
                                         (32, torch.bfloat16, torch.float16, launch._Decode),
                                         (32, torch.float16, torch.float32, launch._Decode)):
        assert launch.variant_of(_cfg(64, 128, rows=rows, tiles_per_warp=2), x_dtype, False, w_dtype) is want


# --- the kernel against fp64 ---------------------------------------------------------

def _int8(N, K, gen):
    p = sparse24.compress(torch.randn(N, K, generator=gen), quantize="int8")
    return pack_decode(p), p.to_dense().double()


@pytest.mark.parametrize("tiles_per_warp", [1, 2, 4])
@pytest.mark.parametrize("M", [1, 8, 9, 16, 21])
def test_every_row_count_matches_reference(M, tiles_per_warp, gen):
    """M <= 8 runs one mma per chunk, 9-16 two; 21 rows: two programs along the grid's z; one, two
    or four 16-row tiles per warp (N = 70: the last warp's last tiles are padding)."""
    d, dense = _int8(70, 200, gen)
    b = torch.randn(70, generator=gen)
    x = torch.randn(M, 200, generator=gen).half()
    cfg = _cfg(64, 128, split=2, tiles_per_warp=tiles_per_warp)
    assert_matches_reference(linear_decode(x, d, b, config=cfg), x, dense, b)


def test_two_tiles_per_warp_only_on_the_sparse_kernel(gen):
    d16 = pack_decode(sparse24.compress(torch.randn(64, 128, generator=gen).half()))
    x = torch.randn(2, 128, generator=gen).half()
    with pytest.raises(ValueError, match="needs num_warps == block_n // 16"):
        linear_decode(x, d16, config=_cfg(64, 64, tiles_per_warp=2))
    d8, _ = _int8(64, 128, gen)
    with pytest.raises(ValueError, match="needs num_warps == block_n // 16"):   # fp32 x: the byte-permute kernel
        linear_decode(x.float(), d8, config=_cfg(64, 64, tiles_per_warp=2))
    # the sparse kernel's space: one 16-row tile per warp for INT8 at M <= 16 only (INT4 so is over budget)
    assert {c.block_n // (16 * c.num_warps) for c in decode_configs(16, 4096, 4096, "int8-float16")} == {1, 2, 4}
    assert {c.block_n // (16 * c.num_warps) for c in decode_configs(16, 4096, 4096, "int4-float16")} == {2, 4}
    assert {c.block_n // (16 * c.num_warps) for c in decode_configs(32, 4096, 4096, "int8-float16")} == {2, 4}


def test_every_int4_config_in_the_space_matches_reference(gen):
    # N = 72, K = 200: a partial row block, a partial K-tile and atom, a short last quantization group
    p = sparse24.compress(torch.randn(72, 200, generator=gen), quantize="int4", group_size=64, symmetric=False)
    # the exact dequantized weight: the tensor cores see u - z (exact), the scale multiplies
    # each group's fp32 partial sums, so no rounding of the weight to float16
    d, dense = pack_decode(p), p.to_dense().double()
    for cfg in decode_configs(16, 72, 200, "int4-float16"):
        x = torch.randn(5, 200, generator=gen).half()
        assert_matches_reference(linear_decode(x, d, config=cfg), x, dense)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("M", [17, 25, 40, 64])
def test_past_16_rows_split_k_inside_the_launch(M, rows, quantize, gen):
    """Past 16 rows (the route to SP_MAX_M rows) the kernel takes 16 or, with
    block_m 32, 32 rows of x per program (the second 16 on the same weight registers) and keeps
    its serial split-K: a workspace block per 16 rows of the bucket (a workspace of one block
    would let the programs past the first 16 rows overwrite other tiles' partials). Against the
    exact (dequantized) weight, bias included; one, two or four row tiles per warp."""
    kw = dict(group_size=64, symmetric=False) if quantize == "int4" else {}
    p = sparse24.compress(torch.randn(72, 200, generator=gen), quantize=quantize, **kw)
    d, dense = pack_decode(p), p.to_dense().double()
    b = torch.randn(72, generator=gen)
    x = torch.randn(M, 200, generator=gen).half()
    for tiles_per_warp in (1, 2, 4):
        cfg = _cfg(64, 128, split=2, tiles_per_warp=tiles_per_warp, rows=rows)
        ws, counts = launch.decode_workspace(x.device, 72, cfg, 2, m_bucket(M))   # what the plan will take
        tiles = 2 * m_bucket(M) // 16                     # per W tile and 16 rows of the bucket (checked first:
        assert counts.numel() >= tiles and ws.numel() >= tiles * 2 * 64 * 16   # a short one is written past)
        assert_matches_reference(linear_decode(x, d, b, config=cfg), x, dense, b)
        plan = next(plan for key, plan in launch._PLANS.items() if key[8] == m_bucket(M) and plan.config == cfg)
        assert not plan.extra[1].any()                     # reset for the next launch
    assert launch._DecodeSP.split_k(cfg, m_bucket(M), False) == 2
    assert launch._DecodeSP.grid(M, 72, cfg, 2) == (-(-M // rows), 2, 2)   # (row blocks, tiles, splits)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_split_k_stays_inside_the_workspace_the_plan_allocates(quantize, gen, monkeypatch):
    """Every split-K launch writes partials and counters only inside what its plan allocated: the
    workspace is handed to the kernel as the front of a longer buffer whose tail holds sentinels.
    A block_m-32 config at 16 rows or fewer wrote its second 16-row block past a workspace sized
    for 16 rows (a segfault or heap corruption; on a GPU, another tensor's memory)."""
    real, guards = launch.decode_workspace, []

    def guarded(*args, **kwargs):
        ws, counts = real(*args, **kwargs)
        if ws is None:
            return ws, counts
        big_ws = torch.full((ws.numel() + 4096,), 12345.0)
        big_counts = torch.cat((torch.zeros_like(counts), torch.full((256,), 777, dtype=counts.dtype)))
        guards.append((big_ws, ws.numel(), big_counts, counts.numel()))
        return big_ws[:ws.numel()], big_counts[:counts.numel()]

    monkeypatch.setattr(launch, "decode_workspace", guarded)
    w = torch.randn(72, 200, generator=gen)
    p = sparse24.compress(w.half()) if quantize is None else sparse24.compress(w, quantize=quantize)
    d, dense = pack_decode(p), p.to_dense().double()
    for M, rows in ((1, 32), (5, 32), (16, 32), (16, 16), (17, 16), (40, 32)):
        launch.release_workspaces()
        x = torch.randn(M, 200, generator=gen).half()
        cfg = _cfg(64, 64, split=2, rows=rows)
        assert_matches_reference(linear_decode(x, d, None, config=cfg), x, dense)
        big_ws, n_ws, big_counts, n_counts = guards[-1]
        assert bool((big_ws[n_ws:] == 12345.0).all()), (M, rows, "partials written past the workspace")
        assert bool((big_counts[n_counts:] == 777).all()), (M, rows, "counters written past the workspace")
    launch.release_workspaces()


@pytest.mark.parametrize("M", [17, 25, 40, 64])
def test_16bit_weights_past_16_rows_match_reference(M, gen):
    """16-bit weights of x's dtype at 17 to SP_MAX_M rows: the stored values are the mma.sp A
    registers and the kernel builds the metadata words from the keep masks of each lane's quad
    (a wrong pair fails the emulation's check or the product). N = 72, K = 200: padding rows,
    a partial atom and K-tile; serial split-K, bias; one, two or four row tiles per warp."""
    p = sparse24.compress(torch.randn(72, 200, generator=gen).half())
    d, dense = pack_decode(p), p.to_dense().double()
    b = torch.randn(72, generator=gen).half()
    x = torch.randn(M, 200, generator=gen).half()
    for tiles_per_warp in (1, 2, 4):
        cfg = _cfg(64, 128, split=2, tiles_per_warp=tiles_per_warp, rows=32)
        assert_matches_reference(linear_decode(x, d, b, config=cfg), x, dense, b)
        plan = next(plan for key, plan in launch._PLANS.items() if key[8] == m_bucket(M) and plan.config == cfg)
        assert plan.variant is launch._DecodeSP and plan.constexprs["R32"]
        assert not plan.extra[1].any()                     # split-K counters reset for the next launch
    # the untuned default of the route (one K-tile per split at this size) and a 3-D x
    x3 = torch.randn(2, -(-M // 2), 200, generator=gen).half()
    assert_matches_reference(linear_decode(x3, d), x3, dense)


def test_16bit_sparse_kernel_reads_the_keep_masks(gen):
    """The 16-bit weight's mma.sp words come from its keep masks (it carries no others): one
    group's two kept slots moved to the other two gives the dense weight the masks describe."""
    N, K = 40, 128
    p = sparse24.compress(torch.randn(N, K, generator=gen).half())
    d, dense = pack_decode(p), p.to_dense().double()
    code = (0, 1, 3, 2)                      # slot -> keep-mask bit (decode_format)
    # row 5, atom 0, chunk 0, group j = 1 (columns 4..7): lane 4 * 5 + 1, nibble 2q + b = 0
    word = int(d.meta[0, 21, 0])
    mask = word & 15
    kept = sorted(s for s in range(4) if mask >> code[s] & 1)
    moved_to = sorted(set(range(4)) - set(kept))
    meta = d.meta.clone()
    meta[0, 21, 0] = word & ~15 | sum(1 << code[s] for s in moved_to)
    bad = DecodePacked(d.values, meta, d.shape, d.dtype, check=False)
    moved = dense.clone()
    moved[5, 4:8] = 0
    moved[5, 4 + moved_to[0]], moved[5, 4 + moved_to[1]] = dense[5, 4 + kept[0]], dense[5, 4 + kept[1]]
    x = torch.randn(20, K, generator=gen).half()
    y = linear_decode(x, bad, config=_cfg(64, 64, rows=32, tiles_per_warp=2))
    assert not matches_reference(y, x, dense)
    assert_matches_reference(y, x, moved)


def test_route_defaults_past_16_rows():
    """The untuned configs of the route: 32 rows per program, two row tiles per warp (INT8's four
    hold more than SP_LOAD_WORDS at 256 deep, INT4's spill: doubled accumulators) in the 32- and
    64-row buckets; past SP_MAX_M and for the byte-permute kernel (which refuses 32) 16 rows.
    16-bit weights: the sparse kernel's 32-row space joins the prefill kernel's in the tuning
    space there (its default two tiles per warp: four spill with Triton 3.6); untuned they take
    the prefill kernel (config_space.sp_tunable)."""
    from sparse24.ops.config_space import candidate_configs
    for dt in ("int8-float16", "int8-bfloat16", "int4-float16", "int4-bfloat16", "float16", "bfloat16"):
        half = dt in ("float16", "bfloat16")
        for M in (32, SP_MAX_M):
            c32 = decode_default(4096, 4096, dt, rows=32)
            assert c32.block_m == 32 and c32.split_k > 1
            # (a whole K-tile per lane: four INT8 tiles 256 deep, 16-bit two 256 deep, over SP_LOAD_WORDS)
            assert c32.block_n // (16 * c32.num_warps) == 2 and c32.block_k == (128 if half else 256)
            assert builtin_config(M, 4096, 4096, layout="decode", dtype=dt) == (
                KernelConfig(16, 64, 128, 1, 1, 4, 1, kernel="decode") if half else c32)
        assert builtin_config(SP_MAX_M + 1, 4096, 4096, layout="decode", dtype=dt).block_m == 16
        # the tuning space there (a tuned entry replaces the default)
        for M in (17, 32, SP_MAX_M):
            space = decode_configs(M, 4096, 4096, dt, rows=32)
            assert {c.block_m for c in space} == {32} and max(c.block_k for c in space) == (128 if half else 256) \
                and max(c.split_k for c in space) > 1
            assert max(c.block_n // (16 * c.num_warps) for c in space) == (4 if dt.startswith("int8-") else 2)
            tuned = candidate_configs(M, 4096, 4096, layout="decode", dtype=dt)
            assert {c.kernel for c in tuned} == ({"prefill", "decode"} if half else {"decode"})
            assert [c for c in tuned if c.kernel == "decode"] == space
            assert {c.block_m for c in decode_configs(M, 4096, 4096, dt)} == {16 if half else 32}
        assert {c.block_m for c in decode_configs(SP_MAX_M + 1, 4096, 4096, dt)} == {16}
        with pytest.raises(ValueError, match="rows=32"):
            decode_configs(SP_MAX_M + 1, 4096, 4096, dt, rows=32)
    with pytest.raises(ValueError, match="rows=32"):   # fp32 x and decode sizes: never the sparse kernel's 32 rows
        decode_configs(32, 4096, 4096, "float32", rows=32)
    with pytest.raises(ValueError, match="rows=32"):
        decode_configs(16, 4096, 4096, "float16", rows=32)
    # M <= 16 keeps the byte-permute kernel for 16-bit weights; fp32 x never takes the route
    assert builtin_config(16, 4096, 4096, layout="decode", dtype="float16").block_m == 16
    assert builtin_config(32, 4096, 4096, layout="decode", dtype="float32").block_m == 16
    # mma.sp takes one type for both operands: a 16-bit weight of the other dtype (or fp32 x) is refused 32 rows
    for w_dtype, x_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.float16)):
        d16 = pack_decode(sparse24.compress(torch.randn(64, 128).to(w_dtype)))
        with pytest.raises(ValueError, match="block_m == 16"):
            linear_decode(torch.randn(20, 128).to(x_dtype), d16, config=_cfg(64, 64, rows=32))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_without_sparse_tensor_cores_quantized_weights_take_the_byte_permute_kernel(quantize, gen, monkeypatch):
    """A GPU without sparse tensor cores (compute capability < 8.0, a T4: mma.sp does not compile
    there): INT8 / INT4 weights with float16 x run the byte-permute decode kernel, 16 rows per
    program, with its untuned config (the float32-x twin key's), against fp64 at M = 1, 5, 16 (bias,
    a partial K-tile; INT4: the dequantized weight rounded once to x's dtype, that kernel's dot
    operand as the prefill kernel's); it compiles for sm_75, without mma.sp. (The 17-64-row route
    there is the prefill kernel: tests/ops/test_prefill_route.py.)"""
    from sparse24.ops.linear24 import launch
    N, K = 72, 200
    w = torch.randn(N, K, generator=gen)
    p = sparse24.compress(w, quantize="int8") if quantize == "int8" else \
        sparse24.compress(w, quantize="int4", group_size=32, symmetric=False)
    d, dense = pack_decode(p), p.to_dense().double()
    if quantize == "int4":
        dense = dense.half().double()
    b = torch.randn(N, generator=gen).half()
    monkeypatch.setattr(launch, "sparse_tensor_cores", lambda device: False)
    launch._PLANS.clear()
    try:
        for M in (1, 5, 16):
            x = torch.randn(M, K, generator=gen).half()
            assert_matches_reference(linear_decode(x, d, b), x, dense, b)
        plans = [plan for key, plan in launch._PLANS.items() if key[7] == K]
        assert plans and all(plan.variant is launch._Decode and plan.config.block_m == 16 for plan in plans)
        twin = "int8-float32" if quantize == "int8" else "int4-float32"
        assert plans[0].config == builtin_config(16, N, K, layout="decode", dtype=twin)
    finally:
        launch._PLANS.clear()
    x = torch.zeros(16, K, dtype=torch.float16)
    cfg = builtin_config(16, N, K, layout="decode", dtype="int8-float32")
    out = torch.empty(16, N, dtype=torch.float16)
    ptx = launch.aot_compile(x, d, None, out, cfg, cfg.split_k, capability=(7, 5)).asm["ptx"]
    assert ".target sm_75" in ptx and "mma.sp" not in ptx


def test_unaligned_and_strided_x(gen):
    """x read as 32-bit words: a view at an odd element offset or with a column stride is
    copied first (contiguous x from torch never is)."""
    d, dense = _int8(40, 128, gen)
    base = torch.randn(4 * 129 + 1, generator=gen).half()
    odd = base[1:].view(4, 129)[:, :128]               # odd storage offset, row stride 129
    assert odd.data_ptr() % 4
    assert_matches_reference(linear_decode(odd, d), odd, dense)
    xt = torch.randn(128, 3, generator=gen).half().t()  # column stride 3
    assert_matches_reference(linear_decode(xt, d), xt, dense)


def test_a_wrong_sp_word_fails_the_check(gen):
    """The kernel reads the mma.sp words, not the keep masks: one group's index pair moved
    gives the dense weight those words describe (built here from the pair), not the original."""
    N, K = 40, 128
    d, dense = _int8(N, K, gen)
    KM = decode_dims(N, K)[2]
    meta = d.meta.clone()
    # lane 4g + q = 4 * 5 + 0 (row 5, chunk 0 of atom 0), group j = 1 (columns 4..7), row half 0
    old = (int(meta[0, 20, KM]) >> 4) & 15
    lo, hi = old & 3, old >> 2
    new_lo, new_hi = sorted(set(range(4)) - {lo, hi})
    meta[0, 20, KM] = int(meta[0, 20, KM]) & ~(15 << 4) | (new_lo | new_hi << 2) << 4
    bad = DecodePacked(d.values, meta, d.shape, d.dtype, d.scale, check=False)   # the keep masks disagree
    moved = dense.clone()
    moved[5, 4:8] = 0
    moved[5, 4 + new_lo], moved[5, 4 + new_hi] = dense[5, 4 + lo], dense[5, 4 + hi]
    x = torch.randn(3, K, generator=gen).half()
    y = linear_decode(x, bad, config=_cfg(64, 64))
    assert not matches_reference(y, x, dense)
    assert_matches_reference(y, x, moved)


def _static_check(monkeypatch):
    """scripts/kernel_static_check.py (its sm_90 compile and SASS counts), fp fusion on as it runs."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    return load_script("kernel_static_check")


def test_load_waves_counts_the_round_trips_a_warp_waits_out():
    """kernel_static_check.load_waves on hand-written SASS: loads issued before any read of their
    registers are one wave; a read of a loaded register before a later load makes two (the warp
    issues in order: the later load waits for the first); 128-bit loads cover four registers;
    reads of other registers, and the loads' own address registers, end nothing."""
    tool = load_script("kernel_static_check")
    one = ["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E R8, desc[UR4][R2.64+0x10]", "IADD3 R9, R20, 0x1, RZ",
           "HMMA.SP.16832.F32 R12, R4, R8, R12, R9, 0x0"]
    assert tool.load_waves(one) == 1
    two = ["LDG.E.128 R4, desc[UR4][R2.64]", "LOP3.LUT R7, R7, 0x807f807f, RZ, 0xc0, !PT",
           "LDG.E R8, desc[UR4][R2.64+0x10]", "HMMA.SP.16832.F32 R12, R4, R8, R12, R9, 0x0"]
    assert tool.load_waves(two) == 2
    assert tool.load_waves(["@P0 LDG.E R4, desc[UR4][R2.64]", "STG.E desc[UR4][R6.64], R4",
                            "LDG.E R5, desc[UR4][R4.64]"]) == 2
    assert tool.load_waves(["IADD3 R1, R1, 0x1, RZ", "BRA 0x100"]) == 0


@pytest.mark.parametrize("dtype,rows,waves", [("int8-float16", 1, 1), ("int8-bfloat16", 16, 1), ("float16", 32, 1),
                                              ("int8-float16", 32, 1), ("int4-float16", 1, 2)])
def test_a_k_tile_is_one_load_wave(dtype, rows, waves, monkeypatch):
    """Compiled for sm_90 (no GPU), the untuned config at 8192 x 8192: every load of a K-tile (values,
    mma.sp words or keep masks, x words) is issued before the first use of any, so a warp waits out
    one memory round trip per K-tile (INT4: two, its group scales loaded where a group starts), with
    no spills. Before (2026-12-04) the loops had 2-15, and the H200 measured the kernel
    latency-bound (0.45-0.95x of dense where 1.5-3.2x was predicted)."""
    tool = _static_check(monkeypatch)
    cfg, _ = tool.default_config(dtype, 8192, 8192, rows=rows)
    r = tool.compile_listed(dtype, cfg, 90, 8192, 8192, rows)
    assert r["sparse"] and r["loop"] and r["spills"] == 0, r
    assert r["waves"] == waves, r


def test_occupancy_report_counts_warps_and_spills(monkeypatch, capsys):
    """kernel_static_check --occupancy (sm_90 compiles, no GPU) at two listed shapes: the INT8 untuned
    default at M <= 16 takes one 16-row tile per warp (64 x 256, 4 warps: the H200's fastest INT8
    decode), whose resident programs give >= 12 warps per SM at 8192 x 8192; the report prints each
    layer's warps per SM and spill bytes, and the minimum per pair."""
    import argparse
    from concurrent.futures import ThreadPoolExecutor
    from sparse24.ops import config_space
    tool = _static_check(monkeypatch)
    monkeypatch.setattr(config_space, "LISTED_SHAPES", ((8192, 8192), (3072, 768)))
    monkeypatch.setattr(tool, "ProcessPoolExecutor", ThreadPoolExecutor)   # (a loaded script does not pickle)
    args = argparse.Namespace(dtypes="int8-float16", gpu="No tuned file GPU", listed_rows=16, jobs=1, cap=90,
                              check=False)
    assert tool.occupancy_main(args) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if "warps/SM" in line and "spillB" in line).split()
    row = next(line for line in out.splitlines() if "8192x8192" in line).split()
    assert row[2] == "BM16_BN64_BK256_W4_S1_SK4" and row[3] == "builtin", row
    warps_per_sm = float(row[head.index("warps/SM")])
    assert warps_per_sm == pytest.approx(float(row[head.index("res/SM")]) * 4, abs=0.05) and warps_per_sm >= 12
    assert row[-1] == "0"                                    # spillB
    assert "min warps per SM at the listed shapes: int8-float16 4.4" in out


def test_batch_of_eight_compiles_one_mma_per_chunk(monkeypatch):
    """Compiled for sm_90 (no GPU): at M <= 8 the kernel issues half the HMMA.SP of M = 16 (one x row
    block of 8) and costs less per byte, both within the INT8 budget (8192 x 8192: a K-loop)."""
    tool = _static_check(monkeypatch)
    cfg, _ = tool.default_config("int8-float16", 8192, 8192)
    r8, r16 = (tool.compile_listed("int8-float16", cfg, 90, 8192, 8192, rows) for rows in (8, 16))
    # per 64-column atom and owned row tile: 2 HMMA.SP (8 rows of x) or 4 (16 rows)
    tiles = cfg.block_n // (16 * cfg.num_warps) * (cfg.block_k // 64)
    assert (r8["loop_hmma_sp"], r16["loop_hmma_sp"]) == (2 * tiles, 4 * tiles)
    assert r8["sparse"] and r16["sparse"] and r8["loop"] < r16["loop"]
    a8, a16 = tool.amortized(r8)[0], tool.amortized(r16)[0]
    assert a8 < a16 <= tool.BUDGET["int8-float16"], (a8, a16)


@pytest.mark.parametrize("dtype", ["int8-float16", "int4-bfloat16"])
def test_32_rows_per_program_compile_two_blocks_without_spills(dtype, monkeypatch):
    """Compiled for sm_90 (no GPU), the 17-64-row default (block_m 32) at 8192 x 8192: each K-tile
    issues twice the HMMA.SP of 16 rows (a second x block on the same weight registers), nothing
    spills (the doubled accumulators are why INT4 keeps two row tiles per warp and 256 columns),
    and its loop costs less per byte than two 16-row passes would."""
    tool = _static_check(monkeypatch)
    cfg, _ = tool.default_config(dtype, 8192, 8192, rows=32)
    assert cfg.block_m == 32
    r32 = tool.compile_listed(dtype, cfg, 90, 8192, 8192, 32)
    r16 = tool.compile_listed(dtype, dataclasses.replace(cfg, block_m=16), 90, 8192, 8192, 16)
    tiles = cfg.block_n // (16 * cfg.num_warps) * (cfg.block_k // 64)
    assert (r16["loop_hmma_sp"], r32["loop_hmma_sp"]) == (4 * tiles, 8 * tiles)
    assert r32["spills"] == 0 and r16["spills"] == 0, (r32["spills"], r16["spills"])
    assert tool.amortized(r32)[0] < 2 * tool.amortized(r16)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_route_compiles_within_the_budget(dtype, monkeypatch):
    """Compiled for sm_90 (no GPU), the 17-64-row default of a 16-bit weight at 8192 x 8192: the
    sparse tensor-core kernel (8 HMMA.SP per owned row tile and atom: two chunks, two 8-row blocks,
    two 16-row blocks), no spills, no shared memory or shuffles in the loop (the quad's keep masks
    arrive by loads and become mma.sp words in registers), within the 16-bit budget per byte."""
    tool = _static_check(monkeypatch)
    cfg, _ = tool.default_config(dtype, 8192, 8192, rows=32)
    assert cfg.block_m == 32 and cfg.block_n // (16 * cfg.num_warps) == 2
    r = tool.compile_listed(dtype, cfg, 90, 8192, 8192, 32)
    ck = tool.compile_decode(dtype, cfg, 90, 8192, 8192, 32)
    ops = [tool._opcode(t) for t in tool.main_loop(tool.without_padding(tool.sass_instructions(ck.asm["cubin"])))]
    tiles = cfg.block_n // (16 * cfg.num_warps) * (cfg.block_k // 64)
    assert r["sparse"] and r["loop_hmma_sp"] == 8 * tiles and r["spills"] == 0, r
    assert not [op for op in ops if op.startswith(("LDS", "STS", "SHFL"))]
    every, integer = tool.amortized(r)
    assert every <= tool.BUDGET[dtype] and integer <= tool.INT_BUDGET, (every, integer)


@pytest.mark.parametrize("quantize,bk,split", [("int8", 128, 2), ("int8", 256, 1), ("int4", 64, 4)])
def test_one_k_tile_per_split_compiles_without_the_loop(quantize, bk, split, gen):
    """SPLIT_K equal to the K-tiles with BLOCK_K dividing K (the small layers' defaults): the kernel
    runs its one tile without the K-loop; against fp64 at M = 3 and 13."""
    K = 256
    w = torch.randn(72, K, generator=gen)
    p = sparse24.compress(w, quantize="int8") if quantize == "int8" else \
        sparse24.compress(w, quantize="int4", group_size=64, symmetric=False)
    d, dense = pack_decode(p), p.to_dense().double()
    b = torch.randn(72, generator=gen)
    for M in (3, 13):
        x = torch.randn(M, K, generator=gen).half()
        cfg = _cfg(64, bk, split=split, tiles_per_warp=2)
        assert launch._DecodeSP.constexprs(cfg, split, True, torch.uint8, True, False, K, 0, False, 16)["ONE_TILE"]
        assert_matches_reference(linear_decode(x, d, b, config=cfg), x, dense, b)


def test_loop_loads_mma_words_as_vectors_and_converts_no_layout(monkeypatch):
    """Compiled for sm_90: a K-tile's mma.sp words arrive as 16-byte loads per lane (one per 4 atoms
    and row tile: one 4-byte load per atom touches 32 cache lines each time), and the loop moves
    nothing through shared memory or shuffles (a lane's words split across threads would). The
    serial split-K's partials (a lane's 8 per row tile) go out and come back as two 16-byte vectors
    per row tile and split, nothing else through L2 (4-byte accesses made 4x the memory operations,
    and the compile 2-5x slower: Triton's coalescing pass grows with them)."""
    tool = _static_check(monkeypatch)
    cfg, _ = tool.default_config("int4-float16", 8192, 8192)
    ck = tool.compile_decode("int4-float16", cfg, 90, 8192, 8192)   # group 128 with zero points, 16 rows
    ops = [tool._opcode(t) for t in tool.main_loop(tool.without_padding(tool.sass_instructions(ck.asm["cubin"])))]
    tiles, atoms = cfg.block_n // (16 * cfg.num_warps), cfg.block_k // 64
    assert ops.count("LDG.E.128") == tiles * atoms // 4, ops.count("LDG.E.128")   # INT4 values: LDG.E.64
    assert not [op for op in ops if op.startswith(("LDS", "STS", "SHFL"))]
    every = [tool._opcode(t) for _, t in tool.without_padding(tool.sass_instructions(ck.asm["cubin"]))]
    partials = collections.Counter(op for op in every if "STRONG" in op)   # the .cg accesses and the counter
    assert cfg.split_k > 1 and partials == {"STG.E.128.STRONG.GPU": 2 * tiles, "ATOMG.E.ADD.STRONG.GPU": 1,
                                            "LDG.E.128.STRONG.GPU": 2 * tiles * cfg.split_k}, partials
    # No shuffle converts a layout. Triton 3.6 (the GPU image's) compiles the split-K counter's
    # atomic warp-aggregated: one lane adds, SHFL.IDX hands the old value back with the lane's
    # POPC offset, a few instructions after the ATOMG; that one shuffle is allowed, no other.
    shuffles = [i for i, op in enumerate(every) if op.startswith("SHFL")]
    atomic = every.index("ATOMG.E.ADD.STRONG.GPU")
    assert len(shuffles) <= 1 and all(atomic < i <= atomic + 8 for i in shuffles), \
        [(i, every[i]) for i in shuffles]

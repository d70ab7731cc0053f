"""The prefill kernel (M > 16, the decode layout, BLOCK_M rows of x per decoded
weight tile), run on CPU tensors in Triton's interpreter (the same source the
GPU compiles), against F.linear in fp64 on the masked dense weight; its config
checks; and an ahead-of-time sm_90 compile (wgmma with W from registers)."""
import dataclasses

import pytest
import torch
import triton.language as tl

import sparse24
from sparse24.kernels.interpreter import InterpretedKernel, triton_version
from sparse24.kernels.sparse24_prefill import NATURAL_TRITON, _tree_split_k, int8_bf16_scaled
from sparse24.decode_format import DecodePacked, pack_decode
from sparse24.ops.config_space import KernelConfig, check_prefill_runs, m_bucket, split_factors
from sparse24.ops.linear24 import launch
from sparse24.ops.linear24.launch import linear_prefill
from sparse24.ops.linear24 import prefill, prefill_model
from sparse24.ops.linear24.prefill import check_prefill_config, natural_tile, prefill_config, prefill_configs

from conftest import assert_matches_reference, int32_words, reference_linear, tolerance
from test_decode_kernel import _static_check, _weight  # the decode kernel's weights and static-check loader


def _cfg(bm, bn, bk, stages=2, group=8):
    return KernelConfig(bm, bn, bk, group, 1, min(bn, 128) // 16, stages, kernel="prefill")


def _case(M, N, K, xtype, wtype, bias, cfg=None):
    ids = f"M{M}-N{N}-K{K}-x{str(xtype)[6:]}-w{wtype}-{'bias' if bias else 'nobias'}-" \
          + ("default" if cfg is None else f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}g{cfg.group_m}")
    return pytest.param(M, N, K, xtype, wtype, bias, cfg, id=ids)


@pytest.mark.parametrize("M,N,K,xtype,wtype,bias,cfg", [
    # the default config of each M bucket; N, K not multiples of the tiles (partial row block,
    # partial K-tile, partial metadata atom); both activation dtypes, both weight kinds, bias
    _case(17, 40, 100, torch.float16, "fp16", True),
    _case(67, 72, 200, torch.float32, "int8", False),
    _case(130, 200, 196, torch.float16, "int8", True),
    _case(130, 72, 260, torch.float32, "fp16", True),
    # several x-blocks and W-blocks, grouped order with a partial last group
    _case(67, 200, 196, torch.float16, "fp16", False, _cfg(32, 64, 64, group=2)),
    _case(130, 136, 132, torch.float32, "int8", True, _cfg(32, 128, 128, group=3)),
])
def test_kernel_matches_reference(M, N, K, xtype, wtype, bias, cfg, gen):
    d, dense = _weight(N, K, wtype, gen)
    x = torch.randn(M, K, generator=gen).to(xtype)
    b = torch.randn(N, generator=gen) if bias else None
    tri = linear_prefill(x, d, b, config=cfg)
    assert tri.dtype == xtype and tri.shape == (M, N)
    assert_matches_reference(tri, x, dense, b)


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
def test_every_config_in_the_space_matches_reference(wtype, gen):
    """Each config a tuner may pick, with BLOCK_M 128/256 covering 67 rows of x (rows past M
    clamped, never stored); stages do not change the interpreted result."""
    d, dense = _weight(72, 200, wtype, gen)
    b = torch.randn(72, generator=gen)
    x = torch.randn(67, 200, generator=gen).half()
    seen = {}
    for c in prefill_configs(4096) + prefill_configs(64):
        seen.setdefault((c.block_m, c.block_n, c.block_k), c)
    for cfg in seen.values():
        assert_matches_reference(linear_prefill(x, d, b, config=cfg), x, dense, b)


@pytest.mark.parametrize("M,N,K,xtype,wtype", [
    (130, 72, 200, torch.float16, "fp16"),
    (130, 72, 200, torch.float32, "fp16"),
    (129, 40, 136, torch.float32, "bf16"),
    (130, 72, 200, torch.float16, "int8"),
    (129, 40, 136, torch.float32, "int8"),
])
@pytest.mark.parametrize("bm,bn", [(128, 64), (256, 128)])
def test_natural_order_tiles_match_reference(M, N, K, xtype, wtype, bm, bn, gen):
    """From 128 rows of x a program reads x in its own column order and each weight lane
    decodes one dense half of two lanes' groups (``_decode_tile_natural``): every weight
    kind with the activation dtypes the interpreter has (bfloat16 x: the sm_90 compile
    below and scripts/gpu_tests), two x-blocks (rows past M clamped), a partial row block,
    a partial K-tile and atom."""
    _check_tile(M, N, K, xtype, wtype, _cfg(bm, bn, 64), gen)


def _check_tile(M, N, K, xtype, wtype, cfg, gen):
    """One launch of ``cfg`` with bias against fp64 on the masked dense weight ("bf16": a
    bfloat16 weight; "int4": INT4, group 64, zero points; else _weight's kinds). Returns
    ``(x, d, b, y)``, or None where this Triton refuses the tile (checked: nothing runs)."""
    if wtype == "bf16":
        w = torch.randn(N, K, generator=gen).bfloat16()
        d, dense = pack_decode(sparse24.compress(w)), (w * sparse24.mask_nm(w)).double()
    elif wtype == "int4":
        p = sparse24.compress(torch.randn(N, K, generator=gen), quantize="int4", group_size=64)
        d, dense = pack_decode(p), p.to_dense().double()
    else:
        d, dense = _weight(N, K, wtype, gen)
    x = torch.randn(M, K, generator=gen).to(xtype)
    b = torch.randn(N, generator=gen)
    if not natural_tile(cfg.block_m, cfg.block_n) and cfg.block_n == 256:   # Triton < 3.6: refused, nothing runs
        with pytest.raises(ValueError, match="needs Triton >= 3.6"):
            linear_prefill(x, d, b, config=cfg)
        return None
    tri = linear_prefill(x, d, b, config=cfg)
    assert tri.dtype == xtype and tri.shape == (M, N)
    assert_matches_reference(tri, x, dense, b)
    return x, d, b, tri


@pytest.mark.parametrize("M,N,K,xtype,wtype", [
    (130, 200, 200, torch.float16, "fp16"),    # the second half's rows 128..199 (the layout pads to 256)
    (67, 300, 136, torch.float32, "bf16"),     # two W-blocks; the last one's second half lies past N
    (129, 200, 196, torch.float16, "int8"),
    (130, 300, 200, torch.float32, "int8"),
])
def test_the_wide_tile_matches_reference(M, N, K, xtype, wtype, gen):
    """128 x 256 (8 warps): two 128-row halves of W decoded into two accumulators against the
    x tile both share; the second half's pointers, its epilogue rows and, past N, its clamped
    re-read of the last rows (never stored). Before Triton 3.6: a clear refusal."""
    _check_tile(M, N, K, xtype, wtype, _cfg(128, 256, 64), gen)


def _split(bm, bn, bk, split):
    return dataclasses.replace(_cfg(bm, bn, bk), split_k=split)


@pytest.mark.parametrize("M,N,K,xtype,wtype,cfg", [
    (40, 200, 1000, torch.float32, "fp16", _split(32, 64, 128, 2)),   # a partial K-tile in the last split
    (40, 72, 1000, torch.float16, "int8", _split(32, 64, 128, 4)),
    (17, 72, 300, torch.float32, "fp16", _split(32, 128, 128, 4)),    # 3 K-tiles, 4 splits: one owns none
    (40, 72, 1300, torch.float16, "fp16", _split(32, 64, 256, 4)),    # 256 deep (17-64 rows): 6 K-tiles, partial last
    (64, 40, 1100, torch.float32, "int8", _split(64, 128, 256, 2)),
    (67, 40, 700, torch.float32, "int4", _split(64, 64, 128, 16)),    # 6 K-tiles, 16 splits
    (130, 72, 520, torch.float16, "fp16", _split(128, 64, 64, 2)),    # natural order, two accumulators
    (130, 300, 520, torch.float32, "int8", _split(128, 256, 64, 4)),  # the wide tile: both halves' partials
])
def test_split_k_matches_reference(M, N, K, xtype, wtype, cfg, gen):
    """Split-K inside the launch (few output tiles: x's rows and N's blocks below the SMs): each
    split sums its K-tiles and the splits' fp32 partial tiles are added as a pairwise tree
    through the plan's workspace, the program last at the root writing out with bias; against
    fp64, twice (the counters are back at zero after a call, as the next launch needs),
    bit-identical both times (other arrival orders: test_tree_split_k_*)."""
    case = _check_tile(M, N, K, xtype, wtype, cfg, gen)
    if case is None:
        return
    x, d, b, first = case
    ws, counts = next(plan.extra for key, plan in launch._PLANS.items()   # the plan's own (key[8]: M bucket)
                      if key[8] == m_bucket(M) and plan.config == cfg)
    tiles = -(-m_bucket(M) // cfg.block_m) * -(-N // cfg.block_n)
    assert counts.numel() >= tiles * cfg.split_k and ws.numel() >= tiles * cfg.split_k * cfg.block_n * cfg.block_m
    assert not counts.any()
    assert torch.equal(linear_prefill(x, d, b, config=cfg), first)
    # stale workspace contents never leak in: each split writes its slot before the last reads them
    ws.fill_(1e6)
    assert torch.equal(linear_prefill(x, d, b, config=cfg), first)


def test_split_k_past_the_last_bucket_runs_in_chunks(monkeypatch, gen):
    """M past the last M bucket shares the bucket's plan, whose split-K workspace holds the
    bucket's rows: such x runs in launches of at most that many rows, each with the workspace to
    itself (here the last bucket made 32 rows: 70 rows run as 32 + 32 + 6), against fp64."""
    monkeypatch.setattr(launch, "m_bucket", lambda M: min(m_bucket(M), 32))
    seen = []
    real = launch._Plan.launch
    monkeypatch.setattr(launch._Plan, "launch", lambda plan, grid, *a: seen.append(grid) or real(plan, grid, *a))
    cfg = _split(32, 64, 128, 2)
    x, d, b, y = _check_tile(70, 72, 520, torch.float32, "fp16", cfg, gen)
    assert seen == [(2, 2, 1)] * 3   # 1 row block x 2 column blocks, 2 splits, per chunk
    plan = next(plan for key, plan in launch._PLANS.items() if key[8] == 32 and plan.config == cfg)
    assert plan.max_rows == 32 and not plan.extra[1].any()


def test_split_k_workspace_is_one_per_device_and_grows(monkeypatch):
    """The split-K workspace and counters (decode and prefill kernels; a counter per split of a
    tile, for the prefill kernel's tree): one pair per
    device that every plan takes, the latest the largest; a larger need makes a new pair at
    least twice the last (the old one stays with the plans that hold it: CUDA graphs keep valid
    pointers), a smaller one takes the latest, each of the two grown on its own; no split, no
    workspace."""
    monkeypatch.setattr(launch, "_WORKSPACES", {})
    cfg = KernelConfig(16, 64, 128, 8, 2, 4, 1, kernel="decode")
    ws, counts = launch.decode_workspace("cpu", 64, cfg, 2)      # 1 tile of 64 x 16, 2 splits
    assert (ws.numel(), counts.numel()) == (2 * 64 * 16, 2)
    assert launch.decode_workspace("cpu", 64, cfg, 2)[0] is ws
    big, big_counts = launch.decode_workspace("cpu", 640, cfg, 2)   # 10 tiles: more than twice
    assert (big.numel(), big_counts.numel()) == (10 * 2 * 64 * 16, 20) and not big_counts.any()
    assert launch.decode_workspace("cpu", 64, cfg, 2)[0] is big
    grown, grown_counts = launch.decode_workspace("cpu", 704, cfg, 2)   # 11 tiles: twice the last
    assert (grown.numel(), grown_counts.numel()) == (2 * big.numel(), 40)
    wide = dataclasses.replace(_cfg(128, 256, 64), split_k=2)           # the prefill's, per BLOCK_M rows
    big_ws, few = launch.decode_workspace("cpu", 300, wide, 2, 256, 128)  # 4 tiles: more partials, 8 counters
    assert big_ws.numel() == 4 * 2 * 256 * 128 and few is grown_counts
    small_ws, many = launch.decode_workspace("cpu", 1920, cfg, 2)     # 30 tiles: 60 counters, fewer partials
    assert small_ws is big_ws and many.numel() == 80 and not many.any()
    assert launch.decode_workspace("cpu", 64, cfg, 1) == (None, None)


def _tree_kernel(parts_ptr, order_ptr, out_ptr, writers_ptr, ws_ptr, count_ptr, ROWS: tl.constexpr,
                 COLS: tl.constexpr):
    # program i of the grid's (splits,) runs as split order[i] of tile 1 (tile 0's counters and slots stay untouched),
    # its partial tile (and a second one, as the wide tile's acc2) from parts
    pid_k = tl.load(order_ptr + tl.program_id(0))
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    acc = tl.load(parts_ptr + pid_k * (2 * ROWS * COLS) + offs)
    acc2 = tl.load(parts_ptr + pid_k * (2 * ROWS * COLS) + ROWS * COLS + offs)
    acc, acc2, write = _tree_split_k(acc, acc2, ws_ptr, count_ptr, tl.full((), 1, tl.int32), pid_k,
                                     tl.num_programs(0), ROWS, COLS, True)
    if write:
        tl.store(out_ptr + offs, acc)
        tl.store(out_ptr + ROWS * COLS + offs, acc2)
        tl.atomic_add(writers_ptr, 1)


@pytest.mark.parametrize("split", [2, 4, 8, 16])
def test_tree_split_k_sums_in_one_order_whatever_the_arrival(split, gen):
    """The prefill kernel's split-K sum (_tree_split_k), its programs arriving in many orders
    (Triton's interpreter runs them one after another in grid order; here program i takes the
    role of split order[i]): exactly one program writes, and it writes the pairwise-tree sum of
    the partials in fp32 ((p0 + p1) + (p2 + p3), ...: computed here in numpy) bit for bit, the
    same for every order, within log2(split) fp32 roundings of the fp64 sum; every counter is back at zero
    and the other tile's workspace and counters untouched. Partials of mixed magnitudes, so a
    different order of the sums changes the bits."""
    rows, cols = 16, 32
    parts = (torch.randn(split, 2, rows, cols, generator=gen) * 10.0 ** torch.randint(-3, 4, (split, 2, rows, cols),
                                                                                       generator=gen)).float()
    tree = parts.numpy()
    while len(tree) > 1:
        tree = tree[0::2] + tree[1::2]
    orders = [torch.arange(split), torch.arange(split).flip(0)] + [torch.randperm(split, generator=gen)
                                                                   for _ in range(4)]
    for order in orders:
        out = torch.zeros(2, rows, cols)
        writers = torch.zeros(1, dtype=torch.int32)
        ws = torch.full((2 * split * 2 * rows * cols,), 7.0)
        counts = torch.zeros(2 * split, dtype=torch.int32)
        InterpretedKernel(_tree_kernel)[(split,)](parts, order.to(torch.int32), out, writers, ws, counts,
                                                  ROWS=rows, COLS=cols)
        assert writers.item() == 1 and not counts.any()
        assert torch.equal(out, torch.from_numpy(tree[0])), order
        assert torch.equal(ws[:split * 2 * rows * cols], torch.full((split * 2 * rows * cols,), 7.0))
        # a tree of log2(split) levels of fp32 additions: each level's rounding within 2**-24 of what it adds
        bound = (split.bit_length() - 1) * 2.0 ** -24 * parts.double().abs().sum(0)
        assert ((out.double() - parts.double().sum(0)).abs() <= bound).all()
    # the bits depend on the order of the sums (so the equality above can fail)
    assert not torch.equal(torch.from_numpy(tree[0]), parts.sum(0)) or split == 2


def _int8_bf16_kernel(d_ptr, w_ptr, n: tl.constexpr):
    tl.store(w_ptr + tl.arange(0, n), int8_bf16_scaled(tl.load(d_ptr + tl.arange(0, n))))


def test_int8_bf16_scaled_gives_every_value_exactly():
    """INT8 weights with bfloat16 x in the natural-order tiles: the sign-magnitude lanes, as the
    permute + AND leave them, read as bfloat16 subnormals and scaled by 2**126 in one fma
    (int8_bf16_scaled, run here in Triton's interpreter through the emulation of fma.rn.bf16x2,
    kernels/interpreter.py) are v * 2**-7 exactly, for every pair of values and zero lanes; the
    kernel scales its sums back by 2**7. A sign or magnitude bit read from the wrong place, or a
    scale off by a power of two, fails."""
    v = torch.arange(-127, 128)
    lane = torch.where(v < 0, 0x8000, 0) | v.abs()                    # sign bit 15, |v| in bits 0-6
    lo, hi = lane.repeat(255), lane.repeat_interleave(255)           # every pair of values in one word
    d = torch.cat([int32_words(lo, hi), torch.zeros(65536 - 255 * 255, dtype=torch.int32)])  # + zero lanes
    w = torch.empty_like(d)
    InterpretedKernel(_int8_bf16_kernel)[(1,)](d, w, n=65536)
    got = w.view(torch.bfloat16).view(-1, 2).double() * 128                  # (low, high) lanes
    assert torch.equal(got[:255 * 255], torch.stack([v.repeat(255), v.repeat_interleave(255)], 1).double())
    assert not got[255 * 255:].any()


def test_the_wide_tile_needs_natural_tiles(monkeypatch, gen):
    """A Triton that runs no 128-row tile in x's own order (before 3.6) has no 128 x 256 in its
    space, and a launch asking for it is refused before anything runs (a tuned file holding it:
    tests/ops/test_config_store.py)."""
    import sparse24.kernels.sparse24_prefill as kernel
    wide = _cfg(128, 256, 64)
    assert (wide in prefill_configs(4096)) == natural_tile(128, 256) and wide not in prefill_configs(64)
    monkeypatch.setattr(kernel, "natural_tile", lambda bm, bn: False)
    assert wide not in prefill_configs(4096)
    d, _ = _weight(200, 64, "fp16", gen)
    with pytest.raises(ValueError, match="needs Triton >= 3.6"):
        linear_prefill(torch.randn(130, 64).half(), d, config=wide)


@pytest.mark.parametrize("wtype", ["fp16", "int8"])
@pytest.mark.parametrize("cfg", [None, _cfg(128, 64, 64)], ids=["default", "natural"])
def test_a_wrong_keep_bit_fails_the_check(wtype, cfg, gen):
    """The kernel really decodes the keep masks: one group's pair moved to the other two
    slots gives the dense weight those bits describe, and misses the original by more
    than the tolerance (the permuted-x tiles and the natural-order ones)."""
    N, K = 40, 128
    d, dense = _weight(N, K, wtype, gen)
    meta = d.meta.clone()
    meta[0, 20, 0] ^= 0b1111 << 8                      # row 5, columns 16..19: the other two slots
    bad = DecodePacked(d.values, meta, d.shape, d.dtype, d.scale, check=False)
    bad = pack_decode(bad.to_sparse24())               # INT8: its mma.sp words follow the keep masks
    x = torch.randn(33, K, generator=gen)
    tri = linear_prefill(x, bad, config=cfg)
    assert not torch.allclose(tri.double(), reference_linear(x, dense), **tolerance(torch.float32, K))
    assert_matches_reference(tri, x, bad.to_dense().double())


def test_strided_3d_and_empty_inputs(gen):
    d, dense = _weight(40, 64, "fp16", gen)
    x = torch.randn(64, 3, 20, generator=gen).half().transpose(0, 2)   # (20, 3, 64), strided
    assert_matches_reference(linear_prefill(x, d), x, dense)
    assert linear_prefill(torch.empty(0, 64).half(), d).shape == (0, 40)


def test_rejects_bad_input(gen):
    d, _ = _weight(40, 64, "fp16", gen)
    x = torch.randn(20, 64).half()
    with pytest.raises(TypeError, match="decode layout"):
        linear_prefill(x, d.to_sparse24())
    with pytest.raises(TypeError, match="bfloat16"):
        linear_prefill(x.bfloat16(), d)
    with pytest.raises(ValueError, match="features"):
        linear_prefill(torch.randn(20, 32).half(), d)
    with pytest.raises(ValueError, match="bad prefill config"):
        linear_prefill(x, d, config=KernelConfig(32, 64, 64, 8, 1, 2, 2, kernel="prefill"))  # warps != BN / 16
    for bad in (KernelConfig(128, 256, 64, 8, 1, 16, 2, kernel="prefill"),   # the wide tile: 8 warps,
                KernelConfig(256, 256, 64, 8, 1, 8, 2, kernel="prefill"),    # 128 rows of x, BLOCK_K 64
                KernelConfig(128, 256, 256, 8, 1, 8, 2, kernel="prefill")):  # or 128
        with pytest.raises(ValueError, match="bad prefill config"):
            linear_prefill(x, d, config=bad)
    with pytest.raises(ValueError, match="bad prefill config"):
        linear_prefill(x, d, config=KernelConfig(16, 64, 64, 8, 1, 4, 1, kernel="decode"))
    with pytest.raises(ValueError, match="M > 16"):
        prefill_config(16, 64, 64)


def _rule_config(M, N, monkeypatch):
    """The fixed list's choice (the defaults without a cost table)."""
    with monkeypatch.context() as m:
        m.setattr(prefill, "prefill_costs", lambda *a, **k: None)
        prefill_config.cache_clear()
        try:
            return prefill_config(M, N, 4096)
        finally:
            prefill_config.cache_clear()


def test_default_configs_without_a_cost_table(monkeypatch):
    """A Triton with no cost table (below 3.6, or one not yet measured) gets the fixed list:
    the largest tile that still gives enough programs for an H200's 132 SMs, wasting at most
    half its rows, the same for every weight kind, split along K while the programs still fit one
    wave (to 64 rows: on 3 stages, up to FEW_ROWS_PER_SM programs per SM)."""
    wide = natural_tile(256, 128)   # Triton >= 3.6: 256 x 128 first, from 0.5 programs per SM
    assert [(lambda c: (c.block_m, c.block_n))(_rule_config(M, 4096, monkeypatch)) for M in (17, 64, 65, 256, 512, 1024, 100000)] == \
        [(32, 64), (32, 64), (128, 64), (128, 64), (128, 128)] + [(256 if wide else 128, 128)] * 2
    assert [_rule_config(M, 28672, monkeypatch).block_m for M in (65, 129)] == [128, 256 if wide else 128]
    assert _rule_config(64, 8192, monkeypatch).block_m == 64   # 128 programs of 64 x 64: from 0.5 per SM
    assert _rule_config(64, 3072, monkeypatch).block_m == 32   # 48 programs of 64 x 64: too few
    assert _rule_config(40, 28672, monkeypatch).block_m == 64  # never 128 rows for 40
    # 64 programs of 32 x 64 (17 rows, 4096 x 4096): to 64 rows split up to FEW_ROWS_PER_SM (3) programs
    # per SM, so in four (256 programs); 28672 rows give 448 programs, more than that already; past
    # 64 rows within one wave (65 rows, 1024 x 4096: 16 programs of 128 x 64, split in eight); past
    # PREFILL_SPLIT_MAX_M rows nothing is split
    assert [_rule_config(M, N, monkeypatch).split_k for M, N in ((17, 4096), (17, 28672), (65, 1024), (100000, 1024))] \
        == [4, 1, 8, 1]
    # to 64 rows on 3 stages (two K-tiles in flight a program: the latency term), past them on 2
    assert [_rule_config(M, 4096, monkeypatch).num_stages for M in (17, 64, 65, 4096)] == [3, 3, 2, 2]


def test_default_configs_follow_the_model(monkeypatch):
    """With the installed Triton's cost table (this project's 3.9, the GPU image's 3.6), the
    default of each shape and weight kind is a config of the space that spills nothing, runs
    wgmma with W from registers, its worst case over the L2 bandwidths (ROBUST_L2: the model's 24.7 B
    per SM clock and the H200's 23.4 and 26.0) within the tolerance of the best of the space and of the
    fixed list's choice (where that spills nothing), and no worse than it at 24.7 B per SM
    clock where the fixed choice's worst case is itself within the tolerance of the best of the space,
    over the 11 shapes of issue 22 and M = 17-4096; at 16-64 rows it never takes 128-row tiles.
    Without a table: the fixed list (above)."""
    tool = _static_check()
    table = prefill.prefill_costs()
    if table is None:   # a Triton this project has no table for: the defaults are the fixed list
        assert prefill_config(4096, 4096, 4096) == _rule_config(4096, 4096, monkeypatch)
        return
    assert set(table) == set(prefill.PAIRS)
    better = 0
    for pair in prefill.PAIRS:
        rows = {r["cfg"]: r for r in table[pair]["configs"]}
        w_bytes = tool.dense_bytes_per_weight(pair)
        assert table[pair]["w_bytes"] == w_bytes
        for N, K in tool.PREFILL_SHAPES:
            for M in (17, 40, 64, 65, 100, 129, 256, 512, 2048, 4096):
                c = check_prefill_config(prefill_config(M, N, K, pair=pair))
                one = dataclasses.replace(c, split_k=1)
                assert one in prefill_configs(M) and c.block_n >= 64 and c.split_k in split_factors(M, N, K, one)
                assert rows[prefill.cost_key(c)]["spills"] == 0 and (M > 64 or c.block_m <= 64)
                fixed = _rule_config(M, N, monkeypatch)

                def ratios(cfg):   # a config of the space, split along K or not (its split row)
                    return [d / o for o, d in (tool.predicted_time(rows[prefill.cost_key(cfg)], M, N, K, w_bytes,
                                                                   cfg.split_k, l2)
                                               for l2 in prefill.ROBUST_L2)]
                if rows[prefill.cost_key(fixed)]["spills"]:   # the model never takes a config that spills
                    continue                                   # (3.7: INT4 x bf16 128 x 64)
                split = [dataclasses.replace(cfg, split_k=sk) for cfg in prefill_configs(M)
                         for sk in split_factors(M, N, K, cfg)]
                floor = (1 - prefill.ROBUST_TOLERANCE) * max(
                    min(ratios(cfg)) for cfg in split if rows[prefill.cost_key(cfg)]["spills"] == 0)
                assert min(ratios(c)) >= floor - 1e-12, (pair, N, K, M, c)
                assert min(ratios(c)) >= (1 - prefill.ROBUST_TOLERANCE) * min(ratios(fixed)) - 1e-12, (pair, N, K, M)
                if min(ratios(fixed)) >= floor:
                    assert ratios(c)[0] >= ratios(fixed)[0] - 1e-12, (pair, N, K, M, c, fixed)
                better += ratios(c)[0] > ratios(fixed)[0] * 1.01
    assert better > 0   # the model's choice differs somewhere, or the table would not be needed


def test_few_row_defaults_keep_the_weight_in_flight(monkeypatch):
    """At 17-64 rows, where the H200 measured the prefill kernel bound by what each SM kept in
    flight (run 4: 4.8-35 KiB of weight per SM, 0.36-1.27 TB/s), the default of a 16-bit weight at
    the 11 listed shapes keeps >= 32 KiB of weight in flight per SM (resident programs x K-tiles
    requested ahead x the weight tile), or the layer's whole weight / 132 where that is smaller,
    with the cost table of the GPU image's Triton (3.6) and of the installed one. (INT8 / INT4 with
    16-bit x run the sparse tensor-core kernel there, sized by decode_default; their prefill
    defaults at 17-64 rows serve fp32 x and follow the model alone.)"""
    import triton

    tool = _static_check()
    for version in {(3, 6), tuple(int(v) for v in triton.__version__.split(".")[:2])}:
        table = prefill.prefill_costs(version)
        if table is None:
            continue
        monkeypatch.setattr(prefill, "prefill_costs", lambda *args, **kw: table)
        prefill_config.cache_clear()
        try:
            for pair in ("float16", "bfloat16"):
                rows = {r["cfg"]: r for r in table[pair]["configs"]}
                seen = 0
                for N, K, M, c, flight, goal in tool.few_row_flights(rows, pair):
                    assert goal == min(32 * 1024, N * K * 9 / 8 / 132)   # values and metadata: 9/8 B a weight
                    assert flight >= goal * (1 - 1e-9), (version, pair, N, K, M, c, flight)
                    seen += 1
                assert seen == 4 * len(tool.PREFILL_SHAPES)   # every default has its cost row
        finally:
            prefill_config.cache_clear()


def _synthetic_row(stages, t_issue, l2_bytes, spills=0):
    """A cost row of 128 x 128 x 64 for the two tests below: 4096 x 4096 at M = 512 is 128
    programs, one per SM, 64 K-tiles (not split: _choice), each K-tile t_tensor 512 + t_issue +
    l2_bytes / l2 clocks (past 64 rows one after the other; the replay ``alone`` unused)."""
    return dict(cfg=_cfg(128, 128, 64, stages), t_tensor=512.0, t_issue=float(t_issue), alone=0.0,
                l2_bytes=l2_bytes, per_sm=1, spills=spills)


def _choice(monkeypatch, rows, tolerance=None):
    """The default for 4096 x 4096 at M = 512 from a synthetic table of ``rows`` (every pair)."""
    fake = {pair: {"w_bytes": 1.125, "configs": rows} for pair in prefill.PAIRS}
    with monkeypatch.context() as m:
        m.setattr(prefill, "prefill_costs", lambda *args, **kw: fake)
        m.setattr(prefill, "split_factors", lambda *args, **kw: (1,))
        if tolerance is not None:
            m.setattr(prefill, "ROBUST_TOLERANCE", tolerance)
        prefill_config.cache_clear()
        try:
            return prefill_config(512, 4096, 4096)
        finally:
            prefill_config.cache_clear()


def test_default_config_weighs_the_measured_l2_range(monkeypatch):
    """The choice between two configs (_synthetic_row) over ROBUST_L2, the model's 24.7 B per SM
    clock and the H200's two runs, 23.4 and 26.0. A, issue-bound (280 clocks of issue, no L2
    bytes): 1.047 of dense at 24.7, 0.995 at 26.0, where dense gains from L2 and A does not; B,
    L2-bound (290 clocks of L2 at 24.7): 1.034 at 24.7, 1.000 at 26.0. Within the tolerance (5%)
    of the best worst case the default takes the better at 24.7, A; with a tolerance of 0.5% A's
    worst case is out of reach and it takes B. A row that spills is never taken."""
    a, b = _synthetic_row(2, 280, 0), _synthetic_row(3, 0, 24.7 * 290)
    w = {name: [d / o for o, d in (prefill_model.predicted_time(row, 512, 4096, 4096, 1.125, 1, l2)
                                   for l2 in prefill.ROBUST_L2)] for name, row in (("a", a), ("b", b))}
    assert prefill.ROBUST_L2 == (24.7, 23.4, 26.0)
    assert [round(v, 3) for v in w["a"]] == [1.047, 1.105, 0.995]
    assert [round(v, 3) for v in w["b"]] == [1.034, 1.070, 1.000]
    assert _choice(monkeypatch, [a, b]) == a["cfg"]
    assert _choice(monkeypatch, [a, b], tolerance=0.005) == b["cfg"]
    a["spills"] = 8
    assert _choice(monkeypatch, [a, b]) == b["cfg"]


def test_a_corrupt_cost_table_is_refused(tmp_path):
    """A cost table that is not JSON, lacks a pair or a key, holds a negative or non-numeric
    cost or a config the kernel cannot run: a ValueError naming the file; a version without a
    table gives None (the fixed list)."""
    import json
    good = json.loads(prefill.COSTS_FILE.read_text())
    version = next(iter(good["tables"]))
    key = tuple(int(v) for v in version.split("."))
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(good))
    assert set(prefill.prefill_costs(key, path)) == set(prefill.PAIRS)
    assert prefill.prefill_costs((9, 99), path) is None

    def bad(edit, match):
        doc = json.loads(json.dumps(good))
        edit(doc)
        path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
        prefill._load_costs.cache_clear()
        with pytest.raises(ValueError, match=match):
            prefill.prefill_costs(key, path)
    first = lambda d: d["tables"][version]["pairs"]["float16"]["configs"][0]  # noqa: E731
    bad(lambda d: d["tables"][version]["pairs"].pop("int8-bfloat16"), "need the pairs")
    bad(lambda d: first(d).pop("alone"), "exactly the keys")
    bad(lambda d: first(d).update(alone=-1.0), "number >= 0")
    bad(lambda d: first(d).update(regs="many"), "number >= 0")
    bad(lambda d: first(d).update(config=[128, 64, 64, 8, 2, 1]), "bad prefill config")   # warps != BN / 16
    bad(lambda d: first(d).update(config=[128, 64, 64, 4, 2]), "split_k")                # no split column
    bad(lambda d: first(d).update(config=[128, 64, 64, 4, 2, 4]), "split_k 1 or 2")     # rows measure 1 and 2
    bad(lambda d: d.update(format=2), "format 1")
    path.write_text("{not json")
    prefill._load_costs.cache_clear()
    with pytest.raises(ValueError, match="bad prefill cost table"):
        prefill.prefill_costs(key, path)
    prefill._load_costs.cache_clear()


@pytest.mark.parametrize("dtype", ["float16", "int8-bfloat16", "int4-bfloat16"])
def test_large_m_default_compiles_to_hgmma_for_sm90(dtype, monkeypatch):
    """No GPU here: the wide tile (Triton >= 3.6: 128 x 256 x 64 (INT4 with bf16 x on Triton 3.6:
    x 128), 8 warps, 2 stages; before: 128 x 128; the large-M default until the model's serial rule
    past 64 rows, and the tile the H200 measured there) compiled for sm_90 with the launcher's arguments
    (scripts/kernel_static_check.py --prefill) runs wgmma with W from registers (HGMMA, one per
    16 columns of a K-tile and 128 rows of W) and x^T straight from the pipelined shared
    buffer: no shared-memory store in the loop (the permuted tiles copied x through registers
    back to shared memory: 8 STS per K-tile); no wait takes its wgmma groups below a K-tile's
    worth less one (or 7, where a K-tile commits more than 8), and one program alone takes no longer than the slowest of its tensor
    cores, its tiles' L2 traffic and its issue (within 5%: the decode runs under the multiply,
    not after it); for 16-bit weights the decode issues in less than the multiply's time; it
    spills nothing: the premises of the prediction in docs/kernels.md. The committed cost
    table of the installed Triton (the defaults' input) holds what this compile counts: a
    kernel changed without rerunning ``kernel_static_check.py --prefill --write-costs`` fails
    here."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    tool = _static_check()
    cfg = next(c for c in prefill_configs(4096) if c.num_stages == 2 and (c.block_m, c.block_n, c.block_k) == (
        (128, 256, 64) if natural_tile(128, 256) else (128, 128, 64)))
    if dtype == "int4-bfloat16" and triton_version()[:2] == (3, 6):
        # Triton 3.6: the group constants once per 128 columns (3.7 and 3.8 spill 88 / 72 B there, as 3.9)
        cfg = dataclasses.replace(cfg, block_k=128)
    r = tool.prefill_model(tool.prefill_one(dtype, cfg, 90))
    table = prefill.prefill_costs()
    if table is not None:
        row = next(row for row in table[dtype]["configs"] if row["cfg"] == cfg)
        assert {k: row[k] for k in ("regs", "spills", "shared", "per_sm", "loop", "mma", "half", "l2_bytes")} == \
            {k: r[k] for k in ("regs", "spills", "shared", "per_sm", "loop", "mma", "half", "l2_bytes")}
        assert (row["t_issue"], row["alone"]) == (pytest.approx(r["t_issue"], abs=0.01), pytest.approx(r["alone"], abs=0.01))
    assert r["hgmma"] and r["mma"] == cfg.block_k // 16 * -(-cfg.block_n // 128)
    assert r["spills"] == 0 and r["local"] == 0
    assert tool.programs_per_sm(r["regs"], r["shared"], cfg.num_warps) >= 1
    if natural_tile(cfg.block_m, cfg.block_n):   # Triton >= 3.6 (this project's 3.9, the GPU image's 3.6)
        # (INT4: Triton 3.6 passes its scales and zero points through shared memory, 8 narrow STS per
        # K-tile; tests/kernels/test_int4_kernel.py)
        assert r["sts"] == 0 or (dtype.startswith("int4-") and not NATURAL_TRITON)
        # (a wait after each group leaves at most 7 in flight: 128 x 256 x 128 commits 16 per K-tile)
        assert r["groups"] >= 2 and tool.in_flight(r) == min(r["groups"], 8) - 1
        assert r["alone"] <= 1.05 * max(r["t_tensor"], r["t_l2"], r["t_issue"])
        if dtype == "float16":
            assert r["t_issue"] < r["t_tensor"]
    # the default at 4096 rows (since the serial rule, of two programs per SM) runs wgmma too, and
    # spills nothing, as its cost row says
    default = prefill_config(4096, 4096, 4096, pair=dtype)
    d = tool.prefill_one(dtype, default, 90)
    assert d["hgmma"] and d["spills"] == 0 and d["local"] == 0
    assert tool.programs_per_sm(d["regs"], d["shared"], default.num_warps) >= 1


@pytest.mark.parametrize("dtype,cfg", [("float16", _split(32, 64, 128, 2)), ("int4-bfloat16", _split(128, 64, 64, 2)),
                                       ("int8-bfloat16", _split(128, 256, 64, 2)),
                                       ("float16", _split(32, 64, 128, 4)), ("int4-float16", _split(128, 128, 64, 8))],
                         ids=["fp16-32x64-split2", "int4-bf16-128x64-split2", "int8-bf16-128x256-split2",
                              "fp16-32x64-split4", "int4-fp16-128x128-split8"])
def test_split_k_compiles_its_cost_row_for_sm90(dtype, cfg, monkeypatch):
    """No GPU here: a split config compiled for sm_90 adds one atomic, in the loop over its
    split-K tree's levels (a node's arrival counter; the partials follow the main loop), and
    runs the main loop, with the registers and spills, of its split row in the committed cost
    table, which stands for every factor (the model charges a split config that row, and the
    defaults never take one that spills: Triton 3.6 spills 56 B at INT4 x bf16 128 x 64): the
    small-M default (32 x 64), a natural tile with two accumulators, the wide tile (both halves'
    partials), and splits 4 and 8, whose code is the split-2 code (the kernel reads the split
    count from the grid; with it as a constant, split 8 of 128 x 128 INT4 held 4 registers more
    with Triton 3.8 and took 2.3% longer per K-tile with 3.6, and adding all eight partials in
    the last program, as a first version did, spilled 104 B with 3.9 where split 2 spilled none)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    if not natural_tile(cfg.block_m, cfg.block_n) and cfg.block_n == 256:   # Triton < 3.6: refused
        with pytest.raises(ValueError, match="needs Triton >= 3.6"):
            check_prefill_runs(cfg)
        return
    tool = _static_check()
    r = tool.prefill_model(tool.prefill_one(dtype, cfg, 90))
    assert r["per_sm"] >= 1 and r["atomics"] == 1
    table = prefill.prefill_costs()
    if table is not None:
        row = next(row for row in table[dtype]["configs"] if row["cfg"] == prefill.cost_key(cfg))
        assert {k: r[k] for k in ("loop", "mma", "half", "regs", "spills")} == \
            {k: row[k] for k in ("loop", "mma", "half", "regs", "spills")}
        assert r["alone"] == pytest.approx(row["alone"], abs=0.01)


def test_l2_traffic_of_a_tile():
    """The model's L2 term by hand: a 256 x 128 x 64 fp16 tile reads 256 x 64 x 2 B of x and
    128 x 64 x 1 B of kept values + 128 x 64 / 8 B of metadata per K-tile; 128 x 64 x 64 reads
    2.0x the bytes per multiply-add, 128 x 256 x 64 0.83x. A round of p programs takes at least p t_l2; the idealized
    dense GEMM's 128 x 256 tile (its 256-wide operand's loads shared by two SMs) is tensor-bound
    at 32 B per SM clock, its 128 x 128 tile L2-bound; at the measured 24.7 both are L2-bound."""
    tool = _static_check()
    wide, narrow = (KernelConfig(bm, bn, 64, 8, 1, bn // 16, 2, kernel="prefill") for bm, bn in ((256, 128), (128, 64)))
    assert tool.tile_l2_bytes("float16", wide) == 256 * 64 * 2 + 128 * 64 + 128 * 64 // 8 == 41984
    assert tool.tile_l2_bytes("float16", narrow) == 20992 and 20992 / (128 * 64) == 2 * 41984 / (256 * 128)
    # the wide weight tile, 128 x 256: x's 128 rows once for 256 rows of W, 34 B per SM clock at the
    # tensor cores' rate (1024 clocks per K-tile) against 256 x 128's 41
    assert tool.tile_l2_bytes("float16", _cfg(128, 256, 64)) == 128 * 64 * 2 + 256 * 64 + 256 * 64 // 8 == 34816
    # the model's figure: the mean of the H200's two L2 probe runs (round numbers below at 32)
    assert tool.L2_BYTES_PER_SM_CLK == 24.7 == sum(prefill_model.L2_MEASURED) / 2
    r = dict(cfg=narrow, t_tensor=256.0, t_issue=200.0, per_sm=2, alone=256.0, l2_bytes=20992)
    ours, dense = tool.predicted_time(r, 4096, 4096, 4096, 1.125, l2=32.0)
    assert ours == 64 * 8 * 2 * 656            # 2048 programs: 16 per SM, 8 rounds of 2; 64 K-tiles
    assert dense == 64 * 4096                  # 128 x 256: 512 tiles, 4 waves of 16 clocks per column of K
    # without an L2 limit the tensor cores bind: 2 x 256 per round; dense evens out its waves with
    # 32 x 64 tiles (8192 of them: 63 waves of one clock per column of K; no split, they fill the SMs)
    assert tool.predicted_time(r, 4096, 4096, 4096, 1.125, l2=float("inf")) == (64 * 8 * 2 * 256, 63 * 4096)
    # M = 512: 64 tiles of 128 x 256 in one wave (16 clocks per column of K), so dense splits K in
    # two: 128 programs over 2048 columns, plus 2 partial tiles of 128 KiB through L2 (8192 clocks);
    # without an L2 limit 32 x 64 tiles: 1024 of them, 8 waves of one clock per column
    assert tool.dense_time(512, 4096, 4096, 32.0) == 16 * 2048 + 2 * 128 * 256 * 4 / 32 == 10 * 4096
    assert tool.dense_time(512, 4096, 4096, float("inf")) == 8 * 4096
    # at the measured 24.7 B the 128 x 256 tile is L2-bound: 512 B of operands per column of K (its
    # 128-wide one and its half of the shared 256-wide one) in 20.7 clocks, not 16; 4 waves
    assert tool.dense_time(4096, 4096, 4096) == pytest.approx(4 * 4096 * (128 + 128) * 2 / 24.7)
    # the idealized dense GEMM streams a small-M weight at HBM's rate (small tiles, split-K), so no
    # prediction can pass the byte ratio there: fp16 4096 x 4096 at M = 32
    per_byte = 1 / prefill_model.SMS / prefill_model.HBM_BYTES_PER_SM_CLK
    assert tool.dense_time(32, 4096, 4096) == pytest.approx((4096 * 4096 + 32 * 8192) * 2 * per_byte)


def test_split_k_estimate_counts_more_programs_and_the_partials():
    """The report's serial split-K estimate (``predicted_time(..., split_k)``), checked by hand on a
    tile whose numbers are round: 128 x 128 x 64, t_issue = t_tensor = 512 clocks per K-tile, two
    programs per SM. 4096 x 4096 at M = 256: 64 tiles; split 4 makes 256 programs (2 per SM, 16
    K-tiles each: 16 x 1024 clocks) plus, per SM, the first program's fp32 partial stored and for
    the last a store and a load on each of the tree's 2 levels (1 + 4 tiles of 64 KiB through
    L2; adding all four partials in the last program moved 2 + 3)."""
    tool = _static_check()
    cfg = KernelConfig(128, 128, 64, 8, 1, 8, 2, kernel="prefill")
    r = dict(cfg=cfg, t_tensor=512.0, t_issue=512.0, per_sm=2)
    one, dense = tool.predicted_time(r, 256, 4096, 4096, 1.125)
    assert one == 64 * 512 * 2     # 64 programs, one per SM: decode then wgmma, 64 K-tiles
    four, dense4 = tool.predicted_time(r, 256, 4096, 4096, 1.125, split_k=4)
    assert dense4 == dense
    assert four == pytest.approx(16 * 1024 + (1 + 4) * 128 * 128 * 4 / tool.L2_BYTES_PER_SM_CLK)
    eight = tool.predicted_time(r, 256, 4096, 4096, 1.125, split_k=8)[0]   # 4 per SM, 8 K-tiles each
    assert eight == pytest.approx(8 * 2048 + (3 + 6) * 128 * 128 * 4 / tool.L2_BYTES_PER_SM_CLK)


def test_loop_replay_overlaps_what_the_waits_allow():
    """The model of one program alone (``loop_tile_time``), by hand on round numbers (4 warps:
    one clock per issue slot; t_tensor 256 per K-tile, split over its groups): a loop that waits
    for its only group takes decode + multiply; one that decodes everything and then commits two
    groups, each wait leaving one in flight, hides half the multiply (300 + 128); four groups with
    a quarter of the decode before each, three left in flight, take max(decode, multiply)."""
    tool = _static_check()
    serial = [("issue", 300), ("group", 0), ("wait", 0)]
    assert tool.loop_tile_time(serial, 256.0, 4) == 300 + 256
    assert tool.loop_tile_time(serial, 256.0, 8) == 600 + 256          # 8 warps: 2 per scheduler
    two = [("issue", 300), ("group", 0), ("wait", 1), ("group", 0), ("wait", 1)]
    assert tool.loop_tile_time(two, 256.0, 4) == 300 + 128
    for decode in (50, 100):
        four = [("issue", decode), ("group", 0), ("wait", 3)] * 4
        assert tool.loop_tile_time(four, 256.0, 4) == max(4 * decode, 256)
    assert tool.loop_tile_time([("issue", 300)], 256.0, 4) == 300 + 256   # no wgmma groups: serial
    # the replay reads a compiled loop: rotated to start after its last wait, HGMMA not issue slots
    loop = ["LDS R1, [R2]", "WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32 R24, R96, gdesc[UR4], R24",
            "HGMMA.64x128x16.F32 R24, R100, gdesc[UR4], R24, gsb0", "PRMT R3, R4, R5, RZ",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x0", "BRA 0x100"]
    assert tool.wgmma_events(loop) == [("issue", 4), ("group", 0), ("issue", 2), ("wait", 1)]


def test_one_program_alone_is_the_replayed_loop_to_64_rows_then_serial():
    """``predicted_time``'s one program's K-tile, 128 x 128 x 64 by hand (t_tensor 512, t_issue
    400, replay 656, 16384 B through L2: 512 clocks at 32 B per SM clock). Up to 64 rows the
    replay (``alone``; without one, decode then multiply): 4096 x 4096 at M = 64 is 32 programs,
    one per SM, 64 K-tiles (the latency term off). Past 64 rows tensor, issue and L2 one after the
    other (1424), as the H200 ran Triton's own GEMM: M = 256, 64 programs, one per SM; M = 1024,
    256 programs, two per SM, each filling the other's gaps, so two programs' tensor time binds
    (2 x 512 < 1424 < 2 x 512 + 400); with L2 unbounded the sum less its L2 term."""
    tool = _static_check()
    cfg = KernelConfig(128, 128, 64, 8, 1, 8, 2, kernel="prefill")
    r = dict(cfg=cfg, t_tensor=512.0, t_issue=400.0, per_sm=2, alone=656.0, l2_bytes=16384)
    assert tool.predicted_time(r, 64, 4096, 4096, 1.125, l2=32.0, hbm_latency=0.0)[0] == 64 * 656
    assert tool.predicted_time(r, 256, 4096, 4096, 1.125, l2=32.0)[0] == 64 * (512 + 400 + 512)
    assert tool.predicted_time(r, 1024, 4096, 4096, 1.125, l2=32.0)[0] == 64 * 1424
    assert tool.predicted_time(r, 256, 4096, 4096, 1.125, l2=float("inf"))[0] == 64 * (512 + 400)
    r.pop("alone")   # without a replay: decode, then multiply
    assert tool.predicted_time(r, 64, 4096, 4096, 1.125, l2=32.0, hbm_latency=0.0)[0] == 64 * (400 + 512)


def test_few_rows_wait_for_their_loads():
    """Up to LATENCY_MAX_M rows a round of n programs takes at least (HBM_LATENCY_CLK + n t_l2) /
    (num_stages - 1) SM clocks per K-tile (its pipeline's K-tiles in flight), by hand: 32 x 64 x
    128 split 2 at 4096 x 8192 and 32 rows is 128 programs (one round, one per SM), 32 K-tiles
    each; with L2 unbounded (t_l2 0, no partials' cost) every figure is above the HBM floor
    (~19100 clocks). The fitted config's own numbers (17408 B a K-tile at the model's 24.7 B per SM
    clock, 4096 x 4096: 16 K-tiles) give back the measured 2614 clocks per K-tile. Past 64 rows, or
    with the term off, its loop binds as before."""
    tool = _static_check()
    lat = prefill_model.HBM_LATENCY_CLK
    inf = float("inf")
    for stages in (2, 3, 4):
        r = dict(cfg=_cfg(32, 64, 128, stages), t_tensor=128.0, t_issue=400.0, alone=620.0, per_sm=4)
        assert tool.predicted_time(r, 32, 4096, 8192, 1.125, 2, inf)[0] == 32 * lat / (stages - 1)
        assert tool.predicted_time(r, 32, 4096, 8192, 1.125, 2, inf, hbm_latency=0.0)[0] == 32 * 620
        # 65 rows: 3 row blocks, 384 programs, 3 per SM in one round: issue binds, no latency term
        assert tool.predicted_time(r, 65, 4096, 8192, 1.125, 2, inf)[0] == 32 * 3 * 400
    r = dict(cfg=_cfg(32, 64, 128, 2), t_tensor=128.0, t_issue=400.0, alone=520.0, per_sm=4, l2_bytes=17408)
    l2 = prefill_model.L2_BYTES_PER_SM_CLK
    partials = 2 * 32 * 64 * 4 / l2   # the split's tree: a store and a load of one fp32 tile
    assert tool.predicted_time(r, 32, 4096, 4096, 1.125, 2, l2)[0] == pytest.approx(16 * (lat + 17408 / l2) + partials)
    assert 16 * (lat + 17408 / l2) == pytest.approx(16 * 2614, abs=16)


def test_the_latency_term_is_the_h200_fit():
    """HBM_LATENCY_CLK is the slope of the H200's two measured runs of one config at 32 rows
    (results/NVIDIA_H200/probe_prefill-run4.csv: 4096 x 4096 and 4096 x 11008, 16 and 43 K-tiles a
    program) in SM clocks at 1.98 GHz, less its tiles' time through L2 at the assumed 32 B per SM
    clock (32 x 128 fp16 x and 64 x 128 compressed fp16 weight a K-tile); the report reads those rows."""
    import pathlib

    tool = _static_check()
    rows = {(r["N"], r["K"]): r for r in tool.measured_prefill_rows(pathlib.Path(__file__).parents[2])
            if r["pair"] == "float16" and r["M"] == 32}
    a, b = rows[(4096, 4096)], rows[(4096, 11008)]
    assert a["cfg"] == b["cfg"] == dataclasses.replace(_cfg(32, 64, 128), split_k=2)

    def tiles(r):
        return -(-(-(-r["K"] // 128)) // 2)
    slope = (b["us"] - a["us"]) / (tiles(b) - tiles(a)) * tool.SM_CLOCK_GHZ * 1e3
    assert tool.tile_l2_bytes("float16", a["cfg"]) == 32 * 128 * 2 + 64 * 128 * 9 // 8
    through_l2 = tool.tile_l2_bytes("float16", a["cfg"]) / prefill_model.L2_BYTES_PER_SM_CLK
    assert abs(slope - through_l2 - prefill_model.HBM_LATENCY_CLK) < 1


def test_past_64_rows_the_model_is_the_h200s_own_gemm(monkeypatch):
    """Past 64 rows the H200 timed, beside each prefill-kernel row, Triton's own dense GEMM on the
    same tile, warps and stages (results/NVIDIA_H200/probe_prefill-run4.csv, 9 fp16 rows at 256-4096
    rows). Compiled here for sm_90 and costed as ours (its tensor, issue and L2 time one after the
    other, L2 at 24.7 B per SM clock), it comes out within 10% of every measured time; ours, with
    the cost rows of the Triton the H200 ran (3.6) on the tile that ran (at K = 4096 run 4's probe took the
    tuned entry, not the labelled config), has a median within 25% (its outlier: the K = 11008 layer,
    docs/kernels.md); the idealized dense GEMM is within 20% of cuBLAS at each.
    The model before (loads under the multiply, L2 at 32) put Triton's GEMM at 0.48-0.51 of its
    measured time and ours at 0.14-0.35."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import pathlib

    tool = _static_check()
    monkeypatch.chdir(pathlib.Path(__file__).parents[2])
    table = prefill.prefill_costs((3, 6))   # (another Triton's table may lack the configs the H200 ran)
    rows = [dict(r, dtype="float16") for r in table["float16"]["configs"]]
    triton_dense, ours, cublas = tool.large_rows_report(rows, 90)
    assert len(triton_dense) == len(ours) == len(cublas) == 9
    assert all(0.9 <= v <= 1.1 for v in triton_dense), triton_dense
    assert 0.9 <= sorted(ours)[4] <= 1.25, ours
    assert all(0.8 <= v <= 1.2 for v in cublas), cublas


def test_the_report_writes_the_cost_table_it_reads(tmp_path, monkeypatch):
    """``kernel_static_check.py --prefill --write-costs`` writes this Triton's section (other
    versions' sections kept) and the defaults read back exactly its rows; it refuses to write
    a table that lacks a pair."""
    import json
    import types

    import triton
    tool = _static_check()
    path = tmp_path / "prefill_costs.json"
    other = {"format": 1, "tables": {"0.1": json.loads(prefill.COSTS_FILE.read_text())["tables"]["3.9"]}}
    path.write_text(json.dumps(other))
    monkeypatch.setattr(prefill, "COSTS_FILE", path)
    source = prefill.prefill_costs((0, 1), path)
    rows = [dict(r, dtype=pair) for pair in prefill.PAIRS for r in source[pair]["configs"]]
    rows[0] = dict(rows[0], alone=rows[0]["alone"] + 1.0)   # a changed cost must come back as written
    tool.write_costs(rows, types.SimpleNamespace(cap=90, argv=["--prefill", "--write-costs"]))
    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    written = prefill.prefill_costs(version, path)
    assert set(json.loads(path.read_text())["tables"]) == {"0.1", f"{version[0]}.{version[1]}"}
    for pair in prefill.PAIRS:
        assert written[pair]["w_bytes"] == tool.dense_bytes_per_weight(pair)
        assert written[pair]["configs"] == [{k: v for k, v in r.items() if k != "dtype"} for r in rows
                                            if r["dtype"] == pair]
    prefill._load_costs.cache_clear()
    with pytest.raises(SystemExit, match="every pair"):
        tool.main(["--prefill", "--write-costs", "--dtypes", "float16"])

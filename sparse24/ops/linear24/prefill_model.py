"""The prefill kernel's time model on an H200 (sm_90), shared by the untuned defaults
(:func:`~.prefill.prefill_config` picks the config it predicts fastest) and the static
report (``scripts/kernel_static_check.py --prefill``, which measures its inputs from the
sm_90 SASS and prints its predictions). Pure arithmetic; docs/kernels.md "Prefill path"
derives it.

A config's costs per K-tile of one program (a dict, one row of the report or of the
committed cost table ``prefill_costs.json``): ``cfg`` (its :class:`KernelConfig`),
``t_tensor`` (SM clocks of its multiply-adds), ``t_issue`` (issue cycles per scheduler),
``alone`` (one program's K-tile by itself on an SM, its loop replayed), ``l2_bytes`` (its x
and weight tiles through L2) and ``per_sm`` (resident programs).
"""
from __future__ import annotations

from ..config_space import SPLIT_K_MAX_M

# H200: 132 SMs; dense fp16/bf16 tensor cores 1024 x 2 = 2048 multiply-adds per clock per SM
# (989 TFLOP/s at 1.83 GHz); HBM 4.0 TB/s at 1.98 GHz for the memory floor.
SMS, MACS_PER_CLK = 132, 2048
HBM_BYTES_PER_SM_CLK = 4.0e12 / 1.98e9 / SMS
# L2 to the SMs: the H200's own figure, the mean of its two probe runs (scripts/gpu_l2_bandwidth.py:
# 23.4 B per SM clock in results/NVIDIA_H200/l2_bandwidth.txt, 26.0 in run 1, at 1.98 GHz). Until
# 2026-12-05 the model assumed 32 (8.4 TB/s), which put the idealized dense GEMM 1.03-1.37x faster
# than the cuBLAS measured beside it from 256 rows; at 24.7 it is 0.81-1.09x of it (median 0.99, 25
# points of probe_prefill-run4.csv and sparse_mm-run5.csv, the fitted 4.6 us added). Every program
# reads its x and weight tiles through L2 on each K-tile (the pipelined copies bypass L1); split-K's
# fp32 partials go through it too.
L2_MEASURED = (23.4, 26.0)
L2_BYTES_PER_SM_CLK = round(sum(L2_MEASURED) / len(L2_MEASURED), 2)
# Up to LATENCY_MAX_M rows each weight tile streams from HBM once, and a program waits out its
# loads: its pipeline keeps num_stages - 1 K-tiles in flight, and a K-tile's bytes arrive
# HBM_LATENCY_CLK after the request plus the time the SM's share of L2 bandwidth takes to bring
# in its round's tiles (n programs' l2_bytes at l2 B per SM clock), so a round takes at least
# (HBM_LATENCY_CLK + n t_l2) / (num_stages - 1) per K-tile (Little's law per program).
# Fitted on the H200 (results/NVIDIA_H200/probe_prefill-run4.csv): one config, 32 x 64 x 128 on
# 2 stages split in 2, one program per SM, at 32 rows took 25.66 us for 16 K-tiles a program
# (fp16 4096 x 4096) and 61.30 us for 43 (4096 x 11008): 1.32 us per K-tile, 2614 clocks at
# 1.98 GHz, less its tiles' 17408 B at 24.7 B per SM clock (705): 1909 (its loop alone is ~520;
# the fit's fixed 4.6 us, launch and epilogue, is not modelled, on either side). Measured
# throughput there rose with the bytes each SM kept in flight (docs/kernels.md, "17-64 rows:
# bytes in flight"). (The config space's few-row regime, whose deeper configs and wider split-K
# this term is for: config_space.prefill_configs, split_factors.)
HBM_LATENCY_CLK = 1909.0
# Past LATENCY_MAX_M rows the tiles are re-read from L2, and one program's K-tile takes its
# tensor-core time, its issue time and its tiles' time through L2 one after the other
# (t_tensor + t_issue + t_l2: nothing of its own overlaps), other programs on the SM filling
# its gaps. Fitted on the H200's run 4, where each prefill row also timed Triton's own dense
# GEMM (scripts/gpu_probe.py's _dense_mm, no decode) on the same tile, warps and stages: that
# kernel's sm_90 loop replayed this way gives 0.92-1.02x of its measured time at the 9 points
# of 256-4096 rows (128 x 256 and 128 x 128 x 64 on 2 stages), where the replay with loads
# overlapped (max of the terms) gave 1.56-1.67x; ours 1.06-1.20x on the two layers of K = 4096
# (docs/kernels.md, "Past 64 rows: the model checked against Triton's own GEMM"). Two programs
# per SM rest on two points: run 2's tuned 256 x 64 x 64 on 3 stages at 4096 rows, 1.08x and 1.10x
# of the rule (4096 x 4096, 11008 x 4096); the same tuner timed 64 x 128 x 128 slower than those
# winners, which the rule overrates there by >= 16% and >= 22%.
LATENCY_MAX_M = SPLIT_K_MAX_M
# The idealized dense GEMM's tiles (rows of x, rows of W: the small ones with the weight as
# wgmma's 64-row side, as GEMMs swap the operands for few rows of x) and split-K factors.
DENSE_TILES = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 128), (128, 256), (256, 128))
DENSE_SPLITS = (1, 2, 4, 8, 16)


def reduction_tiles(per_sm: int, split_k: int, wide: bool = False) -> float:
    """fp32 partial tiles an SM moves through L2 on the critical path of a split-K over
    ``split_k`` (a power of two) splits with ``per_sm`` programs on it: one store for each
    program, and for the last a store and a load on each further level of the pairwise tree
    (kernels/sparse24_prefill.py, ``_tree_split_k``), with half a tile more per level for the
    ``wide`` tile (128 x 256: its second half read back); 0 without split-K."""
    return 0 if split_k == 1 else per_sm - 1 + (2.5 if wide else 2) * (split_k.bit_length() - 1)


def dense_time(M: int, N: int, K: int, l2: float = L2_BYTES_PER_SM_CLK, sms: int = SMS) -> float:
    """SM clocks of the idealized dense GEMM (fp16 weight) the prediction compares with:
    the best of its tiles (DENSE_TILES: rows of x x rows of W, 32x64 to 256x128; ours has
    the same small ones), each split along K into 1, 2, 4, 8 or 16 parts (whole waves of
    programs over the SMs; a split's fp32 partial tile through L2, as :func:`predicted_time`
    charges ours), each tile's K-steps at the tensor
    cores' full rate or at the rate L2 delivers its two operand tiles (2 B per element per
    column of K at ``l2`` B per SM clock; a 256-wide operand's loads shared by two SMs, as
    Hopper GEMMs do with a cluster of two and TMA multicast, so 128x256 is tensor-bound at 32 B
    per SM clock), whichever is slower, floored by HBM traffic. Small tiles and split-K are what
    let a GEMM of few output tiles (M <= 128) fill the SMs and stream the weight at HBM's rate,
    as cuBLAS does; without them this baseline ran 32 SMs at M = 64, N = 4096 and put the 16-bit
    prefill above its byte ratio to dense. The same for every config of ours, so configs compare
    fairly; cuBLAS reaches ~74% of the tensor cores' rate on an H200 (788 TFLOP/s bf16 at
    8192^3, measured by others on these machines: device/KINDS.md). ``sms``: the SMs the waves
    fill (HBM stays an H200's 4.0 TB/s)."""
    io = (M * K + M * N) * 2 / SMS / HBM_BYTES_PER_SM_CLK

    def per_k(bm, bn):   # SM clocks per column of K of one tile
        shared = (bm // (2 if bm == 256 else 1) + bn // (2 if bn == 256 else 1)) * 2   # operand bytes
        return max(bm * bn / MACS_PER_CLK, shared / l2)

    def tiled(bm, bn, s):
        per_sm = -(-(-(-M // bm) * -(-N // bn) * s) // sms)
        partials = reduction_tiles(per_sm, s) * bm * bn * 4 / l2
        return per_sm * per_k(bm, bn) * -(-K // s) + partials
    # split-K where the tiles leave SMs idle, as ours (config_space.split_factors): at most two
    # programs per SM and 128 columns of K per split
    tiles = min(tiled(bm, bn, s) for bm, bn in DENSE_TILES for s in DENSE_SPLITS
                if s == 1 or (K >= 128 * s and -(-M // bm) * -(-N // bn) * s <= 2 * sms))
    return max(tiles, N * K * 2 / SMS / HBM_BYTES_PER_SM_CLK + io)


def predicted_time(r: dict, M: int, N: int, K: int, w_bytes: float, split_k: int = 1,
                   l2: float = L2_BYTES_PER_SM_CLK, sms: int = SMS,
                   hbm_latency: float = HBM_LATENCY_CLK) -> tuple[float, float]:
    """``(ours, dense)`` in SM clocks for (M, N, K): programs spread over the SMs,
    ``per_sm`` resident at once, in rounds: a round of p programs takes max(p t_tensor,
    p t_issue, p t_l2, alone) per K-tile, where t_l2 is a program's x and weight tiles
    (``l2_bytes``) through L2 at ``l2`` B per SM clock (``inf``: no L2 limit, on either
    side) and ``alone`` is one program's K-tile by itself on an SM, other programs filling
    its gaps: up to LATENCY_MAX_M rows its loop's wgmma groups and waits replayed (without
    the replay, decode and wgmma one after the other: t_tensor + t_issue), and the round at
    least (HBM_LATENCY_CLK + n t_l2) / (num_stages - 1) (each program's loads in flight);
    past them t_tensor + t_issue + t_l2 (the H200 fit: nothing of one program overlaps); floored
    by HBM traffic (weight bytes ``w_bytes`` per element, x and out fp16). ``split_k`` > 1: the kernel's split-K
    (``r`` then the split row of the cost table): split_k times the programs, each over its
    split's whole K-tiles, and fp32 partial tiles through L2 as the pairwise tree moves them
    (:func:`reduction_tiles`). Dense: :func:`dense_time`. ``sms``: the SMs
    the programs spread over; ``hbm_latency``: the latency term's clocks (0: without it)."""
    c = r["cfg"]
    progs = -(-M // c.block_m) * -(-N // c.block_n) * split_k
    per_sm_progs = -(-progs // sms)
    iters = -(-(-(-K // c.block_k)) // split_k)   # K-tiles of a split (the kernel's per_split)
    tt, ti, tl2, p = r["t_tensor"], r["t_issue"], r.get("l2_bytes", 0) / l2, max(r["per_sm"], 1)
    full, rest = divmod(per_sm_progs, p)
    few = M <= LATENCY_MAX_M
    # one program's K-tile: its replayed loop (without one: decode, then multiply) up to
    # LATENCY_MAX_M rows, past them its terms one after the other
    alone = r.get("alone", tt + ti) if few else tt + ti + tl2
    depth = max(c.num_stages - 1, 1) if few else 0

    def rnd(n):
        wait = (hbm_latency + n * tl2) / depth if depth else 0.0
        return max(n * tt, n * ti, n * tl2, alone, wait) if n else 0.0
    ours = iters * (full * rnd(p) + rnd(rest))
    ours += reduction_tiles(per_sm_progs, split_k, c.block_n == 256) * c.block_m * c.block_n * 4 / l2
    io = (M * K + M * N) * 2 / SMS / HBM_BYTES_PER_SM_CLK
    return max(ours, (N * K * w_bytes) / SMS / HBM_BYTES_PER_SM_CLK + io), dense_time(M, N, K, l2, sms)

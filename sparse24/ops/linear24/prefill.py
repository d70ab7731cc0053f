"""The prefill kernel's configs (``kernels/sparse24_prefill.py``, M > 16, the
decode layout): its config space and untuned defaults. Its launch is a variant
of the plan-cached path in :mod:`.launch` (``linear_prefill``, ``run_prefill``).

At M > 16 on CUDA a decode-layout weight runs this kernel (``sparse24::linear``
routes it, :mod:`.op`): each weight tile is decoded once per BLOCK_M rows of x
(128 by default at prefill sizes), straight from the one copy the module holds;
no call converts or decompresses the whole weight (``scripts/bench_host.py
--prefill`` counts the aten ops and bytes a call allocates).
"""
from __future__ import annotations

import functools

from ..config_space import DECODE_M, KernelConfig

__all__ = ["prefill_config", "prefill_configs", "check_prefill_config", "natural_tile"]

# The untuned defaults, chosen from the sm_90 SASS counts and the model built on them
# (scripts/kernel_static_check.py --prefill, docs/kernels.md "Prefill path"; not timed
# on a GPU yet). One 16-row W tile per warp (num_warps == BLOCK_N // 16, the decode
# layout's fragment ownership) and BLOCK_N >= 64, so sm_90 runs wgmma with W from
# registers (HGMMA). Tiles in order, each with the programs (in units of the SMs) it needs
# before the next, smaller one is taken, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SMs);
# the last tile takes whatever is left. Fitted to the report's model over the 11 shapes of
# issue 22 at M = 32-4096, for every weight kind at once (16-bit, INT8, INT4) and both
# Triton 3.9 and 3.6: the best sum over M of the minimum over shapes, weight kinds and two
# L2 bandwidths (the model's 32 B per SM clock, and none), then the best sum.
# Every program reads its x tile and its weight tile through L2 on every K-tile, so the
# wide tile comes first: 256 x 128 x 64 (8 warps, x in its own order, one accumulator)
# reads 656 B (fp16) per column of K for 256 x 128 multiply-adds, 128 x 64 x 64 328 B for a
# quarter of them; at 32 B per SM clock 128 x 64 runs at 0.39 of the tensor cores' rate,
# 256 x 128 at 0.78. 256 x 128 runs one program per SM (222-246 registers, no spill, Triton
# 3.9 and 3.6) and one program alone keeps the tensor cores busy (1024-1036 clocks per
# K-tile against 1024 for 16-bit weights). Below Triton 3.6 no tile is natural
# (natural_tile): there 256 x 128 would run permuted and serial, so it is left out.
_WIDE = (256, 128, 64, 8, 2, 0.5)
_TILES = ((128, 128, 64, 8, 2, 0.5), (128, 64, 64, 4, 2, 0.0), (64, 64, 128, 4, 2, 0.5), (32, 64, 128, 4, 2, 0.0))


def prefill_config(M: int, N: int, K: int, num_sms: int = 132) -> KernelConfig:
    """The untuned prefill config for ``M`` rows (``M > 16``) of an ``N x K`` weight of any
    kind (16-bit, INT8, INT4): the first tile of the list that wastes at most half its
    BLOCK_M rows and gives enough programs, ``ceil(M / BLOCK_M) * ceil(N / BLOCK_N)``, for the
    ``num_sms`` multiprocessors (default: an H200's 132); else 32 x 64 (sm_90 SASS,
    docs/kernels.md)."""
    if M <= DECODE_M:
        raise ValueError(f"the prefill kernel serves M > {DECODE_M}, got M = {M}")
    tiles = ((_WIDE,) if natural_tile(256, 128) else ()) + _TILES
    for bm, bn, bk, warps, stages, fill in tiles:
        if bm < 2 * M and -(-M // bm) * -(-N // bn) >= fill * num_sms:
            break
    return _config(bm, bn, bk, warps, stages)


@functools.lru_cache(maxsize=None)
def natural_tile(block_m: int, block_n: int) -> bool:
    """Whether the installed Triton runs a BLOCK_M x BLOCK_N prefill tile in x's own column
    order (``kernels/sparse24_prefill.py``, ``natural_tile``: from 128 rows with Triton 3.9;
    with 3.6 at 128 rows and at 256 x 128; before 3.6 none)."""
    from sparse24.kernels.sparse24_prefill import natural_tile as natural
    return natural(block_m, block_n)


@functools.lru_cache(maxsize=None)
def _config(bm, bn, bk, warps, stages) -> KernelConfig:
    return KernelConfig(bm, bn, bk, 8, 1, warps, stages, kernel="prefill")


def prefill_configs(M: int) -> list[KernelConfig]:
    """The prefill config space for the static report and a tuner: BLOCK_M in
    (32, 64) at M <= 64, else (32, 64, 128, 256) (BLOCK_K 128 for
    BLOCK_M < 128, else 64), BLOCK_N x warps in (64 x 4, 128 x 8), 2 or 3 stages
    (pipelined x loads). Left out, measured by the static report (sm_90, Triton
    3.9): BLOCK_K 128 at BLOCK_M >= 128 (200-255 registers, one program per SM
    or spills), 4 stages (the issue count of 3)."""
    bms = (32, 64) if M <= 64 else (32, 64, 128, 256)
    return [check_prefill_config(KernelConfig(bm, bn, 64 if bm >= 128 else 128, 8, 1, w, st, kernel="prefill"))
            for bm in bms for bn, w in ((64, 4), (128, 8)) for st in (2, 3)]


def check_prefill_config(config: KernelConfig) -> KernelConfig:
    """Raise ValueError unless the prefill kernel can run ``config``; returns it."""
    c = config.validate()
    if c.kernel != "prefill" or c.block_m < 16 or c.block_k < 64 or c.block_n not in (32, 64, 128) \
            or c.num_warps != c.block_n // 16 or c.split_k != 1:
        raise ValueError(f"bad prefill config {c}: need kernel 'prefill', block_m >= 16, block_k >= 64, block_n "
                         f"in (32, 64, 128), num_warps == block_n // 16 and split_k == 1")
    return c

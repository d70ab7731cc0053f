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

__all__ = ["prefill_config", "prefill_configs", "check_prefill_config", "natural_order"]

# The untuned defaults, chosen from the sm_90 SASS counts and the model built on them
# (scripts/kernel_static_check.py --prefill, docs/kernels.md "Prefill path"; not timed
# on a GPU yet). One 16-row W tile per warp (num_warps == BLOCK_N // 16, the decode
# layout's fragment ownership) and BLOCK_N >= 64, so sm_90 runs wgmma with W from
# registers (HGMMA). Tiles in order, each with the programs (in units of the SMs) it needs
# before the next, smaller one is taken, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SMs),
# fitted to the report's model over the 11 shapes of issue 22 at M = 32-4096 (the best
# minimum per M over 1-3-tile lists of the space, then the best sum); the last tile takes
# whatever is left.
# From 128 rows x is read in its own column order, and a 128-row tile multiplies each
# half-atom into its own accumulator, so the loop keeps three wgmma groups in flight and one
# program alone runs its multiply under its decode: 128 x 64 x 64 (Triton 3.9: 215-234
# registers, 3.6: 255, no spill; two programs per SM) takes every M > 64 (predicted 0.94 /
# 0.92 / 0.75 of dense fp16 at worst for fp16, INT8 x fp16, INT8 x bf16, Triton 3.9).
# 16-bit weights first try 128 x 128 x 64 from 4 programs per SM (212 registers, one per SM,
# but alone tensor-bound: 512 clocks per K-tile against 508 of issue; 1.00 where its programs
# fill whole waves); INT8's is issue-bound there (546 / 672). INT4's 128 x 64 is issue-bound
# (375-409 issue cycles per K-tile against 256), so where the 256-row tiles are natural too
# (Triton >= 3.9, natural_order()) it first tries 256 x 64 x 64 (one accumulator, 250
# registers, two programs per SM, tensor-bound at large M) on 2, then 3 stages.
_NATURAL_TILES = ((128, 64, 64, 4, 2, 0.0), (64, 64, 128, 4, 2, 0.5), (32, 64, 128, 4, 2, 0.0))
_NATURAL_16BIT_TILES = ((128, 128, 64, 8, 2, 4.0),) + _NATURAL_TILES
_NATURAL_INT4_TILES = ((256, 64, 64, 4, 2, 1.0), (256, 64, 64, 4, 3, 0.5)) + _NATURAL_TILES


def prefill_config(M: int, N: int, K: int, num_sms: int = 132, *, int4: bool = False,
                   int8: bool = False) -> KernelConfig:
    """The untuned prefill config for ``M`` rows (``M > 16``) of an ``N x K`` weight:
    the first tile of the list for the weight (``int4``: INT4 values, ``int8``: INT8, else
    16-bit) that wastes at most half its BLOCK_M rows and gives enough programs, ``ceil(M / BLOCK_M) * ceil(N / BLOCK_N)``, for the ``num_sms``
    multiprocessors (default: an H200's 132); else 32 x 64 (sm_90 SASS, docs/kernels.md)."""
    if M <= DECODE_M:
        raise ValueError(f"the prefill kernel serves M > {DECODE_M}, got M = {M}")
    if int4:
        tiles = _NATURAL_INT4_TILES if natural_order() else _NATURAL_TILES
    else:
        tiles = _NATURAL_TILES if int8 else _NATURAL_16BIT_TILES
    for bm, bn, bk, warps, stages, fill in tiles:
        if bm < 2 * M and -(-M // bm) * -(-N // bn) >= fill * num_sms:
            break
    return _config(bm, bn, bk, warps, stages)


@functools.lru_cache(maxsize=None)
def natural_order() -> bool:
    """Whether the installed Triton runs the prefill kernel's natural-order tiles at 256 rows
    too (Triton 3.9 and later; 3.6 at 128 rows only: ``kernels/sparse24_prefill.py``,
    ``NATURAL_TRITON``)."""
    from sparse24.kernels.sparse24_prefill import NATURAL_TRITON
    return NATURAL_TRITON


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

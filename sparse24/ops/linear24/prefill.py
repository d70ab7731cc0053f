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
# registers (HGMMA). From 128 rows of x (Triton >= 3.9) the kernel reads x in its own
# column order and the wgmma runs asynchronously, half a K-tile's multiply under the next
# decode; below, the loop waits for its own wgmma and decode and tensor cores overlap only
# across programs sharing an SM. Tiles in order of their predicted efficiency over full
# waves, each with the programs (in units of the SMs) it needs before it beats the next,
# smaller one at filling the GPU, fitted to the report's model over the 11 shapes of issue 22 at M = 64-4096:
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SMs). 128 x 128 x 64 needs 122-128 registers
# (2 programs per SM, every 16-bit and INT8 pair); the last tile takes whatever is left.
# With the natural-order tiles (Triton >= 3.9), INT8 weights first try 256 x 64 x 64 on
# 3 stages (236-237 registers, 2 programs per SM: tensor-bound where 128 x 128 is
# issue-bound, 1.00 against 0.80-0.95 of dense at large M).
_TILES = ((128, 128, 64, 8, 2, 1.5), (128, 64, 64, 4, 2, 1.0), (64, 64, 128, 4, 2, 0.7), (32, 64, 128, 4, 2, 0.0))
_INT8_TILES = ((256, 64, 64, 4, 3, 2.0),) + _TILES


def prefill_config(M: int, N: int, K: int, num_sms: int = 132, *, int4: bool = False,
                   int8: bool = False) -> KernelConfig:
    """The untuned prefill config for ``M`` rows (``M > 16``) of an ``N x K`` weight:
    the first tile of ``_TILES`` that wastes at most half its BLOCK_M rows and gives
    enough programs, ``ceil(M / BLOCK_M) * ceil(N / BLOCK_N)``, for the ``num_sms``
    multiprocessors (default: an H200's 132); else 32 x 64. INT8 weights (``int8``) try
    256 x 64 first where the kernel's natural-order tiles run (:func:`natural_order`); INT4
    weights (``int4``) skip 128 x 128: its dequantization takes 154 registers there, one
    program per SM (sm_90 SASS, docs/kernels.md)."""
    if M <= DECODE_M:
        raise ValueError(f"the prefill kernel serves M > {DECODE_M}, got M = {M}")
    for bm, bn, bk, warps, stages, fill in (_TILES[1:] if int4 else _INT8_TILES if int8 and natural_order()
                                            else _TILES):
        if bm < 2 * M and -(-M // bm) * -(-N // bn) >= fill * num_sms:
            break
    return _config(bm, bn, bk, warps, stages)


@functools.lru_cache(maxsize=None)
def natural_order() -> bool:
    """Whether the installed Triton runs the prefill kernel's natural-order tiles (from
    128 rows; Triton 3.9 and later: ``kernels/sparse24_prefill.py``, ``NATURAL_TRITON``)."""
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

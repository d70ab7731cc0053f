"""Transposable 2-D N:M masks: every ``m x m`` block keeps at most ``n`` per
row AND per column, so ``mask.T`` is N:M too (the backward pass ``grad @ W``
can use the same sparse weight). ``"2d_optimal"`` keeps the maximum magnitude
over all valid block patterns (the 186 maximal ones for 2:4), up to float64 rounding of each
pattern's sum: exact for float32 / 16-bit weights whose magnitudes within a block lie within a
factor 2^24 of each other (2^26 for 2:4), else (1e-20 beside 1.0, or float64 weights) sums that differ below
float64's step tie and the first pattern in table order wins; ``"2d_greedy"`` takes the largest
entries first (any n:m; for m = 4 the optimum is also the faster one: 0.63 s
vs 1.78 s at 4096x4096 fp32, 1 thread of a 2-core AMD EPYC,
results/cpu-amd-epyc/bench_masks.md).
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache

import torch

from .._checks import check_nm

__all__ = ["block_patterns", "mask_2d_optimal", "mask_2d_greedy", "score_dtype"]


# 2d_optimal enumerates the block patterns; their number grows fast with m
# (2:4 has 186, 2:5 4290, 3:5 13540, 2:6 141390), so refuse beyond this many.
_MAX_PATTERNS = 15000


def block_patterns(n: int = 2, m: int = 4) -> torch.Tensor:
    """All maximal ``m x m`` 0/1 blocks with at most ``n`` ones in every row and column.

    Maximal: no zero could become a one without a row or column passing ``n``. Magnitudes are
    >= 0, so the best of all valid blocks is one of these; blocks with exactly ``n`` per row and
    column (90 for 2:4) are not enough: a block that keeps fewer in one row can keep more in all.

    Returns:
        ``(P, m * m)`` bool on the CPU, row-major blocks, those with the most ones first (186 patterns for
        2:4, 24 for 1:4, 184 for 3:4).
    Raises:
        ValueError if there are more than 15000 patterns (e.g. 2:6): use ``"2d_greedy"`` there.
    Example:
        >>> block_patterns(2, 4).shape
        torch.Size([186, 16])
    """
    check_nm(n, m)
    return _block_patterns(n, m).clone()


@lru_cache(maxsize=None)
def _block_patterns(n: int, m: int) -> torch.Tensor:
    # Over the limit without enumerating (seconds each): 2:6 to 5:6 (63756 and more), 1:8 (8! = 40320).
    if (m >= 6 and 1 < n < m) or (m >= 8 and 0 < n < m):
        _too_many_patterns(n, m)
    rows = [sum(1 << j for j in c) for k in range(n, -1, -1) for c in itertools.combinations(range(m), k)]
    out: list[list[int]] = []

    # Depth-first over rows. `need` holds the columns that some row with fewer than n ones lacks:
    # maximality needs each of them full (n ones) by the last row, so prune when one no longer can.
    def extend(prefix, col_counts, need):
        if len(out) > _MAX_PATTERNS:
            return
        left = m - len(prefix) - 1  # rows still to fill after this one
        for r in rows:
            cnt = [c + (r >> j & 1) for j, c in enumerate(col_counts)]
            nd = need | (~r & ((1 << m) - 1) if r.bit_count() < n else 0)
            if max(cnt) > n or any(nd >> j & 1 and cnt[j] + left < n for j in range(m)):
                continue
            if left:
                extend(prefix + [r], cnt, nd)
            else:
                out.append(prefix + [r])

    extend([], [0] * m, 0)
    if len(out) > _MAX_PATTERNS:
        _too_many_patterns(n, m)
    out.sort(key=lambda p: -sum(r.bit_count() for r in p))  # stable: fullest first, so ties keep the most
    bits = torch.tensor([[r >> j & 1 for r in p for j in range(m)] for p in out], dtype=torch.bool, device="cpu")
    return bits.view(len(out), m * m)


def _too_many_patterns(n: int, m: int):
    raise ValueError(f"2d_optimal enumerates every maximal {m}x{m} block with at most {n} per row and column; "
                     f"{n}:{m} has more "
                     f"than {_MAX_PATTERNS} such patterns: use method='2d_greedy' for {n}:{m}")


def _to_blocks(a: torch.Tensor, m: int) -> torch.Tensor:
    """(R, C) -> (R/m * C/m, m*m), each row one row-major m x m block."""
    R, C = a.shape
    return a.view(R // m, m, C // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)


def _from_blocks(b: torch.Tensor, R: int, C: int, m: int) -> torch.Tensor:
    return b.view(R // m, C // m, m, m).permute(0, 2, 1, 3).reshape(R, C)


def score_dtype(w: torch.Tensor) -> torch.dtype:
    """Dtype to score magnitudes in: fp32 at least (a fp16 product of small values underflows into ties)."""
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def mask_2d_optimal(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    R, C = w.shape
    sdt = score_dtype(w)
    pats = _block_patterns(n, m).to(w.device)
    # Patterns are scored in float64, a chunk at a time: a float32 sum rounds pattern sums that differ
    # by less than its step (e.g. 1 + k * 2^-23 entries) to ties or swaps them, so the mask kept less
    # than the optimum and a float64 copy of the same values got another mask. The float64 sums of
    # float32 / float16 / bfloat16 magnitudes are exact while a block's lie within 2^26 of each other.
    pf = pats.to(torch.float64).t().contiguous()  # (m*m, P)
    a = w.detach().abs().to(sdt)
    infinite = torch.isinf(a)
    blocks = _to_blocks(a.masked_fill(infinite, 0), m)  # (B, m*m); 0 x inf in a pattern's sum would be NaN
    inf_blocks = _to_blocks(infinite.to(sdt), m) if bool(infinite.any()) else None
    best = torch.empty(blocks.shape[0], dtype=torch.long, device=w.device)
    # Chunks bound the (B, P) score matrix: 1M blocks x 90 patterns would be 754 MB in float64.
    step = max(1, (1 << 21) // pf.shape[1])
    for i in range(0, blocks.shape[0], step):
        score = blocks[i:i + step].to(torch.float64) @ pf
        if inf_blocks is not None:  # most infinite weights first, then the finite sum
            count = inf_blocks[i:i + step].to(torch.float64) @ pf
            score = score.masked_fill(count < count.amax(-1, keepdim=True), -math.inf)
        best[i:i + step] = score.argmax(-1)  # first maximum on ties: deterministic
    return _from_blocks(pats[best], R, C, m)


def mask_2d_greedy(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    R, C = w.shape
    blocks = _to_blocks(w.detach().abs().to(score_dtype(w)), m)
    order = torch.sort(blocks, dim=-1, descending=True, stable=True).indices  # (B, m*m)
    B = blocks.shape[0]
    # int32: int8 counters wrapped (and `< n` cast n to int8) for n >= 128, pruning everything
    row_cnt = torch.zeros(B, m, dtype=torch.int32, device=w.device)
    col_cnt = torch.zeros_like(row_cnt)
    keep = torch.zeros(B, m * m, dtype=torch.bool, device=w.device)
    # Largest first: accept an entry while its row and column have room.
    for k in range(m * m):
        idx = order[:, k:k + 1]
        r, c = idx // m, idx % m
        ok = (row_cnt.gather(1, r) < n) & (col_cnt.gather(1, c) < n)
        keep.scatter_(1, idx, ok)
        row_cnt.scatter_add_(1, r, ok.to(torch.int32))
        col_cnt.scatter_add_(1, c, ok.to(torch.int32))
    return _from_blocks(keep, R, C, m)

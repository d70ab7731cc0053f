"""Better N:M masks: transposable 2-D masks, activation-aware (Wanda) scores,
SparseGPT reconstruction, calibration statistics and input-channel permutations.

Everything here is pure torch and runs on any device; the 1-D magnitude mask
lives in :mod:`sparse24.format` (``mask_nm(w, n, m)``), which dispatches every
other ``method=`` to :func:`mask_nm_method`.

Methods (``mask_nm(w, n, m, method=...)``):

* ``"magnitude"``: keep the ``n`` largest ``|w|`` of every ``m`` consecutive
  inputs (optimal for kept magnitude).
* ``"2d_greedy"`` / ``"2d_optimal"``: transposable masks: every ``m x m``
  block keeps at most ``n`` per row AND per column, so ``mask.T`` is N:M too
  (the backward pass ``grad @ W`` can use the same sparse weight).
  ``"2d_optimal"`` keeps the maximum magnitude over all valid block patterns
  (90 for 2:4); ``"2d_greedy"`` takes the largest entries first.
* ``"wanda"``: magnitude mask on ``|W_ij| * ||x_j||`` (Sun et al. 2023), needs
  ``act_norm=`` (from :func:`calibrate`).
* ``"sparsegpt"``: SparseGPT (Frantar & Alistarh 2023) mask, needs
  ``hessian=``; the mask alone discards the reconstructed weights, so use
  :func:`sparsegpt_prune` or :func:`prune_nm` to get both.

:func:`prune_nm` is the one entry point that returns the weight to store, the
mask and the kept magnitude fraction for every method.
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from .format import _check_nm, _check_weight, mask_nm

__all__ = ["METHODS", "mask_nm_method", "prune_nm", "PruneResult", "kept_magnitude_fraction", "sparsegpt_prune",
           "LayerStats", "calibrate", "block_patterns"]

METHODS = ("magnitude", "2d_greedy", "2d_optimal", "wanda", "sparsegpt")


# --- reporting -----------------------------------------------------------------

def kept_magnitude_fraction(w: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of the total ``|w|`` that ``mask`` keeps: ``sum(|w| * mask) / sum(|w|)``.

    Args:
        w: ``(R, C)`` weight (any float dtype, any device).
        mask: ``(R, C)`` bool mask.
    Returns:
        float in [0, 1] (computed in fp64); 1.0 for an all-zero ``w``.
    Example:
        >>> w = torch.tensor([[4.0, -3.0, 2.0, 1.0]])
        >>> kept_magnitude_fraction(w, mask_nm(w, 2, 4))
        0.7
    """
    if not isinstance(w, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError("w and mask must be torch.Tensors")
    if mask.shape != w.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match weight shape {tuple(w.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    a = w.detach().abs().double()
    total = float(a.sum())
    return 1.0 if total == 0 else float((a * mask).sum()) / total


@dataclass
class PruneResult:
    """What :func:`prune_nm` returns.

    Attributes:
        weight: ``(R, C)`` weight to store, zero wherever ``mask`` is False
            (``w * mask``, or SparseGPT's reconstructed weight).
        mask: ``(R, C)`` bool, N:M along rows (and along columns for 2-D methods).
        kept_fraction: :func:`kept_magnitude_fraction` of the ORIGINAL weight.
        method: the method used.
    """
    weight: torch.Tensor
    mask: torch.Tensor
    kept_fraction: float
    method: str


def prune_nm(w: torch.Tensor, n: int = 2, m: int = 4, method: str = "magnitude", calibration=None,
             **kwargs) -> PruneResult:
    """Prune one weight to N:M with any method; the single entry point for model-level code.

    Args:
        w: ``(R, C)`` float weight (not modified).
        n, m: keep ``n`` of every ``m`` along the input dimension.
        method: one of :data:`METHODS`.
        calibration: optional :class:`LayerStats` of this layer (from
            :func:`calibrate`); supplies ``act_norm`` (wanda) and ``hessian``
            (sparsegpt, collected with ``calibrate(..., hessian=True)``).
        **kwargs: method options: ``act_norm=`` ``(C,)``, ``hessian=`` ``(C, C)``,
            ``blocksize=``, ``percdamp=`` (sparsegpt).
    Returns:
        :class:`PruneResult` (``weight`` has ``w``'s dtype and device).
    Example:
        >>> r = prune_nm(torch.randn(8, 16), 2, 4, "2d_optimal")
        >>> r.mask.sum().item(), round(r.kept_fraction, 2) > 0.5
        (64, True)
    """
    kwargs = _with_calibration(method, calibration, kwargs)
    if method == "sparsegpt":
        weight, mask = sparsegpt_prune(w, n=n, m=m, **kwargs)
    else:
        mask = mask_nm(w, n, m, method=method, **kwargs)
        weight = w.detach() * mask
    return PruneResult(weight, mask, kept_magnitude_fraction(w, mask), method)


def _with_calibration(method: str, calibration, kwargs: dict) -> dict:
    """Fill ``act_norm=`` / ``hessian=`` from a :class:`LayerStats` for the methods that need them."""
    if calibration is None:
        return kwargs
    if not isinstance(calibration, LayerStats):
        raise TypeError(f"calibration must be a LayerStats (from sparse24.calibrate), got {type(calibration).__name__}")
    kwargs = dict(kwargs)
    if method == "wanda":
        kwargs.setdefault("act_norm", calibration.act_norm)
    elif method == "sparsegpt":
        if calibration.xtx is None:
            raise ValueError("method='sparsegpt' needs the input Hessian: collect it with calibrate(..., hessian=True)")
        kwargs.setdefault("hessian", calibration.hessian)
    return kwargs


# --- dispatch ------------------------------------------------------------------

def mask_nm_method(w: torch.Tensor, n: int, m: int, method: str, **kwargs) -> torch.Tensor:
    """N:M mask of ``w`` by ``method`` (called by ``sparse24.mask_nm`` for non-magnitude methods).

    Args:
        w: ``(R, C)`` float weight, ``C % m == 0`` (and ``R % m == 0`` for 2-D methods).
        n, m: keep at most ``n`` of every ``m``.
        method: ``"2d_greedy"``, ``"2d_optimal"``, ``"wanda"`` (needs
            ``act_norm=`` ``(C,)``), ``"sparsegpt"`` (needs ``hessian=`` ``(C, C)``,
            optional ``blocksize=``, ``percdamp=``) or ``"magnitude"``.
            Any method also accepts ``calibration=`` (a :class:`LayerStats`).
    Returns:
        ``(R, C)`` bool mask on ``w``'s device.
    Example:
        >>> mask = mask_nm(torch.randn(8, 8), 2, 4, method="2d_optimal")
        >>> is_nm(mask, 2, 4) and is_nm(mask.T, 2, 4)
        True
    """
    if method not in METHODS:
        raise ValueError(f"unknown mask method {method!r}; choose one of {', '.join(METHODS)}")
    kwargs = _with_calibration(method, kwargs.pop("calibration", None), kwargs)
    if method == "magnitude":
        return mask_nm(w, n, m, **kwargs)
    if method == "sparsegpt":
        return sparsegpt_prune(w, n=n, m=m, **kwargs)[1]
    if method == "wanda":
        return _mask_wanda(w, n, m, **kwargs)
    _no_kwargs(method, kwargs)
    _check_nm(n, m)
    _check_weight(w, m)
    if w.shape[0] % m != 0:
        raise ValueError(f"method={method!r} builds {m}x{m} blocks: the weight's rows ({w.shape[0]}) must be "
                         f"divisible by m={m} too, got shape {tuple(w.shape)}")
    if method == "2d_greedy":
        return _mask_2d_greedy(w, n, m)
    return _mask_2d_optimal(w, n, m)


def _no_kwargs(method: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"unexpected arguments for method={method!r}: {sorted(kwargs)}")


# --- activation-aware (Wanda) ---------------------------------------------------

def _mask_wanda(w: torch.Tensor, n: int, m: int, act_norm: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    _no_kwargs("wanda", kwargs)
    _check_weight(w, m)
    if act_norm is None:
        raise ValueError("method='wanda' needs act_norm=: a (in_features,) tensor of input-channel norms, "
                         "e.g. sparse24.calibrate(model, batches)[name].act_norm")
    act_norm = _check_vector(act_norm, w.shape[1], "act_norm")
    if bool((act_norm < 0).any()):
        raise ValueError("act_norm must be non-negative")
    # Score in fp32 at least: a fp16 product of small |w| and norms underflows
    # and would turn the score order into ties.
    sdt = torch.float64 if w.dtype == torch.float64 else torch.float32
    score = w.detach().abs().to(sdt) * act_norm.to(device=w.device, dtype=sdt)
    return mask_nm(score, n, m)


def _check_vector(v, k: int, name: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.shape != (k,):
        raise ValueError(f"{name} must have shape ({k},) (the weight's in_features), got {tuple(v.shape)}")
    if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} must be finite floating point")
    return v


# --- 2-D (transposable) masks ---------------------------------------------------

# 2d_optimal enumerates the block patterns; their number grows fast with m
# (2:4 has 90, 2:5 has 2040, 2:6 has 67950), so refuse beyond this many.
_MAX_PATTERNS = 3000


def block_patterns(n: int = 2, m: int = 4) -> torch.Tensor:
    """All ``m x m`` 0/1 blocks with exactly ``n`` ones in every row and column.

    Returns:
        ``(P, m * m)`` bool, row-major blocks, in lexicographic order of row
        choices (90 patterns for 2:4, 24 for 1:4 and 3:4).
    Raises:
        ValueError if there are more than 3000 patterns (e.g. 2:8): use
        ``"2d_greedy"`` there.
    Example:
        >>> block_patterns(2, 4).shape
        torch.Size([90, 16])
    """
    _check_nm(n, m)
    return _block_patterns(n, m).clone()


@lru_cache(maxsize=None)
def _block_patterns(n: int, m: int) -> torch.Tensor:
    if m >= 7 and 0 < n < m:  # at least m! = 5040 patterns: refuse without enumerating
        _too_many_patterns(n, m)
    rows = [sum(1 << j for j in c) for c in itertools.combinations(range(m), n)]
    out: list[list[int]] = []

    def extend(prefix, col_counts):  # depth-first, pruning columns that are full
        if len(out) > _MAX_PATTERNS:
            return
        if len(prefix) == m:
            out.append(prefix)
            return
        for r in rows:
            cnt = [c + (r >> j & 1) for j, c in enumerate(col_counts)]
            left = m - len(prefix) - 1  # rows still to fill can add at most `left` per column
            if all(c <= n and c + left >= n for c in cnt):
                extend(prefix + [r], cnt)

    extend([], [0] * m)
    if len(out) > _MAX_PATTERNS:
        _too_many_patterns(n, m)
    bits = torch.tensor([[r >> j & 1 for r in p for j in range(m)] for p in out], dtype=torch.bool)
    return bits.view(len(out), m * m)


def _too_many_patterns(n: int, m: int):
    raise ValueError(f"2d_optimal enumerates every {m}x{m} block with {n} per row and column; {n}:{m} has more "
                     f"than {_MAX_PATTERNS} such patterns: use method='2d_greedy' for {n}:{m}")


def _to_blocks(a: torch.Tensor, m: int) -> torch.Tensor:
    """(R, C) -> (R/m * C/m, m*m), each row one row-major m x m block."""
    R, C = a.shape
    return a.view(R // m, m, C // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)


def _from_blocks(b: torch.Tensor, R: int, C: int, m: int) -> torch.Tensor:
    return b.view(R // m, C // m, m, m).permute(0, 2, 1, 3).reshape(R, C)


def _score_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def _mask_2d_optimal(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    R, C = w.shape
    sdt = _score_dtype(w)
    pats = _block_patterns(n, m).to(w.device)
    pf = pats.to(sdt).t().contiguous()  # (m*m, P)
    blocks = _to_blocks(w.detach().abs().to(sdt), m)  # (B, m*m)
    best = torch.empty(blocks.shape[0], dtype=torch.long, device=w.device)
    # Chunks bound the (B, P) score matrix: 1M blocks x 90 patterns would be 377 MB.
    step = max(1, (1 << 22) // pf.shape[1])
    for i in range(0, blocks.shape[0], step):
        best[i:i + step] = (blocks[i:i + step] @ pf).argmax(-1)  # first maximum on ties: deterministic
    return _from_blocks(pats[best], R, C, m)


def _mask_2d_greedy(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    R, C = w.shape
    blocks = _to_blocks(w.detach().abs().to(_score_dtype(w)), m)
    order = torch.sort(blocks, dim=-1, descending=True, stable=True).indices  # (B, m*m)
    B = blocks.shape[0]
    row_cnt = torch.zeros(B, m, dtype=torch.int8, device=w.device)
    col_cnt = torch.zeros_like(row_cnt)
    keep = torch.zeros(B, m * m, dtype=torch.bool, device=w.device)
    # Largest first: accept an entry while its row and column have room.
    for k in range(m * m):
        idx = order[:, k:k + 1]
        r, c = idx // m, idx % m
        ok = (row_cnt.gather(1, r) < n) & (col_cnt.gather(1, c) < n)
        keep.scatter_(1, idx, ok)
        row_cnt.scatter_add_(1, r, ok.to(torch.int8))
        col_cnt.scatter_add_(1, c, ok.to(torch.int8))
    return _from_blocks(keep, R, C, m)


# --- SparseGPT ------------------------------------------------------------------

def sparsegpt_prune(w: torch.Tensor, hessian: torch.Tensor | None = None, n: int = 2, m: int = 4,
                    blocksize: int = 128, percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot N:M pruning with OBS weight reconstruction (SparseGPT, Frantar & Alistarh 2023).

    Minimizes ``||X W^T - X W'^T||`` over N:M ``W'`` approximately: columns are
    processed left to right in blocks; at the start of each group of ``m``
    columns the ``n`` kept entries per row are the largest
    ``w^2 / [H^-1]_jj^2`` (``[H^-1]`` the upper Cholesky factor of the inverse
    Hessian restricted to the columns not yet processed), and the error of
    each pruned column is compensated on the later columns.

    Args:
        w: ``(R, C)`` float weight (not modified), ``C % m == 0``.
        hessian: ``(C, C)`` ``X^T X`` of the layer's inputs (any positive
            scale), e.g. ``calibrate(model, batches, hessian=True)[name].hessian``.
        n, m: keep ``n`` of every ``m``.
        blocksize: columns per lazy-update block (a multiple of ``m``).
        percdamp: damping added to the diagonal, as a fraction of its mean.
    Returns:
        ``(new_w, mask)``: ``(R, C)`` reconstructed weight in ``w``'s dtype,
        zero where ``mask`` is False, and the ``(R, C)`` bool N:M mask.
    Example:
        >>> x = torch.randn(256, 16); w = torch.randn(8, 16)
        >>> new_w, mask = sparsegpt_prune(w, x.T @ x)
        >>> bool((new_w[~mask] == 0).all())
        True
    """
    _check_nm(n, m)
    _check_weight(w, m)
    R, C = w.shape
    if hessian is None:
        raise ValueError("method='sparsegpt' needs hessian=: the (in_features, in_features) matrix X^T X of the "
                         "layer's inputs, e.g. sparse24.calibrate(model, batches, hessian=True)[name].hessian")
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (C, C):
        got = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"hessian must be a ({C}, {C}) tensor for a weight with {C} input columns, got {got}")
    if not hessian.is_floating_point() or not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian must be finite floating point")
    if not isinstance(blocksize, int) or blocksize < m or blocksize % m:
        raise ValueError(f"blocksize must be a positive multiple of m={m}, got {blocksize!r}")
    if not percdamp > 0:
        raise ValueError(f"percdamp must be > 0, got {percdamp!r}")

    dev, wdt = w.device, (torch.float64 if w.dtype == torch.float64 else torch.float32)
    W = w.detach().to(wdt).clone()
    H = hessian.detach().to(device=dev, dtype=torch.float64).clone()
    dead = torch.diag(H) == 0  # inputs that never fire: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    H.diagonal().add_(percdamp * float(torch.diag(H).mean()))
    # Upper Cholesky factor of H^-1 (fp64 for the factorizations; the sequential
    # updates only need its rows).
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).to(wdt)
    prune = torch.zeros(R, C, dtype=torch.bool, device=dev)
    for i1 in range(0, C, blocksize):
        i2 = min(i1 + blocksize, C)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        d = torch.diag(Hinv1)
        for i in range(i2 - i1):
            if i % m == 0 and n < m:  # choose this group's mask from the updated weights
                score = W1[:, i:i + m] ** 2 / d[i:i + m] ** 2
                drop = torch.topk(score, m - n, dim=1, largest=False).indices
                prune[:, i1 + i:i1 + i + m].scatter_(1, drop, True)
            col = W1[:, i]
            err = torch.where(prune[:, i1 + i], col, torch.zeros((), dtype=wdt, device=dev)) / d[i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]  # column i itself becomes q (pruned -> 0)
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    mask = ~prune
    W[prune] = 0  # exact zeros (the update leaves rounding residue there)
    return W.to(w.dtype), mask


# --- calibration ----------------------------------------------------------------

@dataclass
class LayerStats:
    """Input statistics of one ``nn.Linear`` collected by :func:`calibrate`.

    Attributes:
        sq_sum: ``(K,)`` sum over all input rows (tokens) of ``x_j^2``.
        count: number of input rows seen (batch x sequence positions).
        xtx: ``(K, K)`` sum of ``x^T x`` or None (``calibrate(hessian=True)``).
    """
    sq_sum: torch.Tensor
    count: int = 0
    xtx: torch.Tensor | None = field(default=None, repr=False)

    @property
    def act_norm(self) -> torch.Tensor:
        """``(K,)`` RMS of each input channel, ``sqrt(sq_sum / count)``: Wanda's
        ``||x_j||_2`` up to a constant factor, which no mask depends on."""
        return (self.sq_sum / max(self.count, 1)).sqrt()

    @property
    def hessian(self) -> torch.Tensor:
        """``(K, K)`` ``X^T X / count`` (SparseGPT's Hessian up to a constant factor)."""
        if self.xtx is None:
            raise ValueError("no Hessian collected: call calibrate(..., hessian=True)")
        return self.xtx / max(self.count, 1)


def calibrate(model: nn.Module, batches, hessian: bool = False, filter_fn=None, device=None,
              dtype: torch.dtype = torch.float64) -> dict[str, LayerStats]:
    """Run ``model`` on ``batches`` and collect per-input-channel statistics of every ``nn.Linear``.

    The model runs in eval mode under ``torch.no_grad()`` (its train/eval
    flags are restored afterwards) with forward pre-hooks that are removed
    afterwards, also on error.

    Args:
        model: any module containing ``nn.Linear`` layers.
        batches: iterable of tensors (``model(b)``), tuples/lists
            (``model(*b)``) or dicts (``model(**b)``).
        hessian: also accumulate ``X^T X`` (``K x K`` per layer; needed by
            ``"sparsegpt"``; costs K^2 memory so off by default).
        filter_fn: optional ``(module, fqn) -> bool`` selecting the layers.
        device: move every tensor of a batch there first (default: leave as is).
        dtype: accumulation dtype (fp64 default; use fp32 on devices without fp64).
    Returns:
        ``{fqn: LayerStats}`` for each Linear that saw at least one input,
        ``fqn`` as in ``model.named_modules()``.
    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> stats = calibrate(net, [torch.randn(32, 8)])
        >>> stats["2"].act_norm.shape
        torch.Size([16])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    stats: dict[str, LayerStats] = {}

    def hook_for(fqn: str, k: int):
        def hook(mod, args):
            x = args[0].detach().reshape(-1, k).to(dtype)
            s = stats.get(fqn)
            if s is None:
                s = stats[fqn] = LayerStats(torch.zeros(k, dtype=dtype, device=x.device), 0,
                                            torch.zeros(k, k, dtype=dtype, device=x.device) if hessian else None)
            s.sq_sum += (x * x).sum(0)
            s.count += x.shape[0]
            if s.xtx is not None:
                s.xtx.addmm_(x.t(), x)
        return hook

    handles, modes = [], [(mod, mod.training) for mod in model.modules()]
    try:
        for fqn, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and (filter_fn is None or filter_fn(mod, fqn)):
                handles.append(mod.register_forward_pre_hook(hook_for(fqn, mod.in_features)))
        model.eval()
        with torch.no_grad():
            for b in batches:
                b = _to_device(b, device)
                if isinstance(b, dict):
                    model(**b)
                elif isinstance(b, (tuple, list)):
                    model(*b)
                else:
                    model(b)
    finally:
        for h in handles:
            h.remove()
        for mod, training in modes:
            mod.training = training
    return stats


def _to_device(b, device):
    if device is None:
        return b
    if isinstance(b, torch.Tensor):
        return b.to(device)
    if isinstance(b, dict):
        return {k: _to_device(v, device) for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        return type(b)(_to_device(v, device) for v in b)
    return b

"""Per-tensor N:M masks by method, and the one pruning entry point.

Methods (``mask_nm(w, n, m, method=...)``, re-exported as ``sparse24.mask_nm``):

* ``"magnitude"``: keep the ``n`` largest ``|w|`` of every ``m`` consecutive
  inputs (optimal for kept magnitude; :func:`sparse24.format.mask_nm`).
* ``"2d_greedy"`` / ``"2d_optimal"``: transposable masks
  (:mod:`sparse24.masks.two_d`).
* ``"wanda"``: magnitude mask on ``|W_ij| * ||x_j||`` (Sun et al. 2023), needs
  ``act_norm=`` (from :func:`sparse24.calibrate`). Scored in float64: exact for
  a float32 / 16-bit weight and a float32 ``act_norm`` (a float64 one, as
  ``calibrate``'s, rounds each product to float64's 53 bits).
* ``"sparsegpt"``: SparseGPT (Frantar & Alistarh 2023) mask, needs
  ``hessian=``; the mask alone discards the reconstructed weights, so use
  :func:`sparsegpt_prune` or :func:`prune_nm` to get both.

:func:`prune_nm` is the one entry point that returns the weight to store, the
mask and the kept magnitude fraction for every method; :class:`LayerStats` is
the per-layer calibration data it accepts (collected by
:func:`sparse24.masks.calibrate.calibrate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._checks import check_mask, check_nm, check_weight, row_chunks
from ..format import Sparse24Tensor
from ..format import mask_nm as magnitude_mask
from .sparsegpt import sparsegpt_prune
from .two_d import mask_2d_greedy, mask_2d_optimal

__all__ = ["METHODS", "mask_nm", "prune_nm", "PruneResult", "LayerStats", "kept_magnitude_fraction"]

METHODS = ("magnitude", "2d_greedy", "2d_optimal", "wanda", "sparsegpt")
# Elements per chunk of rows for the row-wise methods: their temporaries (scores, keys, |w|) stay a few MiB
# instead of ~6x the weight (a 2048x5632 fp32 Wanda prune peaked at +286 MiB for a 44 MiB weight; 1 << 20
# elements still left ~40 MiB of temporaries, 1 << 18 ~10 MiB, and took 1.01 s against 1.34 s, medians of 5
# side by side, 1 thread, loaded 2-core CPU).
_CHUNK = 1 << 18


def _row_chunks(w: torch.Tensor, multiple: int = 1) -> list[slice]:
    """Slices of ``w``'s rows of about :data:`_CHUNK` elements each (on every device: the temporaries are
    several times the block), each starting at a multiple of ``multiple`` rows."""
    return row_chunks(w.shape[0], w.shape[1], w.device, multiple, _CHUNK)


def kept_magnitude_fraction(w: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of the total ``|w|`` that ``mask`` keeps: ``sum(|w| * mask) / sum(|w|)``.

    Args:
        w: ``(R, C)`` weight (any float dtype, any device).
        mask: ``(R, C)`` bool mask.
    Returns:
        float in [0, 1] (computed in fp64); 1.0 for an all-zero ``w``; where ``w`` holds infinite
        values, the fraction of those kept.
    Example:
        >>> w = torch.tensor([[4.0, -3.0, 2.0, 1.0]])
        >>> kept_magnitude_fraction(w, sparse24.mask_nm(w, 2, 4))
        0.7
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    check_mask(mask, w)
    total = kept = 0.0
    for rows in _row_chunks(w) if w.dim() == 2 else [slice(None)]:  # fp64 sums, no copy of a large weight
        a = w[rows].detach().abs()
        total += float(a.sum(dtype=torch.float64))
        kept += float(a.masked_fill(~mask[rows], 0).sum(dtype=torch.float64))
    if math.isinf(total):  # inf / inf: the infinite magnitudes outweigh the rest, so count those
        return kept_magnitude_fraction(torch.isinf(w).to(torch.float32), mask)
    return 1.0 if total == 0 else kept / total


@dataclass
class LayerStats:
    """Input statistics of one ``nn.Linear`` collected by :func:`calibrate`.

    Attributes:
        sq_sum: ``(K,)`` sum over all input rows (tokens) of ``x_j^2``.
        count: number of input rows seen (batch x sequence positions).
        xtx: ``(K, K)`` sum of ``x^T x`` or None (``calibrate(hessian=True)``).
        xtx_teacher: ``(K, K)`` sum of ``x^T x_t``, ``x_t`` the teacher layer's
            input for the same token, or None (``calibrate(teacher=...)``).
    """
    sq_sum: torch.Tensor
    count: int = 0
    xtx: torch.Tensor | None = field(default=None, repr=False)
    xtx_teacher: torch.Tensor | None = field(default=None, repr=False)

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


@dataclass
class PruneResult:
    """What :func:`prune_nm` returns.

    Attributes:
        weight: ``(R, C)`` weight to store, zero wherever ``mask`` is False
            (``w * mask``, or SparseGPT's reconstructed weight).
        mask: ``(R, C)`` bool, N:M along rows (and along columns for 2-D methods).
        kept_fraction: :func:`kept_magnitude_fraction` of the ORIGINAL weight.
        method: the method used.
        packed: the INT4 :class:`~sparse24.format.Sparse24Tensor` when pruned with
            ``quantize="int4"`` (``weight`` is then its ``to_dense()``), else None.
    """
    weight: torch.Tensor
    mask: torch.Tensor
    kept_fraction: float
    method: str
    packed: Sparse24Tensor | None = field(default=None, repr=False)


def prune_nm(w: torch.Tensor, n: int = 2, m: int = 4, method: str = "magnitude", calibration=None,
             out: torch.Tensor | None = None, **kwargs) -> PruneResult:
    """Prune one weight to N:M with any method; the single entry point for model-level code.

    Args:
        w: ``(R, C)`` float weight (not modified, unless passed as ``out``).
        n, m: keep ``n`` of every ``m`` along the input dimension.
        method: one of :data:`METHODS`.
        calibration: optional :class:`LayerStats` of this layer (from
            :func:`calibrate`); supplies ``act_norm`` (wanda) and ``hessian``
            (sparsegpt, collected with ``calibrate(..., hessian=True)``).
        **kwargs: method options: ``act_norm=`` ``(C,)``, ``hessian=`` ``(C, C)``,
            ``blocksize=``, ``percdamp=``, ``refit=``, ``shrink=`` (sparsegpt);
            ``quantize="int4"``, ``group_size=``, ``symmetric=``: SparseGPT's joint
            INT4 quantization (:func:`sparsegpt_prune`), ``packed`` set.
        out: optional tensor of ``w``'s shape, dtype and device that receives the pruned weight
            (``w`` itself prunes in place, with no second copy of the weight); the result's ``weight`` is ``out``.
    Returns:
        :class:`PruneResult` (``weight`` has ``w``'s dtype and device).
    Example:
        >>> r = prune_nm(torch.randn(8, 16), 2, 4, "2d_optimal")
        >>> sparse24.is_nm(r.mask, 2, 4), r.mask.sum().item() <= 64, r.kept_fraction > 0.5
        (True, True, True)
    """
    check_nm(n, m)  # first: the width checks below divide by m
    kwargs = _with_calibration(method, calibration, kwargs)
    if out is not None and (not isinstance(out, torch.Tensor) or not isinstance(w, torch.Tensor)
                            or out.shape != w.shape or out.dtype != w.dtype or out.device != w.device):
        raise ValueError(f"out must be a tensor of w's shape, dtype and device, got "
                         f"{(tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else out}")
    weight = None
    if kwargs.get("quantize") is not None and method != "sparsegpt":
        raise ValueError(f"quantize= while pruning is SparseGPT's joint quantization (method='sparsegpt'), got "
                         f"method={method!r}; to round another method's 2:4 weight to nearest use "
                         "sparse24.compress(weight, mask, quantize='int4')")
    if kwargs.get("quantize") is not None:  # method is "sparsegpt" (checked above)
        packed = sparsegpt_prune(w, n=n, m=m, **kwargs)
        mask = packed.kept_mask()
        kept = kept_magnitude_fraction(w, mask)  # of the original: before out (maybe w) is written
        weight = packed.to_dense()
        if out is not None:
            with torch.no_grad():
                weight = out.copy_(weight).detach()
        return PruneResult(weight, mask, kept, method, packed)
    if method == "sparsegpt":
        weight, mask = sparsegpt_prune(w, n=n, m=m, **kwargs)
    elif method in ("magnitude", "wanda") and isinstance(w, torch.Tensor) and w.dim() == 2:
        check_weight(w, m)  # row by row below: the same mask, bounded temporaries
        mask = torch.empty(w.shape, dtype=torch.bool, device=w.device)
        for rows in _row_chunks(w):
            mask[rows] = mask_nm(w[rows], n, m, method=method, **kwargs)
    else:
        mask = mask_nm(w, n, m, method=method, **kwargs)
    kept = kept_magnitude_fraction(w, mask)  # of the original: before out (maybe w) is written
    with torch.no_grad():
        if out is None:
            # where, not w * mask: a pruned infinite weight would become NaN (inf * 0); and no ~mask temporary
            weight = torch.where(mask, w.detach(), 0) if weight is None else weight
        elif weight is None:
            for rows in _row_chunks(w) if w.dim() == 2 else [slice(None)]:  # w * mask, no weight-sized temporary
                out[rows] = w.detach()[rows].masked_fill(~mask[rows], 0)
        else:
            out.copy_(weight)
    return PruneResult(out.detach() if out is not None else weight, mask, kept, method)


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


# --- dispatch ---------------------------------------------------------------------

def mask_nm(w: torch.Tensor, n: int = 2, m: int = 4, method: str = "magnitude", **kwargs) -> torch.Tensor:
    """N:M mask of ``w`` by ``method`` (``sparse24.mask_nm``).

    Args:
        w: ``(R, C)`` float weight, ``C % m == 0`` (and ``R % m == 0`` for 2-D methods).
        n, m: keep at most ``n`` of every ``m``.
        method: ``"magnitude"`` (the default: keep the ``n`` largest ``|w|`` of
            every ``m``, :func:`sparse24.format.mask_nm`), ``"2d_greedy"``,
            ``"2d_optimal"``, ``"wanda"`` (needs
            ``act_norm=`` ``(C,)``), ``"sparsegpt"`` (needs ``hessian=`` ``(C, C)``,
            optional ``blocksize=``, ``percdamp=``).
            Any method also accepts ``calibration=`` (a :class:`LayerStats`).
    Returns:
        ``(R, C)`` bool mask on ``w``'s device.
    Example:
        >>> mask = mask_nm(torch.randn(8, 8), 2, 4, method="2d_optimal")
        >>> sparse24.is_nm(mask, 2, 4) and sparse24.is_nm(mask.T, 2, 4)
        True
    """
    if method not in METHODS:
        raise ValueError(f"unknown mask method {method!r}; choose one of {', '.join(METHODS)}")
    check_nm(n, m)
    kwargs = _with_calibration(method, kwargs.pop("calibration", None), kwargs)
    if method == "magnitude":
        _no_kwargs(method, kwargs)
        return magnitude_mask(w, n, m)
    if method == "sparsegpt":
        if kwargs.get("quantize") is not None:
            raise ValueError("mask_nm returns a mask only: for SparseGPT's joint INT4 quantization call "
                             "sparsegpt_prune(..., quantize='int4') or prune_nm(..., quantize='int4')")
        return sparsegpt_prune(w, n=n, m=m, **kwargs)[1]
    if method == "wanda":
        return _mask_wanda(w, n, m, **kwargs)
    _no_kwargs(method, kwargs)
    check_weight(w, m)
    if bool(torch.isnan(w).any()):  # (as magnitude_mask: NaN has no magnitude order)
        raise ValueError("weight contains NaN: no magnitude order exists")
    if w.shape[0] % m != 0:
        raise ValueError(f"method={method!r} builds {m}x{m} blocks: the weight's rows ({w.shape[0]}) must be "
                         f"divisible by m={m} too, got shape {tuple(w.shape)}")
    # In bands of m rows (whole m x m blocks, each masked on its own values: the identical mask): the whole
    # weight's temporaries (|w| in fp32, (blocks, m*m) copies, int64 sort indices) peaked at 6.5-8.7x a bf16 weight
    fn = mask_2d_greedy if method == "2d_greedy" else mask_2d_optimal
    mask = torch.empty(w.shape, dtype=torch.bool, device=w.device)
    for rows in _row_chunks(w, m):
        mask[rows] = fn(w[rows], n, m)
    return mask


def _no_kwargs(method: str, kwargs: dict) -> None:
    if kwargs:
        raise TypeError(f"unexpected arguments for method={method!r}: {sorted(kwargs)}")


# --- activation-aware (Wanda) ---------------------------------------------------

def _mask_wanda(w: torch.Tensor, n: int, m: int, act_norm: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    _no_kwargs("wanda", kwargs)
    check_weight(w, m)
    if act_norm is None:
        raise ValueError("method='wanda' needs act_norm=: a (in_features,) tensor of input-channel norms, "
                         "e.g. sparse24.calibrate(model, batches)[name].act_norm")
    act_norm = _check_vector(act_norm, w.shape[1], "act_norm")
    if bool((act_norm < 0).any()):
        raise ValueError("act_norm must be non-negative")
    # Scored in float64: a float32 product of a float32 (or 16-bit) weight and a float32 norm rounds, so
    # scores that differ below its step tied and the lower column won, and a float64 copy of the same
    # values got another mask; in float64 those products are exact. Row chunks bound the temporaries.
    act = act_norm.to(device=w.device, dtype=torch.float64)
    dead = act == 0
    mask = torch.empty(w.shape, dtype=torch.bool, device=w.device)
    for rows in _row_chunks(w):
        score = w.detach()[rows].abs().to(torch.float64).mul_(act)
        # A dead input channel scores 0 even under an infinite weight (inf * 0 would read as NaN)
        mask[rows] = magnitude_mask(score.masked_fill_(dead, 0), n, m)
    return mask


def _check_vector(v, k: int, name: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.shape != (k,):
        raise ValueError(f"{name} must have shape ({k},) (the weight's in_features), got {tuple(v.shape)}")
    if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} must be finite floating point")
    return v

"""INT8 for 2:4 weights: symmetric per-output-row quantization of the kept
values (the 2-bit slots are unchanged), and an SQNR helper.

Storage of an ``(R, C)`` INT8 2:4 weight: ``R * C/2`` int8 values plus
``R * C/2`` 2-bit slots = ``0.625 * R * C`` bytes, i.e. exactly 62.5% of the
dense int8 matrix (``p.nbytes / p.dense_nbytes``); the ``(R,)`` float32
scales (``p.scale_nbytes``, 4 bytes per row) are reported separately.
"""
from __future__ import annotations

import math

import torch

from .format import Sparse24Tensor

__all__ = ["quantize_values", "sqnr_db", "QUANT_MODES"]

QUANT_MODES = ("int8",)
_QMAX = 127  # symmetric: -128 is never used, so negation cannot overflow


def quantize_values(p: Sparse24Tensor, mode: str = "int8") -> Sparse24Tensor:
    """Quantize the kept values of a 2:4 weight to int8 with one scale per output row.

    ``scale[r] = max_j |values[r, j]| / 127`` (computed in float32; 1.0 for an
    all-zero row), ``q = round(values / scale)`` (half to even), clamped to
    [-127, 127]. The dequantized weight is ``q * scale[r]``; its error per
    kept value is at most ``scale[r] / 2``.

    Args:
        p: unquantized :class:`Sparse24Tensor` ``(R, C)`` (any float dtype, any device).
        mode: ``"int8"``.
    Returns:
        A new :class:`Sparse24Tensor`: ``values`` int8 ``(R, C/2)``, the same
        ``meta`` tensor (shared, not copied), ``scale`` float32 ``(R,)``, the
        logical dtype of ``p`` (what ``to_dense()`` returns).
    Raises:
        TypeError: ``p`` is not a Sparse24Tensor, or ``mode`` is not a string.
        ValueError: unknown mode, ``p`` already quantized, non-finite values.
    Example:
        >>> q = quantize_values(sparse24.compress(torch.randn(8, 32)), "int8")
        >>> q.values.dtype, q.scale.shape, q.nbytes / q.dense_nbytes
        (torch.int8, torch.Size([8]), 0.625)
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"quantize_values needs a Sparse24Tensor (see sparse24.compress), got {type(p).__name__}")
    if not isinstance(mode, str):
        raise TypeError(f"quantization mode must be a string, one of {QUANT_MODES}, got {type(mode).__name__}")
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; supported: {', '.join(map(repr, QUANT_MODES))}")
    if p.scale is not None:
        raise ValueError("this Sparse24Tensor is already quantized (it has scales); quantize the float weight instead")
    v = p.values.float()
    if not bool(torch.isfinite(v).all()):
        raise ValueError("cannot quantize: the weight has non-finite (inf/NaN) kept values")
    amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(v / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return Sparse24Tensor(q, p.meta, p.shape, p.dtype, scale, check=False)


def sqnr_db(reference, approx) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum ref^2 / sum (ref - approx)^2)`` in dB.

    Args:
        reference, approx: tensors of one shape, or :class:`Sparse24Tensor`
            (compared densely, e.g. a float 2:4 weight and its INT8 version).
            Computed in float64.
    Returns:
        dB as a float; ``inf`` when they are equal. Each bit of precision is
        about 6.02 dB (8-bit uniform quantization of a full-range signal: ~50 dB).
    Example:
        >>> p = sparse24.compress(torch.randn(64, 256))
        >>> sqnr_db(p, quantize_values(p)) > 30
        True
    """
    ref, app = (_dense64(t, name) for t, name in ((reference, "reference"), (approx, "approx")))
    if ref.shape != app.shape:
        raise ValueError(f"sqnr_db needs equal shapes, got reference {tuple(ref.shape)} and approx {tuple(app.shape)}")
    noise = float(((ref - app.to(ref.device)) ** 2).sum())
    signal = float((ref ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _dense64(t, name: str) -> torch.Tensor:
    if isinstance(t, Sparse24Tensor):
        return t.to_dense().double()
    if isinstance(t, torch.Tensor):
        return t.detach().double()
    raise TypeError(f"sqnr_db: {name} must be a tensor or Sparse24Tensor, got {type(t).__name__}")

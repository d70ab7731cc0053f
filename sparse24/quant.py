"""INT8 for 2:4 weights: symmetric per-output-row quantization of the kept
values (the 2-bit slots are unchanged), and an SQNR helper. The quantizer
itself lives beside the format it produces (``sparse24.format.quantize_values``,
so ``compress(w, quantize="int8")`` needs nothing above it); it is re-exported here.

Storage of an ``(R, C)`` INT8 2:4 weight: ``R * C/2`` int8 values plus
``R * C/2`` 2-bit slots = ``0.625 * R * C`` bytes, i.e. exactly 62.5% of the
dense int8 matrix (``p.nbytes / p.dense_nbytes``); the ``(R,)`` float32
scales (``p.scale_nbytes``, 4 bytes per row) are reported separately.
"""
from __future__ import annotations

import math

import torch

from ._checks import refuse_meta
from .format import QUANT_MODES, Sparse24Tensor, quantize_values

__all__ = ["quantize_values", "sqnr_db", "QUANT_MODES"]


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
    for t, name in ((ref, "reference"), (app, "approx")):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"sqnr_db: {name} has NaN or infinite values (an overflow?)")
    noise = float(((ref - app.to(ref.device)) ** 2).sum())
    signal = float((ref ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0 or signal / noise == 0:   # (the ratio can underflow: 1e-320 / 1e20)
        return -math.inf
    return 10 * math.log10(signal / noise)


def _dense64(t, name: str) -> torch.Tensor:
    if isinstance(t, Sparse24Tensor):
        return t.to_dense().double()
    if isinstance(t, torch.Tensor):
        refuse_meta(t, f"sqnr_db: {name}")
        return t.detach().double()
    raise TypeError(f"sqnr_db: {name} must be a tensor or Sparse24Tensor, got {type(t).__name__}")

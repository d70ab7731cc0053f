"""Preparing a swap: every check and computation of turning an ``nn.Linear``
(or Hugging Face ``Conv1D``) into a :class:`~sparse24.nn.Sparse24Linear`,
done before anything changes (so whole-model calls can prepare every layer
first and stay all or nothing), and the byte counts reported for it."""
from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn

from .._checks import check_finite
from ..format import FLOAT_DTYPES, Sparse24Tensor, _check_mask24, compress
from ..masks import METHODS, mask_nm, prune_nm
from .sharded import is_dtensor

__all__ = ["MODES", "QUANTIZE", "is_conv1d", "is_conv1d_class", "linear_shape", "compressed_nbytes", "memory_nbytes"]

MODES = ("masked", "compressed")
QUANTIZE = (None, "int8")


def _check_mode(mode, quantize, trainable_values) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if mode == "masked" and quantize is not None:
        raise ValueError("quantize applies to mode='compressed' (masked mode trains the dense weight); "
                         "compress afterwards with to_compressed(quantize=...) / sparse24.compress_")
    if trainable_values and (mode != "compressed" or quantize is not None):
        raise ValueError("trainable_values needs mode='compressed' with floating values (quantize=None)")


def is_conv1d(module) -> bool:
    """True for Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2 and relatives): a
    Linear whose weight is stored transposed, ``(in_features, out_features)``. Detected
    without importing transformers (a Conv1D exists only once transformers is imported)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def linear_shape(module) -> tuple[int, int]:
    """``(out_features, in_features)`` of an ``nn.Linear``, a Hugging Face ``Conv1D`` or a
    :class:`Sparse24Linear`."""
    if is_conv1d(module):
        C, R = module.weight.shape
        return R, C
    return module.out_features, module.in_features


def _linear_weight(layer) -> torch.Tensor:
    """The ``(R, C)`` weight of an ``nn.Linear`` or ``Conv1D`` (a transposed view for Conv1D), detached."""
    w = layer.weight.detach()
    return w.t() if is_conv1d(layer) else w


# Methods that need nothing but the weight, so a layer on the meta device can defer its mask.
_DEFERRABLE = ("magnitude", "2d_greedy", "2d_optimal")


def _prune_weight(weight: torch.Tensor, method: str = "magnitude", calibration=None,
                  **mask_kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
    """2:4-prune one weight with ``method`` (nothing is modified).

    Returns ``(new_weight, mask)``: ``(R, C)`` bool mask and, for methods that
    also reconstruct the kept weights (SparseGPT), the ``(R, C)`` weight to
    store; ``None`` when that is just ``weight * mask`` (no copy kept).
    """
    w = weight.detach()
    if method == "magnitude" and calibration is None:  # the mask is all: no weight copy, no report
        return None, mask_nm(w, 2, 4, **mask_kwargs)
    r = prune_nm(w, 2, 4, method=method, calibration=calibration, **mask_kwargs)
    return (None if torch.equal(r.weight, w * r.mask) else r.weight), r.mask


class _Prepared(NamedTuple):
    """What :func:`_prepare` computed for one layer: the weight to store when a method
    reconstructs it (else None), the ``(R, C)`` mask, the compressed weight (compressed
    mode) and, on the meta device, the pending mask method (``{"method", "kwargs"}``)."""
    new_w: torch.Tensor | None
    mask: torch.Tensor
    p: Sparse24Tensor | None
    pending: dict | None = None


def _placeholder(R: int, C: int, dtype, quantize, device) -> Sparse24Tensor:
    """A compressed weight of the right shapes and dtypes, values not yet known (meta device, or
    pending after ``to_empty``)."""
    values = torch.empty(R, C // 2, dtype=torch.int8 if quantize else dtype, device=device)
    meta = torch.zeros((C + 31) // 32, R, dtype=torch.int32, device=device)
    scale = torch.ones(R, dtype=torch.float32, device=device) if quantize else None
    return Sparse24Tensor(values, meta, (R, C), dtype, scale, check=False)


def _check_deferrable(method, calibration, mask_kwargs, R) -> dict:
    if method not in METHODS:
        raise ValueError(f"unknown mask method {method!r}; choose one of {', '.join(METHODS)}")
    if method not in _DEFERRABLE or calibration is not None or mask_kwargs:
        raise ValueError(f"the weight is on the meta device (no values yet), so the mask is computed when the "
                         f"weights are loaded; method={method!r}" + (" with options" if mask_kwargs else "")
                         + f" cannot wait for that: use one of {', '.join(_DEFERRABLE)}, or sparsify the "
                         "model once it holds its weights (calibration needs them anyway)")
    if method != "magnitude" and R % 4:
        raise ValueError(f"method={method!r} builds 4x4 blocks: the weight's rows ({R}) must be divisible by 4")
    return {"method": method, "kwargs": {}}


def _prepare(linear, mask, mode, method, quantize, calibration, trainable_values, mask_kwargs) -> _Prepared:
    """Validate and compute a swap of ``linear`` (an ``nn.Linear`` or Hugging Face ``Conv1D``)
    without changing anything."""
    if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
        raise TypeError(f"expected an nn.Linear (or a transformers Conv1D), got {type(linear).__name__}")
    _check_mode(mode, quantize, trainable_values)
    w = linear.weight
    if not isinstance(w, nn.Parameter):
        raise ValueError(f"the Linear's weight is a computed tensor ({type(w).__name__}, e.g. a "
                         "parametrization such as SR-STE or weight_norm); remove it first")
    if is_dtensor(w):
        raise ValueError("the Linear's weight is already sharded (a DTensor: fully_shard or tensor parallel ran "
                         "first): sparsify before sharding (sparsify_(model), then fully_shard), so that each "
                         "mask is computed from the whole weight and sharded with it")
    R, C = linear_shape(linear)
    if C % 4:
        raise ValueError(f"in_features ({C}) must be divisible by 4 for 2:4 sparsity")
    w = _linear_weight(linear)
    if w.is_meta:
        if mask is not None:
            raise ValueError("the weight is on the meta device: give no mask (it is computed when the weights "
                             "are loaded), or build the layer from real weights")
        pending = _check_deferrable(method, calibration, mask_kwargs, R)
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"weight must be floating point, got {w.dtype}")
        p = _placeholder(R, C, w.dtype, quantize, "meta") if mode == "compressed" else None
        return _Prepared(None, torch.empty(R, C, dtype=torch.bool, device="meta"), p, pending)
    check_finite(w)
    if mask is None:
        new_w, mask = _prune_weight(w, method, calibration, **mask_kwargs)
    else:
        if method != "magnitude" or calibration is not None or mask_kwargs:
            raise ValueError("give either a mask or a method (with its options), not both")
        new_w, mask = None, _check_mask24(mask, w).clone()
    p = None
    if mode == "compressed":
        p = compress(w if new_w is None else new_w, mask, quantize=quantize)
    return _Prepared(new_w, mask, p)


def _mask_from_slots(p: Sparse24Tensor) -> torch.Tensor:
    """``(R, C)`` bool, True at the two stored slots of every group."""
    R, C = p.shape
    keep = torch.zeros(R, C // 4, 4, dtype=torch.bool, device=p.device)
    keep.scatter_(-1, p.slots(), True)
    return keep.view(R, C)


def is_conv1d_class(cls) -> bool:
    """True for the Hugging Face ``Conv1D`` class (see :func:`is_conv1d`)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(cls, type) and issubclass(cls, utils.Conv1D)


def compressed_nbytes(out_features: int, in_features: int, element_size: int, quantized: bool = False) -> int:
    """Bytes of a compressed ``(R, C)`` weight: values + 2-bit indices (+ fp32 scales if INT8)."""
    R, C = out_features, in_features
    half = R * (C // 2)
    return half * (1 if quantized else element_size) + half * 2 // 8 + (4 * R if quantized else 0)


def memory_nbytes(mod) -> int:
    """Bytes a :class:`~sparse24.nn.Sparse24Linear` holds for its weight now (masked: dense weight + bool mask)."""
    if mod.mode == "masked":
        return mod.weight.numel() * mod.weight.element_size() + mod.mask.numel()
    return sum(t.numel() * t.element_size() for t in (mod.values, mod.meta, mod.scale) if t is not None)

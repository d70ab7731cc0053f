"""Preparing a swap: every check and computation of turning an ``nn.Linear``
(or Hugging Face ``Conv1D``) into a :class:`~sparse24.nn.Sparse24Linear`,
done before anything changes (so whole-model calls can prepare every layer
first and stay all or nothing), and the byte counts reported for it."""
from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import nn
from torch.sparse import SparseSemiStructuredTensor

from .._checks import check_bool, check_finite, row_chunks
from .._linears import is_conv1d, is_conv1d_class, linear_shape
from ..format import FLOAT_DTYPES, Sparse24Tensor, _check_mask24, compress, int4_options, is_nm
from ..masks import METHODS, mask_nm, prune_nm
from .sharded import is_dtensor

__all__ = ["MODES", "QUANTIZE", "quant_options", "describe_quant", "is_conv1d", "is_conv1d_class", "linear_shape",
           "compressed_nbytes", "memory_nbytes"]

MODES = ("masked", "compressed")
QUANTIZE = (None, "int8", "int4")


def quant_options(quantize=None, group_size=None, symmetric=None) -> dict:
    """Check a quantization setting; return it as :func:`sparse24.compress` takes it.

    Args:
        quantize: ``None``, ``"int8"`` or ``"int4"``.
        group_size: INT4 only: 32, 64 or 128 (default 128).
        symmetric: INT4 only: ``False`` stores per-group zero points (default True).
    Returns:
        ``{}``, ``{"quantize": "int8"}`` or ``{"quantize": "int4", "group_size": g, "symmetric": s}``.
    Example:
        >>> quant_options("int4", group_size=64)
        {'quantize': 'int4', 'group_size': 64, 'symmetric': True}
    """
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if quantize != "int4":
        if group_size is not None or symmetric is not None:
            raise ValueError(f"group_size and symmetric apply to quantize='int4', got quantize={quantize!r}")
        return {} if quantize is None else {"quantize": quantize}
    group_size, symmetric = int4_options(group_size, symmetric)  # the check sparse24.compress makes too
    return {"quantize": "int4", "group_size": group_size, "symmetric": symmetric}


def describe_quant(quant: dict) -> str:
    """:func:`quant_options` in words: ``quantize=None``, ``quantize=int4, group_size=128, symmetric=True``."""
    return ", ".join(f"{k}={v}" for k, v in ({"quantize": None} | quant).items())


def _check_mode(mode, quantize, trainable_values, group_size=None, symmetric=None) -> dict:
    """Check a mode, its quantization and ``trainable_values``; return :func:`quant_options`."""
    # (nn.Parameter takes only a bool: 0, None failed after the layer had let go of its weight; numpy's bools
    # are bools, converted where used)
    check_bool(trainable_values, "trainable_values")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    quant = quant_options(quantize, group_size, symmetric)
    if mode == "masked" and quantize is not None:
        raise ValueError("quantize applies to mode='compressed' (masked mode trains the dense weight); "
                         "compress afterwards with to_compressed(quantize=...) / sparse24.compress_")
    if trainable_values and (mode != "compressed" or quantize is not None):
        raise ValueError("trainable_values needs mode='compressed' with floating values (quantize=None)")
    return quant


def check_finite_bias(bias: torch.Tensor | None) -> None:
    """ValueError for a bias with NaN or inf (load_state_dict refuses a checkpoint holding one, so a layer
    made from it could not be saved and loaded back); None passes."""
    if bias is not None:
        check_finite(bias.detach(), "bias", "it would spread to every output, and load_state_dict refuses "
                     "a checkpoint holding it")


def _linear_weight(layer) -> torch.Tensor:
    """The ``(R, C)`` weight of an ``nn.Linear`` or ``Conv1D`` (a transposed view for Conv1D), detached."""
    w = layer.weight.detach()
    return w.t() if is_conv1d(layer) else w


# Methods that need nothing but the weight, so a layer on the meta device can defer its mask.
_DEFERRABLE = ("magnitude", "2d_greedy", "2d_optimal")


def _prune_weight(weight: torch.Tensor, method: str = "magnitude", calibration=None,
                  **mask_kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
    """2:4-prune one weight with ``method`` (nothing is modified).

    The magnitude mask of a weight already at most 2:4 (no group of 4 inputs holds more than 2
    non-zeros: pruned to 1:4, 2:8, 1:8 by ``prune_layerwise_`` or ``GradualPruner``) is
    exactly its non-zeros: the slots a full 2:4 mask would add hold zeros that retraining would
    grow back (1:4 silently becoming 2:4). That holds row by row for the rows with a non-zero in
    every 8 inputs (the sparsest pattern kept is 1:8), inputs zero in every row aside (dead
    inputs, whose columns SparseGPT zeroes). An all-zero row, and the rows of an identity (or
    permutation) weight, at most one non-zero per row and column (a fresh ``zeros_`` / ``eye_``
    init, not a pruned one), get the plain 2:4 mask, which keeps their non-zeros and fills each
    group to 2, so that the layer can train. Any other weight gets the plain 2:4 magnitude mask.
    A meta-device layer computes its pending mask here too, when its weights are loaded.
    :func:`sparser_note` says when a mask keeps fewer than 2 of 4.

    Returns ``(new_weight, mask)``: ``(R, C)`` bool mask and, for methods that
    also reconstruct the kept weights (SparseGPT), the ``(R, C)`` weight to
    store; ``None`` when that is just ``weight * mask`` (no copy kept).
    """
    w = weight.detach()
    if method == "magnitude" and calibration is None:  # the mask is all: no weight copy, no report
        mask = mask_nm(w, 2, 4, **mask_kwargs)
        return None, (torch.where(_pruned_rows(w), mask & (w != 0), mask) if is_nm(w, 2, 4) else mask)
    r = prune_nm(w, 2, 4, method=method, calibration=calibration, **mask_kwargs)
    return (None if torch.equal(r.weight, w * r.mask) else r.weight), r.mask


def _pruned_rows(w: torch.Tensor) -> torch.Tensor:
    """``(R, 1)`` bool: the pruned rows of ``w`` (``(R, C)``, ``C % 4 == 0``), whose non-zeros the mask keeps
    exactly: a non-zero in every group of 8 inputs (a last lone group of 4 on its own) that is not zero in
    every row. A group zero in every row holds inputs pruned as a whole (SparseGPT zeroes a dead input's
    column), no sign of a fresh row. Not pruned: an all-zero row, and every row of an identity (or
    permutation) weight, which would pass where it has few live groups (8 or fewer rows or columns)."""
    R, C = w.shape
    nz = w != 0
    # counted a block of rows at a time: a bool sum casts the whole (R, C) mask to int64 first (4x a bf16 weight)
    cols, lone = torch.zeros(C, dtype=torch.int32, device=w.device), True
    for rows in row_chunks(R, C, w.device):
        cols += nz[rows].sum(0, dtype=torch.int32)
        lone = lone and bool((nz[rows].sum(1, dtype=torch.int32) <= 1).all())
    if lone and bool((cols <= 1).all()):  # at most one per row and column
        return torch.zeros(R, 1, dtype=torch.bool, device=w.device)
    nz4 = nz.reshape(R, C // 4, 4).any(-1)
    if nz4.shape[1] % 2:
        nz4 = torch.cat([nz4, nz4[:, -1:]], 1)
    nz8 = nz4.view(R, nz4.shape[1] // 2, 2).any(-1)   # (R, groups of 8); no -1: R may be 0
    live = nz8.any(0, keepdim=True)                    # a non-zero in some row
    return (nz8 | ~live).all(-1, keepdim=True) & nz8.any(-1, keepdim=True)


def sparser_note(mask: torch.Tensor) -> str:
    """A report note when the ``(R, C)`` 2:4 ``mask`` keeps fewer than 2 of some groups of 4 (a weight
    already pruned sparser than 2:4 keeps exactly its non-zeros), else ``""``."""
    R, C = mask.shape
    # Counted a block of rows at a time, in uint8: a bool sum defaults to int64, 8 B per group (4x a bf16
    # weight's bytes, the peak of sparsify_), and even a uint8 sum of the whole mask copies it first.
    fewer = sum(int(torch.count_nonzero(mask[rows].reshape(-1, 4).sum(-1, dtype=torch.uint8) < 2))
                for rows in row_chunks(R, C, mask.device))
    if not fewer:
        return ""
    return (f"the mask keeps fewer than 2 of 4 in {fewer} of {mask.numel() // 4} groups "
            f"({int(torch.count_nonzero(mask))} of {mask.numel()} weights): the weight's non-zeros, it was "
            "already sparser than 2:4")


class _Prepared(NamedTuple):
    """What :func:`_prepare` computed for one layer: the weight to store when a method
    reconstructs it (else None), the ``(R, C)`` mask, the compressed weight (compressed
    mode) and, on the meta device, the pending mask method (``{"method", "kwargs"}``)."""
    new_w: torch.Tensor | None
    mask: torch.Tensor
    p: Sparse24Tensor | None
    pending: dict | None = None


def _placeholder(R: int, C: int, dtype, quant: dict, device) -> Sparse24Tensor:
    """A compressed weight of the right shapes and dtypes (``quant``: :func:`quant_options`),
    values not yet known (meta device, or pending after ``to_empty``)."""
    meta = torch.zeros((C + 31) // 32, R, dtype=torch.int32, device=device)
    if quant.get("quantize") == "int4":
        g = quant["group_size"]
        groups = -(-C // g)
        values = torch.empty(R, C // 4, dtype=torch.uint8, device=device)
        scale = torch.ones(R, groups, dtype=torch.float16, device=device)
        zero = None if quant["symmetric"] else torch.zeros(R, groups, dtype=torch.uint8, device=device)
        return Sparse24Tensor(values, meta, (R, C), dtype, scale, zero=zero, group_size=g, check=False)
    values = torch.empty(R, C // 2, dtype=torch.int8 if quant else dtype, device=device)
    scale = torch.ones(R, dtype=torch.float32, device=device) if quant else None
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


def _pattern_2_4(mask_kwargs: dict) -> dict:
    """``mask_kwargs`` without ``n=`` / ``m=``: the spelling of every other pattern-taking call is
    accepted for 2:4, the one pattern a Sparse24Linear stores; any other is a ValueError."""
    n, m = mask_kwargs.get("n", 2), mask_kwargs.get("m", 4)
    if not (type(n) is int and type(m) is int and (n, m) == (2, 4)):
        raise ValueError(f"Sparse24Linear stores 2:4, got n={n!r}, m={m!r}: for a sparser mask prune first "
                         "(prune_layerwise_ or GradualPruner), then sparsify_, whose magnitude mask keeps exactly "
                         "the non-zeros left (patterns down to 1:8); or pass from_linear a mask= keeping at most 2 "
                         "of every 4")
    return {k: v for k, v in mask_kwargs.items() if k not in ("n", "m")}


def _prepare(linear, mask, mode, method, quant: dict, calibration, trainable_values, mask_kwargs) -> _Prepared:
    """Validate and compute a swap of ``linear`` (an ``nn.Linear`` or Hugging Face ``Conv1D``)
    without changing anything. ``quant``: :func:`quant_options`."""
    if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
        raise TypeError(f"expected an nn.Linear (or a transformers Conv1D), got {type(linear).__name__}")
    mask_kwargs = _pattern_2_4(mask_kwargs)
    _check_mode(mode, quant.get("quantize"), trainable_values, quant.get("group_size"), quant.get("symmetric"))
    w = linear.weight
    if isinstance(w, SparseSemiStructuredTensor):  # (torch's op table refuses the reads below, naming no layer)
        raise ValueError(f"the Linear's weight is torch's own 2:4 format ({type(w).__name__}): make it dense "
                         "first, linear.weight = nn.Parameter(linear.weight.to_dense()) (pruning a 2:4 weight by "
                         "magnitude keeps its non-zeros), or read it as a Sparse24Tensor with "
                         "sparse24.from_semi_structured(linear.weight)")
    if not isinstance(w, nn.Parameter):
        raise ValueError(f"the Linear's weight is a computed tensor ({type(w).__name__}, e.g. a "
                         "parametrization such as SR-STE or weight_norm); remove it first")
    if is_dtensor(w):
        raise ValueError("the Linear's weight is already sharded (a DTensor: fully_shard or tensor parallel ran "
                         "first): sparsify before sharding (sparsify_(model), then fully_shard), so that each "
                         "mask is computed from the whole weight and sharded with it. Tensor parallelism "
                         "(parallelize_module's ColwiseParallel / RowwiseParallel, which take only nn.Linear) "
                         "is not supported for 2:4 layers: shard them with FSDP2 (docs/distributed.md)")
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
        p = _placeholder(R, C, w.dtype, quant, "meta") if mode == "compressed" else None
        return _Prepared(None, torch.empty(R, C, dtype=torch.bool, device="meta"), p, pending)
    check_finite(w)
    check_finite_bias(linear.bias)
    if mask is None:
        new_w, mask = _prune_weight(w, method, calibration, **mask_kwargs)
    else:
        if method != "magnitude" or calibration is not None or mask_kwargs:
            raise ValueError("give either a mask or a method (with its options), not both")
        new_w, mask = None, _check_mask24(mask, w).clone()
    p = None
    if mode == "compressed":
        p = compress(w if new_w is None else new_w, mask, **quant)
    return _Prepared(new_w, mask, p)


def compressed_nbytes(out_features: int, in_features: int, element_size: int, quantized=False,
                      group_size: int | None = None, symmetric: bool = True) -> int:
    """Bytes of a compressed ``(R, C)`` weight: values + 2-bit indices + scales.

    Args:
        out_features, in_features: ``R`` and ``C``, ints >= 0 (``C`` divisible by 4).
        element_size: bytes per unquantized value (2 for bfloat16), an int >= 1.
        quantized: False/None, ``"int8"`` (or True: one byte per kept value, fp32 scale per
            row) or ``"int4"`` (half a byte per kept value, an fp16 scale per row and ``group_size``
            columns, and a uint8 zero point beside it unless ``symmetric``).
        group_size, symmetric: INT4's (``group_size`` 32, 64 or 128; ``symmetric`` a bool).
    Returns:
        The byte count (an int), as :attr:`sparse24.Sparse24Tensor.nbytes` counts it.
    """
    for name, v, low in (("out_features", out_features, 0), ("in_features", in_features, 0),
                         ("element_size", element_size, 1)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if in_features % 4:
        raise ValueError(f"in_features must be divisible by 4 (2:4 groups), got {in_features}")
    if not (quantized is None or isinstance(quantized, bool)
            or isinstance(quantized, str) and quantized in ("int8", "int4")):
        raise ValueError(f"quantized must be False, None, True, 'int8' or 'int4', got {quantized!r}")
    R, C = int(out_features), int(in_features)
    half = R * (C // 2)
    slots = (R * C + 7) // 8   # 2 bits per kept value (as Sparse24Tensor.nbytes counts them)
    if quantized == "int4":
        group_size, symmetric = int4_options(group_size, symmetric)   # None: the defaults, as compress takes
        groups = R * -(-C // group_size)
        return half // 2 + slots + groups * (2 if symmetric else 3)
    return half * (1 if quantized else int(element_size)) + slots + (4 * R if quantized else 0)


def memory_nbytes(mod) -> int:
    """Bytes a :class:`~sparse24.nn.Sparse24Linear` holds for its weight now (masked: dense weight + bool
    mask; compressed: its tensors as held, the decode layout's padding and an INT4 layer's bfloat16
    copy of its scales included)."""
    if mod.mode == "masked":
        return mod.weight.numel() * mod.weight.element_size() + mod.mask.numel()
    copy = mod.__dict__.get("_scale_bf16")
    held = [mod.values, mod.meta, mod.scale, mod.zero, copy[2] if copy else None]
    return sum(t.numel() * t.element_size() for t in held if t is not None)

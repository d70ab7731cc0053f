"""Interop with torch's own 2:4 path (``torch.sparse.SparseSemiStructuredTensor``).

Where cuSPARSELt / CUTLASS sparse tensor cores beat our Triton kernel (large
batches on Ampere/Hopper), export the weight; import torch's tensors back to
store, inspect or run them anywhere.

Layouts: torch's CUTLASS layout for float16/bfloat16 keeps the kept values in
exactly our order (two per group of 4, lower slot first) and the same nibble
per group (``slot_lo | slot_hi << 2``), packed 4 groups per int16 and then
permuted ("reordered") for the tensor cores. So :func:`to_cutlass_layout` and
:func:`from_cutlass_layout` are a repack of the metadata bits plus torch's
own permutation, pure torch, any device; they are tested on CPU against
torch's reference conversions in ``torch.sparse._semi_structured_conversions``.
torch's float32 CUTLASS layout is 1:2 (one of each pair), which a 2:4 weight
does not satisfy in general, so float32 weights are exported as float16/bfloat16.
"""
from __future__ import annotations

import torch

from .format import Sparse24Tensor, compress

__all__ = ["to_semi_structured", "from_semi_structured", "to_cutlass_layout", "from_cutlass_layout"]

_HALF = (torch.float16, torch.bfloat16)
BACKENDS = ("cutlass", "cusparselt")


def _meta_offsets(rows: int, meta_cols: int, device) -> torch.Tensor:
    # torch's own implementation of CUTLASS's metadata permutation (int16 meta).
    from torch.sparse._semi_structured_conversions import _calculate_meta_reordering_scatter_offsets
    return _calculate_meta_reordering_scatter_offsets(rows, meta_cols, torch.int16, device)


def _export_dtype(p: Sparse24Tensor, dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or p.dtype
    if dtype not in _HALF:
        raise TypeError(f"torch's 2:4 layout needs float16 or bfloat16 values, got {dtype}"
                        + ("; its float32 layout is 1:2, not 2:4: pass dtype=torch.float16 or torch.bfloat16"
                           if dtype == torch.float32 else ""))
    return dtype


def to_cutlass_layout(p: Sparse24Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack a 2:4 weight into torch's CUTLASS layout (no dense matrix is built).

    Args:
        p: :class:`Sparse24Tensor` ``(R, C)`` with ``R % 32 == 0`` and
            ``C % 64 == 0`` (torch's minimum tile); INT8 weights are exported
            dequantized. Any device.
        dtype: float16 or bfloat16 (default: ``p.dtype``).
    Returns:
        ``(packed, meta)``: ``(R, C/2)`` values in ``dtype`` and ``(R, C/16)``
        int16 reordered metadata, as ``sparse_semi_structured_from_dense_cutlass``
        would produce for ``p.to_dense()``.
    Example:
        >>> packed, meta = to_cutlass_layout(sparse24.compress(torch.randn(32, 64).half()))
        >>> packed.shape, meta.shape, meta.dtype
        (torch.Size([32, 32]), torch.Size([32, 4]), torch.int16)
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"expected a Sparse24Tensor, got {type(p).__name__}")
    dtype = _export_dtype(p, dtype)
    R, C = p.shape
    if R % 32 or C % 64 or R == 0:
        raise ValueError(f"torch's 2:4 tensors need rows a positive multiple of 32 and columns a multiple of 64 "
                         f"(for {dtype}), got shape {(R, C)}; pad the weight first")
    words = p.meta.t().to(torch.int64)                       # (R, C/32): 8 nibbles each
    halves = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=-1).reshape(R, C // 16)
    halves = halves - ((halves >> 15) << 16)                 # as signed 16-bit values
    meta = torch.empty(R * (C // 16), dtype=torch.int16, device=p.device)
    meta.scatter_(0, _meta_offsets(R, C // 16, p.device), halves.to(torch.int16).reshape(-1))
    return p.dequantized_values(dtype).contiguous(), meta.view(R, C // 16)


def from_cutlass_layout(packed: torch.Tensor, meta: torch.Tensor) -> Sparse24Tensor:
    """Inverse of :func:`to_cutlass_layout`.

    Args:
        packed: ``(R, C/2)`` float16/bfloat16 kept values; meta: ``(R, C/16)``
            int16 reordered metadata (torch's CUTLASS layout).
    Returns:
        :class:`Sparse24Tensor` ``(R, C)`` whose ``to_dense()`` equals
        ``sparse_semi_structured_to_dense_cutlass(packed, meta)``.
    """
    if not isinstance(packed, torch.Tensor) or not isinstance(meta, torch.Tensor):
        raise TypeError("packed and meta must be tensors")
    if packed.dtype not in _HALF:
        raise TypeError(f"only float16/bfloat16 CUTLASS tensors are 2:4 (float32 is 1:2), got {packed.dtype}")
    if packed.dim() != 2 or meta.dtype != torch.int16 or tuple(meta.shape) != (packed.shape[0], packed.shape[1] // 8) \
            or packed.shape[1] % 8:
        raise ValueError(f"need packed (R, C/2) and int16 meta (R, C/16), got packed {tuple(packed.shape)} and "
                         f"meta {meta.dtype} {tuple(meta.shape)}")
    R, C = packed.shape[0], 2 * packed.shape[1]
    if R % 32 or C % 64 or R == 0:
        raise ValueError(f"torch's 2:4 tensors have rows a positive multiple of 32 and columns a multiple of 64, "
                         f"got packed {tuple(packed.shape)} (dense {(R, C)})")
    halves = torch.gather(meta.reshape(-1), 0, _meta_offsets(R, C // 16, meta.device)).view(R, C // 16)
    halves = halves.to(torch.int64) & 0xFFFF
    if (C // 16) % 2:                                         # last word holds one 16-column half
        halves = torch.nn.functional.pad(halves, (0, 1))
    pairs = halves.view(R, -1, 2)
    words = pairs[..., 0] | (pairs[..., 1] << 16)
    words = words - ((words >> 31) << 32)                     # as signed 32-bit values
    return Sparse24Tensor(packed.contiguous(), words.to(torch.int32).t().contiguous(), (R, C))


def to_semi_structured(p: Sparse24Tensor, backend: str = "cutlass", dtype: torch.dtype | None = None):
    """Export a 2:4 weight as a ``torch.sparse.SparseSemiStructuredTensor`` (CUDA).

    Use it where torch's sparse tensor-core matmuls are faster than our
    kernel, e.g. ``F.linear(x, to_semi_structured(p))`` at large batch.

    Args:
        p: :class:`Sparse24Tensor` ``(N, K)`` on a CUDA device, ``N % 32 == 0``,
            ``K % 64 == 0`` (INT8 weights are exported dequantized).
        backend: ``"cutlass"`` (repacked directly, no dense copy) or
            ``"cusparselt"`` (its layout is opaque: compressed by
            ``torch._cslt_compress`` from a transient dense copy).
        dtype: float16 or bfloat16 (default: ``p.dtype``).
    Returns:
        A ``SparseSemiStructuredTensorCUTLASS`` / ``...CUSPARSELT`` whose
        ``to_dense()`` equals ``p.to_dense()`` (in ``dtype``).
    Raises:
        ValueError: p on CPU (torch's 2:4 tensors are CUDA-only; the layout
        functions above work anywhere), bad shape or backend.
        TypeError: not a Sparse24Tensor, or a dtype torch cannot store 2:4.
    Example:
        >>> t = to_semi_structured(sparse24.compress(torch.randn(64, 128, device="cuda").half()))
        >>> y = torch.nn.functional.linear(torch.randn(8, 128, device="cuda").half(), t)
    """
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"expected a Sparse24Tensor, got {type(p).__name__}")
    if p.device.type != "cuda":
        raise ValueError(f"torch's SparseSemiStructuredTensor is CUDA-only, but the weight is on {p.device}; move it "
                         f"with p.to('cuda') (to_cutlass_layout converts the layout on any device)")
    if backend == "cutlass":
        packed, meta = to_cutlass_layout(p, dtype)
        return SparseSemiStructuredTensorCUTLASS(p.shape, packed=packed, meta=meta, packed_t=None, meta_t=None,
                                                 compressed_swizzled_bitmask=None)
    dense = p.to_dense().to(_export_dtype(p, dtype))
    return SparseSemiStructuredTensorCUSPARSELT.from_dense(dense)


def from_semi_structured(t) -> Sparse24Tensor:
    """Import a ``torch.sparse.SparseSemiStructuredTensor`` as a :class:`Sparse24Tensor`.

    CUTLASS tensors are repacked directly (any device); cuSPARSELt tensors
    (opaque layout) go through ``t.to_dense()`` on their CUDA device.

    Args:
        t: a 2-D float16/bfloat16 ``SparseSemiStructuredTensor`` ``(N, K)``.
    Returns:
        :class:`Sparse24Tensor` on t's device with ``to_dense() == t.to_dense()``.
    """
    from torch.sparse import SparseSemiStructuredTensor, SparseSemiStructuredTensorCUTLASS

    if not isinstance(t, SparseSemiStructuredTensor):
        raise TypeError(f"expected a torch.sparse.SparseSemiStructuredTensor, got {type(t).__name__}")
    if isinstance(t, SparseSemiStructuredTensorCUTLASS) and t.packed is not None and t.meta is not None \
            and t.meta.dim() == 2:
        return from_cutlass_layout(t.packed, t.meta)
    if t.dtype not in _HALF:
        raise TypeError(f"only float16/bfloat16 semi-structured tensors are 2:4, got {t.dtype}")
    dense = t.to_dense()
    return compress(dense, mask=dense != 0)

"""``linear(x, p, bias)``: y = x @ W^T + bias with W stored as a Sparse24Tensor.

Backends: ``"reference"`` (pure torch, any device), ``"triton"`` (the Triton
kernel; on CPU tensors it runs in the Triton interpreter) and ``"auto"``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..format import Sparse24Tensor

__all__ = ["linear", "linear_reference", "choose_backend", "chunk_rows", "BACKENDS", "check_linear_args"]

BACKENDS = ("auto", "reference", "triton")
# Decompress at most this many weight elements at a time in the reference
# backend, so a huge layer never exists densely in full (1M elements = 4 MiB
# fp32). Blocks this small stay in cache between decompression and matmul:
# 4096x4096 fp32 on a 2-core EPYC, 1 thread, M = 1 / 16: 70 / 91 ms vs
# 119 / 140 ms with 4M-element blocks (2 threads and M = 256: within noise).
CHUNK_ELEMENTS = 1 << 20
# On a GPU each block costs several kernel launches (unpack, scatter, GEMM), so
# blocks are larger there: 16M elements (32 MiB fp16) keep LLM layers to 1-4 blocks.
CUDA_CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n_cols: int, device: torch.device) -> int:
    """Weight rows the reference backend decompresses at a time (at least 1)."""
    budget = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS
    return max(1, budget // max(n_cols, 1))


def check_linear_args(x: torch.Tensor, p: Sparse24Tensor, bias: torch.Tensor | None) -> None:
    """Raise a clear error if x, p, bias do not fit together."""
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"weight must be a Sparse24Tensor (see sparse24.compress), got {type(p).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != p.shape[1]:
        raise ValueError(f"x has {x.shape[-1] if x.dim() else 0} features but the weight expects {p.shape[1]} "
                         f"(x shape {tuple(x.shape)}, weight shape {tuple(p.shape)})")
    if x.device != p.device:
        raise ValueError(f"x is on {x.device} but the weight is on {p.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (p.shape[0],):
            raise ValueError(f"bias must have shape {(p.shape[0],)}, got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def linear_reference(x: torch.Tensor, p: Sparse24Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch ``x @ W^T + bias``, decompressing W a block of rows at a time.

    Args:
        x: ``(..., K)``; p: weight of shape ``(N, K)``; bias: ``(N,)`` or None.
    Returns:
        ``(..., N)`` in x's dtype. Computed in x's dtype (the weight is cast to it).
    """
    check_linear_args(x, p, bias)
    N, K = p.shape
    rows = chunk_rows(K, p.device)
    if rows >= N:  # small layer: one piece
        return F.linear(x, p.to_dense().to(x.dtype), None if bias is None else bias.to(x.dtype))
    out = x.new_empty(*x.shape[:-1], N)
    for n0 in range(0, N, rows):
        sl = slice(n0, min(N, n0 + rows))
        b = None if bias is None else bias[sl].to(x.dtype)
        out[..., sl] = F.linear(x, p.to_dense(rows=sl).to(x.dtype), b)
    return out


def linear(x: torch.Tensor, p: Sparse24Tensor, bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``y = x @ W^T + bias`` for a compressed 2:4 weight W.

    Args:
        x: ``(..., K)`` floating input, any number of leading dims (M = 0 allowed).
        p: :class:`Sparse24Tensor` of logical shape ``(N, K)``.
        bias: ``(N,)`` or None.
        backend: ``"auto"`` (see :func:`choose_backend`), ``"reference"``
            or ``"triton"`` (interpreted on CPU tensors).
    Returns:
        ``(..., N)`` in x's dtype; equals ``F.linear(x, p.to_dense(), bias)``.
    Example:
        >>> p = sparse24.compress(torch.randn(64, 32))
        >>> linear(torch.randn(3, 32), p).shape
        torch.Size([3, 64])
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = choose_backend(x, p)
    if backend == "reference":
        return linear_reference(x, p, bias)
    from .triton_linear import linear_triton  # imports triton lazily
    return linear_triton(x, p, bias)


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def choose_backend(x: torch.Tensor, p: Sparse24Tensor) -> str:
    """The backend ``"auto"`` runs: the Triton kernel for fp16/bf16/fp32 x on
    CUDA, unless this GPU's tuned-config file measured the kernel slower than
    dense ``F.linear`` at this shape (large, compute-bound M), where the
    reference backend (row-block decompression + cuBLAS) is used; the
    reference everywhere else (CPU, fp64, no triton)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in KERNEL_DTYPES and _triton_available()):
        return "reference"
    from .. import tuning
    from ..tuning import dtype_key
    M = x.numel() // max(x.shape[-1], 1)
    speedup = tuning.measured_speedup(M, p.shape[0], p.shape[1], dtype_key(x.dtype, p.scale is not None), x.device)
    return "reference" if speedup is not None and speedup < 1.0 else "triton"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

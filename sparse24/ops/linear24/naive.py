"""The pure-torch twin of the 2:4 linear op (any device, any float dtype):
forward and backward decompress the weight a block of rows at a time, so a
huge layer never exists densely in full. It is the ``"reference"`` backend,
the CPU implementation of the registered op, and its backward formula.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ...decode_format import DecodePacked
from ..._checks import row_chunks as _row_chunks
from ...format import Sparse24Tensor

__all__ = ["check_input", "check_linear_args", "on_jagged", "chunk_rows", "row_chunks", "linear_reference",
           "linear_backward_reference", "CHUNK_ELEMENTS", "CUDA_CHUNK_ELEMENTS"]

# Decompress at most this many weight elements at a time in the reference
# backend, so a huge layer never exists densely in full (1M elements = 4 MiB
# fp32). Blocks this small stay in cache between decompression and matmul:
# 4096x4096 fp32 on a 2-core EPYC, 1 thread, M = 1 / 16: 70 / 91 ms vs
# 119 / 140 ms with 4M-element blocks (2 threads and M = 256: within noise).
CHUNK_ELEMENTS = 1 << 20
# On a GPU each block costs several kernel launches (unpack, scatter, GEMM), so
# blocks are larger there: 16M elements (32 MiB fp16) keep LLM layers to 1-4 blocks.
CUDA_CHUNK_ELEMENTS = 1 << 24


def _budget(device: torch.device) -> int:
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


def chunk_rows(n_cols: int, device: torch.device) -> int:
    """Weight rows the reference backend decompresses at a time (at least 1)."""
    return max(1, _budget(device) // max(n_cols, 1))


def row_chunks(n_rows: int, n_cols: int, device: torch.device, multiple: int = 1) -> list[slice]:
    """Row slices of the reference backend's block size (bounded dense memory), each
    starting at a multiple of ``multiple`` rows (the decode layout's 128-row blocks)."""
    return _row_chunks(n_rows, n_cols, device, multiple, _budget(device))


def _shape(x: torch.Tensor) -> tuple:
    """``tuple(x.shape)``; under torch.jit.trace as ints, without its TracerWarning (the traced shape is fixed:
    checking it is right, and the warning only told users a trace might be wrong)."""
    if not torch.jit.is_tracing():
        return tuple(x.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return tuple(int(d) for d in x.shape)


def check_input(x: torch.Tensor, in_features: int, device: torch.device) -> None:
    """Raise a clear error unless x is a floating ``(..., in_features)`` tensor on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    shape = _shape(x)
    if not shape or shape[-1] != in_features:
        raise ValueError(f"x has {shape[-1] if shape else 0} features but the weight expects {in_features} "
                         f"(x shape {shape})")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weight is on {device}")


def on_jagged(x: torch.Tensor, fn, what: str = "x") -> torch.Tensor:
    """``fn`` (a ``(..., K) -> (..., N)`` linear map) of a nested tensor ``x`` of layout ``torch.jagged``,
    run on its packed values and nested again with x's offsets, lengths and ragged dim (differentiable,
    as both are views). A strided nested tensor is a TypeError naming ``what``."""
    if x.layout != torch.jagged:
        raise TypeError(f"{what} is a nested tensor of layout {x.layout}: sparse24 takes nested tensors of layout "
                        "torch.jagged only (torch.nested.nested_tensor(..., layout=torch.jagged))")
    return torch.nested.nested_tensor_from_jagged(fn(x.values()), x.offsets(), lengths=x.lengths(),
                                                  jagged_dim=x._ragged_idx)


def check_linear_args(x: torch.Tensor, p: Sparse24Tensor | DecodePacked, bias: torch.Tensor | None) -> None:
    """Raise a clear error if x, p, bias do not fit together."""
    if not isinstance(p, (Sparse24Tensor, DecodePacked)):
        raise TypeError(f"weight must be a Sparse24Tensor (see sparse24.compress) or a DecodePacked "
                        f"(sparse24.pack_decode), got {type(p).__name__}")
    check_input(x, p.shape[1], p.device)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if not bias.is_floating_point():   # (complex: the reference dropped its imaginary part silently)
            raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
        if tuple(bias.shape) != (p.shape[0],):
            raise ValueError(f"bias must have shape {(p.shape[0],)}, got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def linear_reference(x: torch.Tensor, p: Sparse24Tensor | DecodePacked,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch ``x @ W^T + bias``, decompressing W a block of rows at a time.

    The pure-torch twin of the three kernels: for a decode-layout weight (the
    decode and prefill kernels' input) each block of 128-row tiles is re-ordered
    and decompressed on its own (:meth:`DecodePacked.to_dense` with ``rows``).

    Args:
        x: ``(..., K)``; p: weight of shape ``(N, K)`` (layout v1 or the decode
            layout); bias: ``(N,)`` or None.
    Returns:
        ``(..., N)`` in x's dtype. Computed in x's dtype (the weight is cast to it).
    """
    check_linear_args(x, p, bias)
    N, K = p.shape
    chunks = row_chunks(N, K, p.device, 128 if isinstance(p, DecodePacked) else 1)
    if len(chunks) <= 1:  # small layer: one piece
        return F.linear(x, p.to_dense().to(x.dtype), None if bias is None else bias.to(x.dtype))
    parts = (F.linear(x, p.to_dense(rows=sl).to(x.dtype), None if bias is None else bias[sl].to(x.dtype))
             for sl in chunks)
    if torch._C._are_functorch_transforms_active():
        # torch.func (vmap over the weights): a batched part cannot be written into a plain buffer
        return torch.cat(list(parts), dim=-1)
    out = x.new_empty(*x.shape[:-1], N)
    for sl, part in zip(chunks, parts):
        out[..., sl] = part
    return out


def grad_rows(grad_y: torch.Tensor, N: int) -> torch.Tensor:
    """``grad_y`` ``(..., N)`` as ``(M, N)`` rows. Not -1: ambiguous for a layer of 0 outputs; math.prod,
    not Size.numel(): traced (compiled training), numel() made the rows a constant and every new batch or
    sequence length compiled again."""
    return grad_y.reshape(math.prod(grad_y.shape[:-1]), N)


def linear_backward_reference(grad_y: torch.Tensor, x: torch.Tensor | None, p: Sparse24Tensor,
                              need_x: bool, need_values: bool, need_bias: bool, bias_dtype=None):
    """Gradients of ``y = x @ W^T + b`` for a compressed W, a block of weight rows at a time.

    Args:
        grad_y: ``(..., N)``; x: ``(..., K)`` (needed only for the values' gradient); p: ``(N, K)``.
        need_x / need_values / need_bias: which gradients to compute; bias_dtype: the bias's dtype.
    Returns:
        ``(grad_x (..., K), grad_values (N, K/2) at the kept slots, grad_bias (N,))``, None where not needed.
    """
    N, K = p.shape
    gy = grad_rows(grad_y, N)
    grad_x = grad_values = grad_bias = None
    chunks = row_chunks(N, K, p.device, 128 if isinstance(p, DecodePacked) else 1)  # (whole decode blocks)
    # Out of place for one block of rows (most layers: nothing to accumulate) and for torch's batched
    # backward (autograd.grad(is_grads_batched=True), jacobian / hessian(vectorize=True) run it under
    # torch's legacy vmap: a batched grad_y cannot be written into the plain buffers, nor sliced whole:
    # aten::alias); otherwise the blocks accumulate into one buffer (no block's product kept beside it)
    whole = len(chunks) <= 1
    in_place = not whole and not (torch._C._functorch.is_legacy_batchedtensor(grad_y)
                                  or torch._C._functorch.is_functorch_wrapped_tensor(grad_y))
    if need_x:
        if whole:
            grad_x = gy @ p.to_dense().to(gy.dtype)
        elif in_place:
            grad_x = torch.zeros(gy.shape[0], K, dtype=gy.dtype, device=gy.device)
            for sl in chunks:
                grad_x.addmm_(gy[:, sl], p.to_dense(rows=sl).to(gy.dtype))
        else:
            grad_x = sum(gy[:, sl] @ p.to_dense(rows=sl).to(gy.dtype) for sl in chunks)
        grad_x = grad_x.view(*grad_y.shape[:-1], K)
    if need_values:
        x2 = x.reshape(gy.shape[0], K).to(gy.dtype)

        def kept(sl):  # the dense weight gradient of rows sl, at the kept slots (unpacked for rows sl only:
            # the int64 slots are 4 bytes per weight, 2x a bf16 layer's dense bytes when unpacked whole)
            gw = ((gy if whole else gy[:, sl]).t() @ x2).view(-1, K // 4, 4)
            return gw.gather(-1, p.slots(sl)).view(-1, K // 2).to(p.values.dtype)
        if whole:
            grad_values = kept(slice(None))
        elif in_place:
            grad_values = torch.empty_like(p.values)
            for sl in chunks:
                grad_values[sl] = kept(sl)
        else:
            grad_values = torch.cat([kept(sl) for sl in chunks])
    if need_bias:
        grad_bias = gy.sum(0).to(bias_dtype)
    return grad_x, grad_values, grad_bias

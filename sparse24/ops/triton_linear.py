"""Launcher of the compressed 2:4 Triton matmul (``kernels/sparse24_matmul.py``).

``linear_triton(x, p, bias)``: (1) checks, (2) allocates the output, (3) picks
a tile config (``sparse24.tuning``), (4) launches: compiled on CUDA tensors,
through Triton's interpreter on CPU tensors (same kernel source).
"""
from __future__ import annotations

import contextlib

import torch

from ..format import Sparse24Tensor
from .linear import check_linear_args

__all__ = ["linear_triton", "SUPPORTED_DTYPES"]

# tl.dot takes fp16/bf16/fp32 operands; fp64 has no tensor-core path, so
# float64 inputs are rejected here (backend="reference" computes them).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_triton_args(x: torch.Tensor, p: Sparse24Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"backend='triton' supports x of dtype float16, bfloat16 or float32, got {x.dtype}; "
                        f"use backend='reference' for {x.dtype}")
    if x.device.type == "cpu":
        if x.dtype == torch.bfloat16:
            # numpy has no bfloat16, so Triton's interpreter cannot compute it.
            raise TypeError("backend='triton' on CPU tensors runs Triton's interpreter, which has no bfloat16 "
                            "arithmetic; use float16/float32 on CPU, backend='reference', or a CUDA device")
    elif x.device.type != "cuda":
        raise ValueError(f"backend='triton' needs CUDA or CPU tensors, got device {x.device}")
    if p.scale is None and p.values.dtype == torch.float64:
        raise TypeError("backend='triton' cannot read float64 weight values; cast the weight with "
                        "p.to(dtype=torch.float32) or use backend='reference'")


def linear_triton(x: torch.Tensor, p: Sparse24Tensor, bias: torch.Tensor | None = None, *,
                  config=None) -> torch.Tensor:
    """``y = x @ W^T + bias`` with the compressed 2:4 Triton kernel.

    The kernel reads W only compressed (values + 2-bit slots), expands each
    tile in registers, accumulates in fp32, applies the INT8 scale (if
    ``p.scale`` is set) and the bias in the epilogue, and writes x's dtype.

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, any leading dims (M = 0
            allowed), any strides. CUDA tensors run compiled; CPU tensors run
            in Triton's interpreter (float16/float32 only; slow, for tests).
        p: :class:`Sparse24Tensor` ``(N, K)``: float16/bfloat16/float32
            values, or int8 values with ``(N,)`` float32 scales.
        bias: ``(N,)`` or None, any float dtype (added in fp32).
        config: a :class:`sparse24.tuning.KernelConfig` to pin; default: the
            tuned-config lookup of :func:`sparse24.tuning.get_config`.
    Returns:
        ``(..., N)`` in x's dtype.
    Raises:
        TypeError: float64 (or integer) x, bfloat16 x on CPU, float64 weight values.
    Example:
        >>> p = sparse24.compress(torch.randn(64, 128, device="cuda", dtype=torch.float16))
        >>> linear_triton(torch.randn(4, 128, device="cuda", dtype=torch.float16), p).shape
        torch.Size([4, 64])
    """
    check_linear_args(x, p, bias)
    _check_triton_args(x, p)
    from .. import tuning  # tuning imports this module for live tuning

    N, K = p.shape
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), K)  # a view when the strides allow it (not -1: ambiguous for K = 0)
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out.view(*lead, N)

    if config is None:
        config = tuning.get_config(M, N, K, tuning.dtype_key(x.dtype, p.scale is not None), x.device)
    else:
        if not isinstance(config, tuning.KernelConfig):
            raise TypeError(f"config must be a sparse24.tuning.KernelConfig, got {type(config).__name__}")
        config.validate()
    split_k = 1 if torch.are_deterministic_algorithms_enabled() else config.split_k
    _launch(x2, p, bias, out, config, split_k)
    return out.view(*lead, N)


def _launch(x2, p, bias, out, config, split_k: int) -> None:
    # Split-K partial sums meet by fp32 atomic adds in a zeroed buffer: one
    # M x N buffer (not SPLIT_K of them) and no reduction launch; the cost is
    # run-to-run differences at fp32 rounding, so deterministic mode
    # (torch.use_deterministic_algorithms) forces SPLIT_K = 1.
    target = out
    if split_k > 1:
        target = out.zero_() if out.dtype == torch.float32 else torch.zeros(
            out.shape, dtype=torch.float32, device=out.device)
    kernel, grid, args, kwargs = kernel_call(x2, p, bias, target, config, split_k)
    with torch.cuda.device(x2.device) if x2.is_cuda else contextlib.nullcontext():
        kernel[grid](*args, **kwargs)
    if target is not out:
        out.copy_(target)


def kernel_call(x2, p, bias, target, config, split_k: int):
    """``(kernel, grid, args, kwargs)`` of one launch writing ``target`` (M, N);
    shared by the launcher, the tuner's parallel pre-compilation and the
    ahead-of-time compile test, so all three build the same kernel variant."""
    from sparse24.kernels.sparse24_matmul import sparse24_matmul, sparse24_matmul_interpreted

    M, K = x2.shape
    N = p.shape[0]
    # Dot precision for fp32 operands follows torch's own matmul TF32 switch
    # (off by default, so fp32 results match F.linear); half types ignore it.
    tf32 = x2.is_cuda and x2.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    dummy = p.values  # never read when HAS_SCALE / HAS_BIAS is False
    args = (x2, p.values, p.meta, p.scale if p.scale is not None else dummy, bias if bias is not None else dummy,
            target, M, N, K, x2.stride(0), x2.stride(1), p.values.stride(0), p.values.stride(1),
            p.meta.stride(0), p.meta.stride(1), target.stride(0), target.stride(1))
    kwargs = dict(HAS_SCALE=p.scale is not None, HAS_BIAS=bias is not None, DOT_PRECISION="tf32" if tf32 else "ieee",
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  GROUP_M=config.group_m, SPLIT_K=split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (_cdiv(M, config.block_m) * _cdiv(N, config.block_n), split_k)
    return (sparse24_matmul if x2.is_cuda else sparse24_matmul_interpreted), grid, args, kwargs


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aot_compile(x2, p, bias, target, config, split_k: int, capability: tuple[int, int] = (9, 0)):
    """Compile (not run) the launch :func:`kernel_call` describes for a CUDA
    target, without a GPU: Triton -> PTX -> cubin with the ptxas shipped in
    Triton's wheel. Specializes arguments as the JIT does on a GPU (unit
    strides become constants; 16-byte aligned pointers and ints divisible by
    16 are marked so), so the code matches what a GPU would build.

    Args:
        x2: ``(M, K)`` CPU tensor, p: weight, bias: ``(N,)`` or None,
        target: ``(M, N)`` output (fp32 when ``split_k > 1``), config, split_k.
        capability: ``(major, minor)``, e.g. ``(9, 0)`` for H100/H200.
    Returns:
        Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from sparse24.kernels.sparse24_matmul import sparse24_matmul

    _, _, args, kwargs = kernel_call(x2, p, bias, target, config, split_k)
    names = sparse24_matmul.arg_names
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    constexprs.update({n: 1 for n, a in zip(names, args) if n != "M" and isinstance(a, int) and a == 1})
    signature = {n: ("constexpr" if n in constexprs else mangle_type(a)) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, a) in enumerate(zip(names, args))
             if n not in constexprs and ((isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
                                         or (n != "M" and isinstance(a, int) and a % 16 == 0))}
    src = ASTSource(sparse24_matmul, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})

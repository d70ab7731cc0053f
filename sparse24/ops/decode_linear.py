"""Launcher of the decode-path Triton kernel (``kernels/sparse24_decode.py``):
``y = x @ W^T (* scale) + bias`` for M <= 16 rows, W in the decode layout
(:class:`sparse24.format.DecodePacked`, from :func:`sparse24.format.pack_decode`).

Self-contained glue: :func:`linear_decode` (check, allocate, launch),
:func:`decode_call` (the launch, mirroring ``triton_linear.kernel_call``),
:func:`decode_aot_compile` (sm_90 cubin without a GPU) and
:func:`decode_configs`, the config space a tuner may pick at M <= 16 (every
config in it meets the sm_90 instruction budget, see docs/kernels.md).
"""
from __future__ import annotations

import contextlib

import torch

from ..format import DecodePacked
from ..tuning import KernelConfig

__all__ = ["MAX_M", "DECODE_KERNEL", "decode_configs", "default_decode_config", "decode_call", "linear_decode",
           "decode_aot_compile", "aot_compile_call"]

MAX_M = 16                        # the kernel's one row block (every tl.dot dim >= 16)
DECODE_KERNEL = "sparse24_decode"
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The config space, every config measured within the sm_90 budget (0.15
# warp-instructions per compressed byte for float16/bfloat16 weights, 0.22 for
# INT8) by ``scripts/kernel_static_check.py --sass``, Triton 3.9 and 3.6
# (results/static-sm90/). (BLOCK_N, num_warps): one 16-row tile per warp, so a
# warp's decoded registers are its own mma A-fragments, and BLOCK_N >= 64 runs
# Hopper's wgmma with the weight operand in registers. Left out, measured:
# BLOCK_N = 32 (2 warps, mma.sync): Triton picks kWidth = 4 for the operands and
# re-distributes the decoded tile with shuffles (fp16: 0.10-0.12 with Triton 3.9
# but 0.17-0.20 with 3.6; INT8 0.32-0.40); INT8 with 3 stages (0.21-0.29) and
# INT8 with 2 stages on tiles under 16384 elements (the shared-memory
# pipeline's extra LDS: 0.20-0.24; 64 x 128 reached 0.221).
_TILES = ((64, 4), (128, 8))
_BLOCK_K = (64, 128, 256)


def default_decode_config() -> KernelConfig:
    """Untuned fallback: 64 x 128 tiles, 4 warps, 1 stage (not timed on a GPU)."""
    return KernelConfig(16, 64, 128, 1, 1, 4, 1)


def decode_configs(M: int, N: int, K: int, dtype: str = "float16", num_sms: int = 132) -> list[KernelConfig]:
    """The decode kernel's config space for one (M <= 16, N, K, dtype key).

    BLOCK_N x warps in (64 x 4, 128 x 8) x BLOCK_K in (64, 128, 256) x
    stages (1-3) x split-K in (1, 2, 4, 8);
    split-K while the programs stay within 4 per SM and each split keeps
    >= 2 K-tiles (a 4096 x 4096 layer has only 64 programs of 64 rows for
    132 SMs). INT8 weights (``dtype`` ``"int8-..."``): one stage, or two on
    tiles of >= 16384 elements (see the comment above).

    Args:
        M, N, K: problem size (x is M x K, W is N x K); dtype: a
            :func:`sparse24.tuning.dtype_key`.
    Returns:
        list of :class:`sparse24.tuning.KernelConfig` (``block_m == 16``).
    """
    if not 1 <= M <= MAX_M:
        raise ValueError(f"the decode kernel serves 1 <= M <= {MAX_M}, got M={M}")
    int8 = dtype.startswith("int8-")
    out = []
    for bn, warps in _TILES:
        for bk in _BLOCK_K:
            programs = -(-N // bn)
            splits = [1] + [s for s in (2, 4, 8) if programs * s <= 4 * num_sms and K >= 2 * s * bk]
            stages = ((1, 2) if bn * bk >= 16384 else (1,)) if int8 else (1, 2, 3)
            out += [KernelConfig(16, bn, bk, 1, s, warps, st) for s in splits for st in stages]
    return [c.validate() for c in out]


def _check_config(config: KernelConfig) -> None:
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a sparse24.tuning.KernelConfig, got {type(config).__name__}")
    config.validate()
    c = config
    if c.block_m != MAX_M or c.block_k < 64 or c.block_n not in (32, 64, 128) or c.num_warps != c.block_n // 16:
        raise ValueError(f"bad decode config {c}: need block_m == 16, block_k >= 64, block_n in (32, 64, 128) and "
                         f"num_warps == block_n // 16 (one 16-row tile per warp)")


def _check_args(x: torch.Tensor, d: DecodePacked, bias) -> None:
    if not isinstance(d, DecodePacked):
        raise TypeError(f"the decode kernel reads a DecodePacked weight (sparse24.format.pack_decode), "
                        f"got {type(d).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _ACT_DTYPES:
        raise TypeError(f"x must be a float16, bfloat16 or float32 tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-1] != d.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {d.shape[1]}")
    if x.device != d.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x ({x.device}), weight ({d.device}) and bias must be on one device")
    if bias is not None and tuple(bias.shape) != (d.shape[0],):
        raise ValueError(f"bias must have shape {(d.shape[0],)}, got {tuple(bias.shape)}")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise TypeError("on CPU tensors the decode kernel runs in Triton's interpreter, which has no bfloat16 "
                        "arithmetic; use float16/float32 on CPU or a CUDA device")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the decode kernel needs CUDA or CPU tensors, got device {x.device}")


def linear_decode(x: torch.Tensor, d: DecodePacked, bias: torch.Tensor | None = None, *,
                  config: KernelConfig | None = None) -> torch.Tensor:
    """``y = x @ W^T + bias`` with the decode-path kernel, for at most 16 rows.

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32 with at most 16 rows in
            all (``x.reshape(-1, K).shape[0] <= 16``), any strides. CUDA
            tensors run compiled; CPU tensors in Triton's interpreter
            (float16/float32 only; slow, for tests).
        d: :class:`DecodePacked` ``(N, K)``: float16/bfloat16 values, or INT8
            values with ``(N,)`` float32 scales.
        bias: ``(N,)`` or None, any float dtype (added in fp32).
        config: a :class:`KernelConfig` from :func:`decode_configs` (default:
            :func:`default_decode_config`).
    Returns:
        ``(..., N)`` in x's dtype.
    Raises:
        ValueError: more than 16 rows (use ``sparse24.ops.triton_linear``), bad shapes or config.
        TypeError: bad dtypes, bfloat16 x on CPU.
    Example:
        >>> d = pack_decode(sparse24.compress(torch.randn(64, 128, device="cuda").half()))
        >>> linear_decode(torch.randn(4, 128, device="cuda").half(), d).shape
        torch.Size([4, 64])
    """
    _check_args(x, d, bias)
    config = default_decode_config() if config is None else config
    _check_config(config)
    N, K = d.shape
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), K)
    M = x2.shape[0]
    if M > MAX_M:
        raise ValueError(f"the decode kernel serves at most {MAX_M} rows, got {M}; use sparse24.ops.triton_linear")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out.view(*lead, N)
    split_k = 1 if torch.are_deterministic_algorithms_enabled() else config.split_k
    target = out
    if split_k > 1:  # fp32 atomics into one zeroed buffer (no reduction launch)
        target = out.zero_() if out.dtype == torch.float32 else torch.zeros(M, N, dtype=torch.float32,
                                                                            device=x.device)
    kernel, grid, args, kwargs = decode_call(x2, d, bias, target, config, split_k)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](*args, **kwargs)
    if target is not out:
        out.copy_(target)
    return out.view(*lead, N)


def decode_call(x2, d: DecodePacked, bias, target, config: KernelConfig, split_k: int):
    """``(kernel, grid, args, kwargs)`` of one decode launch writing ``target``
    ``(M, N)`` (fp32 and zeroed when ``split_k > 1``); shared by
    :func:`linear_decode` and :func:`decode_aot_compile`."""
    from sparse24.kernels.sparse24_decode import sparse24_decode, sparse24_decode_interpreted

    M, K = x2.shape
    N = d.shape[0]
    tf32 = x2.is_cuda and x2.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    words = d.values.view(torch.int32)          # the kernel reads 32-bit words
    dummy = d.meta                              # never read when there is no scale / bias
    args = (x2, words, d.meta, d.scale if d.scale is not None else dummy, bias if bias is not None else dummy,
            target, M, N, K, -(-K // 64), d.meta.shape[2], x2.stride(0), x2.stride(1), target.stride(0),
            target.stride(1))
    kwargs = dict(INT8=d.scale is not None, W_BF16=d.values.dtype == torch.bfloat16, HAS_BIAS=bias is not None,
                  DOT_PRECISION="tf32" if tf32 else "ieee", BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  SPLIT_K=split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (-(-N // config.block_n), split_k)
    return (sparse24_decode if x2.is_cuda else sparse24_decode_interpreted), grid, args, kwargs


def aot_compile_call(jit_fn, args, kwargs, capability: tuple[int, int] = (9, 0), unspecialized=("M",)):
    """Compile (not run) ``jit_fn[grid](*args, **kwargs)`` for a CUDA target
    without a GPU (Triton -> PTX -> cubin with the ptxas in Triton's wheel),
    specializing arguments as the JIT does on a GPU: ints equal to 1 become
    constants (except ``unspecialized``), 16-byte aligned pointers and ints
    divisible by 16 are marked so.

    Returns:
        Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    names = jit_fn.arg_names
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    constexprs.update({n: 1 for n, a in zip(names, args)
                       if n not in unspecialized and isinstance(a, int) and not isinstance(a, bool) and a == 1})
    signature = {n: ("constexpr" if n in constexprs else mangle_type(a)) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, a) in enumerate(zip(names, args))
             if n not in constexprs and ((isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
                                         or (n not in unspecialized and isinstance(a, int) and a % 16 == 0))}
    src = ASTSource(jit_fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                          options={"num_warps": kwargs["num_warps"], "num_stages": kwargs["num_stages"]})


def decode_aot_compile(x2, d: DecodePacked, bias, target, config: KernelConfig, split_k: int,
                       capability: tuple[int, int] = (9, 0)):
    """Compile the launch :func:`decode_call` describes for a CUDA target, no GPU needed.

    Args:
        x2: ``(M, K)`` CPU tensor (float16/bfloat16/float32), d: weight,
        bias: ``(N,)`` or None, target: ``(M, N)`` output (fp32 when
        ``split_k > 1``), config, split_k; capability: ``(9, 0)`` for H100/H200.
    Returns:
        Triton's ``CompiledKernel``.
    """
    from sparse24.kernels.sparse24_decode import sparse24_decode

    _check_config(config)
    _, _, args, kwargs = decode_call(x2, d, bias, target, config, split_k)
    return aot_compile_call(sparse24_decode, args, kwargs, capability)

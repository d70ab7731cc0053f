"""Triton kernel for prefill-sized batches (M > 16):
``out = x @ W^T (* scale) + bias`` with W in the decode layout
(``sparse24.decode_format.DecodePacked``), the one copy a compressed module
holds on CUDA.

Triton only (no torch.nn, no policy). The launcher and its default configs
live in ``sparse24.ops.prefill24``; the bit layout in ``sparse24/decode_format.py``.

Why a third kernel: the decode kernel takes 16 rows of x per program, so at
M rows it decodes every weight tile ceil(M / 16) times; here a program takes
BLOCK_M (32-256) rows and decodes each of its weight tiles once for all of
them. The decode itself is the decode kernel's ``_decode_tile`` (byte
permutes straight into the dot's register operand, out^T = W x^T): W is the
first dot operand, decoded in registers, x^T the second. On sm_90 with
BLOCK_N >= 64 (one 16-row tile per warp, 4 or 8 warps) Triton emits wgmma
with W from registers and x^T from shared memory (HGMMA in the SASS; counts
in docs/kernels.md, "Prefill path"), and num_stages > 1 pipelines the x loads.

Grid: one program per (BLOCK_N rows of W, BLOCK_M rows of x), in groups of
GROUP_M x-blocks that share W tiles while they sit in L2. No split-K: at
M > 16 the grid has ceil(N / BLOCK_N) * ceil(M / BLOCK_M) programs.
Offsets that can pass 2**31 (x and out rows, weight atoms) are int64.

Two callables share ONE source function, ``_sparse24_prefill``:
``sparse24_prefill`` (``triton.jit``, GPU tensors) and
``sparse24_prefill_interpreted`` (Triton's interpreter, CPU tensors).
"""
import triton
import triton.language as tl

from .interpreter import InterpretedKernel
from .sparse24_decode import _decode_tile, _epilogue, _int4_rows

__all__ = ["sparse24_prefill", "sparse24_prefill_interpreted"]


def _sparse24_prefill(
    x_ptr, v_ptr, meta_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K, KA, KM,
    stride_xm, stride_xk,
    stride_om, stride_on,
    INT8: tl.constexpr, W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
):
    A: tl.constexpr = BLOCK_K // 64
    T: tl.constexpr = BLOCK_N // 16
    v_ptr = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # values read as 32-bit words
    # Grouped order (Triton tutorial 03): GROUP_M consecutive x-blocks walk the
    # same W columns, so a decoded program's weight tiles are re-read from L2.
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    # This program's BLOCK_M rows of x and out: pointers moved (int64), M counted from them.
    m0 = pid_m.to(tl.int64) * BLOCK_M
    x_ptr += m0 * stride_xm
    out_ptr += m0 * stride_om
    M = M - m0

    # Row tiles of W: rows padded to 128 in the layout, so no masks on weight loads.
    NT = (N + 127) // 128 * 8
    t0 = pid_n * T
    n_full = K // BLOCK_K  # full K-tiles; a partial tile (K % BLOCK_K) runs once after the loop

    atoms = tl.arange(0, A).to(tl.int64)
    lanes = tl.arange(0, T * 128)  # T row tiles x 32 lanes x 4 words, contiguous
    if INT4:  # 8 bytes per lane and atom
        v_ptrs = v_ptr + (atoms[:, None] * NT + t0) * 64 + tl.arange(0, T * 64)[None, :]   # [A, T*64]
        V_STEP: tl.constexpr = A * 64
    elif INT8:
        v_ptrs = v_ptr + (atoms[:, None] * NT + t0) * 128 + lanes[None, :]                  # [A, T*128]
        V_STEP: tl.constexpr = A * 128
    else:
        v_ptrs = (v_ptr + ((atoms[:, None, None] * 2 + tl.arange(0, 2)[None, :, None]) * NT + t0) * 128
                  + lanes[None, None, :])                                                  # [A, 2, T*128]
        V_STEP: tl.constexpr = A * 256
    m_ptrs = meta_ptr + (t0 * 32 + tl.arange(0, T * 32)).to(tl.int64)[:, None] * KM + atoms[None, :]  # [T*32, A]
    G = (K + GROUP - 1) // GROUP   # INT4: quantization groups per row
    s_rows, z_rows = _int4_rows(scale_ptr, zero_ptr, t0, N, G, T) if INT4 else (scale_ptr, zero_ptr)
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1).to(tl.int64)   # rows past M: clamped, never stored
    x_ptrs = x_ptr + rows[:, None] * stride_xm + tl.arange(0, BLOCK_K).to(tl.int64)[None, :] * stride_xk
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K  # a transposed x has stride_xk = M: int64 steps

    # One decode per weight tile for all BLOCK_M rows of x (the decode kernel: 16).
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(0, n_full):
        acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, kt * BLOCK_K, K, kt * A, KA, s_rows, z_rows, G,
                           False, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
        v_ptrs += V_STEP * NT
        m_ptrs += A
        x_ptrs += x_step
    if n_full * BLOCK_K < K:
        acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, n_full * BLOCK_K, K, n_full * A, KA, s_rows, z_rows,
                           G, True, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    _epilogue(acc, out_ptr, scale_ptr, bias_ptr, offs_n, offs_m, N, M, stride_om, stride_on,
              x_ptr.dtype.element_ty == tl.float16, INT8, HAS_BIAS)


# M is not specialized: one compiled variant per config serves every M.
sparse24_prefill = triton.jit(_sparse24_prefill, do_not_specialize=["M"])
sparse24_prefill_interpreted = InterpretedKernel(_sparse24_prefill)

"""Triton kernel: ``out = x @ W^T (* scale) + bias`` with W stored compressed 2:4.

Triton only (no torch.nn, no policy). The launcher, config choice and checks
live in ``sparse24.ops.linear24.launch``. The bit layout decoded here is defined
in ``sparse24.format`` (values ``(N, K/2)``, meta ``(ceil(K/32), N)`` int32,
one nibble ``slot_lo | slot_hi << 2`` per group of 4 dense columns, 8 groups
per word).

Two callables share ONE source function, ``_sparse24_matmul``:

* ``sparse24_matmul``: ``triton.jit`` of it, compiled for GPU tensors;
* ``sparse24_matmul_interpreted``: the same function run by Triton's
  interpreter (``kernels/interpreter.py``, which leaves ``triton.language``
  as it found it), so CPU tensors run through numpy without the user setting
  ``TRITON_INTERPRET=1`` before import. Tests on CPU therefore exercise the
  exact source the GPU compiles.
"""
import triton
import triton.language as tl

from .interpreter import InterpretedKernel

__all__ = ["sparse24_matmul", "sparse24_matmul_interpreted"]


def _sparse24_matmul(
    x_ptr, v_ptr, meta_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_vn, stride_vk,
    stride_mk, stride_mn,
    stride_om, stride_on,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). BLOCK_K is a power
    # of two >= 32, so one K-tile covers BLOCK_K // 32 whole metadata words.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)

    # GROUP_M swizzle (Triton tutorial 03): consecutive programs share weight
    # tiles across GROUP_M row blocks so W is re-read from L2, not HBM.
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)            # dense columns of a K-tile
    offs_j = tl.arange(0, BLOCK_K // 2)       # stored values of a K-tile
    offs_w = tl.arange(0, BLOCK_K // 32)      # metadata words of a K-tile
    mask_m = offs_m < M
    mask_n = offs_n < N
    KV = K // 2                                # stored values per row
    KW = (K + 31) // 32                        # metadata words per row

    # Split-K: split pid_k owns whole K-tiles [k_begin, k_end), so the splits
    # never overlap and a partial last tile only meets the K bound.
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    tiles_per_split = (k_tiles + SPLIT_K - 1) // SPLIT_K
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = min(K, k_begin + tiles_per_split * BLOCK_K)

    # Offsets in int64: M * stride_xm can pass 2**31 for long prompts, and so can
    # K * stride_xk for a transposed x (stride_xk = M); the weight's strides alike.
    # (A stride of 1 stays a constant: loads still vectorize.)
    stride_xk, stride_vk, stride_mk = tl.cast(stride_xk, tl.int64), tl.cast(stride_vk, tl.int64), \
        tl.cast(stride_mk, tl.int64)
    x_ptrs = (x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
              + (k_begin + offs_k)[None, :] * stride_xk)                    # [BM, BK]
    v_ptrs = (v_ptr + offs_n[:, None].to(tl.int64) * stride_vn
              + (k_begin // 2 + offs_j)[None, :] * stride_vk)               # [BN, BK/2]
    m_ptrs = (meta_ptr + (k_begin // 32 + offs_w)[:, None] * stride_mk
              + offs_n[None, :].to(tl.int64) * stride_mn)                   # [BK/32, BN]

    # Group g of a tile is the nibble at bits 4*(g % 8) of word g // 8.
    nib_shift = (tl.arange(0, BLOCK_K // 4) % 8) * 4
    slot_ids = tl.arange(0, 4)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Compressed weight tile: values with K contiguous (vector loads),
        # metadata transposed so a tile's words are contiguous along N.
        # Out-of-range values load as 0, so padding slots add nothing.
        vals = tl.load(v_ptrs, mask=mask_n[:, None] & ((k0 // 2 + offs_j) < KV)[None, :], other=0)
        words = tl.load(m_ptrs, mask=((k0 // 32 + offs_w) < KW)[:, None] & mask_n[None, :], other=0)

        # Slots per group: broadcast each word over its 8 groups, shift out
        # that group's nibble. "& 15" also drops sign bits of bit-31 words.
        nib = tl.reshape(tl.broadcast_to(tl.trans(words)[:, :, None], (BLOCK_N, BLOCK_K // 32, 8)),
                         (BLOCK_N, BLOCK_K // 4))
        nib = (nib >> nib_shift[None, :]) & 15
        slot_lo = nib & 3
        slot_hi = nib >> 2

        # Expand in registers: dense[n, 4g + s] = v_lo if s == slot_lo,
        # v_hi if s == slot_hi, else 0. The dense W never reaches memory.
        v_lo, v_hi = tl.split(tl.reshape(vals, (BLOCK_N, BLOCK_K // 4, 2)))
        v_lo = v_lo.to(x_ptr.dtype.element_ty)  # int8 magnitudes <= 127 are exact in fp16/bf16
        v_hi = v_hi.to(x_ptr.dtype.element_ty)
        w = tl.where(slot_lo[:, :, None] == slot_ids[None, None, :], v_lo[:, :, None],
                     tl.where(slot_hi[:, :, None] == slot_ids[None, None, :], v_hi[:, :, None], 0))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))

        a = tl.load(x_ptrs, mask=mask_m[:, None] & ((k0 + offs_k) < K)[None, :], other=0)
        # fp32 accumulation; DOT_PRECISION only matters for fp32 operands.
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)

        x_ptrs += BLOCK_K * stride_xk
        v_ptrs += (BLOCK_K // 2) * stride_vk
        m_ptrs += (BLOCK_K // 32) * stride_mk

    # Epilogue in fp32: per-row INT8 scale (linear, so it commutes with the
    # split-K sum), then bias (added by split 0 only).
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc = acc + bias[None, :]

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # out is a zeroed fp32 buffer; the splits add their partial sums.
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


# M is not specialized (M == 1, M % 16): one compiled variant serves every
# batch size of a config, which keeps tuning's compile count down.
sparse24_matmul = triton.jit(_sparse24_matmul, do_not_specialize=["M"])
sparse24_matmul_interpreted = InterpretedKernel(_sparse24_matmul)

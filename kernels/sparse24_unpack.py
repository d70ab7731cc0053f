"""Triton kernel: a decode-layout 2:4 weight (16-bit, INT8 or INT4) written out dense, ``(R, C)``.

For prefill on CUDA where dense cuBLAS on the decompressed weight beats the prefill
kernel: one pass that reads the compressed weight and writes the dense one into a
scratch buffer, then one ``mm`` / ``addmm``. The layout read here is defined in
``sparse24.decode_format`` (its comment block); the launcher is
``sparse24.ops.linear24.launch.unpack_dense``.

* ``sparse24_unpack``: ``triton.jit``, for GPU tensors;
* ``sparse24_unpack_interpreted``: the same source in Triton's interpreter (CPU tensors).
"""
import triton
import triton.language as tl

from .interpreter import InterpretedKernel

__all__ = ["sparse24_unpack", "sparse24_unpack_interpreted"]


@triton.jit
def _int8_value(byte):
    """Sign-magnitude bytes (bit 7 sign, bits 0-6 |q|) -> q in float32."""
    byte = byte.to(tl.int32)
    mag = (byte & 127).to(tl.float32)
    return tl.where((byte & 128) != 0, -mag, mag)


@triton.jit
def _rounded(val, OUT: tl.constexpr):
    """float32 ``val`` (finite) rounded once to nearest even in ``OUT`` (float16 / bfloat16);
    bfloat16 by hand: the interpreter's cast truncates (the GPU's cvt.rn does this)."""
    if OUT == tl.bfloat16:
        bits = val.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return val.to(OUT)


def _sparse24_unpack(
    v_ptr, meta_ptr, scale_ptr, zero_ptr, out_ptr,
    R, C, NT, G, stride_ml, stride_or,
    INT8: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_A: tl.constexpr,
):
    # Grid: (NT, cdiv(KA, BLOCK_A)); a program writes row tile t (16 rows) for BLOCK_A atoms of
    # 64 columns: per atom 32 lanes x 8 groups g = 4 h + gg x 4 slots, as a 5-D tensor
    # (atom, lane, h, gg, slot) so that a lane's 8 16-bit values of half-atom h load as one vector.
    t = tl.program_id(0)
    a = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)[:, None, None, None, None]
    lane = tl.arange(0, 32)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    gg = tl.arange(0, 4)[None, None, None, :, None]
    s = tl.arange(0, 4)[None, None, None, None, :]
    in_a = a < tl.cdiv(C, 64)
    g = 4 * h + gg
    q, b = g // 2, g % 2
    i, j = lane // 4, lane % 4
    row = 16 * t + 8 * b + i
    col0 = 64 * a + 16 * q + 4 * j                                               # the group's first column
    col = col0 + s

    word = tl.load(meta_ptr + (t * 32 + lane) * stride_ml + a, mask=in_a, other=0)   # keep masks
    nib = (word >> (4 * g)) & 15                                                 # bits: slots 0, 1, 3, 2
    kept = ((nib >> (s ^ (s >> 1))) & 1) != 0
    natural = (nib & 3) | (((nib >> 3) & 1) << 2)                                # kept slots 0..2, in order
    below = natural & ((1 << s) - 1)                                             # kept slots under s
    first = ((below & 1) + ((below >> 1) & 1) + ((below >> 2) & 1)) == 0         # s is the lower kept slot
    # v0, v1: each group's lower and higher kept value in the output dtype, (A, 32, 2, 4, 1)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if INT8:
        # values[a, t, l, 4q + 2v + b]: sign-magnitude bytes; times the row's scale
        base = ((a * NT + t) * 32 + lane) * 16 + 4 * q + b
        sc = tl.load(scale_ptr + row, mask=row < R, other=0.0)
        v0 = _rounded(_int8_value(tl.load(v_ptr + base, mask=in_a, other=0)) * sc, OUT)
        v1 = _rounded(_int8_value(tl.load(v_ptr + base + 2, mask=in_a, other=0)) * sc, OUT)
    elif GROUP > 0:
        # INT4: word h of a lane's atom (values[a, t, l, 4h .. 4h + 3]) holds group (q = 2h + gg // 2,
        # b = gg % 2)'s code u of value v in nibble gg + 4v. (u - z) * s is exact in float32
        # (|u - z| <= 15, s 11 significant bits), so the one rounding gives what the kernels'
        # dot operand holds (sparse24_decode._int4_dequant)
        w = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + ((a * NT + t) * 32 + lane) * 2 + h, mask=in_a, other=0)
        c32 = 64 * a + 32 * h        # a quantization group (>= 32 columns) holds all 32 of these columns
        at = row.to(tl.int64) * G + c32 // GROUP
        ok = (row < R) & (c32 < C) & in_a
        sc = tl.load(scale_ptr + at, mask=ok, other=0.0)
        if scale_ptr.dtype.element_ty == tl.bfloat16:   # a module's exact bfloat16 copy: widen the bits
            sc = (sc.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        sc = sc.to(tl.float32)
        z = tl.load(zero_ptr + at, mask=ok, other=0).to(tl.int32) if HAS_ZERO else 8
        v0 = _rounded((((w >> (4 * gg)) & 15) - z).to(tl.float32) * sc, OUT)
        v1 = _rounded((((w >> (4 * gg + 16)) & 15) - z).to(tl.float32) * sc, OUT)
    else:
        # values[a, h, t, l, 2 gg + v]: a lane's 8 values of half-atom h, 16 contiguous bytes
        # (one 16-byte load where 16 two-byte gathers were: 30% fewer sm_90 instructions)
        a4, h4 = a.reshape(BLOCK_A, 1, 1, 1), h.reshape(1, 1, 2, 1)       # the slot and group axes dropped
        base = (((a4 * 2 + h4) * NT + t) * 32 + lane.reshape(1, 32, 1, 1)) * 8
        pair = tl.load(v_ptr + base + tl.arange(0, 8)[None, None, None, :],
                       mask=in_a.reshape(BLOCK_A, 1, 1, 1), other=0.0)               # (A, 32, 2, 8)
        v0, v1 = tl.split(pair.reshape(BLOCK_A, 32, 2, 4, 2))                    # (A, 32, 2, 4) each
        v0, v1 = v0[:, :, :, :, None], v1[:, :, :, :, None]
    val = tl.where(first, v0, v1)
    out = tl.where(kept, val, 0.0).to(OUT)
    tl.store(out_ptr + row.to(tl.int64) * stride_or + col, out, mask=(row < R) & (col < C) & in_a)


sparse24_unpack = triton.jit(_sparse24_unpack)
sparse24_unpack_interpreted = InterpretedKernel(_sparse24_unpack)

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
From BLOCK_M = 128 (``NATURAL``) the weight lanes decode what the wgmma's A
fragment holds with x in its own column order (``_decode_tile_natural``), so
x^T goes to the wgmma straight from the pipelined shared buffer and the wgmma
runs asynchronously; a 128-row tile multiplies each half-atom into its own
accumulator (``HALVES``), so Triton keeps three wgmma groups in flight and the
multiply runs under the next half's decode. A 128 x 256 tile (``SPLIT_N``, 8
warps) decodes and multiplies two 128-row halves of W into two accumulators
against one x tile: x crosses L2 once per 256 rows of W. Below 128 rows,
``_decode_tile`` with x permuted as the decode kernel does (less to load per
weight lane where few rows share it).

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

from .interpreter import (ASM_EMULATIONS, InterpretedKernel, bf16x2_cvt_reference, bf16x2_fma_reference,
                          f16x2_reference, triton_version)
from .sparse24_decode import (_ADD01, _ADD01_B0, _ADD01_B1, _ADD23, _ADD23_B0, _ADD23_B1, _MAGIC_F16,
                              _MUL01, _MUL01_B0, _MUL01_B1, _MUL23, _MUL23_B0, _MUL23_B1, _SEL_MASK, _SM_MASK,
                              _TWO_POW_24, _decode_tile, _epilogue, _BF16X2_MINUS_ZERO, _DEQUANT_BF16X2, _MUL_F16X2,
                              _SCALE_BF16X2, _f16x2, _half_word, _int4_group, _int4_rows, _prmt)

__all__ = ["sparse24_prefill", "sparse24_prefill_interpreted", "NATURAL_TRITON", "natural_tile", "int8_bf16_scaled",
           "int4_bf16_zero", "int4_bf16_scale", "int4_bf16_dequant",
           "int4_bf16_exact_scale", "int4_bf16_dequant_exact"]

# The natural-order tiles (``_decode_tile_natural``) where Triton compiles them well: from
# 3.9 at every BLOCK_M >= 128; 3.6 (the GPU image's) at 128 rows (two accumulators; 128 x 64:
# 255 registers, no spill, two programs per SM) and at 256 x 128 (8 warps, 2 stages: 222-246
# registers, no spill, one program alone tensor-bound; sm_90 SASS, docs/kernels.md). 3.6's
# 256 x 64 natural tiles spill, so they stay permuted there, as every tile before 3.6 (not
# compiled for sm_90 here).
_TRITON = triton_version()
NATURAL_TRITON = _TRITON >= (3, 9)


def natural_tile(block_m: int, block_n: int) -> bool:
    """Whether the kernel decodes a BLOCK_M x BLOCK_N tile in x's own column order with the
    installed Triton: its constexpr ``NATURAL``, which the launcher sets from this."""
    return block_m >= 128 and (NATURAL_TRITON or (_TRITON >= (3, 6) and (block_m == 128 or block_n == 128)))


def _pair_add(add: tl.constexpr) -> tl.constexpr:
    """A selector's ADD for both groups of a pair at once, as int32 (sparse24_decode._selector_pair)."""
    return tl.constexpr(add.value * 0x10001 - ((add.value >> 15) << 32))


_PA01, _PA23 = _pair_add(_ADD01), _pair_add(_ADD23)
_PA01_B0, _PA23_B0, _PA01_B1, _PA23_B1 = map(_pair_add, (_ADD01_B0, _ADD23_B0, _ADD01_B1, _ADD23_B1))
# INT4 in x's own order (_decode_tile_natural): each byte permute reads the codes straight from
# the value word (group (qq, b)'s two codes are nibble b of bytes qq and qq + 2), unkept slots
# z from Zb (z in every nibble), and one AND-OR then keeps nibble b of each half and writes the
# magic high byte. So only nibbles 0 and 2 of a selector matter, and one multiply-add of
# f = x0 | x1 << 4 (the fields of groups b = 0 and 1) makes both groups' selectors: nibbles 0, 2
# and 1, 3 ((x MUL + ADD) & 7 each, no carry between nibbles), with S in 0..0xFFFF for every
# (x0, x1), so both half-atoms' fit in one word as before: four selectors per multiply-add
# (16-bit and INT8 weights need all four nibbles: two). qq = 1 (bytes 1, 3): ADD + 0x1111.
# Found by a search nibble by nibble; tests/kernels/test_int4_kernel.py checks every keep pattern.
_MUL01_NI4, _ADD01_NI4 = tl.constexpr(0x01FC), tl.constexpr(0x44CC)
_MUL23_NI4, _ADD23_NI4 = tl.constexpr(-0x0402), tl.constexpr(0xEE66)
_PA01_NI4, _PA23_NI4 = _pair_add(_ADD01_NI4), _pair_add(_ADD23_NI4)
# The high nibbles' codes stay in place, 1024 + 16 u (float16 / float32 x; bfloat16's 7 mantissa bits
# could not hold 16 u: int4_bf16_dequant), so no shift; u - z = fma(d, m, c) on whole
# words, exact: m = 1 or 1/16, c = -(1024 + z) or -(64 + z) (float16 pairs, z <= 15 added to the
# mantissa).
_FMA_F16X2 = tl.constexpr("fma.rn.f16x2 $0, $1, $2, $3;")
ASM_EMULATIONS[_FMA_F16X2.value] = f16x2_reference("fma")
_ONE, _SIXTEENTH = tl.constexpr(0x3C003C00), tl.constexpr(0x2C002C00)
_NEG_1024, _NEG_64 = tl.constexpr(0xE400E400 - 2 ** 32), tl.constexpr(0xD400D400 - 2 ** 32)
# INT8 with bfloat16 x in x's own order: the sign-magnitude lanes (sign in bit 15, |v| in bits 0-6)
# are bfloat16 subnormals, v * 2**-133; one fma by 2**126 (plus -0: sm_80 has no bf16x2 mul) makes
# them v * 2**-7 exactly, and the epilogue's scale carries the 2**7 (as it carries 2**24 for float16). Two
# instructions per register pair (an AND, this fma), where y - c took three (int8_bf16_words: two
# LOP3 and a subtraction). Exact wherever |x| >= 2**-119 (a product then stays a normal float32).
_FMA_BF16X2 = tl.constexpr("fma.rn.bf16x2 $0, $1, $2, $3;")
ASM_EMULATIONS[_FMA_BF16X2.value] = bf16x2_fma_reference
_BF16X2_TWO_POW_126 = tl.constexpr(0x7E807E80)
_TWO_POW_7 = tl.constexpr(128.0)


@triton.jit
def _bf16x2_times(d, factor: tl.constexpr):
    # bfloat16 pairs (int32 words) times the bfloat16 pair ``factor``, one fma.rn.bf16x2 (+ -0)
    return tl.inline_asm_elementwise(_FMA_BF16X2, "=r,r,r,r", [d, tl.zeros_like(d) + factor,
                                                                tl.zeros_like(d) + _BF16X2_MINUS_ZERO],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def int8_bf16_scaled(d):
    """Sign-magnitude INT8 lanes of int32 words (sign in bit 15, |v| in bits 0-6, two per word, as
    the byte permute and the AND leave them) -> bfloat16 pairs holding v * 2**-7 exactly."""
    return _bf16x2_times(d, _BF16X2_TWO_POW_126)


# INT4 with bfloat16 x in x's own order: after the AND a code sits in its half as u (b = 0) or 16 u
# (b = 1) with exponent field 0 or 1, where bfloat16 is linear: n * 2**-133 for n < 256. One fma by
# 2**126 or 2**122 plus -z * 2**-7 gives t = (u - z) * 2**-7 exactly (no shift of the high nibbles:
# bfloat16's 7 mantissa bits could not take 1024 + 16 u as float16's do); then the scale as
# _int4_dequant does, exactly rounded once: s * 2**7 = hi + lo, t * lo exact, t * hi + that.
# The three fma.rn.bf16x2 of _DEQUANT_BF16X2 with its first operands reordered (t = d * m + C).
_BF16X2_TWO_POW_122 = tl.constexpr(0x7C807C80)
_BF16X2_MINUS_TWO_POW_126 = tl.constexpr(0xFE80FE80 - 2 ** 32)
# float32 -> bfloat16 in both halves of a word in one instruction (F2FP): Triton's .to(tl.bfloat16)
# and a pack of the halves took two more per scale (Triton 3.6, 128 x 256 x 128: alone 2078 -> 2048)
_CVT_BF16X2 = tl.constexpr("cvt.rn.bf16x2.f32 $0, $1, $1;")
ASM_EMULATIONS[_CVT_BF16X2.value] = bf16x2_cvt_reference


@triton.jit
def _bf16x2_of(s):
    # float32 -> int32 words holding bf16(s) in both halves (_CVT_BF16X2)
    return tl.inline_asm_elementwise(_CVT_BF16X2, "=r,f", [s], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def int4_bf16_zero(Z):
    """Zero-point words (z in both 16-bit halves: _int4_group with magic 0) -> -z * 2**-7 in both
    bfloat16 halves: z read as a subnormal, times -2**126 (exact)."""
    return _bf16x2_times(Z, _BF16X2_MINUS_TWO_POW_126)


@triton.jit
def int4_bf16_scale(sc):
    """float16 scales -> the bfloat16 words (both halves) of s * 2**7 = hi + lo: hi = bf16(s * 2**7),
    lo the rest, exact (float16's 11 significant bits are 8 + 3)."""
    s = sc.to(tl.float32) * 128.0
    hi = _bf16x2_of(s)
    return hi, _bf16x2_of(s - (hi & -65536).to(tl.float32, bitcast=True))


@triton.jit
def int4_bf16_dequant(d, b, C, HI, LO):
    """INT4 codes after the byte permute and AND (u in bits 0-3 of each half where b = 0, in bits
    4-7 where b = 1; z for unkept slots), a group's int4_bf16_zero word C and its int4_bf16_scale
    words HI, LO -> bfloat16 pairs holding (u - z) * s exactly rounded once (int32 words)."""
    m = tl.where(b == 1, _BF16X2_TWO_POW_122, _BF16X2_TWO_POW_126)
    return tl.inline_asm_elementwise(_DEQUANT_BF16X2, "=r,r,r,r,r,r,r",
                                     [C, d, HI, LO, tl.zeros_like(d) + m, tl.zeros_like(d) + _BF16X2_MINUS_ZERO],
                                     dtype=tl.int32, is_pure=True, pack=1)


# Scales that bfloat16 holds exactly (a module's bfloat16 copy: format.bf16_exact_scales) skip the
# split: t = d * m + C as above, then t * S + -0 with S = s * 2**7 (exact), one rounding, two fma
# per register pair against three (_SCALE_BF16X2, operands reordered as above; Triton 3.6, 128 x
# 256 x 128: t_issue 2080 -> 1886 per 2048 clocks of tensor work; 3.9, 128 x 256 x 64: one
# program alone 1190 -> 1070 per 1024).


@triton.jit
def int4_bf16_exact_scale(sc):
    """bfloat16 scales -> bfloat16 words (both halves) of s * 2**7, exact."""
    return _bf16x2_of(sc.to(tl.float32) * 128.0)


@triton.jit
def int4_bf16_dequant_exact(d, b, C, S):
    """:func:`int4_bf16_dequant` for a scale bfloat16 holds: its int4_bf16_exact_scale words S."""
    m = tl.where(b == 1, _BF16X2_TWO_POW_122, _BF16X2_TWO_POW_126)
    return tl.inline_asm_elementwise(_SCALE_BF16X2, "=r,r,r,r,r,r",
                                     [C, d, S, tl.zeros_like(d) + m, tl.zeros_like(d) + _BF16X2_MINUS_ZERO],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pair_constant(hh, b, C01_0: tl.constexpr, C23_0: tl.constexpr, C01_1: tl.constexpr, C23_1: tl.constexpr):
    # A selector constant of this lane's dense half hh (0: slots 0, 1; 1: slots 3, 2) of row half b's group
    return tl.where(hh == 1, tl.where(b == 1, C23_1, C23_0), tl.where(b == 1, C01_1, C01_0))


@triton.jit
def _int4_rows_natural(scale_ptr, zero_ptr, t0, N, G, T: tl.constexpr):
    # INT4, natural order: scale and zero-point pointers at quantization group 0 of rows
    # 16 t + 8 b + i for lane 4i + 2jlo + hh, [1, 1, b, T, i, jlo, hh] (_int4_rows: the padding
    # rows clamped). Every thread dimension in the pointers and last, so each lane loads its own
    # rows' values into registers (with b last, Triton spread b over lanes and copied the
    # decoded W through shared memory to the wgmma).
    ib = tl.arange(0, 2)[None, None, :, None, None, None, None]
    it = tl.arange(0, T)[None, None, None, :, None, None, None]
    ii = tl.arange(0, 8)[None, None, None, None, :, None, None]
    ij = tl.arange(0, 2)[None, None, None, None, None, :, None]
    ihh = tl.arange(0, 2)[None, None, None, None, None, None, :]
    r = tl.minimum((t0 + it) * 16 + ib * 8 + ii + 0 * (ij + ihh), N - 1).to(tl.int64) * G
    return scale_ptr + r, zero_ptr + r


@triton.jit
def _decode_tile_natural(acc, acc2, xm, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, G, x_half, v_half,
                         MASKED: tl.constexpr, INT8: tl.constexpr, W_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr, INT4: tl.constexpr,
                         GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    # One K-tile with x in its own column order (no permutation, so Triton's wgmma reads
    # x^T straight from the pipelined shared buffer and runs asynchronously): lane
    # 4i + 2jlo + hh of the dot's A fragment holds dense columns 2(2jlo + hh) + c and
    # 8 + 2(2jlo + hh) + c of every 16-column chunk, i.e. half hh of groups jlo and
    # jlo + 2, which the layout gives lanes 4i + jlo and 4i + jlo + 2 (s = 0, 1): each
    # lane reads those two lanes' words and byte-permutes one dense half of each group
    # (the same selectors as _decode_tile, the half's pair chosen per lane).
    # Tensors are [A, h, s, T, i, jlo, hh, qq, b] (chunk q = 2h + qq; row i + 8b of tile T):
    # the thread dimensions (i, jlo, hh) last but the per-thread words, so that the loads'
    # layout puts lane 4i + 2jlo + hh's words in that lane.
    # HALVES == 2: each half-atom h is decoded and multiplied on its own, into acc (h = 0)
    # and acc2 (h = 1): with two accumulators Triton keeps up to three wgmma groups in flight
    # (not one), so the tensor cores run under the next half's decode even with one program
    # per SM (docs/kernels.md, "Prefill path"). x_ptrs then covers the h = 0 columns
    # (x_half: on to h = 1), v_ptrs (16-bit) the h = 0 words (v_half: on to h = 1).
    A: tl.constexpr = BLOCK_K // 64
    T: tl.constexpr = BLOCK_N // 16
    ok_a = (a0 + tl.arange(0, A)) < KA
    ok_v = ok_a[:, None, None, None, None, None, None, None]
    if MASKED:
        mw = tl.load(m_ptrs, mask=ok_a[:, None, None, None, None, None, None], other=0)   # [A, 1, s, T, i, jlo, hh]
    else:
        mw = tl.load(m_ptrs)
    if INT8 or INT4:   # INT8 [A, 1, s, T, i, jlo, hh, q]: word q = 2h + qq holds groups (q, b = 0, 1)
        wv = tl.load(v_ptrs, mask=ok_v, other=0) if MASKED else tl.load(v_ptrs)
    mw = mw[:, :, :, :, :, :, :, None, None]
    iq = tl.arange(0, 2)[None, None, None, None, None, None, None, :, None]
    ib = tl.arange(0, 2)[None, None, None, None, None, None, None, None, :]
    hh = tl.arange(0, 2)[None, None, None, None, None, None, :, None, None]
    XT: tl.constexpr = x_ptrs.dtype.element_ty
    SCALE_BF16: tl.constexpr = s_rows.dtype.element_ty == tl.bfloat16   # (INT4: exact bfloat16 scales)
    # INT4 permutes the value word itself (_MUL01_NI4): with bfloat16 x too since the codes are read
    # as bfloat16 subnormals (int4_bf16_dequant: no shift of the high nibbles; Triton 3.6, 128 x 256,
    # one program alone 1294 -> 1126 clocks per K-tile; building code words first, as _decode_tile
    # does, took one shift and AND-OR per register pair)
    if INT4:   # this lane's half (slots 0,1 or 3,2) of groups (qq, b = 0, 1), both half-atoms
        f = (mw >> (8 * iq + 2 * hh)) & 0x00330033                       # [..., qq, 1]
    else:     # this lane's half of group (qq, b), both half-atoms
        f = (mw >> ((2 * iq + ib) * 4 + 2 * hh)) & 0x30003
    if INT4:
        # [A, 1, s, T, i, jlo, hh, word h]: group (h, qq, b)'s codes are nibbles 2qq + b and
        # 2qq + b + 4 of word h (_decode_tile); the zero words Z hold z in both halves. Scales
        # and zero points depend on the rows (T, i, b) and the quantization group (the atom; with
        # groups of 32, also h).
        wv = tl.reshape(wv, [A, 2, T, 8, 2, 2, 2])                           # [A, s, T, i, jlo, hh, h]
        ia = tl.arange(0, A)[:, None, None, None, None, None, None]
        if GROUP == 32:
            kq = (a0 + ia) * 2 + tl.arange(0, 3 - HALVES)[None, :, None, None, None, None, None]   # [A, h, ...]
        else:
            kq = (a0 + ia) // (GROUP // 64)
        # four selectors per multiply-add: b = 1's in nibbles 1 and 3, h = 1's 16 bits up
        mul = tl.where(hh == 1, _MUL23_NI4, _MUL01_NI4)
        add = tl.where(hh == 1, _PA23_NI4, _PA01_NI4) + iq * 0x11111111
        WT: tl.constexpr = tl.bfloat16 if XT == tl.bfloat16 else tl.float16
    elif INT8:
        mul = _pair_constant(hh, ib, _MUL01_B0, _MUL23_B0, _MUL01_B1, _MUL23_B1)
        add = _pair_constant(hh, ib, _PA01_B0, _PA23_B0, _PA01_B1, _PA23_B1)
        WT: tl.constexpr = tl.bfloat16 if XT == tl.bfloat16 else tl.float16
        wv = tl.reshape(wv, [A, 2, T, 8, 2, 2, 2, 2])                        # [A, s, T, i, jlo, hh, h, qq]
    else:
        mul = tl.where(hh == 1, _MUL23, _MUL01)
        add = tl.where(hh == 1, _PA23, _PA01)
        WT: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    sel = (f * mul + add) & _SEL_MASK          # both half-atoms' selectors, h = 1's in the high 16 bits
    for H in tl.static_range(HALVES):
        # P: the words of half-atom H (HALVES == 2) or of both, [A, h, s, T, i, jlo, hh, qq, b]
        if HALVES == 2:
            if INT4:
                P = tl.split(wv)[H][:, None, :, :, :, :, :, None, None]
            elif INT8:
                P = tl.split(tl.permute(wv, [0, 1, 2, 3, 4, 5, 7, 6]))[H][:, None, :, :, :, :, :, :, None]
            else:
                wh = tl.load(v_ptrs + H * v_half, mask=ok_v, other=0) if MASKED else tl.load(v_ptrs + H * v_half)
                P = tl.reshape(wh, [A, 1, 2, T, 8, 2, 2, 2, 2])                # words 2qq + b
            sh = sel >> (16 * H + (4 * ib if INT4 else 0))
        else:
            if INT4:
                P = tl.permute(wv, [0, 6, 1, 2, 3, 4, 5])[:, :, :, :, :, :, :, None, None]
            elif INT8:
                P = tl.permute(wv, [0, 6, 1, 2, 3, 4, 5, 7])[:, :, :, :, :, :, :, :, None]
            else:
                # the half-atoms joined as a trailing dimension, as INT8's words: a plain reshape of the
                # [A, h, s, T, 8, 2, 2, 4] load made Triton 3.6 copy W through shared memory (ldmatrix)
                wv = tl.load(v_ptrs, mask=ok_v, other=0) if MASKED else tl.load(v_ptrs)
                h0, h1 = tl.split(tl.permute(wv, [0, 2, 3, 4, 5, 6, 7, 1]))      # [A, s, T, 8, 2, 2, 4] each
                P = tl.permute(tl.reshape(tl.join(h0, h1), [A, 2, T, 8, 2, 2, 2, 2, 2]), [0, 8, 1, 2, 3, 4, 5, 6, 7])
            ih = tl.arange(0, 2)[None, :, None, None, None, None, None, None, None]
            sh = sel >> (16 * ih + (4 * ib if INT4 else 0))
        if INT4:
            if H == 0 or GROUP == 32:   # half H's quantization group (the same for both halves unless 32)
                Z, sc = _int4_group(s_rows, z_rows, kq + H if GROUP == 32 else kq,
                                    ok_a[:, None, None, None, None, None, None], G, MASKED, HAS_ZERO,
                                    0)                                       # [A, h or 1, b, T, i, jlo, hh]
                # (magic 0: Z holds z in both halves, so Zb and C are one multiply-add each, no mask)
                Z = tl.permute(Z, [0, 1, 3, 4, 5, 6, 2])[:, :, None, :, :, :, :, None, :]
                sc = tl.permute(sc, [0, 1, 3, 4, 5, 6, 2])[:, :, None, :, :, :, :, None, :]
                Zb = Z * 0x1111   # z in every nibble (Z: z in both halves)
                if XT == tl.bfloat16:
                    C = int4_bf16_zero(Z)
                    if SCALE_BF16:
                        HI = int4_bf16_exact_scale(sc)
                    else:
                        HI, LO = int4_bf16_scale(sc)
                else:   # -(1024 + z) (b = 0), -(64 + z) (b = 1) in both float16 halves
                    C = Z * tl.where(ib == 1, 0x10, 0x1) + tl.where(ib == 1, _NEG_64, _NEG_1024)
            # the code masks are runtime values (KA >> 31 is 0, see _decode_tile's INT8 mask): as constants,
            # ptxas put them in a register afresh (IMAD.MOV) before every AND-OR
            if XT == tl.bfloat16:
                d = _prmt(P, Zb, sh) & (0x000F000F << (ib * 4 + (KA >> 31)))
                d = int4_bf16_dequant_exact(d, ib, C, HI) if SCALE_BF16 else int4_bf16_dequant(d, ib, C, HI, LO)
            else:   # u - z exactly: (1024 + u) - (1024 + z), (1024 + 16 u) / 16 - (64 + z); then the scale
                d = (_prmt(P, Zb, sh) & (0x000F000F << (ib * 4 + (KA >> 31)))) | _MAGIC_F16
                d = tl.inline_asm_elementwise(_FMA_F16X2, "=r,r,r,r", [d, tl.where(ib == 1, _SIXTEENTH, _ONE), C],
                                              dtype=tl.int32, is_pure=True, pack=1)
                if XT == tl.float16:
                    d = _f16x2(_MUL_F16X2, d, _half_word(sc))
        else:
            d = _prmt(P, tl.zeros([1, 1, 1, 1, 1, 1, 1, 1, 1], tl.int32), sh)
        if INT8:
            d = d & (_SM_MASK | (KA >> 31))   # a runtime mask: see _decode_tile
        if INT8 and XT == tl.bfloat16:
            d = int8_bf16_scaled(d)
        if INT4 and XT == tl.float32:  # u - z in float16, the scale in float32 (exact), as _decode_tile
            s32 = sc.to(tl.float32)
            w = tl.join((d & 0xFFFF).to(tl.int16).to(WT, bitcast=True).to(XT) * s32,
                        (d >> 16).to(tl.int16).to(WT, bitcast=True).to(XT) * s32)
        else:
            w = tl.join((d & 0xFFFF).to(tl.int16).to(WT, bitcast=True), (d >> 16).to(tl.int16).to(WT, bitcast=True))
        # [A, h, s, T, i, jlo, hh, qq, b, c] -> rows (T, b, i), columns (A, h, qq, s, jlo, hh, c)
        w = tl.reshape(tl.permute(w, [3, 8, 4, 0, 1, 7, 2, 5, 6, 9]), [BLOCK_N, BLOCK_K // HALVES])
        if HALVES == 2:   # (HALVES == 1: the caller loaded x, which both halves of a 256-row tile share)
            xm = _load_x(x_ptrs + H * x_half, k0, K, MASKED, H, HALVES, BLOCK_K)
        if INT8 and XT == tl.float32:  # fp32 dots: scale the fp16 subnormals back to the integers, exactly
            w = w.to(tl.float32) * _TWO_POW_24
        elif WT != XT:
            w = w.to(XT)
        if H == 0:
            acc = tl.dot(w, tl.trans(xm), acc, input_precision=DOT_PRECISION)
        else:
            acc2 = tl.dot(w, tl.trans(xm), acc2, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _tree_split_k(acc, acc2, ws_ptr, count_ptr, tile, pid_k, nsplit, ROWS: tl.constexpr, COLS: tl.constexpr,
                  TWO: tl.constexpr):
    # Split-K inside the one launch over nsplit splits (a power of two up to 16, a runtime value),
    # summed as a pairwise tree. On level l the program holding group g's sum (splits g 2**l to
    # (g + 1) 2**l - 1) stores it in slot g 2**l of the output tile's workspace (ws_ptr: [tiles,
    # nsplit, 1 + TWO, ROWS, COLS] fp32; acc2 too where TWO), then takes the counter of the node
    # joining groups g and g ^ 1 (count_ptr: [tiles, nsplit], node (nsplit >> (l + 1)) + (g >> 1),
    # zero between launches): the second to arrive adds the other group's sum, resets the counter
    # and goes on up; the first is done. The one that is second at the root writes the output.
    # Each node adds its two halves and a + b == b + a exactly, so the sum has the same bits
    # whatever the arrival order (deterministic), and no program waits for another. On the
    # critical path a store and a load per level, 2 log2 nsplit partial tiles (TWO: half a tile
    # more, acc2 read back), where the last program adding every split's moved nsplit + 1
    # (prefill_model.reduction_tiles). Returns (acc, acc2, whether to write the output).
    SIZE: tl.constexpr = ROWS * COLS
    SLOT: tl.constexpr = (1 + TWO) * SIZE
    ws_ptr += tile.to(tl.int64) * nsplit * SLOT
    count_ptr += tile.to(tl.int64) * nsplit
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    levels = (nsplit > 1).to(tl.int32) + (nsplit > 2).to(tl.int32) + (nsplit > 4).to(tl.int32) \
        + (nsplit > 8).to(tl.int32)
    live = pid_k >= 0
    # a loop of a runtime count, not unrolled: unrolled, each level held more registers (Triton
    # 3.9, INT4 128 x 128 at split 8: 255 registers and 160 B spilled, against 227 and none)
    for lvl in range(0, levels):
        if live:
            g = pid_k >> lvl
            mine = ws_ptr + (g << lvl) * SLOT
            tl.store(mine + offs, acc, cache_modifier=".cg")
            if TWO:
                tl.store(mine + SIZE + offs, acc2, cache_modifier=".cg")
            tl.debug_barrier()  # all threads' sums are stored before the counter releases them
            node = count_ptr + (nsplit >> (lvl + 1)) + (g >> 1)
            live = tl.atomic_add(node, 1, sem="acq_rel", scope="gpu") == 1
            if live:
                other = ws_ptr + ((g ^ 1) << lvl) * SLOT
                acc += tl.load(other + offs, cache_modifier=".cg")
                if TWO:   # acc2 read back, not held across the atomic beside acc and a loaded tile (the
                    # wide tile then spilled 56-96 B, outside the main loop but the defaults take no spill)
                    acc2 = tl.load(mine + SIZE + offs, cache_modifier=".cg") + tl.load(other + SIZE + offs,
                                                                                     cache_modifier=".cg")
                tl.store(node, 0)  # ready for the next launch
    return acc, acc2, live


@triton.jit
def _load_x(x_ptrs, k0, K, MASKED: tl.constexpr, H: tl.constexpr, HALVES: tl.constexpr, BLOCK_K: tl.constexpr):
    # x's [BLOCK_M, BLOCK_K // HALVES] columns of half-atom H (HALVES == 2) or of the whole K-tile
    if MASKED:
        j = tl.arange(0, BLOCK_K // HALVES)
        offs_k = k0 + (j + (j // 32 + H) * 32 if HALVES == 2 else j)   # half H: columns 64a + 32H + c
        return tl.load(x_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    return tl.load(x_ptrs)


@triton.jit
def _k_tile(acc, acc2, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, s_rows2, z_rows2, G, x_half, v_half,
            v_sub, m_sub, MASKED: tl.constexpr, NATURAL: tl.constexpr, HALVES: tl.constexpr, SPLIT_N: tl.constexpr,
            INT8: tl.constexpr, W_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    # One K-tile of either decode (the pointers were laid out for it by the kernel).
    # BLOCK_N: the rows of W one decode covers (SPLIT_N == 2: half the program's; the second
    # half's pointers are v_sub / m_sub on, its INT4 rows s_rows2 / z_rows2, into acc2).
    if NATURAL and HALVES == 2:
        acc, acc2 = _decode_tile_natural(acc, acc2, acc, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, G,
                                         x_half, v_half, MASKED, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K,
                                         HALVES, INT4, GROUP, HAS_ZERO)
    elif NATURAL:
        xm = _load_x(x_ptrs, k0, K, MASKED, 0, 1, BLOCK_K)
        acc, _ = _decode_tile_natural(acc, acc, xm, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, G,
                                      x_half, v_half, MASKED, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, 1, INT4,
                                      GROUP, HAS_ZERO)
        if SPLIT_N == 2:
            acc2, _ = _decode_tile_natural(acc2, acc2, xm, x_ptrs, v_ptrs + v_sub, m_ptrs + m_sub, k0, K, a0, KA,
                                           s_rows2, z_rows2, G, x_half, v_half, MASKED, INT8, W_BF16, DOT_PRECISION,
                                           BLOCK_N, BLOCK_K, 1, INT4, GROUP, HAS_ZERO)
    else:
        acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, G, MASKED, INT8, W_BF16,
                           DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
    return acc, acc2


def _sparse24_prefill(
    x_ptr, v_ptr, meta_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, KA, KM,
    stride_xm, stride_xk,
    stride_om, stride_on,
    INT8: tl.constexpr, W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATURAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # NATURAL: x in its own column order (_decode_tile_natural), from 128 rows of x: there the
    # permuted copy of x it saves outweighs reading two lanes' words per weight lane
    # (natural_tile: which tiles, by Triton version).
    A: tl.constexpr = BLOCK_K // 64
    # BLOCK_N = 256 (natural, 8 warps): two 128-row halves of W, each decoded and multiplied
    # on its own into its own accumulator (acc, acc2) against the one x tile both share, so
    # the first half's wgmma runs under the second half's decode and x crosses L2 once per
    # 256 rows of W (docs/kernels.md, "Prefill path").
    SPLIT_N: tl.constexpr = 2 if BLOCK_N == 256 else 1
    tl.static_assert(SPLIT_N == 1 or (NATURAL and BLOCK_M == 128), "BLOCK_N 256: 128 rows of x in its own order")
    SUB_N: tl.constexpr = BLOCK_N // SPLIT_N
    T: tl.constexpr = SUB_N // 16
    # Two accumulators for the two half-atoms (_decode_tile_natural's HALVES) where both fit
    # beside the decode: BLOCK_M x BLOCK_N / (32 num_warps) = BLOCK_M / 2 registers each
    # (num_warps = BLOCK_N / 16).
    HALVES: tl.constexpr = 2 if NATURAL and BLOCK_M <= 128 and SPLIT_N == 1 else 1
    v_ptr = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # values read as 32-bit words
    # Grid: (output tiles, SPLIT_K). Grouped order (Triton tutorial 03): GROUP_M consecutive
    # x-blocks walk the same W columns, so a decoded program's weight tiles are re-read from L2.
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
    t0 = pid_n * (BLOCK_N // 16)
    # The second half's first row tile: past the padded rows (N % 256 in 1..128) it re-reads
    # the last 128 rows, whose results past N are never stored.
    t_sub = tl.minimum(t0 + T, NT - T) - t0
    n_full = K // BLOCK_K  # full K-tiles; a partial tile (K % BLOCK_K) runs once after the loop
    if SPLIT_K > 1:
        # Split-K (where the output tiles alone would leave SMs idle; _tree_split_k): split pid_k owns
        # whole K-tiles [k_lo, k_hi), possibly none; the partial tile belongs to the last split.
        pid_k = tl.program_id(1)
        # the split count as a runtime value (the grid's y, SPLIT_K): every factor compiles to the
        # same code, so the cost table's split-2 row measures them all
        tl.static_assert(SPLIT_K <= 16 and (SPLIT_K & (SPLIT_K - 1)) == 0, "SPLIT_K: a power of two up to 16")
        nsplit = tl.num_programs(1)
        per_split = ((K + BLOCK_K - 1) // BLOCK_K + nsplit - 1) // nsplit
        k_lo = pid_k * per_split
        k_hi = tl.minimum(k_lo + per_split, n_full)
        k_partial = (n_full * BLOCK_K < K) & (n_full >= k_lo) & (n_full < k_lo + per_split)
        # On to this split's first K-tile: the scalar bases move (the loop then compiles as
        # the unsplit one; moving the per-thread pointers instead cost 11-27 integer
        # instructions per K-tile, the loop's pointer steps no longer folded).
        x_ptr += (k_lo * BLOCK_K).to(tl.int64) * stride_xk
        v_ptr += k_lo.to(tl.int64) * (A * (64 if INT4 else 128 if INT8 else 256)) * NT
        meta_ptr += k_lo * A
    else:
        k_lo = 0
        k_hi = n_full
        k_partial = n_full * BLOCK_K < K

    atoms = tl.arange(0, A).to(tl.int64)
    lanes = tl.arange(0, T * 128)  # T row tiles x 32 lanes x 4 words, contiguous
    if NATURAL:
        # Lane 4i + 2jlo + hh reads the words of lanes 4i + jlo + 2s (_decode_tile_natural), one
        # 16-byte load per source lane (and half-atom h for 16-bit weights; INT4: 8 bytes):
        # [A, h, s, T, i, jlo, hh, 4 words] (16-bit: words 2qq + b; INT8: [A, 1, ...], words q;
        # INT4: [A, 1, ..., 2 words], words h).
        src = (2 * tl.arange(0, 2)[None, :, None, None, None, None]
               + tl.arange(0, T)[None, None, :, None, None, None] * 32
               + tl.arange(0, 8)[None, None, None, :, None, None] * 4
               + tl.arange(0, 2)[None, None, None, None, :, None]
               + 0 * tl.arange(0, 2)[None, None, None, None, None, :])           # [1, s, T, i, jlo, hh]
        a8 = atoms[:, None, None, None, None, None, None, None]
        w4 = tl.arange(0, 4)[None, None, None, None, None, None, None, :]
        if INT4:
            v_ptrs = (v_ptr + (a8 * NT + t0) * 64 + src[:, None, :, :, :, :, :, None] * 2
                      + tl.arange(0, 2)[None, None, None, None, None, None, None, :])
            V_STEP: tl.constexpr = A * 64
        elif INT8:
            v_ptrs = v_ptr + (a8 * NT + t0) * 128 + src[:, None, :, :, :, :, :, None] * 4 + w4
            V_STEP: tl.constexpr = A * 128
        else:
            h = tl.arange(0, 3 - HALVES)[None, :, None, None, None, None, None, None]   # HALVES == 2: h = 0 only
            v_ptrs = (v_ptr + ((a8 * 2 + h) * NT + t0) * 128
                      + src[:, None, :, :, :, :, :, None] * 4 + w4)
            V_STEP: tl.constexpr = A * 256
        m_ptrs = meta_ptr + (t0 * 32 + src[:, None, :, :, :, :, :]).to(tl.int64) * KM \
            + atoms[:, None, None, None, None, None, None]                          # [A, 1, s, T, i, jlo, hh]
    elif INT4:  # 8 bytes per lane and atom
        v_ptrs = v_ptr + (atoms[:, None] * NT + t0) * 64 + tl.arange(0, T * 64)[None, :]   # [A, T*64]
        V_STEP: tl.constexpr = A * 64
    elif INT8:
        v_ptrs = v_ptr + (atoms[:, None] * NT + t0) * 128 + lanes[None, :]                  # [A, T*128]
        V_STEP: tl.constexpr = A * 128
    else:
        v_ptrs = (v_ptr + ((atoms[:, None, None] * 2 + tl.arange(0, 2)[None, :, None]) * NT + t0) * 128
                  + lanes[None, None, :])                                                  # [A, 2, T*128]
        V_STEP: tl.constexpr = A * 256
    if not NATURAL:
        m_ptrs = meta_ptr + (t0 * 32 + tl.arange(0, T * 32)).to(tl.int64)[:, None] * KM + atoms[None, :]  # [T*32, A]
    G = (K + GROUP - 1) // GROUP   # INT4: quantization groups per row
    s_rows2, z_rows2 = scale_ptr, zero_ptr
    if INT4 and NATURAL:
        s_rows, z_rows = _int4_rows_natural(scale_ptr, zero_ptr, t0, N, G, T)
        if SPLIT_N == 2:
            s_rows2, z_rows2 = _int4_rows_natural(scale_ptr, zero_ptr, t0 + t_sub, N, G, T)
    elif INT4:
        s_rows, z_rows = _int4_rows(scale_ptr, zero_ptr, t0, N, G, T)
    else:
        s_rows, z_rows = scale_ptr, zero_ptr
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1).to(tl.int64)   # rows past M: clamped, never stored
    cols = tl.arange(0, BLOCK_K // HALVES)
    if HALVES == 2:   # the h = 0 columns of each atom: 64a + c, c < 32
        cols += cols // 32 * 32
    x_ptrs = x_ptr + rows[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xk
    x_half = tl.cast(stride_xk, tl.int64) * 32   # HALVES == 2: on to the h = 1 columns and words
    v_half = NT * 128
    v_sub = t_sub * (64 if INT4 else 128)   # SPLIT_N == 2: the second half's words and metadata
    m_sub = (t_sub * 32).to(tl.int64) * KM
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K  # a transposed x has stride_xk = M: int64 steps

    # One decode per weight tile for all BLOCK_M rows of x (the decode kernel: 16).
    acc = tl.zeros((SUB_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((SUB_N, BLOCK_M) if HALVES == 2 or SPLIT_N == 2 else (1, 1), dtype=tl.float32)
    for kt in range(k_lo, k_hi):
        acc, acc2 = _k_tile(acc, acc2, x_ptrs, v_ptrs, m_ptrs, kt * BLOCK_K, K, kt * A, KA, s_rows, z_rows, s_rows2,
                            z_rows2, G, x_half, v_half, v_sub, m_sub, False, NATURAL, HALVES, SPLIT_N, INT8, W_BF16,
                            DOT_PRECISION, SUB_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
        v_ptrs += V_STEP * NT
        m_ptrs += A
        x_ptrs += x_step
    if k_partial:
        acc, acc2 = _k_tile(acc, acc2, x_ptrs, v_ptrs, m_ptrs, n_full * BLOCK_K, K, n_full * A, KA, s_rows, z_rows,
                            s_rows2, z_rows2, G, x_half, v_half, v_sub, m_sub, True, NATURAL, HALVES, SPLIT_N, INT8,
                            W_BF16, DOT_PRECISION, SUB_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
    if HALVES == 2:
        acc += acc2
    write = True
    if SPLIT_K > 1:
        acc, acc2, write = _tree_split_k(acc, acc2, ws_ptr, count_ptr, pid, pid_k, nsplit, SUB_N, BLOCK_M,
                                         SPLIT_N == 2)

    offs_n = pid_n * BLOCK_N + tl.arange(0, SUB_N)
    offs_m = tl.arange(0, BLOCK_M)
    # INT8: one step of the weight entered the dot as 2**-24 (float16 x) or, natural order with
    # bfloat16 x, 2**-7 (int8_bf16_scaled); the epilogue's scale carries the reciprocal
    XT: tl.constexpr = x_ptr.dtype.element_ty
    UNIT: tl.constexpr = _TWO_POW_24 if XT == tl.float16 else (_TWO_POW_7 if NATURAL and XT == tl.bfloat16 else 1.0)
    if write:
        _epilogue(acc, out_ptr, scale_ptr, bias_ptr, offs_n, offs_m, N, M, stride_om, stride_on, UNIT, INT8, HAS_BIAS)
        if SPLIT_N == 2:
            _epilogue(acc2, out_ptr, scale_ptr, bias_ptr, offs_n + SUB_N, offs_m, N, M, stride_om, stride_on, UNIT,
                      INT8, HAS_BIAS)


# M is not specialized: one compiled variant per config serves every M.
sparse24_prefill = triton.jit(_sparse24_prefill, do_not_specialize=["M"])
sparse24_prefill_interpreted = InterpretedKernel(_sparse24_prefill)

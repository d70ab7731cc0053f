"""Triton kernel for decode-sized batches (M <= 16; larger M in more programs):
``out = x @ W^T (* scale) + bias`` with W in the decode layout
(``sparse24.decode_format.DecodePacked``, version 1). The launcher runs it for
16-bit weights, and for INT8 / INT4 weights with float32 x; INT8 / INT4 weights
with float16 / bfloat16 x run ``sparse24_sp.py`` on the sparse tensor cores
(``_decode_tile`` below also serves the prefill kernel, for every pair).

Triton only (no torch.nn, no policy). The launcher, checks and config space
live in ``sparse24.ops.linear24.launch`` and ``sparse24.ops.config_space``; the bit layout is defined in
``sparse24/decode_format.py``.

Why a second kernel: at M <= 16 the general kernel (``sparse24_matmul.py``)
runs out of issue slots before bandwidth: 0.37-0.41 SASS warp-instructions per
compressed weight byte on sm_90, where an H200 issues ~0.22 per byte of HBM
bandwidth. This one spends 0.09-0.14 (fp16/bf16) and 0.18-0.21 (INT8) on the
same 4096x4096 layer, every config of its space, Triton 3.9 and 3.6
(results/static-sm90/, docs/kernels.md), because:

* the weight is the dot's first operand (out^T = W x^T) and each thread
  decodes exactly the A-fragment registers its mma consumes: the decode layout
  gives lane 4i+j rows i, i+8 and whole groups, and the 16 columns of every
  chunk are permuted (the same permutation gathers x), so dense slots 0,1 of
  a group land in one fragment register and slots 2,3 in the next. Triton then
  keeps the decoded tile in registers (no shared-memory round trip: the
  reshape result already has the dot-operand layout);
* each dense register pair is ONE byte permute (PRMT) of the group's packed
  values, its selector a multiply-add of a 2-bit field of the keep mask
  (constants found by exhaustive search, checked in tests/kernels/test_decode_kernel.py),
  two groups' selectors in one 32-bit multiply-add (their fields lie 16 bits
  apart in the lane's word); per two groups: 2 field extractions (SHF + LOP3),
  2 IMAD, 2 LOP3 clearing bit 3 of every selector nibble, 2 SHF for the upper
  halves, 4 PRMT (raw ``prmt.b32``: libdevice's byte_perm masks each selector
  on its own, 4 LOP3);
  the general kernel spends ~30 SEL/ISETP/SHF/LOP3/PRMT per group plus
  64 STS + LDSM + 2 barriers per tile;
* INT8 values are sign-magnitude bytes: one AND turns a permuted byte pair into
  the exact float16 subnormal value * 2**-24; the 2**24 goes into the epilogue
  scale (no int -> float conversion instructions);
* INT4 values (W4A16): one AND + OR per group makes its two 4-bit codes a
  float16 (bfloat16) pair 1024 + u (128 + u); the same two byte permutes, with
  the zero point's word 1024 + z as their second source (unkept slots), put it
  in the dense registers; one packed subtraction leaves u - z (0 on unkept
  slots) and one packed multiply the group's scale (bfloat16: an exact split of
  the scale and three fma). Over the sm_90 budget (0.54-0.76 per compressed
  byte at the listed shapes, docs/kernels.md "INT4 weights"): the 16-bit
  scatter alone costs more per group than INT4's 1.5 bytes allow;
* no masks in the main loop: the packed weight is padded to whole 64-column
  atoms and to 128 rows, x rows past M are clamped (their outputs are never
  stored) and the partial last K-tile runs once, masked, after the loop;
* where every split owns one K-tile (``ONE_TILE``: SPLIT_K == K-tiles, the
  small layers' default) the kernel compiles without the loop: the ~250
  instructions outside the tile are all a program runs besides it.

The permutes are inline PTX ``prmt.b32``; Triton's interpreter runs inline
PTX through ``kernels/interpreter.py``'s exact integer emulations of the
documented semantics (``prmt_raw_reference`` here, libdevice's ``byte_perm``
where the sparse tensor-core kernel calls it): the CPU tests run this very
source.

Two callables share ONE source function, ``_sparse24_decode``:
``sparse24_decode`` (``triton.jit``, GPU tensors) and
``sparse24_decode_interpreted`` (Triton's interpreter, CPU tensors).
"""
import triton
import triton.language as tl

from .interpreter import ASM_EMULATIONS, InterpretedKernel, bf16x2_fma_reference, f16x2_reference, prmt_raw_reference

__all__ = ["sparse24_decode", "sparse24_decode_interpreted", "int8_bf16_words", "SELECTORS", "SM_MASK"]

# Byte-permute selectors, per dense register pair: S = x * MUL + ADD, with x
# the 2-bit field of the group's keep mask (slots 0,1: bits 0-1; slots 3,2:
# bits 2-3); found by exhaustive search over 16-bit MUL, ADD (then, for the
# slots 3,2 ones, the equivalent pair under byte_perm's 0x7777 mask whose S stays
# in 0..0xFFFF: a negative MUL), checked for all six slot pairs in
# tests/kernels/test_decode_kernel.py. S never leaves 16 bits, so ONE multiply-add
# computes the selectors of two groups at once: the fields of groups g and g + 4 of
# a lane's word lie 16 bits apart, (field_g | field_g+4 << 16) * MUL + ADD * 0x10001
# holds both selectors, one per half (``_selector_pair``).
# 16-bit values: the group's word is (lo, hi); zero lanes select bytes 4-7 of 0.
# INT8: a word holds two groups' sign-magnitude bytes (lo_0, lo_1, hi_0, hi_1);
# both bytes of a lane select the same byte, the AND with 0x807F807F then
# leaves sign and magnitude. Group 0 of the word (b = 0) and group 1 differ.
_MUL01 = tl.constexpr(0x2144)
_ADD01 = tl.constexpr(0x564C)
_MUL23 = tl.constexpr(-0x3C1A)
_ADD23 = tl.constexpr(0xEE66)
_MUL01_B0 = tl.constexpr(0x213C)
_ADD01_B0 = tl.constexpr(0x464C)
_MUL23_B0 = tl.constexpr(-0x3C2A)
_ADD23_B0 = tl.constexpr(0xDE7E)
_MUL01_B1 = tl.constexpr(0x2244)
_ADD01_B1 = tl.constexpr(0x54CD)
_MUL23_B1 = tl.constexpr(-0x3C1A)
_ADD23_B1 = tl.constexpr(0xEF67)
# INT4: the group's word is (0x6400 | lo, 0x6400 | hi) (bfloat16: 0x4300), the
# second word Z the zero point's (0x6400 | z) twice: an unkept slot selects Z's
# bytes in order, so after subtracting 1024 + z it is exactly 0, a kept one u - z.
_MUL01_I4 = tl.constexpr(0x21BC)
_ADD01_I4 = tl.constexpr(0x54DC)
_MUL23_I4 = tl.constexpr(-0x4422)
_ADD23_I4 = tl.constexpr(0xFE76)
# (int8, group b of the word) -> (MUL01, ADD01, MUL23, ADD23), for tests and docs; "int4": INT4's
SELECTORS = {
    "int4": (_MUL01_I4.value, _ADD01_I4.value, _MUL23_I4.value, _ADD23_I4.value),
    (False, 0): (_MUL01.value, _ADD01.value, _MUL23.value, _ADD23.value),
    (False, 1): (_MUL01.value, _ADD01.value, _MUL23.value, _ADD23.value),
    (True, 0): (_MUL01_B0.value, _ADD01_B0.value, _MUL23_B0.value, _ADD23_B0.value),
    (True, 1): (_MUL01_B1.value, _ADD01_B1.value, _MUL23_B1.value, _ADD23_B1.value),
}
_SM_MASK = tl.constexpr(-0x7F807F81)   # 0x807F807F as int32: sign bits + 7-bit magnitudes
SM_MASK = _SM_MASK.value & 0xFFFFFFFF
_TWO_POW_24 = tl.constexpr(16777216.0)  # INT8 values enter the fp16 dot as value * 2**-24
# INT8 with bfloat16 activations: OR-ing a lane with 0x4300 makes the bfloat16
# +-(128 + |v|) (exponent 2**7, |v| <= 127 the 7-bit mantissa); masking that to
# sign and exponent gives +-128; their difference is v exactly (Sterbenz).
_BF16_MAGIC = tl.constexpr(0x43004300)
_BF16_SIGN_EXP = tl.constexpr(-0x007F0080)   # 0xFF80FF80 as int32


@triton.jit
def int8_bf16_words(d):
    """Sign-magnitude INT8 lanes (sign in bit 15, |v| in bits 0-6, as the byte
    permute and the AND leave them) -> two words of bfloat16 pairs, y and c,
    with y - c == v exactly: two LOP3 and one bfloat16x2 subtraction per pair,
    no int -> float conversion."""
    y = d | _BF16_MAGIC
    return y, y & _BF16_SIGN_EXP


# INT4: a code u OR-ed into the exponent bits of 1024 (float16) or 128 (bfloat16)
# is that number + u exactly (the 10 / 7 mantissa bits hold u <= 15).
_MAGIC_F16 = tl.constexpr(0x64006400)
_MAGIC_BF16 = tl.constexpr(0x43004300)


@triton.jit
def _int4_words(wv, s_rows, z_rows, ok_a, a0, G, MASKED: tl.constexpr, HAS_ZERO: tl.constexpr,
                GROUP: tl.constexpr, MAGIC: tl.constexpr, A: tl.constexpr, T: tl.constexpr):
    # INT4 values [A, T*64] (a lane's two words per atom) -> the groups' code words P
    # (magic | lo, magic | hi) and zero words Z (magic | z, twice), [A, h, T, 32, qq, b],
    # and the scales [A, h or 1, T, 32, 1, b] (float16) of each group's row and
    # quantization group (at most 2 per lane and atom: rows i, i + 8).
    W = tl.reshape(tl.permute(tl.reshape(wv, [A, T, 32, 2]), [0, 3, 1, 2]), [A, 2, T, 32, 1, 1])
    iq = tl.arange(0, 2)[None, None, None, None, :, None]
    ib = tl.arange(0, 2)[None, None, None, None, None, :]
    P = ((W >> ((2 * iq + ib) * 4)) & 0x000F000F) | MAGIC                   # group 2qq + b: nibbles k, k + 4
    ia = tl.arange(0, A)[:, None, None, None, None, None]
    if GROUP == 32:  # the two halves of an atom are two quantization groups
        kq = (a0 + ia) * 2 + tl.arange(0, 2)[None, :, None, None, None, None]
    else:
        kq = (a0 + ia) // (GROUP // 64)
    Z, s = _int4_group(s_rows, z_rows, kq, ok_a[:, None, None, None, None, None], G, MASKED, HAS_ZERO, MAGIC)
    return P, Z, s


@triton.jit
def _int4_group(s_rows, z_rows, kq, ok_a, G, MASKED: tl.constexpr, HAS_ZERO: tl.constexpr, MAGIC: tl.constexpr):
    # INT4: the zero words Z (magic | z, twice) and float16 scales of quantization groups kq
    # at the lanes' rows (pointers s_rows, z_rows at group 0; any rank, broadcast together)
    if MASKED:  # the partial tile: groups past the last one (columns >= K) are not read
        ok = ok_a & (kq < G)
        s = tl.load(s_rows + kq, mask=ok, other=0.0)
        if HAS_ZERO:
            Z = tl.load(z_rows + kq, mask=ok, other=0).to(tl.int32) * 0x10001 | MAGIC
    else:
        s = tl.load(s_rows + kq)
        if HAS_ZERO:
            Z = tl.load(z_rows + kq).to(tl.int32) * 0x10001 | MAGIC
    if not HAS_ZERO:
        Z = tl.zeros_like(kq) + (MAGIC | 0x80008)   # symmetric: z = 8
    return Z, s


# INT4 dequantization on whole 32-bit words (two halves each): Triton's per-element
# float16 arithmetic made LLVM re-pair the halves (a PRMT per operand and result: 0.62
# warp-instructions per byte in the 4096 x 4096 main loop, 0.53 this way). Each string
# has a numpy emulation for interpreted launches (kernels/interpreter.py).
_SUB_F16X2 = tl.constexpr("sub.f16x2 $0, $1, $2;")
_MUL_F16X2 = tl.constexpr("mul.f16x2 $0, $1, $2;")
# bfloat16: u - z exactly, then (u - z) * s rounded once: s = hi + lo with hi = bf16(s) and
# lo = s - hi exact in bfloat16 (float16's 11 bits = 8 + 3), (u - z) * lo exact (<= 8 bits),
# one fma adds (u - z) * hi to it with a single rounding. All fma.rn.bf16x2 (sm_80; the
# bf16x2 sub and mul forms need sm_90): t = Z * -1 + d, p = t * lo + -0, t * hi + p
# (operands: $1 d, $2 Z, $3 hi, $4 lo, $5 the words of -1 and $6 of -0: no immediates in fma).
_DEQUANT_BF16X2 = tl.constexpr(
    "{ .reg .b32 t, p; fma.rn.bf16x2 t, $2, $5, $1; fma.rn.bf16x2 p, t, $4, $6; fma.rn.bf16x2 $0, t, $3, p; }")
_BF16X2_MINUS_ONE = tl.constexpr(-0x407F4080)   # 0xBF80BF80 as int32
_BF16X2_MINUS_ZERO = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32
ASM_EMULATIONS[_SUB_F16X2.value] = f16x2_reference("sub")
ASM_EMULATIONS[_MUL_F16X2.value] = f16x2_reference("mul")


def _dequant_bf16x2_reference(d, z, hi, lo, m, m0):
    # _DEQUANT_BF16X2 for the interpreter: t = $2 * $5 + $1, p = t * $4 + $6, t * $3 + p
    t = bf16x2_fma_reference(z, m, d)
    return bf16x2_fma_reference(t, hi, bf16x2_fma_reference(t, lo, m0))


ASM_EMULATIONS[_DEQUANT_BF16X2.value] = _dequant_bf16x2_reference
# Scales bfloat16 holds exactly (a bfloat16 module's copy: format.bf16_exact_scales) need no split:
# t = $2 * $4 + $1 as above, then t * $3 + $5 (-0), rounded once: two fma per register pair.
_SCALE_BF16X2 = tl.constexpr("{ .reg .b32 t; fma.rn.bf16x2 t, $2, $4, $1; fma.rn.bf16x2 $0, t, $3, $5; }")


def _scale_bf16x2_reference(d, z, s, m, m0):
    # _SCALE_BF16X2 for the interpreter: t = $2 * $4 + $1, t * $3 + $5
    return bf16x2_fma_reference(bf16x2_fma_reference(z, m, d), s, m0)


ASM_EMULATIONS[_SCALE_BF16X2.value] = _scale_bf16x2_reference


@triton.jit
def _f16x2(asm: tl.constexpr, a, b):
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half_word(h):
    """A float16/bfloat16 tensor -> int32 words holding it in both halves."""
    return (h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 0x10001


@triton.jit
def _int4_dequant(d, Z, sc, XT: tl.constexpr):
    # INT4 dense words d (byte permutes of P and Z) -> u - z exactly (integers below 2**11 / 2**8),
    # then times the float16 scale sc, on whole words: x float16, in float16 (one rounding of
    # the exact product); x bfloat16, the exact product rounded once (_DEQUANT_BF16X2, or
    # _SCALE_BF16X2 for bfloat16 scales); x float32,
    # u - z here, the scale after, in float32 (exact).
    if XT == tl.float16:
        d = _f16x2(_MUL_F16X2, _f16x2(_SUB_F16X2, d, Z), _half_word(sc))
    elif XT == tl.bfloat16 and sc.dtype == tl.bfloat16:   # exact bfloat16 scales: one fma fewer
        d = tl.inline_asm_elementwise(_SCALE_BF16X2, "=r,r,r,r,r,r",
                                      [d, Z, _half_word(sc), tl.zeros_like(d) + _BF16X2_MINUS_ONE,
                                       tl.zeros_like(d) + _BF16X2_MINUS_ZERO], dtype=tl.int32, is_pure=True, pack=1)
    elif XT == tl.bfloat16:
        hi = sc.to(tl.bfloat16)
        lo = (sc.to(tl.float32) - hi.to(tl.float32)).to(tl.bfloat16)
        m1 = tl.zeros_like(d) + _BF16X2_MINUS_ONE   # splat constants
        m0 = tl.zeros_like(d) + _BF16X2_MINUS_ZERO
        d = tl.inline_asm_elementwise(_DEQUANT_BF16X2, "=r,r,r,r,r,r,r", [d, Z, _half_word(hi), _half_word(lo), m1, m0],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        d = _f16x2(_SUB_F16X2, d, Z)
    return d


@triton.jit
def _int4_rows(scale_ptr, zero_ptr, t0, N, G, T: tl.constexpr):
    # INT4: a lane's scale and zero-point pointers at quantization group 0, [1, 1, T, 32, 1, b]:
    # rows 16 t + 8 b + i of lane 4 i + j of the (N, G) arrays; padding rows (>= N, never
    # stored) clamped to N - 1, once per program: the loop's scale loads need no masks.
    it = tl.arange(0, T)[None, None, :, None, None, None]
    il = tl.arange(0, 32)[None, None, None, :, None, None]
    ib = tl.arange(0, 2)[None, None, None, None, None, :]
    r = tl.minimum((t0 + it) * 16 + ib * 8 + il // 4, N - 1).to(tl.int64) * G
    return scale_ptr + r, zero_ptr + r


# Raw prmt (the interpreter: kernels/interpreter.py's prmt_raw_reference): bit 3 of a
# selector nibble would fill the byte with its sign, so every selector passes _SEL_MASK
# first (libdevice's byte_perm masks each selector on its own: one AND per permute).
_PRMT = tl.constexpr("prmt.b32 $0, $1, $2, $3;")
ASM_EMULATIONS[_PRMT.value] = prmt_raw_reference
_SEL_MASK = tl.constexpr(0x77777777)


@triton.jit
def _selector_pair(f, MUL: tl.constexpr, ADD: tl.constexpr):
    """Fields of groups g (bits 0-1 of ``f``) and g + 4 (bits 16-17) -> both byte-permute
    selectors in one multiply-add and one mask, indexed by the half-atom h along axis 1
    ([A, 1, ...] -> [A, 2, ...]): group g's in the low half, g + 4's shifted down (prmt
    reads the low 16 bits). Exact because S = x * MUL + ADD stays in 16 bits; the mask
    clears bit 3 of every nibble (and bit 31, so the shift brings in zeros)."""
    ih = tl.arange(0, 2)[None, :, None, None, None, None]
    ADD2: tl.constexpr = ADD * 0x10001 - ((ADD >> 15) << 32)   # as int32 (ADD < 0x10000)
    return (((f & 0x30003) * MUL + ADD2) & _SEL_MASK) >> (16 * ih)


@triton.jit
def _prmt(a, b, sel):
    """PTX ``prmt.b32`` (default mode) of words a, b by a selector without bit-3 nibbles."""
    return tl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, k0, K, a0, KA, s_rows, z_rows, G,
                 MASKED: tl.constexpr, INT8: tl.constexpr, W_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT4: tl.constexpr = False,
                 GROUP: tl.constexpr = 128, HAS_ZERO: tl.constexpr = False):
    # One K-tile: A atoms (64 columns) of T row tiles (16 rows), T = num_warps.
    # Decode tensors are indexed (atom, half-atom h, row tile, lane,
    # chunk-in-half qq, row half b). Every load has ONE contiguous dimension
    # that covers all threads (the lanes of the T row tiles), so Triton's
    # coalescer gives each thread exactly its own lane's bytes in every
    # version (3.6 and 3.9 order equally contiguous dimensions differently).
    A: tl.constexpr = BLOCK_K // 64
    T: tl.constexpr = BLOCK_N // 16
    BLOCK_M: tl.constexpr = x_ptrs.shape[0]  # rows of x: 16 here, 32-256 in the prefill kernel
    ok_a = (a0 + tl.arange(0, A)) < KA   # the partial last tile only: atoms past the padded K
    if MASKED:  # (and columns past K)
        mw = tl.load(m_ptrs, mask=ok_a[None, :], other=0)                   # [T*32, A]
    else:
        mw = tl.load(m_ptrs)
    mw = tl.reshape(tl.permute(mw, [1, 0]), [A, 1, T, 32, 1, 1])
    # Group g = 4h + 2qq + b of the lane's word: bits 4g..4g+3 (slot 0, 1, 3, 2); f holds
    # the nibbles of groups (h = 0, qq, b) and (h = 1, qq, b) 16 bits apart.
    iq = tl.arange(0, 2)[None, None, None, None, :, None]
    ib = tl.arange(0, 2)[None, None, None, None, None, :]
    f = mw >> ((2 * iq + ib) * 4)                                             # [A, 1, T, 32, qq, b]
    # The multiply-add selectors set bit 3 of some nibbles, which raw PRMT reads as "fill
    # with the byte's sign": 15 of the 24 16-bit / INT8 ones would decode wrong without
    # _selector_pair's mask (tests/kernels/test_first_run_hazards.py).
    zero = tl.zeros([1, 1, 1, 1, 1, 1], tl.int32)
    XT: tl.constexpr = x_ptrs.dtype.element_ty
    if INT4:
        # 8 bytes per lane and atom. Each dense register pair is one byte permute of
        # the group's code word P and its zero word Z; subtracting 1024 + z (128 + z)
        # leaves u - z on kept slots and exactly 0 on the others; then the scale.
        MAGIC: tl.constexpr = _MAGIC_BF16 if XT == tl.bfloat16 else _MAGIC_F16
        if MASKED:
            wv = tl.load(v_ptrs, mask=ok_a[:, None], other=0)                 # [A, T*64]
        else:
            wv = tl.load(v_ptrs)
        P, Z, sc = _int4_words(wv, s_rows, z_rows, ok_a, a0, G, MASKED, HAS_ZERO, GROUP, MAGIC, A, T)
        d01 = _prmt(P, Z, _selector_pair(f, _MUL01_I4, _ADD01_I4))       # dense slots 0, 1
        d23 = _prmt(P, Z, _selector_pair(f >> 2, _MUL23_I4, _ADD23_I4))  # dense slots 2, 3
        d01 = _int4_dequant(d01, Z, sc, XT)
        d23 = _int4_dequant(d23, Z, sc, XT)
    elif INT8:
        # 16 bytes per lane and atom; word q = 2h + qq holds groups (q, 0) and
        # (q, 1): each word gives 4 dense pairs, with per-group selectors.
        if MASKED:
            wv = tl.load(v_ptrs, mask=ok_a[:, None], other=0)                 # [A, T*128]
        else:
            wv = tl.load(v_ptrs)
        P = tl.permute(tl.reshape(wv, [A, T, 32, 2, 2]), [0, 3, 1, 2, 4])     # [A, h, T, 32, qq]
        f0, f1 = tl.split(f)                                                 # [A, 1, T, 32, qq]
        f0, f1 = f0[:, :, :, :, :, None], f1[:, :, :, :, :, None]
        # The mask must reach ptxas as a register, not a constant: a constant AND is split per
        # half (+4/group), and only a register mask fuses with bf16's OR into one LOP3. KA >> 31
        # is 0 (KA >= 0), which no compiler can know: the mask stays a runtime value.
        sm_mask = _SM_MASK | (KA >> 31)
        d01_0 = _prmt(P, zero, tl.reshape(_selector_pair(f0, _MUL01_B0, _ADD01_B0), P.shape)) & sm_mask
        d23_0 = _prmt(P, zero, tl.reshape(_selector_pair(f0 >> 2, _MUL23_B0, _ADD23_B0), P.shape)) \
            & sm_mask
        d01_1 = _prmt(P, zero, tl.reshape(_selector_pair(f1, _MUL01_B1, _ADD01_B1), P.shape)) & sm_mask
        d23_1 = _prmt(P, zero, tl.reshape(_selector_pair(f1 >> 2, _MUL23_B1, _ADD23_B1), P.shape)) \
            & sm_mask
        d01 = tl.join(d01_0, d01_1)                                          # [A, h, T, 32, qq, b]
        d23 = tl.join(d23_0, d23_1)
    else:
        # 32 bytes per lane and atom, as two 16-byte halves: one word per group.
        if MASKED:
            wv = tl.load(v_ptrs, mask=ok_a[:, None, None], other=0)           # [A, h, T*128]
        else:
            wv = tl.load(v_ptrs)
        P = tl.reshape(wv, [A, 2, T, 32, 2, 2])                               # [A, h, T, 32, qq, b]
        d01 = _prmt(P, zero, _selector_pair(f, _MUL01, _ADD01))         # dense slots 0, 1
        d23 = _prmt(P, zero, _selector_pair(f >> 2, _MUL23, _ADD23))    # dense slots 2, 3
    if W_BF16 or ((INT8 or INT4) and XT == tl.bfloat16):
        WT: tl.constexpr = tl.bfloat16
    else:
        WT: tl.constexpr = tl.float16
    if INT8 and XT == tl.bfloat16:
        d01, c01 = int8_bf16_words(d01)
        d23, c23 = int8_bf16_words(d23)
    w0 = (d01 & 0xFFFF).to(tl.int16).to(WT, bitcast=True)
    w1 = (d01 >> 16).to(tl.int16).to(WT, bitcast=True)
    w2 = (d23 & 0xFFFF).to(tl.int16).to(WT, bitcast=True)
    w3 = (d23 >> 16).to(tl.int16).to(WT, bitcast=True)
    if INT8 and XT == tl.bfloat16:
        w0 -= (c01 & 0xFFFF).to(tl.int16).to(WT, bitcast=True)
        w1 -= (c01 >> 16).to(tl.int16).to(WT, bitcast=True)
        w2 -= (c23 & 0xFFFF).to(tl.int16).to(WT, bitcast=True)
        w3 -= (c23 >> 16).to(tl.int16).to(WT, bitcast=True)
    if INT4 and XT == tl.float32:
        s32 = sc.to(tl.float32)
        w0, w1, w2, w3 = w0.to(XT) * s32, w1.to(XT) * s32, w2.to(XT) * s32, w3.to(XT) * s32

    # Dot order inside each 16-column chunk: position 8hh + 2j + e holds dense
    # column 4j + 2hh + e, so lane (i, j) holds its groups' columns in its
    # A-fragment registers. [A, h, T, i, j, qq, b, e, hh] -> [BLOCK_N, BLOCK_K].
    w = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    w = tl.reshape(w, [A, 2, T, 8, 4, 2, 2, 2, 2])
    w = tl.reshape(tl.permute(w, [2, 6, 3, 0, 1, 5, 8, 4, 7]), [BLOCK_N, BLOCK_K])

    # x^T with the same column permutation: [16, BLOCK_K] -> [BLOCK_K, 16].
    if MASKED:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xm = tl.load(x_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    else:
        xm = tl.load(x_ptrs)
    xm = tl.reshape(xm, [BLOCK_M, BLOCK_K // 16, 4, 2, 2])
    xt = tl.reshape(tl.permute(xm, [1, 3, 2, 4, 0]), [BLOCK_K, BLOCK_M])

    if INT8:
        if XT == tl.float32:  # fp32 dots: scale the fp16 subnormals back to the integers, exactly
            w = w.to(tl.float32) * _TWO_POW_24
    elif WT != XT and not INT4:
        w = w.to(XT)
    return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)



@triton.jit
def _epilogue(acc, out_ptr, scale_ptr, bias_ptr, offs_n, offs_m, N, M, stride_om, stride_on,
              UNIT: tl.constexpr, INT8: tl.constexpr, HAS_BIAS: tl.constexpr):
    # On out^T [BLOCK_N, BLOCK_M] in fp32 (the decode and prefill kernels'):
    # INT8 scale times UNIT, the reciprocal of the value one INT8 step had in the dot
    # (2**24 for float16 subnormals, 2**7 for the prefill's scaled bfloat16 ones, else 1),
    # then bias; rows offs_m < M and columns offs_n < N stored in out's dtype.
    mask_n = offs_n < N
    if INT8:
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        if UNIT != 1.0:
            scale = scale * UNIT
        acc = acc * scale[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_m < M)[None, :])


@triton.jit
def _serial_split_k(acc, ws_ptr, count_ptr, tile, pid_k, SPLIT_K: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    # Serial split-K, inside one launch (the decode kernel; the prefill kernel sums its larger
    # partials as a tree: sparse24_prefill._tree_split_k): every split stores its fp32 partial
    # tile ([ROWS, COLS]) in the plan's workspace (ws_ptr: [tiles, SPLIT_K, ROWS, COLS]); the
    # output tile's counter (count_ptr, zero between launches) says which program arrives last;
    # that one adds the SPLIT_K partials in split order (the same bits whatever the arrival
    # order: split-K stays deterministic) and resets the counter. Returns (acc, whether to write
    # the output).
    SIZE: tl.constexpr = ROWS * COLS
    part = (ws_ptr + tile.to(tl.int64) * (SPLIT_K * SIZE)
            + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :])
    tl.store(part + pid_k * SIZE, acc, cache_modifier=".cg")
    tl.debug_barrier()  # all threads' partials are stored before the counter releases them
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    write = arrived == SPLIT_K - 1
    if write:
        acc = tl.load(part, cache_modifier=".cg")
        for j in tl.static_range(1, SPLIT_K):
            acc += tl.load(part + j * SIZE, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)  # ready for the next launch
    return acc, write


def _sparse24_decode(
    x_ptr, v_ptr, meta_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, KA, KM,
    stride_xm, stride_xk,
    stride_om, stride_on,
    INT8: tl.constexpr, W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_TILE: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
):
    # Grid: (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, 16)); a program covers 16 rows
    # of x (all of them at decode sizes, M <= 16) and BLOCK_N // 16 row tiles of
    # W, one per warp (num_warps == BLOCK_N // 16). Larger M re-decodes W once
    # per 16 rows: correct, but the decode cost is only amortized at M <= 16.
    # v_ptr / meta_ptr: the decode layout (contiguous), values read as int32 words;
    # KA atoms per row, KM atoms per lane of meta storage.
    BLOCK_M: tl.constexpr = 16
    A: tl.constexpr = BLOCK_K // 64
    T: tl.constexpr = BLOCK_N // 16
    # The values arrive in their own dtype (float16/bfloat16/uint8); the kernel
    # reads them as 32-bit words (a host-side view would cost ~1 us per call).
    v_ptr = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # This program's 16 rows of x and out: pointers moved, M counted from them.
    m0 = tl.program_id(2).to(tl.int64) * BLOCK_M
    x_ptr += m0 * stride_xm
    out_ptr += m0 * stride_om
    # Rows of this block (1..16) as an int32 scalar: row clamps and the store mask stay 32-bit.
    m_left = tl.minimum(M - tl.program_id(2) * BLOCK_M, BLOCK_M)

    # Row tiles: the layout pads rows to a multiple of 128, so a program's T
    # tiles (T = 2, 4 or 8) never run past the end: no masks on weight loads.
    NT = (N + 127) // 128 * 8
    t0 = pid_n * T

    # Split-K: split pid_k owns whole K-tiles [k_lo, k_hi) (possibly none);
    # tiles below n_full = K // BLOCK_K are full (no masks), the partial tile
    # n_full (when K % BLOCK_K) runs once after the loop, in the split owning it.
    n_full = K // BLOCK_K
    if ONE_TILE:  # SPLIT_K == K-tiles (small layers): split pid_k owns K-tile pid_k
        k_lo = pid_k
        k_hi = pid_k + 1
    else:
        k_tiles = (K + BLOCK_K - 1) // BLOCK_K
        per_split = (k_tiles + SPLIT_K - 1) // SPLIT_K
        k_lo = pid_k * per_split
        k_hi = min(k_tiles, k_lo + per_split)

    atoms = (k_lo * A + tl.arange(0, A)).to(tl.int64)
    lanes = tl.arange(0, T * 128)        # T row tiles x 32 lanes x 4 words, contiguous
    # The value pointers as one per-thread pointer (the scalar part int64) plus a
    # per-register multiple of the scalar atom stride: each load's address is then
    # one 64-bit add, not a 64-bit multiply-add of its own (~24 integer instructions).
    atom_words = NT.to(tl.int64) * 128   # one 16-byte slot per lane, NT row tiles: one atom (half-atom for 16 bit)
    if INT4:  # 8 bytes per lane and atom
        v_base = v_ptr + (k_lo.to(tl.int64) * A * NT + t0) * 64 + tl.arange(0, T * 64)
        v_ptrs = v_base[None, :] + tl.arange(0, A).to(tl.int64)[:, None] * (atom_words // 2)  # [A, T*64]
        V_STEP: tl.constexpr = A * 64
    elif INT8:
        v_base = v_ptr + (k_lo.to(tl.int64) * A * NT + t0) * 128 + lanes
        v_ptrs = v_base[None, :] + tl.arange(0, A).to(tl.int64)[:, None] * atom_words       # [A, T*128]
        V_STEP: tl.constexpr = A * 128
    else:
        v_base = v_ptr + (k_lo.to(tl.int64) * (2 * A) * NT + t0) * 128 + lanes
        v_ptrs = v_base[None, None, :] + (tl.arange(0, A)[:, None, None] * 2
                                          + tl.arange(0, 2)[None, :, None]).to(tl.int64) * atom_words  # [A, 2, T*128]
        V_STEP: tl.constexpr = A * 256
    m_ptrs = meta_ptr + (t0 * 32 + tl.arange(0, T * 32)).to(tl.int64)[:, None] * KM + atoms[None, :]  # [T*32, A]
    G = (K + GROUP - 1) // GROUP   # INT4: quantization groups per row
    s_rows, z_rows = _int4_rows(scale_ptr, zero_ptr, t0, N, G, T) if INT4 else (scale_ptr, zero_ptr)
    rows = tl.minimum(tl.arange(0, BLOCK_M), m_left - 1).to(tl.int64)   # rows past M: clamped, never stored
    # int64 column offsets (and K-tile steps): a transposed x has stride_xk = M, so
    # k * stride_xk passes 2**31 once M * K does. A stride of 1 stays a constant.
    stride_xk = tl.cast(stride_xk, tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_lo * BLOCK_K + tl.arange(0, BLOCK_K))[None, :] * stride_xk

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if ONE_TILE:
        # No loop: no loop-carried pointers, no loop control and, where BLOCK_K divides
        # K, no zero-trip path (the ~100 instructions a one-tile program cannot amortize).
        if EVEN_K:
            acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, k_lo * BLOCK_K, K, k_lo * A, KA, s_rows, z_rows, G,
                               False, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
        elif k_lo < n_full:
            acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, k_lo * BLOCK_K, K, k_lo * A, KA, s_rows, z_rows, G,
                               False, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
    else:
        for kt in range(k_lo, min(k_hi, n_full)):
            acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, kt * BLOCK_K, K, kt * A, KA, s_rows, z_rows, G,
                               False, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)
            v_ptrs += V_STEP * NT
            m_ptrs += A
            x_ptrs += BLOCK_K * stride_xk
    if not EVEN_K:  # K % BLOCK_K: the partial tile's code is compiled only where it exists
        if (n_full >= k_lo) & (n_full < k_hi):  # this split owns the partial tile (pointers are there)
            acc = _decode_tile(acc, x_ptrs, v_ptrs, m_ptrs, n_full * BLOCK_K, K, n_full * A, KA, s_rows, z_rows,
                               G, True, INT8, W_BF16, DOT_PRECISION, BLOCK_N, BLOCK_K, INT4, GROUP, HAS_ZERO)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    write = True
    if SPLIT_K > 1:
        acc, write = _serial_split_k(acc, ws_ptr, count_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, pid_k,
                                     SPLIT_K, BLOCK_N, BLOCK_M)
    if write:
        UNIT: tl.constexpr = _TWO_POW_24 if x_ptr.dtype.element_ty == tl.float16 else 1.0
        _epilogue(acc, out_ptr, scale_ptr, bias_ptr, offs_n, offs_m, N, m_left, stride_om, stride_on, UNIT, INT8,
                  HAS_BIAS)


# M is not specialized: one compiled variant per config serves every M.
sparse24_decode = triton.jit(_sparse24_decode, do_not_specialize=["M"])
sparse24_decode_interpreted = InterpretedKernel(_sparse24_decode)

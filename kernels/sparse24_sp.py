"""Triton kernel for decode-sized batches of quantized weights (INT8, INT4) on
the sparse tensor cores: ``out = x @ W^T (* scale) + bias``, W in the decode
layout (``sparse24.decode_format.DecodePacked``) with its ``mma.sp`` metadata
words, x float16 or bfloat16, M <= 16 per program (32 with ``R32``; larger M:
more programs); and for 16-bit weights of x's dtype at 17-64 rows, whose stored
values are the A registers as they are and whose metadata words the kernel
builds from the keep masks (``_mask_sp_word``: the layout carries no others).

Why a third kernel: the byte-permute decode kernel (``sparse24_decode.py``)
rebuilds the dense operand in registers, ~12 integer instructions per 2:4 group,
which an INT8 group (2.5 bytes) or an INT4 group (1.5 bytes) cannot afford on
sm_90 (docs/kernels.md, "INT8 and INT4 on the sparse tensor cores"). ``mma.sp`` takes the
kept values and their 2-bit indices as they are and skips the zeros in
hardware, so the only decode left is the value conversion: one byte permute
and one AND per register pair (INT8), or shift, OR, subtract and scale (INT4).

Triton has no sparse dot, so the kernel issues ``mma.sp::ordered_metadata.sync.aligned.m16n8k32``
as inline PTX on tensors that hold ONE element per thread: a tensor of
``32 * num_warps`` elements is laid out one per thread in lane order, so
element ``32 w + l`` is lane ``l`` of warp ``w``, and the asm's operands are
exactly that lane's fragment registers (no layout conversion: the compiled
loop has no shuffle and no shared memory). Each warp owns one, two or four
16-row tiles of W (``RT``; the decode layout's row tiles, lane ``4 g + t`` rows
``g`` and ``g + 8`` of each), whose mma all take the same x words (per-tile
values are tuples indexed by tile):

* A (the weight, sparse): the decode layout already stores a lane's kept values
  in the A-fragment order of ``m16n8k32`` (the dense ``m16n8k16`` A layout over
  the 16 x 16 kept values: registers (row g, group t), (row g + 8, group t),
  (row g, group t + 4), (row g + 8, group t + 4) of each 32-column chunk).
  INT8: sign-magnitude bytes; one constant byte permute and one AND make a
  float16 register pair of value * 2**-24 (subnormals, exact; the epilogue
  scale carries 2**24), bfloat16 ``(128 + |v|) - 128`` by two LOP3 and one
  fma. INT4: 1024 + u (bfloat16 128 + u) minus 1024 + z, exact; the scale multiplies each
  quantization group's fp32 partial sums (``_fold``), so the weight is the exact grid.
* E (metadata): the layout's ``mma.sp`` words (``decode_format``: lane 4g + t
  of atom a holds 16-column chunk t, rows g and g + 8); chunk 0 of an atom runs
  with sparsity selector 0 (lanes t = 0, 1 hold its words), chunk 1 with 1.
  A lane's words of a K-tile lie along its meta row: loaded 4 atoms at a time.
* B (x^T): lane (g, t) loads x[row g, k + 2t .. 2t + 1] and the same at
  k + 8, 16, 24 as 32-bit words (x rows with unit column stride, even row
  stride: the launcher guarantees it); M > 8 runs a second mma on rows 8-15.
* C/D: fp32, lane (g, t) holds out^T rows g, g + 8, columns 2t, 2t + 1.

Split-K is serial and inside the one launch, as in the decode kernel. The
interpreter runs this source on CPU: ``kernels/interpreter.py`` emulates the
inline PTX from the definitions above (the fragment and metadata layouts are the
PTX ISA's, as NVIDIA's CuTe encodes them for this instruction; a GPU confirms
them: ``scripts/gpu_check.sh``).
"""
import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .interpreter import ASM_EMULATIONS, InterpretedKernel, prmt_raw_reference
from .sparse24_decode import (_BF16X2_MINUS_ONE, _MAGIC_BF16, _MAGIC_F16, _SM_MASK, _SUB_F16X2, _TWO_POW_24, _f16x2,
                              int8_bf16_words)

__all__ = ["sparse24_sp", "sparse24_sp_interpreted", "mma_sp_reference", "SP_META_NIBBLE_PAD"]

# ::ordered_metadata (PTX 8.5, sm_80+): each group's lower kept index in the low bits, as the layout stores
# them; PTX advises it over plain mma.sp, which may run much slower on newer GPUs.
_MMA_SP = ("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{t}.{t}.f32 {{$0, $1, $2, $3}}, "
           "{{$4, $5, $6, $7}}, {{$8, $9, $10, $11}}, {{$12, $13, $14, $15}}, $16, {s};")
_MMA_F16_0 = tl.constexpr(_MMA_SP.format(t="f16", s="0x0"))
_MMA_F16_1 = tl.constexpr(_MMA_SP.format(t="f16", s="0x1"))
_MMA_BF16_0 = tl.constexpr(_MMA_SP.format(t="bf16", s="0x0"))
_MMA_BF16_1 = tl.constexpr(_MMA_SP.format(t="bf16", s="0x1"))
# bfloat16 INT8: y - c exactly (c * -1 + y, one fma: sm_80 has no bf16x2 sub)
_SUB_BF16X2 = tl.constexpr("fma.rn.bf16x2 $0, $2, $3, $1;")
# INT4 zero word (magic | z, both halves) from the zero point byte z and the magic word (a register): one
# prmt with an immediate selector (bytes z, magic's high byte, z, again; no selector nibble sets bit 3, so
# raw prmt is libdevice's byte_perm here), where byte_perm would move its selector into a register each time.
_ZERO_WORD = tl.constexpr("prmt.b32 $0, $1, $2, 0x5050;")
SP_META_NIBBLE_PAD = 0b0100   # a valid (0, 1) index pair: padding groups (zero values) must not be 0b0000


def mma_sp_reference(selector: int, bf16: bool = False):
    """A numpy emulation of ``mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{f16,bf16}``
    on the operand arrays of tensors laid out one element per thread (element 32 w + l is
    lane l of warp w): A from the kept values and the metadata words of the two threads
    of each quad that ``selector`` names (lane 4g + 2 selector + c holds columns 16c ..
    16c + 15 of rows g (bits 0-15) and g + 8 (bits 16-31), 4 bits per group of 4
    columns: lower kept index in bits 0-1), B and C as in the dense m16n8k16 layouts
    extended to k = 32 (the A, B and E layouts of CuTe's ``MMA_Traits`` for
    ``SM80_SPARSE_16x8x32_F32F16F16F32_TN``); products exact, the sum rounded once to float32."""
    def run(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e):
        def halves(w):
            w = np.ascontiguousarray(np.asarray(w, dtype=np.int32))
            if bf16:  # bfloat16 bits are the top half of float32's
                u = w.view(np.uint32).astype(np.uint64)
                lo = ((u & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
                hi = ((u >> 16) << 16).astype(np.uint32).view(np.float32)
                return lo.astype(np.float64), hi.astype(np.float64)
            h = w.view(np.float16).reshape(-1, 2).astype(np.float64)
            return h[:, 0], h[:, 1]
        L = len(a0)
        out = [np.empty(L, np.float32) for _ in range(4)]
        c = np.stack([np.asarray(v, np.float64) for v in (c0, c1, c2, c3)], 1)
        e = np.asarray(e).astype(np.int64) & 0xFFFFFFFF
        for w in range(L // 32):
            s = slice(32 * w, 32 * w + 32)
            A = np.zeros((16, 32))
            for reg, (dr, dg) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
                lo, hi = halves((a0, a1, a2, a3)[reg][s])
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    row, grp = g + dr, t + dg
                    word = e[32 * w + 4 * g + 2 * selector + grp // 4]
                    nib = (word >> (16 * (row // 8) + 4 * (grp % 4))) & 15
                    i0, i1 = nib & 3, nib >> 2
                    if i0 >= i1:
                        raise ValueError(f"invalid mma.sp metadata nibble {nib:#06b} (row {row}, group {grp})")
                    A[row, 4 * grp + i0] = lo[lane]
                    A[row, 4 * grp + i1] = hi[lane]
            B = np.zeros((32, 8))
            for reg in range(4):
                lo, hi = halves((b0, b1, b2, b3)[reg][s])
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    B[8 * reg + 2 * t, g], B[8 * reg + 2 * t + 1, g] = lo[lane], hi[lane]
            D = A @ B
            for lane in range(32):
                g, t = divmod(lane, 4)
                d = (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
                for i in range(4):
                    out[i][32 * w + lane] = np.float32(d[i] + c[32 * w + lane, i])
        return tuple(out)
    return run


def _bf16x2_sub_reference(y, c):
    y, c = (np.ascontiguousarray(np.asarray(v, np.int32)).view(np.uint32).astype(np.uint64) for v in (y, c))
    def f(u, k):
        return (((u >> (16 * k)) & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
    d = [(f(y, k) - f(c, k)).view(np.uint32) >> 16 for k in (0, 1)]   # exact: no rounding to do
    return (d[0].astype(np.uint64) | d[1].astype(np.uint64) << 16).astype(np.uint32).view(np.int32)


for _asm, _sel, _bf in ((_MMA_F16_0, 0, False), (_MMA_F16_1, 1, False), (_MMA_BF16_0, 0, True),
                        (_MMA_BF16_1, 1, True)):
    ASM_EMULATIONS[_asm.value] = mma_sp_reference(_sel, _bf)
ASM_EMULATIONS[_SUB_BF16X2.value] = lambda y, c, m1: _bf16x2_sub_reference(y, c)
ASM_EMULATIONS[_ZERO_WORD.value] = lambda z, magic: prmt_raw_reference(z, magic, 0x5050)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f,r",
                                     [a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _int8_pair(p, SEL: tl.constexpr, sm_mask, BF16: tl.constexpr):
    # Two sign-magnitude bytes of word p (selector SEL puts each in both bytes of a lane)
    # -> an A register: float16 value * 2**-24 (AND), or bfloat16 value exactly.
    if BF16:
        d = libdevice.byte_perm(p, 0, SEL) & sm_mask
        y, c = int8_bf16_words(d)
        m1 = tl.full(y.shape, _BF16X2_MINUS_ONE, tl.int32)
        return tl.inline_asm_elementwise(_SUB_BF16X2, "=r,r,r,r", [y, c, m1], dtype=tl.int32, is_pure=True, pack=1)
    return libdevice.byte_perm(p, 0, SEL) & sm_mask   # float16: the same AND (sm_mask holds _SM_MASK)


@triton.jit
def _int4_pair(w, SHIFT: tl.constexpr, Z, nib_mask, BF16: tl.constexpr):
    # Two 4-bit codes (nibbles SHIFT/4 and SHIFT/4 + 4 of w) -> an A register of u - z, exact:
    # 1024 + u (bfloat16 128 + u) by one AND-OR, minus the zero word 1024 + z. The scale is
    # applied to the quantization group's fp32 partial sums (_fold), not here.
    q = ((w >> SHIFT) & nib_mask) | (_MAGIC_BF16 if BF16 else _MAGIC_F16)
    if BF16:
        m1 = tl.full(q.shape, _BF16X2_MINUS_ONE, tl.int32)
        return tl.inline_asm_elementwise(_SUB_BF16X2, "=r,r,r,r", [q, Z, m1], dtype=tl.int32, is_pure=True, pack=1)
    return _f16x2(_SUB_F16X2, q, Z)


@triton.jit
def _int8_regs(pq0, pq1, sm_mask, BF16: tl.constexpr):
    # A registers of one 32-column chunk from its two 16-column words (bytes: row g lo,
    # row g+8 lo, row g hi, row g+8 hi): (row g, group t), (row g+8, t), (g, t+4), (g+8, t+4).
    return (_int8_pair(pq0, 0x2200, sm_mask, BF16), _int8_pair(pq0, 0x3311, sm_mask, BF16),
            _int8_pair(pq1, 0x2200, sm_mask, BF16), _int8_pair(pq1, 0x3311, sm_mask, BF16))


@triton.jit
def _int4_regs(w, Z0, Z8, nib_mask, BF16: tl.constexpr):
    # A registers of one 32-column chunk from its word w (nibbles 2qq + b + 4v): rows g
    # (zero word Z0) and g + 8 (Z8), groups t and t + 4.
    return (_int4_pair(w, 0, Z0, nib_mask, BF16), _int4_pair(w, 4, Z8, nib_mask, BF16),
            _int4_pair(w, 8, Z0, nib_mask, BF16), _int4_pair(w, 12, Z8, nib_mask, BF16))


@triton.jit
def _mask_sp_word(m0, m1, m2, m3, sel):
    # 16-bit weights carry keep masks only (decode_format): lane (g, q)'s mma.sp word of an atom
    # from byte q of the keep-mask words of lanes 4g .. 4g + 3 (m0 .. m3), whose byte q holds
    # chunk q's group j = 0 .. 3 (the lane's index), row g in the low nibble and g + 8 in the high.
    # Gathered by byte permutes (sel = q | (q + 4) << 4), then converted nibble-parallel, then
    # rows g and g + 8 unzipped into bits 0-15 and 16-31.
    w = libdevice.byte_perm(libdevice.byte_perm(m0, m1, sel), libdevice.byte_perm(m2, m3, sel), 0x5410)
    # keep-mask nibble bits (slot 0, slot 1, slot 3, slot 2) -> (lower index, higher index), two bits each:
    # lower = 0 if slot 0, 1 if slot 1 alone of 0-1, else 2; higher = 3 if slot 3, 2 if slot 2 alone of
    # 2-3, else 1; an empty mask (padding, zero values) -> the valid pair (0, 1) = 0b0100.
    p1 = w >> 1
    p2 = w >> 2
    p3 = w >> 3
    ones = 0x11111111
    hi2 = (p2 | p3) & ones                      # higher index bit 1: slot 2 or 3 kept
    lo0 = ~w & p1 & ones                        # lower index bit 0: slot 1 kept, not slot 0
    lo1 = ~w & ~p1 & hi2                        # lower index bit 1: neither slot 0 nor 1 (and not empty)
    hi1 = (p2 | ~p3) & ones                     # higher index bit 0: slot 3 kept, or slot 2 not
    e = lo0 | (lo1 << 1) | (hi1 << 2) | (hi2 << 3)
    lo = e & 0x0F0F0F0F                         # row g's nibbles at 0, 8, 16, 24
    hi = (e >> 4) & 0x0F0F0F0F                  # row g + 8's
    # (lo | lo >> 4): groups 0, 1 in byte 0 and 2, 3 in byte 2; the permute takes bytes 0, 2 of each
    return libdevice.byte_perm(lo | (lo >> 4), hi | (hi >> 4), 0x6420)


@triton.jit
def _lane_words(v):
    # [L, 4] (a lane's 16-byte vector) -> its four [L] words in memory order (_split4: _four's order).
    w0, w2, w1, w3 = _split4(v)
    return w0, w1, w2, w3


@triton.jit
def _x_words(xw, kw: tl.constexpr, k, K, col, MASKED: tl.constexpr):
    # B registers of one 32-column chunk (first column k): this lane's x words (two columns
    # each) at kw, kw + 4, + 8, + 12 past xw (col = 2t: the lane's first column in the
    # chunk); columns >= K read as 0 (K % 4 == 0: a word is inside K or past it).
    if MASKED:
        b0 = tl.load(xw + kw, mask=k + col < K, other=0)
        b1 = tl.load(xw + kw + 4, mask=k + col + 8 < K, other=0)
        b2 = tl.load(xw + kw + 8, mask=k + col + 16 < K, other=0)
        b3 = tl.load(xw + kw + 12, mask=k + col + 24 < K, other=0)
    else:
        b0 = tl.load(xw + kw)
        b1 = tl.load(xw + kw + 4)
        b2 = tl.load(xw + kw + 8)
        b3 = tl.load(xw + kw + 12)
    return b0, b1, b2, b3


@triton.jit
def _int4_group(s_rows0, s_rows1, z_rows0, z_rows1, kq, ok, magic, MASKED: tl.constexpr, HAS_ZERO: tl.constexpr,
                BF16: tl.constexpr):
    # Scales (fp32) and zero words (magic | z, twice) of rows g and g + 8 at quantization
    # group kq: (s0, Z0, s8, Z8); loaded once per group, not per atom.
    MAGIC: tl.constexpr = _MAGIC_BF16 if BF16 else _MAGIC_F16
    if MASKED:
        s0 = tl.load(s_rows0 + kq, mask=ok, other=0.0)
        s8 = tl.load(s_rows1 + kq, mask=ok, other=0.0)
    else:
        s0 = tl.load(s_rows0 + kq)
        s8 = tl.load(s_rows1 + kq)
    if HAS_ZERO:
        # (magic | z) in both halves by one byte permute: bytes z, magic's high byte, z, again
        if MASKED:
            z0 = tl.load(z_rows0 + kq, mask=ok, other=0).to(tl.int32)
            z8 = tl.load(z_rows1 + kq, mask=ok, other=0).to(tl.int32)
        else:
            z0 = tl.load(z_rows0 + kq).to(tl.int32)
            z8 = tl.load(z_rows1 + kq).to(tl.int32)
        Z0 = tl.inline_asm_elementwise(_ZERO_WORD, "=r,r,r", [z0, magic], dtype=tl.int32, is_pure=True, pack=1)
        Z8 = tl.inline_asm_elementwise(_ZERO_WORD, "=r,r,r", [z8, magic], dtype=tl.int32, is_pure=True, pack=1)
    else:  # symmetric: z = 8
        Z0 = tl.full(magic.shape, MAGIC | 0x80008, tl.int32)
        Z8 = Z0
    return s0.to(tl.float32), Z0, s8.to(tl.float32), Z8


@triton.jit
def _fold(acc, grp, Q, N16: tl.constexpr, RT: tl.constexpr):
    # acc += scale * grp per row tile r and row: one quantization group's fp32 partial sums (of
    # x (u - z)); Q[r] = (scale row g, zero word, scale row g + 8, zero word). One FFMA each:
    # the product rounded once with the sum, as the dot would round adding the group's terms.
    out = ()
    for r in tl.static_range(RT):
        c0, c1, c2, c3, d0, d1, d2, d3 = acc[r]
        g0, g1, g2, g3, h0, h1, h2, h3 = grp[r]
        s0 = Q[r][0]
        s8 = Q[r][2]
        c0, c1, c2, c3 = c0 + s0 * g0, c1 + s0 * g1, c2 + s8 * g2, c3 + s8 * g3
        if N16:
            d0, d1, d2, d3 = d0 + s0 * h0, d1 + s0 * h1, d2 + s8 * h2, d3 + s8 * h3
        out = out + ((c0, c1, c2, c3, d0, d1, d2, d3),)
    return out


@triton.jit
def _mmas(acc, a, e, b, h, ASM: tl.constexpr, N16: tl.constexpr):
    # One row tile's mma.sp of a chunk: x rows 0-7 (B words b) into c, rows 8-15 (h) into d.
    c0, c1, c2, c3, d0, d1, d2, d3 = acc
    a0, a1, a2, a3 = a
    b0, b1, b2, b3 = b
    c0, c1, c2, c3 = _mma(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e, ASM)
    if N16:
        h0, h1, h2, h3 = h
        d0, d1, d2, d3 = _mma(a0, a1, a2, a3, h0, h1, h2, h3, d0, d1, d2, d3, e, ASM)
    return c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _chunk_x(xw0, xw1, kw: tl.constexpr, k, K, col, MASKED: tl.constexpr, N16: tl.constexpr):
    # One 32-column chunk's x words (first column k; rows 0-7 at xw0, 8-15 at xw1, word kw on): (b, h).
    b = _x_words(xw0, kw, k, K, col, MASKED)
    h = b
    if N16:
        h = _x_words(xw1, kw, k, K, col, MASKED)
    return b, h


@triton.jit
def _chunk(acc, A, E, bh, SEL: tl.constexpr, BF16: tl.constexpr, N16: tl.constexpr, RT: tl.constexpr):
    # One 32-column chunk: mma.sp for each of the RT row tiles (A registers A[r], metadata word
    # E[r]) with the chunk's x words bh (_chunk_x). acc: per row tile its 8 accumulator registers
    # (x rows 0-7, 8-15).
    b, h = bh
    if BF16:
        ASM: tl.constexpr = _MMA_BF16_1 if SEL else _MMA_BF16_0
    else:
        ASM: tl.constexpr = _MMA_F16_1 if SEL else _MMA_F16_0
    out = ()
    for r in tl.static_range(RT):
        out = out + (_mmas(acc[r], A[r], E[r], b, h, ASM, N16),)
    return out


@triton.jit
def _atom_values(vp, ok, MASKED: tl.constexpr):
    # One row tile's values of one atom: INT4 [L, 2] words, INT8 [L, 4].
    if MASKED:  # atoms past the padded K: zero values
        return tl.load(vp, mask=ok[:, None], other=0)
    return tl.load(vp)


@triton.jit
def _words(ep, a0, KA, A: tl.constexpr, MASKED: tl.constexpr):
    # A <= 4 consecutive mma.sp words per lane (atoms a0 ..) in one vector load: a tuple of A [L].
    # (Wider than 4 words, the coalescer splits a lane's row over two threads, and the split
    # words would go through shared memory to reach their lane.)
    ptrs = ep[:, None] + tl.arange(0, A)[None, :]
    if MASKED:  # atoms past the padded K: valid (0, 1) index pairs (their values are zero)
        w = tl.load(ptrs, mask=(a0 + tl.arange(0, A) < KA)[None, :], other=0x44444444)
    else:
        w = tl.load(ptrs)
    L: tl.constexpr = w.shape[0]
    # one return: Triton 3.6 refuses returns of different tuple lengths even in constexpr branches
    if A == 1:
        words = (tl.reshape(w, [L]),)
    elif A == 2:
        e0, e1 = tl.split(w)
        words = (e0, e1)
    else:   # [L, 2, 2]: atom 2i + k
        lo, hi = tl.split(tl.reshape(w, [L, 2, 2]))
        e0, e2 = tl.split(lo)
        e1, e3 = tl.split(hi)
        words = (e0, e1, e2, e3)
    return words


@triton.jit
def _tile_words(ep, a0, KA, A: tl.constexpr, MASKED: tl.constexpr):
    # One row tile's mma.sp words of a K-tile's A atoms, a lane's consecutive words in vector
    # loads of up to 16 bytes: one 4-byte load per atom would touch 32 cache lines (a lane's
    # words lie one meta row apart) for 128 bytes each time, 8 L1 wavefronts (docs/kernels.md,
    # "L1 wavefronts"). Returns the A words as a tuple of [L] tensors, in atom order.
    if A <= 4:
        words = _words(ep, a0, KA, A, MASKED)
    else:
        words = _words(ep, a0, KA, 4, MASKED) + _words(ep + 4, a0 + 4, KA, 4, MASKED)
    return words


@triton.jit
def _zeros(zero, RT: tl.constexpr):
    # RT row tiles' 8 accumulator registers, all zero.
    out = ()
    for r in tl.static_range(RT):
        out = out + ((zero, zero, zero, zero, zero, zero, zero, zero),)
    return out


@triton.jit
def _groups(srow, zrow, kq, ok, magic, MASKED: tl.constexpr, HAS_ZERO: tl.constexpr, BF16: tl.constexpr,
            RT: tl.constexpr):
    # Per row tile r: _int4_group of its rows g (srow[2r], zrow[2r]) and g + 8 at group kq.
    out = ()
    for r in tl.static_range(RT):
        out = out + (_int4_group(srow[2 * r], srow[2 * r + 1], zrow[2 * r], zrow[2 * r + 1], kq, ok, magic, MASKED,
                                 HAS_ZERO, BF16),)
    return out


@triton.jit
def _int4_tiles(W, Q, nib_mask, BF16: tl.constexpr, RT: tl.constexpr):
    # Per row tile r: the A registers of one chunk from its code word W[r] and zero words Q[r].
    out = ()
    for r in tl.static_range(RT):
        out = out + (_int4_regs(W[r], Q[r][1], Q[r][3], nib_mask, BF16),)
    return out


@triton.jit
def _fold_loads(PV, P2V, XV, EW, A: tl.constexpr, RT: tl.constexpr, W16: tl.constexpr, R32: tl.constexpr,
                N16: tl.constexpr):
    # XOR of one word of every load of a K-tile (_sp_tile's): a value that exists only once all
    # of them have arrived.
    d = XV[0][0][0][0]
    for c in tl.static_range(2 * A):
        for q in tl.static_range(4):
            if c + q > 0:
                d = d ^ XV[c][0][0][q]
            if N16:
                d = d ^ XV[c][0][1][q]
            if R32:
                d = d ^ XV[c][1][0][q]
                if N16:
                    d = d ^ XV[c][1][1][q]
    for j in tl.static_range(A):
        for r in tl.static_range(RT):
            d = d ^ _first_word(PV[j][r])
            if W16:
                d = d ^ _first_word(P2V[j][r])
    for r in tl.static_range(RT):
        if W16:
            for i in tl.static_range(4):
                d = d ^ EW[r][i][0]
                if A > 4:
                    d = d ^ EW[r][i][4]
        else:
            d = d ^ EW[r][0]
            if A > 4:
                d = d ^ EW[r][4]
    return d


@triton.jit
def _first_word(v):
    # A lane's first word of a [L, W] load (W = 2 or 4).
    if v.shape[1] == 2:
        w0, w1 = tl.split(v)
    else:
        w0, w1, w2, w3 = _lane_words(v)
    return w0


@triton.jit
def _sp_tile(acc, acc2, vt, V_ATOM, V_ROWS, et, E_ROWS, xt0, xt1, xt2, xt3, col, kt, K, KA, sm_mask, nib_mask,
             magic, srow, zrow, G, KM, sel, A: tl.constexpr,
             MASKED: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
             BF16: tl.constexpr, N16: tl.constexpr, RT: tl.constexpr, R32: tl.constexpr, W16: tl.constexpr,
             ONE_WAVE: tl.constexpr):
    # One K-tile (A atoms of 64 columns, two mma.sp chunks each) of this warp's RT row tiles:
    # acc per row tile its 8 accumulator registers (x rows 0-7, 8-15; the second four unused
    # unless N16); vt, et, xt0, xt1 this lane's value, metadata and x-word pointers at the
    # tile's start (row tile r: + r V_ROWS, + r E_ROWS); srow, zrow: INT4 scale and zero-point
    # row pointers (rows g, g + 8 of each row tile). Per chunk all row tiles' mma take the same
    # x words, which live only within their chunk. R32: a second 16-row block of x (rows 16-23
    # at xt2, 24-31 at xt3) into acc2 with the same A registers and metadata words.
    # W16: 16-bit weights, whose values are the A registers as stored (a lane's 4 words of each
    # half-atom, V_ATOM // 2 apart) and whose mma.sp words come from the keep masks of the lane's
    # quad (et: its first lane's mask row; the quad's rows KM apart; _mask_sp_word with sel).
    W2: tl.constexpr = 2 if INT4 else 4   # value words per lane and atom (16-bit: per half-atom)
    SEG: tl.constexpr = GROUP if GROUP < 64 * A else 64 * A  # INT4: columns of a quantization group inside one K-tile
    zero = tl.zeros(col.shape, tl.float32)
    # Every load of the K-tile first (keep masks / mma.sp words, values, x words), then the
    # mma.sp: the warp issues in order, so a load placed after a consumer of an earlier one waits
    # for it, and each such wave costs a memory round trip (the H200 measured the kernel
    # latency-bound with 2-15 waves per K-tile; scripts/kernel_static_check.py counts them).
    EW = ()
    for r in tl.static_range(RT):
        if W16:   # per quad lane i: its keep-mask words of the K-tile's atoms
            EW = EW + ((_tile_words(et + r * E_ROWS, kt * A, KA, A, MASKED),
                        _tile_words(et + r * E_ROWS + KM, kt * A, KA, A, MASKED),
                        _tile_words(et + r * E_ROWS + 2 * KM, kt * A, KA, A, MASKED),
                        _tile_words(et + r * E_ROWS + 3 * KM, kt * A, KA, A, MASKED)),)
        else:
            EW = EW + (_tile_words(et + r * E_ROWS, kt * A, KA, A, MASKED),)
    PV = ()   # per atom: per row tile its value words (16-bit: also the second half-atom's, P2)
    P2V = ()
    XV = ()   # per chunk (2 per atom): x words of rows 0-15 and (R32) 16-31
    for j in tl.static_range(A):
        a = kt * A + j
        ok = col * 0 + a < KA   # per lane (a scalar mask is not accepted by every Triton version)
        vp = (vt + j * V_ATOM)[:, None] + tl.arange(0, W2)[None, :]
        P = ()
        P2 = ()
        for r in tl.static_range(RT):
            P = P + (_atom_values(vp + r * V_ROWS, ok, MASKED),)
            if W16:
                P2 = P2 + (_atom_values(vp + r * V_ROWS + V_ATOM // 2, ok, MASKED),)
        PV = PV + (P,)
        P2V = P2V + (P2,)
        for half in tl.static_range(2):
            x01 = _chunk_x(xt0, xt1, j * 32 + 16 * half, a * 64 + 32 * half, K, col, MASKED, N16)
            x23 = x01
            if R32:
                x23 = _chunk_x(xt2, xt3, j * 32 + 16 * half, a * 64 + 32 * half, K, col, MASKED, N16)
            XV = XV + ((x01, x23),)
    # The first uses wait for every load above: a zero word folded from them all (K >> 31 is 0,
    # which no compiler can know; not KA, whose zero the masks hold already, and (x & m) | m = m)
    # enters the masks every conversion and mma.sp word reads, so ptxas issues all of the
    # K-tile's loads before any of them is used.
    # (ONE_WAVE False: the small layers' kernel without a K-loop, one K-tile per program, whose
    # integer-pipe budget has no room for the fold: INT4 3072 x 768 0.088 -> 0.104 per byte.)
    if ONE_WAVE:
        dep = _fold_loads(PV, P2V, XV, EW, A, RT, W16, R32, N16) & (K >> 31)
        sm_mask = sm_mask | dep
        nib_mask = nib_mask | dep
        sel = sel | dep
    for j in tl.static_range(A):
        a = kt * A + j
        ok = col * 0 + a < KA
        P = PV[j]
        E = ()
        for r in tl.static_range(RT):
            if W16:
                E = E + (_mask_sp_word(EW[r][0][j], EW[r][1][j], EW[r][2][j], EW[r][3][j], sel),)
            else:
                E = E + (EW[r][j],)
        X0 = XV[2 * j]
        X1 = XV[2 * j + 1]
        if INT4:
            # Each quantization group's chunks sum into zeroed accumulators grp, then _fold adds
            # scale * grp (a group inside this K-tile: SEG columns; BLOCK_K < GROUP: the tile's part).
            W0 = ()
            W1 = ()
            for r in tl.static_range(RT):
                w0, w1 = tl.split(P[r])
                W0 = W0 + (w0,)
                W1 = W1 + (w1,)
            if (2 * j) % (SEG // 32) == 0:   # a group starts with chunk 0
                kq = (a * 64) // GROUP
                Q = _groups(srow, zrow, kq, ok & (col * 0 + kq < G), magic, MASKED, HAS_ZERO, BF16, RT)
                grp = _zeros(zero, RT)
                grp2 = grp
            A0 = _int4_tiles(W0, Q, nib_mask, BF16, RT)
            grp = _chunk(grp, A0, E, X0[0], 0, BF16, N16, RT)
            if R32:
                grp2 = _chunk(grp2, A0, E, X0[1], 0, BF16, N16, RT)
            if SEG == 32:  # the second chunk is the next group
                acc = _fold(acc, grp, Q, N16, RT)
                if R32:
                    acc2 = _fold(acc2, grp2, Q, N16, RT)
                kq = (a * 64 + 32) // GROUP
                Q = _groups(srow, zrow, kq, ok & (col * 0 + kq < G), magic, MASKED, HAS_ZERO, BF16, RT)
                grp = _zeros(zero, RT)
                grp2 = grp
            A1 = _int4_tiles(W1, Q, nib_mask, BF16, RT)
            grp = _chunk(grp, A1, E, X1[0], 1, BF16, N16, RT)
            if R32:
                grp2 = _chunk(grp2, A1, E, X1[1], 1, BF16, N16, RT)
            if (2 * j + 2) % (SEG // 32) == 0:   # the group ends with chunk 1
                acc = _fold(acc, grp, Q, N16, RT)
                if R32:
                    acc2 = _fold(acc2, grp2, Q, N16, RT)
        else:
            A0 = ()
            A1 = ()
            for r in tl.static_range(RT):
                if W16:   # the stored words are the A registers: chunk 0 in the first half-atom, chunk 1 in the second
                    A0 = A0 + (_lane_words(P[r]),)
                    A1 = A1 + (_lane_words(P2V[j][r]),)
                else:
                    p0, p1, p2, p3 = _lane_words(P[r])
                    A0 = A0 + (_int8_regs(p0, p1, sm_mask, BF16),)
                    A1 = A1 + (_int8_regs(p2, p3, sm_mask, BF16),)
            acc = _chunk(acc, A0, E, X0[0], 0, BF16, N16, RT)
            acc = _chunk(acc, A1, E, X1[0], 1, BF16, N16, RT)
            if R32:
                acc2 = _chunk(acc2, A0, E, X0[1], 0, BF16, N16, RT)
                acc2 = _chunk(acc2, A1, E, X1[1], 1, BF16, N16, RT)
    return acc, acc2


def _sparse24_sp(
    x_ptr, v_ptr, meta_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, N, K, KA, KM,
    stride_xm, stride_xk,
    stride_om, stride_on,
    INT8: tl.constexpr, W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_TILE: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, N16: tl.constexpr,
    RT: tl.constexpr, R32: tl.constexpr,
):
    # Grid: (cdiv(M, ROWS), cdiv(N, BLOCK_N), SPLIT_K), ROWS = 32 x rows per program when R32
    # (M > 16: each weight tile's registers serve two 16-row blocks of x), else 16; num_warps = BLOCK_N // (16 RT): warp w
    # owns the RT row tiles pid_n * BLOCK_N / 16 + RT w + r (RT = 2: both tiles' mma take the
    # same x words, loaded once). meta_ptr: the layout's meta, (NT, 32, KM) words whose
    # second half (atoms KM / 2 ..) holds the mma.sp words. x: unit column stride, even
    # row stride (stride_xk is not read). DOT_PRECISION: the decode kernel's constexpr (one
    # signature for both launch paths), not used here.
    W: tl.constexpr = BLOCK_N // (16 * RT)
    L: tl.constexpr = 32 * W
    A: tl.constexpr = BLOCK_K // 64
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    lane = tl.arange(0, L)
    li = lane % 32
    g = li // 4
    tq = li % 4
    # Grid (row blocks, weight tiles, splits): the row blocks along x, which the GPU starts fastest,
    # so the programs that read one weight tile for different rows of x start together and all but
    # the first find it in L2 (with the row blocks along z, a layer whose programs do not all fit
    # on the SMs at once would read the weight from HBM once per row block).
    ROWS: tl.constexpr = 32 if R32 else 16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n_tiles = tl.num_programs(1)
    m0 = pid_m.to(tl.int64) * ROWS
    x_ptr += m0 * stride_xm
    out_ptr += m0 * stride_om
    m_left = tl.minimum(M - pid_m * ROWS, ROWS)
    NT = (N + 127) // 128 * 8
    t = pid_n * (BLOCK_N // 16) + (lane // 32) * RT    # this lane's (first) row tile

    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    if ONE_TILE:   # SPLIT_K == k_tiles: one K-tile per split, no division
        per_split = 1
    else:
        per_split = (k_tiles + SPLIT_K - 1) // SPLIT_K
    k_lo = pid_k * per_split
    k_hi = min(k_tiles, k_lo + per_split)
    n_full = K // BLOCK_K

    # values as 32-bit words, per lane and atom: INT8 4 words (16 B), INT4 2 words (8 B), 16-bit
    # weights 4 words per half-atom (the A registers of one chunk)
    W16: tl.constexpr = not INT8 and not INT4
    v_ptr = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if W16:
        v_lane = v_ptr + t.to(tl.int64) * 128 + li * 4       # + atom * 2 * NT * 128 (+ NT * 128: half 1)
        V_ATOM = NT.to(tl.int64) * 256
        V_ROWS: tl.constexpr = 128
    elif INT4:
        v_lane = v_ptr + t.to(tl.int64) * 64 + li * 2        # + atom * NT * 64
        V_ATOM = NT.to(tl.int64) * 64
        V_ROWS: tl.constexpr = 64                             # the next row tile
    else:
        v_lane = v_ptr + t.to(tl.int64) * 128 + li * 4       # + atom * NT * 128
        V_ATOM = NT.to(tl.int64) * 128
        V_ROWS: tl.constexpr = 128
    if W16:   # the keep masks of the lane's quad (lanes 4g .. 4g + 3; rows KM apart)
        e_ptrs = meta_ptr + (t * 32 + 4 * g).to(tl.int64) * KM
    else:     # the mma.sp words (KM >= 0: a shift, not a signed division)
        e_ptrs = meta_ptr + ((t * 32 + li).to(tl.int64) * KM + (KM >> 1))
    E_ROWS = 32 * KM
    sel = tq | ((tq + 4) << 4)   # W16: byte q of two keep-mask words
    # x rows g and g + 8 as 32-bit words (rows past M clamped: never stored)
    xi = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    r0 = tl.minimum(g, m_left - 1).to(tl.int64)
    r1 = tl.minimum(g + 8, m_left - 1).to(tl.int64)
    xw0 = xi + r0 * (stride_xm // 2) + tq
    xw1 = xi + r1 * (stride_xm // 2) + tq
    xw2 = xw0   # R32: rows g + 16 and g + 24 (clamped the same way)
    xw3 = xw1
    if R32:
        xw2 = xi + tl.minimum(g + 16, m_left - 1).to(tl.int64) * (stride_xm // 2) + tq
        xw3 = xi + tl.minimum(g + 24, m_left - 1).to(tl.int64) * (stride_xm // 2) + tq
    # INT4 scale and zero-point rows g, g + 8 of each row tile (padding rows clamped)
    G = (K + GROUP - 1) // GROUP
    srow = ()
    zrow = ()
    for h in tl.static_range(2 * RT):   # rows g and g + 8 of each row tile (padding rows clamped)
        row = tl.minimum(t * 16 + g + 8 * h, N - 1).to(tl.int64) * G
        srow = srow + (scale_ptr + row,)
        zrow = zrow + (zero_ptr + row,)

    col = 2 * tq
    # INT8 x bfloat16: the sign-magnitude mask as a runtime register (KA >> 31 is 0, which no
    # compiler can know) fuses the AND with the magic OR into one LOP3, instead of rebuilding
    # the constant in a register for every use (the decode kernel's trick).
    sm_mask = _SM_MASK | (KA >> 31)
    nib_mask = 0x000F000F | (KA >> 31)   # INT4: the codes' AND-OR is one LOP3 the same way
    # INT4 zero points: the magic word in a register, the zero word's prmt takes its selector as an immediate
    magic = tl.full([L], _MAGIC_BF16 if BF16 else _MAGIC_F16, tl.int32) | (K >> 31)   # not KA: LLVM would merge it with nib_mask
    acc = _zeros(tl.zeros([L], tl.float32), RT)   # per row tile: x rows 0-7, 8-15
    acc2 = acc                                     # R32: x rows 16-23, 24-31
    # pointers at this split's first K-tile, advanced by one tile per iteration
    vt = v_lane + (k_lo * A).to(tl.int64) * V_ATOM
    et = e_ptrs + k_lo * A
    xt0 = xw0 + k_lo * (BLOCK_K // 2)
    xt1 = xw1 + k_lo * (BLOCK_K // 2)
    xt2 = xw2 + k_lo * (BLOCK_K // 2)
    xt3 = xw3 + k_lo * (BLOCK_K // 2)
    V_TILE = A * V_ATOM
    if ONE_TILE and EVEN_K:  # split pid_k owns exactly K-tile pid_k (the small layers' default): no loop
        acc, acc2 = _sp_tile(acc, acc2, vt, V_ATOM, V_ROWS, et, E_ROWS, xt0, xt1, xt2, xt3, col, k_lo, K, KA, sm_mask,
                             nib_mask, magic, srow, zrow, G, KM, sel, A, False, INT4, GROUP, HAS_ZERO, BF16, N16, RT,
                             R32, W16, False)
    else:
        for kt in range(k_lo, min(k_hi, n_full)):
            acc, acc2 = _sp_tile(acc, acc2, vt, V_ATOM, V_ROWS, et, E_ROWS, xt0, xt1, xt2, xt3, col, kt, K, KA, sm_mask,
                                 nib_mask, magic, srow, zrow, G, KM, sel, A, False, INT4, GROUP, HAS_ZERO, BF16, N16,
                                 RT, R32, W16, True)
            vt += V_TILE
            et += A
            xt0 += BLOCK_K // 2
            xt1 += BLOCK_K // 2
            if R32:
                xt2 += BLOCK_K // 2
                xt3 += BLOCK_K // 2
    if not EVEN_K:
        if (n_full >= k_lo) & (n_full < k_hi):  # this split owns the partial tile (pointers are there)
            acc, acc2 = _sp_tile(acc, acc2, vt, V_ATOM, V_ROWS, et, E_ROWS, xt0, xt1, xt2, xt3, col, n_full, K, KA,
                                 sm_mask, nib_mask, magic, srow, zrow, G, KM, sel, A, True, INT4, GROUP, HAS_ZERO, BF16,
                                 N16, RT, R32, W16, True)

    # out^T fragment -> (n, m): n = row of W, m = row of x
    n_lo = t * 16 + g
    m_lo = 2 * tq
    write = True
    if SPLIT_K > 1:
        # Serial split-K (as the decode kernel): partials in the plan's workspace
        # [tiles, SPLIT_K, BLOCK_N, 16], a tile per BLOCK_N rows of W and 16 rows of x (R32: this
        # program's second 16 rows in the next block of n_tiles tiles), the last-arriving program (its
        # first tile's counter) sums them in split order.
        tile = pid_m * (ROWS // 16) * n_tiles + pid_n
        TILE: tl.constexpr = SPLIT_K * BLOCK_N * 16
        # a lane's 8 partials of a row tile lie together (two 16-byte vectors): the program's row tile i
        # at 256 i floats, lane li at 8 li
        base = ws_ptr + tile.to(tl.int64) * TILE + (t - pid_n * (BLOCK_N // 16)) * 256 + li * 8
        base2 = base + n_tiles.to(tl.int64) * TILE
        mine = base + pid_k * (BLOCK_N * 16)
        mine2 = base2 + pid_k * (BLOCK_N * 16)
        for r in tl.static_range(RT):   # row tile r: 16 rows (256 partials) further
            _sp_store(mine + 256 * r, acc[r], N16)
            if R32:
                _sp_store(mine2 + 256 * r, acc2[r], N16)
        tl.debug_barrier()  # all threads' partials are stored before the counter releases them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        write = arrived == SPLIT_K - 1
        if write:
            summed = ()
            summed2 = ()
            for r in tl.static_range(RT):
                summed = summed + (_sp_sum(base + 256 * r, SPLIT_K, BLOCK_N * 16, N16),)
                if R32:
                    summed2 = summed2 + (_sp_sum(base2 + 256 * r, SPLIT_K, BLOCK_N * 16, N16),)
            acc = summed
            if R32:
                acc2 = summed2
            tl.store(count_ptr + tile, 0)  # ready for the next launch
    if write:
        for r in tl.static_range(RT):
            _sp_epilogue(acc[r], out_ptr, scale_ptr, bias_ptr, n_lo + 16 * r, m_lo, N, m_left, stride_om, stride_on,
                         INT8, not BF16, HAS_BIAS, N16)
            if R32:   # rows 16-31 (none stored where m_left <= 16)
                _sp_epilogue(acc2[r], out_ptr + 16 * stride_om, scale_ptr, bias_ptr, n_lo + 16 * r, m_lo, N,
                             m_left - 16, stride_om, stride_on, INT8, not BF16, HAS_BIAS, N16)


@triton.jit
def _four(a, b, c, d):
    # Four [L] registers as one [L, 4] tensor (a lane's 16-byte vector), in the order _split4 undoes.
    return tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), [a.shape[0], 4])


@triton.jit
def _split4(v):
    # [L, 4] from _four -> its four [L] registers.
    lo, hi = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    a, b = tl.split(lo)
    c, d = tl.split(hi)
    return a, b, c, d


@triton.jit
def _sp_store(p, acc, N16: tl.constexpr):
    # One lane's split-K partials (one row tile's 8 registers) at p: 32 contiguous bytes, stored
    # as two 16-byte vectors (eight 4-byte stores and, in _sp_sum, eight loads per split made the
    # compile 5x slower: Triton's coalescing pass grows with every memory access, ~16 s at SPLIT_K 16).
    c0, c1, c2, c3, d0, d1, d2, d3 = acc
    four = tl.arange(0, 4)[None, :]
    tl.store(p[:, None] + four, _four(c0, c1, c2, c3), cache_modifier=".cg")
    if N16:
        tl.store(p[:, None] + 4 + four, _four(d0, d1, d2, d3), cache_modifier=".cg")


@triton.jit
def _sp_sum(base, SPLIT_K: tl.constexpr, STRIDE: tl.constexpr, N16: tl.constexpr):
    # The SPLIT_K partials at a lane's places (_sp_store's), added in split order (the same bits
    # whatever order the programs arrived in).
    four = tl.arange(0, 4)[None, :]
    c = tl.load(base[:, None] + four, cache_modifier=".cg")
    d = c   # not read unless N16
    if N16:
        d = tl.load(base[:, None] + 4 + four, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        part = base[:, None] + s * STRIDE + four
        c += tl.load(part, cache_modifier=".cg")
        if N16:
            d += tl.load(part + 4, cache_modifier=".cg")
    c0, c1, c2, c3 = _split4(c)
    d0, d1, d2, d3 = _split4(d)
    return c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _sp_epilogue(acc, out_ptr, scale_ptr, bias_ptr, n_lo, m_lo, N, M, stride_om, stride_on,
                 INT8: tl.constexpr, X_FP16: tl.constexpr, HAS_BIAS: tl.constexpr, N16: tl.constexpr):
    # out[m, n] for this lane's fragment: (n_lo, m_lo), (n_lo, m_lo + 1), (n_lo + 8, ...), and
    # m + 8 for the second n-tile; INT8 scale (times 2**24 for the float16 subnormals), bias.
    c0, c1, c2, c3, d0, d1, d2, d3 = acc
    n_hi = n_lo + 8
    ok_lo = n_lo < N
    ok_hi = n_hi < N
    if INT8:
        s_lo = tl.load(scale_ptr + n_lo, mask=ok_lo, other=0.0)
        s_hi = tl.load(scale_ptr + n_hi, mask=ok_hi, other=0.0)
        if X_FP16:
            s_lo = s_lo * _TWO_POW_24
            s_hi = s_hi * _TWO_POW_24
        c0, c1, c2, c3 = c0 * s_lo, c1 * s_lo, c2 * s_hi, c3 * s_hi
        d0, d1, d2, d3 = d0 * s_lo, d1 * s_lo, d2 * s_hi, d3 * s_hi
    if HAS_BIAS:
        b_lo = tl.load(bias_ptr + n_lo, mask=ok_lo, other=0.0).to(tl.float32)
        b_hi = tl.load(bias_ptr + n_hi, mask=ok_hi, other=0.0).to(tl.float32)
        c0, c1, c2, c3 = c0 + b_lo, c1 + b_lo, c2 + b_hi, c3 + b_hi
        d0, d1, d2, d3 = d0 + b_lo, d1 + b_lo, d2 + b_hi, d3 + b_hi
    OT: tl.constexpr = out_ptr.dtype.element_ty
    p_lo = out_ptr + m_lo.to(tl.int64) * stride_om + n_lo * stride_on
    p_hi = out_ptr + m_lo.to(tl.int64) * stride_om + n_hi * stride_on
    tl.store(p_lo, c0.to(OT), mask=ok_lo & (m_lo < M))
    tl.store(p_lo + stride_om, c1.to(OT), mask=ok_lo & (m_lo + 1 < M))
    tl.store(p_hi, c2.to(OT), mask=ok_hi & (m_lo < M))
    tl.store(p_hi + stride_om, c3.to(OT), mask=ok_hi & (m_lo + 1 < M))
    if N16:
        p_lo += 8 * stride_om
        p_hi += 8 * stride_om
        tl.store(p_lo, d0.to(OT), mask=ok_lo & (m_lo + 8 < M))
        tl.store(p_lo + stride_om, d1.to(OT), mask=ok_lo & (m_lo + 9 < M))
        tl.store(p_hi, d2.to(OT), mask=ok_hi & (m_lo + 8 < M))
        tl.store(p_hi + stride_om, d3.to(OT), mask=ok_hi & (m_lo + 9 < M))


sparse24_sp = triton.jit(_sparse24_sp, do_not_specialize=["M"])
sparse24_sp_interpreted = InterpretedKernel(_sparse24_sp)

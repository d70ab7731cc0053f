"""INT4 2:4 weights (W4A16) in the decode and prefill kernels, run on CPU tensors in
Triton's interpreter (the source the GPU compiles), against F.linear in fp64 on the
dense weight built here from the stored codes, scales and zero points as the format
defines it (``W = (u - zero) * scale``), at the kept positions of an independent
magnitude mask. bfloat16 has no numpy type, so the interpreter cannot run it: its
dequantization identities are checked exactly below, and its code path is compiled
for sm_90 (scripts/kernel_static_check.py and the last test here)."""
import itertools

import pytest
import torch
import triton.language as tl

import sparse24
from sparse24.decode_format import DecodePacked, pack_decode
from sparse24.kernels import sparse24_prefill as prefill_kernel
from sparse24.kernels.interpreter import InterpretedKernel, byte_perm_reference, prmt_raw_reference, triton_version
from sparse24.kernels.sparse24_decode import SELECTORS
from sparse24.format import bf16_exact_scales
from sparse24.kernels.sparse24_decode import _int4_dequant
from sparse24.kernels.sparse24_prefill import (NATURAL_TRITON, int4_bf16_dequant, int4_bf16_dequant_exact,
                                               int4_bf16_exact_scale, int4_bf16_scale, int4_bf16_zero)
from sparse24.ops.config_space import KernelConfig
from sparse24.ops.linear24 import launch, linear_prefill
from sparse24.ops.linear24 import prefill
from sparse24.ops.linear24.prefill import natural_tile, prefill_config
from sparse24.ops.linear24 import linear_triton as linear_decode

from conftest import assert_matches_reference, int32_words, matches_reference, top2_mask
from test_decode_kernel import _static_check  # the static-check script's loader

CODE_BIT = (0, 1, 3, 2)   # the decode layout's keep-mask bit of each slot


def _cfg(bn, bk, split=1, stages=1):
    return KernelConfig(16, bn, bk, 1, split, bn // 16, stages, kernel="decode")


def _int4(N, K, gs, symmetric, gen):
    """``(p, W)``: an INT4 weight and its dense fp64 dequantization, built independently of the
    library's decoders: kept positions from :func:`top2_mask` of the original weight, codes read
    off the bytes (group g's byte: lower kept slot in the low nibble), W = (u - zero) * scale."""
    w = torch.randn(N, K, generator=gen)
    p = sparse24.compress(w, quantize="int4", group_size=gs, symmetric=symmetric)
    keep = top2_mask(w).reshape(N, K // 4, 4)
    byte = p.values.long()
    codes = torch.stack((byte & 15, byte >> 4), dim=-1).double()              # (N, K/4, 2)
    col = torch.arange(K).reshape(K // 4, 4)
    k = (col // gs)                                                           # quantization group
    zero = torch.full((N, -(-K // gs)), 8.0, dtype=torch.float64) if p.zero is None else p.zero.double()
    scale = p.scale.double()
    W = torch.zeros(N, K // 4, 4, dtype=torch.float64)
    for r, g in itertools.product(range(N), range(K // 4)):
        slots = keep[r, g].nonzero().flatten().tolist()
        for v, slot in enumerate(slots):
            kk = int(k[g, slot])
            W[r, g, slot] = (codes[r, g, v] - zero[r, kk]) * scale[r, kk]
    return p, W.reshape(N, K)


def _operand(W, xtype, kernel="decode"):
    """The weight the product is exact to: the prefill kernel dequantizes into the dot's operand,
    the exact value rounded once to x's dtype; at M <= 16 (fp16/bf16 x: the sparse tensor-core
    kernel, u - z exact in the mma, the scale on each group's fp32 partial sums; fp32 x:
    exact in fp32) the exact dequantized weight itself."""
    return W.to(xtype).double() if kernel == "prefill" else W


# --- byte-permute selectors ------------------------------------------------------

def test_int4_selectors_fill_unkept_slots_with_the_zero_word():
    """For all six slot pairs, S = field * MUL + ADD permutes (P, Z) into the dense pairs:
    kept slots get their code's half of P, unkept ones Z's half (1024 + z: 0 after the subtraction)."""
    mul01, add01, mul23, add23 = SELECTORS["int4"]
    lo, hi, z = 0x6403, 0x640E, 0x6409
    P, Z = lo | hi << 16, z | z << 16
    for lo_slot, hi_slot in itertools.combinations(range(4), 2):
        code = (1 << CODE_BIT[lo_slot]) | (1 << CODE_BIT[hi_slot])
        d01 = int(byte_perm_reference(P, Z, (code & 3) * mul01 + add01)) & 0xFFFFFFFF
        d23 = int(byte_perm_reference(P, Z, ((code >> 2) & 3) * mul23 + add23)) & 0xFFFFFFFF
        want = [z] * 4
        want[lo_slot], want[hi_slot] = lo, hi
        assert [d01 & 0xFFFF, d01 >> 16, d23 & 0xFFFF, d23 >> 16] == want, (lo_slot, hi_slot)


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2 ** 32 if v >= 2 ** 31 else v


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_natural_int4_selectors_read_the_value_word(bf16):
    """The natural-order INT4 decode (kernels/sparse24_prefill.py, _decode_tile_natural): one
    multiply-add makes the selectors of four groups (b = 0, 1 and both half-atoms) and the
    raw byte permute reads the codes straight from the value word, unkept slots z from Zb.
    Checked for every keep pattern of every group of the word, against the layout's own
    definition (group g = 4h + 2qq + b: codes in nibbles 2qq + b and 2qq + b + 4 of word h,
    the lower kept slot's first; its keep mask in bits 4g..4g+3 of the metadata word, slots
    0, 1, 3, 2): after the kernel's AND-OR each dense half holds its slot's code (float16:
    b = 1's in place, 16 u; bfloat16: the word shifted down first) or z."""
    k = prefill_kernel
    pairs = list(itertools.combinations(range(4), 2))
    rng = torch.Generator().manual_seed(0)
    for trial in range(64):
        codes = torch.randint(0, 16, (2, 8), generator=rng).tolist()   # nibbles of words h = 0, 1
        keep = [pairs[int(i)] for i in torch.randint(0, 6, (8,), generator=rng)]
        if trial < 6:   # every keep pattern in every group at least once
            keep = [pairs[(trial + g) % 6] for g in range(8)]
        z = trial % 16
        words = [_int32(sum(c << 4 * n for n, c in enumerate(codes[h]))) for h in range(2)]
        mw = _int32(sum(((1 << CODE_BIT[a]) | (1 << CODE_BIT[b])) << 4 * g for g, (a, b) in enumerate(keep)))
        Zb = _int32(z * 0x11111111)
        for hh, qq, b, h in itertools.product(range(2), repeat=4):
            mul = (k._MUL23_NI4 if hh else k._MUL01_NI4).value
            add = (k._PA23_NI4 if hh else k._PA01_NI4).value + qq * 0x11111111
            f = (mw >> (8 * qq + 2 * hh)) & 0x00330033
            sel = _int32((f * mul + add) & k._SEL_MASK.value)
            word = words[h] >> (4 * b) if bf16 else words[h]
            d = int(prmt_raw_reference(word, Zb, sel >> (16 * h + 4 * b))) & 0xFFFFFFFF
            shift = 0 if bf16 else 4 * b
            got = [(d >> shift) & 15, (d >> (16 + shift)) & 15]
            g = 4 * h + 2 * qq + b
            lo_slot, hi_slot = keep[g]
            value = {lo_slot: codes[h][2 * qq + b], hi_slot: codes[h][2 * qq + b + 4]}
            want = [value.get(2 * hh + c, z) for c in range(2)]
            assert got == want, (trial, hh, qq, b, h)


@pytest.mark.parametrize("xtype, magic", [(torch.float16, 0x6400), (torch.bfloat16, 0x4300)])
def test_int4_magic_numbers_give_exact_integers(xtype, magic):
    """The identities the kernel's dequantization rests on, for every code u and zero point z:
    (magic | u) - (magic | z) == u - z exactly in x's 16-bit type, and (u - z) * scale done as
    the kernel does is the exact product rounded once to x's dtype. fp16: one mul.f16x2.
    bf16 (three fma.rn.bf16x2, each one rounding of an exact a * b + c, emulated exactly in
    fp32 here since every exact result fits its 24 bits): s = hi + lo, hi = bf16(s), lo exact,
    p = (u - z) * lo exact, then (u - z) * hi + p rounded once."""
    u = torch.arange(16).repeat_interleave(16).repeat(64)
    z = torch.arange(16).repeat(16).repeat(64)
    a = (magic | u).to(torch.int16).view(xtype)
    b = (magic | z).to(torch.int16).view(xtype)
    t = a - b
    assert torch.equal(t.double(), (u - z).double())
    s = (torch.randn(u.numel(), generator=torch.Generator().manual_seed(0))
         * torch.logspace(-6, 3, u.numel(), dtype=torch.float64).float()).half()
    exact = (u - z).double() * s.double()
    if xtype == torch.float16:
        got = t * s
    else:
        hi = s.to(torch.bfloat16)
        lo = (s.float() - hi.float()).to(torch.bfloat16)
        assert torch.equal(lo.double() + hi.double(), s.double())              # the split is exact
        p = (t.float() * lo.float()).to(torch.bfloat16)
        assert torch.equal(p.double(), t.double() * lo.double())               # so is (u - z) * lo
        got = (t.float() * hi.float() + p.float()).to(torch.bfloat16)
    assert torch.equal(got, exact.to(xtype))


def _every_code_pair():
    """``(u0, u1, z, b)``: every pair of codes, zero point and nibble (b = 1: the high nibbles), flat."""
    return tuple(t.reshape(-1) for t in torch.meshgrid(torch.arange(16), torch.arange(16), torch.arange(16),
                                                        torch.arange(2), indexing="ij"))


def _rounded_once(u0, u1, z, s):
    """(u - z) * s of both codes rounded once to bfloat16, as float64 ``(n, 2)`` (low, high halves)."""
    return torch.stack([((u - z).double() * s.double()).bfloat16().double() for u in (u0, u1)], 1)


def _int4_bf16_kernel(d_ptr, b_ptr, z_ptr, s_ptr, w_ptr, n: tl.constexpr):
    i = tl.arange(0, n)
    hi, lo = int4_bf16_scale(tl.load(s_ptr + i))
    tl.store(w_ptr + i, int4_bf16_dequant(tl.load(d_ptr + i), tl.load(b_ptr + i), int4_bf16_zero(tl.load(z_ptr + i)),
                                          hi, lo))


def test_int4_bf16_dequant_is_the_exact_product_rounded_once():
    """INT4 with bfloat16 x in the natural-order tiles (kernels/sparse24_prefill.py,
    int4_bf16_dequant, run here in Triton's interpreter through the emulation of fma.rn.bf16x2):
    the codes as the byte permute and AND leave them (u in bits 0-3 of each half for b = 0, 16 u
    for b = 1) read as bfloat16 subnormals, the zero point's word (z in both halves) turned into
    -z * 2**-7, and s * 2**7 split into bfloat16 hi + lo (int4_bf16_scale, through the emulation
    of cvt.rn.bf16x2.f32) give (u - z) * s rounded once to bfloat16, for every pair of codes,
    zero point and nibble, and float16 scales from subnormal to 65504. A multiplier off by a
    power of two, a nibble read from the wrong place or a dropped lo fails."""
    u0, u1, z, b = _every_code_pair()
    n = u0.numel()
    s = (torch.randn(n, generator=torch.Generator().manual_seed(0)).abs()
         * torch.logspace(-7, 4, n, dtype=torch.float64).float()).half()
    s[:4] = torch.tensor([2 ** -24, 3 * 2 ** -20, 65504, 1 + 2 ** -10]).half()   # subnormal, largest, 11 bits
    d = int32_words(u0 << 4 * b, u1 << 4 * b)
    w = torch.empty_like(d)
    InterpretedKernel(_int4_bf16_kernel)[(1,)](d, b.to(torch.int32), int32_words(z, z), s, w, n=n)
    got = w.view(torch.bfloat16).view(-1, 2).double()                # (low, high) halves
    assert torch.equal(got, _rounded_once(u0, u1, z, s))


def _int4_bf16_exact_kernel(d_ptr, b_ptr, z_ptr, s_ptr, w_ptr, n: tl.constexpr):
    i = tl.arange(0, n)
    tl.store(w_ptr + i, int4_bf16_dequant_exact(tl.load(d_ptr + i), tl.load(b_ptr + i),
                                                int4_bf16_zero(tl.load(z_ptr + i)),
                                                int4_bf16_exact_scale(tl.load(s_ptr + i))))


def _int4_dequant_kernel(d_ptr, z_ptr, s_ptr, w_ptr, n: tl.constexpr):
    i = tl.arange(0, n)
    tl.store(w_ptr + i, _int4_dequant(tl.load(d_ptr + i), tl.load(z_ptr + i), tl.load(s_ptr + i), tl.bfloat16))


def test_int4_bf16_exact_scales_take_two_fma_and_give_the_exact_product_rounded_once():
    """Scales bfloat16 holds exactly (a bfloat16 module's copy, sparse24/nn/layout.py), in both
    kernels' bfloat16 paths, run here through the emulation of fma.rn.bf16x2: the prefill tile's
    (int4_bf16_dequant_exact: the codes as bfloat16 subnormals, the zero word, s * 2**7) and the
    decode kernel's (_int4_dequant on code words 128 + u and 128 + z) give (u - z) * s rounded once
    to bfloat16, for every pair of codes, zero point and nibble. A multiplier off by a power of
    two or a dropped 2**7 fails."""
    u0, u1, z, b = _every_code_pair()
    s = bf16_exact_scales(torch.randn(u0.numel(), generator=torch.Generator().manual_seed(1)).abs()
                          * torch.logspace(-7, 4, u0.numel(), dtype=torch.float64))   # 2**-24 to 65280
    s[:3] = torch.tensor([2 ** -24, 127 * 2 ** -24, 65280]).half()
    want = _rounded_once(u0, u1, z, s)
    w = torch.empty(u0.numel(), dtype=torch.int32)
    InterpretedKernel(_int4_bf16_exact_kernel)[(1,)](int32_words(u0 << 4 * b, u1 << 4 * b), b.to(torch.int32),
                                                     int32_words(z, z), s.bfloat16(), w, n=u0.numel())
    assert torch.equal(w.view(torch.bfloat16).view(-1, 2).double(), want)
    one28 = 0x4300   # bfloat16 128: its 7 mantissa bits hold 128 + u exactly
    InterpretedKernel(_int4_dequant_kernel)[(1,)](int32_words(one28 + u0, one28 + u1),
                                                  int32_words(one28 + z, one28 + z), s.bfloat16(), w, n=u0.numel())
    assert torch.equal(w.view(torch.bfloat16).view(-1, 2).double(), want)


def test_bf16_scales_are_only_read_with_bf16_x(gen):
    """The launch takes bfloat16 scales only for INT4 weights with bfloat16 x (what a module
    passes): with float16 or float32 x the kernels would read them as float16 / need float16,
    so the launch refuses before any work, and caches nothing."""
    p, _ = _int4(64, 128, 32, True, gen)
    d = pack_decode(p)
    before = dict(launch._PLANS)
    for xtype in (torch.float16, torch.float32):
        with pytest.raises(ValueError, match="bfloat16 scales are read only for INT4 weights with bfloat16 x"):
            launch.run(torch.randn(3, 128).to(xtype), d.values, d.meta, d.scale.bfloat16(), None, 64, None, None, 32)
    assert launch._PLANS == before


# --- the kernels against fp64 ------------------------------------------------------

def _case(M, N, K, xtype, gs, sym, bias, cfg):
    ids = f"M{M}-N{N}-K{K}-x{str(xtype)[6:]}-g{gs}-{'sym' if sym else 'asym'}-{'bias' if bias else 'nobias'}-" \
          f"{cfg.block_n}x{cfg.block_k}s{cfg.split_k}"
    return pytest.param(M, N, K, xtype, gs, sym, bias, cfg, id=ids)


@pytest.mark.parametrize("M,N,K,xtype,gs,sym,bias,cfg", [
    # M = 1, 5, 16; fp16 and fp32 x; every group size; symmetric and asymmetric; N and K off the
    # tiles (K = 200: a partial K-tile, a partial atom and a short last quantization group)
    _case(1, 40, 200, torch.float16, 32, True, True, _cfg(32, 64)),
    _case(5, 72, 200, torch.float32, 64, False, False, _cfg(64, 128)),
    _case(16, 40, 200, torch.float16, 128, False, True, _cfg(64, 256)),
    _case(5, 136, 96, torch.float16, 64, True, False, _cfg(128, 64)),         # K < group size 128 below
    _case(1, 40, 96, torch.float32, 128, True, True, _cfg(32, 64)),
    # serial split-K (one launch), with a partial last tile and splits that own no tile
    _case(16, 72, 300, torch.float16, 32, False, True, _cfg(64, 64, split=3, stages=2)),
    _case(5, 40, 256, torch.float32, 128, False, False, _cfg(64, 64, split=4)),   # one K-tile per split
    _case(13, 40, 200, torch.float16, 64, True, True, _cfg(64, 64, split=8)),     # splits 4..7 own none
])
def test_decode_kernel_matches_reference(M, N, K, xtype, gs, sym, bias, cfg, gen):
    p, W = _int4(N, K, gs, sym, gen)
    d = pack_decode(p)
    x = torch.randn(M, K, generator=gen).to(xtype)
    b = torch.randn(N, generator=gen) if bias else None
    y = linear_decode(x, d, b, config=cfg)
    assert y.dtype == xtype and y.shape == (M, N)
    assert_matches_reference(y, x, _operand(W, xtype), b)


@pytest.mark.parametrize("xtype,gs,sym", [(torch.float16, 32, False), (torch.float32, 128, True)])
def test_prefill_kernel_matches_reference(xtype, gs, sym, gen):
    """M > 16: each weight tile dequantized once per BLOCK_M rows."""
    p, W = _int4(72, 200, gs, sym, gen)
    x = torch.randn(40, 200, generator=gen).to(xtype)
    b = torch.randn(72, generator=gen)
    cfg = KernelConfig(32, 64, 64, 8, 1, 4, 2, kernel="prefill")
    y = linear_prefill(x, pack_decode(p), b, config=cfg)
    assert_matches_reference(y, x, _operand(W, xtype, "prefill"), b)


def _prefill_cfg(bm, bn, bk=64):
    return KernelConfig(bm, bn, bk, 8, 1, min(bn, 128) // 16, 2, kernel="prefill")


@pytest.mark.parametrize("M,N,K,xtype,gs,sym,bm,bn,bk", [
    # natural-order tiles (BLOCK_M >= 128): a partial row block (M = 130), rows past M in a second
    # x-block, N off 16, K off 64 (a partial K-tile and atom); groups of 32 split each atom's
    # half-atoms, 64 and 128 span one or two K-tiles (128: a short last group at K = 200)
    (130, 72, 200, torch.float16, 32, False, 128, 64, 64),
    (130, 40, 196, torch.float32, 32, True, 128, 64, 64),
    (130, 72, 136, torch.float16, 64, True, 128, 64, 64),
    (129, 136, 200, torch.float32, 128, False, 128, 64, 64),
    (129, 136, 200, torch.float16, 128, False, 256, 128, 64),
    (67, 40, 260, torch.float32, 64, False, 256, 128, 64),
    (130, 72, 132, torch.float16, 32, True, 256, 128, 64),
    # the wide tile: two 128-row halves, their scale rows apart (the second past N in the last block);
    # BLOCK_K 128: two atoms per K-tile, groups of 32 and 64 changing within it, a partial last one
    (130, 300, 200, torch.float16, 32, False, 128, 256, 64),
    (67, 200, 196, torch.float32, 128, True, 128, 256, 64),
    (130, 264, 200, torch.float16, 64, False, 128, 256, 128),
    (67, 136, 328, torch.float32, 32, True, 128, 256, 128),
])
def test_natural_order_tiles_match_reference(M, N, K, xtype, gs, sym, bm, bn, bk, gen):
    """From 128 rows of x each weight lane dequantizes one dense half of two lanes' groups
    straight into the wgmma's A fragment, x in its own column order (``_decode_tile_natural``)."""
    p, W = _int4(N, K, gs, sym, gen)
    x = torch.randn(M, K, generator=gen).to(xtype)
    b = torch.randn(N, generator=gen)
    if not natural_tile(bm, bn) and bn == 256:   # the wide tile before Triton 3.6: refused
        with pytest.raises(ValueError, match="needs Triton >= 3.6"):
            linear_prefill(x, pack_decode(p), b, config=_prefill_cfg(bm, bn, bk))
        return
    y = linear_prefill(x, pack_decode(p), b, config=_prefill_cfg(bm, bn, bk))
    assert y.dtype == xtype and y.shape == (M, N)
    assert_matches_reference(y, x, _operand(W, xtype, "prefill"), b)


@pytest.mark.parametrize("what", ["keep bit", "nibble"])
def test_natural_order_tiles_decode_what_is_stored(what, gen):
    """A wrong keep bit (one group's pair moved to its other two slots) or a moved nibble (one
    group's two codes swapped) in the natural-order tile misses the original weight by more than
    the bound and matches the weight those bits describe."""
    p, W = _int4(40, 128, 32, False, gen)
    d = pack_decode(p)
    meta, values = d.meta.clone(), d.values.clone()
    if what == "keep bit":
        meta[0, 20, 0] ^= 0b1111 << 8                 # lane 20 (rows 5, 13), atom 0, group 2
        bad = pack_decode(DecodePacked(values, meta, d.shape, d.dtype, d.scale, zero=d.zero, group_size=32,
                                       check=False).to_sparse24())   # and its mma.sp words
    else:   # lane 22 (rows 5, 13), word 1: group k's codes at nibbles k and k + 4 (the first that differ)
        word = int.from_bytes(bytes(values[0, 0, 22, 4:].tolist()), "little")
        k = next(k for k in range(4) if (word >> 4 * k) & 15 != (word >> 4 * (k + 4)) & 15)
        lo, hi = (word >> 4 * k) & 15, (word >> 4 * (k + 4)) & 15
        word = (word & ~(0xF << 4 * k | 0xF << 4 * (k + 4))) | hi << 4 * k | lo << 4 * (k + 4)
        values[0, 0, 22, 4:] = torch.tensor(list(word.to_bytes(4, "little")), dtype=torch.uint8)
        bad = DecodePacked(values, meta, d.shape, d.dtype, d.scale, zero=d.zero, group_size=32)
    x = torch.randn(130, 128, generator=gen)
    y = linear_prefill(x, bad, config=_prefill_cfg(128, 64))
    assert not matches_reference(y, x, W)
    assert_matches_reference(y, x, bad.to_dense().double())


def test_default_configs_and_the_op(gen):
    """Without a config (the built-in defaults), through sparse24.linear: the decode layout at
    M <= 16 and M > 16, and a layout-v1 INT4 weight with backend='triton' (re-ordered per call)."""
    p, W = _int4(72, 200, 64, False, gen)
    d = pack_decode(p)
    for M in (3, 20):   # backend="triton": the decode kernel at any M (prefill: "auto" on CUDA only)
        x = torch.randn(M, 200, generator=gen).half()
        assert_matches_reference(sparse24.linear(x, d, backend="triton"), x, _operand(W, torch.float16))
    x = torch.randn(4, 200, generator=gen).half()
    assert_matches_reference(sparse24.linear(x, p, backend="triton"), x, _operand(W, torch.float16))
    assert_matches_reference(linear_decode(x, p), x, _operand(W, torch.float16))
    # the untuned large-M prefill tile (tests/kernels/test_prefill_kernel.py), from the cost tables of
    # Triton 3.4-3.9: mostly two programs per SM (the model's serial rule past 64 rows: a program's
    # multiply, decode and loads one after the other, another program's filling the gaps), 64 x 128 x
    # 128 for 16-bit weights and INT4 with either x, except where a Triton compiles the kernel
    # otherwise (3.5, which runs no tile in x's own order: 16-bit 128 x 128 x 64); a Triton without a
    # table: the fixed list's 256 x 128 where 128-row tiles run in x's own order, else 128 x 128
    big = [prefill_config(4096, 4096, 4096, pair=pair) for pair in ("float16", "int4-float16", "int4-bfloat16")]
    if prefill.prefill_costs() is not None:
        half, int4 = {(3, 4): ((64, 128, 128), (128, 64, 64)), (3, 5): ((128, 128, 64), (64, 128, 128)),
                      (3, 6): ((64, 128, 128), (256, 64, 64))}.get(triton_version()[:2], ((64, 128, 128),) * 2)
        want = [half, int4, int4]
    else:
        want = [(256, 128, 64)] * 3 if natural_tile(256, 128) else [(128, 128, 64)] * 3
    assert [(c.block_m, c.block_n, c.block_k) for c in big] == want


@pytest.mark.parametrize("dtype,cfg", [("int4-bfloat16", None), ("int4-float16", _prefill_cfg(128, 64))],
                         ids=["bfloat16-wide", "float16-128x64"])
def test_natural_order_tiles_compile_for_sm90(dtype, cfg, monkeypatch):
    """No GPU here: the INT4 natural-order tiles compiled for sm_90 (scripts/kernel_static_check.py
    --prefill) run wgmma with the dequantized W straight from registers and x^T from the pipelined
    shared buffer: no shared-memory store in the loop (W copied through shared memory would show as
    STS), no wait takes the loop's wgmma groups below one K-tile's worth less one (128 rows: two
    accumulators, four groups, three left in flight; 256 rows: two groups, one), nothing spills,
    two programs fit per SM at 128 x 64 (4 warps), one at the 8-warp wide tile (128 x 256 x 64; x 128
    with Triton 3.6, whose group constants cost less once per 128 columns; before 3.6, which has no
    wide tile, 128 x 128)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    tool = _static_check()
    if cfg is None:   # the wide tile where this Triton runs it (x 128 with 3.6), else 128 x 128
        cfg = _prefill_cfg(128, 256, 128 if triton_version()[:2] == (3, 6) else 64) if natural_tile(128, 256) \
            else _prefill_cfg(128, 128)   # (x 128 spills 88 / 72 / 104 B with Triton 3.7 / 3.8 / 3.9)
    assert cfg.block_m >= 128
    r = tool.prefill_one(dtype, cfg, 90)
    assert r["hgmma"] and r["mma"] == cfg.block_k // 16 * -(-cfg.block_n // 128)
    if natural_tile(cfg.block_m, cfg.block_n):   # x in its own order (Triton >= 3.6)
        assert r["groups"] >= 2 and tool.in_flight(r) == min(r["groups"], 8) - 1   # 7 at most (16 at x 128)
    if NATURAL_TRITON:   # Triton >= 3.9 (this project's); 3.6 keeps 4 STS per K-tile in the INT4 loop
        assert r["sts"] == 0 and r["groups"] == (4 if cfg.block_m == 128 else 2)
    assert r["spills"] == 0 and r["local"] == 0
    assert tool.programs_per_sm(r["regs"], r["shared"], cfg.num_warps) >= 8 // cfg.num_warps


# --- corruption is caught ------------------------------------------------------------

def test_a_moved_nibble_fails_the_check(gen):
    """Swapping the two codes of one group (a nibble in the wrong place) is outside the bound;
    the kernel then matches the weight those bytes describe."""
    p, W = _int4(40, 128, 32, True, gen)
    d = pack_decode(p)
    values = d.values.clone()
    # lane 20 (rows 5, 13), word 0: group k = 2 qq + b has its codes at nibbles k (lower slot)
    # and k + 4 (higher slot); swap them in the first group whose two codes differ
    word = int.from_bytes(bytes(values[0, 0, 20, :4].tolist()), "little")
    k = next(k for k in range(4) if (word >> 4 * k) & 15 != (word >> 4 * (k + 4)) & 15)
    lo, hi = (word >> 4 * k) & 15, (word >> 4 * (k + 4)) & 15
    word = (word & ~(0xF << 4 * k | 0xF << 4 * (k + 4))) | hi << 4 * k | lo << 4 * (k + 4)
    values[0, 0, 20, :4] = torch.tensor(list(word.to_bytes(4, "little")), dtype=torch.uint8)
    bad = DecodePacked(values, d.meta, d.shape, d.dtype, d.scale, zero=d.zero, group_size=32)
    x = torch.randn(13, 128, generator=gen)
    y = linear_decode(x, bad, config=_cfg(64, 64))
    assert not matches_reference(y, x, W)
    assert_matches_reference(y, x, bad.to_dense().double())


@pytest.mark.parametrize("where", ["group", "row"])
def test_a_wrong_scale_index_fails_the_check(where, gen):
    """Scales read one quantization group off (or from the neighbouring row) are outside the bound:
    the kernel indexes scales by (row, group), and a transposed or shifted read would show here."""
    p, W = _int4(40, 128, 32, False, gen)
    d = pack_decode(p)
    scale = d.scale.clone()
    if where == "group":
        scale[:, [0, 1]] = scale[:, [1, 0]]    # groups 0 and 1 of every row swapped
    else:
        scale[[4, 5]] = scale[[5, 4]]          # rows 4 and 5 swapped
    bad = DecodePacked(d.values, d.meta, d.shape, d.dtype, scale, zero=d.zero, group_size=32)
    x = torch.randn(5, 128, generator=gen)
    y = linear_decode(x, bad, config=_cfg(64, 128))
    assert not matches_reference(y, x, W)
    assert_matches_reference(y, x, bad.to_dense().double())


# --- bfloat16 and the GPU build --------------------------------------------------------

def test_bf16_is_refused_on_cpu_and_compiles_for_sm90(gen):
    """The interpreter cannot run bfloat16 (a clear error); the bfloat16 INT4 path compiles for
    sm_80 and sm_90 with its magic constant, its fma dequantization, sparse tensor-core mma and
    no local memory."""
    p, _ = _int4(64, 256, 128, False, gen)
    d = pack_decode(p)
    with pytest.raises(TypeError, match="no bfloat16"):
        linear_decode(torch.randn(2, 256).bfloat16(), d)
    pytest.importorskip("triton.backends.nvidia")
    for cap, bn in ((80, 32), (90, 64)):
        cfg = _cfg(bn, 128, split=2, stages=2)
        ck = launch.aot_compile(torch.randn(16, 256).bfloat16(), d, None, torch.empty(16, 64).bfloat16(), cfg, 2,
                                (cap // 10, 0))
        ptx = ck.asm["ptx"]
        assert "1124090624" in ptx or "0x43004300" in ptx.lower()   # 0x43004300: bfloat16 128 + u
        assert ptx.count("fma.rn.bf16x2") >= 3 and "sub.f16x2" not in ptx
        # the sparse tensor-core kernel (kernels/sparse24_sp.py) on both: no dense dot
        assert "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32" in ptx
        assert "wgmma" not in ptx and "mma.sync" not in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("bm,bn", [(64, 64), (128, 64)], ids=["permuted-64x64", "natural-128x64"])
def test_bf16_scales_compile_to_two_fma_per_pair_for_sm90(bm, bn):
    """With bfloat16 x and the bfloat16 scales a bfloat16 module passes, both prefill tiles (x
    permuted below 128 rows: _int4_dequant; x in its own order: int4_bf16_dequant_exact) scale
    with the two-fma string, never the three-fma one of float16 scales (which they take with the
    same weight's float16 scales), and nothing spills."""
    pytest.importorskip("triton.backends.nvidia")
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    d = pack_decode(sparse24.compress(w, quantize="int4", group_size=64))
    cfg = KernelConfig(bm, bn, 64 if bm >= 128 else 128, 4, 1, bn // 16, 2, kernel="prefill")
    x, out = torch.randn(bm, 256).bfloat16(), torch.empty(bm, 256).bfloat16()
    two, three = ".reg .b32 t;", ".reg .b32 t, p;"   # _SCALE_BF16X2, _DEQUANT_BF16X2
    ptx = launch.aot_compile(x, d, None, out, cfg, 1, (9, 0)).asm["ptx"]
    assert three in ptx and two not in ptx
    d.scale = d.scale.bfloat16()   # exact: the weight is bfloat16 (format.bf16_exact_scales)
    ck = launch.aot_compile(x, d, None, out, cfg, 1, (9, 0))
    assert two in ck.asm["ptx"] and three not in ck.asm["ptx"]
    assert "ld.local" not in ck.asm["ptx"] and "st.local" not in ck.asm["ptx"]


def test_compiled_kernels_keep_their_fmas_whatever_tritons_fp_fusion_default(monkeypatch):
    """Triton 3.9 warned on every first compile that FP fusion was left to its default, which turns off in
    3.10: the INT4 decode kernel then split its 8 fma.rn.f32 into mul + add (other rounding, other
    instruction budget). The launch states it (launch.COMPILE_OPTIONS); no GPU needed: sm_90 PTX."""
    import re
    import warnings
    torch.manual_seed(0)
    d = pack_decode(sparse24.compress(torch.randn(256, 512).half(), quantize="int4", group_size=128))
    cfg = KernelConfig(16, 64, 128, 1, 1, 4, 1, kernel="decode")

    def fmas(default):
        if default is None:
            monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
        else:
            monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", default)
        ptx = launch.aot_compile(torch.randn(16, 512).half(), d, None, torch.empty(16, 256).half(), cfg, 1).asm["ptx"]
        return len(re.findall(r"\bfma\.rn\.f32", ptx)), len(re.findall(r"\bmul\.(?:rn\.)?f32", ptx))

    on = fmas("1")
    assert on[0] >= 8
    assert fmas("0") == on
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (Triton 3.9's "TRITON_DEFAULT_FP_FUSION is unset" warning)
        assert fmas(None) == on

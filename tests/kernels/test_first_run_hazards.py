"""Hazards a CPU run would not show but a first GPU run would hit (issue 22,
item 6): int32 offsets that wrap, grids past CUDA's limits, values not aligned
for the kernel's 4-byte word loads, and byte_perm's selector mask. Each is
checked here in Triton's interpreter, on small memory."""
import re
import time

import numpy as np
import pytest
import torch
import triton.language as tl

import sparse24
from sparse24.decode_format import DecodePacked, pack_decode
from sparse24.kernels import sparse24_decode
from sparse24.kernels.interpreter import byte_perm_reference, prmt_raw_reference
from sparse24.kernels.sparse24_decode import SELECTORS
from sparse24.ops.config_space import KernelConfig
from sparse24.ops.linear24 import launch, linear_triton

from conftest import assert_matches_reference, matches_reference

DECODE = KernelConfig(16, 32, 64, 1, 1, 2, 1, kernel="decode")
MATMUL = KernelConfig(16, 32, 32)


def _weights(N, K, gen):
    w = torch.randn(N, K, generator=gen).half()
    p = sparse24.compress(w)
    return p, pack_decode(p), (w * sparse24.mask_nm(w)).double()


# --- int64 offsets ------------------------------------------------------------------

def test_column_offsets_past_2_31_elements(gen):
    """x (2, 64) whose column stride S puts its last column 2**31 + elements away (a
    transposed x with M * K >= 2**31 looks like this): int32 offsets 63 * S would wrap
    to 2**31 elements before x (the interpreter computes offsets in the kernel's own
    integer types). x sits 2**31 elements into 8 GiB of untouched virtual memory, so
    a wrapped offset reads zeros and fails the check instead of faulting; only the
    pages of the 128 elements written become resident."""
    M, K = 2, 64
    S = 2 ** 31 // (K - 1) + 1                     # (K - 1) * S > 2**31
    buf = torch.empty(2 ** 31 + (K - 1) * S + M, dtype=torch.float16)
    x = buf.as_strided((M, K), (1, S), 2 ** 31)
    x.copy_(torch.randn(M, K, generator=gen))
    p, d, dense = _weights(40, K, gen)
    start = time.perf_counter()
    for w, cfg in ((d, DECODE), (p, KernelConfig(16, 32, 64))):   # BLOCK_K 64: offsets up to 63 * S
        assert_matches_reference(linear_triton(x, w, config=cfg), x, dense)
    assert time.perf_counter() - start < 30        # seconds: nothing copies the 8 GiB


# --- grids past CUDA's limits: one launch per row chunk ----------------------------------

def test_grid_chunks_keep_every_grid_within_cuda_limits():
    dec = launch._Decode
    assert dec.max_rows(4096, DECODE) == 65535 * 16 == 1_048_560
    for M in (1, 16, 1_048_560):
        assert dec.grid(M, 4096, DECODE, 4)[2] <= 65535
    assert dec.grid(1_048_561, 4096, DECODE, 4)[2] == 65536     # one more row would not launch
    mm = launch._Matmul
    rows = mm.max_rows(4096, MATMUL)
    assert mm.grid(rows, 4096, MATMUL, 1)[0] <= 2 ** 31 - 1 < mm.grid(rows + 16, 4096, MATMUL, 1)[0]
    assert launch.grid_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert launch.grid_chunks(2_097_121, 1_048_560) == [(0, 1_048_560), (1_048_560, 2_097_120),
                                                      (2_097_120, 2_097_121)]


@pytest.mark.parametrize("layout", ["decode", "v1"])
def test_rows_past_the_grid_limit_run_in_chunks(layout, monkeypatch, gen):
    """With the limit lowered to 16 rows, 37 rows run as 3 launches (strided x too) and
    match the reference: the path a prompt of over 1,048,560 rows takes."""
    p, d, dense = _weights(40, 64, gen)
    w, cfg = (d, DECODE) if layout == "decode" else (p, MATMUL)
    variant = launch._VARIANTS[cfg.kernel]
    monkeypatch.setattr(variant, "max_rows", staticmethod(lambda N, config: 16))
    launch._PLANS.clear()
    grids = []
    real = launch._Plan.launch
    monkeypatch.setattr(launch._Plan, "launch", lambda plan, grid, *a: grids.append(grid) or real(plan, grid, *a))
    try:
        for x in (torch.randn(37, 64, generator=gen).half(), torch.randn(64, 37, generator=gen).half().t()):
            b = torch.randn(40, generator=gen)
            assert_matches_reference(linear_triton(x, w, b, config=cfg), x, dense, b)
    finally:
        launch._PLANS.clear()
    assert len(grids) == 6


# --- values the kernel reads as 4-byte words ---------------------------------------------

def _shifted(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A contiguous copy of t starting ``elements`` into its storage."""
    buf = torch.zeros(t.numel() + elements, dtype=t.dtype)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("int8", [False, True], ids=["fp16", "int8"])
def test_unaligned_values_are_refused_with_a_clear_error(int8, gen):
    """A contiguous view at an odd storage offset passes the contiguity check, and the
    interpreter would compute it right, but the compiled kernel's 4-byte loads fault:
    refused where a DecodePacked is made and at launch (module buffers reach the kernel
    without one), and changes nothing. A copy (``.clone()``) is aligned and runs."""
    w = torch.randn(40, 64, generator=gen)
    d = pack_decode(sparse24.compress(w, quantize="int8") if int8 else sparse24.compress(w.half()))
    values = _shifted(d.values, 1)
    assert values.is_contiguous() and values.data_ptr() % 4 != 0
    saved = values.clone()
    with pytest.raises(ValueError, match=r"values must start at a 4-byte aligned address \(data_ptr\(\) % 4 == 0\)"):
        DecodePacked(values, d.meta, d.shape, d.dtype, d.scale)
    x = torch.randn(3, 64, generator=gen).half()
    with pytest.raises(ValueError, match="4-byte aligned"):
        launch.run(x, values, d.meta, d.scale, None, 40, DECODE)
    assert torch.equal(values, saved)
    fixed = DecodePacked(values.clone(), d.meta, d.shape, d.dtype, d.scale)
    assert_matches_reference(linear_triton(x, fixed, config=DECODE), x, d.to_dense().double())


def test_unaligned_meta_is_refused(gen):
    _, d, _ = _weights(40, 64, gen)
    raw = torch.zeros(d.meta.numel() * 4 + 4, dtype=torch.uint8)
    meta = torch.frombuffer(memoryview(raw.numpy()), dtype=torch.int32, count=d.meta.numel(), offset=2)
    meta = meta.view(d.meta.shape)
    meta.copy_(d.meta)
    assert meta.data_ptr() % 4 != 0
    with pytest.raises(ValueError, match="meta must start at a 4-byte aligned address"):
        DecodePacked(d.values, meta, d.shape, d.dtype)


# --- byte_perm's selector mask ---------------------------------------------------------

def _kernel_selectors(kinds=((False, 0), (False, 1), (True, 0), (True, 1))) -> set[int]:
    """Every selector the decode kernel computes for 16-bit and INT8 weights (``kinds``,
    keys of SELECTORS): field * MUL + ADD, field 0..3."""
    return {f * mul + add for mul01, add01, mul23, add23 in (SELECTORS[k] for k in kinds)
            for mul, add in ((mul01, add01), (mul23, add23)) for f in range(4)}


def test_raw_prmt_differs_for_15_of_the_kernel_s_selectors():
    """libdevice's __nv_byte_perm masks the selector with 0x7777 before prmt.b32; raw
    PRMT reads bit 3 of each nibble as 'replicate the sign bit'. The kernel's
    multiply-add selectors set those bits: 15 of its 24 selectors decode wrong without
    the mask, exactly those with a bit-3 nibble picking a byte of x (y is 0 in the
    kernel: its bytes' sign is 0 either way)."""
    sels = sorted(_kernel_selectors())
    assert len(sels) == 24
    rng = np.random.default_rng(0)
    x = rng.integers(-2 ** 31, 2 ** 31, 256, dtype=np.int64).astype(np.int32)
    differ = {s for s in sels if not np.array_equal(byte_perm_reference(x, 0, s), prmt_raw_reference(x, 0, s))}
    assert len(differ) == 15
    assert differ == {s for s in sels if any((s >> 4 * n) & 15 in (8, 9, 10, 11) for n in range(4))}
    # 0xBA98 on bytes (03, 82, 01, 80): raw PRMT fills each byte with its sign
    assert prmt_raw_reference(0x80018203 - 2 ** 32, 0, 0xBA98) == 0xFF00FF00 - 2 ** 32
    # INT4 permutes (P, Z), both words of positive bytes (0x64 | u, 0x64 | z): raw PRMT would
    # write 0x00 wherever a nibble has bit 3, and 6 of its 8 selectors have one
    sels4 = _kernel_selectors(["int4"])
    P = (rng.integers(0, 16, 256) | rng.integers(0, 16, 256) << 16 | 0x64006400).astype(np.int32)
    differ4 = {s for s in sels4 if not np.array_equal(byte_perm_reference(P, 0x64096409, s),
                                                      prmt_raw_reference(P, 0x64096409, s))}
    assert len(sels4) == 8 and len(differ4) == 6
    assert differ4 == {s for s in sels4 if any((s >> 4 * n) & 8 for n in range(4))}


def test_kernel_without_the_selector_mask_decodes_wrong(monkeypatch, gen):
    """The byte-permute decode runs raw PRMT (inline PTX, emulated here exactly: a set
    bit 3 of a selector nibble fills the byte with its sign) on selectors that
    ``_selector_pair`` masks with 0x77777777 (two at once; libdevice's byte_perm would
    mask each one). Without the mask the result leaves the error bound, so a test fails
    if the mask is ever dropped."""
    _, d, dense = _weights(40, 64, gen)
    x = torch.randn(5, 64, generator=gen).half()
    assert_matches_reference(linear_triton(x, d, config=DECODE), x, dense)
    monkeypatch.setattr(sparse24_decode, "_SEL_MASK", tl.constexpr(-1))
    assert not matches_reference(linear_triton(x, d, config=DECODE), x, dense)


def _prmt_selector_defs(ptx: str) -> list[str]:
    """For each ``prmt.b32`` of a PTX listing, the line that defines its selector
    register (or the immediate selector itself); a selector shifted right by a whole
    number of nibbles (the upper half of a pair of selectors) is followed to the
    register it shifts, and a constant moved into a register (Triton 3.4's PTX) to
    that constant."""
    defs = {m.group(1): m.group(0).strip() for m in re.finditer(r"^\s*\S+\s+(%r\d+),[^;]*;", ptx, re.M)}
    sels = [m.group(1).strip() for m in re.finditer(r"prmt\.b32\s+%r\d+,[^,]+,[^,]+,([^;]+);", ptx)]
    out = []
    for s in sels:
        line = defs.get(s, f"undefined {s}") if s.startswith("%") else s
        shift = re.fullmatch(r"shr\.[su]32\s+%r\d+,\s*(%r\d+),\s*(\d+);", line)
        if shift is not None and int(shift.group(2)) % 4 == 0:
            line = defs.get(shift.group(1), f"undefined {shift.group(1)}")
        constant = re.fullmatch(r"mov\.[bsu]32\s+%r\d+,\s*((0x)?[0-9a-fA-F]+U?);", line)
        if constant is not None:
            line = constant.group(1)
        out.append(line)
    return out


@pytest.mark.parametrize("int8", [False, True], ids=["fp16", "int8"])
def test_compiled_prmt_selectors_are_masked(int8, monkeypatch):
    """In the sm_90 PTX, every prmt.b32 takes a selector ANDed with a constant that clears
    bit 3 of every nibble (the decode's 0x77777777, then its upper half shifted down), or an
    immediate without such bits (INT8 x fp16 runs the sparse tensor-core kernel: libdevice's
    byte_perm with constant selectors, two per value word): a raw PRMT of a multiply-add
    selector without the mask would fail here."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    w = torch.randn(256, 512)
    d = pack_decode(sparse24.compress(w, quantize="int8") if int8 else sparse24.compress(w.half()))
    cfg = KernelConfig(16, 64, 128, 1, 1, 4, 1, kernel="decode")
    ptx = launch.aot_compile(torch.randn(16, 512).half(), d, None, torch.empty(16, 256).half(), cfg, 1).asm["ptx"]
    defs = _prmt_selector_defs(ptx)
    assert len(defs) >= (16 if int8 else 32) and all(_masked(line) for line in defs), \
        [d for d in defs if not _masked(d)]
    # the check itself: a raw PRMT of the multiply-add selector fails it
    raw = "mad.lo.s32 \t%r5, %r4, 8516, 22092;\n\tprmt.b32 \t%r6, %r1, 0, %r5;"
    assert not _masked(_prmt_selector_defs(raw)[0])
    moved = "mov.b32 \t%r5, 34952;\n\tprmt.b32 \t%r6, %r1, 0, %r5;"   # 0x8888: sign-replicating nibbles
    assert _prmt_selector_defs(moved) == ["34952"] and not _masked("34952")


def _masked(line: str) -> bool:
    """Whether a selector definition is an AND with (or an immediate of) no nibble bit 3."""
    mask = re.fullmatch(r"and\.b32\s+%r\d+,\s*%r\d+,\s*(-?\d+);", line)
    if mask is not None:
        return int(mask.group(1)) & 0x8888 == 0
    imm = re.fullmatch(r"((0x)?[0-9a-fA-F]+)U?", line)   # PTX immediates may carry a U suffix
    return imm is not None and int(imm.group(1), 0) & 0x8888 == 0

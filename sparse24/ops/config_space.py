"""The tile-config space of the 2:4 Triton kernels: what a config is, which
ones the tuner may try for a shape, and the untuned default.

A :class:`KernelConfig` names the kernel variant (``kernel``) and its launch
parameters. Each variant reads one weight layout (:data:`LAYOUT_KERNEL`):
``"matmul"`` layout v1 (:class:`sparse24.format.Sparse24Tensor`), ``"decode"``
the decode layout (:class:`sparse24.decode_format.DecodePacked`). M is
bucketed (:data:`M_BUCKETS`, powers of two) so one tuned entry serves every
batch size of its bucket.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["KernelConfig", "KERNEL_VARIANTS", "LAYOUTS", "LAYOUT_KERNEL", "M_BUCKETS", "DTYPE_KEYS", "DECODE_M",
           "SPLIT_K_MAX_M", "SP_MAX_M", "PREFILL_SPLIT_MAX_M", "PREFILL_SPLITS", "split_factors", "DECODE_PAIRS",
           "LISTED_SHAPES",
           "m_bucket", "dtype_key", "builtin_config", "decode_default", "decode_rows", "sp_tunable", "fp32_twin",
           "candidate_configs", "decode_configs", "check_decode_config", "sparse_kernel", "prefill_configs", "check_prefill_config"]

# Kernel variants a config may name (kernels/): "matmul" (sparse24_matmul.py)
# expands each weight tile in registers and runs tl.dot, any M, layout v1;
# "decode" (sparse24_decode.py) decodes the weight straight into the dot's
# register operand, 16 rows of x per program, the decode layout; "prefill"
# (sparse24_prefill.py) the same decode for BLOCK_M rows, the decode layout at M > 16.
KERNEL_VARIANTS = ("matmul", "decode", "prefill")
LAYOUTS = ("v1", "decode")
LAYOUT_KERNEL = {"v1": "matmul", "decode": "decode"}
# Decode sizes: at M <= 16 the weight is streamed once per call, and the decode
# kernel's main loop is held to the sm_90 instruction budget (docs/kernels.md).
DECODE_M = 16
# The decode kernels run 16 rows of x per program, more rows in more programs along the
# grid's z; their serial split-K keeps a workspace block per 16 rows, up to this many rows.
SPLIT_K_MAX_M = 64
# INT8 / INT4 weights with float16 / bfloat16 x stay on the sparse tensor-core kernel up to
# SP_MAX_M rows, and 16-bit weights of x's dtype take it from 17 rows: one program per 32 rows
# (block_m 32: every weight register serves 32 rows), one pass over the weight to 32 rows, two
# to 64, predicted 2.62-3.20x (INT8 / INT4) and 1.78x (16-bit) of dense at its worst listed
# shape, half that at 33-64 rows if each pass came from HBM (a tile's row blocks start together,
# so the second should read L2: 16-bit 1.33x, INT8 1.47x, INT4 1.31x, L1-bound), where the
# prefill kernel, split-K included, is predicted 1.04-1.25x (INT8 / INT4) at its worst and
# measured 0.55-0.71x (16-bit, 64 rows, H200; scripts/kernel_static_check.py --sass
# --listed-only --listed-rows 32 and --prefill; docs/kernels.md, "17-64 rows").
SP_MAX_M = SPLIT_K_MAX_M
# The prefill kernel's split-K (for few output tiles: x's rows times N's blocks below
# the SMs) serves M buckets up to this many rows; its workspace holds a partial tile per
# BLOCK_M rows of the bucket, and the split factors the defaults and the tuner consider.
PREFILL_SPLIT_MAX_M = 4096
PREFILL_SPLITS = (1, 2, 4, 8, 16)
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The (weight, activation) pairs a compressed layer holds in the decode layout on CUDA:
# short name -> dtype key (fp32 activations run too, off the tensor-core path).
DECODE_PAIRS = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8-float16", "int8-bf16": "int8-bfloat16"}
# Layer shapes (out, in) the decode path's static figures are held to (Llama-2/3-7B/8B/70B
# projections and MLPs, BERT-base): scripts/kernel_static_check.py, scripts/bench_host.py.
LISTED_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (8192, 8192),
                 (28672, 8192), (8192, 28672), (3072, 768), (768, 3072), (1024, 4096))
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_KEYS = tuple(_DTYPE_NAMES.values()) + tuple(f"{q}-{n}" for q in ("int8", "int4") for n in _DTYPE_NAMES.values())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of a 2:4 kernel variant (names as in the kernel)."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "matmul"

    _JSON = {"KERNEL": "kernel", "BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k",
             "GROUP_M": "group_m", "SPLIT_K": "split_k", "num_warps": "num_warps", "num_stages": "num_stages"}

    def validate(self) -> "KernelConfig":
        """Raise ValueError unless the kernel can compile this config on any GPU."""
        def integer(v, lo, hi):   # (bool is an int to Python: True would read as 1)
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        def pow2(v, lo, hi):
            return integer(v, lo, hi) and v & (v - 1) == 0
        checks = [  # every tl.dot dim >= 16; BLOCK_K covers whole metadata words (32 columns)
            ("KERNEL", self.kernel, self.kernel in KERNEL_VARIANTS, f"one of {KERNEL_VARIANTS}"),
            ("BLOCK_M", self.block_m, pow2(self.block_m, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_N", self.block_n, pow2(self.block_n, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_K", self.block_k, pow2(self.block_k, 32, 512), "a power of two in [32, 512]"),
            ("GROUP_M", self.group_m, integer(self.group_m, 1, 64), "in [1, 64]"),
            ("SPLIT_K", self.split_k, integer(self.split_k, 1, 32), "in [1, 32]"),
            ("num_warps", self.num_warps, pow2(self.num_warps, 1, 16), "1, 2, 4, 8 or 16"),
            ("num_stages", self.num_stages, integer(self.num_stages, 1, 8), "in [1, 8]"),
        ]
        for name, value, ok, need in checks:
            if not ok:
                raise ValueError(f"bad kernel config {name}={value!r}: must be {need}")
        return self

    def to_json(self) -> dict:
        """The config as a file stores it: ``{"BLOCK_M": ..., "num_stages": ...}``."""
        return {k: getattr(self, f) for k, f in self._JSON.items()}

    @classmethod
    def from_json(cls, d) -> "KernelConfig":
        if not isinstance(d, dict) or set(d) != set(cls._JSON):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a config must have exactly the keys {sorted(cls._JSON)}, got {got}")
        return cls(**{f: d[k] for k, f in cls._JSON.items()}).validate()


def m_bucket(M: int) -> int:
    """The smallest bucket >= M (powers of two, capped at 4096; 1 for M <= 1)."""
    # bit arithmetic, not a scan: this runs on every kernel call
    return 1 if M <= 1 else min(1 << (M - 1).bit_length(), M_BUCKETS[-1])


def dtype_key(x_dtype: torch.dtype, int8_weights: bool = False, int4_weights: bool = False) -> str:
    """``float16`` etc. for the activation dtype, prefixed ``int8-`` for INT8 weights, ``int4-`` for INT4."""
    name = _DTYPE_NAMES.get(x_dtype)
    if name is None:
        raise TypeError(f"no kernel configs for activations of dtype {x_dtype}")
    return f"int4-{name}" if int4_weights else f"int8-{name}" if int8_weights else name


def builtin_config(M: int, N: int = 4096, K: int = 4096, num_sms: int = 132, layout: str = "v1",
                   dtype: str = "float16") -> KernelConfig:
    """The untuned fallback: small tiles that compile on every CUDA GPU Triton
    supports. At decode sizes (M <= 16) the programs must fill the ``num_sms``
    multiprocessors (N = 4096 with BLOCK_N = 64 gives 64 programs for an H200's
    132): layout v1 shrinks BLOCK_N to 16 first, and only then split-K grows
    (each split keeping >= 2 K-tiles), since its split-K costs a zeroed fp32
    buffer and a copy per call. The decode layout: :func:`decode_default`.
    Not measured: a tuned file should replace it."""
    if layout == "decode":
        if M <= DECODE_M or decode_rows(M, dtype) == 32:   # (the sparse tensor-core route past 16 rows)
            return decode_default(N, K, dtype, num_sms, M)
        return KernelConfig(16, 64, 128, 1, 1, 4, 1, kernel="decode")  # split-K only at decode sizes and on that route
    if M <= 16:
        bn = next((b for b in (64, 32, 16) if -(-N // b) >= num_sms), 16)
        programs, split = -(-N // bn), 1
        while programs * split < num_sms and split < 8 and K >= 2 * 128 * (2 * split):
            split *= 2
        return KernelConfig(16, bn, 128, 8, split, 4 if bn >= 64 else 2, 3)
    if M <= 64:
        return KernelConfig(32, 64, 64, 8, 1, 4, 3)
    return KernelConfig(64, 64, 64, 8, 1, 4, 3)


def candidate_configs(M: int, N: int, K: int, num_sms: int = 132, layout: str = "v1",
                      dtype: str = "float16") -> list[KernelConfig]:
    """The config space searched for one (M, N, K) and weight layout: small per
    regime, because every config is a separate compile (seconds each). The
    decode layout's space is :func:`decode_configs`; layout v1's follows.

    Decode-sized M (<= 16) streams the weight once: one 16-row block, tiles
    from 16 x 256 to 128 x 64 along (N, K), and split-K while the programs
    stay within 4 per SM and each split keeps >= 2 K-tiles (more loads in
    flight when N alone gives few programs). Larger M is compute-bound:
    bigger square-ish tiles, more warps.

    The decode layout past 16 rows runs the prefill kernel (``sparse24::linear``'s
    route, but for INT8 / INT4 with 16-bit x to SP_MAX_M rows): its space is
    :func:`prefill_configs`, and for 16-bit weights at 17 to SP_MAX_M rows the sparse
    tensor-core kernel's 32-row space beside it (:func:`sp_tunable`: the tuned entry says
    which kernel the route takes).
    """
    if layout == "decode":
        if M > DECODE_M and decode_rows(M, dtype) != 32:
            # and each config split along K where that can fill idle SMs (the model's
            # defaults, prefill_config, take split-K there)
            return [dataclasses.replace(c, split_k=s) for c in prefill_configs(M)
                    for s in split_factors(M, N, K, c, num_sms)] \
                + (decode_configs(M, N, K, dtype, num_sms, rows=32) if sp_tunable(M, dtype) else [])
        return decode_configs(M, N, K, dtype, num_sms)
    out: list[KernelConfig] = []
    if M <= 16:
        for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
            warps = 2 if bn * bk <= 4096 else 4
            programs = -(-N // bn)
            splits = [1] + [s for s in (2, 4, 8) if programs * s <= 4 * num_sms and K >= 2 * s * bk]
            out += [KernelConfig(16, bn, bk, 8, s, warps, stages) for s in splits for stages in (3, 5)]
    elif M <= 128:
        bms = (32,) if M <= 32 else (32, 64)
        for bm in bms:
            for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 32)):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    else:
        for bm, bn, bk in ((64, 64, 64), (64, 128, 32), (64, 128, 64), (128, 64, 64), (128, 128, 32),
                           (128, 128, 64), (128, 256, 32)):
            # 4 warps only up to 64 x 128 tiles: 128 x 256 x 32 with 4 warps
            # spills 1 KB and 128 x 128 x 64 needs 254 registers (sm_90 cubin,
            # scripts/kernel_static_check.py, Triton 3.9)
            for warps, stages in ((4, 3), (8, 3), (8, 4)) if bm * bn <= 64 * 128 else ((8, 3), (8, 4)):
                out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    return [c.validate() for c in out]


# The decode kernel's space, every config measured within the sm_90 budget (0.15
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
_DECODE_TILES = ((64, 4), (128, 8))
# The sparse tensor-core kernel: two or four 16-row tiles per warp (all its tiles' mma take the same
# x words): two took INT4 x fp16 at 4096 x 4096 from 0.240 to 0.186 warp-instructions per byte
# (90-104 registers); four halve the x loads' L1 wavefronts per byte (INT4 0.0625 -> 0.0417, under
# the 0.0545 HBM delivers; 251 registers at BLOCK_K 256, spills at 512).
_SPARSE_TILES = ((64, 4), (64, 2), (128, 4), (128, 2))
# One tile per warp (64, 4) only for INT8 at M <= 16: INT4 so is 0.24 warp-instructions per byte (over
# 0.20), and the 32-row spaces keep their measured tiles. INT8 with it: at most 0.125 in the loop and
# 0.164 amortized (bfloat16 x, 16 rows, 64 deep), 32-199 registers, one load wave (sm_90, Triton 3.9);
# the H200 ran INT8 decode fastest with it (run 2; docs/kernels.md).
# The sparse tensor-core kernel issues every load of a K-tile before its first use (one memory
# round trip per K-tile: kernels/sparse24_sp.py, _sp_tile), so a lane holds the whole tile's words
# at once. Over this many (sp_load_words) sm_90 builds spill or sit at 255 registers (Triton 3.6
# and 3.9, 4096 x 4096: INT8 4 tiles per warp 512 deep at 1-8 rows 192 words, 255 registers; 256
# deep at 32 rows 192, 272-280 B of spills; 16-bit weights 2 tiles 256 deep at 32 rows 192, 224-248 B);
# at 160 or fewer, 230 registers at most and no spills.
SP_LOAD_WORDS = 160


def sp_load_words(block_n: int, block_k: int, num_warps: int, dtype: str, rows: int) -> int:
    """32-bit words a lane of the sparse tensor-core kernel loads per K-tile for ``rows`` rows of x
    (M's bucket; 17-64: its 32 rows per program): the values (atoms x row tiles x 4 words; INT4 2,
    16-bit weights 8) and the x words (two chunks per atom, 4 words per 8 rows: rows 8-15 from 9
    rows on, 16-31 from 17)."""
    atoms, tiles = block_k // 64, block_n // (16 * num_warps)
    per_value = 2 if dtype.startswith("int4-") else 4 if dtype.startswith("int8-") else 8
    blocks = (1 if rows <= 8 else 2) * (2 if rows > DECODE_M else 1)
    return atoms * tiles * per_value + 2 * atoms * 4 * blocks
_DECODE_BLOCK_K = (64, 128, 256)


def sparse_kernel(dtype: str) -> bool:
    """Whether a decode-layout weight of dtype key ``dtype`` runs the sparse tensor-core kernel
    (kernels/sparse24_sp.py): INT8 or INT4 weights with float16 / bfloat16 x."""
    return dtype.startswith(("int8-", "int4-")) and not dtype.endswith("float32")


def decode_rows(M: int, dtype: str) -> int:
    """Rows of x per program the decode kernels take at ``M`` rows (or its bucket) of dtype key
    ``dtype``: 32 on the sparse tensor-core route (17 to SP_MAX_M rows, INT8 / INT4 weights with
    float16 / bfloat16 x: one weight register serves 32 rows), else 16. (16-bit weights take that
    kernel there only where this GPU's tuned entry chose it: :func:`sp_tunable`.)"""
    return 32 if DECODE_M < M <= SP_MAX_M and sparse_kernel(dtype) else 16


def sp_tunable(M: int, dtype: str) -> bool:
    """Whether the sparse tensor-core kernel's 32-row configs join the tuning space of a 16-bit
    weight of x's dtype (``dtype`` ``"float16"`` / ``"bfloat16"``) at ``M`` (17 to SP_MAX_M rows),
    beside the prefill kernel's. Measured on an H200 (results/NVIDIA_H200/probe_prefill.csv),
    untuned it lost to the prefill kernel at all six points (4096x4096, 11008x4096, 4096x11008;
    32 and 64 rows: 30-81 against 26-61 us), tuned it won at 4096x4096 and 32 rows (18.2 us
    against the prefill kernel's untuned 25.7): so the route takes it only from a tuned entry."""
    return DECODE_M < M <= SP_MAX_M and dtype in ("float16", "bfloat16")


def fp32_twin(dtype: str) -> str:
    """The dtype key of the same weight with float32 x (``"int8-float16"`` -> ``"int8-float32"``,
    ``"bfloat16"`` -> ``"float32"``): its configs are the byte-permute decode kernel's, which serves
    every pair where the sparse tensor-core kernel cannot (a GPU without sparse tensor cores)."""
    return dtype.split("-")[0] + "-float32" if "-" in dtype else "float32"


def decode_configs(M: int, N: int, K: int, dtype: str = "float16", num_sms: int = 132,
                   rows: int | None = None) -> list[KernelConfig]:
    """The decode kernel's config space for one (M, N, K, dtype key).

    BLOCK_N x warps in (64 x 4, 128 x 8) x BLOCK_K in (64, 128, 256) x
    stages (1-3) x split-K in (1, 2, 4, 8): split-K while the programs stay
    within 4 per SM and each split keeps >= 2 K-tiles (a 4096 x 4096 layer has
    only 64 programs of 64 rows for 132 SMs). INT8 weights (``dtype``
    ``"int8-..."``): one stage, or two on tiles of >= 16384 elements (see the
    comment above). The space does not depend on M at decode sizes; above 16
    rows the programs multiply by ceil(M / 16), K is not split and only the
    deepest pipeline of each tile is kept (``backend="triton"`` there; the tuner
    times the prefill kernel's space past 16 rows, :func:`candidate_configs`). INT8 / INT4 weights with
    float16 / bfloat16 x (the sparse tensor-core kernel): BLOCK_N x warps in
    (64 x 4, 64 x 2, 128 x 4, 128 x 2), one (INT8 only), two or four 16-row tiles per
    warp, BLOCK_K up to 512 (not 512 with four INT4 tiles: spills), one stage; at 17 to SP_MAX_M rows
    (its route past decode sizes) 32 rows per program (``block_m`` 32) with
    split-K, two or four tiles per warp, BLOCK_K up to 256 and INT4 at most two tiles per warp (INT4's doubled
    accumulators spill beyond; all 30 compiled variants at 4096 x 4096: 0 spills).
    16-bit weights take the same kernel's space there with ``rows`` 32 (:func:`sp_tunable`; at
    M <= 16 the byte-permute kernel's space), at most two tiles per warp (four spill with Triton 3.6).
    That kernel holds a whole K-tile's words per lane (one load wave per K-tile): tiles over
    ``SP_LOAD_WORDS`` leave its space, so it depends on M's bucket (x rows 8-15 from 9 rows), and
    INT4 starts 128 deep (64 deep: 0.206 warp-instructions per byte with the loads' fold, over 0.20).

    Args:
        M, N, K: problem size (x is M x K, W is N x K); dtype: a :func:`dtype_key`.
        rows: rows per program (default :func:`decode_rows`; 32 for a 16-bit key where :func:`sp_tunable`).
    Returns:
        list of :class:`KernelConfig` with ``kernel == "decode"``, ``block_m`` 16 (32: above).
    """
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    int8 = dtype.startswith("int8-")
    rows = decode_rows(M, dtype) if rows is None else rows
    if rows not in (16, 32) or rows == 32 and not (decode_rows(M, dtype) == 32 or sp_tunable(M, dtype)):
        raise ValueError(f"rows={rows}: 16, or 32 where the sparse tensor-core kernel serves {dtype} at M={M}")
    r32 = rows == 32
    sparse = sparse_kernel(dtype) or r32
    out = []
    for bn, warps in _SPARSE_TILES if sparse else _DECODE_TILES:
        for bk in _DECODE_BLOCK_K + ((512,) if sparse else ()):   # (registers: no tile in shared memory)
            # Four INT4 row tiles per warp 512 deep spill (255 registers, sm_90); at 32 rows four INT4 tiles
            # or 512 deep spill too, and INT8 512 deep compiles (178 registers) but is not predicted faster.
            # 16-bit weights at 32 rows: four tiles spill with Triton 3.6 (255 registers, 40-200 B; 3.9: 170-193)
            if sparse and bn // warps == 16 and (r32 or not int8) \
                    or dtype.startswith("int4-") and bn // warps == 64 and (bk == 512 or r32) or (r32 and bk == 512) \
                    or (r32 and not sparse_kernel(dtype) and bn // warps == 64) \
                    or sparse and sp_load_words(bn, bk, warps, dtype, 32 if r32 else m_bucket(M)) > SP_LOAD_WORDS \
                    or dtype.startswith("int4-") and sparse and bk == 64:   # 0.206 warp-instructions per byte
                continue
            programs = -(-N // bn) * -(-M // rows)
            splits = [1] + [s for s in (2, 4, 8) if programs * s <= 4 * num_sms and K >= 2 * s * bk
                            and (M <= DECODE_M or r32)]
            # the sparse tensor-core kernel loads into registers: no pipeline stages to choose
            stages = (1,) if sparse else ((1, 2) if bn * bk >= 16384 else (1,)) if int8 else (1, 2, 3)
            if M > DECODE_M:  # past decode sizes the kernel re-decodes W per 16 rows and the reference
                stages = stages[-1:]  # backend wins: one stage per tile, to time it against the reference
            out += [KernelConfig(rows, bn, bk, 1, s, warps, st, kernel="decode")
                    for s in splits for st in stages]
    return [check_decode_config(c) for c in out]


# Weight bytes a multiprocessor should have requested and not yet received
# (Little's law: 4.8 TB/s x ~0.7-0.9 us of HBM latency over 132 SMs ~ 25-33 KB).
DECODE_IN_FLIGHT = 32 * 1024


def decode_default(N: int, K: int, dtype: str = "float16", num_sms: int = 132, rows: int = DECODE_M) -> KernelConfig:
    """The decode kernel's untuned config at M <= 16 for an (N, K) layer (``rows`` 17-64 with
    INT8 / INT4 weights and 16-bit x, or a 16-bit weight of x's dtype (:func:`sp_tunable`; no route
    takes that one untuned): the sparse tensor-core kernel's 32 rows per program, ``block_m`` 32;
    then INT4 takes at most 2 row tiles per warp and tiles at most 256 deep, where the doubled accumulators spill (sm_90: 216 B with four tiles, 48 B at 512 deep), and
    INT8 tiles at most 256 deep too: 512 compiles without spills but is not predicted faster,
    the large shapes being at the byte ratio already).

    64-row tiles (4 warps, ~70-160 registers: several programs fit an SM), BLOCK_K
    256 (128 where 256 leaves SMs without a program), pipelined: 16-bit weights 2
    stages (one K-tile's loads in flight while another decodes), INT8 and INT4 3 stages
    (two: their tiles hold 5/9 and 3/9 of the bytes) with fp32 x; INT8 and INT4 with
    16-bit x (the sparse tensor-core kernel) 1: one tile in flight per program; INT8 at M <= 16
    one 16-row tile per warp (BLOCK_N 64, 4 warps: the most warps per SM for the bytes, what the
    H200 measured fastest), else its warps own four 16-row tiles (BLOCK_N 128, 2 warps) where
    that keeps tiles 256 deep, else two (64, 2). Then split-K (serial, inside the one launch) just
    large enough that the programs running at once keep ``DECODE_IN_FLIGHT`` weight
    bytes requested per SM, or, for small layers, one K-tile per program (the whole
    weight at once, in one stage: there is no later tile to prefetch; SPLIT_K equals the
    K-tiles, so the kernel compiles without its K-loop, which keeps the ~250 instructions
    outside the tile within the budget). Predicted by
    ``scripts/kernel_static_check.py --occupancy`` and ``--sass`` (docs/kernels.md); the INT8
    tile shape measured on an H200 (run 2), the rest not measured on a GPU."""
    quantized = dtype.startswith(("int8-", "int4-"))
    # INT8 / INT4 with 16-bit x run the sparse tensor-core kernel (kernels/sparse24_sp.py): it
    # loads into registers, without Triton's pipeline, so a program has one K-tile in flight;
    # its INT4 tiles may be 512 columns deep (the instructions outside the loop amortize over twice
    # the bytes: INT4 4096 x 4096 0.307 -> 0.239 warp-instructions per byte on sm_90)
    r32 = decode_rows(rows, dtype) == 32 or sp_tunable(rows, dtype)
    sparse = sparse_kernel(dtype) or r32   # (16-bit weights: on the sparse tensor cores past 16 rows)
    bn, warps = 64, 4
    if sparse:
        # 512 where it divides K (a partial tile is a second, masked copy of the tile's code); four
        # 16-row tiles per warp (BLOCK_N 128, 2 warps: half the L1 wavefronts of the x loads per
        # byte) where the layer still fills the SMs with tiles at least 256 deep, else two (64, 2).
        # INT4 with four tiles: at most 256 deep (251 registers; 512 spills).
        def depth(rows, depths):
            return next((b for b in depths if rows * -(-K // b) >= num_sms and K % b == 0), None)
        x_rows = 32 if r32 else rows   # (the whole K-tile's words in registers: at most SP_LOAD_WORDS)

        def fitting(bn, warps, depths):
            return tuple(b for b in depths if sp_load_words(bn, b, warps, dtype, x_rows) <= SP_LOAD_WORDS)
        if dtype.startswith("int8-") and not r32:
            # M <= 16, INT8: one 16-row tile per warp, 256 deep where the layer fills the SMs so. The
            # H200 ran INT8 decode fastest with the most warps per SM: this tile (run 2: the Llama-7B
            # block's compiled step at batch 1 in 107 us, against 150 us with four tiles per warp 512
            # deep, run 4), and its tuner chose the smallest tile of its space then (run 5, without one
            # tile per warp: 64 x 64, two per warp). docs/kernels.md.
            bn, warps = 64, 4
            bk = depth(-(-N // 64), fitting(64, 4, (256, 128))) or 128
        else:
            # (at 32 rows INT4 and 16-bit weights keep two tiles: four spill, 16-bit with Triton 3.6)
            deep = () if r32 and not dtype.startswith("int8-") else (256,)
            bk = depth(-(-N // 128), fitting(128, 2, deep))
            bn, warps = (128, 2) if bk else (64, 2)
            bk = bk or depth(-(-N // 64), fitting(64, 2, (256, 128) if r32 else (512, 256, 128))) or 128
    rows = -(-N // bn)
    if not sparse:
        bk = 256 if rows * -(-K // 256) >= num_sms else 128
    stages = 1 if sparse else 3 if quantized else 2
    tiles = -(-K // bk)
    tile_bytes = bn * bk * (3 if dtype.startswith("int4-") else 5 if quantized else 9) // 8  # eighths of a byte
    split = tiles
    for per_split in range(tiles, 0, -1):               # the fewest splits (longest K ranges) that do
        split = -(-tiles // per_split)
        ahead = min(max(stages - 1, 1), per_split)      # K-tiles a program has requested ahead (1 stage: its own)
        if rows * split >= max(num_sms * DECODE_IN_FLIGHT / (ahead * tile_bytes), num_sms):
            break
    if per_split == 1:  # one K-tile per program: nothing to overlap, and a pipeline's prologue costs ~40%
        stages = 1
    return check_decode_config(KernelConfig(32 if r32 else 16, bn, bk, 1, min(split, 32), warps, stages, kernel="decode"))


# The prefill kernel's widest weight tile: two 128-row halves, each decoded into its own
# accumulator against one shared 128-row x tile (kernels/sparse24_prefill.py, SPLIT_N).
WIDE_N = 256


def prefill_configs(M: int) -> list[KernelConfig]:
    """The prefill kernel's (``kernels/sparse24_prefill.py``) config space for the static report and a tuner: BLOCK_M in
    (32, 64) at M <= 64, else (32, 64, 128, 256) (BLOCK_K 128 for
    BLOCK_M < 128, else 64), BLOCK_N x warps in (64 x 4, 128 x 8), 2 or 3 stages
    (pipelined x and weight loads); at M <= 64 (SPLIT_K_MAX_M), where each weight tile streams
    from HBM once and the H200 measured this kernel bound by the bytes a program keeps in flight
    (docs/kernels.md, "17-64 rows: bytes in flight"), also BLOCK_K 128 on 4 stages and BLOCK_K 256
    on 2 or 3; past 64 rows also 128 x 256 (8 warps, two 128-row halves of W
    sharing one x tile; BLOCK_K 64 or 128) where the installed Triton runs 128-row tiles in
    x's own order (``natural_tile``: 3.6 and later). BLOCK_K 128 there halves the per-K-tile
    cost of a quantization group's constants (INT4 with bfloat16 x, Triton 3.6: 1126 -> 1024
    SM clocks per 64 columns, no spill; no other pair gains, and 3.7-3.9 spill there). Left out,
    measured by the static report (sm_90, Triton 3.9): BLOCK_K 128 at the other tiles of
    BLOCK_M >= 128 (200-255 registers, one program per SM or spills), 4 stages (the issue
    count of 3)."""
    from sparse24.kernels.sparse24_prefill import natural_tile

    bms = (32, 64) if M <= SPLIT_K_MAX_M else (32, 64, 128, 256)
    space = [(bm, bn, 64 if bm >= 128 else 128, w, st) for bm in bms for bn, w in ((64, 4), (128, 8)) for st in (2, 3)]
    if M <= SPLIT_K_MAX_M:   # more weight bytes in flight per program where the weight streams from HBM
        space += [(bm, bn, bk, w, st) for bm in bms for bn, w in ((64, 4), (128, 8))
                  for bk, st in ((128, 4), (256, 2), (256, 3))]
    elif natural_tile(128, WIDE_N):
        space += [(128, WIDE_N, bk, 8, st) for bk in (64, 128) for st in (2, 3)]
    return [check_prefill_config(KernelConfig(bm, bn, bk, 8, 1, w, st, kernel="prefill"))
            for bm, bn, bk, w, st in space]


def split_factors(M: int, N: int, K: int, config: KernelConfig, num_sms: int = 132) -> tuple[int, ...]:
    """The prefill kernel's split-K factors (:data:`PREFILL_SPLITS`) for ``config`` at
    (M, N, K), the defaults' and the tuner's: 1, and up to M = PREFILL_SPLIT_MAX_M those that
    keep two K-tiles per split and at most two programs per SM, four at M <= SPLIT_K_MAX_M as the
    decode kernels (split-K is for output tiles too few to fill the SMs, and at few rows for the
    weight bytes in flight; the workspace grows with the programs)."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    per_sm = 4 if M <= SPLIT_K_MAX_M else 2
    return (1,) + tuple(s for s in PREFILL_SPLITS[1:] if M <= PREFILL_SPLIT_MAX_M and K >= 2 * s * config.block_k
                        and tiles * s <= per_sm * num_sms)


def check_prefill_config(config: KernelConfig) -> KernelConfig:
    """Raise ValueError unless the prefill kernel can run ``config``; returns it. (BLOCK_N 256
    also needs the installed Triton to run it: :func:`check_prefill_runs`.)"""
    c = config.validate()
    one_tile_per_warp = c.block_n in (32, 64, 128) and c.num_warps == c.block_n // 16
    wide = (c.block_m, c.block_n, c.num_warps) == (128, WIDE_N, 8) and c.block_k in (64, 128)
    if c.kernel != "prefill" or c.block_m < 16 or c.block_k < 64 or not (one_tile_per_warp or wide) \
            or c.split_k not in PREFILL_SPLITS:
        raise ValueError(f"bad prefill config {c}: need kernel 'prefill', block_m >= 16, block_k >= 64, block_n "
                         f"in (32, 64, 128) with num_warps == block_n // 16 (or block_m, block_n, num_warps = 128, "
                         f"{WIDE_N}, 8 with block_k 64 or 128) and split_k in {PREFILL_SPLITS}")
    return c


def check_prefill_runs(config: KernelConfig) -> KernelConfig:
    """:func:`check_prefill_config`, and for BLOCK_N 256 a Triton that runs 128-row tiles in
    x's own order (3.6 and later; the kernel has no permuted form of the wide tile). Checked
    where a config is launched or read from a tuned file, not in the cost tables (which hold
    every Triton's rows). Without Triton (macOS, Windows) nothing launches it: the entry stays,
    so a tuned file still reads there."""
    c = check_prefill_config(config)
    if c.block_n != WIDE_N:
        return c
    try:
        from sparse24.kernels.sparse24_prefill import natural_tile
    except ImportError:
        return c
    if not natural_tile(c.block_m, c.block_n):
        raise ValueError(f"prefill config {c}: BLOCK_N {WIDE_N} needs Triton >= 3.6 (x in its own order at "
                         f"128 rows)")
    return c


def check_decode_config(config: KernelConfig) -> KernelConfig:
    """Raise ValueError unless the decode kernel can run ``config``; returns it."""
    c = config.validate()
    if c.kernel != "decode" or c.block_m not in (16, 32) or c.block_k < 64 or c.block_n not in (32, 64, 128) \
            or c.num_warps not in (c.block_n // 16, c.block_n // 32, c.block_n // 64):
        raise ValueError(f"bad decode config {c}: need kernel 'decode', block_m 16 (32: the sparse tensor-core "
                         f"kernel's 32 rows of x per program), block_k >= 64, block_n in (32, 64, 128) and num_warps == "
                         f"block_n // 16 (one 16-row tile per warp; the sparse tensor-core kernel also block_n // 32 "
                         f"or // 64: two or four)")
    return c

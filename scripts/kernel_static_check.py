"""Compile the 2:4 kernels ahead of time for a GPU target (no GPU needed).

Default mode, per config of the general kernel: registers, spill bytes, shared
memory, and the tile loads (cp16 / cp4: 16- / 4-byte pipelined async copies,
ld.g: plain global loads). Catches configs that spill or overflow shared
memory before any device time is spent.

    python scripts/kernel_static_check.py --cap 90 --dtype float16 --m 1 --shape 4096,4096 [--jobs 2]

``--sass``: the instruction budget. Compiles every config the tuner may pick
at the given M buckets (decode kernel: ``decode_configs``; ``--kernel
matmul``: the general kernel's ``candidate_configs``) for the four pairs
(fp16, bf16, INT8 with fp16 or bf16 activations), disassembles the cubin
with the cuobjdump in Triton's wheel, finds the main K-loop (the largest
backward branch of the SASS) and counts its instructions. Writes a CSV
(``--csv FILE``) with ``kernel,dtype,m,config,loop_warp_instructions,
bytes_per_iteration,warp_instr_per_byte,int_warp_instr_per_byte`` and prints
``max warp_instr_per_byte at M<=16: fp16 X, bf16 Y, int8 Z, int8-bf16 W``.
Then (decode kernel; ``--listed-only`` for this part alone) each pair at the
listed shapes with the config a layer uses, everything outside the loop
amortized over a program's K range:
``max amortized warp_instr_per_byte at listed shapes: ...``.

    loop_warp_instructions = SASS instructions of the loop x warps of a program
    bytes_per_iteration    = compressed weight bytes (values + metadata) the loop
                             streams per iteration (one K-tile, times the unroll
                             factor, checked against the loop's load widths)
    warp_instr_per_byte    = loop_warp_instructions / bytes_per_iteration
    int_...                = the same for integer-pipe opcodes (INT_OPS)

Budget on sm_90 (docs/kernels.md): <= 0.15 for fp16/bf16 weights, <= 0.20 for
INT8, <= 0.10 on the integer pipe; ``--check`` exits 1 when over.

    python scripts/kernel_static_check.py --sass --csv results/static-sm90/decode-triton-3.9.0.csv

``--occupancy``: for each pair at the listed shapes, the config a layer uses
(tuned file or built-in default) compiled for sm_90: programs per SM from
registers and shared memory, waves on 132 SMs, and weight bytes in flight per
SM; prints ``min weight bytes in flight per SM: N KiB``.

``--unpack``: the unpack kernel (the prefill route from 256 rows: the weight
written dense into a scratch for cuBLAS) compiled for sm_90 per weight kind and
output dtype: SASS instructions per thread (32 outputs each), and at ``--shape``
its issue time (every warp-instruction at 4 per SM clock: a floor) against its
HBM time (compressed bytes read + dense bytes written at the H200's measured 4.2
TB/s), and its registers, resident programs per SM and the compressed bytes they
have in flight (each loads its whole tile first); prints ``unpack at N x K: max
predicted X us (issue Y us, HBM Z us)``.

``--prefill``: the prefill kernel (M > 16) compiled for sm_90: issue cycles of
its main loop per tensor-core instruction, its tiles' L2 traffic, and the
predicted ratio to dense at the listed shapes, with L2 at an assumed 32 B per
SM clock and unbounded (docs/kernels.md, "Prefill path"); at 17-64 rows the
defaults' weight bytes in flight per SM (``min weight bytes in flight per SM at
17-64 rows``) and the model against the H200's measured rows, with and without
its latency term (docs/kernels.md, "17-64 rows: bytes in flight").
"""
import argparse
import collections
import dataclasses
import functools
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from sparse24.ops.linear24.prefill_model import (L2_BYTES_PER_SM_CLK, LATENCY_MAX_M, MACS_PER_CLK, dense_time,
                                                 predicted_time)


def compile_one(cfg, dtype, cap, N, K):
    import sparse24
    from sparse24.ops.linear24 import aot_compile
    from sparse24.ops.linear24.launch import target_dtype

    act = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype.removeprefix("int8-")]
    p = sparse24.compress(torch.randn(N, K), quantize="int8" if dtype.startswith("int8-") else None)
    if p.scale is None:
        p = p.to(dtype=act)
    x = torch.randn(16, K).to(act)
    target = torch.empty(16, N, dtype=target_dtype(cfg, cfg.split_k, act))
    t0 = time.time()
    ck = aot_compile(x, p, None, target, cfg, cfg.split_k, (cap // 10, cap % 10))
    ptx = ck.asm["ptx"]
    regs, spills = resource_usage(ck.asm["cubin"])
    return dict(cfg=cfg, regs=regs, spills=spills, shared=ck.metadata.shared,
                cp16=len(re.findall(r"cp\.async\.c[ag]\.shared\.global .*, 0x10", ptx)),
                cp4=len(re.findall(r"cp\.async\.c[ag]\.shared\.global .*, 0x4", ptx)),
                ldg=len(re.findall(r"ld\.global", ptx)),
                mma=ptx.count("mma.sync") + ptx.count("wgmma"), secs=time.time() - t0)


# --- --sass: the instruction budget ---------------------------------------------

# warp-instructions per compressed weight byte on sm_90 (docs/kernels.md): all instructions,
# and those of the integer pipe alone (half the issue rate: 64 lanes per clock per SM)
BUDGET = {"float16": 0.15, "bfloat16": 0.15, "int8-float16": 0.20, "int8-bfloat16": 0.20,
          "int4-float16": 0.20, "int4-bfloat16": 0.20}
INT_BUDGET = 0.10
ISSUE_PER_BYTE = 132 * 4 * 1.98e9 / 4.8e12   # H200: warp-instructions issued per byte of HBM bandwidth
L1_PER_BYTE = 132 * 1.98e9 / 4.8e12   # H200: L1 wavefronts (one per SM and clock) per byte of HBM bandwidth
SUMMARY_NAMES = (("fp16", "float16"), ("bf16", "bfloat16"), ("int8", "int8-float16"), ("int8-bf16", "int8-bfloat16"),
                 ("int4", "int4-float16"), ("int4-bf16", "int4-bfloat16"))
# INT4 weights in these reports: group size 128, asymmetric (zero points loaded: the dearer variant)
INT4_GROUP = 128
# Integer-pipe opcodes (per-thread ALU work at 64 lanes/clock/SM on sm_90); uniform-datapath
# (U*) and FP ops are not counted. IMAD counts in every form (IMAD.MOV, IMAD.SHL, IMAD.HI ...).
INT_OPS = frozenset({"LOP3", "LOP", "SHF", "SHL", "SHR", "SGXT", "PRMT", "IMAD", "IADD3", "IADD", "VIADD", "LEA",
                     "ISETP", "IMNMX", "VIMNMX", "SEL", "BMSK", "IABS", "POPC", "FLO", "BREV"})
# H200 (sm_90): multiprocessors, registers and shared memory per SM (1 KiB of it reserved per block)
SMS, SM_REGS, SM_SHARED, SM_WARPS, SM_BLOCKS = 132, 65536, 233472, 64, 32
IN_FLIGHT_GOAL = 32 * 1024
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)")


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_instructions(cubin: bytes) -> list[tuple[int, str]]:
    """``[(address, instruction text)]`` of the cubin, from ``cuobjdump -sass``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in _LINE.finditer(text)]


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers per thread, spilled bytes: local + stack)`` of the cubin, from the
    cuobjdump in Triton's wheel (CompiledKernel.n_regs needs a GPU)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    field = lambda name: int(re.search(rf"{name}:(\d+)", res).group(1))   # noqa: E731
    return field("REG"), field("LOCAL") + field("STACK")


def without_padding(instrs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """``instrs`` less the tail after the last ``EXIT``: the ``BRA`` to itself and the
    ``NOP`` alignment padding, never executed."""
    end = len(instrs)
    while end and (_opcode(instrs[end - 1][1]) == "NOP" or (lambda m: m and int(m.group(1), 16) == instrs[end - 1][0])(
            _BRA.search(instrs[end - 1][1]))):
        end -= 1
    return instrs[:end]


def main_loop(instrs: list[tuple[int, str]], required: bool = True) -> list[str]:
    """The instructions of the largest loop with tensor-core instructions (of the largest
    loop where none has them): from a backward branch's target to the branch, inclusive
    (the trailing ``BRA`` to itself is not a loop). With
    ``required=False`` a kernel without a loop gives ``[]``."""
    loops = []
    for addr, text in instrs:
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr:
            target = int(m.group(1), 16)
            loops.append([t for a, t in instrs if target <= a <= addr])
    if not loops:
        if not required:
            return []
        raise RuntimeError("no loop in the SASS")
    # the main loop multiplies: a loop after it (the prefill kernel's split-K tree) may be longer
    mma = [lp for lp in loops if any(_opcode(t).startswith(("HGMMA", "HMMA")) for t in lp)]
    return max(mma or loops, key=len)


def _opcode(text: str) -> str:
    return _unpredicated(text).split()[0]


def _unpredicated(text: str) -> str:
    """An instruction without its guard predicate (``@P0``, ``@!UP1``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


_REG = re.compile(r"\bR(\d+)\b")


def load_waves(loop: list[str]) -> int:
    """Memory round trips one warp waits out per loop iteration: a warp issues in order, so a
    global load placed after an instruction that reads an earlier load's result is issued only
    once that result arrived. Counts the runs of LDG separated by such a read (each LDG's
    destination registers by its width; a read of any of them ends the run). The H200 measured
    the sparse tensor-core kernel latency-bound while its loops had 2-15 (2026-12-04, runs 4-5)."""
    waves, pending, stalled = 0, set(), True
    for text in loop:
        op = _opcode(text)
        operands = _unpredicated(text)[len(op):].split(",")
        dest = _REG.search(operands[0]) if op.startswith("LDG.") else None   # (not LDGSTS, LDGDEPBAR)
        if dest:
            if stalled:
                waves, stalled = waves + 1, False
            first = int(dest.group(1))
            pending |= set(range(first, first + (4 if ".128" in op else 2 if ".64" in op else 1)))
        else:   # stores and atomics read their first operand too
            reads = operands if op.startswith(("ST", "RED", "ATOM")) else operands[1:]
            if pending & {int(r) for o in reads for r in _REG.findall(o)}:
                stalled, pending = True, set()
    return waves


def global_load_bytes(loop: list[str]) -> int:
    """Bytes one thread requests per iteration with LDG / LDGSTS (by the width suffix)."""
    total = 0
    for text in loop:
        op = _opcode(text)
        if op.startswith(("LDG.", "LDGSTS.")):
            parts = op.split(".")
            width = 16 if "128" in parts else 8 if "64" in parts else 2 if {"U16", "S16"} & set(parts) \
                else 1 if {"U8", "S8"} & set(parts) else 4
            total += width
    return total


def x_blocks(rows: int) -> int:
    """8-row blocks of x a sparse tensor-core program multiplies (kernels/sparse24_sp.py): one
    at M <= 8, two at 9-16, four (two 16-row blocks, ``R32``) above 16 rows."""
    return 1 if rows <= 8 else 2 if rows <= 16 else 4


def sparse_mma_tiles(loop: list[str], cfg, rows: int) -> float:
    """K-tiles per iteration of a sparse tensor-core loop (kernels/sparse24_sp.py), from its
    ``HMMA.SP`` count (each warp: 2 per 64-column atom, x row block of 8 and row tile it owns,
    ``block_n // (16 num_warps)``), or 0 for the other kernels. (That kernel loads x per warp,
    so the load-width count does not apply.)"""
    n = sum(_opcode(t).startswith("HMMA.SP") for t in loop)
    tiles_per_warp = cfg.block_n // (16 * cfg.num_warps)
    return n / (2 * (cfg.block_k // 64) * x_blocks(rows) * tiles_per_warp) if n else 0


def _weights(kernel: str, dtype: str, N: int, K: int, bf16_scales: bool = False):
    """``(x dtype, weight)`` of a pair; ``bf16_scales``: an INT4 weight with bfloat16 x gets its
    scales as bfloat16, as a bfloat16 module passes them (sparse24/nn/layout.py)."""
    import sparse24
    from sparse24.decode_format import pack_decode

    act = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype.split("-")[-1]]
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    bf16_scales = bf16_scales and dtype == "int4-bfloat16"
    if dtype.startswith("int4-"):   # (a bfloat16 weight's scales are exact in bfloat16: bf16_exact_scales)
        p = sparse24.compress(w.bfloat16() if bf16_scales else w, quantize="int4", group_size=INT4_GROUP,
                              symmetric=False)
    else:
        p = sparse24.compress(w, quantize="int8") if dtype.startswith("int8-") else sparse24.compress(w.to(act))
    d = pack_decode(p) if kernel == "decode" else p
    if bf16_scales:
        d.scale = d.scale.bfloat16()
    return act, d


def weight_tile_bytes(dtype: str, block_n: int, block_k: int) -> int:
    """Compressed weight bytes of one BLOCK_N x BLOCK_K tile (values + 2-bit metadata): the
    bytes the per-byte figures divide by. INT4's scales and zero points are not counted (at
    group 128 they add 3 / 128 B per weight, 6%: the figures are per byte of values + metadata)."""
    value_quarters = 1 if dtype.startswith("int4-") else 2 if dtype.startswith("int8-") else 4  # per dense weight
    return block_n * block_k * value_quarters // 4 + block_n * block_k // 8


def side_bytes(dtype: str, block_n: int, block_k: int) -> int:
    """Bytes the loop loads per tile besides weights and x: INT4's scale (2 B) and zero-point
    (1 B) loads, one per lane, row (i, i + 8) and quantization group of the tile (the
    compiler merges the loads of atoms in one group), as the compiled loop issues them."""
    if not dtype.startswith("int4-"):
        return 0
    return (block_n // 16) * 32 * 2 * max(1, block_k // INT4_GROUP) * 3


def sass_one(kernel: str, dtype: str, cfg, cap: int, N: int, K: int) -> dict:
    """Compile one config, return its main-loop counts (one row of the CSV, without M)."""
    from sparse24.ops.linear24 import aot_compile
    from sparse24.ops.linear24.launch import target_dtype

    act, w = _weights(kernel, dtype, N, K)
    x = torch.randn(cfg.block_m, K).to(act)
    target = torch.empty(cfg.block_m, N, dtype=target_dtype(cfg, cfg.split_k, act))
    ck = aot_compile(x, w, None, target, cfg, cfg.split_k, (cap // 10, cap % 10))
    loop = main_loop(sass_instructions(ck.asm["cubin"]))
    tile_w = weight_tile_bytes(dtype, cfg.block_n, cfg.block_k)
    tile_x = cfg.block_m * cfg.block_k * act.itemsize + side_bytes(dtype, cfg.block_n, cfg.block_k)
    loaded = global_load_bytes(loop) * 32 * cfg.num_warps
    unroll = sparse_mma_tiles(loop, cfg, cfg.block_m) or loaded / (tile_w + tile_x)
    # Each iteration must stream whole tiles: the loop's load widths say how many.
    if round(unroll) < 1 or abs(unroll - round(unroll)) > 0.02:
        raise RuntimeError(f"{kernel} {dtype} {cfg}: the loop loads {loaded} B per iteration, "
                           f"not a whole number of {tile_w + tile_x} B tiles: wrong loop?")
    per_warp = len(loop)
    ops = collections.Counter(_opcode(t).split(".")[0] for t in loop)
    return dict(kernel=kernel, dtype=dtype, cfg=cfg, loop=per_warp, warp_instr=per_warp * cfg.num_warps,
                bytes=tile_w * round(unroll), ops=ops, int_instr=_int_count(loop) * cfg.num_warps)


def _int_count(instrs) -> int:
    return sum(_opcode(t).split(".")[0] in INT_OPS for t in instrs)


def config_name(c) -> str:
    return f"BM{c.block_m}_BN{c.block_n}_BK{c.block_k}_W{c.num_warps}_S{c.num_stages}_SK{c.split_k}"


def sass_main(a) -> int:
    import triton

    from sparse24.tools.bench import cpu_name
    from sparse24.ops.config_space import candidate_configs, decode_configs

    if a.listed_only:
        worst = listed_main(a, a.dtypes.split(","))
        return 1 if a.check and any(v > BUDGET.get(dt, 1.0) for dt, v in worst.items()) else 0
    N, K = map(int, a.shape.split(","))
    ms = [int(m) for m in a.m.split(",")]
    dtypes = a.dtypes.split(",")
    def space(m, dt):
        return decode_configs(m, N, K, dt) if a.kernel == "decode" else candidate_configs(m, N, K)
    per_m = {(m, dt): space(m, dt) for m in ms for dt in dtypes}
    jobs = list({(dt, c): None for (m, dt), cs in per_m.items() for c in cs})
    n_cfg = len({c for _, c in jobs})
    head = [f"# sparse24 static SASS count: {a.kernel} kernel, sm_{a.cap}, weight {N}x{K} (N x K), "
            f"M buckets {a.m}, dtypes {a.dtypes}: {len(jobs)} compiled variants ({n_cfg} configs)",
            f"# machine: {cpu_name()}, {platform.system()} {platform.release()}; python "
            f"{platform.python_version()}, triton {triton.__version__}, torch {torch.__version__}",
            "# command: " + "".join(f"{k}={os.environ[k]} " for k in ("TRITON_DEFAULT_FP_FUSION",) if k in os.environ)
            + "python scripts/kernel_static_check.py " + " ".join(a.argv),
            "kernel,dtype,m,config,loop_warp_instructions,bytes_per_iteration,warp_instr_per_byte,"
            "int_warp_instr_per_byte"]
    print("\n".join(head[:3]), flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(a.jobs) as ex:
        results = list(ex.map(sass_one, [a.kernel] * len(jobs), [dt for dt, _ in jobs], [c for _, c in jobs],
                              [a.cap] * len(jobs), [N] * len(jobs), [K] * len(jobs)))
    by_key = {(r["dtype"], r["cfg"]): r for r in results}
    rows, worst, worst_int = [], {}, {}
    for dt in dtypes:
        for m in ms:
            for c in per_m[(m, dt)]:
                r = by_key[(dt, c)]
                wipb = r["warp_instr"] / r["bytes"]
                rows.append(f"{a.kernel},{dt},{m},{config_name(c)},{r['warp_instr']},{r['bytes']},{wipb:.4f},"
                            f"{r['int_instr'] / r['bytes']:.4f}")
                if m <= 16:
                    worst[dt] = max(worst.get(dt, 0.0), wipb)
                    worst_int[dt] = max(worst_int.get(dt, 0.0), r["int_instr"] / r["bytes"])
    summary = "max warp_instr_per_byte at M<=16: " + ", ".join(
        f"{short} {worst[dt]:.3f}" if dt in worst else f"{short} n/a" for short, dt in SUMMARY_NAMES)
    summary += "\nmax integer-pipe warp_instr_per_byte at M<=16: " + ", ".join(
        f"{short} {worst_int[dt]:.3f}" if dt in worst_int else f"{short} n/a" for short, dt in SUMMARY_NAMES)
    if a.verbose:
        for r in sorted(results, key=lambda r: (r["dtype"], r["warp_instr"] / r["bytes"])):
            print(f"  {r['dtype']:13} {config_name(r['cfg']):28} {r['warp_instr'] / r['bytes']:.4f}  "
                  + " ".join(f"{k}:{v}" for k, v in r["ops"].most_common(8)))
    if a.csv:
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        with open(a.csv, "w") as f:
            f.write("\n".join(head + rows + [f"# {line}" for line in summary.splitlines()]) + "\n")
    print(f"{len(results)} compiles in {time.time() - t0:.0f} s" + (f"; wrote {a.csv}" if a.csv else ""))
    print(summary)
    over = [dt for dt in worst if dt in BUDGET and worst[dt] > BUDGET[dt]]
    if a.kernel == "decode" and not a.no_listed:
        amortized = listed_main(a, dtypes)
        over += [dt for dt, v in amortized.items() if v > BUDGET.get(dt, 1.0)]
    if over:
        print(f"over the sm_90 budget ({', '.join(f'{dt} {BUDGET[dt]}' for dt in over)})", file=sys.stderr)
    return 1 if a.check and over else 0


# --- the listed shapes: the config a layer would use, amortized and occupancy -----

def default_config(dtype: str, N: int, K: int, gpu: str = "NVIDIA H200", rows: int = 16, tuned: bool = True):
    """``(config, source)`` a decode-layout layer of ``dtype`` (a dtype key) at M <= 16 (or
    ``rows``) uses on ``gpu`` (sm_90, 132 SMs): a tuned file's entry where one applies, else
    the built-in default (``tuned=False``: the built-in default, the files aside). A 16-bit
    weight at 17-64 rows: the sparse tensor-core kernel's 32-row default where no tuned entry
    gives it a 32-row config (its route takes it from a tuned entry only: config_space.sp_tunable;
    this reports what that kernel compiles to)."""
    from sparse24.ops.config_space import decode_default, sp_tunable
    from sparse24.ops.config_store import lookup
    choice = lookup(max(rows, 16), N, K, dtype, gpu if tuned else "untuned", (9, 0) if tuned else None, SMS,
                    "decode")
    if sp_tunable(rows, dtype) and choice.config.block_m != 32:
        return decode_default(N, K, dtype, SMS, rows=rows), "sparse-default"
    return choice.config, choice.kind


def _act_dtype(dtype: str) -> torch.dtype:
    """The activations' dtype of a dtype key (``"int8-bfloat16"`` -> bfloat16)."""
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype.split("-")[-1], torch.float16)


def compile_decode(dtype: str, cfg, cap: int, N: int, K: int, rows: int = 16):
    """Triton's ``CompiledKernel`` of ``cfg`` for an (N, K) decode-layout layer of ``dtype`` (a dtype
    key) and ``rows`` rows of x, compiled for sm_``cap`` (uninitialized storage: only shapes, dtypes
    and alignment matter)."""
    from sparse24.decode_format import DecodePacked
    from sparse24.ops.linear24 import aot_compile

    act = _act_dtype(dtype)
    w = DecodePacked.empty(N, K, torch.float16 if act == torch.float32 else act, dtype.startswith("int8-"),
                           group_size=INT4_GROUP if dtype.startswith("int4-") else None,  # fp32 x: fp16 weights
                           symmetric=False)
    # rows of x: 16 (the default, the worst case of M <= 16); the sparse tensor-core kernel compiles one mma
    # per chunk instead of two at M <= 8 (--listed-rows 8), the other kernels the same code for any M
    x, target = torch.empty(rows, K, dtype=act), torch.empty(rows, N, dtype=act)
    return aot_compile(x, w, None, target, cfg, cfg.split_k, (cap // 10, cap % 10))


def compile_listed(dtype: str, cfg, cap: int, N: int, K: int, rows: int = 16) -> dict:
    """:func:`compile_decode`, then registers, shared memory, loop and whole-kernel SASS counts."""
    ck = compile_decode(dtype, cfg, cap, N, K, rows)
    act = _act_dtype(dtype)
    instrs = without_padding(sass_instructions(ck.asm["cubin"]))
    loop = main_loop(instrs, required=cfg.split_k != -(-K // cfg.block_k))   # ONE_TILE kernels have no loop
    regs, spills = resource_usage(ck.asm["cubin"])
    tile_w = weight_tile_bytes(dtype, cfg.block_n, cfg.block_k)
    tile_x = 16 * cfg.block_k * act.itemsize + side_bytes(dtype, cfg.block_n, cfg.block_k)
    unroll = round(sparse_mma_tiles(loop, cfg, rows) or global_load_bytes(loop) * 32 * cfg.num_warps / (tile_w + tile_x))
    # Serial split-K: after the arrival counter's atomic, every program but the last of its
    # tile exits (the first predicated EXIT); what follows (the partials' sum and the
    # epilogue) runs in one program of SPLIT_K.
    texts = [t for _, t in instrs]
    atom = next((i for i, t in enumerate(texts) if _opcode(t).startswith(("ATOMG", "ATOM.", "RED"))), None)
    exit_ = None if atom is None else next(
        (i for i in range(atom, len(texts)) if texts[i].startswith("@") and _opcode(texts[i]) == "EXIT"), None)
    last = texts[exit_ + 1:] if exit_ is not None else []
    return dict(dtype=dtype, cfg=cfg, N=N, K=K, rows=rows, regs=regs, spills=spills,
                local=sum(_opcode(t).startswith(("LDL", "STL")) for t in loop), shared=ck.metadata.shared,
                loop=len(loop), total=len(instrs), unroll=max(unroll, 1),
                sparse=any(_opcode(t).startswith("HMMA.SP") for t in texts), waves=load_waves(loop),
                loop_hmma_sp=sum(_opcode(t).startswith("HMMA.SP") for t in loop),
                loop_int=_int_count(loop), total_int=_int_count(texts), tile_w=tile_w, last=len(last),
                last_int=_int_count(last))


def amortized(r: dict) -> tuple[float, float]:
    """(all, integer-pipe) warp-instructions per compressed weight byte of one program at
    (N, K), averaged over the programs of a tile: the loop times its iterations, every
    other instruction once, except the last-arriving program's split-K sum and epilogue,
    once per SPLIT_K programs (an upper bound still: every branch outside the loop counts
    as taken)."""
    c = r["cfg"]
    tiles = -(-(-(-r["K"] // c.block_k)) // c.split_k)   # K-tiles of one split
    iters = tiles / r["unroll"]
    nbytes = tiles * r["tile_w"]
    rest = r["total"] - r["loop"] - r["last"] + r["last"] / c.split_k
    rest_int = r["total_int"] - r["loop_int"] - r["last_int"] + r["last_int"] / c.split_k
    return ((r["loop"] * iters + rest) * c.num_warps / nbytes, (r["loop_int"] * iters + rest_int) * c.num_warps / nbytes)


def sp_l1_per_byte(r: dict) -> float | None:
    """L1 wavefronts per compressed weight byte of the sparse tensor-core kernel's K-loop
    (None for the other kernels, whose loads are whole coalesced tiles). A warp-wide load
    costs max(distinct 128-byte lines / 4, bytes / 128) wavefronts: Volta and later look up
    4 tags and return 128 bytes per cycle (NVIDIA's description of L1TEX on its developer
    forum; a model, not measured here). Per warp and K-tile (A atoms, RT row tiles): x, 4-byte
    words of 8 rows (8 lines: 2) per register, 4 per chunk and 8-row block; the mma.sp words,
    up to 16 bytes per lane of 32 meta rows (8; 16-bit weights: the keep masks of a lane's quad,
    four loads of 8 rows each, 2 each); values, lane-contiguous (16-bit 32 B, INT8 16 B, INT4 8 B
    per lane and atom); INT4 scales and zero points, 8 rows each (2) per row half and group."""
    if not r["sparse"]:
        return None
    c = r["cfg"]
    A, RT = c.block_k // 64, c.block_n // (16 * c.num_warps)
    int4 = r["dtype"].startswith("int4-")
    x = 2 * A * 4 * x_blocks(r["rows"]) * 2
    meta = RT * -(-A // 4) * 8
    lane_bytes = 8 if int4 else 16 if r["dtype"].startswith("int8-") else 32
    values = RT * A * max(1, 32 * lane_bytes // 128)
    groups = max(1, c.block_k // INT4_GROUP) if int4 else 0
    side = RT * 2 * groups * 2 * 2          # rows g, g + 8; scale and zero point
    return (x + meta + values + side) / (weight_tile_bytes(r["dtype"], c.block_n, c.block_k) / c.num_warps)


def dense_bytes_per_weight(dtype: str) -> float:
    """Bytes per weight a layer of ``dtype`` streams: 16-bit 1.125, INT8 0.625, INT4 0.375 +
    its group-128 scales and zero points (3 / 128): the byte ratio to dense fp16 is 2 / this."""
    return 0.375 + 3 / INT4_GROUP if dtype.startswith("int4-") else 0.625 if dtype.startswith("int8-") else 1.125


def occupancy(r: dict) -> dict:
    """Programs per SM (registers, shared memory, warps), waves and weight bytes in
    flight per SM (average over the SMs) for one compiled config at (N, K), M <= 16."""
    c = r["cfg"]
    per_warp = -(-r["regs"] * 32 // 256) * 256
    fit = min(SM_REGS // per_warp // c.num_warps, SM_SHARED // (r["shared"] + 1024), SM_WARPS // c.num_warps,
              SM_BLOCKS)
    programs = -(-r["N"] // c.block_n) * c.split_k
    resident = min(fit, programs / SMS)              # programs running at once, per SM on average
    tiles = -(-(-(-r["K"] // c.block_k)) // c.split_k)
    # Tiles requested ahead of the one being decoded: num_stages - 1 with Triton's
    # pipeliner; one stage has no prefetch: its tile's loads are in flight only until
    # they land (counted as 1, a peak), none while it decodes.
    # The sparse tensor-core kernel loads into registers (no Triton pipeline, whatever
    # num_stages): one tile per program in flight.
    depth = 1 if r.get("sparse") else min(max(c.num_stages - 1, 1), tiles)
    return dict(fit=fit, programs=programs, waves=programs / (SMS * fit), resident=resident, depth=depth,
                in_flight=resident * depth * r["tile_w"], whole=r["N"] * r["K"] * r["tile_w"]
                / (c.block_n * c.block_k) / SMS)


def _listed_results(a, dtypes) -> list[dict]:
    from sparse24.ops.config_space import LISTED_SHAPES
    jobs = [(dt, *default_config(dt, N, K, a.gpu, a.listed_rows), N, K) for dt in dtypes for N, K in LISTED_SHAPES]
    with ProcessPoolExecutor(a.jobs) as ex:
        results = list(ex.map(compile_listed, [j[0] for j in jobs], [j[1] for j in jobs], [a.cap] * len(jobs),
                              [j[3] for j in jobs], [j[4] for j in jobs], [a.listed_rows] * len(jobs)))
    for r, j in zip(results, jobs):
        r["source"] = j[2]
    return results


def spill_summary(results: list[dict]) -> str:
    """The worst spill of the listed compiles and whether any main loop touches local memory
    (a spill outside the loop, e.g. in the split-K epilogue, costs a few L1 accesses per program)."""
    return (f"spill bytes at most {max(r['spills'] for r in results)}, local-memory instructions in a main "
            f"loop at most {max(r['local'] for r in results)}")


def listed_main(a, dtypes) -> dict:
    """Each pair at the listed shapes, the config a layer would use, instructions outside
    the loop amortized over a program's K range; returns the worst per dtype."""
    t0 = time.time()
    results = _listed_results(a, dtypes)
    worst, worst_int = {}, {}
    print(f"amortized over a program's K range (loop x iterations + the rest of the kernel once, its last part, "
          f"the split-K sum and epilogue, once per SPLIT_K programs; loop 0: one K-tile per program, no loop; the "
          f"never-executed padding after the last EXIT not counted), config a layer uses on {a.gpu} untuned or tuned:")
    print(f"  {'dtype':14} {'shape':>11} {'config':28} {'source':8} {'loop':>5} {'rest':>5} {'last':>5} {'iters':>5} "
          f"{'all/B':>6} {'int/B':>6}")
    for r in results:
        tot, ints = amortized(r)
        worst[r["dtype"]] = max(worst.get(r["dtype"], 0.0), tot)
        worst_int[r["dtype"]] = max(worst_int.get(r["dtype"], 0.0), ints)
        c = r["cfg"]
        tiles = -(-(-(-r["K"] // c.block_k)) // c.split_k)
        print(f"  {r['dtype']:14} {r['N']:>5}x{r['K']:<5} {config_name(c):28} {r['source']:8} {r['loop']:>5} "
              f"{r['total'] - r['loop']:>5} {r['last']:>5} {tiles / r['unroll']:>5.1f} {tot:>6.3f} {ints:>6.3f}")
    print(f"{len(results)} compiles in {time.time() - t0:.0f} s; {spill_summary(results)}")
    waves = {}
    for r in results:
        if r["sparse"] and r["loop"]:
            waves[r["dtype"]] = max(waves.get(r["dtype"], 0), r["waves"])
    if waves:
        print("max load waves per K-tile (sparse tensor-core kernel's loop; 1: every load of a K-tile in flight "
              "together): " + ", ".join(f"{short} {waves[dt]}" for short, dt in SUMMARY_NAMES if dt in waves))
    # Predicted decode speed against dense fp16/bf16 weights read at the same bandwidth:
    # the byte ratio, unless issue (all instructions, 1.05e12/s) or the integer pipe
    # (half rate) takes longer than the bytes take to arrive (4.8 TB/s).
    # The sparse tensor-core kernel also waits on L1 (sp_l1_per_byte: its x words come 4 bytes a
    # lane from 8 rows) when its wavefronts per byte pass 0.0545, one per clock at HBM rate.
    per_byte = ISSUE_PER_BYTE
    from sparse24.ops.config_space import SP_MAX_M
    passes = -(-SP_MAX_M // 32)
    ratios, l1, l2_ratios = {}, {}, {}

    def ratio(dense, tot, ints, w, n=1):
        # n passes over the weight per HBM byte (n - 1 of them from L2): n times the instructions and
        # L1 wavefronts per byte of HBM traffic
        return dense * min(1.0, per_byte / (n * tot), per_byte / (2 * n * ints),
                           1.0 if w is None else L1_PER_BYTE / (n * w))
    for r in results:
        tot, ints = amortized(r)
        dense = 2.0 / dense_bytes_per_weight(r["dtype"])
        w = sp_l1_per_byte(r)
        if w is not None:
            l1[r["dtype"]] = max(l1.get(r["dtype"], 0.0), w)
        ratios.setdefault(r["dtype"], []).append(ratio(dense, tot, ints, w))
        l2_ratios.setdefault(r["dtype"], []).append(ratio(dense, tot, ints, w, passes))
    if l1:
        print(f"max L1 wavefronts per byte in the loop (sparse tensor-core kernel, {results[0]['rows']} rows of x; "
              f"HBM rate {L1_PER_BYTE:.4f}): " + ", ".join(f"{short} {l1[dt]:.4f}" for short, dt in SUMMARY_NAMES
                                                            if dt in l1))
    rows = results[0]["rows"]
    print(f"predicted decode speed{' at 17-32 rows (32 rows of x per program, one pass)' if rows > 16 else ''} vs "
          "dense 16-bit at equal bandwidth (byte ratio x min(1, 0.219 / all, "
          "0.219 / (2 x integer), 0.0545 / L1 wavefronts)): " + ", ".join(
              f"{short} {min(ratios[dt]):.2f}-{max(ratios[dt]):.2f}x" for short, dt in SUMMARY_NAMES if dt in ratios))
    # With 16-bit x this kernel serves up to SP_MAX_M rows: ceil(M / 32) programs per weight tile,
    # each a pass over it. Counted from HBM every time, that divides the speed (the bound below).
    # The kernel's grid starts a tile's row blocks one after another (row blocks fastest along x),
    # so all but the first should find the tile in L2: one HBM pass, but each pass still issues
    # its instructions and L1 wavefronts, so per HBM byte they multiply by the passes (a
    # prediction; L2 bandwidth not counted). Where every program of all the passes fits on the SMs
    # at once, the passes run side by side whatever the order.
    if rows > 16:
        print(f"predicted speed at 33-{SP_MAX_M} rows if each of the {passes} passes came from HBM (the bound): "
              + ", ".join(f"{short} {min(ratios[dt]) / passes:.2f}-{max(ratios[dt]) / passes:.2f}x"
                          for short, dt in SUMMARY_NAMES if dt in ratios))
        print(f"predicted speed at 33-{SP_MAX_M} rows with one HBM pass (a tile's row blocks start together; the "
              f"others read L2, each pass's instructions and L1 wavefronts counted): "
              + ", ".join(f"{short} {min(l2_ratios[dt]):.2f}-{max(l2_ratios[dt]):.2f}x"
                          for short, dt in SUMMARY_NAMES if dt in l2_ratios))
        together = {}
        for r in results:
            o = occupancy(r)
            together.setdefault(r["dtype"], []).append(passes * o["programs"] <= SMS * o["fit"])
        print(f"shapes whose {passes} passes also fit on the SMs at once: "
              + ", ".join(f"{short} {sum(together[dt])}/{len(together[dt])}" for short, dt in SUMMARY_NAMES
                          if dt in together))
    print("max amortized warp_instr_per_byte at listed shapes: " + ", ".join(
        f"{short} {worst[dt]:.3f}" for short, dt in SUMMARY_NAMES if dt in worst))
    print("max amortized integer-pipe warp_instr_per_byte at listed shapes: " + ", ".join(
        f"{short} {worst_int[dt]:.3f}" for short, dt in SUMMARY_NAMES if dt in worst_int))
    return worst


def occupancy_main(a) -> int:
    dtypes = a.dtypes.split(",")
    t0 = time.time()
    results = _listed_results(a, dtypes)
    print(f"# sm_{a.cap} ({SMS} SMs, {SM_REGS} registers, {SM_SHARED // 1024} KiB shared memory per SM), M <= 16, "
          f"the config a decode-layout layer uses on {a.gpu} (tuned file entry, else built-in default)")
    print(f"  {'dtype':14} {'shape':>11} {'config':28} {'source':8} {'regs':>4} {'smem':>6} {'fit':>3} "
          f"{'progs':>5} {'waves':>5} {'res/SM':>6} {'warps/SM':>8} {'tileKiB':>7} {'depth':>5} {'flightKiB':>9} "
          f"{'wholeKiB':>8} {'spillB':>6}")
    least, short, warps = None, [], {}
    for r in results:
        o = occupancy(r)
        c = r["cfg"]
        per_sm = o["resident"] * c.num_warps
        print(f"  {r['dtype']:14} {r['N']:>5}x{r['K']:<5} {config_name(c):28} {r['source']:8} {r['regs']:>4} "
              f"{r['shared']:>6} {o['fit']:>3} {o['programs']:>5} {o['waves']:>5.2f} {o['resident']:>6.2f} "
              f"{per_sm:>8.1f} {r['tile_w'] / 1024:>7.1f} {o['depth']:>3}{'*' if c.num_stages == 1 else ' ':2} "
              f"{o['in_flight'] / 1024:>9.1f} {o['whole'] / 1024:>8.1f} {r['spills']:>6}")
        least = o["in_flight"] if least is None else min(least, o["in_flight"])
        warps[r["dtype"]] = min(warps.get(r["dtype"], per_sm), per_sm)
        if o["programs"] < SMS or o["in_flight"] < min(IN_FLIGHT_GOAL, o["whole"]) * (1 - 1e-9):
            short.append(f"{r['dtype']} {r['N']}x{r['K']}")
    print("  fit: programs per SM (registers, shared memory, warps); waves: programs / (132 x fit); res/SM: "
          "programs running at once per SM (average); warps/SM: res/SM x warps per program (what hides a warp's "
          "own load and decode latency: the H200's INT8 decode ran fastest with the most, docs/kernels.md); depth: "
          "K-tiles requested ahead (num_stages - 1; * one stage: no prefetch, the tile's loads are in flight only "
          "until they land); wholeKiB: the layer's whole weight / 132 SMs (no config can hold more in flight); "
          "spillB: bytes spilled to local memory")
    print(f"{len(results)} compiles in {time.time() - t0:.0f} s; {spill_summary(results)}")
    print(f"min weight bytes in flight per SM: {least / 1024:.1f} KiB")
    print("min warps per SM at the listed shapes: " + ", ".join(f"{d} {w:.1f}" for d, w in warps.items()))
    print(f"every SM busy and >= {IN_FLIGHT_GOAL // 1024} KiB in flight per SM (or the whole weight where it is "
          f"smaller): " + ("met at every listed shape and pair" if not short else "NOT met: " + "; ".join(short)))
    return 1 if a.check and short else 0


# --- --prefill: decode cost per tensor-core instruction, predicted ratio to dense ---------

# The shapes (out, in) of issue 22, and the M of the prediction.
PREFILL_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (8192, 8192),
                  (28672, 8192), (8192, 28672), (3072, 768), (768, 3072), (1024, 4096))
PREFILL_M = (32, 48, 64, 128, 256, 512, 2048, 4096)
# H200 (sm_90): per SM 65536 registers, 228 KiB shared memory (1 KiB reserved per program),
# 64 warps. LOP3, SHF, SGXT, PRMT, IADD3, SEL and integer IMAD issue at half rate
# (REFERENCE.md 5): each counts two issue cycles. The model's SMs, tensor-core rate, HBM and
# L2 figures (the L2 one assumed) and its arithmetic live in the package, which the untuned
# defaults share: sparse24/ops/linear24/prefill_model.py.
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
HALF_RATE = ("LOP3", "SHF", "SGXT", "PRMT", "IADD3", "SEL", "IMAD", "ISETP", "LEA")


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident programs per SM from registers (allocated per warp in units of
    256), shared memory and warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return max(0, min(REGS_PER_SM // (per_warp * warps), SMEM_PER_SM // (shared + 1024), WARPS_PER_SM // warps))


def prefill_one(dtype: str, cfg, cap: int) -> dict:
    """Compile one prefill config; count its main loop: instructions per warp, HGMMA/HMMA per
    warp, half-rate integer instructions, its wgmma groups and waits (``events``, :func:`wgmma_events`;
    ``groups`` per K-tile, at least 1). INT4 with bf16 x reads bf16 scales, as a bf16 model's layers
    pass them (float16 scales of 11 bits take one fma per register pair more)."""
    import triton

    from sparse24.ops.linear24 import aot_compile

    act, w = _weights("decode", dtype, 4096, 4096, bf16_scales=True)
    x = torch.randn(cfg.block_m, 4096).to(act)
    ck = aot_compile(x, w, None, torch.empty(cfg.block_m, 4096, dtype=act), cfg, cfg.split_k, (cap // 10, cap % 10))
    return dict(loop_counts(ck), dtype=dtype, cfg=cfg, triton=triton.__version__)


def loop_counts(ck) -> dict:
    """A compiled kernel's main loop counted as :func:`prefill_one` reports it (instructions,
    tensor-core and half-rate ones per warp, wgmma events and groups, shared-memory stores,
    local-memory accesses) with its registers, spills, shared memory and atomics."""
    sass = sass_instructions(ck.asm["cubin"])
    loop = main_loop(sass)
    ops = collections.Counter(_opcode(t).split(".")[0] for t in loop)
    regs, spills = resource_usage(ck.asm["cubin"])
    events = wgmma_events(loop)
    return dict(loop=len(loop), mma=ops["HGMMA"] + ops["HMMA"], hgmma=ops["HGMMA"] > 0, local=ops["LDL"] + ops["STL"],
                sts=ops["STS"], half=sum(ops[o] for o in HALF_RATE), regs=regs, spills=spills,
                shared=ck.metadata.shared, groups=max(1, sum(e == "group" for e, _ in events)), events=events,
                atomics=sum(_opcode(t).split(".")[0] in ("ATOMG", "RED") for _, t in sass))


def wgmma_events(loop: list[str]) -> list[tuple[str, int]]:
    """The main loop as the events :func:`loop_tile_time` replays, in program order and
    rotated to start after the last wgmma wait: ("issue", n) for n issue slots of one warp
    (half-rate integer instructions twice, tensor-core instructions not counted: as
    t_issue), ("group", 0) where a wgmma group is committed (an HGMMA with ``gsb0``) and
    ("wait", P) for ``WARPGROUP.DEPBAR.LE gsb0, P`` (at most P groups left in flight)."""
    waits = [i for i, t in enumerate(loop) if t.startswith("WARPGROUP.DEPBAR")]
    if waits:
        loop = loop[waits[-1] + 1:] + loop[:waits[-1] + 1]
    events = []
    for t in loop:
        op = _opcode(t).split(".")[0]
        if t.startswith("WARPGROUP.DEPBAR"):
            events.append(("wait", int(re.search(r"gsb0, (0x[0-9a-f]+)", t).group(1), 16)))
        elif op in ("HGMMA", "HMMA"):
            if "gsb0" in t:
                events.append(("group", 0))
        elif events and events[-1][0] == "issue":
            events[-1] = ("issue", events[-1][1] + 1 + (op in HALF_RATE))
        else:
            events.append(("issue", 1 + (op in HALF_RATE)))
    return events


def in_flight(r: dict) -> int | None:
    """The fewest wgmma groups any wait of the loop leaves in flight (None: no wgmma waits)."""
    return min((n for e, n in r["events"] if e == "wait"), default=None)


def loop_tile_time(events, t_tensor: float, warps: int, tiles: int = 16) -> float:
    """SM clocks per K-tile of ONE program alone on an SM, replaying its loop's events
    (:func:`wgmma_events`): issue slots take warps / 4 clocks each (the warps share 4
    schedulers), the tensor cores run the committed groups one after another (t_tensor
    split evenly over a K-tile's groups, none starting before it is issued) and a wait
    stops issue until at most P groups are in flight. Steady state over the last half of
    ``tiles`` K-tiles. A loop without wgmma groups (synchronous mma) takes t_issue + t_tensor."""
    per_tile = sum(1 for e in events if e[0] == "group")
    issue = sum(n for e, n in events if e == "issue") * warps / 4
    if not per_tile:
        return issue + t_tensor
    clock, free, done, marks = 0.0, 0.0, [], []
    for _ in range(tiles):
        for kind, n in events:
            if kind == "issue":
                clock += n * warps / 4
            elif kind == "group":
                free = max(free, clock) + t_tensor / per_tile
                done.append(free)
            elif len(done) > n:
                clock = max(clock, done[-1 - n])
        marks.append(max(clock, free))
    half = tiles // 2
    return (marks[-1] - marks[half - 1]) / (tiles - half)


def prefill_model(r: dict, l2: float = L2_BYTES_PER_SM_CLK) -> dict:
    """Per K-tile of one program: tensor-core cycles (SM-wide), issue cycles of the
    rest (per scheduler, half-rate integer instructions twice), programs per SM."""
    c = r["cfg"]
    r = dict(r)
    r["t_tensor"] = c.block_m * c.block_n * c.block_k / MACS_PER_CLK
    r["t_issue"] = (r["loop"] - r["mma"] + r["half"]) * c.num_warps / 4
    r["per_sm"] = programs_per_sm(r["regs"], r["shared"], c.num_warps)
    r["alone"] = loop_tile_time(r["events"], r["t_tensor"], c.num_warps)
    r["l2_bytes"] = r.get("l2_bytes", tile_l2_bytes(r["dtype"], c))   # (given: a kernel other than ours)
    r["t_l2"] = r["l2_bytes"] / l2
    r["issue_per_mma"] = (r["loop"] - r["mma"] + r["half"]) / max(r["mma"], 1)
    return r


def tile_l2_bytes(dtype: str, c) -> int:
    """Bytes one program reads through L2 per K-tile: its BLOCK_M x BLOCK_K tile of x (16-bit)
    and its compressed weight tile (values, metadata, INT4's scales and zero points)."""
    return c.block_m * c.block_k * 2 + weight_tile_bytes(dtype, c.block_n, c.block_k) \
        + side_bytes(dtype, c.block_n, c.block_k)


def costs_json(doc: dict) -> str:
    """The cost table as JSON text, one line per config row (diffs show which config changed)."""
    import json

    rows = []

    def mark(t):
        for p in t["pairs"].values():
            for i, row in enumerate(p["configs"]):
                rows.append(json.dumps(row))
                p["configs"][i] = f"@row{len(rows) - 1}@"
    doc = json.loads(json.dumps(doc))
    for t in doc["tables"].values():
        mark(t)
    text = json.dumps(doc, indent=1)
    return re.sub(r'"@row(\d+)@"', lambda m: rows[int(m.group(1))], text) + "\n"


def write_costs(rows: list[dict], a) -> None:
    """``--write-costs``: the model's inputs of every config and pair, measured on this
    Triton's sm_90 SASS, into the package's cost table (its section for this Triton's
    major.minor; the other versions' sections kept), which the untuned defaults read
    (sparse24/ops/linear24/prefill.py)."""
    import json

    import triton

    from sparse24.ops.linear24 import prefill

    path = prefill.COSTS_FILE
    doc = json.loads(path.read_text()) if path.exists() else {
        "format": 1, "about": "Per-config inputs of the prefill time model (sparse24/ops/linear24/prefill_model.py), "
        "counted on sm_90 SASS; the untuned prefill defaults read them. Written by scripts/kernel_static_check.py "
        "--prefill --write-costs, one table per Triton major.minor.", "tables": {}}
    version = triton.__version__
    doc["tables"][".".join(version.split(".")[:2])] = {
        "triton": version, "target": f"sm_{a.cap}",
        "command": "TRITON_DEFAULT_FP_FUSION=1 python scripts/kernel_static_check.py " + " ".join(a.argv),
        "pairs": {pair: {"w_bytes": dense_bytes_per_weight(pair), "configs": [
            {"config": [r["cfg"].block_m, r["cfg"].block_n, r["cfg"].block_k, r["cfg"].num_warps, r["cfg"].num_stages,
                        r["cfg"].split_k],
             **{k: round(float(r[k]), 2) if isinstance(r[k], float) else r[k] for k in prefill.COST_KEYS}}
            for r in rows if r["dtype"] == pair]} for pair in prefill.PAIRS}}
    doc["tables"] = dict(sorted(doc["tables"].items()))
    path.write_text(costs_json(doc))
    prefill._load_costs.cache_clear()
    prefill.prefill_config.cache_clear()
    print(f"# wrote the cost table of Triton {version} to {path}", file=sys.stderr)


def prefill_main(a) -> int:
    """``--prefill``: compile the prefill kernel's configs for sm_90, count the
    decode's issue cost per tensor-core instruction, predict the ratio to dense."""
    from sparse24.ops.config_space import split_factors
    from sparse24.ops.linear24.prefill import PAIRS, cost_key, prefill_config, prefill_configs

    dtypes = a.dtypes.split(",")
    if a.write_costs and sorted(dtypes) != sorted(PAIRS):
        raise SystemExit("--write-costs writes every pair's table: run it with --dtypes " + ",".join(PAIRS))
    cfgs = list(dict.fromkeys(prefill_configs(4096) + prefill_configs(64) + prefill_configs(32)))
    # each also split along K (its row stands for every split factor: SPLIT_K changes only the
    # code after the loop, but the loop compiles a little differently once split)
    cfgs += [dataclasses.replace(c, split_k=2) for c in cfgs]
    if a.limit:
        cfgs = cfgs[:a.limit]
    jobs = [(dt, c) for dt in dtypes for c in cfgs]
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = [prefill_model(r, a.l2) for r in ex.map(prefill_one, [dt for dt, _ in jobs], [c for _, c in jobs],
                                                 [a.cap] * len(jobs))]
    if a.write_costs:
        write_costs(rows, a)
    from sparse24.tools.bench import cpu_name
    print(f"# sparse24 prefill kernel, sm_{a.cap}, triton {rows[0]['triton']}, torch {torch.__version__}, python "
          f"{platform.python_version()}; machine: {cpu_name()}\n# command: "
          + "".join(f"{k}={os.environ[k]} " for k in ("TRITON_DEFAULT_FP_FUSION",) if k in os.environ)
          + "python scripts/kernel_static_check.py " + " ".join(a.argv))
    print("# per K-tile of one program: loop = SASS instructions per warp, mma = tensor-core instructions per warp "
          "(H: HGMMA, wgmma), half = half-rate integer ones among them; issue/mma = (loop - mma + half) / mma; "
          "t_issue = issue cycles per scheduler (half-rate counted twice), t_tensor = SM clocks of its "
          "multiply-adds at 2048 per clock; alone = SM clocks of one program's K-tile by itself (its loop's wgmma "
          "groups and waits replayed: loop_tile_time); t_L2 = SM clocks of its x and weight tiles through L2 at "
          f"{a.l2:g} B per SM clock ({'the H200 measured' if a.l2 == L2_BYTES_PER_SM_CLK else '--l2'}); in flight = wgmma groups per K-tile / the fewest "
          "any wait leaves in flight; /SM = resident programs (registers, shared memory)")
    print(f"{'dtype':13} {'config':26} {'regs':>4} {'smem':>6} {'/SM':>3} {'mma':>4} {'loop':>5} {'half':>4} "
          f"{'issue/mma':>9} {'t_issue':>7} {'t_tensor':>8} {'alone':>6} {'t_L2':>5} in flight")
    for r in rows:
        kind = "HGMMA" if r["hgmma"] else "HMMA"
        print(f"{r['dtype']:13} {config_name(r['cfg']):26} {r['regs']:>4} {r['shared']:>6} {r['per_sm']:>3} "
              f"{r['mma']:>3}{kind[0]} {r['loop']:>5} {r['half']:>4} {r['issue_per_mma']:>9.1f} "
              f"{r['t_issue']:>7.0f} {r['t_tensor']:>8.0f} {r['alone']:>6.0f} {r['t_l2']:>5.0f} {r['groups']}/"
              f"{'-' if in_flight(r) is None else in_flight(r)}"
              + (f"  spills {r['spills']} B, {r['local']} LDL/STL in the loop" if r["spills"] else ""))
    print("# predicted ratio dense / prefill kernel (> 1: faster than dense), per shape (out x in) and M:"
          " the default config (/s: split along K into s), and in brackets the best config of the space that"
          " spills nothing (its BLOCK_M x BLOCK_N/s); dense: the idealized dense GEMM of dense_time(), the same"
          " for every config")
    worst, wins, unbounded, one_split = {}, [], {}, {}
    for dt in dtypes:
        w_bytes = dense_bytes_per_weight(dt)
        by_cfg = {r["cfg"]: r for r in rows if r["dtype"] == dt}
        print(f"{dt:13} " + " ".join(f"{'M=' + str(m):>19}" for m in PREFILL_M))
        for N, K in PREFILL_SHAPES:
            cells = []
            for M in PREFILL_M:
                def ratio(c, l2=a.l2):   # c: a config of the space, split along K or not
                    ours, dense = predicted_time(by_cfg[cost_key(c)], M, N, K, w_bytes, c.split_k, l2)
                    return dense / ours
                space = [dataclasses.replace(c, split_k=s) for c in by_cfg if c.split_k == 1
                         for s in split_factors(M, N, K, c) if not by_cfg.get(cost_key(
                             dataclasses.replace(c, split_k=s)), {"spills": 1})["spills"]]
                best = max(space, key=ratio)
                default = prefill_config(M, N, K, pair=dt)
                d = ratio(default) if cost_key(default) in by_cfg else None
                if d is not None:
                    worst[(dt, M)] = min(worst.get((dt, M), 9.0), d)
                    unbounded[(dt, M)] = min(unbounded.get((dt, M), 9.0), ratio(default, float("inf")))
                    one_split[(dt, M)] = min(one_split.get((dt, M), 9.0), max(
                        ratio(c) for c in space if c.split_k == 1))
                    if d >= 1.0:
                        wins.append(f"{dt} {N}x{K} M={M} {d:.2f}")

                def tile(c):
                    return f"{c.block_m}x{c.block_n}" + (f"/{c.split_k}" if c.split_k > 1 else "")
                split = f"/{default.split_k}" if default.split_k > 1 else ""
                cells.append(f"{d if d is not None else float('nan'):.2f}{split} ({ratio(best):.2f} {tile(best)})")
            print(f"  {N}x{K:<8}  " + " ".join(f"{c:>22}" for c in cells))
    print("min predicted prefill ratio to dense (default configs): " + ", ".join(
        f"{dt} M={m} {v:.2f}" for (dt, m), v in sorted(worst.items())))
    print("min predicted with L2 unbounded (both sides; the model without its L2 term): " + ", ".join(
        f"{dt} M={m} {v:.2f}" for (dt, m), v in sorted(unbounded.items())))
    print("min predicted without split-K (the best config of the space not split): " + ", ".join(
        f"{dt} M={m} {v:.2f}" for (dt, m), v in sorted(one_split.items())))
    print("predicted >= 1.0 of dense (default configs): " + (", ".join(wins) or "nowhere"))
    few_rows_report(rows, dtypes)
    large_rows_report(rows, a.cap)
    return 0


def prefill_in_flight(r: dict, dtype: str, M: int, N: int, K: int, split_k: int) -> float:
    """Weight bytes one SM keeps in flight (average over the SMs) running a prefill config at
    (M, N, K) split ``split_k`` ways: resident programs (its cost row's ``per_sm``, or the
    programs / 132 where fewer) x K-tiles requested ahead (num_stages - 1, at most a split's
    K-tiles) x its weight tile's bytes (values and metadata)."""
    c = r["cfg"]
    programs = -(-M // c.block_m) * -(-N // c.block_n) * split_k
    depth = min(c.num_stages - 1, -(-(-(-K // c.block_k)) // split_k))
    return min(max(r["per_sm"], 1), programs / SMS) * depth * weight_tile_bytes(dtype, c.block_n, c.block_k)


# The H200's measured prefill-kernel rows the latency term was fitted on and is checked against.
MEASURED_PREFILL = ("results/NVIDIA_H200/probe_prefill-run4.csv", "results/NVIDIA_H200/probe_prefill-run5.csv")
SM_CLOCK_GHZ = 1.98


def measured_prefill_rows(root: str = ".", few: bool = True) -> list[dict]:
    """Rows of MEASURED_PREFILL at 17-64 rows (``few``; else past 64): ``pair`` (``float16`` /
    ``int8-float16``), N, K, M, the config ours ran (``cfg``, with its split), the measured kernel time
    ``us``, cuBLAS's ``dense_us`` and Triton's own dense GEMM ``triton_dense_us`` on the tile
    ``dense_cfg`` (NaN where not timed) (later files win)."""
    import csv

    from sparse24.ops.config_space import KernelConfig

    found = {}
    for name in MEASURED_PREFILL:
        path = os.path.join(root, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for row in csv.DictReader(f):
                m = re.fullmatch(r"BM(\d+)_BN(\d+)_BK(\d+)_W(\d+)_S(\d+)_SK(\d+)", row["prefill_config"])
                if not m or (int(row["M"]) <= LATENCY_MAX_M) != few or row["prefill_us"] in ("", "nan"):
                    continue
                bm, bn, bk, w, st, sk = map(int, m.groups())
                pair = {"fp16": "float16", "int8": "int8-float16"}[row["weight"]]
                key = (pair, int(row["N"]), int(row["K"]), int(row["M"]))
                label = cfg = KernelConfig(bm, bn, bk, 8, sk, w, st, kernel="prefill")
                if "tuned_config" not in row:
                    # Files of runs 4-5: the probe launched ours through run_prefill without a config, so
                    # where the H200's file has a tuned prefill entry that entry ran, not the labelled
                    # config (Triton's dense GEMM did run the labelled tile)
                    cfg = _ran_before_labels(row["weight"], *key[1:]) or label
                found[key] = dict(pair=pair, N=key[1], K=key[2], M=key[3], us=float(row["prefill_us"]), cfg=cfg,
                                  dense_cfg=label, dense_us=float(row["dense_us"]),
                                  triton_dense_us=float(row.get("triton_dense_us") or "nan"))
    return list(found.values())


def _ran_before_labels(weight: str, N: int, K: int, M: int):
    """The H200 file's tuned prefill entry for the point (what ``run_prefill`` without a config took
    there), or None."""
    from sparse24.ops.config_store import lookup

    probe = _probe()
    return probe._tuned_of(lookup(M, N, K, probe._weight_key(weight), "NVIDIA H200", (9, 0), 132, "decode",
                                  "prefill"))


@functools.lru_cache(maxsize=1)
def _probe():
    """scripts/gpu_probe.py as a module (its ``_dense_mm``), loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_probe", os.path.join(os.path.dirname(__file__), "gpu_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def dense_one(cfg, cap: int) -> dict:
    """Compile Triton's own dense GEMM of scripts/gpu_probe.py (``_dense_mm``: 16-bit x and W,
    no decode), which the H200 timed beside the prefill kernel on the same tile, warps and
    stages, for sm_``cap`` and cost its K-tile as :func:`prefill_model` costs ours (its W tile
    BLOCK_N x BLOCK_K x 2 B through L2)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    # as the JIT specializes the H200's launches: aligned pointers, N and K divisible by 16 (M is too
    # at every measured row)
    src = ASTSource(triton.jit(_probe()._dense_mm), sig, attrs={(i,): [["tt.divisibility", 16]] for i in range(6)},
                    constexprs={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k})
    ck = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": True})
    return prefill_model(dict(loop_counts(ck), dtype="float16", cfg=dataclasses.replace(cfg, split_k=1),
                              l2_bytes=(cfg.block_m + cfg.block_n) * cfg.block_k * 2))   # x and a dense W tile


# The fixed time of a launch the model leaves out on both sides (launch, epilogue): the
# intercept of the latency fit (prefill_model's HBM_LATENCY_CLK), added where modelled time is
# set against measured time.
FIXED_US = 4.6


def large_rows_report(rows: list[dict], cap: int) -> tuple[list[float], list[float], list[float]]:
    """``--prefill`` past 64 rows: the H200's measured prefill kernel and, on the same tile,
    Triton's own dense GEMM (no decode: :func:`dense_one`) against the model (this Triton's cost
    rows and SASS, FIXED_US added), and cuBLAS against the idealized dense GEMM
    (``dense_time``). Returns the measured / model ratios (Triton's dense, ours, cuBLAS)."""
    from sparse24.ops.linear24.prefill import cost_key

    by_cfg = {r["cfg"]: r for r in rows if r["dtype"] == "float16"}
    measured = [m for m in measured_prefill_rows(few=False) if m["pair"] == "float16"]
    if not measured or not by_cfg:
        return [], [], []
    dense_rows = {}
    clk = SM_CLOCK_GHZ * 1e3
    print(f"# past {LATENCY_MAX_M} rows, fp16: the H200's measured prefill kernel (ours), Triton's own dense GEMM "
          "on the same tile (scripts/gpu_probe.py _dense_mm, compiled here) and cuBLAS, each against the model (us; "
          f"{FIXED_US} us of launch added; one program's K-tile its tensor, issue and L2 time one after the other)")
    print(f"  {'shape':>11} {'M':>4} {'config':26} {'ours':>7} {'model':>6} {'ratio':>5} {'triton':>7} {'model':>6} "
          f"{'ratio':>5} {'cuBLAS':>7} {'model':>6} {'ratio':>5}")
    tri, ours, cub = [], [], []
    for m in measured:
        r = by_cfg.get(cost_key(m["cfg"]))   # ours (None: this table does not cost the config that ran)
        r_dense = by_cfg.get(cost_key(m["dense_cfg"]))
        if r_dense is None and r is None:
            continue
        one = dataclasses.replace(m["dense_cfg"], split_k=1)
        if one not in dense_rows:
            dense_rows[one] = dense_one(one, cap)
        t = predicted_time(dense_rows[one], m["M"], m["N"], m["K"], 2.0)[0] / clk + FIXED_US
        o, d = (t_ / clk + FIXED_US for t_ in predicted_time(r or r_dense, m["M"], m["N"], m["K"],
                                                              dense_bytes_per_weight("float16"), m["cfg"].split_k))
        if r is not None:
            ours.append(m["us"] / o)
        cub.append(m["dense_us"] / d)
        if m["triton_dense_us"] == m["triton_dense_us"]:
            tri.append(m["triton_dense_us"] / t)
        theirs = "" if m["dense_cfg"] == m["cfg"] else f" (Triton's GEMM: {config_name(m['dense_cfg'])})"
        print(f"  {m['N']:>5}x{m['K']:<5} {m['M']:>4} {config_name(m['cfg']):26} {m['us']:>7.1f} "
              + (f"{o:>6.1f} {ours[-1]:>5.2f}" if r is not None else f"{'-':>6} {'-':>5}")
              + f" {m['triton_dense_us']:>7.1f} {t:>6.1f} {m['triton_dense_us'] / t:>5.2f} "
              f"{m['dense_us']:>7.1f} {d:>6.1f} {cub[-1]:>5.2f}{theirs}")
    print(f"measured / model past {LATENCY_MAX_M} rows ({len(ours)} H200 points): "
          f"Triton's dense GEMM {_spread(tri, '.2f')}; "
          f"ours {_spread(ours, '.2f')}; cuBLAS / idealized dense {_spread(cub, '.2f')}")
    return tri, ours, cub


def _spread(v: list[float], fmt: str, unit: str = "") -> str:
    """``median M<unit>, LO to HI`` of ``v`` (the upper median of an even count), or ``none``."""
    v = sorted(v)
    return f"median {v[len(v) // 2]:{fmt}}{unit}, {v[0]:{fmt}} to {v[-1]:{fmt}}" if v else "none"


def few_row_flights(by_cfg: dict, dtype: str):
    """For each listed shape at M = 17, 32, 48 and 64: ``(N, K, M, config, flight, goal)``, the
    default config of pair ``dtype`` (:func:`prefill_config` with the installed cost table), the
    weight bytes it keeps in flight per SM (:func:`prefill_in_flight`, from its row in ``by_cfg``,
    cost rows by config) and the goal: IN_FLIGHT_GOAL, or the layer's whole weight / 132 where that is
    smaller. Defaults without a row in ``by_cfg`` are left out."""
    from sparse24.ops.linear24.prefill import cost_key, prefill_config

    for N, K in PREFILL_SHAPES:
        for M in (17, 32, 48, 64):
            c = prefill_config(M, N, K, pair=dtype)
            if cost_key(c) in by_cfg:
                flight = prefill_in_flight(dict(by_cfg[cost_key(c)], cfg=c), dtype, M, N, K, c.split_k)
                whole = N * K * weight_tile_bytes(dtype, 64, 64) / (64 * 64) / SMS
                yield N, K, M, c, flight, min(IN_FLIGHT_GOAL, whole)


def few_rows_report(rows: list[dict], dtypes: list[str]) -> None:
    """``--prefill`` at 17-64 rows: the weight bytes in flight per SM of the default configs at
    the listed shapes, and the model against the H200's measured prefill-kernel times there,
    with and without its latency term (prefill_model.HBM_LATENCY_CLK)."""
    from sparse24.ops.config_space import sparse_kernel
    from sparse24.ops.linear24.prefill import cost_key

    by_pair = {dt: {r["cfg"]: r for r in rows if r["dtype"] == dt} for dt in dtypes}
    least, short = {}, []
    for dt in dtypes:
        for N, K, M, _, flight, goal in few_row_flights(by_pair[dt], dt):
            least[dt] = min(least.get(dt, flight), flight)
            # (the goal is the 16-bit weights': INT8 / INT4 with 16-bit x take the sparse tensor-core kernel)
            if not sparse_kernel(dt) and flight < goal * (1 - 1e-9):
                short.append(f"{dt} {N}x{K} M={M} {flight / 1024:.1f}")
    print("min weight bytes in flight per SM at 17-64 rows (default configs, M = 17, 32, 48, 64 at the listed "
          "shapes): " + ", ".join(f"{dt} {v / 1024:.1f} KiB" for dt, v in least.items()))
    print(f">= {IN_FLIGHT_GOAL // 1024} KiB in flight per SM at 17-64 rows (or the whole weight / 132 where it is "
          "smaller), 16-bit weights (INT8 / INT4 with 16-bit x take the sparse tensor-core kernel there: --occupancy "
          "--listed-rows 32): " + ("met at every listed shape" if not short else "NOT met: " + "; ".join(short)))
    measured = [m for m in measured_prefill_rows() if m["pair"] in by_pair]
    if not measured:
        return
    print(f"# 17-64 rows, the H200's measured prefill kernel ({', '.join(MEASURED_PREFILL)}) against the model "
          f"(this Triton's cost rows; us at {SM_CLOCK_GHZ} GHz): with its latency term, without it; flightKiB: weight "
          "bytes in flight per SM")
    print(f"  {'pair':13} {'shape':>11} {'M':>3} {'config':26} {'measured':>8} {'model':>6} {'m-model':>7} "
          f"{'no-lat':>6} {'m-no-lat':>8} {'flightKiB':>9}")
    gaps = {True: [], False: []}
    for m in measured:
        r = by_pair[m["pair"]].get(cost_key(m["cfg"]))
        if r is None:
            continue
        w_bytes = dense_bytes_per_weight(m["pair"])
        us = {lat: predicted_time(r, m["M"], m["N"], m["K"], w_bytes, m["cfg"].split_k,
                                  **({} if lat else {"hbm_latency": 0.0}))[0] / (SM_CLOCK_GHZ * 1e3)
              for lat in (True, False)}
        for lat in gaps:
            gaps[lat].append(m["us"] - us[lat])
        print(f"  {m['pair']:13} {m['N']:>5}x{m['K']:<5} {m['M']:>3} {config_name(m['cfg']):26} {m['us']:>8.1f} "
              f"{us[True]:>6.1f} {m['us'] - us[True]:>7.1f} {us[False]:>6.1f} {m['us'] - us[False]:>8.1f} "
              f"{prefill_in_flight(r, m['pair'], m['M'], m['N'], m['K'], m['cfg'].split_k) / 1024:>9.1f}")
    print(f"measured - model at 17-64 rows ({len(gaps[True])} H200 points): with the latency term "
          f"{_spread(gaps[True], '.1f', ' us')}; without it {_spread(gaps[False], '.1f', ' us')} "
          "(a constant difference is the fixed launch and "
          "epilogue time the model leaves out)")


# --- --unpack: the unpack route's kernel ---------------------------------------------

# (name, values, scale, output, INT8, GROUP, HAS_ZERO, compressed bytes read per dense weight)
UNPACK_VARIANTS = (("fp16", "*fp16", "*fp32", "*fp16", False, 0, False, 1.125),
                   ("bf16", "*bf16", "*fp32", "*bf16", False, 0, False, 1.125),
                   ("int8", "*u8", "*fp32", "*fp16", True, 0, False, 0.625),
                   ("int8-bf16", "*u8", "*fp32", "*bf16", True, 0, False, 0.625),
                   ("int4", "*u8", "*fp16", "*fp16", False, 128, False, 0.375 + 2 / 128),
                   ("int4-bf16", "*u8", "*bf16", "*bf16", False, 128, False, 0.375 + 2 / 128),
                   ("int4-zero", "*u8", "*fp16", "*fp16", False, 128, True, 0.375 + 3 / 128))
UNPACK_HBM = 4.2e12   # B/s: the H200's measured HBM read rate (results/NVIDIA_H200/l2_bandwidth.txt)


def compile_unpack(values, scale, out, int8, group, has_zero, cap=90):
    """The unpack kernel (4 warps, 4 atoms: 32 outputs a thread) compiled for ``sm_<cap>`` for one
    of :data:`UNPACK_VARIANTS`, specialized as a launch on a 4096-wide weight is (pointers and
    sizes divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sparse24.kernels.sparse24_unpack import sparse24_unpack
    sig = {"v_ptr": values, "meta_ptr": "*i32", "scale_ptr": scale, "zero_ptr": "*u8", "out_ptr": out, "R": "i32",
           "C": "i32", "NT": "i32", "G": "i32", "stride_ml": "i32", "stride_or": "i32", "INT8": "constexpr",
           "GROUP": "constexpr", "HAS_ZERO": "constexpr", "BLOCK_A": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}
    return triton.compile(ASTSource(sparse24_unpack, sig, attrs=attrs,
                                    constexprs={"INT8": int8, "GROUP": group, "HAS_ZERO": has_zero, "BLOCK_A": 4}),
                          target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})


def unpack_instructions(values, scale, out, int8, group, has_zero, cap=90) -> tuple[int, int]:
    """``(SASS instructions, registers)`` per thread of :func:`compile_unpack`'s kernel."""
    cubin = compile_unpack(values, scale, out, int8, group, has_zero, cap).asm["cubin"]
    return len(without_padding(sass_instructions(cubin))), resource_usage(cubin)[0]


def unpack_main(a) -> int:
    import triton
    N, K = map(int, a.shape.split(","))
    print(f"# unpack kernel, sm_{a.cap}, Triton {triton.__version__}; {N} x {K}: issue at 4 warp-instructions per "
          f"SM clock on 132 SMs at 1.98 GHz, HBM at {UNPACK_HBM / 1e12:.1f} TB/s")
    print(f"{'weights':10} {'instr/thread':>12} {'warp-instr/output B':>19} {'issue us':>8} {'HBM us':>7} "
          f"{'regs':>4} {'programs/SM':>11} {'read KiB in flight/SM':>21}")
    worst = (0.0, 0.0, 0.0)
    for name, values, scale, out, int8, group, has_zero, read in UNPACK_VARIANTS:
        n, regs = unpack_instructions(values, scale, out, int8, group, has_zero, a.cap)
        issue = N * K / 1024 * n / (132 * 4 * 1.98e9) * 1e6   # a warp writes 1024 outputs per n instructions
        hbm = N * K * (read + 2) / UNPACK_HBM * 1e6
        progs = programs_per_sm(regs, 0, 4)
        # a program loads its whole tile (16 rows x 256 columns) before it computes or stores
        print(f"{name:10} {n:>12} {n / 2048:>19.3f} {issue:>8.1f} {hbm:>7.1f} {regs:>4} {progs:>11} "
              f"{progs * 16 * 256 * read / 1024:>21.1f}", flush=True)
        worst = max(worst, (max(issue, hbm), issue, hbm))
    print(f"unpack at {N} x {K}: max predicted {worst[0]:.1f} us (issue {worst[1]:.1f} us, HBM {worst[2]:.1f} us)")
    return 0


def main(argv=None):
    from sparse24.ops.config_space import candidate_configs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", type=int, default=90)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--m", type=str, default=None, help="M (default 1); with --sass a list (default 1,2,4,8,16)")
    ap.add_argument("--shape", default="4096,4096")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N configs")
    ap.add_argument("--sass", action="store_true", help="count the main loop's SASS instructions (budget)")
    ap.add_argument("--kernel", choices=("decode", "matmul"), default="decode", help="with --sass")
    ap.add_argument("--dtypes", default="float16,bfloat16,int8-float16,int8-bfloat16,int4-float16,int4-bfloat16",
                    help="with --sass, --occupancy, --prefill")
    ap.add_argument("--listed-only", action="store_true", help="with --sass: only the listed shapes")
    ap.add_argument("--listed-rows", type=int, default=16, choices=(8, 16, 32),
                    help="with --sass/--occupancy: rows of x at the listed shapes (8: batch <= 8, one mma per "
                         "chunk in the sparse tensor-core kernel; 32: its 32 rows per program, the 17-32 row route "
                         "of INT8 / INT4 weights with 16-bit x)")
    ap.add_argument("--no-listed", action="store_true",
                    help="with --sass: skip the amortized count at the listed shapes")
    ap.add_argument("--occupancy", action="store_true",
                    help="programs per SM, waves and weight bytes in flight at the listed shapes")
    ap.add_argument("--gpu", default="NVIDIA H200", help="with --occupancy: whose tuned file applies")
    ap.add_argument("--csv", default=None, help="with --sass: write the rows here")
    ap.add_argument("--check", action="store_true", help="with --sass: exit 1 when over the budget")
    ap.add_argument("--verbose", action="store_true", help="with --sass: opcode mix per config")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill kernel: decode issue cost per tensor-core instruction, predicted ratio to dense")
    ap.add_argument("--unpack", action="store_true",
                    help="the unpack kernel: instructions per thread, issue and HBM time at --shape")
    ap.add_argument("--write-costs", action="store_true",
                    help="with --prefill (every pair): write this Triton's cost table for the untuned defaults")
    ap.add_argument("--l2", type=float, default=L2_BYTES_PER_SM_CLK,
                    help="with --prefill: L2 bytes per SM clock (default: the assumed figure; "
                         "scripts/gpu_l2_bandwidth.py measures it)")
    a = ap.parse_args(argv)
    if not a.l2 > 0:
        ap.error(f"--l2 must be a positive number of bytes per SM clock, got {a.l2}")
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.unpack:
        return unpack_main(a)
    if a.prefill:
        return prefill_main(a)
    if a.occupancy:
        return occupancy_main(a)
    if a.sass:
        a.m = a.m or "1,2,4,8,16"
        return sass_main(a)
    a.m = int(a.m or 1)
    N, K = map(int, a.shape.split(","))
    cfgs = candidate_configs(a.m, N, K)
    cfgs = cfgs[:a.limit] if a.limit else cfgs
    # split-K changes only the epilogue: compile each tile once
    cfgs = list({(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages): c for c in cfgs}.values())
    print(f"sm_{a.cap} {a.dtype} M={a.m} N={N} K={K}: {len(cfgs)} configs, triton "
          f"{__import__('triton').__version__}", flush=True)
    print(f"{'config (BM,BN,BK,warps,stages)':34} {'regs':>5} {'spill':>6} {'smem':>7} {'cp16':>5} {'cp4':>5} "
          f"{'ld.g':>5} "
          f"{'mma':>5} {'s':>5}")
    with ProcessPoolExecutor(a.jobs) as ex:
        futs = [ex.submit(compile_one, c, a.dtype, a.cap, N, K) for c in cfgs]
        for f in futs:
            r = f.result()
            c = r["cfg"]
            print(f"{str((c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)):34} {r['regs']:>5} "
                  f"{r['spills']:>6} {r['shared']:>7} {r['cp16']:>5} {r['cp4']:>5} {r['ldg']:>5} {r['mma']:>5} "
                  f"{r['secs']:>5.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

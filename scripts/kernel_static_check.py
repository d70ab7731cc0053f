"""Compile the 2:4 kernel ahead of time for a GPU target (no GPU needed) and
report, per config: registers, spill bytes, shared memory, and the tile loads
(cp16 / cp4: 16- / 4-byte pipelined async copies, ld.g: plain global loads).
Catches configs that spill or overflow shared memory before any device time
is spent.

    python scripts/kernel_static_check.py --cap 90 --dtype float16 --m 1 --shape 4096,4096 [--jobs 2]
"""
import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch


def compile_one(cfg, dtype, cap, N, K):
    import triton

    import sparse24
    from sparse24.ops.linear24 import aot_compile

    act = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype.removeprefix("int8-")]
    p = sparse24.compress(torch.randn(N, K), quantize="int8" if dtype.startswith("int8-") else None)
    if p.scale is None:
        p = p.to(dtype=act)
    x = torch.randn(16, K).to(act)
    target = torch.empty(16, N, dtype=torch.float32 if cfg.split_k > 1 else act)
    t0 = time.time()
    ck = aot_compile(x, p, None, target, cfg, cfg.split_k, (cap // 10, cap % 10))
    ptx = ck.asm["ptx"]
    # Registers and local-memory (spill) bytes from the cubin, via the
    # cuobjdump shipped in Triton's wheel (CompiledKernel.n_regs needs a GPU).
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    spills = int(re.search(r"LOCAL:(\d+)", res).group(1)) + int(re.search(r"STACK:(\d+)", res).group(1))
    return dict(cfg=cfg, regs=regs, spills=spills, shared=ck.metadata.shared,
                cp16=len(re.findall(r"cp\.async\.c[ag]\.shared\.global .*, 0x10", ptx)),
                cp4=len(re.findall(r"cp\.async\.c[ag]\.shared\.global .*, 0x4", ptx)),
                ldg=len(re.findall(r"ld\.global", ptx)),
                mma=ptx.count("mma.sync") + ptx.count("wgmma"), secs=time.time() - t0)


def main(argv=None):
    from sparse24.tuning import candidate_configs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", type=int, default=90)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--shape", default="4096,4096")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N configs")
    a = ap.parse_args(argv)
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

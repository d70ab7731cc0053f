"""Measure what the prefill model assumes: how many bytes per SM clock L2 delivers to
the SMs (scripts/kernel_static_check.py, ``L2_BYTES_PER_SM_CLK``: 24.7, the mean of this probe's two
H200 runs, 23.4 and 26.0; 32 assumed before; docs/kernels.md, "Prefill path"), and HBM's bandwidth
beside it. Run by scripts/gpu_check.sh; its figure
goes back into the report here: ``python scripts/kernel_static_check.py --prefill --l2 X``.

Every program reads 16-byte vectors with ``.cg`` (L2 only, as the prefill kernel's
pipelined copies), walking a buffer of ``--l2-mib`` 32 times per launch (well inside L2:
60 MB on an H200) or ``--hbm-mib`` once (far past it); the sums are checked against torch.
One warm-up launch puts the small buffer in L2; the median of ``--reps`` timed launches
(CUDA events) counts.

    python scripts/gpu_l2_bandwidth.py --out results/GPU/     # on a GPU
    python scripts/gpu_l2_bandwidth.py --smoke                # CPU (Triton's interpreter), tiny: the sums only
"""
import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from sparse24.kernels.interpreter import InterpretedKernel

BLOCK = 2048   # int32 per program and step: 8 KiB, four 16-byte loads per thread of 4 warps


def _read(src_ptr, out_ptr, n_blocks, steps, grid, BLOCK: tl.constexpr):
    # Program p sums blocks p, p + grid, p + 2 grid, ... (mod n_blocks), `steps` of them.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(steps):
        b = (pid + i * grid) % n_blocks
        acc += tl.load(src_ptr + b.to(tl.int64) * BLOCK + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


read_kernel = triton.jit(_read)
read_interpreted = InterpretedKernel(_read)


def read_pass(src: torch.Tensor, grid: int, steps: int) -> torch.Tensor:
    """One launch: ``grid`` programs, ``steps`` blocks of ``BLOCK`` int32 each, over ``src``
    (int32, a multiple of ``BLOCK`` long) -> each program's int32 sum, ``(grid,)``."""
    if src.dtype != torch.int32 or src.dim() != 1 or src.numel() % BLOCK:
        raise ValueError(f"src must be 1-D int32 with a multiple of {BLOCK} elements")
    out = torch.empty(grid, dtype=torch.int32, device=src.device)
    kernel = read_kernel if src.is_cuda else read_interpreted
    kernel[(grid,)](src, out, src.numel() // BLOCK, steps, grid, BLOCK=BLOCK, num_warps=4)
    return out


def expected_sums(src: torch.Tensor, grid: int, steps: int) -> torch.Tensor:
    """The reference: each program's blocks summed by torch (int64, then as int32 wraps)."""
    blocks = src.view(-1, BLOCK).to(torch.int64).sum(1)
    idx = (torch.arange(grid)[:, None] + torch.arange(steps)[None, :] * grid) % blocks.numel()
    return blocks.cpu()[idx].sum(1)


def _sm_clock_mhz() -> tuple[float, str]:
    """The SM clock to count bytes per clock at: nvidia-smi's maximum, else the H200's 1980 MHz."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10).stdout.split()
        return float(q[0]), "nvidia-smi clocks.max.sm"
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 1980.0, "assumed (nvidia-smi unavailable)"


def measure(mib: int, passes: int, reps: int, device) -> dict:
    """Median bandwidth of reading a ``mib`` MiB buffer ``passes`` times per launch through
    L2 (``.cg``), sums checked."""
    n = mib * 2 ** 20 // 4 // BLOCK * BLOCK
    src = torch.randint(0, 4, (n,), dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = sms * 8
    steps = max(1, passes * n // BLOCK // grid)
    got = read_pass(src, grid, steps)        # warm-up (and the small buffer into L2)
    torch.testing.assert_close(got.cpu().to(torch.int64), expected_sums(src, grid, steps), rtol=0, atol=0)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        read_pass(src, grid, steps)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    t = statistics.median(times)
    nbytes = grid * steps * BLOCK * 4
    mhz, clock_from = _sm_clock_mhz()
    return dict(mib=mib, bytes=nbytes, seconds=t, tb_s=nbytes / t / 1e12,
                b_per_sm_clk=nbytes / t / (sms * mhz * 1e6), sms=sms, mhz=mhz, clock_from=clock_from)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--l2-mib", type=int, default=24, help="buffer read from L2 (MiB)")
    ap.add_argument("--hbm-mib", type=int, default=2048, help="buffer read from HBM (MiB)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for l2_bandwidth.txt")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter: the sums only")
    a = ap.parse_args(argv)
    if a.smoke:
        src = torch.randint(0, 4, (BLOCK * 5,), dtype=torch.int32)
        got = read_pass(src, 3, 4)
        torch.testing.assert_close(got.to(torch.int64), expected_sums(src, 3, 4), rtol=0, atol=0)
        print("smoke: sums match (no bandwidth on CPU)")
        return 0
    if not torch.cuda.is_available():
        print("gpu_l2_bandwidth: no CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    lines = [f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}"]
    results = {kind: measure(mib, passes, a.reps, dev) for kind, mib, passes in (("L2", a.l2_mib, 32),
                                                                                    ("HBM", a.hbm_mib, 1))}
    for kind, r in results.items():
        lines.append(f"{kind} read bandwidth ({r['mib']} MiB buffer, .cg 16-byte loads, {r['sms']} SMs): "
                     f"{r['tb_s']:.2f} TB/s = {r['b_per_sm_clk']:.1f} B per SM clock at {r['mhz']:.0f} MHz "
                     f"({r['clock_from']}); median of {a.reps}, {r['bytes'] / 2 ** 20:.0f} MiB per launch")
    lines.append(f"then, on the CPU machine: python scripts/kernel_static_check.py --prefill --l2 "
                 f"{results['L2']['b_per_sm_clk']:.1f}")
    print("\n".join(lines))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "l2_bandwidth.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Core speed figures on this machine, measured side by side in one run.

- compress / to_dense versus torch's own pure-torch conversion to and from
  its CUTLASS 2:4 layout (same weight, same process, interleaved repeats);
- the reference ``sparse24.linear`` versus dense ``F.linear`` on the masked
  weight, fp32, M = 1, 64, 256;
- the reference backend's extra memory on a large layer (peak RSS growth of a
  first and of a repeated call in a fresh process, the peak reset right before
  each (Linux ``/proc``; elsewhere the figure is reported unavailable), versus
  the size of the dense weight).

Goals (issue 23): to_dense within 2x of a copy of the same dense result
(``torch.clone``, timed side by side), and the reference linear <= 1.4x dense
``F.linear`` at M = 256.

Usage: python scripts/bench_core.py [--size 4096] [--repeats 7] [--threads N] [--clock wall|cpu] [--skip-memory]
Prints medians over repeats and ratios. The speed-ups vs torch's CUTLASS
conversions are torch / sparse24 (higher = sparse24 faster); ``to_dense / copy``
and ``sparse/dense`` are sparse24 / the reference (higher = sparse24 slower:
1 = as fast as the copy or dense ``F.linear``, the goals <= 2 and <= 1.4).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.sparse._semi_structured_conversions import (
    sparse_semi_structured_from_dense_cutlass, sparse_semi_structured_to_dense_cutlass)

import sparse24
from sparse24.tools.bench import cpu_name


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (with --threads 1: the work of the one thread)


def side_by_side(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per function, the functions interleaved in every repeat
    so that load on a shared machine hits all of them alike."""
    for f in fns.values():
        f()  # warm-up
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = CLOCK()
            f()
            times[k].append(CLOCK() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_conversion(size: int, repeats: int) -> None:
    for dtype in (torch.float16, torch.float32):
        w = torch.randn(size, size).to(dtype)
        masked = w * sparse24.mask_nm(w)
        p = sparse24.compress(w)
        cut_vals, cut_meta = sparse_semi_structured_from_dense_cutlass(masked)
        t = side_by_side({
            "copy": lambda: masked.clone(),  # the bytes to_dense writes, copied: memory speed
            "mask_nm": lambda: sparse24.mask_nm(w),
            "compress": lambda: sparse24.compress(w),
            "compress(mask)": lambda: sparse24.compress(masked, mask=masked != 0),
            "torch_cutlass_from_dense": lambda: sparse_semi_structured_from_dense_cutlass(masked),
            "to_dense": lambda: p.to_dense(),
            "torch_cutlass_to_dense": lambda: sparse_semi_structured_to_dense_cutlass(cut_vals, cut_meta),
        }, repeats)
        print(f"\n{size}x{size} {str(dtype).replace('torch.', '')}: median seconds over {repeats} repeats")
        for k, v in t.items():
            print(f"  {k:28s} {v:8.4f}")
        print(f"  compress speed-up vs torch CUTLASS conversion: {t['torch_cutlass_from_dense'] / t['compress']:.2f}x"
              f" (from a dense masked weight: compress from its mask"
              f" {t['torch_cutlass_from_dense'] / t['compress(mask)']:.2f}x)")
        print(f"  to_dense speed-up vs torch CUTLASS inverse:      {t['torch_cutlass_to_dense'] / t['to_dense']:.2f}x")
        print(f"  to_dense / copy of the dense result (memory speed = 1; goal <= 2): "
              f"{t['to_dense'] / t['copy']:.2f}x")


def bench_linear(size: int, repeats: int) -> None:
    w = torch.randn(size, size)
    p = sparse24.compress(w)
    wd = p.to_dense()
    print(f"\nreference linear vs dense F.linear, fp32, W {size}x{size}, median over {repeats} repeats")
    print(f"  {'M':>5s} {'dense s':>9s} {'sparse24 s':>11s} {'sparse/dense':>13s}")
    for M in (1, 64, 256):
        x = torch.randn(M, size)
        t = side_by_side({"dense": lambda: F.linear(x, wd), "ref": lambda: sparse24.linear(x, p)}, repeats)
        print(f"  {M:5d} {t['dense']:9.4f} {t['ref']:11.4f} {t['ref'] / t['dense']:12.2f}x"
              + ("  (goal at M = 256: <= 1.4x)" if M == 256 else ""))


_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def _peak_rss() -> int | None:
    """This process's peak resident set (Linux VmHWM) in bytes; None where /proc is missing."""
    try:
        with open(_STATUS) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _reset_peak_rss() -> bool:
    """Set the peak (VmHWM) to the current resident set (Linux >= 4.0); False where that is not possible."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_child(n: int, k: int, threads: int | None = None) -> None:
    """Prints the peak-RSS growth in bytes of a first and then a repeated ``sparse24.linear`` call on an
    ``n x k`` fp32 weight, one line each, or ``unavailable``. The peak is reset right before each call:
    ``ru_maxrss`` cannot be reset, and the setup (a 256 MiB ``randn`` and ``compress``) had already raised it
    past anything the call needs, so it read 0 even for a call decompressing the whole weight."""
    if threads:
        torch.set_num_threads(threads)
    p = sparse24.compress(torch.randn(n, k))
    x = torch.randn(1, k)
    for _ in range(2):  # the first call's growth includes one-time setup; the repeated call's does not
        gc.collect()
        before = _peak_rss() if _reset_peak_rss() else None
        if before is None:
            print("unavailable")
            return
        sparse24.linear(x, p)
        # >= 0: Linux syncs a thread's RSS counts lazily (a few hundred KiB late), the peak can read lower
        print(max(0, _peak_rss() - before))


def bench_memory(n: int = 16384, k: int = 4096, threads: int | None = None) -> None:
    # A fresh process, so that no earlier benchmark's freed memory is reused by the calls measured.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_core; "
            f"bench_core._rss_child({n}, {k}, {threads!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    from sparse24.ops.linear24 import CHUNK_ELEMENTS
    head = f"\nreference linear memory, fp32 W {n}x{k} (dense would be {n * k * 4 / 2**20:.0f} MiB): "
    if lines[-1] == "unavailable":
        print(head + "peak RSS growth unavailable (needs Linux's /proc/self/status VmHWM and clear_refs)")
        return
    first, repeated = (int(v) / 2**20 for v in lines[-2:])
    print(head + f"peak RSS growth of a first call {first:.1f} MiB, of a repeated call {repeated:.1f} MiB; "
          f"decompression works in chunks of {CHUNK_ELEMENTS * 4 / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on a shared "
                                                "machine use 1: two threads on two busy cores wait for each other)")
    ap.add_argument("--skip-memory", action="store_true", help="skip the peak-RSS measurement")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or the CPU time of this thread (with --threads 1; on a machine so loaded "
                         "that wall times of one call vary 30x, CPU time still counts memory stalls but not "
                         "the time other processes hold the core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            ap.error("--clock cpu needs --threads 1 (other threads' work is not this thread's time)")
        global CLOCK
        CLOCK = time.thread_time
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}; "
          f"sparse24 {sparse24.__version__}; clock: {args.clock}")
    bench_conversion(args.size, args.repeats)
    bench_linear(args.size, args.repeats)
    if not args.skip_memory:
        bench_memory(threads=args.threads)


if __name__ == "__main__":
    main()

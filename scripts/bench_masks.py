"""Mask quality and speed: permutation gain on random normal 64x128 matrices, and
every mask method on a 4096x4096 fp32 weight.

The permutation figures here are ours alone: ASP published none on these
matrices. ``scripts/compare_asp_permutation.py`` compares with ASP's published
result on ASP's own matrix.

    python scripts/bench_masks.py                  # full run (~3 minutes on 2 cores)
    python scripts/bench_masks.py --seeds 4 --perm-time 1 --big 1024   # quick look
    python scripts/bench_masks.py --threads 1      # one thread: faster on a loaded machine

Prints Markdown tables and, with ``--csv PATH``, writes one CSV row per figure.
Timings are wall-clock medians over ``--repeats`` runs in this one process; the
load average is printed because other jobs share the machine.
"""
import argparse
import csv
import os
import statistics
import sys
import time

import torch

from sparse24 import mask_nm
from sparse24.tools.bench import cpu_name
from sparse24.masks import kept_magnitude_fraction, search_permutation, sparsegpt_prune

def machine() -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"load average {load}")


def upper_bound(w: torch.Tensor) -> float:
    """Kept fraction of the best unstructured 50% mask (top half of |w|): no N:M mask keeps more."""
    a = w.abs().flatten().double()
    return float(a.topk(a.numel() // 2).values.sum() / a.sum())


def kept_nm(w: torch.Tensor) -> float:
    return kept_magnitude_fraction(w, mask_nm(w, 2, 4))


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def bench_permutation(seeds: int, time_limit: float, rows):
    print(f"\n## Permutation search, random normal 64x128 fp32, 2:4, {time_limit:g} s per matrix\n")
    print("| seed | 2:4 kept | permuted kept | upper bound | gain | gap closed | time budget (s) |")
    print("|---|---|---|---|---|---|---|")
    gains, closed = [], []
    for seed in range(seeds):
        w = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))
        perm = search_permutation(w, time_limit=time_limit, seed=seed, progress=False)
        k0, k1, up = kept_nm(w), kept_nm(w[:, perm]), upper_bound(w)
        gains.append(100 * (k1 / k0 - 1))
        closed.append(100 * (k1 - k0) / (up - k0))
        print(f"| {seed} | {k0:.4f} | {k1:.4f} | {up:.4f} | +{gains[-1]:.2f}% | {closed[-1]:.1f}% | {time_limit:g} s |")
        rows.append({"figure": "perm_64x128", "seed": seed, "kept_base": k0, "kept_perm": k1, "upper": up,
                     "gain_pct": gains[-1], "gap_closed_pct": closed[-1], "time_limit_s": time_limit})
    g, c = statistics.mean(gains), statistics.mean(closed)
    print(f"\nmean kept-magnitude gain +{g:.2f}%, mean gap to the unstructured upper bound closed {c:.1f}%; "
          f"min gain +{min(gains):.2f}% (no published figure on these matrices: for ASP's, see "
          f"scripts/compare_asp_permutation.py)")
    rows.append({"figure": "perm_64x128_mean", "gain_pct": g, "gap_closed_pct": c, "time_limit_s": time_limit})


def bench_big(size: int, repeats: int, perm_time: float, sparsegpt: bool, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(size, size, generator=g)
    act_norm = torch.rand(size, generator=g) * 2 + 0.1
    print(f"\n## {size}x{size} fp32 weight, 2:4 (upper bound, unstructured top-50%: {upper_bound(w):.4f})\n")
    print("| method | time (s) | target (s) | kept fraction |")
    print("|---|---|---|---|")
    targets = {"magnitude": 0.2, "2d_optimal": 5.0, "permutation": 60.0} if size == 4096 else {}

    def report(name, seconds, mask_w, mask, note=""):
        kept = kept_magnitude_fraction(mask_w, mask)
        tgt = targets.get(name)
        print(f"| {name}{note} | {seconds:.3f} | {'<= %g' % tgt if tgt else '-'} | {kept:.4f} |")
        rows.append({"figure": f"big_{size}", "method": name, "seconds": seconds, "target_s": tgt or "",
                     "kept": kept})

    for method, kw in (("magnitude", {}), ("2d_greedy", {}), ("2d_optimal", {}), ("wanda", {"act_norm": act_norm})):
        mask, sec = timed(lambda: mask_nm(w, 2, 4, method=method, **kw), repeats)
        report(method, sec, w, mask, " (kept of |w|)" if method == "wanda" else "")
    if sparsegpt:
        # correlated inputs: low-rank (size/8) covariance plus a 10% isotropic part
        b = torch.randn(size, size // 8, generator=g)
        hessian = b @ b.T + 0.1 * (size // 8) * torch.eye(size)
        (new_w, mask), sec = timed(lambda: sparsegpt_prune(w, hessian, 2, 4), 1)
        report("sparsegpt", sec, w, mask, " (synthetic correlated H)")
    perm, sec = timed(lambda: search_permutation(w, time_limit=perm_time, seed=0, progress=True), 1)
    wp = w[:, perm]
    report("permutation", sec, wp, mask_nm(wp, 2, 4), f" + magnitude (time_limit={perm_time:g})")
    print(f"\npermutation gain on {size}x{size}: +{100 * (kept_nm(wp) / kept_nm(w) - 1):.3f}% kept magnitude")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 seeds or repeats left a median or mean of nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=positive_int, default=10, help="random 64x128 matrices (default 10)")
    ap.add_argument("--perm-time", type=float, default=3.0, help="search seconds per 64x128 matrix")
    ap.add_argument("--big", type=int, default=4096, help="side of the square weight for the speed table")
    ap.add_argument("--big-perm-time", type=float, default=60.0, help="time_limit of the big permutation search")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--no-sparsegpt", action="store_true", help="skip SparseGPT on the big weight")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--csv", help="write the figures to this CSV file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    rows: list[dict] = []
    bench_permutation(args.seeds, args.perm_time, rows)
    bench_big(args.big, args.repeats, args.big_perm_time, not args.no_sparsegpt, rows)
    print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    sys.exit(main())

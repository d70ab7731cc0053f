"""Memory and time of one learnable 2:4 mask on a large layer (CPU).

Builds a ``LearnableMask`` for a ``rows x cols`` weight, then one hard
straight-through draw + backward, and reports the process's peak resident
memory after each step (``ru_maxrss``, so each figure is a new peak).

    python scripts/bench_learned_mask.py [--rows 4096 --cols 4096 --threads 1]
"""
import argparse
import os
import resource
import time

import torch

from sparse24.tools.bench import cpu_name
from sparse24.masks import LearnableMask


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    R, C = args.rows, args.cols
    base = peak_mib()
    lm = LearnableMask((R, C))
    init = peak_mib()
    w = torch.randn(R, C)
    weight = peak_mib()
    t0 = time.perf_counter()
    (w * lm.sample(0.5, hard=True, generator=torch.Generator().manual_seed(0))).sum().backward()
    seconds = time.perf_counter() - t0
    step = peak_mib()
    logits = lm.logits.numel() * lm.logits.element_size() / 2**20
    print(f"{R}x{C} fp32 weight, {R * C // 4} groups; {cpu_name()}, {args.threads} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"logits: {lm.logits.numel()} = 6 per group, {logits:.1f} MiB; peak memory +{init - base:.0f} MiB")
    print(f"weight: +{weight - init:.0f} MiB")
    print(f"one hard draw + backward: +{step - weight:.0f} MiB more at the peak ({(step - weight) / logits:.1f}x the "
          f"logits, their gradient included), {seconds:.2f} s")


if __name__ == "__main__":
    main()

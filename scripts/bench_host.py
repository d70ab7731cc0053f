"""Host (CPU) time per call of a compressed ``Sparse24Linear`` on the kernel
path, with the kernel launch itself replaced by a no-op, against
``nn.Linear.forward`` of the same shape, side by side in one run.

Decode-sized layers run for 7-10 us on an H200 (4096x4096 fp16 GEMV), so the
Python around a launch decides eager decode speed. No GPU is needed to measure
that Python: the layer takes the same steps on CPU tensors as on CUDA ones
(plan lookup, output and split-K buffer allocation, argument tuple, alignment
checks; the layer in the decode layout it holds on CUDA), up to the launch
call, which is swapped for a no-op here. nn.Linear
runs where its compute is nil: the same 4096x4096 fp16 layer on an empty
batch (M = 0: module call, dispatch, shape checks, output allocation, no
arithmetic), and a 16x16 layer at M = 1 (a real GEMV of 256 multiply-adds).

    python scripts/bench_host.py [--repeats 15] [--calls 2000]

Prints the medians (us per call) and the ratio sparse / nn.Linear.
"""
import argparse
import statistics
import time

import torch
from torch import nn

import sparse24
from sparse24.tools.bench import cpu_name
from sparse24.ops.linear24 import launch, op


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    N, K = a.n, a.k

    # The layout a compressed fp16 layer holds on CUDA (the decode kernel's), asked for on CPU.
    sparse = sparse24.Sparse24Linear.from_linear(nn.Linear(K, N, dtype=torch.float16), mode="compressed")
    sparse.to_layout("decode")
    x = torch.randn(1, K, dtype=torch.float16)
    # The CUDA decision, taken on CPU tensors: "auto" picks the kernel at M <= 16 on CUDA.
    op._auto_backend = lambda *args: "triton"
    launches = []
    launch._Plan.launch = lambda plan, grid, args, aligned: launches.append(grid)  # the no-op launch
    dense = nn.Linear(K, N, dtype=torch.float16)
    x_empty = torch.empty(0, K, dtype=torch.float16)
    dense_small = nn.Linear(16, 16)
    x_small = torch.randn(1, 16)

    cases = {
        "Sparse24Linear (compressed, kernel path, launch no-op)": lambda: sparse(x),
        f"nn.Linear {N}x{K} fp16, empty batch (M = 0)": lambda: dense(x_empty),
        "nn.Linear 16x16 fp32 on CPU": lambda: dense_small(x_small),
    }
    with torch.no_grad():
        for fn in cases.values():  # warm up: the plan is made on the first call
            fn()
        plan = next(iter(launch._PLANS.values()))
        times = {name: [] for name in cases}
        for _ in range(a.repeats):  # interleaved, so load changes hit every case alike
            for name, fn in cases.items():
                times[name].append(_per_call_us(fn, a.calls))
    assert launches and all(g[1] == plan.split_k for g in launches)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"# {cpu_name()}, torch {torch.__version__}, 1 thread, load {open('/proc/loadavg').read().split()[0]}; "
          f"M = 1, {N}x{K} fp16 weight, config {plan.config} (split-K {plan.split_k}); "
          f"medians of {a.repeats} x {a.calls} calls, interleaved")
    for name, us in med.items():
        print(f"{name:58s} {us:8.2f} us/call")
    s = med["Sparse24Linear (compressed, kernel path, launch no-op)"]
    for name in list(cases)[1:]:
        print(f"ratio sparse / {name}: {s / med[name]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

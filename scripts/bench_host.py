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

    python scripts/bench_host.py [--repeats 15] [--calls 2000] [--counts-only]

Prints the medians (us per call) and the ratio sparse / nn.Linear. Then, for
every (weight, activation) pair a layer holds in the decode layout on CUDA
(and fp32 activations) at the listed shapes and M = 1, 4, 16, the device work
of one call with the launch stubbed: kernels per call (stubbed launches plus
every aten op that would run a device kernel: anything but allocation and
views) and aten ops per call (a TorchDispatchMode counter), ending with
``kernels per call at M<=16: max N``.
"""
import argparse
import contextlib
import dataclasses
import statistics
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sparse24
from sparse24.decode_format import DecodePacked
from sparse24.tools.bench import cpu_name
from sparse24.ops.linear24 import launch, op


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


# aten ops that run no device kernel: allocation, views and metadata
_NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "detach",
              "alias", "unsqueeze", "squeeze", "select", "slice", "permute", "_reshape_alias", "reshape"}


class _AtenCounter(TorchDispatchMode):
    """Records the name of every aten op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stubbed_launch():
    """Inside: kernel launches are recorded ``(plan, grid)``, not run, and ``backend="auto"``
    takes the kernel as it does on CUDA at M <= 16 (CPU tensors stand in for CUDA ones)."""
    launches = []
    saved = launch._Plan.launch, op._auto_backend
    launch._Plan.launch = lambda plan, grid, args, aligned: launches.append((plan, grid))
    op._auto_backend = lambda *args: "triton"
    try:
        yield launches
    finally:
        launch._Plan.launch, op._auto_backend = saved


def device_work(call, launches: list) -> tuple[int, list[str]]:
    """``(kernels, aten ops)`` of one ``call()`` inside :func:`stubbed_launch`: kernels are
    the launches plus every aten op that would run a device kernel (anything but
    allocation, views and metadata); the first call (which makes the plan) is not counted."""
    call()
    launches.clear()
    with _AtenCounter() as ops:
        call()
    return len(launches) + sum(name not in _NO_KERNEL for name in ops.ops), ops.ops


def count_device_work(shapes=None, ms=(1, 4, 16)) -> int:
    """Print kernels and aten ops per call of the decode path (module-level forward,
    as Sparse24Linear calls it; the launch stubbed, untuned configs as on an H200)
    per pair, shape (default: the listed ones) and M; return the most kernels any call launched."""
    from sparse24.ops.config_space import DECODE_PAIRS, LISTED_SHAPES
    from sparse24.ops.linear24 import forward
    pairs = [(name, torch.bfloat16 if name.endswith("bf16") else torch.float16) for name in DECODE_PAIRS]
    pairs.append(("fp16", torch.float32))  # fp32 activations: one kernel too, off the tensor cores (docs)
    worst, seen = 0, set()
    print(f"# device work per decode call, launch stubbed: kernels (launches + aten ops that run a device kernel) "
          f"/ aten ops; M = {', '.join(map(str, ms))}")
    print(f"{'pair':18s} {'shape (out x in)':>16s} {'config (untuned)':28s} " + " ".join(f"M={m:<5d}" for m in ms))
    with stubbed_launch() as launches, torch.no_grad():
        for pair, act in pairs:
            for N, K in shapes or LISTED_SHAPES:
                w = DecodePacked.empty(N, K, act if pair == "bf16" else torch.float16, pair.startswith("int8"))
                bias = torch.empty(N, dtype=act)
                cells = []
                for m in ms:
                    x = torch.empty(m, K, dtype=act)
                    kernels, ops = device_work(lambda: forward(x, w.values, w.meta, w.scale, bias, w.dtype, N),
                                               launches)
                    worst = max(worst, kernels)
                    cells.append(f"{kernels} / {len(ops)}")
                    seen.update(ops)
                plan = launches[0][0]
                cfg = dataclasses.replace(plan.config, split_k=plan.split_k)
                print(f"{pair + '/' + str(act)[6:]:18s} {f'{N}x{K}':>16s} {_cfg_name(cfg):28s} " + "  ".join(cells))
    print(f"aten ops seen in these calls: {', '.join(sorted(seen))}")
    print(f"kernels per call at M<=16: max {worst}")
    return worst


def _cfg_name(c) -> str:
    return f"BN{c.block_n}_BK{c.block_k}_W{c.num_warps}_S{c.num_stages}_SK{c.split_k}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--counts-only", action="store_true", help="only the kernels / aten ops per call")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.counts_only:
        count_device_work()
        return 0
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
    launch._PLANS.clear()
    count_device_work()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
views) and aten ops per call (sparse24.tools.dispatch_count), ending with
``kernels per call at M<=16: max N``.

``--prefill``: the M > 16 route of a decode-layout layer (what it holds on
CUDA), taken as on CUDA (the backend decision sees a CUDA tensor, the launch is
a no-op): per M in 64, 512, 4096, the aten ops one call runs, the bytes they
allocate against the output's, and whether the weight was converted or
decompressed; and the layer's memory against its dense fp16 weight.

    python scripts/bench_host.py --prefill

``--compile``: what the first call of a decode-layout layer costs once per
machine (Triton's cache keeps it after): for each pair, the config the layer
uses untuned on an H200 at ``--n`` x ``--k``, 16 rows of x (and 32, the
17-64-row route of INT8 / INT4 weights with 16-bit x), compiled for sm_90 into
an empty Triton cache, as the JIT would on the GPU: seconds, and the memory
operations of its Triton IR (Triton's coalescing pass grows with them), ending
with ``max first-call compile (sm_90, empty Triton cache): N s``.

    python scripts/bench_host.py --compile
"""
import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import sparse24
from sparse24.decode_format import DecodePacked
from sparse24.tools.bench import cpu_name
from sparse24.ops import config_store
from sparse24.ops.linear24 import launch, op
from sparse24.tools.dispatch_count import count_dispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # --compile uses kernel_static_check's compile


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


class _AsCuda:
    """What the backend decision reads of x (``op._auto_backend``), as a CUDA tensor would show it."""
    is_cuda = True

    def __init__(self, x):
        self.dtype, self.shape, self.device, self.dim = x.dtype, x.shape, torch.device("cuda"), x.dim


def as_cuda_device_info(real):
    """``config_store.device_info`` answering for CUDA devices (an :class:`_AsCuda` x's) as a GPU
    without a tuned file would, sm_90 with 132 SMs, and for the others as ``real`` does."""
    gpu = config_store.DeviceInfo("No Tuned GPU", (9, 0))
    return lambda device=None: gpu if device is not None and torch.device(device).type == "cuda" else real(device)


def prefill_figures(N: int, K: int, ms=(64, 512, 4096), quantize=None) -> list[dict]:
    """Per M: aten ops and allocated bytes of one call of a decode-layout ``Sparse24Linear``
    (N x K, fp16 activations) on its M > 16 CUDA route, with the launch a no-op, and the bytes of
    the split-K workspace its plan made once (kept for the process)."""
    from sparse24.decode_format import DecodePacked
    from sparse24.format import Sparse24Tensor

    layer = sparse24.Sparse24Linear.from_linear(nn.Linear(K, N, dtype=torch.float16), mode="compressed",
                                                quantize=quantize)
    layer.to_layout("decode")
    real_auto = op._auto_backend
    real_launch, real_unpack, real_timings = launch._Plan.launch, launch._launch_unpack, op.measured_timings
    real_info = config_store.device_info
    conversions = []
    watched = [(DecodePacked, "to_sparse24"), (DecodePacked, "to_dense"), (Sparse24Tensor, "to_dense")]
    originals = {(cls, name): getattr(cls, name) for cls, name in watched}
    rows = []
    try:
        op._auto_backend = lambda x, *rest: real_auto(_AsCuda(x), *rest)
        op.measured_timings = lambda *args: {}   # no GPU measured here: the route's unmeasured rule
        config_store.device_info = as_cuda_device_info(real_info)
        launch._Plan.launch = lambda plan, grid, args, aligned: None
        launch._launch_unpack = lambda *args: None
        for (cls, name), fn in originals.items():
            setattr(cls, name, lambda self, *a, _n=f"{cls.__name__}.{name}", _f=fn, **k:
                    conversions.append(_n) or _f(self, *a, **k))
        with torch.no_grad():
            for M in ms:
                x = torch.randn(M, K, dtype=torch.float16)
                launch._PLANS.clear()
                layer(x)  # the plan is made on the first call, with its split-K workspace (kept)
                workspace = sum(t.numel() * t.element_size() for plan in launch._PLANS.values()
                                for t in plan.extra if t.numel() > 1) + \
                    sum(t.numel() for t in launch._DENSE_SCRATCH.values())   # the unpack route's dense scratch
                conversions.clear()
                y, count = count_dispatch(layer, x)
                rows.append(dict(M=M, backend=real_auto(_AsCuda(x), layer.values, layer.scale, N, layer.group_size or 0),
                                 aten_ops=len(count.ops), ops=",".join(count.ops),
                                 bytes_allocated=count.bytes_allocated, output_bytes=y.numel() * y.element_size(),
                                 conversions=len(conversions), workspace_bytes=workspace))
    finally:
        op._auto_backend, op.measured_timings, config_store.device_info = real_auto, real_timings, real_info
        launch._Plan.launch, launch._launch_unpack = real_launch, real_unpack
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        op._AUTO.clear()
        launch._PLANS.clear()
    held = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()) if t is not None)
    for r in rows:
        r["layer_bytes_over_dense_fp16"] = held / (N * K * 2)
    return rows


def prefill_main(a) -> int:
    print(f"# {cpu_name()}, torch {torch.__version__}; Sparse24Linear {a.n}x{a.k} in the decode layout, fp16 x, "
          f"the M > 16 route as on CUDA (backend decision on a CUDA-looking x), launch a no-op")
    print(f"{'weights':8} {'M':>5} {'route':>8} {'aten ops':>8} {'allocated B':>12} {'output B':>10} "
          f"{'conversions':>11} {'layer/dense fp16':>16} {'workspace B':>11}  ops")
    worst = {}
    for quantize in (None, "int8", "int4"):
        for r in prefill_figures(a.n, a.k, quantize=quantize):
            name = quantize or "fp16"
            print(f"{name:8} {r['M']:>5} {r['backend']:>8} {r['aten_ops']:>8} {r['bytes_allocated']:>12} "
                  f"{r['output_bytes']:>10} {r['conversions']:>11} {r['layer_bytes_over_dense_fp16']:>16.3f} "
                  f"{r['workspace_bytes']:>11}  {r['ops']}")
            worst["ops"] = max(worst.get("ops", 0), r["aten_ops"])
            worst["extra"] = max(worst.get("extra", 0), r["bytes_allocated"] - r["output_bytes"])
            worst["conv"] = max(worst.get("conv", 0), r["conversions"])
            worst["mem"] = max(worst.get("mem", 0), r["layer_bytes_over_dense_fp16"])
            worst["ws"] = max(worst.get("ws", 0), r["workspace_bytes"])
    print(f"prefill per call at M>16: max aten ops {worst['ops']}, max bytes allocated beyond the output "
          f"{worst['extra']}, whole-weight conversions {worst['conv']}; layer memory <= "
          f"{worst['mem']:.3f}x dense fp16; workspace (split-K, dense scratch) kept for the process "
          f"<= {worst['ws'] / 2**20:.1f} MiB")
    return 0


# aten ops that run no device kernel: allocation, views and metadata
_NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "detach",
              "alias", "unsqueeze", "squeeze", "select", "slice", "permute", "_reshape_alias", "reshape"}


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
    _, count = count_dispatch(call)
    return len(launches) + sum(name not in _NO_KERNEL for name in count.ops), count.ops


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


def compile_figures(N: int, K: int) -> list[dict]:
    """Per pair and rows of x (16; 32 where the sparse tensor-core route takes 17-64 rows): the
    untuned H200 config of an (N, K) decode-layout layer compiled for sm_90 into an empty Triton
    cache: ``dict(dtype, rows, config, memory_ops, seconds)``."""
    import os
    import re
    import tempfile
    from unittest import mock

    from sparse24.ops.config_space import DTYPE_KEYS
    from kernel_static_check import compile_decode, default_config

    out = []
    for dt in (k for k in DTYPE_KEYS if not k.endswith("float32")):
        for rows in (16, 32) if dt.startswith("int") else (16,):
            cfg, _ = default_config(dt, N, K, rows=rows)
            # an empty cache: the compile is not served from one (the caller's setting comes back after)
            with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TRITON_CACHE_DIR=cache):
                t0 = time.perf_counter()
                ck = compile_decode(dt, cfg, 90, N, K, rows)
                secs = time.perf_counter() - t0
            ops = len(re.findall(r"\btt\.(?:load|store|atomic_\w+)\b", ck.asm["ttir"]))
            out.append(dict(dtype=dt, rows=rows, config=cfg, memory_ops=ops, seconds=secs))
    return out


def compile_main(a) -> int:
    import triton
    rows = compile_figures(a.n, a.k)
    print(f"# first call of a decode-layout {a.n}x{a.k} layer: its untuned H200 config compiled for sm_90 into an "
          f"empty Triton cache (triton {triton.__version__}, {cpu_name()}, load "
          f"{open('/proc/loadavg').read().split()[0]}); once per machine, Triton's cache serves later processes")
    print(f"{'pair':14s} {'rows':>4s} {'config':30s} {'memory ops':>10s} {'compile s':>9s}")
    for r in rows:
        name = f"BM{r['config'].block_m}_" + _cfg_name(r["config"])
        print(f"{r['dtype']:14s} {r['rows']:>4d} {name:30s} {r['memory_ops']:>10d} "
              f"{r['seconds']:>9.1f}")
    worst = max(rows, key=lambda r: r["seconds"])
    print(f"max first-call compile (sm_90, empty Triton cache): {worst['seconds']:.1f} s "
          f"({worst['dtype']}, {worst['rows']} rows)")
    return 0


def _cfg_name(c) -> str:
    return f"BN{c.block_n}_BK{c.block_k}_W{c.num_warps}_S{c.num_stages}_SK{c.split_k}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--prefill", action="store_true", help="aten ops and bytes per call of the M > 16 route")
    ap.add_argument("--counts-only", action="store_true", help="only the kernels / aten ops per call")
    ap.add_argument("--compile", action="store_true", help="first-call compile time of each pair's default")
    a = ap.parse_args(argv)
    if a.prefill:
        return prefill_main(a)
    if a.compile:
        return compile_main(a)
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

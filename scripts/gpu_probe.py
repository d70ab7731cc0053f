"""Second look after the first H200 run (results/NVIDIA_H200): where an eager call's host time
goes, and the prefill paths side by side.

1. host: a Sparse24Linear's eager call at M = 1 cost ~80 us of wall time against nn.Linear's
   ~26 us, with a ~22 us kernel: the time per call the host spends enqueueing (no sync inside
   the loop) for nn.Linear, the module, ``sparse24.linear``, ``launch.run``; whether the kept
   handle is in use; and a cProfile of the module's calls.
2. prefill: the prefill kernel measured 0.40x of dense at M = 4096: per shape and M, dense
   F.linear, the prefill kernel, the unpack kernel + cuBLAS (``launch.unpack_dense``), the unpack
   kernel alone, torch's cuSPARSELt and Triton's own dense GEMM with the prefill kernel's untuned
   tile (added after run 3: a slow Triton GEMM or a slow decode?), medians of do_bench; unpack
   checked bit-exact first. ``prefill_us`` runs the untuned config named in ``prefill_config``,
   the tile ``triton_dense_us`` runs; where this GPU's file has a tuned prefill entry for the
   point (exact or nearest M: what a layer's ``run_prefill`` takes), ``tuned_us`` times it beside
   them, named in ``tuned_config`` (run 4's ``prefill_us`` ran that entry under the untuned
   label: fixed 2026-12-05). fp16, INT8 and INT4 (group 128) weights; cuSPARSELt for fp16 only,
   with its kernels' own GPU time per call from torch.profiler beside do_bench's (run 3 timed
   it at ~1 ms a call: if that is host time, a CUDA graph would remove it). ``sp_us``: the sparse
   tensor-core kernel, to 64 rows the route's own config, past 64 rows (where no route takes it)
   its untuned 32-row config without split-K, 32 rows per program re-reading each weight tile
   from L2: is there a sparse route past 64 rows that beats dense?
3. host (added after run 3): the kept handle's launch alone with pointers as ints (what the plan
   passes) and as tensors (before).

Writes ``probe_host.txt`` and ``probe_prefill.csv`` to ``--out``; prints both.

    python scripts/gpu_probe.py --out results/NVIDIA_H200/
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_user_view import _sync  # noqa: E402  (the same device sync as the other GPU scripts)


def _host_us(fn, dev, calls: int = 300) -> float:
    """Host time per call: the loop's wall time without a sync inside (the GPU queue absorbs the
    kernels while the host is slower than them), after a synchronized warm-up."""
    for _ in range(5):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    _sync(dev)
    return 1e6 * host


def host(out: Path, dev, d: int = 4096, ff: int = 11008, calls: int = 300) -> None:
    torch.manual_seed(0)
    dense = nn.Linear(d, ff, bias=False, dtype=torch.float16, device=dev)
    mod = sparse24.Sparse24Linear.from_linear(nn.Linear(d, ff, bias=False, dtype=torch.float16, device=dev),
                                              mode="compressed")
    w = dense.weight.detach()
    p = pack_decode(sparse24.compress(w))
    x = torch.randn(1, d, dtype=torch.float16, device=dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    lines = [f"# {name}, torch {torch.__version__}, M = 1, {ff}x{d} fp16"]
    with torch.no_grad():
        for name, fn in (("nn.Linear", lambda: dense(x)), ("Sparse24Linear", lambda: mod(x)),
                         ("sparse24.linear", lambda: sparse24.linear(x, p)),
                         ("launch.run", lambda: launch.run(x, p.values, p.meta, None, None, ff)),
                         ("torch.empty (floor)", lambda: torch.empty(1, ff, dtype=torch.float16, device=dev))):
            lines.append(f"host us/call {name:22s} {_host_us(fn, dev, calls):8.2f}")
        plans = list(launch._PLANS.values())
        runtime = launch._triton_runtime_knobs()
        lines.append(f"plans {len(plans)}; kept handles {[pl.compiled is not None for pl in plans]}; "
                     f"fast launch ok {dev.type == 'cuda' and launch._fast_launch_ok(torch.cuda.current_device())}; hooks "
                     f"{getattr(runtime, 'launch_enter_hook', '?')}, {getattr(runtime, 'launch_exit_hook', '?')}; "
                     f"module backend {getattr(mod, 'backend', '?')}")
        try:
            lines += _pointer_args(plans, (x, p.values, p.meta), dev, calls)
        except Exception as e:  # noqa: BLE001 (a diagnostic: the rest of the probe goes on)
            lines.append(f"kept handle timing failed: {type(e).__name__}: {str(e)[:200]}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            mod(x)
        prof.disable()
        _sync(dev)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text, flush=True)
    (out / "probe_host.txt").write_text(text)


def _pointer_args(plans, tensors, dev, calls) -> list[str]:
    """The kept handle's launch alone, host us per call, with pointers passed as ints (what the
    plan passes) and as the tensors themselves (before: Triton's launcher then
    calls data_ptr() and cuPointerGetAttribute per pointer)."""
    plan = next((pl for pl in plans if pl.compiled is not None), None)
    if plan is None:
        return ["kept handle: none (no pointer-argument timing)"]
    real, seen = plan.compiled, []

    class _Catch:   # records the arguments of one launch, then launches as the real handle
        function, packed_metadata = real.function, real.packed_metadata

        def run(self, *args):
            seen.append(args)
            return real.run(*args)
    plan.compiled = _Catch()
    try:
        launch.run(tensors[0], tensors[1], tensors[2], None, None, plan.N)
    finally:
        plan.compiled = real
    if not seen:
        return ["kept handle: not used by launch.run (no pointer-argument timing)"]
    out = torch.empty(tensors[0].shape[0], plan.N, dtype=tensors[0].dtype, device=dev)
    by_ptr = {t.data_ptr(): t for t in (*tensors, *plan.extra)}
    head, tail = seen[0][:9], seen[0][9:]   # grid (3), stream, function, metadata, launch metadata, 2 hooks

    def is_ptr(a):   # device addresses; M, N, K, strides and constexprs are far smaller
        return isinstance(a, int) and not isinstance(a, bool) and a >= 2**32
    # the launch's own output is gone: both forms write ``out``
    tail = tuple(out.data_ptr() if is_ptr(a) and a not in by_ptr else a for a in tail)
    by_ptr[out.data_ptr()] = out
    ints, as_tensors = head + tail, head + tuple(by_ptr[a] if is_ptr(a) else a for a in tail)
    return [f"host us/call kept handle, pointers as ints    {_host_us(lambda: real.run(*ints), dev, calls):8.2f}",
            f"host us/call kept handle, pointers as tensors {_host_us(lambda: real.run(*as_tensors), dev, calls):8.2f}"]


def _device_us(fn, dev, calls: int = 5) -> float:
    """GPU time per call of ``fn``'s kernels (torch.profiler's CUDA events), host time left out;
    nan off CUDA or where the profiler fails."""
    if dev.type != "cuda":
        return float("nan")
    try:
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names = sorted({e.name[:60] for e in kernels})
        print(f"    kernels: {names[:4]}", flush=True)
        return round(sum(e.time_range.elapsed_us() for e in kernels) / calls, 2)
    except Exception as e:  # noqa: BLE001 (a diagnostic)
        print(f"  profiler failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def _dense_mm(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """``out = x @ w^T`` (x (M, K), w (N, K), contiguous 16-bit): Triton's own dense GEMM with the
    prefill kernel's tile, the baseline that tells a slow decode from a slow Triton GEMM."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm[:, None] < M) & (k0 + rk < K)[None, :],
                     other=0.0)
        wt = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=(rn[None, :] < N) & (k0 + rk < K)[:, None],
                     other=0.0)
        acc = tl.dot(xt, wt, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _triton_dense(x, w, cfg, kernels):
    """Time-able call of :func:`_dense_mm` with ``cfg``'s tile, warps and stages."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    if x.is_cuda:
        kernels["cuda"][grid](x, w, out, M, N, K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True)
    else:
        kernels["cpu"][grid](x, w, out, M, N, K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    return out


def _dense_kernels() -> dict:
    """:func:`_dense_mm` compiled (``"cuda"``) and in Triton's interpreter (``"cpu"``, --smoke)."""
    from sparse24.kernels.interpreter import InterpretedKernel
    return {"cuda": triton.jit(_dense_mm), "cpu": InterpretedKernel(_dense_mm)}


def _bench(fn, dev) -> float:
    """Median microseconds of ``fn`` (do_bench); on CPU (--smoke) one call's wall time, the code
    path only. A path that fails is reported and gives NaN, so a sweep goes on."""
    from triton.testing import do_bench
    try:
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return round(1e6 * (time.perf_counter() - t0), 2)
        return round(do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3, 2)
    except Exception as e:  # noqa: BLE001
        print(f"  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


PREFILL_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))


def _weight_key(weight: str) -> str:
    """The dtype key of a probe weight kind (fp16 x): ``"int8"`` -> ``"int8-float16"``."""
    from sparse24.ops.config_space import dtype_key
    return dtype_key(torch.float16, weight == "int8", weight == "int4")


def _shapes_of(weight: str, shapes):
    return shapes[:1] if weight == "int4" else shapes   # (INT4: one shape, for the step's time)


def prefill_configs(weight: str, N: int, K: int, M: int) -> tuple:
    """The prefill probe's two fixed configs at one point: the prefill kernel's untuned one (what
    ``run_prefill`` takes without a tuned entry; Triton's own GEMM runs its tile) and, past the
    route's rows, the sparse tensor-core kernel's 32-row one, one program per (32 rows, weight
    tile) (None to ``SP_MAX_M`` rows: the route's own config)."""
    from dataclasses import replace

    from sparse24.ops.config_space import SP_MAX_M, decode_default
    from sparse24.ops.linear24.prefill import prefill_config, prefill_pair
    key = _weight_key(weight)
    cfg = prefill_config(M, N, K, pair=prefill_pair(key))
    return cfg, None if M <= SP_MAX_M else replace(decode_default(N, K, key, rows=32), split_k=1)


def config_name(cfg) -> str:
    """A config as the CSV's ``prefill_config`` / ``tuned_config`` columns name it."""
    return f"BM{cfg.block_m}_BN{cfg.block_n}_BK{cfg.block_k}_W{cfg.num_warps}_S{cfg.num_stages}_SK{cfg.split_k}"


def _tuned_of(choice):
    """The config of a config-store choice that comes from a tuned file (exact or nearest M, or the
    GPU family's entry); None for the built-in one (then nothing tuned to time)."""
    return None if choice.kind == "builtin" else choice.config


def tuned_prefill_config(weight: str, N: int, K: int, M: int, dev):
    """This GPU's tuned prefill config for the point, as ``run_prefill`` without a config finds it
    (``launch._prefill_default``: exact or nearest M), or None where the file has none (CPU: none)."""
    from sparse24.ops.config_store import get_choice
    return _tuned_of(get_choice(M, N, K, _weight_key(weight), dev, "decode", "prefill"))


def prefill_jobs(ms, weights=("fp16",), shapes=PREFILL_SHAPES, gpu: str = "NVIDIA H200",
                 capability=(9, 0), num_sms: int = 132) -> list:
    """The kernel variants of ours the prefill probe launches on ``gpu``, ``(M, N, K, dtype key,
    config)`` (what scripts/triton_prebuild.py compiles ahead), each once per point in the order
    :func:`prefill` times them: the untuned prefill config (``prefill_us``), the GPU's tuned prefill
    entry where it has one and it differs (``tuned_us``, found by the config store's lookup as
    :func:`tuned_prefill_config` finds it on that GPU), and the sparse tensor-core kernel's
    (:func:`prefill_configs`, to ``SP_MAX_M`` rows the route's config for the GPU)."""
    from sparse24.ops.config_store import lookup
    jobs = []
    for weight in weights:
        key = _weight_key(weight)
        for N, K in _shapes_of(weight, shapes):
            for M in ms:
                cfg, sp_cfg = prefill_configs(weight, N, K, M)
                tuned = _tuned_of(lookup(M, N, K, key, gpu, capability, num_sms, "decode", "prefill"))
                sp = sp_cfg or lookup(M, N, K, key, gpu, capability, num_sms, "decode").config
                point = [cfg] + ([tuned] if tuned is not None and tuned != cfg else []) + [sp]
                jobs += [(M, N, K, key, c) for c in point]
    return jobs


def prefill(out: Path, dev, shapes=PREFILL_SHAPES, ms=(32, 64, 256, 1024, 4096),
            weights=("fp16", "int8", "int4")) -> None:
    torch.manual_seed(0)
    rows = []
    f = open(out / "probe_prefill.csv", "w", newline="")
    wr = csv.writer(f)
    wr.writerow(["weight", "N", "K", "M", "dense_us", "prefill_us", "unpack_mm_us", "unpack_us", "cusparselt_us",
                 "triton_dense_us", "prefill_config", "cusparselt_kernel_us", "sp_us", "tuned_us", "tuned_config"])
    kernels = _dense_kernels()

    def bench(fn):
        return _bench(fn, dev)

    for weight in weights:
        for N, K in _shapes_of(weight, shapes):
            w = torch.randn(N, K, device=dev, dtype=torch.float16)
            c = sparse24.compress(w)
            if weight == "int8":
                c = sparse24.quantize_values(sparse24.compress(w.float()), "int8")
            elif weight == "int4":
                c = sparse24.compress(w.float(), quantize="int4", group_size=128)
            p = pack_decode(c)
            gs = p.group_size or 0
            wd = c.to_dense().to(torch.float16)     # the weight the kernels compute with (INT4: rounded once)

            def unpack(dtype=torch.float16, p=p, N=N, K=K, gs=gs):
                return launch.unpack_dense(p.values, p.meta, p.scale, (N, K), dtype, zero=p.zero, group_size=gs)
            u = unpack()
            exact = torch.equal(u, wd)
            print(f"{weight} {N}x{K}: unpack bit-exact {exact}", flush=True)
            ws = None
            if weight == "fp16":   # (the other kinds' dense weights would time the same product)
                try:
                    ws = torch.sparse.to_sparse_semi_structured(wd)
                except Exception as e:  # noqa: BLE001
                    print(f"  cuSPARSELt: {type(e).__name__}: {str(e)[:200]}", flush=True)
            for M in ms:
                x = torch.randn(M, K, device=dev, dtype=torch.float16)
                cfg, sp_cfg = prefill_configs(weight, N, K, M)
                tuned = tuned_prefill_config(weight, N, K, M, dev)
                if weight == "fp16":
                    try:   # (a deep config's dense tiles can exceed shared memory: reported, the sweep goes on)
                        y_t = _triton_dense(x, wd, cfg, kernels)
                        err = (y_t.float() - F.linear(x, wd).float()).abs().max().item()
                        print(f"  M {M}: triton dense max |diff| vs F.linear {err:.3g}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"  M {M}: triton dense failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                try:   # the sparse tensor-core kernel's result, as timed below (F.linear: fp32 accumulation too)
                    ref = F.linear(x.float(), wd.float())
                    y_sp = launch.run(x, p.values, p.meta, p.scale, None, N, sp_cfg, p.zero, gs).float()
                    print(f"  M {M}: sparse tensor cores max |diff| / max |ref| "
                          f"{((y_sp - ref).abs().max() / ref.abs().max()).item():.3g}", flush=True)
                except Exception as e:  # noqa: BLE001 (reported; the timing below reports NaN)
                    print(f"  M {M}: sparse tensor cores failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                # ``cfg`` passed, never None: run_prefill(None) takes this GPU's tuned entry, which
                # would time another tile than the label and than Triton's GEMM (run 4's rows did)
                r = [weight, N, K, M, bench(lambda: F.linear(x, wd)),
                     bench(lambda: launch.run_prefill(x, p.values, p.meta, p.scale, None, N, cfg, p.zero, gs)),
                     bench(lambda: F.linear(x, unpack())),
                     bench(unpack),
                     bench(lambda: F.linear(x, ws)) if ws is not None else float("nan"),
                     bench(lambda: _triton_dense(x, wd, cfg, kernels)) if weight == "fp16" else float("nan"),
                     config_name(cfg),
                     # cuSPARSELt's own kernels per call (profiler): is its ~1 ms a call host time
                     # (then a CUDA graph would remove it) or the GPU's?
                     _device_us(lambda: F.linear(x, ws), dev) if ws is not None else float("nan"),
                     # to SP_MAX_M rows the route's sparse tensor-core kernel (16-bit weights too, since
                     # 2026-12-04), its untuned config for the M bucket; past them sp_cfg (docstring)
                     bench(lambda: launch.run(x, p.values, p.meta, p.scale, None, N, sp_cfg, p.zero, gs)),
                     # this GPU's tuned prefill entry (what a layer runs), beside the untuned one
                     bench(lambda: launch.run_prefill(x, p.values, p.meta, p.scale, None, N, tuned, p.zero, gs))
                     if tuned is not None else float("nan"),
                     config_name(tuned) if tuned is not None else ""]
                wr.writerow(r)
                f.flush()
                rows.append(r)
                print("  M %5d  dense %8.2f  prefill %8.2f  unpack+mm %8.2f  unpack %7.2f  cusparselt %8.2f  "
                      "triton dense %8.2f  (%s)  cusparselt kernels %8.2f  sparse tensor cores %8.2f  "
                      "tuned %8.2f  (%s)" % (M, *r[4:-1], r[-1] or "none"), flush=True)
    f.close()


# The K-sweep's fixed tile: run 4's untuned config at 1024-4096 rows. Ours ran 2.46-2.50x
# Triton's own GEMM on it at 4096x11008, the one like-for-like comparison of run 4. Its rows at
# K = 4096 (1.02-1.19x, labelled with this tile) did not run it: run_prefill without a config took
# run 2's tuned 256 x 64 x 64 entry of the H200 file (4 warps, 3 stages) while Triton's GEMM ran
# this tile. So ours on this tile at K = 4096 is unmeasured; the sweep's K = 4096 row is the first.
KSWEEP_TILE = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=2)
KSWEEP_KS = (4096, 8192, 10240, 11008, 11264, 12288, 16384)
# The split-K rows: the untuned 256-row config at 4096x4096 (split 2). Run 4's row labelled with
# it (82.9 us, read as 1.93x the model) ran the same tuned 256 x 64 x 64 entry, unsplit, so what
# the split gains is unmeasured: the sweep times this tile unsplit, split 2 and split 4.
SPLIT_TILE = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2)


def ksweep_jobs(N: int = 4096, M: int = 1024, ks=KSWEEP_KS, group_ms=(1, 8, 32), group_k: int = 11008,
                tile=None, split_shape=(4096, 4096, 256), splits=(1, 2, 4), split_tile=None) -> list:
    """The K-sweep's launches, ``(N, K, M, config)``, each a fp16 weight of the prefill kernel:
    ``tile`` (default :data:`KSWEEP_TILE`) at every K of ``ks``, N and M fixed, GROUP_M 8, and at
    ``group_k`` also the other ``group_ms``; then ``split_tile`` (:data:`SPLIT_TILE`) at
    ``split_shape`` (N, K, M) for each split-K factor of ``splits``."""
    from dataclasses import replace

    from sparse24.ops.config_space import KernelConfig
    base = KernelConfig(kernel="prefill", **(tile or KSWEEP_TILE))
    jobs = [(N, K, M, replace(base, group_m=g)) for K in ks for g in (group_ms if K == group_k else (8,))]
    split = KernelConfig(kernel="prefill", **(split_tile or SPLIT_TILE))
    return jobs + [(*split_shape, replace(split, split_k=sk)) for sk in splits]


def ksweep(out: Path, dev, jobs) -> None:
    """Why the 16-bit prefill kernel ran 2.5x Triton's own dense GEMM on one tile at K = 11008 (run 4,
    4096x11008), whose loop is the same code at K = 4096 (docs/kernels.md, "Past 64 rows"): run 4
    never timed ours on that tile at K = 4096 (those rows ran the H200 file's tuned 256 x 64 x 64
    entry under the untuned label; :data:`KSWEEP_TILE`), so the sweep's K = 4096 row is the first
    like-for-like point there; and whether its split-K gains anything (unmeasured too:
    :data:`SPLIT_TILE`). ``jobs``: :func:`ksweep_jobs` (the
    default: N = 4096, 1024 rows, one tile, K = 4096 ... 16384; seven compiles in all, none per K).
    Per job: cuBLAS (F.linear), ours (checked against fp32 first) and Triton's own dense GEMM on the
    tile (unsplit). The meta row stride KM (atoms, padded to 16) is a power of two at 4096, 8192 and
    16384 and not at 10240 / 11008 / 11264 / 12288; 11008 and 11264 share KM = 176. So a ratio to
    Triton's that rises with K says capacity (L2, TLB), one that jumps where KM is not a power of two
    says the meta rows' stride, one only at 11008 says its K-tile count; GROUP_M 1 and 32 beside 8 at
    11008, the order in which programs share weight tiles in L2. Writes ``probe_ksweep.csv``."""
    from sparse24.decode_format import decode_dims
    torch.manual_seed(0)
    kernels = _dense_kernels()
    f = open(out / "probe_ksweep.csv", "w", newline="")
    wr = csv.writer(f)
    wr.writerow(["N", "K", "M", "KM", "config", "dense_us", "ours_us", "triton_dense_us", "ours_over_triton",
                 "max_rel_err"])
    shape = None
    for N, K, M, cfg in jobs:
        if (N, K, M) != shape:   # one weight per shape, shared by its configs
            shape = (N, K, M)
            w = torch.randn(N, K, device=dev, dtype=torch.float16)
            c = sparse24.compress(w)
            p = pack_decode(c)
            wd = c.to_dense().to(torch.float16)
            x = torch.randn(M, K, device=dev, dtype=torch.float16)
            ref = F.linear(x.float(), wd.float())
        name = (f"BM{cfg.block_m}_BN{cfg.block_n}_BK{cfg.block_k}_W{cfg.num_warps}_S{cfg.num_stages}"
                f"_SK{cfg.split_k}_G{cfg.group_m}")
        try:   # ours checked against fp32 before it is timed (a wrong kernel times nothing useful)
            y = launch.run_prefill(x, p.values, p.meta, None, None, N, cfg).float()
            err = round(((y - ref).abs().max() / ref.abs().max()).item(), 6)
        except Exception as e:  # noqa: BLE001
            print(f"  {N}x{K} M {M} {name}: ours failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            err = float("nan")
        dense = _bench(lambda: F.linear(x, wd), dev)
        ours = _bench(lambda: launch.run_prefill(x, p.values, p.meta, None, None, N, cfg), dev)
        tri = _bench(lambda: _triton_dense(x, wd, cfg, kernels), dev)
        r = [N, K, M, decode_dims(N, K)[2], name, dense, ours, tri, round(ours / tri, 3), err]
        wr.writerow(r)
        f.flush()
        print("  %5dx%-5d M %5d  KM %4d  %s  dense %8.2f  ours %8.2f  triton dense %8.2f  ours/triton %6.3f  "
              "max rel err %.3g" % tuple(r), flush=True)
    f.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", choices=("host", "prefill", "ksweep"), default=None,
                    help="one step (ksweep: never run by default, gpu_check.sh's ksweep step)")
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes: the code paths only")
    ap.add_argument("--weights", default="fp16,int8,int4", help="prefill: the weight kinds, in order")
    ap.add_argument("--ms", default=None, help="prefill: the row counts (default 32,64,256,1024,4096)")
    a = ap.parse_args(argv)
    kinds = tuple(a.weights.split(","))
    if not set(kinds) <= {"fp16", "int8", "int4"}:
        ap.error(f"--weights: fp16, int8 and int4 only, got {a.weights}")
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_probe: no CUDA GPU visible; nothing to probe", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.only in (None, "host"):
        host(a.out, dev, *((128, 256, 3) if a.smoke else ()))
    if a.only in (None, "prefill"):
        shapes = ((256, 256),) if a.smoke else ((4096, 4096), (11008, 4096), (4096, 11008))
        ms = tuple(int(m) for m in a.ms.split(",")) if a.ms else (64, 80) if a.smoke else (32, 64, 256, 1024, 4096)
        prefill(a.out, dev, shapes, ms, kinds)
    if a.only == "ksweep":
        if a.smoke:   # the code path on the interpreter: small shapes, tiles it runs in seconds
            small = dict(block_m=32, block_n=128, block_k=64, num_warps=8, num_stages=2)
            jobs = ksweep_jobs(N=128, M=32, ks=(128, 192), group_ms=(1, 8), group_k=192, tile=small,
                               split_shape=(128, 256, 32), splits=(1, 2), split_tile=small)
        else:
            jobs = ksweep_jobs(M=int(a.ms.split(",")[0]) if a.ms else 1024)
        ksweep(a.out, dev, jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

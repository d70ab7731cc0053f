"""Throughput sweeps: time ``y = x @ W^T`` over batch sizes M for each provider,
write CSV rows (measurement only; :mod:`sparse24.tools.plot` draws them). (Just over
400 lines: the providers, the timer and the CSV schema are one measurement's
parts and change together.)

Providers (each on the same masked 2:4 weight, one shape and M at a time):

* ``dense``: ``F.linear`` on the masked dense weight (cuBLAS / oneDNN) - the baseline;
* ``sparse24-triton`` / ``sparse24-reference``: :func:`sparse24.linear` with that backend;
  the Triton providers (and ``sparse24-auto``) take the weight in the layout a compressed
  module holds on the device: the decode layout (decode kernel) on CUDA for float16/bfloat16
  and INT8 weights, layout v1 (general kernel) elsewhere;
* ``sparse24-auto``: ``backend="auto"``, what users get by default (CUDA only:
  on CPU auto is the reference backend, timed already);
* ``torch-semi-structured``: ``torch.sparse.to_sparse_semi_structured`` (CUDA, sm80+);
* ``sparse24-int8-triton`` / ``sparse24-int8-reference``: INT8 values + per-row
  scales (``sparse24.compress(w, quantize="int8")``), activations in ``--dtype``.
* ``sparse24-int4-reference`` / ``sparse24-int4-auto`` / ``sparse24-int4-triton``: INT4
  values + fp16 scales per 128 input columns, symmetric
  (``sparse24.compress(w, quantize="int4")``), activations in ``--dtype``; ``auto`` is
  the backend a layer gets (CUDA only, as ``sparse24-auto``), ``triton`` the Triton backend's
  INT4 kernels.

Timing: medians over ``repeats`` samples after warm-up, providers interleaved
round-robin so that a load change on a shared machine hits all of them alike.
CUDA: CUDA events around each call, L2 cleared before each (as
``triton.testing.do_bench`` does) and the host's launch overhead hidden
behind a GPU spin, so every provider's GPU time is measured alike.
CPU: ``time.perf_counter``, each sample averaging enough calls to last >= 1 ms.

Figures per row: TFLOP/s = 2*M*N*K / t (dense-equivalent FLOPs, also for
sparse providers), effective GB/s = (weight bytes as stored + x + y) / t, and
the speedup vs ``dense`` measured in the same run.
"""
from __future__ import annotations

import csv
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .._progress import progress_bar
from .._version import __version__
from ..decode_format import pack_decode
from ..format import compress, mask_nm
from ..ops.linear24 import linear
from ..ops.linear24.launch import kernel_refusal
from .cli_common import temp_name

__all__ = ["SCHEMA", "COLUMNS", "PROVIDERS", "BenchSettings", "device_info", "device_slug",
           "provider_status", "default_settings", "run_bench", "write_csv", "write_together"]

# Bump when a column changes meaning; sparse24.tools.plot refuses other schemas.
SCHEMA = "sparse24-bench/1"
COLUMNS = ["schema", "device_type", "device", "threads", "torch", "triton", "sparse24", "dtype", "shape",
           "N", "K", "M", "provider", "weight_bytes", "median_ms", "tflops", "gbps", "speedup_vs_dense",
           "rel_err", "repeats"]
PROVIDERS = ("dense", "sparse24-triton", "sparse24-reference", "sparse24-auto", "torch-semi-structured",
             "sparse24-int8-triton", "sparse24-int8-reference", "sparse24-int4-triton", "sparse24-int4-auto",
             "sparse24-int4-reference")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The Triton interpreter takes ~0.08 s for a 64x128 weight and ~1.9 s for
# 768x768 at M = 1 (2-core CPU), so on CPU the kernel is timed only for weights
# up to this many elements unless asked for by name: its CPU time says nothing
# about GPU speed, it only shows the path runs.
CPU_TRITON_MAX_ELEMENTS = 128 * 128
# Largest relative Frobenius error vs the fp64 product before a provider's
# result counts as wrong (a broken decode is off by O(1); int8 and int4 are compared
# with their own dequantized weight, so quantization error does not count).
_MAX_REL_ERR = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}


# --- the machine ---------------------------------------------------------------------

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_info(device: torch.device) -> dict:
    """``{"device_type", "device", "threads"}`` for the CSV: the GPU's name, or
    the CPU model and torch's thread count."""
    if device.type == "cuda":
        return {"device_type": "cuda", "device": torch.cuda.get_device_name(device), "threads": ""}
    return {"device_type": "cpu", "device": cpu_name(), "threads": torch.get_num_threads()}


def device_slug(info: dict) -> str:
    """Folder name for a device's results: ``cpu-amd-epyc`` or the GPU's tuned-config
    folder name (``NVIDIA_H100_80GB_HBM3``, as ``sparse24.tools.tuning.gpu_file_name``)."""
    if info["device_type"] == "cuda":
        return re.sub(r"[^A-Za-z0-9.-]+", "_", info["device"]).strip("_") or "unknown"
    return "cpu-" + (re.sub(r"[^a-z0-9.]+", "-", info["device"].lower()).strip("-") or "unknown")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return triton.__version__


# --- providers -----------------------------------------------------------------------

def provider_status(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Why ``name`` cannot run on ``device`` with activations of ``dtype``; "" if it can."""
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
    if "triton" in name:
        if not _triton_version():
            return "triton is not installed"
        if device.type == "cpu" and dtype == torch.bfloat16:
            return "Triton's interpreter (CPU) has no bfloat16 arithmetic"
        why = kernel_refusal(device, dtype, "int4" in name)  # (a ROCm or pre-sm_70 GPU; INT4 + bf16 before sm_80)
        if why is not None:
            return why
    if name in ("sparse24-auto", "sparse24-int4-auto") and device.type != "cuda":
        return f"on CPU backend='auto' is the reference backend (timed as {name.replace('auto', 'reference')})"
    if name == "torch-semi-structured":
        if device.type != "cuda":
            return "torch's semi-structured kernels (CUTLASS/cuSPARSELt) run on CUDA only"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "torch's semi-structured kernels need compute capability >= 8.0 (Ampere or newer)"
    return ""


def _semi_structured_bytes(ws) -> int:
    """Stored bytes of a SparseSemiStructuredTensor (values + metadata, as torch keeps them)."""
    parts = [getattr(ws, a, None) for a in ("packed", "meta")]
    parts = [t for t in parts if isinstance(t, torch.Tensor)]
    if not parts:  # unknown layout: the 2:4 minimum (half the values + 2 bits each)
        N, K = ws.shape
        return N * K // 2 * ws.dtype.itemsize + N * K // 8
    return sum(t.numel() * t.element_size() for t in parts)


def _make_op(name: str, w: torch.Tensor, mask: torch.Tensor) -> tuple[Callable, int, torch.Tensor]:
    """``(fn(x) -> y, weight bytes as stored, dense weight the result must equal)``
    for provider ``name`` on the 2:4 ``mask``-ed dense weight ``w`` (on the device, in x's dtype)."""
    if name == "dense":
        return (lambda x: F.linear(x, w)), w.numel() * w.element_size(), w
    if name == "torch-semi-structured":
        ws = torch.sparse.to_sparse_semi_structured(w)
        return (lambda x: F.linear(x, ws)), _semi_structured_bytes(ws), w
    quantize = next((q for q in ("int8", "int4") if q in name), None)
    p = compress(w, mask, quantize=quantize)
    backend = name.rsplit("-", 1)[1]
    q = p
    if backend != "reference" and w.is_cuda and (quantize or w.dtype in (torch.float16, torch.bfloat16)):
        q = pack_decode(p)  # the layout a compressed module holds there: what users' layers run
    # fp values must reproduce the masked dense weight itself; quantized ones their dequantized form
    return (lambda x: linear(x, q, backend=backend)), p.nbytes + p.scale_nbytes, p.to_dense() if quantize else w


# --- timing --------------------------------------------------------------------------

class _Timer:
    """Per-device timer of one call: ``sample(fn) -> seconds``."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            # Cleared before every call so each one reads its weight from HBM
            # (the 256 MB buffer triton.testing.do_bench uses for the same reason).
            self.cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
        self.inner: dict[int, int] = {}

    def warm(self, key: int, fn: Callable) -> None:
        """Run ``fn`` until compiled/cached; on CPU pick calls per sample so a sample lasts >= 1 ms."""
        for _ in range(2):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        self.inner[key] = max(1, min(1000, math.ceil(1e-3 / max(dt, 1e-7))))

    def sample(self, key: int, fn: Callable) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.cache.zero_()
            # Keep the GPU busy (~0.5 ms) while Python enqueues the call, so the
            # time between the events is GPU time only, as in a CUDA graph: a
            # decode-sized kernel (~10 us) would otherwise be timed with the
            # launch overhead of whichever Python wrapper precedes it.
            torch.cuda._sleep(1_000_000)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3
        n = self.inner[key]
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against the fp64 ``ref`` (same shape)."""
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# --- the sweep -----------------------------------------------------------------------

@dataclass
class BenchSettings:
    """What to sweep.

    Attributes:
        device: ``torch.device("cpu")`` or a CUDA device.
        shapes: ``(label, N, K)`` rows (see :func:`sparse24.tools.shapes.parse_shapes`).
        ms: batch sizes M.
        dtypes: activation (and dense weight) dtypes.
        providers: provider names (``dense`` is always added: speedups need it).
        repeats: timed samples per (shape, M, provider); the median is kept.
        seed: weights and inputs are ``randn`` from this seed.
    """
    device: torch.device
    shapes: list
    ms: list
    dtypes: list
    providers: list
    repeats: int
    seed: int = 0


def default_settings(device: torch.device, quick: bool = False) -> dict:
    """Defaults per device: ``{"shapes", "ms", "dtypes", "repeats"}``.

    CPU: BERT-base shapes in fp32 (CPU GEMMs run fp16 slowly, so fp32 is
    what CPU users run); CUDA: the LLM shapes the kernel targets, fp16.
    """
    if device.type == "cuda":
        return {"shapes": ["standard"], "dtypes": ["float16"], "repeats": 25 if quick else 100,
                "ms": [1, 16, 256, 4096] if quick else [2 ** i for i in range(13)]}
    return {"shapes": ["bert-base"], "dtypes": ["float32"], "repeats": 5 if quick else 15,
            "ms": [1, 16, 128] if quick else [1, 4, 16, 64, 256]}


def plan_providers(settings: BenchSettings, explicit: bool) -> tuple[list, list[str]]:
    """``([(dtype, label, N, K, provider)], notes)``: what runs, and why the rest does not."""
    jobs, notes = [], []
    names = ["dense"] + [p for p in settings.providers if p != "dense"]
    for dtype in settings.dtypes:
        for name in names:
            why = provider_status(name, settings.device, dtype)
            if why:
                notes.append(f"{name} ({str(dtype)[6:]}): skipped, {why}")
                continue
            interpreted = "triton" in name and settings.device.type == "cpu" and not explicit
            too_big = [label for label, N, K in settings.shapes if interpreted and N * K > CPU_TRITON_MAX_ELEMENTS]
            if too_big:
                notes.append(f"{name} ({str(dtype)[6:]}): skipped for {', '.join(too_big)}: on CPU the kernel runs "
                             f"in Triton's interpreter (seconds per call, says nothing about GPU speed), so only "
                             f"weights up to {CPU_TRITON_MAX_ELEMENTS} elements are timed unless you name it "
                             f"in --providers")
            jobs += [(dtype, label, N, K, name) for label, N, K in settings.shapes if label not in too_big]
    return jobs, notes


def run_bench(settings: BenchSettings, explicit_providers: bool = False, progress: bool | None = None,
              log=None, partial: str | os.PathLike | None = None) -> list[dict]:
    """Sweep M for every shape, dtype and provider; return CSV rows (dicts keyed by :data:`COLUMNS`).

    Args:
        settings: :class:`BenchSettings`.
        explicit_providers: the user named the providers (on CPU the Triton
            interpreter then runs on every shape).
        progress: a progress bar on stderr (tqdm; None: when stderr is a terminal or in a notebook).
        log: where skip notes go (default stderr).
        partial: a CSV file rewritten with the rows so far after every point, so a sweep stopped
            early (a GPU job's time limit) keeps what it measured.
    Returns:
        one row per (dtype, shape, M, provider) that ran.
    Example:
        >>> s = BenchSettings(torch.device("cpu"), [("64x128", 64, 128)], [1, 8], [torch.float32],
        ...                   ["dense", "sparse24-reference"], repeats=3)
        >>> rows = run_bench(s, progress=False)
        >>> len(rows), rows[0]["provider"]
        (4, 'dense')
    """
    log = log if log is not None else sys.stderr
    dev = settings.device
    jobs, notes = plan_providers(settings, explicit_providers)
    for n in notes:
        print(f"  note: {n}", file=log)
    common = {"schema": SCHEMA, **device_info(dev), "torch": torch.__version__, "triton": _triton_version(),
              "sparse24": __version__}
    groups: dict[tuple, list[str]] = {}
    for dtype, label, N, K, name in jobs:
        groups.setdefault((dtype, label, N, K), []).append(name)
    total = sum(len(v) for v in groups.values()) * len(settings.ms)  # measurements
    bar = progress_bar(total=total, desc="bench", progress=progress, unit="point")
    timer = _Timer(dev)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    for (dtype, label, N, K), names in groups.items():
        w = torch.randn(N, K, generator=gen, device="cpu").to(dev, dtype)
        mask = mask_nm(w)
        w = torch.where(mask, w, 0)
        ops = {}
        for name in names:
            try:
                ops[name] = _make_op(name, w, mask)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. a shape torch's 2:4 path does not take
                _fail(name, label, "weight preparation", e, log)
        for M in settings.ms:
            x = torch.randn(M, K, generator=gen, device="cpu").to(dev, dtype)
            for name, (t, t_dense, err, wbytes) in _measure_point(ops, x, timer, settings.repeats, log,
                                                                  f"{label} M={M}").items():
                io_bytes = wbytes + M * K * x.element_size() + M * N * x.element_size()
                rows.append({**common, "dtype": str(dtype)[6:], "shape": label, "N": N, "K": K, "M": M,
                             "provider": name, "weight_bytes": wbytes, "median_ms": f"{t * 1e3:.6g}",
                             "tflops": f"{2 * M * N * K / t / 1e12:.6g}", "gbps": f"{io_bytes / t / 1e9:.6g}",
                             "speedup_vs_dense": f"{t_dense / t:.5g}", "rel_err": f"{err:.2e}",
                             "repeats": settings.repeats})
            if partial is not None:
                write_csv(rows, partial)
            bar.set_postfix_str(f"{label} M={M}", refresh=False)
            bar.update(len(names))
        del ops, w, mask
    bar.close()
    return rows


def _fail(name: str, where: str, what: str, err: Exception, log) -> None:
    if name == "dense":  # the baseline every speedup needs
        raise err
    print(f"  note: {name} {where}: {what} failed ({' '.join(str(err).split())[:160]}); skipped", file=log)


def _measure_point(ops: dict, x: torch.Tensor, timer: _Timer, repeats: int, log, where: str) -> dict:
    """Time every provider on one input: ``{name: (median s, dense median s, rel err, weight bytes)}``.

    Each provider's result is first checked against the fp64 product of its own
    dense weight; a provider that fails to run here is skipped with a note.
    """
    refs: dict[int, torch.Tensor] = {}
    live, errs = {}, {}
    for i, (name, (fn, wbytes, wref)) in enumerate(ops.items()):
        try:
            timer.warm(i, lambda: fn(x))
            y = fn(x)
        except (RuntimeError, TypeError, ValueError) as e:
            _fail(name, where, "the call", e, log)
            continue
        if id(wref) not in refs:
            refs[id(wref)] = F.linear(x.double(), wref.double())
        errs[name] = rel_error(y, refs[id(wref)])
        if errs[name] > _MAX_REL_ERR[x.dtype]:
            print(f"  WARNING: {name} {where}: relative error {errs[name]:.2e} vs the fp64 product is above "
                  f"{_MAX_REL_ERR[x.dtype]:.0e}: its timing is of a wrong result", file=log)
        live[i, name] = fn
    del refs
    samples: dict[str, list[float]] = {name: [] for _, name in live}
    for _ in range(repeats):  # round-robin: a load change on a shared machine hits every provider alike
        for (i, name), fn in live.items():
            samples[name].append(timer.sample(i, lambda: fn(x)))
    t_dense = statistics.median(samples["dense"])
    return {name: (statistics.median(samples[name]), t_dense, errs[name], ops[name][1]) for _, name in live}


def write_csv(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write ``rows`` (from :func:`run_bench`) to ``path`` with the :data:`COLUMNS` header."""
    path = Path(path)
    make_parent(path)

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=COLUMNS)
            wr.writeheader()
            wr.writerows(rows)

    write_together({path: write})
    return path


def make_parent(path: Path) -> None:
    """Create ``path``'s folder (and the ones above); ValueError naming the file that stands where a
    folder must (mkdir's own "[Errno 17] File exists" named neither)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), path.parent)
        raise ValueError(f"cannot write {path}: {blocking} is a file, not a folder") from None


def write_together(writers: dict) -> None:
    """Write ``{path: write(tmp_path)}`` to temporary names, then rename them all:
    a failure (disk full, a plotting error) leaves the previous run's files as
    they were, not a new CSV next to an old plot or a half-written file."""
    tmps = {}
    try:
        for path, write in writers.items():
            # suffix kept: savefig's format (a longer one is none); the name is short for any legal `path`
            suffix = path.suffix if len(path.suffix) <= 16 else ""
            tmps[path] = path.with_name(temp_name(path.name, "tmp" + suffix))
            write(tmps[path])
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


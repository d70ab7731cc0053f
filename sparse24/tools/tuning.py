"""Tuning the 2:4 Triton kernels on a GPU (a tool, above the ops it times):
time the config space per shape side by side with dense ``F.linear`` and the
reference backend, keep the fastest config that computes the right result, and
merge it into this GPU's tuned-config file (read back by
:mod:`sparse24.ops.config_store`). ``python -m sparse24 autotune`` runs it for
named shape sets (:func:`autotune`); ``SPARSE24_AUTOTUNE=1`` tunes shapes live
on first use once this module is imported (``import sparse24`` does so when the
variable is set).

The config space and the file store live below the ops
(:mod:`sparse24.ops.config_space`, :mod:`sparse24.ops.config_store`); their
names are re-exported here for existing code.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:   # (Windows) no advisory file locks: concurrent writers of one file are not serialized
    fcntl = None

import torch
import torch.nn.functional as F

from ..decode_format import pack_decode
from ..format import compress, quantize_values
from ..ops import config_store
from ..ops.config_space import (DTYPE_KEYS, KERNEL_VARIANTS, M_BUCKETS, KernelConfig, builtin_config,  # noqa: F401
                               SP_MAX_M, candidate_configs, decode_rows, dtype_key, fp32_twin, m_bucket,
                               sparse_kernel)
from ..ops.config_store import (KERNEL, SCHEMA_VERSION, Choice, clear_cache, config_dirs,  # noqa: F401
                               describe_config_source, get_config, gpu_file_name, lookup, measured_timings,
                               shipped_config_dir, validate_dir, validate_file)
from ..ops.linear24 import linear_prefill, linear_reference, linear_triton, op
from ..ops.linear24.launch import (half_pair, int_specialization, kernel_call, kernel_refusal, sparse_tensor_cores,
                                   target_dtype, tf32_matmul, variant_of)
from ..ops.linear24.op import DECODE_M
from .bench import rel_error
from .cli_common import CLIError, check_writable

__all__ = ["tune_key", "time_launches_us", "write_entries", "autotune", "KernelConfig", "candidate_configs",
           "get_config", "gpu_file_name", "clear_cache"]


_ACT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Largest relative Frobenius error (vs fp64) a tuning candidate may show before
# it is rejected: ~4 unit round-offs of the output dtype. A mis-decoding config
# is off by O(1), so this only rejects broken configs, never close calls.
_MAX_REL_ERR = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}


def runtime_layout(dtype: str) -> str:
    """The layout a compressed module holds on CUDA for weights of this dtype key (see
    :meth:`sparse24.Sparse24Linear.to_layout`): the decode layout for float16/bfloat16
    and INT8 / INT4 weights, layout v1 for float32 ones."""
    return "v1" if dtype == "float32" else "decode"


def _activation(dtype: str) -> str:
    """The activation dtype of a dtype key: ``int8-bfloat16`` -> ``bfloat16``."""
    return dtype.rsplit("-", 1)[-1]


def _tuning_inputs(M: int, N: int, K: int, dtype: str, device, seed: int = 0, layout: str = "v1"):
    """Random x (M, K), compressed weight p (N, K) in ``layout`` and its dense twin, as tuned
    (``int8-``/``int4-`` keys: the weight quantized so, INT4 in groups of 128 columns, symmetric)."""
    act = _ACT[_activation(dtype)]
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=gen, device=device).to(act)
    p = compress(w)
    if dtype != _activation(dtype):
        p = quantize_values(p, dtype.split("-")[0])
    x = torch.randn(M, K, generator=gen, device=device).to(act)
    dense = p.to_dense().to(act)
    return x, pack_decode(p) if layout == "decode" else p, dense


def tuning_space(M: int, N: int, K: int, dtype: str, device, layout: str | None = None) -> list[KernelConfig]:
    """The configs :func:`tune_key` times for one key on ``device``: :func:`candidate_configs`,
    except that a GPU without sparse tensor cores (compute capability < 8.0) times INT8 / INT4 keys
    with 16-bit x at M <= 16 in the byte-permute kernel's space (that of the key's float32-x twin:
    the kernel its layers run there) and refuses them at 17-64 rows, where those layers take the
    prefill kernel's untuned config (its entries there are the sparse kernel's); 16-bit keys there
    time the prefill kernel's space alone."""
    device = torch.device(device)
    layout = runtime_layout(dtype) if layout is None else layout
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    if layout != "decode" or sparse_tensor_cores(device):
        return candidate_configs(M, N, K, num_sms, layout, dtype)
    if sparse_kernel(dtype):
        if M > DECODE_M and decode_rows(M, dtype) == 32:
            raise RuntimeError(f"M={M}, {dtype}: on a GPU without sparse tensor cores (compute capability < 8.0) "
                               f"INT8 / INT4 weights with 16-bit x take the prefill kernel's untuned config at "
                               f"{DECODE_M + 1}-{SP_MAX_M} rows; nothing to tune there (tune M <= {DECODE_M} or "
                               f"> {SP_MAX_M})")
        dtype = fp32_twin(dtype)   # the byte-permute kernel's space
    return [c for c in candidate_configs(M, N, K, num_sms, layout, dtype) if c.kernel != "decode" or c.block_m == 16]


def _space_or_none(M, N, K, dtype, device) -> list[KernelConfig]:
    """:func:`tuning_space`, empty where it refuses (:func:`tune_key` reports that key)."""
    try:
        return tuning_space(M, N, K, dtype, device)
    except RuntimeError:
        return []


def tune_key(M: int, N: int, K: int, dtype: str, device, configs=None, warmup_ms: float = 10,
             rep_ms: float = 40, layout: str | None = None, timings: list | None = None) -> Choice:
    """Time the config space for one key on a CUDA device; return the fastest
    config that also computes the right result.

    Args:
        M, N, K: sizes (M is used as given: pass the bucket); dtype: a dtype key.
        device: a CUDA device. configs: candidates (default :func:`candidate_configs`).
        layout: the weight layout tuned for (default :func:`runtime_layout`).
        warmup_ms, rep_ms: timing budgets per candidate (see :func:`time_launches_us`).
        timings: a list that gets one row (:data:`TIMING_COLUMNS`) per candidate, timed or
            rejected, even when no candidate ran (:func:`autotune` writes them as CSV).
    Returns:
        :class:`Choice` with ``kind="live"`` and ``entry = {"config", "kernel_us",
        "dense_us", "m"}`` (dense = ``F.linear`` on the dense weight in the activation dtype),
        plus ``"reference_us"`` (the reference backend) when M > 16, and ``"unpack_us"`` (the
        unpack route: :func:`unpack_time_us`) for the decode layout there where it applies.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tuning times kernels on a CUDA device, got {device}")
    layout = runtime_layout(dtype) if layout is None else layout
    why = kernel_refusal(device, _ACT[_activation(dtype)], dtype.startswith("int4"))
    if why is not None:  # (a ROCm or pre-sm_70 GPU: nothing to time, the kernels do not compile there)
        raise ValueError(f"tuning: {why}")
    if device.index is not None and device.index != torch.cuda.current_device():
        # the timing's side stream, graph capture and do_bench use the current device: another GPU's
        # launches (guarded to their own) were not captured, and an empty graph was timed
        with torch.cuda.device(device):
            return tune_key(M, N, K, dtype, device, configs, warmup_ms, rep_ms, layout, timings)
    x, p, w_dense = _tuning_inputs(M, N, K, dtype, device, layout=layout)
    ref = F.linear(x.double(), w_dense.double())
    tf32 = dtype.endswith("float32") and tf32_matmul()
    max_err = 2e-3 if tf32 else _MAX_REL_ERR[_activation(dtype)]
    props = torch.cuda.get_device_properties(device)
    # Enough weight copies to overflow L2 twice, so every launch streams its
    # weight from HBM as in a real model (one 4096 x 4096 fp16 2:4 weight,
    # 18.9 MB, would otherwise sit in an H100/H200's 50-60 MB L2).
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    weights = [p] + [_clone_weight(p) for _ in range(_copies(l2, p.nbytes) - 1)]
    dense_weights = [w_dense] + [w_dense.clone() for _ in range(_copies(l2, w_dense.nbytes) - 1)]

    def kernel_time(cfg) -> float:
        return time_launches_us([lambda q=q: launch_config(x, q, cfg) for q in weights], warmup_ms, rep_ms)

    record, dense_us = [], None
    try:
        best_cfg, best_us, rejected = _select_fastest(
            configs if configs is not None else tuning_space(M, N, K, dtype, device, layout),
            launch=lambda cfg: launch_config(x, p, cfg),
            error=lambda y: rel_error(y, ref),
            time=kernel_time, max_err=max_err, label=f"M={M}, N={N}, K={K}, {dtype}", record=record)
        dense_us = time_launches_us([lambda w=w: F.linear(x, w) for w in dense_weights], warmup_ms, rep_ms)
    finally:
        if timings is not None:
            timings += timing_rows((M, N, K, dtype), x, p, record, dense_us)
    entry = {"config": best_cfg, "kernel_us": round(best_us, 3), "dense_us": round(dense_us, 3), "m": M}
    if M > DECODE_M:  # backend="auto" never runs the reference at decode sizes: not worth the time there
        entry["reference_us"] = round(time_launches_us([lambda q=q: linear_reference(x, q) for q in weights],
                                                       warmup_ms, rep_ms), 3)
        if layout == "decode":   # the prefill route's other path: the faster one serves (op.prefill_backend)
            unpack = unpack_time_us(x, weights, ref, max_err,
                                    lambda launches: time_launches_us(launches, warmup_ms, rep_ms))
            if unpack is not None:
                entry["unpack_us"] = unpack
    return Choice(best_cfg, "live", f"tuned live on {torch.cuda.get_device_name(device)} "
                                    f"({len(rejected)} candidates rejected)", entry)


def timing_rows(key: tuple, x: torch.Tensor, p, record: list, dense_us: float | None) -> list[dict]:
    """``autotune --timings`` rows (:data:`TIMING_COLUMNS` but ``gpu``) of one key ``(M, N, K, dtype)``
    from :func:`_select_fastest`'s ``record`` for weight ``p`` and ``x``: each candidate's config
    (its file form), the kernel it ran on ``x``'s device, its time (empty: rejected) and status."""
    sparse_cores = sparse_tensor_cores(x.device)
    M, N, K, dtype = key
    return [dict(m=M, n=N, k=K, dtype=dtype,
                 kernel=variant_of(c, x.dtype, p.scale is not None, p.values.dtype, sparse_cores).kernel(
                     cuda=True).__name__,
                 config=json.dumps(c.to_json(), separators=(",", ":")), kernel_us="" if us is None else round(us, 3),
                 dense_us="" if dense_us is None else round(dense_us, 3), status=status)
            for c, us, status in record]


def unpack_time_us(x: torch.Tensor, weights: list, ref: torch.Tensor, max_err: float, time) -> float | None:
    """The unpack route's time for decode-layout ``weights`` (copies of one ``(N, K)`` weight)
    and ``x`` ``(M, K)``: the weight unpacked into the dense scratch, then cuBLAS, as
    ``backend="auto"`` runs it; ``time(launches)`` measures (:func:`time_launches_us`). None
    where the route does not apply (float32 x, a 16-bit weight of another dtype) or its result
    is off by more than ``max_err`` (relative to ``ref``, fp64: reported, never chosen)."""
    p = weights[0]
    if not half_pair(x.dtype, p.values.dtype, p.scale is not None):
        return None

    def run(q):
        return op.unpack_linear(x, q.values, q.meta, q.scale, q.zero, q.group_size or 0, None, q.shape[0])
    err = rel_error(run(p), ref)
    if not err <= max_err:
        print(f"  unpack route: relative error {err:.2e} above {max_err:.0e}: not timed", file=sys.stderr)
        return None
    return round(time([lambda q=q: run(q) for q in weights]), 3)


def launch_config(x: torch.Tensor, p, cfg: KernelConfig) -> torch.Tensor:
    """``y = x @ W^T`` with one config of the space: its kernel's entry point (a prefill
    config runs the prefill kernel, the decode layout's past 16 rows; the rest
    :func:`linear_triton`)."""
    return linear_prefill(x, p, config=cfg) if cfg.kernel == "prefill" else linear_triton(x, p, config=cfg)


def _copies(l2_bytes: int, nbytes: int) -> int:
    return min(16, max(1, -(-2 * l2_bytes // max(nbytes, 1))))


def _clone_weight(p):
    """A copy of ``p`` in new memory (every tensor: values, meta, INT8 / INT4 scales, INT4 zero points)."""
    def copy(t):
        return None if t is None else t.clone()
    return type(p)(p.values.clone(), p.meta.clone(), p.shape, p.dtype, copy(p.scale), zero=copy(p.zero),
                   group_size=p.group_size, check=False)


def time_launches_us(launches, warmup_ms: float = 10, rep_ms: float = 40, outputs: list | None = None) -> float:
    """Median GPU time per launch, in microseconds, of a list of launches
    (callables) replayed together as one CUDA graph.

    The graph removes Python/launch overhead from the measurement (for a
    decode-sized kernel it can exceed the kernel itself); replaying
    different weight copies in one graph keeps the weights out of L2.
    ``triton.testing.do_bench`` times the replays (L2 flushed before each).
    ``outputs``, when given, gets what each captured call returned (the
    graph's own tensors, written by one replay before timing).
    """
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and compile) outside the capture
        for fn in launches:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [fn() for fn in launches]
    if outputs is not None:
        graph.replay()
        torch.cuda.synchronize()
        outputs.extend(captured)
    return 1e3 * do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") / len(launches)


def _select_fastest(configs, launch, error, time, max_err: float, label: str, record: list | None = None):
    """Fastest config whose result is right: ``(config, time, rejected)``; ``record``, when
    given, gets ``(config, time or None, status)`` for every candidate.

    ``launch(cfg)`` runs the kernel once, ``error(y)`` is y's relative error
    vs an fp64 reference (it syncs, so asynchronous launch failures surface
    inside the try), ``time(cfg)`` measures a config that passed.
    """
    best, record = None, [] if record is None else record
    start = len(record)
    for cfg in configs:
        try:
            err = error(launch(cfg))
        except Exception as e:  # e.g. out of shared memory on this GPU: not a candidate here
            record.append((cfg, None, f"failed: {type(e).__name__}: {str(e)[:120]}"))
            continue
        if not err <= max_err:  # a kernel bug, never a close call: say so loudly
            record.append((cfg, None, f"wrong result: relative error {err:.2e}"))
            print(f"sparse24 tuning: WRONG RESULT from {cfg} at {label}: relative error {err:.2e} > "
                  f"{max_err:.0e}; config rejected", file=sys.stderr)
            continue
        t = time(cfg)
        record.append((cfg, t, "ok"))
        if best is None or t < best[1]:
            best = (cfg, t)
    rejected = [f"{cfg}: {status}" for cfg, t, status in record[start:] if t is None]
    if best is None:
        raise RuntimeError(f"no candidate config ran correctly for {label}: " + "; ".join(rejected[:5]))
    return best[0], best[1], rejected


def _compile_variant(M: int, N: int, K: int, dtype: str, cfg: KernelConfig) -> tuple:
    """What makes two launches compile the same kernel: Triton specializes ints
    and strides on divisibility by 16 (:func:`~sparse24.ops.linear24.launch.int_specialization`:
    every integer argument, those the layout derives from K too), and the constexprs that
    follow from the shape: M's bucket (the sparse tensor-core kernel takes two mma per
    chunk past 8 rows), whether K fills whole K-tiles and whether each split owns one
    K-tile (no loop). (Without them the tuner compiled the M = 1 bucket's sparse-kernel
    variants of a shape in parallel and the M = 16 bucket's one by one while timing; without
    the derived ints, a K = 11008 shape's variants counted as K = 4096's.)"""
    tiles = -(-K // cfg.block_k)
    return (dtype, int_specialization(cfg, N, K, dtype.startswith("int")), cfg, m_bucket(M) > 8,
            K % cfg.block_k == 0, tiles == cfg.split_k)


def distinct_variants(tasks) -> list:
    """One ``(M, N, K, dtype, config)`` of ``tasks`` per distinct compiled kernel variant
    (:func:`_compile_variant`), in their order."""
    variants = {}
    for t in tasks:
        variants.setdefault(_compile_variant(*t), t)
    return list(variants.values())


def compile_variants(items: list, device, sparse_cores: bool | None = None) -> list[str]:
    """Compile (not run) the CUDA kernel of each ``(M, N, K, dtype, config)`` into Triton's disk
    cache, its arguments made on ``device`` (a GPU; or CPU tensors under a driver that only
    compiles: scripts/triton_prebuild.py, ``sparse_cores`` then as the target has them). Returns
    the errors, one message each."""
    errors, key, inputs = [], None, None
    for M, N, K, dtype, cfg in items:
        try:
            if (M, N, K, dtype) != key:   # (items come grouped by key: one key's inputs at a time)
                key, inputs = (M, N, K, dtype), _tuning_inputs(M, N, K, dtype, device, layout=runtime_layout(dtype))
            x, p, _ = inputs
            target = torch.empty(M, N, device=device, dtype=target_dtype(cfg, cfg.split_k, x.dtype))
            kernel, grid, args, kwargs = kernel_call(x, p, None, target, cfg, cfg.split_k, sparse_cores, cuda=True)
            kernel.warmup(*args, grid=grid, **kwargs)
        except Exception as e:  # reported; the timing pass skips configs that fail again
            errors.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
    return errors


def _compile_worker(items: list, device_index: int) -> list[str]:
    """Compile (not run) each (M, N, K, dtype, config) into Triton's disk cache."""
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    return compile_variants(items, device)


def _precompile(tasks: list, jobs: int, device: torch.device) -> int:
    """Compile every distinct kernel variant of ``tasks`` in ``jobs`` processes
    (Triton compiles one kernel per thread, seconds each; the timing pass then
    loads them from the disk cache). Returns the number of variants."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    items = distinct_variants(tasks)
    if jobs <= 1 or len(items) <= 1:
        errors = _compile_worker(items, device.index or 0)
    else:
        chunks = [items[i::jobs] for i in range(jobs)]
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as ex:
            errors = [e for r in ex.map(_compile_worker, chunks, [device.index or 0] * jobs) for e in r]
    if errors:
        print(f"  {len(errors)} variants did not compile (skipped when timing), e.g. {errors[0]}", file=sys.stderr)
    return len(items)


# --- files: writing ------------------------------------------------------------

def _entry_key(key: tuple) -> str:
    return ",".join(map(str, key))


def _tuned_file(out_dir: Path, gpu: str) -> Path:
    """This GPU's tuned-config file under ``out_dir``."""
    return Path(out_dir) / gpu_file_name(gpu) / f"{KERNEL}.json"


def tuned_keys(out_dir: Path, gpu: str) -> set:
    """The (M bucket, N, K, dtype) keys this GPU's file under ``out_dir`` holds (none for a
    missing or unreadable file: those are re-tuned; nor entries the installed Triton cannot
    run, which serve nothing here)."""
    try:
        return set(validate_file(config_store.read_file(_tuned_file(out_dir, gpu)))["entries"])
    except (OSError, *config_store.BAD_FILE_ERRORS):
        return set()


# Reading a file that is not JSON at all (garbage, cut short, not UTF-8, nested too deep): set aside.
_NOT_JSON = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)


def _read_for_merge(path: Path):
    """``(parsed, None)`` for this GPU's existing file (:func:`validate_file`'s result; None if
    there is none) or ``(None, error)`` for one that is not JSON (:func:`write_entries` moves it
    aside). A file that is JSON but not one this sparse24 merges into (another schema, a bad
    entry, a key written twice) raises ValueError naming it and what to do: overwriting it would
    throw its entries away."""
    try:
        return validate_file(config_store.read_file(path)), None
    except FileNotFoundError:
        return None, None
    except _NOT_JSON as e:
        return None, e
    except ValueError as e:
        raise ValueError(f"{path} is not a tuned-config file this sparse24 can merge into ({e}); nothing was "
                         f"written: fix or move that file, or tune into another folder (--out-dir)") from None


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``<file>.lock`` beside ``path`` (kept: removing it would let two
    writers lock two different files): concurrent autotune runs (one per GPU of a node, one
    per-model file) then read-merge-write one after another. Without ``fcntl`` (Windows) this
    does not lock: each write still replaces the file whole, but concurrent writers may lose
    each other's entries."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:   # another user's lock file in a folder we may write: flock needs no write access
        fd = os.open(lock, os.O_RDONLY)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)   # released when fd is closed
            except OSError as e:   # a file system without locks (some network mounts): write as without fcntl
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                print(f"sparse24: cannot lock {lock} ({e.strerror}); writing unlocked: tuning runs writing "
                      f"this file at the same time may lose each other's entries", file=sys.stderr)
        yield
    finally:
        os.close(fd)


def _set_aside(path: Path) -> Path:
    """Move a file that is not JSON to ``<name>.corrupt`` (``<name>.corrupt-<UTC time>[-n]`` when
    that is taken: an earlier copy is never overwritten); called under :func:`_locked`."""
    dest = path.with_name(path.name + ".corrupt")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n > 1 else ""))
    path.replace(dest)
    return dest


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a new temporary file beside ``path``, flushed to disk, and rename it over
    ``path``: a reader sees the old file or the new one, never part of one; a failure leaves
    the old file and no temporary one."""
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644   # (mkstemp makes 0600)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):   # the rename itself, on disk (POSIX)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_entries(out_dir: Path, gpu: str, capability: tuple[int, int], entries: dict) -> Path:
    """Merge ``entries`` ({(M bucket, N, K, dtype): entry}) into this GPU's file
    under ``out_dir`` (created if needed). The default becomes the config that wins most entries
    (prefill entries aside: the prefill route falls back to its model's choice, not to a file default).

    Safe for several processes at once (one autotune per GPU, one file): the read-merge-write
    holds an exclusive lock on ``<file>.lock`` and the new file replaces the old one whole.
    An old file that is not JSON is kept beside it as ``.corrupt`` (a timestamped name when
    that is taken). Raises ValueError, writing nothing, where the old file is JSON this sparse24
    does not merge into (another schema, a bad entry: :func:`_read_for_merge`) or a new entry is
    invalid; entries of the old file that the installed Triton cannot run are kept as they were."""
    import triton

    path = _tuned_file(out_dir, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        old, err = _read_for_merge(path)
        if err is not None:
            dest = _set_aside(path)
            print(f"sparse24: {path} was unreadable ({err}); moved to {dest.name}", file=sys.stderr)
        kept = {k: raw for k, (raw, _) in (old or {}).get("skipped", {}).items() if k not in entries}
        merged = {**(old or {}).get("entries", {}), **entries}
        wins: dict = {}
        for e in merged.values():   # the default serves keys without an entry: the prefill route has its model's
            if e["config"].kernel != "prefill":
                wins[e["config"]] = wins.get(e["config"], 0) + 1
        default = max(wins, key=wins.get) if wins else builtin_config(16)
        out = {k: dict(e, config=e["config"].to_json()) for k, e in merged.items()}
        out.update(kept)   # as read: a newer Triton runs them
        order = sorted(out, key=lambda k: (k[3], k[1], k[2], k[0]))  # dtype, N, K, M: readable diffs
        data = {
            "schema": SCHEMA_VERSION, "kernel": KERNEL, "gpu": gpu, "compute_capability": list(capability),
            "triton": triton.__version__, "torch": torch.__version__.split("+")[0],
            "updated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "default": default.to_json(),
            "entries": {_entry_key(k): out[k] for k in order},
        }
        text = json.dumps(data, indent=1) + "\n"
        check = validate_file(json.loads(text))  # never write what the reader would reject
        new_skipped = {k: why for k, (_, why) in check["skipped"].items() if k in entries}
        if new_skipped:   # the tuner never times one; a caller's entry this Triton cannot run is refused
            k, why = next(iter(new_skipped.items()))
            raise ValueError(f"entry {_entry_key(k)!r}: {why}")
        _replace_atomically(path, text)
    clear_cache()  # the store forgets what it read, and the launch path its plans
    return path


# --- CLI -----------------------------------------------------------------------

def _progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on a terminal, one line per step in a log."""
    bar = "#" * (20 * i // n) + "." * (20 - 20 * i // n)
    if sys.stderr.isatty():
        print(f"\r[{bar}] {i}/{n} {label:<60}", end="" if i < n else "\n", file=sys.stderr, flush=True)
    else:
        print(f"[{bar}] {i}/{n} {label}", file=sys.stderr, flush=True)


# The columns of ``autotune --timings``: one row per candidate config and key.
TIMING_COLUMNS = ("gpu", "m", "n", "k", "dtype", "kernel", "config", "kernel_us", "dense_us", "status")


def append_timings(path, gpu: str, rows: list[dict]) -> None:
    """Append ``rows`` (:func:`tune_key`'s ``timings``) to the CSV file ``path`` (header
    :data:`TIMING_COLUMNS` when the file is new or empty): every candidate's time, the data
    the untuned defaults are fitted to."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        out = csv.DictWriter(f, TIMING_COLUMNS)
        if new:
            out.writeheader()
        out.writerows(dict(r, gpu=gpu) for r in rows)


def autotune(shapes, ms, dtypes, out_dir, warmup_ms: float = 10, rep_ms: float = 40, jobs: int = 1,
             skip_tuned: bool = False, timings_csv=None) -> int:
    """Tune every (M bucket, N, K, dtype) on the current GPU and merge each result into
    ``<out_dir>/<GPU name>/sparse24_matmul.json`` as soon as it is measured
    (``python -m sparse24 autotune``, whose parser checks the arguments).

    Args:
        shapes: ``[(label, N, K), ...]`` (:func:`sparse24.tools.shapes.parse_shapes`).
        ms: M buckets; dtypes: dtype keys; out_dir: config folder.
        warmup_ms, rep_ms: timing budgets per candidate; jobs: parallel compile processes.
        skip_tuned: leave out the keys this GPU's file already holds (a run cut short by a time
            limit goes on where it stopped).
        timings_csv: a CSV file that gets every candidate's time, key by key (:func:`append_timings`).
    Returns:
        0 on success, 1 when there is no CUDA GPU or a key found no working config, 2 (as the
        CLI's other refusals of bad input, checked before any tuning) when ``out_dir`` cannot be
        written or this GPU's file there is JSON this sparse24 cannot merge into.
    """
    try:
        # before the GPU check, as bench checks --out (exit 2 without a GPU too)
        check_writable(out_dir, f"--out-dir {out_dir}")
    except CLIError as e:
        print(f"sparse24 autotune: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sparse24 autotune: error: no CUDA GPU found (torch.cuda.is_available() is False); tuning times kernels "
              "on the GPU it tunes for, so nothing was tuned or written.", file=sys.stderr)
        return 1

    device = torch.device("cuda", torch.cuda.current_device())
    gpu, cc = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    try:   # this GPU's folder, and a file there merges (found now, not after the first key's minutes)
        check_writable(_tuned_file(out_dir, gpu).parent, f"--out-dir {out_dir}")
        _read_for_merge(_tuned_file(out_dir, gpu))
    except (OSError, ValueError, CLIError) as e:
        print(f"sparse24 autotune: error: {e}", file=sys.stderr)
        return 2
    keys = [(m, n, k, dt) for dt in dtypes for _, n, k in shapes for m in ms]
    if skip_tuned:
        have = tuned_keys(out_dir, gpu)
        kept = [key for key in keys if key not in have]
        print(f"sparse24 autotune: {len(keys) - len(kept)} of {len(keys)} keys already tuned in {out_dir}; "
              f"skipped", file=sys.stderr)
        keys = kept
        if not keys:
            return 0
    tasks = [(m, n, k, dt, c) for m, n, k, dt in keys
             for c in _space_or_none(m, n, k, dt, device)]
    print(f"sparse24 autotune on {gpu} (sm_{cc[0]}{cc[1]}): {len(keys)} keys, {len(tasks)} timings", file=sys.stderr)
    n_var = _precompile(tasks, jobs, device)
    print(f"  compiled {n_var} kernel variants with {jobs} processes", file=sys.stderr)
    path, done, failed = None, 0, []
    for i, key in enumerate(keys, 1):
        rows = []
        try:
            e = tune_key(*key, device, warmup_ms=warmup_ms, rep_ms=rep_ms, timings=rows).entry
        except RuntimeError as err:
            failed.append(key)
            print(f"sparse24 autotune: {err}", file=sys.stderr)
            continue
        finally:
            if timings_csv is not None:
                append_timings(timings_csv, gpu, rows)
        # Merge after every key, so a run stopped early keeps what it measured.
        try:
            path = write_entries(out_dir, gpu, cc, {key: e})
        except (OSError, ValueError) as err:   # (a disk full; a file replaced meanwhile): what was written stays
            print(f"sparse24 autotune: error: writing M={key[0]} {key[1]}x{key[2]} {key[3]}: {err}; stopped after "
                  f"{done} keys written", file=sys.stderr)
            return 1
        done += 1
        unpack = f", unpack route {e['unpack_us']:.1f} us" if "unpack_us" in e else ""
        _progress(i, len(keys), f"M={key[0]} {key[1]}x{key[2]} {key[3]}: {e['kernel_us']:.1f} us "
                                f"(dense {e['dense_us']:.1f} us, {e['dense_us'] / e['kernel_us']:.2f}x{unpack})")
    print(f"wrote {done} entries to {path}" if done else "sparse24 autotune: nothing was written")
    return 1 if failed or not done else 0


config_store.set_live_tuner(tune_key)

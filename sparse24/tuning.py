"""Tile configs for the 2:4 Triton kernel: config space, per-GPU tuned files,
lookup, live tuning and the ``python -m sparse24 autotune`` command.

Files: ``<dir>/<sanitized GPU name>/sparse24_matmul.json``, where ``<dir>`` is
``$SPARSE24_CONFIG_DIR`` (searched first) and then the shipped
``sparse24/autotune_configs``. Schema (version 1)::

    {"schema": 1, "kernel": "sparse24_matmul",
     "gpu": "NVIDIA H200", "compute_capability": [9, 0],
     "triton": "3.6.0", "torch": "2.11.0", "updated": "2026-11-20T10:00:00Z",
     "default": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8,
                 "SPLIT_K": 1, "num_warps": 4, "num_stages": 3},
     "entries": {"16,4096,4096,float16": {"config": {...}, "kernel_us": 6.1,
                                          "dense_us": 9.8}}}

Entry keys are ``"<M bucket>,<N>,<K>,<dtype key>"``; dtype keys are the
activation dtype (``float16``, ``bfloat16``, ``float32``), prefixed ``int8-``
for INT8 weights. ``kernel_us`` / ``dense_us`` are medians measured side by
side (dense = ``F.linear`` on the dense fp weight) on that GPU.

Lookup order for (M, N, K, dtype) on a GPU: (1) exact key in this GPU's
file(s), (2) the nearest M bucket with the same N, K, dtype, (3) the same in
files of other GPUs with the same compute capability (the GPU family),
(4) this GPU's file default, (5) :func:`builtin_config`. A missing folder is
silent; a corrupt or schema-invalid file gives one warning and is skipped, so
a bad file can never crash a forward pass or pick an invalid config.
``SPARSE24_AUTOTUNE=1`` replaces steps 2-5 by timing the config space on the
spot (CUDA only; results kept for the process).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["KernelConfig", "KERNEL", "M_BUCKETS", "m_bucket", "dtype_key", "builtin_config", "candidate_configs",
           "config_dirs", "shipped_config_dir", "gpu_file_name", "get_config", "lookup", "clear_cache", "validate_file",
           "validate_dir", "write_entries", "measured_speedup", "time_launches_us",
           "describe_config_source", "tune_key", "autotune_main"]

KERNEL = "sparse24_matmul"
SCHEMA_VERSION = 1
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_KEYS = tuple(_DTYPE_NAMES.values()) + tuple(f"int8-{n}" for n in _DTYPE_NAMES.values())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the 2:4 kernel (names as in the kernel)."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    _JSON = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k", "GROUP_M": "group_m",
             "SPLIT_K": "split_k", "num_warps": "num_warps", "num_stages": "num_stages"}

    def validate(self) -> "KernelConfig":
        """Raise ValueError unless the kernel can compile this config on any GPU."""
        def pow2(v, lo, hi):
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi and v & (v - 1) == 0
        checks = [  # every tl.dot dim >= 16; BLOCK_K covers whole metadata words (32 columns)
            ("BLOCK_M", self.block_m, pow2(self.block_m, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_N", self.block_n, pow2(self.block_n, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_K", self.block_k, pow2(self.block_k, 32, 512), "a power of two in [32, 512]"),
            ("GROUP_M", self.group_m, isinstance(self.group_m, int) and 1 <= self.group_m <= 64, "in [1, 64]"),
            ("SPLIT_K", self.split_k, isinstance(self.split_k, int) and 1 <= self.split_k <= 32, "in [1, 32]"),
            ("num_warps", self.num_warps, pow2(self.num_warps, 1, 16), "1, 2, 4, 8 or 16"),
            ("num_stages", self.num_stages, isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8,
             "in [1, 8]"),
        ]
        for name, value, ok, need in checks:
            if not ok:
                raise ValueError(f"bad kernel config {name}={value!r}: must be {need}")
        return self

    def to_json(self) -> dict:
        """The config as a file stores it: ``{"BLOCK_M": ..., "num_stages": ...}``."""
        return {k: getattr(self, f) for k, f in self._JSON.items()}

    @classmethod
    def from_json(cls, d) -> "KernelConfig":
        if not isinstance(d, dict) or set(d) != set(cls._JSON):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a config must have exactly the keys {sorted(cls._JSON)}, got {got}")
        return cls(**{f: d[k] for k, f in cls._JSON.items()}).validate()


def m_bucket(M: int) -> int:
    """The smallest bucket >= M (powers of two, capped at 4096)."""
    return next((b for b in M_BUCKETS if b >= M), M_BUCKETS[-1])


def dtype_key(x_dtype: torch.dtype, int8_weights: bool = False) -> str:
    """``float16`` etc. for the activation dtype, prefixed ``int8-`` for INT8 weights."""
    name = _DTYPE_NAMES.get(x_dtype)
    if name is None:
        raise TypeError(f"no kernel configs for activations of dtype {x_dtype}")
    return f"int8-{name}" if int8_weights else name


def builtin_config(M: int) -> KernelConfig:
    """The untuned fallback: small tiles that compile on every CUDA GPU Triton
    supports (<= 48 KB of shared memory) and keep many programs in flight.
    Not measured: a tuned file or ``SPARSE24_AUTOTUNE=1`` should replace it."""
    if M <= 16:
        return KernelConfig(16, 64, 128, 8, 1, 4, 3)
    if M <= 64:
        return KernelConfig(32, 64, 64, 8, 1, 4, 3)
    return KernelConfig(64, 64, 64, 8, 1, 4, 3)


def candidate_configs(M: int, N: int, K: int, num_sms: int = 132) -> list[KernelConfig]:
    """The config space searched for one (M, N, K): small per regime, because
    every config is a separate compile (seconds each).

    Decode-sized M (<= 16) streams the weight once: one 16-row block, tiles
    from 16 x 256 to 128 x 64 along (N, K), and split-K while the programs
    stay within 4 per SM and each split keeps >= 2 K-tiles (more loads in
    flight when N alone gives few programs). Larger M is compute-bound:
    bigger square-ish tiles, more warps.
    """
    out: list[KernelConfig] = []
    if M <= 16:
        for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
            warps = 2 if bn * bk <= 4096 else 4
            programs = -(-N // bn)
            splits = [1] + [s for s in (2, 4, 8) if programs * s <= 4 * num_sms and K >= 2 * s * bk]
            out += [KernelConfig(16, bn, bk, 8, s, warps, stages) for s in splits for stages in (3, 5)]
    elif M <= 128:
        bms = (32,) if M <= 32 else (32, 64)
        for bm in bms:
            for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 32)):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    else:
        for bm, bn, bk in ((64, 64, 64), (64, 128, 32), (64, 128, 64), (128, 64, 64), (128, 128, 32),
                           (128, 128, 64), (128, 256, 32)):
            # 4 warps only up to 64 x 128 tiles: 128 x 256 x 32 with 4 warps
            # spills 1 KB and 128 x 128 x 64 needs 254 registers (sm_90 cubin,
            # scripts/kernel_static_check.py, Triton 3.9)
            for warps, stages in ((4, 3), (8, 3), (8, 4)) if bm * bn <= 64 * 128 else ((8, 3), (8, 4)):
                out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    return [c.validate() for c in out]


# --- files -------------------------------------------------------------------

def shipped_config_dir() -> Path:
    """The ``autotune_configs`` folder installed with the package."""
    try:
        import sparse24.autotune_configs as shipped
        return Path(shipped.__file__).parent
    except ImportError:  # running from a source tree that is not installed
        return Path(__file__).resolve().parent.parent / "autotune_configs"


def config_dirs() -> list[Path]:
    """Folders searched for tuned files: ``$SPARSE24_CONFIG_DIR`` first, then the shipped one."""
    dirs = [Path(d) for d in [os.environ.get("SPARSE24_CONFIG_DIR")] if d]
    return dirs + [shipped_config_dir()]


def gpu_file_name(gpu_name: str) -> str:
    """Folder name for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3"``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", gpu_name).strip("_") or "unknown"


def validate_file(data) -> dict:
    """Check a parsed tuned-config file against schema 1; return it with
    configs parsed (``default`` and each entry's ``config`` as KernelConfig).
    Raise ValueError saying what is wrong and where."""
    if not isinstance(data, dict):
        raise ValueError(f"top level must be an object, got {type(data).__name__}")
    need = {"schema": int, "kernel": str, "gpu": str, "compute_capability": list, "triton": str, "torch": str,
            "default": dict, "entries": dict}
    for key, typ in need.items():
        if not isinstance(data.get(key), typ):
            raise ValueError(f"field {key!r} must be a {typ.__name__}, got {data.get(key)!r:.60}")
    if data["schema"] != SCHEMA_VERSION:
        raise ValueError(f"schema {data['schema']} is not supported (this sparse24 reads schema {SCHEMA_VERSION})")
    if data["kernel"] != KERNEL:
        raise ValueError(f"kernel {data['kernel']!r} is not {KERNEL!r}")
    cc = data["compute_capability"]
    if len(cc) != 2 or not all(isinstance(c, int) for c in cc):
        raise ValueError(f"compute_capability must be [major, minor], got {cc}")
    parsed = dict(data, default=_parse_config(data["default"], "default"), entries={})
    for key, entry in data["entries"].items():
        where = f"entry {key!r}"
        parts = key.split(",")
        if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]) or parts[3] not in DTYPE_KEYS \
                or int(parts[0]) not in M_BUCKETS:
            raise ValueError(f"{where}: keys must be 'M_BUCKET,N,K,DTYPE' with M_BUCKET in {M_BUCKETS} "
                             f"and DTYPE in {DTYPE_KEYS}")
        if not isinstance(entry, dict) or "config" not in entry:
            raise ValueError(f"{where}: must be an object with a 'config'")
        for t in ("kernel_us", "dense_us"):
            if t in entry and not (isinstance(entry[t], (int, float)) and entry[t] > 0):
                raise ValueError(f"{where}: {t} must be a positive number, got {entry[t]!r}")
        parsed["entries"][(int(parts[0]), int(parts[1]), int(parts[2]), parts[3])] = \
            dict(entry, config=_parse_config(entry["config"], where))
    return parsed


def validate_dir(d) -> list[tuple[Path, str]]:
    """Check every tuned file under ``d`` (``<gpu>/sparse24_matmul.json``);
    return ``(path, problem)`` for each bad one (empty list: all good, or none).
    A file must also sit in the folder named after its own ``gpu`` field."""
    problems = []
    for path in sorted(Path(d).glob(f"*/{KERNEL}.json")):
        try:
            data = validate_file(json.loads(path.read_text()))
        except _BAD_FILE as e:
            problems.append((path, f"{type(e).__name__}: {e}"))
            continue
        if path.parent.name != gpu_file_name(data["gpu"]):
            problems.append((path, f"gpu {data['gpu']!r} belongs in folder {gpu_file_name(data['gpu'])!r}"))
    return problems


def _parse_config(d, where: str) -> KernelConfig:
    try:
        return KernelConfig.from_json(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


# What reading a corrupt file can raise (deeply nested JSON makes json.loads raise RecursionError).
_BAD_FILE = (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError)
_WARNED: set[str] = set()
_FILES: dict[tuple, list[dict]] = {}      # dirs -> parsed files (with their "path")
_CHOICES: dict[tuple, "Choice"] = {}      # (dirs, gpu, cc, key) -> lookup (or live-tuned) result


def clear_cache() -> None:
    """Forget loaded files and lookups (after writing a file, or changing the env)."""
    _FILES.clear()
    _CHOICES.clear()


def _warn_once(path: Path, problem: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(f"sparse24: ignoring tuned-config file {path}: {problem}. "
                      f"Falling back to other files or the built-in config (results stay correct, "
                      f"speed may not be tuned).", RuntimeWarning, stacklevel=4)


def _load_dir(d: Path) -> list[dict]:
    files = []
    for path in sorted(d.glob(f"*/{KERNEL}.json")) if d.is_dir() else []:
        try:
            data = validate_file(json.loads(path.read_text()))
        except _BAD_FILE as e:
            _warn_once(path, f"{type(e).__name__}: {e}")
            continue
        files.append(dict(data, path=path))
    return files


def _files() -> list[dict]:
    dirs = tuple(config_dirs())
    if dirs not in _FILES:
        _FILES[dirs] = [f for d in dirs for f in _load_dir(d)]
    return _FILES[dirs]


@dataclasses.dataclass(frozen=True)
class Choice:
    """A lookup result: the config, how it was found (``kind``: exact,
    nearest, family, file-default, builtin, live) and a sentence saying where."""
    config: KernelConfig
    kind: str
    source: str
    entry: dict | None = None


def _nearest_entry(files: list[dict], M: int, N: int, K: int, dtype: str):
    """(file, entry, bucket) of the nearest M bucket (in log2) for (N, K, dtype);
    ties go to the smaller M; earlier files (the user folder) win among equals."""
    best = None
    for f in files:
        for (bm, n, k, dt), entry in f["entries"].items():
            if (n, k, dt) == (N, K, dtype):
                dist = (abs(math.log2(bm) - math.log2(m_bucket(M))), bm)
                if best is None or dist < best[0]:
                    best = (dist, f, entry, bm)
    return None if best is None else best[1:]


def lookup(M: int, N: int, K: int, dtype: str, gpu_name: str, capability: tuple[int, int] | None) -> Choice:
    """The config for one call, following the lookup order in the module docstring.

    Args:
        M, N, K: problem size (x is M x K, W is N x K); dtype: a :func:`dtype_key`.
        gpu_name: ``torch.cuda.get_device_name()`` (or ``"cpu"``);
        capability: ``(major, minor)`` or None (CPU).
    Returns:
        :class:`Choice`.
    Example:
        >>> lookup(1, 4096, 4096, "float16", "cpu", None).kind
        'builtin'
    """
    files = _files()
    own = [f for f in files if gpu_file_name(f["gpu"]) == gpu_file_name(gpu_name)]
    family = [f for f in files if f not in own and capability is not None
              and tuple(f["compute_capability"]) == tuple(capability)]
    key = (m_bucket(M), N, K, dtype)
    for f in own:
        if key in f["entries"]:
            return Choice(f["entries"][key]["config"], "exact", f"exact entry {key} in {f['path']}",
                          f["entries"][key])
    for group, kind in ((own, "nearest"), (family, "family")):
        hit = _nearest_entry(group, M, N, K, dtype)
        if hit is not None:
            f, entry, bm = hit
            return Choice(entry["config"], kind, f"{kind} entry M={bm} for N={N}, K={K}, {dtype} in {f['path']}",
                          entry)
    if own:
        return Choice(own[0]["default"], "file-default", f"default of {own[0]['path']}")
    return Choice(builtin_config(M), "builtin", "built-in untuned config (no tuned file for this GPU)")


def _device_identity(device) -> tuple[str, tuple[int, int] | None]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device.type, None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


def get_config(M: int, N: int, K: int, dtype: str, device) -> KernelConfig:
    """Config for a launch on ``device``: :func:`lookup`, or live tuning when
    ``SPARSE24_AUTOTUNE=1`` on CUDA and no exact entry exists. Cached per
    process (:func:`clear_cache` forgets). CPU tensors (interpreter) get the
    built-in config."""
    gpu, cc = _device_identity(device)
    cache_key = (tuple(config_dirs()), gpu, cc, (m_bucket(M), N, K, dtype))
    choice = _CHOICES.get(cache_key)
    if choice is None:
        choice = lookup(M, N, K, dtype, gpu, cc)
        if os.environ.get("SPARSE24_AUTOTUNE") == "1" and cc is not None and choice.kind != "exact":
            choice = tune_key(m_bucket(M), N, K, dtype, torch.device(device))
        _CHOICES[cache_key] = choice
    return choice.config


def measured_speedup(M: int, N: int, K: int, dtype: str, device=None) -> float | None:
    """Dense ``F.linear`` time over kernel time, as measured side by side by
    the tuner on this GPU (the exact or nearest-M entry of its own file);
    None when this GPU has no such measurement. Lets a dispatcher prefer
    dense where the kernel measured slower (typically large M)."""
    gpu, cc = _device_identity(device)
    choice = lookup(M, N, K, dtype, gpu, cc)
    # both timings are optional in a file; a speed-up needs the two of them
    if choice.kind not in ("exact", "nearest") or not choice.entry or not {"dense_us", "kernel_us"} <= set(choice.entry):
        return None
    return choice.entry["dense_us"] / choice.entry["kernel_us"]


def describe_config_source(device=None) -> str:
    """Which tuned-config files apply on ``device`` (default: the current GPU) and why.

    Example:
        >>> print(describe_config_source("cpu"))  # doctest: +ELLIPSIS
        device cpu: ...
    """
    gpu, cc = _device_identity(device)
    dirs = config_dirs()
    files = _files()
    lines = [f"device {gpu}" + (f" (compute capability {cc[0]}.{cc[1]})" if cc else "") + ":"]
    lines.append("  searched, in order: " + ", ".join(
        f"{d}{'' if d.is_dir() else ' (a file, not a folder)' if d.exists() else ' (missing)'}" for d in dirs)
        + (" [SPARSE24_CONFIG_DIR first]" if os.environ.get("SPARSE24_CONFIG_DIR") else ""))
    if cc is None:
        lines.append("  not a CUDA device: the Triton backend runs in the interpreter with built-in configs")
        return "\n".join(lines)
    own = [f for f in files if gpu_file_name(f["gpu"]) == gpu_file_name(gpu)]
    family = [f for f in files if f not in own and tuple(f["compute_capability"]) == tuple(cc)]
    for f in own:
        lines.append(f"  tuned file for this GPU: {f['path']} ({len(f['entries'])} entries, triton {f['triton']}, "
                     f"torch {f['torch']}): exact and nearest-M entries come from here")
    for f in family:
        lines.append(f"  same family (sm_{cc[0]}{cc[1]}): {f['path']} ({f['gpu']}, {len(f['entries'])} entries): "
                     f"used for shapes this GPU's file lacks")
    if not own:
        lines.append(f"  no tuned file for '{gpu}' (folder {gpu_file_name(gpu)}): "
                     + ("family files, then " if family else "") + "built-in untuned configs; run "
                     "'python -m sparse24 autotune' to tune")
    if os.environ.get("SPARSE24_AUTOTUNE") == "1":
        lines.append("  SPARSE24_AUTOTUNE=1: shapes without an exact entry are tuned live on first use")
    return "\n".join(lines)


# --- measuring (CUDA) ----------------------------------------------------------

_ACT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Largest relative Frobenius error (vs fp64) a tuning candidate may show before
# it is rejected: ~4 unit round-offs of the output dtype. A mis-decoding config
# is off by O(1), so this only rejects broken configs, never close calls.
_MAX_REL_ERR = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}


def _tuning_inputs(M: int, N: int, K: int, dtype: str, device, seed: int = 0):
    """Random x (M, K), compressed weight p (N, K) and its dense twin, as tuned."""
    from .format import compress
    from .quant import quantize_values

    act = _ACT[dtype.removeprefix("int8-")]
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=gen, device=device).to(act)
    p = compress(w)
    if dtype.startswith("int8-"):
        p = quantize_values(p, "int8")
    x = torch.randn(M, K, generator=gen, device=device).to(act)
    return x, p, p.to_dense().to(act)


def tune_key(M: int, N: int, K: int, dtype: str, device, configs=None, warmup_ms: float = 10,
             rep_ms: float = 40) -> Choice:
    """Time the config space for one key on a CUDA device; return the fastest
    config that also computes the right result.

    Args:
        M, N, K: sizes (M is used as given: pass the bucket); dtype: a dtype key.
        device: a CUDA device. configs: candidates (default :func:`candidate_configs`).
        warmup_ms, rep_ms: timing budgets per candidate (see :func:`time_launches_us`).
    Returns:
        :class:`Choice` with ``kind="live"`` and ``entry = {"config", "kernel_us",
        "dense_us", "m"}`` (dense = ``F.linear`` on the dense weight in the activation dtype).
    """
    import torch.nn.functional as F

    from .ops.triton_linear import linear_triton

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tuning times kernels on a CUDA device, got {device}")
    x, p, w_dense = _tuning_inputs(M, N, K, dtype, device)
    ref = F.linear(x.double(), w_dense.double())
    tf32 = dtype.endswith("float32") and torch.backends.cuda.matmul.allow_tf32
    max_err = 2e-3 if tf32 else _MAX_REL_ERR[dtype.removeprefix("int8-")]
    props = torch.cuda.get_device_properties(device)
    # Enough weight copies to overflow L2 twice, so every launch streams its
    # weight from HBM as in a real model (one 4096 x 4096 fp16 2:4 weight,
    # 18.9 MB, would otherwise sit in an H100/H200's 50-60 MB L2).
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    weights = [p] + [_clone_weight(p) for _ in range(_copies(l2, p.nbytes) - 1)]
    dense_weights = [w_dense] + [w_dense.clone() for _ in range(_copies(l2, w_dense.nbytes) - 1)]

    def kernel_time(cfg) -> float:
        return time_launches_us([lambda q=q: linear_triton(x, q, config=cfg) for q in weights], warmup_ms, rep_ms)

    best_cfg, best_us, rejected = _select_fastest(
        configs if configs is not None else candidate_configs(M, N, K, props.multi_processor_count),
        launch=lambda cfg: linear_triton(x, p, config=cfg),
        error=lambda y: float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)),
        time=kernel_time, max_err=max_err, label=f"M={M}, N={N}, K={K}, {dtype}")
    dense_us = time_launches_us([lambda w=w: F.linear(x, w) for w in dense_weights], warmup_ms, rep_ms)
    entry = {"config": best_cfg, "kernel_us": round(best_us, 3), "dense_us": round(dense_us, 3), "m": M}
    return Choice(best_cfg, "live", f"tuned live on {torch.cuda.get_device_name(device)} "
                                    f"({len(rejected)} candidates rejected)", entry)


def _copies(l2_bytes: int, nbytes: int) -> int:
    return min(16, max(1, -(-2 * l2_bytes // max(nbytes, 1))))


def _clone_weight(p):
    from .format import Sparse24Tensor
    return Sparse24Tensor(p.values.clone(), p.meta.clone(), p.shape, p.dtype,
                          None if p.scale is None else p.scale.clone(), check=False)


def time_launches_us(launches, warmup_ms: float = 10, rep_ms: float = 40) -> float:
    """Median GPU time per launch, in microseconds, of a list of launches
    (callables) replayed together as one CUDA graph.

    The graph removes Python/launch overhead from the measurement (for a
    decode-sized kernel it can exceed the kernel itself); replaying
    different weight copies in one graph keeps the weights out of L2.
    ``triton.testing.do_bench`` times the replays (L2 flushed before each).
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
        for fn in launches:
            fn()
    return 1e3 * do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") / len(launches)


def _select_fastest(configs, launch, error, time, max_err: float, label: str):
    """Fastest config whose result is right: ``(config, time, rejected)``.

    ``launch(cfg)`` runs the kernel once, ``error(y)`` is y's relative error
    vs an fp64 reference (it syncs, so asynchronous launch failures surface
    inside the try), ``time(cfg)`` measures a config that passed.
    """
    best, rejected = None, []
    for cfg in configs:
        try:
            err = error(launch(cfg))
        except Exception as e:  # e.g. out of shared memory on this GPU: not a candidate here
            rejected.append(f"{cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not err <= max_err:  # a kernel bug, never a close call: say so loudly
            rejected.append(f"{cfg}: wrong result (relative error {err:.2e})")
            print(f"sparse24 tuning: WRONG RESULT from {cfg} at {label}: relative error {err:.2e} > "
                  f"{max_err:.0e}; config rejected", file=sys.stderr)
            continue
        t = time(cfg)
        if best is None or t < best[1]:
            best = (cfg, t)
    if best is None:
        raise RuntimeError(f"no candidate config ran correctly for {label}: " + "; ".join(rejected[:5]))
    return best[0], best[1], rejected


def _compile_variant(M: int, N: int, K: int, dtype: str, cfg: KernelConfig) -> tuple:
    """What makes two launches compile the same kernel: Triton specializes ints
    and strides on divisibility by 16 (M is not specialized)."""
    return (dtype, N % 16 == 0, K % 16 == 0, (K // 2) % 16 == 0, cfg)


def _compile_worker(items: list, device_index: int) -> list[str]:
    """Compile (not run) each (M, N, K, dtype, config) into Triton's disk cache."""
    from .ops.triton_linear import kernel_call

    errors = []
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    for M, N, K, dtype, cfg in items:
        try:
            x, p, _ = _tuning_inputs(M, N, K, dtype, device)
            target = torch.empty(M, N, device=device, dtype=torch.float32 if cfg.split_k > 1 else x.dtype)
            kernel, grid, args, kwargs = kernel_call(x, p, None, target, cfg, cfg.split_k)
            kernel.warmup(*args, grid=grid, **kwargs)
        except Exception as e:  # reported; the timing pass skips configs that fail again
            errors.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
    return errors


def _precompile(tasks: list, jobs: int, device: torch.device) -> int:
    """Compile every distinct kernel variant of ``tasks`` in ``jobs`` processes
    (Triton compiles one kernel per thread, seconds each; the timing pass then
    loads them from the disk cache). Returns the number of variants."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    variants = {}
    for t in tasks:
        variants.setdefault(_compile_variant(*t), t)
    items = list(variants.values())
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


def write_entries(out_dir: Path, gpu: str, capability: tuple[int, int], entries: dict) -> Path:
    """Merge ``entries`` ({(M bucket, N, K, dtype): entry}) into this GPU's file
    under ``out_dir`` (created if needed; a corrupt old file is kept beside it
    as ``.corrupt``). The default becomes the config that wins most entries."""
    import triton

    path = Path(out_dir) / gpu_file_name(gpu) / f"{KERNEL}.json"
    old: dict = {}
    if path.exists():
        try:
            old = validate_file(json.loads(path.read_text()))["entries"]
        except _BAD_FILE as e:
            path.replace(path.with_suffix(".json.corrupt"))
            print(f"sparse24: {path} was unreadable ({e}); moved to {path.name}.corrupt", file=sys.stderr)
    merged = {**old, **entries}
    wins: dict = {}
    for e in merged.values():
        wins[e["config"]] = wins.get(e["config"], 0) + 1
    default = max(wins, key=wins.get) if wins else builtin_config(16)
    order = sorted(merged, key=lambda k: (k[3], k[1], k[2], k[0]))  # dtype, N, K, M: readable diffs
    data = {
        "schema": SCHEMA_VERSION, "kernel": KERNEL, "gpu": gpu, "compute_capability": list(capability),
        "triton": triton.__version__, "torch": torch.__version__.split("+")[0],
        "updated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "default": default.to_json(),
        "entries": {_entry_key(k): dict(merged[k], config=merged[k]["config"].to_json()) for k in order},
    }
    validate_file(json.loads(json.dumps(data)))  # never write what the reader would reject
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    clear_cache()
    return path


# --- CLI -----------------------------------------------------------------------

def _progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on a terminal, one line per step in a log."""
    bar = "#" * (20 * i // n) + "." * (20 - 20 * i // n)
    if sys.stderr.isatty():
        print(f"\r[{bar}] {i}/{n} {label:<60}", end="" if i < n else "\n", file=sys.stderr, flush=True)
    else:
        print(f"[{bar}] {i}/{n} {label}", file=sys.stderr, flush=True)


def autotune_main(argv: list[str]) -> int:
    """``python -m sparse24 autotune [--shapes NAME|N,K ...] [--m 1,2,4,...] [--dtype ...] [--out-dir DIR]``.

    Tunes every (M bucket, N, K, dtype) on the current GPU and merges each
    result into ``<out-dir>/<GPU name>/sparse24_matmul.json`` as soon as it
    is measured. Returns 0 on success, 1 when there is no CUDA GPU or a key
    found no working config, 2 on bad arguments.
    """
    from .cli import CLIError, _choices, _int_list, _Parser  # the other commands' one-line argument errors
    from .shapes import parse_shapes

    ap = _Parser(prog="python -m sparse24 autotune",
                 description="Tune the 2:4 Triton kernel's tile configs on this GPU and save them.")
    ap.add_argument("--shapes", nargs="+", default=["standard"],
                    help="weight shapes: names from sparse24.shapes (standard, llama-7b, ...) or N,K "
                         "(default: standard)")
    ap.add_argument("--m", default=",".join(map(str, M_BUCKETS)),
                    help="batch sizes, comma-separated; each maps to its M bucket (default: all buckets)")
    ap.add_argument("--dtype", default="float16", help=f"comma-separated, from {', '.join(DTYPE_KEYS)} "
                                                       "(int8-X: INT8 weights, X activations)")
    ap.add_argument("--out-dir", default=None, help="config folder (default: $SPARSE24_CONFIG_DIR, "
                                                    "else the package's autotune_configs)")
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel compile processes")
    try:
        args = ap.parse_args(argv)
        shapes = parse_shapes(args.shapes)
        ms = sorted({m_bucket(m) for m in _int_list(args.m, "--m")})
        dtypes = _choices(args.dtype, DTYPE_KEYS, "--dtype")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if not (0 <= args.warmup_ms < math.inf and 0 < args.rep_ms < math.inf):
            raise ValueError(f"--warmup-ms must be >= 0 and --rep-ms > 0, got {args.warmup_ms} and {args.rep_ms}")
        out_dir = Path(args.out_dir or os.environ.get("SPARSE24_CONFIG_DIR") or shipped_config_dir())
        if out_dir.exists() and not out_dir.is_dir():  # found before tuning, not after minutes of it
            raise ValueError(f"config folder {out_dir} is a file")
    except (CLIError, ValueError) as e:
        print(f"sparse24 autotune: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sparse24 autotune: error: no CUDA GPU found (torch.cuda.is_available() is False); tuning times kernels "
              "on the GPU it tunes for, so nothing was tuned or written.", file=sys.stderr)
        return 1

    device = torch.device("cuda", torch.cuda.current_device())
    gpu, cc = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    keys = [(m, n, k, dt) for dt in dtypes for _, n, k in shapes for m in ms]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    tasks = [(m, n, k, dt, c) for m, n, k, dt in keys for c in candidate_configs(m, n, k, num_sms)]
    print(f"sparse24 autotune on {gpu} (sm_{cc[0]}{cc[1]}): {len(keys)} keys, {len(tasks)} timings", file=sys.stderr)
    n_var = _precompile(tasks, args.jobs, device)
    print(f"  compiled {n_var} kernel variants with {args.jobs} processes", file=sys.stderr)
    path, done, failed = None, 0, []
    for i, key in enumerate(keys, 1):
        try:
            e = tune_key(*key, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).entry
        except RuntimeError as err:
            failed.append(key)
            print(f"sparse24 autotune: {err}", file=sys.stderr)
            continue
        # Merge after every key, so a run stopped early keeps what it measured.
        path = write_entries(out_dir, gpu, cc, {key: e})
        done += 1
        _progress(i, len(keys), f"M={key[0]} {key[1]}x{key[2]} {key[3]}: {e['kernel_us']:.1f} us "
                                f"(dense {e['dense_us']:.1f} us, {e['dense_us'] / e['kernel_us']:.2f}x)")
    print(f"wrote {done} entries to {path}" if done else "sparse24 autotune: nothing was written")
    return 1 if failed or not done else 0

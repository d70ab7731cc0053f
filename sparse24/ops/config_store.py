"""Per-GPU tuned-config files for the 2:4 Triton kernels: where they are,
what a valid one holds, and the lookup a launch makes (once per shape: the
launch path caches the answer).

Files: ``<dir>/<sanitized GPU name>/sparse24_matmul.json``, where ``<dir>`` is
``$SPARSE24_CONFIG_DIR`` (searched first) and then the shipped
``sparse24/autotune_configs``. Schema (version 2)::

    {"schema": 2, "kernel": "sparse24_matmul",
     "gpu": "NVIDIA H200", "compute_capability": [9, 0],
     "triton": "3.6.0", "torch": "2.11.0", "updated": "2026-11-20T10:00:00Z",
     "default": {"KERNEL": "matmul", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
                 "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3},
     "entries": {"16,4096,4096,float16": {"config": {...}, "kernel_us": 6.1,
                                          "dense_us": 9.8, "reference_us": 31.0}}}

Entry keys are ``"<M bucket>,<N>,<K>,<dtype key>"``; dtype keys are the
activation dtype (``float16``, ``bfloat16``, ``float32``), prefixed ``int8-``
for INT8 weights. ``kernel_us`` / ``dense_us`` / ``reference_us`` are medians
measured side by side on that GPU: the kernel, dense ``F.linear`` on the dense
fp weight, and the reference backend (row-block decompression + dense GEMM);
``backend="auto"`` dispatches to the faster of kernel and reference. A decode-layout
entry past 16 rows with 16-bit x may hold ``unpack_us`` too (the weight unpacked into
a dense scratch, then cuBLAS): the route takes the faster of it and the prefill
kernel (``sparse24.ops.linear24.op.prefill_backend``). Schema 1
files (before kernel variants existed) are rejected with a message to re-tune.

Lookup order for (M, N, K, dtype) on a GPU: (1) exact key in this GPU's
file(s), (2) the nearest M bucket with the same N, K, dtype, (3) the same in
files of other GPUs with the same compute capability (the GPU family: NVIDIA GPUs only, in
NVIDIA's numbering; a ROCm GPU's "capability", e.g. an MI250X's 9.0, is AMD's, and the kernels
do not run there),
(4) this GPU's file default, for a dtype key the file has entries of (an H200 tune cut short
after six float16 keys would otherwise have set INT8, INT4 and bfloat16 configs untimed) where
its grid keeps the SMs as busy as the built-in's and splits K no finer than its tiles (a winner
at 4096 x 4096 would leave idle SMs at 1024 x 4096),
(5) :func:`~sparse24.ops.config_space.builtin_config`.
A missing folder is silent; a corrupt or schema-invalid file (a key written twice
included) gives one warning and is skipped, so a bad file can never crash a forward
pass or pick an invalid config. An entry the installed Triton cannot run (a prefill
tile that needs a newer one) is skipped with one warning naming it; the rest of
its file is used. Files are read as UTF-8, a leading BOM allowed. On CPU the
device name is ``"cpu"``: a file whose ``gpu`` is ``"cpu"`` (nothing the tuner
writes: it tunes on CUDA) serves CPU tensors like a GPU's own file; no GPU's file does.
``SPARSE24_AUTOTUNE=1`` replaces steps 2-5 by timing the config space on the spot
(CUDA only; results kept for the process): the tuner lives in the tools layer
(:mod:`sparse24.tools.tuning`) and plugs itself in with :func:`set_live_tuner`, so
this store never imports upward.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import torch

from .._checks import warn_user
from .config_space import (DECODE_M, DTYPE_KEYS, LAYOUT_KERNEL, M_BUCKETS, SP_MAX_M, KernelConfig, builtin_config,
                           check_decode_config, check_prefill_config, check_prefill_runs, decode_rows, m_bucket,
                           sp_tunable, sparse_kernel)

__all__ = ["KERNEL", "SCHEMA_VERSION", "TIMINGS", "Choice", "DeviceInfo", "device_info", "shared_memory_limit",
           "config_dirs", "shipped_config_dir", "gpu_file_name", "read_file", "validate_file", "validate_dir", "lookup",
           "get_choice", "get_config", "measured_timings", "clear_cache", "on_clear", "describe_config_source",
           "set_live_tuner"]

KERNEL = "sparse24_matmul"
SCHEMA_VERSION = 2
# Optional per-entry timings (microseconds, medians measured side by side).
TIMINGS = ("kernel_us", "dense_us", "reference_us", "unpack_us")


def shipped_config_dir() -> Path:
    """The ``autotune_configs`` folder installed with the package."""
    try:
        import sparse24.autotune_configs as shipped
        return Path(shipped.__file__).parent
    except ImportError:  # running from a source tree that is not installed
        return Path(__file__).resolve().parents[2] / "autotune_configs"


def config_dirs() -> list[Path]:
    """Folders searched for tuned files: ``$SPARSE24_CONFIG_DIR`` first, then the shipped one."""
    dirs = [Path(d) for d in [os.environ.get("SPARSE24_CONFIG_DIR")] if d]
    return dirs + [shipped_config_dir()]


def gpu_file_name(gpu_name: str) -> str:
    """Folder name for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3"``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", gpu_name).strip("_") or "unknown"


def _unique_keys(pairs: list) -> dict:
    """``object_pairs_hook`` of :func:`read_file`: a key written twice (a hand edit) is refused,
    not read as its last value."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} is written twice in one object (which one is meant?); keep one")
        out[k] = v
    return out


def read_file(path) -> dict:
    """A tuned-config file parsed (UTF-8, a leading BOM allowed; a key written twice refused
    with ValueError), not yet validated: pass it to :func:`validate_file`."""
    return json.loads(Path(path).read_text(encoding="utf-8-sig"), object_pairs_hook=_unique_keys)


def validate_file(data) -> dict:
    """Check a parsed tuned-config file against the schema; return it with
    configs parsed (``default`` and each entry's ``config`` as KernelConfig).
    Raise ValueError saying what is wrong and where.

    An entry the installed Triton cannot run (a prefill tile that needs a newer one), but
    otherwise valid, is not an error: it is left out of ``entries`` and listed in
    ``skipped`` (``{key: (entry as read, reason)}``), the rest of the file used."""
    if not isinstance(data, dict):
        raise ValueError(f"top level must be an object, got {type(data).__name__}")
    need = {"schema": int, "kernel": str, "gpu": str, "compute_capability": list, "triton": str, "torch": str,
            "default": dict, "entries": dict}
    for key, typ in need.items():
        if not isinstance(data.get(key), typ):
            raise ValueError(f"field {key!r} must be a {typ.__name__}, got {data.get(key)!r:.60}")
    if data["schema"] != SCHEMA_VERSION:
        hint = "; re-tune with 'python -m sparse24 autotune'" if data["schema"] < SCHEMA_VERSION else ""
        raise ValueError(f"schema {data['schema']} is not supported (this sparse24 reads schema {SCHEMA_VERSION}){hint}")
    if data["kernel"] != KERNEL:
        raise ValueError(f"kernel {data['kernel']!r} is not {KERNEL!r}")
    cc = data["compute_capability"]
    if len(cc) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) for c in cc):
        raise ValueError(f"compute_capability must be [major, minor], got {cc}")
    parsed = dict(data, default=_parse_config(data["default"], "default"), entries={}, skipped={})
    _check_shared_memory(parsed["default"], "default")
    for key, entry in data["entries"].items():
        where = f"entry {key!r}"
        parts = key.split(",")
        # numbers as written by str(int): '01,64,...' would be a second key for '1,64,...'
        if len(parts) != 4 or not all(p.isdigit() and str(int(p)) == p for p in parts[:3]) \
                or parts[3] not in DTYPE_KEYS or int(parts[0]) not in M_BUCKETS or int(parts[2]) % 4:
            raise ValueError(f"{where}: keys must be 'M_BUCKET,N,K,DTYPE' with M_BUCKET in {M_BUCKETS}, K a "
                             f"multiple of 4 and DTYPE in {DTYPE_KEYS}")
        if not isinstance(entry, dict) or "config" not in entry:
            raise ValueError(f"{where}: must be an object with a 'config'")
        for t in TIMINGS:
            v = entry.get(t, 1.0)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"{where}: {t} must be a positive finite number, got {entry[t]!r}")
        config = _parse_config(entry["config"], where)
        _check_shared_memory(config, where)
        k = (int(parts[0]), int(parts[1]), int(parts[2]), parts[3])
        if config.kernel == "decode":
            _check_decode_entry(config, int(parts[0]), parts[3], where)
        elif config.kernel == "prefill":
            _check_prefill_entry(config, int(parts[0]), parts[3], where)
            try:   # what the installed Triton runs: another environment reading the file may run it
                check_prefill_runs(config)
            except ValueError as e:
                parsed["skipped"][k] = (entry, str(e))
                continue
        parsed["entries"][k] = dict(entry, config=config)
    return parsed


def _serves(config: KernelConfig, M: int, dtype: str) -> bool:
    """Whether a config tuned for another M (a nearest entry, a file's default) is the kind
    its kernel takes at M: a decode-kernel config with :func:`decode_rows` rows per program (or
    the sparse tensor-core kernel's 32 where :func:`sp_tunable`); a prefill config of at most 64
    rows per program at 17-64 rows (the space there)."""
    if config.kernel == "prefill":
        return config.block_m <= 64 or m_bucket(M) > 64
    bucket = m_bucket(M)
    return config.kernel != "decode" or config.block_m == decode_rows(bucket, dtype) \
        or config.block_m == 32 and sp_tunable(bucket, dtype)


def _check_prefill_entry(config: KernelConfig, bucket: int, dtype: str, where: str) -> None:
    """A prefill-kernel entry must be one of the kernel's configs, at a bucket its route takes:
    past 16 rows, and with 16-bit x past SP_MAX_M rows. (Whether the installed Triton runs
    it is not checked here: :func:`validate_file` skips that entry alone.)"""
    try:
        check_prefill_config(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if bucket <= DECODE_M or decode_rows(bucket, dtype) == 32:
        raise ValueError(f"{where}: a prefill entry at M bucket {bucket} for {dtype}: the prefill kernel runs past "
                         f"{DECODE_M} rows (INT8 / INT4 weights with float16 / bfloat16 x: past {SP_MAX_M})")


# The most shared memory one program may have on any CUDA GPU (sm_90's 227 KiB opt-in)
_MAX_SHARED = 227 * 1024


def _check_shared_memory(config: KernelConfig, where: str) -> None:
    """A general-kernel (layout v1) config whose pipeline cannot fit any GPU's shared memory, counted
    low (16-bit x, no layout conversions): its first launch would fail, on every forward pass."""
    if config.kernel != "matmul":   # (the decode and prefill entries are checked against their spaces)
        return
    per_stage = config.block_m * config.block_k * 2 + config.block_n * config.block_k + config.block_n * config.block_k // 16
    if config.num_stages * per_stage > _MAX_SHARED:
        raise ValueError(f"{where}: {config} needs at least {config.num_stages * per_stage // 1024} KiB of shared "
                         f"memory ({config.num_stages} stages), more than any GPU gives a program "
                         f"({_MAX_SHARED // 1024} KiB)")


def _check_decode_entry(config: KernelConfig, bucket: int, dtype: str, where: str) -> None:
    """A decode-kernel entry must be one its kernel runs at that bucket: 32 rows per program
    only for the sparse tensor-core kernel (16-bit x, 17 to SP_MAX_M rows)."""
    try:
        check_decode_config(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if config.block_m != 16 and not _serves(config, bucket, dtype):
        raise ValueError(f"{where}: BLOCK_M {config.block_m} in a decode entry: 32 rows per program only for "
                         f"float16 / bfloat16 x at M buckets {DECODE_M * 2}-{SP_MAX_M}")
    if config.block_m == 16 and not sparse_kernel(dtype) and config.num_warps != config.block_n // 16:
        # 16 rows of a 16-bit weight or of float32 x: the byte-permute kernel's one tile per warp (its
        # launch refuses the others, on every call a forward pass makes)
        raise ValueError(f"{where}: a {dtype} decode entry of 16 rows runs the byte-permute kernel, which needs "
                         f"num_warps == block_n // 16 (got {config.num_warps} warps for block_n {config.block_n})")


def validate_dir(d) -> list[tuple[Path, str]]:
    """Check every tuned file under ``d`` (``<gpu>/sparse24_matmul.json``);
    return ``(path, problem)`` for each bad one (empty list: all good, or none).
    A file must also sit in the folder named after its own ``gpu`` field."""
    problems = []
    for path in sorted(Path(d).glob(f"*/{KERNEL}.json")):
        try:
            data = validate_file(read_file(path))
        except BAD_FILE_ERRORS as e:
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
BAD_FILE_ERRORS = (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError)
_WARNED: set[str] = set()
_FILES: dict[tuple, list[dict]] = {}      # dirs -> parsed files (with their "path")
_CHOICES: dict[tuple, "Choice"] = {}      # (dirs, gpu, cc, key) -> lookup (or live-tuned) result


_ON_CLEAR: list = []  # what callers above cached from lookups (the launch plans), cleared with them


def on_clear(forget) -> None:
    """Have :func:`clear_cache` also call ``forget()`` (for caches built from lookups)."""
    _ON_CLEAR.append(forget)


def clear_cache() -> None:
    """Forget loaded files and lookups (after writing a file, or changing the env),
    and everything cached from them."""
    _FILES.clear()
    _CHOICES.clear()
    for forget in _ON_CLEAR:
        forget()


def _warn_once(path: Path, problem: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warn_user(f"sparse24: ignoring tuned-config file {path}: {problem}. "
                  f"Falling back to other files or the built-in config (results stay correct, "
                  f"speed may not be tuned).", RuntimeWarning)


def _load_dir(d: Path) -> list[dict]:
    files = []
    for path in sorted(d.glob(f"*/{KERNEL}.json")) if d.is_dir() else []:
        try:
            data = validate_file(read_file(path))
        except BAD_FILE_ERRORS as e:
            _warn_once(path, f"{type(e).__name__}: {e}")
            continue
        if data["skipped"] and f"{path}:skipped" not in _WARNED:
            _WARNED.add(f"{path}:skipped")
            warn_user(f"sparse24: tuned-config file {path}: skipping {len(data['skipped'])} entries the "
                      f"installed Triton cannot run (" + "; ".join(
                          f"{','.join(map(str, k))!r}: {why}" for k, (_, why) in data["skipped"].items())
                      + f"); its other {len(data['entries'])} entries are used.", RuntimeWarning)
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


def _nearest_entry(files: list[dict], M: int, N: int, K: int, dtype: str, kernel: str):
    """(file, entry, bucket) of the nearest M bucket (in log2) for (N, K, dtype) among entries
    of ``kernel`` that :func:`_serves` M; ties go to the smaller M; earlier files (the user
    folder) win among equals."""
    best = None
    for f in files:
        for (bm, n, k, dt), entry in f["entries"].items():
            if (n, k, dt) == (N, K, dtype) and entry["config"].kernel == kernel and _serves(entry["config"], M, dtype):
                dist = (abs(math.log2(bm) - math.log2(m_bucket(M))), bm)
                if best is None or dist < best[0]:
                    best = (dist, f, entry, bm)
    return None if best is None else best[1:]


def lookup(M: int, N: int, K: int, dtype: str, gpu_name: str, capability: tuple[int, int] | None,
           num_sms: int = 132, layout: str = "v1", kernel: str | None = None, *, nvidia: bool | None = None,
           shared_memory: int | None = None) -> Choice:
    """The config for one call, following the lookup order in the module docstring.

    Args:
        M, N, K: problem size (x is M x K, W is N x K); dtype: a :func:`dtype_key`.
        gpu_name: ``torch.cuda.get_device_name()`` (or ``"cpu"``);
        capability: ``(major, minor)`` or None (CPU); num_sms: multiprocessors (builtin config).
        layout: the weight's layout (``"v1"`` or ``"decode"``): only configs of the kernel
            variant that reads it are taken.
        kernel: that variant, if not the layout's own: ``"prefill"`` (the decode layout past
            16 rows, whose built-in is :func:`~sparse24.ops.linear24.prefill.prefill_config`).
        nvidia: whether the device is an NVIDIA GPU (only those share files by capability, the
            family); default: unless ``gpu_name`` is an AMD GPU's (:func:`get_choice` passes
            whether torch is a CUDA build, not a ROCm one).
        shared_memory: the device's per-program shared memory limit in bytes
            (:func:`shared_memory_limit`; None: none), which the prefill kernel's built-in keeps within.
    Returns:
        :class:`Choice`.
    Example:
        >>> lookup(1, 4096, 4096, "float16", "cpu", None).kind
        'builtin'
    """
    files = _files()
    own = [f for f in files if gpu_file_name(f["gpu"]) == gpu_file_name(gpu_name)]
    family = _family(files, own, gpu_name, capability, nvidia)
    key, kernel = (m_bucket(M), N, K, dtype), kernel or LAYOUT_KERNEL[layout]
    for f in own:
        if key in f["entries"] and f["entries"][key]["config"].kernel == kernel:
            return Choice(f["entries"][key]["config"], "exact", f"exact entry {key} in {f['path']}",
                          f["entries"][key])
    for group, kind in ((own, "nearest"), (family, "family")):
        hit = _nearest_entry(group, M, N, K, dtype, kernel)
        if hit is not None:
            f, entry, bm = hit
            return Choice(entry["config"], kind, f"{kind} entry M={bm} for N={N}, K={K}, {dtype} in {f['path']}",
                          entry)
    builtin = None if kernel == "prefill" else builtin_config(M, N, K, num_sms, layout, dtype)
    for f in own:   # a file's default serves the dtype keys it won an entry of (the evidence for them: the
        # H200 file's fp16 winner is a 16-bit byte-permute config, not one INT8's sparse kernel was timed with)
        if f["default"].kernel == kernel and _serves(f["default"], M, dtype) \
                and any(k[3] == dtype and e["config"] == f["default"] for k, e in f["entries"].items()) \
                and _fills(f["default"], builtin, M, N, K, num_sms):
            return Choice(f["default"], "file-default", f"default of {f['path']}")
    if kernel == "prefill":
        from .linear24.prefill import untuned_prefill
        return Choice(untuned_prefill(M, N, K, dtype, num_sms, shared_memory, capability), "builtin",
                      "the prefill kernel's untuned config (no tuned prefill config for this GPU)")
    return Choice(builtin, "builtin", "built-in untuned config (no tuned config of this layout for this GPU)")


# ROCm's names for AMD GPUs (torch.cuda.get_device_name on a ROCm build)
_AMD_NAME = re.compile(r"(?i)\b(amd|radeon|instinct)\b|^gfx\d")


def _family(files: list[dict], own: list[dict], gpu_name: str, capability, nvidia: bool | None) -> list[dict]:
    """Other NVIDIA GPUs' files of this NVIDIA GPU's compute capability (none for a ROCm GPU, whose
    major.minor numbers AMD's architectures: an MI250X reports 9.0, an H200's)."""
    if nvidia is None:
        nvidia = not _AMD_NAME.search(gpu_name)
    if capability is None or not nvidia:
        return []
    return [f for f in files if f not in own and not _AMD_NAME.search(f["gpu"])
            and tuple(f["compute_capability"]) == tuple(capability)]


def _programs(config: KernelConfig, M: int, N: int) -> int:
    """Programs of one launch of ``config`` at M rows and N outputs (row blocks x column blocks x splits)."""
    return -(-M // config.block_m) * -(-N // config.block_n) * config.split_k


def _fills(default: KernelConfig, builtin: KernelConfig, M: int, N: int, K: int, num_sms: int) -> bool:
    """Whether a file's default, tuned at other shapes, keeps the SMs as busy at (M, N, K) as the
    built-in default would: at least ``num_sms`` programs, or as many as the built-in's (a small
    layer neither fills), and no more splits of K than K-tiles (a split without a tile only adds
    its prologue and partial sums). A default that won at 4096 x 4096 (64 tiles of 64 rows, split 8)
    gives a 1024 x 4096 layer 128 programs on 132 SMs, where the built-in splits to fill them, and a
    3072 x 768 layer 8 splits of its 3 K-tiles (sm_90, Triton 3.6: 0.102 integer-pipe instructions per
    byte, over the 0.10 budget; the built-in's 3 splits: 0.079)."""
    need = num_sms if builtin is None else min(num_sms, _programs(builtin, M, N))
    return _programs(default, M, N) >= need and default.split_k <= -(-K // default.block_k)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the lookup needs to know of a device (queried once per device)."""
    name: str                              # torch.cuda.get_device_name, or "cpu"
    capability: tuple[int, int] | None     # None off CUDA
    num_sms: int = 132                     # multiprocessors (the builtin config fills them)
    # Shared memory one program may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin, what
    # Triton's launch checks a kernel against); None: not reported (shared_memory_limit says)
    shared_memory: int | None = None


# NVIDIA's published per-block opt-in shared memory by compute capability, for a DeviceInfo that
# does not say (made by hand, or a torch without the property), and every CUDA GPU's static 48 KiB
# for other capabilities
_OPTIN_SHARED = {(7, 0): 98304, (7, 2): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
                 (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}
_STATIC_SHARED = 48 * 1024


def shared_memory_limit(info: DeviceInfo) -> int | None:
    """The most shared memory one program may use on the device ``info`` describes (bytes):
    what the device reports, else :data:`_OPTIN_SHARED`'s figure for its capability, else 48 KiB;
    None for a CPU (Triton's interpreter has no limit)."""
    if info.shared_memory is not None:
        return info.shared_memory
    if info.capability is None:
        return None
    return _OPTIN_SHARED.get(tuple(info.capability), _STATIC_SHARED)


_DEVICES: dict[tuple, DeviceInfo] = {}


def device_info(device=None) -> DeviceInfo:
    """:class:`DeviceInfo` of ``device`` (default: the current CUDA device, else CPU), cached per
    device: device queries cost microseconds and under torch.compile they would break the graph."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    info = _DEVICES.get(key)
    if info is None:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            info = DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count,
                              getattr(props, "shared_memory_per_block_optin", None))
        else:
            info = DeviceInfo(device.type, None)
        _DEVICES[key] = info
    return info


_LIVE_TUNER = None


def set_live_tuner(tuner) -> None:
    """Plug in the function ``SPARSE24_AUTOTUNE=1`` calls for a shape without an exact
    entry: ``tuner(M_bucket, N, K, dtype, device, layout=...) -> Choice``; None unplugs it.
    (:mod:`sparse24.tools.tuning` registers its tuner when imported.)"""
    global _LIVE_TUNER
    _LIVE_TUNER = tuner
    clear_cache()


def get_choice(M: int, N: int, K: int, dtype: str, device, layout: str = "v1", kernel: str | None = None) -> Choice:
    """:func:`lookup` for a launch on ``device``, or live tuning when ``SPARSE24_AUTOTUNE=1``
    on CUDA and no exact entry exists. Cached per process (:func:`clear_cache` forgets).
    CPU tensors (the Triton interpreter) look up device name ``"cpu"``: the built-in config,
    unless a file whose ``gpu`` is ``"cpu"`` holds one (no GPU's file serves them; the tuner
    writes none: it tunes on CUDA). ``kernel``: as in :func:`lookup` (the live tuner times the
    layout's space at M, which past 16 rows is the prefill kernel's)."""
    info = device_info(device)
    cache_key = (tuple(config_dirs()), info, (m_bucket(M), N, K, dtype), layout, kernel)
    choice = _CHOICES.get(cache_key)
    if choice is None:
        choice = lookup(M, N, K, dtype, info.name, info.capability, info.num_sms, layout, kernel,
                        nvidia=torch.version.hip is None, shared_memory=shared_memory_limit(info))
        if (os.environ.get("SPARSE24_AUTOTUNE") == "1" and info.capability is not None and choice.kind != "exact"
                and _LIVE_TUNER is not None):
            choice = _LIVE_TUNER(m_bucket(M), N, K, dtype, torch.device(device), layout=layout)
        _CHOICES[cache_key] = choice
    return choice


def get_config(M: int, N: int, K: int, dtype: str, device, layout: str = "v1") -> KernelConfig:
    """The :class:`KernelConfig` of :func:`get_choice`."""
    return get_choice(M, N, K, dtype, device, layout).config


def measured_timings(M: int, N: int, K: int, dtype: str, device=None, layout: str = "v1",
                     kernel: str | None = None) -> dict[str, float]:
    """``{"kernel_us", "dense_us", "reference_us", "unpack_us"}`` (those present) measured side by side by
    the tuner on this GPU for this shape (its exact or nearest-M entry, or a live-tuned one);
    empty when this GPU has no measurement. ``backend="auto"`` picks the faster backend from it.
    ``kernel``: as in :func:`lookup` (``"prefill"``: the decode layout's entries past 16 rows)."""
    choice = get_choice(M, N, K, dtype, device, layout, kernel)
    if choice.kind not in ("exact", "nearest", "live") or not choice.entry:
        return {}
    return {t: choice.entry[t] for t in TIMINGS if t in choice.entry}


def describe_config_source(device=None) -> str:
    """Which tuned-config files apply on ``device`` (default: the current GPU) and why.

    Example:
        >>> print(describe_config_source("cpu"))  # doctest: +ELLIPSIS
        device cpu: ...
    """
    info = device_info(device)
    gpu, cc = info.name, info.capability
    dirs = config_dirs()
    files = _files()
    lines = [f"device {gpu}" + (f" (compute capability {cc[0]}.{cc[1]})" if cc else "") + ":"]
    lines.append("  searched, in order: " + ", ".join(
        f"{d}{'' if d.is_dir() else ' (a file, not a folder)' if d.exists() else ' (missing)'}" for d in dirs)
        + (" [SPARSE24_CONFIG_DIR first]" if os.environ.get("SPARSE24_CONFIG_DIR") else ""))
    own = [f for f in files if gpu_file_name(f["gpu"]) == gpu_file_name(gpu)]
    if cc is None:
        lines.append("  not a CUDA device: the Triton backend runs in the interpreter with "
                     + ("the configs of the file(s) below, else built-in ones" if own else "built-in configs"))
        lines += [f"  tuned file for '{gpu}': {f['path']} ({len(f['entries'])} entries): exact and nearest-M entries "
                  f"come from here" for f in own]
        return "\n".join(lines)
    family = _family(files, own, gpu, cc, torch.version.hip is None)
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

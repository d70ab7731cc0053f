"""The command line: ``python -m sparse24 {bench,plot,info,prune,autotune,demo}``.

Every error a user can cause (a bad path, shape, dtype or CSV, no GPU for
``--device cuda``) ends with one line on stderr, ``sparse24 <command>: error:
<reason>``, and a non-zero exit: 2 for bad arguments or input files, 1 when
this machine cannot do what was asked (no CUDA GPU, triton missing, out of
memory, none of the named providers runs here). Files are written under a
temporary name and renamed, so a failure leaves earlier outputs whole.
``SPARSE24_DEBUG=1`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from .._version import __version__

__all__ = ["main", "CLIError", "prune_state_dict", "PRUNE_EXCLUDE"]

# A raw state dict does not say which 2-D weights are embedding tables; these
# names (GPT-2's wte/wpe, *embed*, *emb*) are, and pruning a lookup table 2:4
# is not what a user asking to prune a checkpoint's linear layers wants.
PRUNE_EXCLUDE = r"emb|wte|wpe"


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _prog() -> str:
    """The program as invoked: ``sparse24`` (the console script) or ``python -m sparse24``."""
    return "sparse24" if Path(sys.argv[0]).name == "sparse24" else "python -m sparse24"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise CLIError(f"{message} (see '{self.prog} --help')", 2)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CLIError(f"{what} needs comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CLIError(f"{what} needs positive integers, got {text!r}")
    return list(dict.fromkeys(vals))  # a repeated value would be measured twice: two CSV rows for one point


def _choices(text: str, allowed, what: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise CLIError(f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(vals))


def _device_kind(name: str) -> torch.device:
    """--device parsed without touching the GPU (so other arguments are checked first)."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise CLIError(f"--device must be cpu or cuda[:N], got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise CLIError(f"--device must be cpu or cuda[:N], got {name!r}")
    return dev


def _device(name: str) -> torch.device:
    dev = _device_kind(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "torch.cuda.is_available() is False")
            raise CLIError(f"--device {name}: no CUDA GPU is visible ({why}); use --device cpu", 1)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CLIError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible", 1)
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    return dev


def _out_dir(path: str) -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CLIError(f"--out {path}: exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a file where a parent folder should be
        raise CLIError(f"--out {path}: cannot create the folder ({e.strerror or e})") from None
    return p


def _threads(n: int | None, what: str = "--threads") -> int | None:
    # far more threads than CPUs only measures oversubscription; 100000 crashed the process (exit 139)
    cpus = os.cpu_count() or 1
    if n is not None and not 1 <= n <= cpus:
        raise CLIError(f"{what} must be between 1 and {cpus} (this machine's logical CPUs), got {n}")
    return n


def _memory_bytes(dev: torch.device) -> int | None:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_fits(dev: torch.device, shapes, ms, dtypes) -> None:
    """Refuse a sweep whose tensors cannot fit before it starts (else: an allocator
    traceback, or torch's overflow message, after the smaller points ran)."""
    cap = _memory_bytes(dev)
    e = max(t.itemsize for t in dtypes)
    for label, N, K in shapes:
        # a lower bound: weight + mask + fp64 copy, x and y plus their fp64 reference
        need = N * K * (2 * e + 9) + max(ms) * (N + K) * (e + 8)
        if cap and need > cap:
            raise CLIError(f"shape {label} at M={max(ms)} needs over {need / 2 ** 30:.3g} GiB, more than this "
                           f"{dev.type} has ({cap / 2 ** 30:.3g} GiB); use a smaller --m or --shapes")


# --- bench / plot ----------------------------------------------------------------

def _cmd_bench(args) -> int:
    from . import bench
    from .shapes import parse_shapes

    _threads(args.threads)
    d = bench.default_settings(_device_kind(args.device), args.quick)
    shapes = parse_shapes(args.shapes or d["shapes"])
    # "is None", not falsiness: an empty --m/--dtype/--providers is an error, not "the defaults"
    ms = _int_list(args.m, "--m") if args.m is not None else d["ms"]
    dtypes = [bench.DTYPES[n] for n in _choices(",".join(d["dtypes"]) if args.dtype is None else args.dtype,
                                                bench.DTYPES, "--dtype")]
    explicit = args.providers is not None
    providers = _choices(args.providers, bench.PROVIDERS, "provider") if explicit else list(bench.PROVIDERS)
    repeats = d["repeats"] if args.repeats is None else args.repeats
    if repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {repeats}")
    dev = _device(args.device)  # bad arguments are exit 2 even where no GPU is there (exit 1)
    _check_fits(dev, shapes, ms, dtypes)
    settings = bench.BenchSettings(dev, shapes, ms, dtypes, providers, repeats)
    if explicit and set(providers) - {"dense"}:
        jobs, notes = bench.plan_providers(settings, explicit)
        if all(j[4] == "dense" for j in jobs):  # else a dense-only CSV, exit 0, for a provider that never ran
            raise CLIError("none of the named providers runs here: " + "; ".join(notes), 1)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    info = bench.device_info(dev)
    out = _out_dir(args.out or os.path.join("runs", "bench", bench.device_slug(info)))
    names = ["bench.csv", "bench.txt"] + ([] if args.no_plot else ["bench.png"])
    if any((out / n).is_dir() for n in names) or not os.access(out, os.W_OK):  # found now, not after the sweep
        raise CLIError(f"--out {out}: cannot write {', '.join(names)} there (not writable, or one is a folder)")
    print(f"sparse24 bench on {info['device']} ({dev.type}"
          + (f", {info['threads']} threads" if dev.type == "cpu" else "") + f"): {len(shapes)} shape(s), "
          f"M in {ms}, {', '.join(str(t)[6:] for t in dtypes)}, median of {repeats}", file=sys.stderr)
    t0 = time.perf_counter()
    rows = bench.run_bench(settings, explicit_providers=explicit)
    seconds = time.perf_counter() - t0
    from .plot import plot_rows
    bench.write_together({out / "bench.csv": lambda p: bench.write_csv(rows, p),
                     out / "bench.txt": lambda p: _write_env(p, info, seconds),
                     **({} if args.no_plot else {out / "bench.png": lambda p: plot_rows(rows, p)})})
    print(_speedup_table(rows))
    print(f"CSV:  {out / 'bench.csv'}")
    if not args.no_plot:
        print(f"plot: {out / 'bench.png'}")
    return 0


def _write_env(path: Path, info: dict, seconds: float) -> None:
    """The run's context next to its CSV: command, date, machine load (CPU numbers depend on it)."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    lines = [f"command: {_prog()} {' '.join(sys.argv[1:])}".rstrip(),
             f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
             f"device: {info['device']} ({info['device_type']}" + (f", {info['threads']} torch threads, "
                                                                  f"{os.cpu_count()} logical CPUs"
                                                                  if info["device_type"] == "cpu" else "") + ")",
             f"load average (1, 5, 15 min) at the end: {load}",
             f"sparse24 {__version__}, torch {torch.__version__}, python {sys.version.split()[0]}",
             f"wall time: {seconds:.1f} s"]
    path.write_text("\n".join(lines) + "\n")


def _speedup_table(rows: list[dict]) -> str:
    """Speedup vs dense per (dtype, shape, M) and provider, as printed text."""
    provs = list(dict.fromkeys(r["provider"] for r in rows if r["provider"] != "dense"))
    keys = list(dict.fromkeys((r["dtype"], r["shape"], r["M"]) for r in rows))
    sp = {(r["dtype"], r["shape"], r["M"], r["provider"]): f"{float(r['speedup_vs_dense']):.3f}" for r in rows}
    dense_ms = {(r["dtype"], r["shape"], r["M"]): r["median_ms"] for r in rows if r["provider"] == "dense"}
    w = max([len(f"{k[1]} {k[0]}") for k in keys] + [10])
    head = f"{'shape dtype':<{w}} {'M':>5} {'dense ms':>10} " + " ".join(f"{p:>{max(len(p), 8)}}" for p in provs)
    lines = ["speedup vs dense (x, same run; >1 is faster):", head]
    for dt, shape, M in keys:
        cells = " ".join(f"{sp.get((dt, shape, M, p), '-'):>{max(len(p), 8)}}" for p in provs)
        lines.append(f"{shape + ' ' + dt:<{w}} {M:>5} {float(dense_ms[(dt, shape, M)]):>10.4g} {cells}")
    return "\n".join(lines)


def _cmd_plot(args) -> int:
    from .plot import plot_csv
    if Path(args.out).suffix.lower() != ".png":
        raise CLIError(f"--out must name a .png file, got {args.out!r}")
    if Path(args.out).is_dir():
        raise CLIError(f"--out {args.out}: is a folder")
    print(f"plot: {plot_csv(args.csv, args.out, args.title)}")
    return 0


# --- info -----------------------------------------------------------------------

def _cmd_info(args) -> int:
    from .bench import cpu_name, _triton_version
    tv = _triton_version()
    print(f"sparse24 {__version__} | torch {torch.__version__} | triton {tv or 'not installed'} | "
          f"python {sys.version.split()[0]}")
    cuda = torch.cuda.is_available()
    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs, torch uses {torch.get_num_threads()} threads)")
    if cuda:
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            print(f"GPU {i}: {torch.cuda.get_device_name(i)} (compute capability {cc[0]}.{cc[1]})")
    else:
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU visible to torch"
        print(f"GPU: none ({why})")
    cc = torch.cuda.get_device_capability() if cuda else None
    print("backends:")
    rows = [("reference", "available: pure torch, any device (decompresses a block of weight rows at a time)")]
    if not tv:
        rows.append(("triton", "unavailable: triton is not installed (pip install triton; Linux only)"))
    elif cuda:
        rows.append(("triton", "available: compiled kernel on CUDA (backend='auto' uses it unless this GPU's tuned "
                               "file measured dense faster at that shape)"))
    else:
        rows.append(("triton", "interpreter only: no CUDA GPU, so the kernel runs in Triton's interpreter on CPU "
                               "tensors (correct, but seconds per call: for tests; auto picks the reference)"))
    if not cuda:
        rows.append(("torch semi-structured", "unavailable: torch's 2:4 kernels (CUTLASS/cuSPARSELt) need CUDA"))
    elif cc < (8, 0):
        rows.append(("torch semi-structured", f"unavailable: needs compute capability >= 8.0, this GPU is "
                                              f"{cc[0]}.{cc[1]}"))
    else:
        rows.append(("torch semi-structured", "available (torch.sparse.to_sparse_semi_structured; interop "
                                              "via sparse24.to_semi_structured)"))
    rows.append(("int8 weights", "available: sparse24.compress(w, quantize='int8'); fused dequant in the "
                                 "Triton kernel, dequantizing reference elsewhere"))
    w = max(len(r[0]) for r in rows)
    for name, text in rows:
        print(f"  {name:<{w}}  {text}")
    print("tuned kernel configs:")
    try:
        from .tuning import config_dirs, describe_config_source, validate_dir
        with warnings.catch_warnings():  # a 2-line warning with a source line; listed below instead
            warnings.simplefilter("ignore", RuntimeWarning)
            text = describe_config_source(torch.device("cuda") if cuda else torch.device("cpu"))
        text += "".join(f"\n  problem in {path}: {_one_line(why)[:200]}"
                        for d in config_dirs() if d.is_dir() for path, why in validate_dir(d))
    except ImportError as e:
        text = f"sparse24.tuning is not importable ({e})"
    print("\n".join("  " + line for line in text.splitlines()))
    return 0


# --- prune ----------------------------------------------------------------------

def _load_state_dict(path: str) -> tuple[dict, str]:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such checkpoint file: {path} (a state dict file, or a Hugging Face model folder with "
                       "config.json)")
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CLIError("reading .safetensors needs the safetensors package: pip install 'sparse24[hf]'", 1) from None
        try:
            return load_file(p), ""
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CLIError(f"cannot read {path} as a safetensors file: {_one_line(e)[:200]}") from None
    try:
        with warnings.catch_warnings():  # torch's multi-line pickle-protocol warning; the error says it
            warnings.simplefilter("ignore")
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for non-checkpoint files
        why = _one_line(e)
        found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed| Please| Check the|\. |$)", why)
        if found:  # torch's text is a paragraph (with terminal escapes); its cause is one phrase in it
            why = (f"it holds objects other than tensors ({found.group(1)}), which torch.load(weights_only=True) "
                   f"refuses; save model.state_dict() alone")
        raise CLIError(f"cannot read {path} as a torch checkpoint: "
                       f"{why[:200] or type(e).__name__ + (' (empty file)' if not p.stat().st_size else '')}") from None
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, ""
    for key in ("state_dict", "model"):
        inner = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return inner, key
    raise CLIError(f"{path} is not a state dict (a dict of tensors, or one under 'state_dict'/'model')")


def _direct_reader(prefix: str, sd: dict) -> str:
    """Why ``prefix`` (a Linear's name) must stay in masked mode, mirroring
    ``sparse24.api``: parents that read the child's ``.weight`` directly."""
    parent, _, leaf = prefix.rpartition(".")
    head = parent + "." if parent else ""
    if leaf == "out_proj" and (head + "in_proj_weight" in sd or head + "q_proj_weight" in sd):
        return "nn.MultiheadAttention reads out_proj.weight in its functional forward"
    if leaf in ("linear1", "linear2") and head + "self_attn.in_proj_weight" in sd:
        return "nn.TransformerEncoderLayer reads linear1/linear2.weight in its inference fast path"
    return ""


def prune_state_dict(sd: dict, method: str = "magnitude", quantize: str | None = None,
                     min_features: int | None = None, exclude: str = PRUNE_EXCLUDE,
                     prune_head: bool = False) -> tuple[dict, list[dict]]:
    """2:4-prune the linear weights of a raw state dict (no model class needed).

    Every 2-D floating ``<prefix>.weight`` with in-features divisible by 4 and
    both dimensions >= ``min_features`` is pruned, unless its name matches
    ``exclude``, its storage is shared with another entry (tied weights) or it
    is the output head (as many rows as the largest excluded embedding table:
    kept dense as LLM pruning does, unless ``prune_head``). A raw state dict does
    not say which layers are Hugging Face ``Conv1D`` (weight stored transposed):
    prune a model folder for GPT-2-style models.
    Pruned entries are stored the way :class:`sparse24.Sparse24Linear` holds
    them, so ``load_state_dict`` of a model prepared with
    ``sparse24.sparsify_(model, mode="compressed", quantize=...)`` takes them:

    * ``<prefix>.values`` ``(R, C/2)``, ``<prefix>.meta`` ``(ceil(C/32), R)`` int32 and,
      for INT8, ``<prefix>.scale`` ``(R,)`` fp32, replacing ``<prefix>.weight``;
    * layers whose parent reads ``.weight`` directly (``nn.MultiheadAttention.out_proj``,
      ``nn.TransformerEncoderLayer.linear1/2``) stay in masked mode, as ``sparsify_``
      keeps them: ``<prefix>.weight`` (zeros where pruned) + ``<prefix>.mask`` (bool).

    Everything else is copied unchanged.

    Args:
        sd: ``{name: tensor}``.
        method: a mask method needing no calibration data (``"magnitude"``,
            ``"2d_greedy"``, ``"2d_optimal"``).
        quantize: ``None`` or ``"int8"``.
        min_features: default ``sparse24.api.MIN_FEATURES`` (the same rule as ``sparsify_``).
        exclude: regular expression; matching weight names are left dense.
        prune_head: prune the output head too.
    Returns:
        ``(new_state_dict, report)`` with one report dict per 2-D float weight:
        ``name, shape, dtype, action ("compressed" | "masked" | "kept dense"),
        reason, kept (fraction of |w| kept), bytes_before, bytes_after``.
    Example:
        >>> sd = torch.nn.Linear(64, 32).state_dict()  # keys 'weight', 'bias'
        >>> new, report = prune_state_dict({"fc." + k: v for k, v in sd.items()})
        >>> sorted(new), report[0]["action"]
        (['fc.bias', 'fc.meta', 'fc.values'], 'compressed')
    """
    from ..api import MIN_FEATURES
    from ..format import FLOAT_DTYPES, compress
    from ..masks import kept_magnitude_fraction, mask_nm

    if method in ("wanda", "sparsegpt"):
        raise ValueError(f"method {method!r} needs calibration data (layer inputs), which a checkpoint does not "
                         f"have; use sparse24.calibrate + sparsify_ in Python, or magnitude/2d_greedy/2d_optimal")
    if quantize not in (None, "int8"):
        raise ValueError(f"--quantize must be int8 (or absent), got {quantize!r}")
    min_features = MIN_FEATURES if min_features is None else min_features
    if min_features < 0:
        raise ValueError(f"--min-features must be >= 0, got {min_features}")
    try:
        excl = re.compile(exclude, re.IGNORECASE) if exclude else None
    except re.error as e:
        raise ValueError(f"--exclude {exclude!r} is not a regular expression: {e}") from None
    # sparse-layout or meta tensors hold no dense data to prune (and have no storage): copied as they are
    plain = {k for k, v in sd.items() if v.layout == torch.strided and not v.is_meta}
    storages: dict[int, list[str]] = {}
    for k in plain:
        storages.setdefault(sd[k].untyped_storage().data_ptr(), []).append(k)
    # The output head: as many rows as the vocabulary (the largest excluded 2-D weight, an embedding table), and
    # named like a head or the last 2-D weight (an MLP layer as wide as a small test vocabulary is no head).
    vocab = max((sd[k].shape[0] for k in plain if excl is not None and sd[k].dim() == 2
                 and k.endswith("weight") and excl.search(k[:-len("weight")].rstrip("."))), default=None)
    last = [k for k in plain if k.endswith("weight") and sd[k].dim() == 2][-1:]
    heads = {k for k in plain if vocab is not None and sd[k].dim() == 2 and sd[k].shape[0] == vocab
             and (re.search(r"(^|\.)(lm_head|head|output)\.weight$", k) or [k] == last)}
    out, report = {}, []
    for key, t in sd.items():
        if not (key.endswith(".weight") or key == "weight") or t.dim() != 2 or t.dtype not in FLOAT_DTYPES \
                or key not in plain:
            out[key] = t
            continue
        prefix = key[: -len("weight")]  # "fc." (or "" for a bare Linear's state dict)
        R, C = t.shape
        nbytes = t.numel() * t.element_size()
        row = {"name": key, "shape": (R, C), "dtype": str(t.dtype)[6:], "action": "kept dense", "reason": "",
               "kept": 1.0, "bytes_before": nbytes, "bytes_after": nbytes}
        tied = [k for k in storages[t.untyped_storage().data_ptr()] if k != key]
        taken = [prefix + n for n in ("values", "meta", "scale", "mask") if prefix + n in sd]
        if taken:  # writing them would overwrite those entries silently
            row["reason"] = f"the state dict already has {', '.join(taken)}"
        elif C % 4:
            row["reason"] = f"in-features {C} not divisible by 4"
        elif min(R, C) < min_features:
            row["reason"] = f"smaller than min_features={min_features}: too small to gain"
        elif excl is not None and excl.search(prefix.rstrip(".")):
            row["reason"] = f"name matches --exclude {exclude!r} (an embedding table?)"
        elif tied:
            row["reason"] = f"storage shared with {', '.join(tied)} (tied weights): pruning would prune those too"
        elif not prune_head and key in heads:
            row["reason"] = (f"output head ({R} rows = the embedding table's vocabulary): kept dense as LLM pruning "
                             "does; --prune-head prunes it")
        if row["reason"]:
            out[key] = t
            report.append(row)
            continue
        mask = mask_nm(t, 2, 4, method=method)
        row["kept"] = kept_magnitude_fraction(t, mask)
        reader = _direct_reader(prefix.rstrip("."), sd)
        if reader:
            out[key], out[prefix + "mask"] = torch.where(mask, t, 0), mask
            row.update(action="masked", reason=f"kept as weight + mask: {reader}")
        else:
            p = compress(t, mask, quantize=quantize)
            out.update({prefix + n: v for n, v in p.state_tensors().items()})
            row["action"] = "compressed" + (" int8" if quantize else "")
        row["bytes_after"] = sum(out[k].numel() * out[k].element_size() for k in out if k.startswith(prefix)
                                 and k[len(prefix):] in ("weight", "mask", "values", "meta", "scale"))
        report.append(row)
    return out, report


def _check_prune_out(args) -> Path:
    if Path(args.out).resolve() == Path(args.checkpoint).resolve():
        raise CLIError("--out must differ from the input checkpoint (it would be overwritten)")
    out = Path(args.out)
    parent = next(a for a in out.absolute().parents if a.exists())
    if not parent.is_dir():  # checked before the work, and before creating any folder
        raise CLIError(f"--out {out}: {parent} is a file, not a folder")
    return out


def _save_state_dict(sd: dict, path: Path) -> None:
    """``torch.save``, or safetensors for a ``.safetensors`` name (tensors sharing storage, i.e.
    tied weights kept dense, are stored as copies: safetensors refuses shared tensors)."""
    if path.suffix != ".safetensors":
        torch.save(sd, path)
        return
    from safetensors.torch import save_file
    seen, flat = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) if v.numel() else None
        flat[k] = v.clone() if key in seen else v.contiguous()
        seen.add(key)
    save_file(flat, path, metadata={"format": "pt"})


def _print_prune_table(title: str, report: list[dict], out: Path, size_in: int) -> None:
    w = max(len(r["name"]) for r in report)
    print(title)
    print(f"  {'weight':<{w}}  {'shape':>12}  {'dtype':>8}  {'|w| kept':>8}  {'bytes':>10}  {'-> bytes':>10}  action")
    for r in report:
        kept = f"{100 * r['kept']:.1f}%" if r["action"] != "kept dense" else "-"
        print(f"  {r['name']:<{w}}  {str(r['shape']):>12}  {r['dtype']:>8}  {kept:>8}  {r['bytes_before']:>10}  "
              f"{r['bytes_after']:>10}  {r['action']}" + (f" ({r['reason']})" if r["reason"] else ""))
    before, after = (sum(r[k] for r in report) for k in ("bytes_before", "bytes_after"))
    n = sum(r["action"] != "kept dense" for r in report)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else out.stat().st_size
    print(f"  {n} of {len(report)} 2-D weights pruned; their bytes {before} -> {after} "
          f"({100 * after / max(before, 1):.1f}%); other tensors copied unchanged")
    print(f"  {'folder' if out.is_dir() else 'file'}: {out} ({size} bytes; input {size_in} bytes)")


def _cmd_prune(args) -> int:
    out = _check_prune_out(args)
    src = Path(args.checkpoint)
    settings = f": method={args.method}" + (f", quantize={args.quantize}" if args.quantize else "")
    if src.is_dir() and (src / "config.json").is_file():
        return _prune_folder(args, src, out, settings)
    if out.is_dir():
        raise CLIError(f"--out {out}: is a folder; name the file to write")
    if out.suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        raise CLIError("writing .safetensors needs the safetensors package: pip install 'sparse24[hf]'", 1)
    sd, wrapper = _load_state_dict(args.checkpoint)
    new, report = prune_state_dict(sd, args.method, args.quantize, args.min_features, args.exclude, args.prune_head)
    if not any(r["action"] != "kept dense" for r in report):
        raise CLIError(f"{args.checkpoint}: no weight could be pruned ({len(report)} 2-D float weight(s), "
                       "none eligible" + (f"; first: {report[0]['name']}: {report[0]['reason']}" if report else "")
                       + "); see --min-features / --exclude", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .bench import write_together
    write_together({out: lambda p: _save_state_dict(new, p)})  # a failed write leaves an existing file whole
    _print_prune_table(f"{_prog()} prune {args.checkpoint}" + (f" (state dict under '{wrapper}')" if wrapper else "")
                       + settings, report, out, src.stat().st_size)
    print("  load it with: sparse24.sparsify_(model, mode='compressed'"
          + (f", quantize='{args.quantize}'" if args.quantize else "") + (", skip_output_head=False"
                                                                          if args.prune_head else "")
          + "); model.load_state_dict("
          + ("safetensors.torch.load_file(...))" if out.suffix == ".safetensors" else "torch.load(...))"))
    return 0


def _prune_folder(args, src: Path, out: Path, settings: str) -> int:
    """``prune FOLDER --out DIR``: a Hugging Face model folder (see :mod:`sparse24.tools.hf_folder`)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
        raise CLIError("pruning a model folder needs transformers and safetensors: pip install 'sparse24[hf]'", 1)
    from .hf_folder import prune_folder
    report = prune_folder(src, out, args.method, args.quantize, args.min_features, args.exclude, args.prune_head)
    size_in = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    _print_prune_table(f"{_prog()} prune {src} (Hugging Face folder){settings}", report, out, size_in)
    print(f"  load it with: sparse24.from_pretrained(<model class>, {str(out)!r})")
    return 0


# --- autotune / demo --------------------------------------------------------------

def _cmd_autotune(argv: list[str]) -> int:
    """``python -m sparse24 autotune [--shapes NAME|N,K ...] [--m 1,2,4,...] [--dtype ...] [--out-dir DIR]``:
    parse and check every argument (exit 2 on a bad one, before any GPU work), then
    :func:`sparse24.tuning.autotune`. Returns 0 on success, 1 when there is no CUDA GPU
    or a key found no working config."""
    from ..ops.config_space import DTYPE_KEYS, M_BUCKETS, m_bucket
    from ..ops.config_store import shipped_config_dir
    from .shapes import parse_shapes

    ap = _Parser(prog=f"{_prog()} autotune",
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
    try:
        from .tuning import autotune
    except ImportError as e:
        raise CLIError(f"the tuner is not importable ({e})", 1) from None
    return autotune(shapes, ms, dtypes, out_dir, args.warmup_ms, args.rep_ms, args.jobs)


def _cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args)


# --- parser and entry point -------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .bench import PROVIDERS
    from .shapes import SHAPE_SETS

    ap = _Parser(prog=_prog(), description="sparse24: 2:4 structured sparsity for PyTorch.")
    ap.add_argument("--version", action="version", version=f"sparse24 {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{bench,plot,info,prune,autotune,demo}", required=True)

    b = sub.add_parser("bench", help="time dense vs 2:4 providers over batch sizes M; write CSV + PNG",
                       description="Sweep M for weight shapes over the providers this machine has; write "
                                   "bench.csv, bench.txt and bench.png to --out.")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    b.add_argument("--shapes", nargs="+", metavar="NAME|N,K",
                   help=f"shape sets ({', '.join(SHAPE_SETS)}) or N,K; default: bert-base on CPU, standard on CUDA")
    b.add_argument("--m", metavar="LIST", help="batch sizes, comma-separated (default: per device, fewer with --quick)")
    b.add_argument("--dtype", metavar="LIST",
                   help="float16,bfloat16,float32 (default: float32 on CPU, float16 on CUDA)")
    b.add_argument("--providers", metavar="LIST", help="comma-separated subset of: " + ", ".join(PROVIDERS)
                   + " (default: all this machine has; on CPU the Triton interpreter only for tiny weights)")
    b.add_argument("--quick", action="store_true", help="fewer M values and repeats")
    b.add_argument("--repeats", type=int, help="timed samples per point (median kept)")
    b.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on a shared machine use 1: "
                   "with 2 threads on 2 busy cores a 16x768x768 GEMM took 16 ms instead of 1 ms)")
    b.add_argument("--out", metavar="DIR", help="output folder (default: runs/bench/<device>)")
    b.add_argument("--no-plot", action="store_true", help="write the CSV only")
    b.set_defaults(func=_cmd_bench)

    p = sub.add_parser("plot", help="redraw a PNG from one or more bench CSVs (devices overlay)")
    p.add_argument("csv", nargs="+", help="bench.csv files")
    p.add_argument("--out", required=True, metavar="PNG")
    p.add_argument("--title")
    p.set_defaults(func=_cmd_plot)

    i = sub.add_parser("info", help="device, available backends (and why others are not), tuned configs")
    i.set_defaults(func=_cmd_info)

    r = sub.add_parser("prune", help="2:4-prune a dense checkpoint (state dict file or Hugging Face folder)",
                       description=prune_state_dict.__doc__.split("\n\n")[0] + " A Hugging Face model folder "
                       "(config.json + safetensors, sharded or not) becomes a new folder that "
                       "sparse24.from_pretrained loads.")
    r.add_argument("checkpoint", help="a torch.save'd or .safetensors state dict, or a Hugging Face model folder")
    r.add_argument("--out", required=True, metavar="FILE|DIR",
                   help="file for a state dict (.safetensors: safetensors, else torch.save), folder for a model folder")
    r.add_argument("--prune-head", action="store_true",
                   help="prune the output head too (kept dense by default, as LLM pruning does)")
    r.add_argument("--method", default="magnitude", choices=("magnitude", "2d_greedy", "2d_optimal"))
    r.add_argument("--quantize", choices=("int8",), help="store INT8 values + per-row scales")
    r.add_argument("--min-features", type=int, help="skip weights with fewer rows or columns (default: as sparsify_)")
    r.add_argument("--exclude", default=PRUNE_EXCLUDE, metavar="REGEX",
                   help=f"leave matching weights dense (default {PRUNE_EXCLUDE!r}: embedding tables; '' for none)")
    r.set_defaults(func=_cmd_prune)

    sub.add_parser("autotune", help="tune the Triton kernel on this GPU (options: autotune --help)", add_help=False)

    from .demo import add_demo_arguments
    d = sub.add_parser("demo", help="the main job: train, prune 2:4, retrain, compress, measure, plot",
                       description="Train a small character-level LM on the Python standard library's source, "
                                   "prune it 2:4, retrain with the mask frozen, compress, report bits per "
                                   "character and bytes, sweep throughput, write the plot.")
    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if not a.startswith("-")), "")
    try:
        if cmd == "autotune":
            return _cmd_autotune(argv[argv.index("autotune") + 1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"sparse24 {cmd}: interrupted", file=sys.stderr)
        return 130
    except (CLIError, OSError, ValueError, TypeError, MemoryError, RuntimeError) as e:
        # RuntimeError only when torch ran out of memory (sizes too big for this machine); others are bugs
        oom = isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(e, RuntimeError) and re.search(r"out of memory|can't allocate memory", str(e)))
        if os.environ.get("SPARSE24_DEBUG") == "1" or (isinstance(e, RuntimeError) and not oom):
            raise
        if oom:
            e = CLIError(f"out of memory ({_one_line(e)[:160]}); use smaller --m / --shapes", 1)
        where = f"sparse24 {cmd}" if cmd else "sparse24"
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return e.code if isinstance(e, CLIError) else 2

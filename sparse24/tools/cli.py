"""The command line: ``python -m sparse24 {bench,plot,info,prune,inspect,autotune,demo}``.

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
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .._version import __version__
from .cli_common import (CLIError, _check_fits, _choices, _device, _device_kind, _int_list, _one_line,
                         _out_dir, _Parser, _prog, _threads, add_progress_argument)
from .prune import PRUNE_EXCLUDE, add_blockwise_args, cmd_prune, prune_state_dict

__all__ = ["main", "CLIError", "prune_state_dict", "PRUNE_EXCLUDE"]

# --- bench / plot ----------------------------------------------------------------

def _cmd_bench(args) -> int:
    # --threads is for this sweep only: main() may run in-process (a notebook, a driver script), and a run that
    # fails part way must give the caller's thread count back too (as run_demo does)
    threads_before = torch.get_num_threads()
    try:
        return _bench(args)
    finally:
        torch.set_num_threads(threads_before)


def _bench(args) -> int:
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
    names = ["bench.csv", "bench.txt", "bench.partial.csv"] + ([] if args.no_plot else ["bench.png"])
    if any((out / n).is_dir() for n in names) or not os.access(out, os.W_OK):  # found now, not after the sweep
        raise CLIError(f"--out {out}: cannot write {', '.join(names)} there (not writable, or one is a folder)")
    print(f"sparse24 bench on {info['device']} ({dev.type}"
          + (f", {info['threads']} threads" if dev.type == "cpu" else "") + f"): {len(shapes)} shape(s), "
          f"M in {ms}, {', '.join(str(t)[6:] for t in dtypes)}, median of {repeats}", file=sys.stderr)
    t0 = time.perf_counter()
    # the rows so far, rewritten after every point: what a sweep stopped by a time limit measured
    partial = out / "bench.partial.csv"
    rows = bench.run_bench(settings, explicit_providers=explicit, progress=args.progress, partial=partial)
    seconds = time.perf_counter() - t0
    from .plot import plot_rows
    bench.write_together({out / "bench.csv": lambda p: bench.write_csv(rows, p),
                     out / "bench.txt": lambda p: _write_env(p, info, seconds),
                     **({} if args.no_plot else {out / "bench.png": lambda p: plot_rows(rows, p)})})
    partial.unlink(missing_ok=True)
    if args.no_plot:  # (an earlier run's plot beside this run's CSV would describe another sweep)
        (out / "bench.png").unlink(missing_ok=True)
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
    from .bench import _triton_version, cpu_name
    tv = _triton_version()
    print(f"sparse24 {__version__} | torch {torch.__version__} | triton {tv or 'not installed'} | "
          f"python {sys.version.split()[0]}")
    cuda = torch.cuda.is_available()
    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs, torch uses {torch.get_num_threads()} threads)")
    if cuda:
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            print(f"GPU {i}: {torch.cuda.get_device_name(i)} "
                  + (f"(ROCm {torch.version.hip}; capability {cc[0]}.{cc[1]} in AMD's numbering)" if torch.version.hip
                     else f"(compute capability {cc[0]}.{cc[1]})"))
    else:
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU visible to torch"
        print(f"GPU: none ({why})")
    cc = torch.cuda.get_device_capability() if cuda else None
    refusal = None   # why the compiled kernels cannot run on this GPU (ROCm, older than sm_70)
    if cuda and tv:
        from ..ops.linear24.launch import kernel_refusal
        refusal = kernel_refusal(torch.device("cuda", torch.cuda.current_device()), torch.float16)
    print("backends:")
    rows = [("reference", "available: pure torch, any device (decompresses a block of weight rows at a time)")]
    if not tv:
        rows.append(("triton", "unavailable: triton is not installed (pip install triton; Linux only)"))
    elif refusal is not None:
        rows.append(("triton", f"unavailable on this GPU: {refusal} (backend='auto' runs the reference "
                               "here; Triton's interpreter still runs the kernels on CPU tensors)"))
    elif cuda:
        rows.append(("triton", "available: compiled kernel on CUDA (backend='auto' uses it unless this GPU's tuned "
                               "file measured dense faster at that shape"
                               + ("; INT4 weights with bfloat16 x need compute capability 8.0: the reference "
                                  "runs them here)" if cc < (8, 0) else ")")))
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
    rows.append(("int4 weights", "available: sparse24.compress(w, quantize='int4', group_size=128); fused "
                                 "dequant in the Triton kernel, dequantizing reference elsewhere"))
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
        text = f"sparse24.tools.tuning is not importable ({e})"
    print("\n".join("  " + line for line in text.splitlines()))
    return 0


# --- autotune / demo --------------------------------------------------------------

def _cmd_autotune(argv: list[str]) -> int:
    """``python -m sparse24 autotune [--shapes NAME|N,K ...] [--m 1,2,4,...] [--dtype ...] [--out-dir DIR]``:
    parse and check every argument (exit 2 on a bad one, before any GPU work), then
    :func:`sparse24.tools.tuning.autotune`. Returns 0 on success, 1 when there is no CUDA GPU
    or a key found no working config."""
    from ..ops.config_space import DTYPE_KEYS, M_BUCKETS, m_bucket
    from ..ops.config_store import shipped_config_dir
    from .shapes import parse_shapes

    ap = _Parser(prog=f"{_prog()} autotune",
                 description="Tune the 2:4 Triton kernel's tile configs on this GPU and save them.")
    ap.add_argument("--shapes", nargs="+", default=["standard"],
                    help="weight shapes: names from sparse24.tools.shapes (standard, llama-7b, ...) or N,K "
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
    ap.add_argument("--skip-tuned", action=argparse.BooleanOptionalAction, default=False,
                    help="leave out the keys this GPU's file in --out-dir already holds (default: re-time them)")
    ap.add_argument("--timings", default=None, metavar="CSV",
                    help="append every candidate config's time (and each rejection) to this CSV file")
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
        timings = None if args.timings is None else Path(args.timings)
        if timings is not None and (timings.is_dir() or not timings.parent.is_dir()):
            raise ValueError(f"--timings {timings}: need a file in an existing folder")
    except (CLIError, ValueError) as e:
        print(f"sparse24 autotune: error: {e}", file=sys.stderr)
        return 2
    try:
        from .tuning import autotune
    except ImportError as e:
        raise CLIError(f"the tuner is not importable ({e})", 1) from None
    return autotune(shapes, ms, dtypes, out_dir, args.warmup_ms, args.rep_ms, args.jobs, args.skip_tuned, timings)


def _cmd_inspect(args) -> int:
    from .inspect_checkpoint import cmd_inspect
    return cmd_inspect(args)


def _cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args)


# --- parser and entry point -------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .bench import PROVIDERS
    from .shapes import SHAPE_SETS

    ap = _Parser(prog=_prog(), description="sparse24: 2:4 structured sparsity for PyTorch.")
    ap.add_argument("--version", action="version", version=f"sparse24 {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{bench,plot,info,prune,inspect,autotune,demo}", required=True)

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
    add_progress_argument(b)
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
    r.add_argument("--method", default="magnitude",
                   choices=("magnitude", "2d_greedy", "2d_optimal", "wanda", "sparsegpt", "layerwise"),
                   help="magnitude (default), 2d_greedy, 2d_optimal: no data needed; wanda, sparsegpt (+ least-squares "
                        "refit), layerwise (each layer fit to the dense outputs, the recommended one): a model folder "
                        "and --calibration text")
    r.add_argument("--quantize", choices=("int8", "int4"),
                   help="int8: INT8 values + per-row fp32 scales; int4: 4-bit values + fp16 scales per --group-size "
                        "input columns")
    r.add_argument("--group-size", type=int, choices=(32, 64, 128), metavar="{32,64,128}",
                   help="--quantize int4: input columns per scale (default 128)")
    r.add_argument("--asymmetric", action="store_true", help="--quantize int4: a uint8 zero point per group too")
    r.add_argument("--min-features", type=int, help="skip weights with fewer rows or columns (default: as sparsify_)")
    r.add_argument("--exclude", metavar="REGEX",
                   help="leave dense the layers whose name or weight name (as the report lists it, e.g. "
                        "model.layers.0.mlp.down_proj.weight) matches; a model folder: none by default (its "
                        f"embedding tables are never pruned); a state dict file: default {PRUNE_EXCLUDE!r}, "
                        "its embedding tables ('' for none)")
    from .prune_calibrated import add_calibration_arguments
    add_calibration_arguments(r)
    add_progress_argument(r)
    add_blockwise_args(r)
    r.set_defaults(func=cmd_prune)

    n = sub.add_parser("inspect", help="per layer of a pruned checkpoint: mode, exact 2:4 check, kept |w|, bytes",
                       description="Check a pruned checkpoint (state dict file or Hugging Face folder) layer by layer: "
                                   "mode (compressed, INT8, INT4 gN [asym], masked, dense), whether the 2:4 pattern is exact (as "
                                   "loading checks it), bytes, dtype, and the totals. Exit 0 when every layer passes, "
                                   "1 when one fails, 2 when the file cannot be read.")
    n.add_argument("path", help="a .pt/.safetensors state dict or a Hugging Face model folder")
    n.add_argument("--dense", metavar="ORIGINAL", help="the dense checkpoint it was pruned from (same names): "
                   "adds the share of each layer's sum |W| the mask keeps")
    n.set_defaults(func=_cmd_inspect)

    sub.add_parser("autotune", help="tune the Triton kernel on this GPU (options: autotune --help)", add_help=False)

    from .demo import add_demo_arguments
    d = sub.add_parser("demo", help="the main job: train, prune 2:4, retrain, compress, measure, plot",
                       description="Train a small character-level LM on the Python standard library's source, "
                                   "prune it 2:4, retrain with the mask frozen, compress, report bits per "
                                   "character and bytes, sweep throughput, write the plot.")
    add_demo_arguments(d)
    d.set_defaults(func=_cmd_demo)
    return ap


class _Terminated(BaseException):
    """SIGTERM (a batch scheduler's time limit, ``kill``) raised as an exception: the ``finally``
    blocks run, so a prune stopped part way leaves no ``.s24-PID-HASH.partial`` folder."""


def _on_sigterm(signum, frame):
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success; 130 after Ctrl-C, 143 after
    SIGTERM, each with its partial output removed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if not a.startswith("-")), "")
    # only where nobody else handles SIGTERM (an embedding program may), and signals can be handled here
    previous = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv, cmd)
    except _Terminated:
        print(f"sparse24 {cmd}: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str], cmd: str) -> int:
    try:
        if cmd == "autotune":
            return _cmd_autotune(argv[argv.index("autotune") + 1:])
        ap = build_parser()
        try:
            args = ap.parse_args(argv)
        except CLIError as e:   # (argparse reports a subcommand's unknown options from the top parser)
            if cmd and "unrecognized arguments" in str(e):   # (a valid command: else "invalid choice")
                raise CLIError(str(e).replace(f"'{ap.prog} --help'", f"'{ap.prog} {cmd} --help'"), 2) from None
            raise
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
            # (bench and autotune size their work by --m / --shapes; the other commands by their input)
            hint = "; use smaller --m / --shapes" if cmd in ("bench", "autotune") else ""
            e = CLIError(f"out of memory ({_one_line(e)[:160]}){hint}", 1)
        where = f"sparse24 {cmd}" if cmd else "sparse24"
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return e.code if isinstance(e, CLIError) else 2

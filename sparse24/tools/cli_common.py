"""What every command of the command line shares: the one-line error
(:class:`CLIError`), an argument parser that raises it, and the checks of
common arguments (integer lists, choices, devices, output folders, threads)."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch

from ..api.walk import EXCLUDED_BY

__all__ = ["CLIError", "prune_quant", "int4_args", "printable"]


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


def printable(name: str) -> str:
    """``name`` (a tensor or layer name read from a file) as a table prints it: itself when every character
    is printable, else escaped as ``ascii`` writes it (``\\x1b``, ``\\n``, ...). Names are the file's text: a
    terminal runs the control sequences in them (``ESC[2K`` erases a line, ``ESC[8m`` hides what follows)."""
    return name if name.isprintable() else ascii(name)[1:-1]


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


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: bars only when stderr is a terminal or in a notebook)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: only when stderr is a terminal)")


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


def prune_quant(args) -> dict:
    """``--quantize``, ``--group-size``, ``--asymmetric`` as :func:`sparse24.nn.quant_options` (CLIError,
    exit 2, when they do not go together)."""
    from ..nn import quant_options
    if (args.group_size is not None or args.asymmetric) and args.quantize != "int4":
        raise CLIError("--group-size and --asymmetric go with --quantize int4")
    return quant_options(args.quantize, args.group_size, False if args.asymmetric else None)


def int4_args(quant: dict) -> dict:
    """The INT4 keywords of the prune functions (``group_size``, ``symmetric``), from :func:`prune_quant`."""
    return {k: quant[k] for k in ("group_size", "symmetric") if k in quant}


def excluded(pattern, fqn: str) -> bool:
    """Whether ``--exclude`` (a compiled pattern, or None) names layer ``fqn``: searched in the layer name and
    in its weight's name (``fqn + ".weight"``, as the report lists it)."""
    return pattern is not None and bool(pattern.search(fqn) or pattern.search(f"{fqn}.weight" if fqn else "weight"))


def exclude_filter(pattern):
    """``sparsify_``'s ``filter_fn`` for ``--exclude`` (None when no pattern is given)."""
    return None if pattern is None else (lambda m, fqn: not excluded(pattern, fqn))


def exclude_reason(reason: str, exclude) -> str:
    """A ``sparsify_`` skip reason in the command line's words (it has no filter_fn, only --exclude)."""
    return f"name matches --exclude {exclude!r}" if reason == EXCLUDED_BY else reason  # (worded for --exclude)


def check_writable(folder: Path, what: str) -> None:
    """Refuse, before any work, a place that cannot be written (CLIError starting with ``what``):
    ``folder``, or where it does not exist yet the nearest existing folder above it (where it would be
    created), must be a folder in which a file can be created (a probe created and removed there)."""
    import tempfile
    probe = Path(folder).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():  # checked before the work, and before creating any folder
        raise CLIError(f"{what}: cannot write there: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CLIError(f"{what}: cannot write in {probe} (permission denied)")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".sparse24-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise CLIError(f"{what}: cannot write in {probe} ({e.strerror or _one_line(e)})") from None


def check_out_writable(out: Path) -> None:
    """Refuse an ``--out`` that cannot be written before any work (CLIError naming it): an existing
    folder must itself be writable (an output folder is built inside it, so its parent need not be),
    else the nearest existing folder above it."""
    path = Path(out).absolute()
    check_writable(path if path.is_dir() else path.parent, f"--out {out}")


TEMP_PREFIX = ".s24-"


def temp_name(final: str, kind: str) -> str:
    """The hidden name an output is written under before it is renamed to ``final``:
    ``.s24-PID-HASH.KIND`` (``HASH`` of ``final``: one per output and process). Short whatever ``final``'s
    length: a name built from it (``.NAME.PID.partial``) exceeded the file system's 255 bytes for a
    legal ``--out`` and failed after all the work."""
    return f"{TEMP_PREFIX}{os.getpid()}-{hashlib.sha1(final.encode(errors='surrogateescape')).hexdigest()[:8]}.{kind}"

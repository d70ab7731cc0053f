"""What the checkpoint commands (``prune``, ``inspect``) share: what a model folder is, which stored tensors
count as weight matrices, the report row of one left dense, and a first read of
safetensors shards that names a bad file in one line."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

from .._checks import safetensors_headers
from ..format import FLOAT_DTYPES
from .cli_common import _one_line, temp_name

__all__ = ["is_model_folder", "is_weight_matrix", "dense_row", "check_shards", "quant_label",
           "LAYER_ENTRIES", "load_torch_file", "CheckpointError"]

# The state-dict entries of a 2:4 layer besides its bias (masked: weight + mask; compressed: values + meta,
# INT8/INT4 scale, INT4 zero points and group size).
LAYER_ENTRIES = ("weight", "mask", "values", "meta", "scale", "zero", "group_size")


def exclude_pattern(exclude: str | None) -> "re.Pattern | None":
    """``--exclude``'s regular expression, compiled case-insensitively (None for none); ValueError
    naming it when it does not compile."""
    try:
        return re.compile(exclude, re.IGNORECASE) if exclude else None
    except re.error as e:
        raise ValueError(f"--exclude {exclude!r} is not a regular expression: {e}") from None


def output_folder(dst: str | os.PathLike) -> Path:
    """``--out`` as the folder to write: refused unless new or empty (ValueError). A symbolic link is
    followed: the output is written into its target, so the link names the result (renaming onto
    the link itself failed after all the work)."""
    dst = Path(dst)
    if dst.is_symlink():
        dst = dst.resolve()
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"--out {dst}: exists and is not an empty folder")
    first = next(dst.iterdir(), None) if dst.is_dir() else None
    if first is not None:   # (named: a hidden one, a killed run's .s24-*.partial, is not seen by ls)
        raise ValueError(f"--out {dst}: exists and is not an empty folder (it holds {first.name})")
    return dst


@contextlib.contextmanager
def partial_folder(dst: Path):
    """A new empty hidden folder (:func:`~sparse24.tools.cli_common.temp_name`, ``.s24-PID-HASH.partial``)
    to write an output folder into, then :func:`finish_folder` it to ``dst``; removed when the block ends,
    with every folder above it that was made for it and stays empty (a failure leaves no trace of
    ``--out a/b/out``). Made beside ``dst``, or inside it when ``dst`` is an existing (empty) folder: that
    folder is kept, with its owner and permissions, and may be a mount point or sit in a folder the user
    cannot write in. An OSError of the block that names a path in the temporary folder (removed by then) or
    none (a buffered write's close: transformers' ``config.json``), and a ``shutil.Error`` (a subfolder's
    copy), is raised as an OSError naming ``dst`` (:func:`_naming_dst`)."""
    inside = dst.is_dir()
    tmp = (dst if inside else dst.parent) / temp_name(dst.name, "partial")
    with new_parents(tmp, always=True):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            yield tmp
        except OSError as e:
            err = _naming_dst(e, tmp, dst)
            if err is e:
                raise
            raise err from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _naming_dst(e: OSError, tmp: Path, dst: Path) -> OSError:
    """``e`` (raised while ``tmp`` was written) as an OSError naming ``dst`` when it is about writing there;
    else ``e`` itself (a source file that cannot be read stays named)."""
    def inside(name) -> bool:
        return os.path.abspath(name).startswith(os.path.abspath(tmp) + os.sep) \
            or os.path.abspath(name) == os.path.abspath(tmp)
    if isinstance(e, shutil.Error):   # copytree's list of (src, dst, str(error)); the first one stands for all
        if not (e.args and isinstance(e.args[0], list) and e.args[0]):
            return e
        src, _, why = e.args[0][0]
        code = re.match(r"\[Errno (\d+)\] ", why)
        if f"{str(src)!r}" in why and str(tmp) not in why:   # (reading the source failed: named as it was)
            return OSError(int(code[1]), os.strerror(int(code[1])), str(src)) if code else e
        return OSError(int(code[1]), os.strerror(int(code[1])), str(dst)) if code else \
            OSError(0, _one_line(why)[:200], str(dst))
    names = [n for n in (e.filename, e.filename2) if n is not None]
    if names and not any(inside(os.fsdecode(n)) for n in names if isinstance(n, (str, bytes, os.PathLike))):
        return e
    return OSError(e.errno, e.strerror or _one_line(e)[:200], str(dst))


def finish_folder(tmp: Path, dst: Path) -> None:
    """Make the complete output folder ``tmp`` (from :func:`partial_folder`) ``dst``: renamed to it, or,
    built inside ``dst``, its entries moved into ``dst`` one by one (``config.json`` last: until then the
    folder is no model folder); a failure part way removes those moved, leaving ``dst`` empty as it was."""
    if tmp.parent != dst:
        os.replace(tmp, dst)
        return
    others = [n for n in os.listdir(dst) if n != tmp.name]
    if others:   # (something else wrote into --out meantime: mixing the two would corrupt both)
        raise OSError(errno.ENOTEMPTY, f"no longer empty (it now holds {others[0]})", str(dst))
    moved = []
    try:
        for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
            os.replace(tmp / name, dst / name)
            moved.append(dst / name)
    except BaseException:
        for p in moved:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        raise
    tmp.rmdir()


@contextlib.contextmanager
def new_parents(path: Path, always: bool = False):
    """The folders above ``path`` that do not exist yet (the block may create them) are removed again,
    those left empty, when the block fails (``always``: when it ends: a finished output kept in one
    stops the removal there)."""
    made = [p for p in Path(path).absolute().parents if not p.exists()]   # nearest first
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise
    if always:
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:
        try:
            d.rmdir()
        except OSError:   # (holds the finished output, or something else now)
            break


def is_model_folder(path: str | os.PathLike) -> bool:
    """A folder with a ``config.json`` (a Hugging Face model folder)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def is_weight_matrix(key: str, t: torch.Tensor) -> bool:
    """The tensors a ``prune`` report counts, for a file and a folder alike: every 2-D
    floating-point ``weight`` (``<prefix>.weight``) stored in the checkpoint."""
    return (key == "weight" or key.endswith(".weight")) and t.dim() == 2 and t.dtype in FLOAT_DTYPES \
        and t.layout == torch.strided  # (a sparse-layout tensor holds no dense matrix: copied as it is)


def quant_label(quant: dict) -> str:
    """A report's words for :func:`sparse24.nn.quant_options`: ``""``, ``" int8"``, ``" int4 g128"``
    (``" int4 g128 asym"`` with zero points)."""
    if quant.get("quantize") != "int4":
        return f" {quant['quantize']}" if quant else ""
    return f" int4 g{quant['group_size']}" + ("" if quant["symmetric"] else " asym")


def dense_row(key: str, t: torch.Tensor, reason: str) -> dict:
    """The report row of a 2-D weight left dense."""
    nbytes = t.numel() * t.element_size()
    return {"name": key, "shape": tuple(t.shape), "dtype": str(t.dtype)[6:], "action": "kept dense",
            "reason": reason, "kept": 1.0, "bytes_before": nbytes, "bytes_after": nbytes}


def check_shards(folder: Path, shards: list[str]) -> dict:
    """Read every shard's header before any work (:func:`sparse24._checks.safetensors_headers`:
    a truncated or foreign file is named in one line); returns what it found."""
    return safetensors_headers([folder / s for s in shards])


class CheckpointError(ValueError):
    """A file :func:`load_torch_file` refused before or after torch read it; the message names the file."""


def load_torch_file(f, what: str | None = None):
    """``torch.load(f, weights_only=True)`` on the CPU, after checking that its memory stays
    within the file's size: torch reads each stored record into a buffer of the size the zip
    directory gives, so a corrupt size field asked for 4 GiB from a 12 KiB file (found by
    fuzzing: tests/tools/test_fuzz.py). Nothing is unpickled before the check.

    Bound: the tensors' data takes at most the file's size (every record is stored
    uncompressed, inside the file, and their sizes sum to at most the file's size; torch checks
    each storage against its record), plus the unpickler's objects (data.pkl is in the file too).
    A tensor viewing more elements than its storage holds (stride 0) is refused as well: any
    later ``clone`` would allocate past the bound.

    Args:
        f: a path or a seekable binary file object holding a ``torch.save`` zip archive
            (the format since torch 1.6; the older one reads sizes from the stream).
        what: how errors name the file (default: the path).
    Returns:
        what ``torch.load`` returns. Raises :class:`CheckpointError` (a ValueError) naming the file
        and the record; torch's own errors pass through.
    """
    name = what or str(f)
    with open(f, "rb") if isinstance(f, (str, os.PathLike)) else _rewound(f) as fh:
        size = fh.seek(0, io.SEEK_END)
        fh.seek(0)
        try:
            members = zipfile.ZipFile(fh).infolist()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            why = "nothing in it (empty file)" if not size else (
                f"not a torch.save zip archive ({_one_line(e)}); sparse24 reads the format torch has written since "
                "1.6 (load it with torch and save it again)")
            raise CheckpointError(f"cannot read {name} as a torch checkpoint: {why}") from None
        total = 0
        for m in members:
            if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size \
                    or m.header_offset + m.file_size > size:
                raise CheckpointError(f"cannot read {name} as a torch checkpoint: corrupt archive: record "
                                      f"{m.filename!r} claims {m.file_size} bytes ({m.compress_size} stored, method "
                                      f"{m.compress_type}) in a {size}-byte file")
            total += m.file_size
        if total > size:
            raise CheckpointError(f"cannot read {name} as a torch checkpoint: corrupt archive: its records claim "
                                  f"{total} bytes in a {size}-byte file")
        fh.seek(0)
        with warnings.catch_warnings():  # torch's multi-line pickle-protocol warning; errors say it
            warnings.simplefilter("ignore")
            obj = torch.load(fh, map_location="cpu", weights_only=True)
    for key, t in _tensors(obj):
        if t.layout == torch.strided and not t.is_meta and \
                t.numel() * t.element_size() > t.untyped_storage().nbytes():
            raise CheckpointError(f"cannot read {name} as a torch checkpoint: {key!r} views {t.numel()} elements "
                                  f"of a {t.untyped_storage().nbytes()}-byte storage (an overlapping view): not a "
                                  "saved tensor")
    return obj


class _rewound:
    """A caller's file object as a context manager that does not close it."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def _tensors(obj):
    """``(name, tensor)`` for each distinct tensor in nested dicts, lists and tuples (what torch.load returns),
    named by the first path that reaches it (cut at 200 characters, then ``...``). Each container is
    visited once, in time linear in the file's size: a pickle may hold one container under many paths (its
    memo), and following every path of ``L(i+1) = [L(i)] * 30`` eight levels deep (a 2 KB file) took 30**8
    steps. No depth limit (nor recursion): a tensor nested deeper is checked as well."""
    seen, stack = set(), [("", obj)]
    while stack:
        key, o = stack.pop()
        if not isinstance(o, (torch.Tensor, dict, list, tuple)) or id(o) in seen:
            continue
        seen.add(id(o))   # (every object stays alive inside obj: no id is reused)
        if isinstance(o, torch.Tensor):
            yield key, o
            continue
        steps = [(f".{k}" if key else str(k), v) for k, v in o.items()] if isinstance(o, dict) \
            else [(f"[{i}]", v) for i, v in enumerate(o)]
        stack.extend((key + step if len(key) < 200 else key[:200] + "...", v) for step, v in reversed(steps))

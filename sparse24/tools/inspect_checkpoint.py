"""``python -m sparse24 inspect PATH [--dense ORIGINAL]``: what a pruned checkpoint holds.

PATH is a state dict file (torch or safetensors) or a Hugging Face model folder
(sharded or not). One row per weight matrix: its mode (compressed, INT8, INT4
with its group size, masked, or dense), shape, dtype, bytes as stored, and whether its 2:4 pattern
is exact, checked as :class:`sparse24.Sparse24Linear` checks a state dict
before loading it (compressed: :meth:`Sparse24Tensor.validate` of the
metadata; masked: the mask exactly 2 of every 4 and the weight zero off it),
plus finite values. A dense weight is reported as 2:4 when it already is
(e.g. after ``prune_layerwise_``). The kept magnitude (the share of the dense
``sum |W|`` the mask keeps) needs the dense weights, which a pruned checkpoint
no longer has: ``--dense`` names the original checkpoint. Exit 0 when every
layer passes, 1 when one fails its check, 2 when PATH cannot be read.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import torch

from .._checks import check_finite
from ..format import Sparse24Tensor, is_nm
from ..masks import kept_magnitude_fraction
from ..nn.state import _check_state_masked, check_int4_entries
from .checkpoint import check_shards, is_weight_matrix
from .cli_common import CLIError, _one_line, _prog, printable

__all__ = ["inspect_tensors", "cmd_inspect", "open_checkpoint"]

_SPARSE = ("values", "meta", "scale", "zero", "group_size", "mask")


@contextlib.contextmanager
def open_checkpoint(path: str | Path):
    """``{name: tensor}`` of a state dict file, or a lazy mapping over a model folder's
    safetensors shards (one tensor read at a time). Unreadable input: :class:`CLIError`."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CLIError(f"{path} is a folder without config.json (not a Hugging Face model folder)")
        if importlib.util.find_spec("safetensors") is None:
            raise CLIError("reading a model folder needs the safetensors package: pip install 'sparse24[hf]'", 1)
        from safetensors import safe_open

        from .hf_folder import _shards
        try:
            shards, _ = _shards(p)
        except ValueError as e:  # no weights file, or a bad index
            raise CLIError(_one_line(e)) from None
        check_shards(p, shards)
        with contextlib.ExitStack() as stack:
            files = {s: stack.enter_context(safe_open(p / s, framework="pt")) for s in shards}
            yield _Shards({k: f for f in files.values() for k in f.keys()})
        return
    from .prune import _load_state_dict
    sd, _ = _load_state_dict(str(path))
    yield sd


class _Shards(dict):
    """``{key: open safetensors file}`` read as ``{key: tensor}``."""

    def __getitem__(self, key):
        return super().__getitem__(key).get_tensor(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def inspect_tensors(sd, dense=None, conv1d: set | frozenset = frozenset()) -> list[dict]:
    """One row per weight matrix of ``sd`` (``{name: tensor}``, or a lazy mapping).

    Args:
        sd: the checkpoint's tensors.
        dense: optional tensors of the dense original (same names), for the kept magnitude.
        conv1d: layers whose dense weight is stored transposed (transformers' ``Conv1D``: a folder's
            sparse24 section says so); other weights are taken as transposed only when the shapes say so.
    Returns:
        dicts ``layer, mode ("compressed" | "INT8" | "INT4" | "masked" | "dense"), group_size (INT4,
        else None), shape (R, C), dtype, valid (True / False / None for a dense weight that is not
        2:4), problem, kept (float or None), bytes`` (as stored: INT4 and INT8 bytes include the
        scales, zero points and the group-size entry).
    Example:
        >>> sd = {"fc.weight": torch.randn(8, 16)}
        >>> inspect_tensors(sd)[0]["mode"]
        'dense'
    """
    keys = list(sd.keys())
    prefixes = {k.rpartition(".")[0] + "." if "." in k else "" for k in keys
                if k.rpartition(".")[2] in ("values", "mask")}
    rows = []
    for prefix in sorted(prefixes):
        row = _sparse_row(prefix, {n: sd[prefix + n] for n in ("weight", *_SPARSE) if prefix + n in sd})
        if row is None:
            continue
        if dense is not None and row["valid"] and prefix + "weight" in dense:
            row["kept"] = _kept(dense[prefix + "weight"], row.pop("_mask"), prefix[:-1] in conv1d)
        row.pop("_mask", None)
        rows.append(row)
    for key in keys:
        prefix = key[:-len("weight")]
        if prefix in prefixes or not key.endswith("weight"):
            continue
        t = sd[key]
        if is_weight_matrix(key, t):
            pattern = t.shape[1] % 4 == 0 and is_nm(t)
            rows.append({"layer": prefix.rstrip(".") or key, "mode": "dense", "group_size": None,
                         "shape": tuple(t.shape), "dtype": str(t.dtype)[6:], "valid": True if pattern else None,
                         "problem": "" if pattern else "not 2:4", "kept": None, "bytes": _nbytes(t)})
    return rows


def _sparse_row(prefix: str, t: dict) -> dict | None:
    """The row of one 2:4 layer's entries, its check run as loading it would."""
    compressed = "values" in t
    if not compressed and "weight" not in t:
        return None  # a "mask" of some other module
    stored = {n: v for n, v in t.items() if n != "weight" or not compressed}  # a compressed layer's 1-byte marker
    row = {"layer": prefix.rstrip("."), "mode": "compressed", "group_size": None, "shape": None, "dtype": "",
           "valid": False, "problem": "", "kept": None, "bytes": sum(_nbytes(v) for v in stored.values()),
           "_mask": None}
    try:
        if compressed:
            values, meta, scale, gs = t["values"], t.get("meta"), t.get("scale"), t.get("group_size")
            row.update(mode="INT4" if gs is not None else "INT8" if scale is not None else "compressed",
                       dtype=str(values.dtype)[6:])
            if meta is None or values.dim() != 2:
                raise ValueError("values without meta" if meta is None else f"values are {values.dim()}-D")
            row["shape"] = (values.shape[0], (4 if gs is not None else 2) * values.shape[1])
            if gs is not None:
                if scale is None:
                    raise ValueError("an INT4 group_size without scales")
                if gs.dim() == 0 and not gs.is_floating_point():
                    row["group_size"] = int(gs)
                check_int4_entries(gs, scale, row["group_size"], prefix)
                row["asymmetric"] = "zero" in t
            p = Sparse24Tensor(values, meta, row["shape"], torch.float32 if scale is not None else None, scale,
                               zero=t.get("zero"), group_size=row["group_size"])
            check_finite(values, "values", why="")
            row["_mask"] = p.kept_mask()
        else:
            w, mask = t["weight"], t.get("mask")
            row.update(mode="masked", shape=tuple(w.shape), dtype=str(w.dtype)[6:])
            if w.dim() != 2 or not w.is_floating_point():
                raise ValueError(f"weight is {w.dim()}-D {w.dtype}, not a 2-D float matrix")
            _check_state_masked(w, mask, tuple(w.shape), prefix)
            check_finite(w, "weight", why="")
            row["_mask"] = mask
        row["valid"] = True
    except (ValueError, TypeError) as e:
        row["problem"] = _one_line(e)
    return row


def _kept(w: torch.Tensor, mask: torch.Tensor, transposed: bool = False) -> float | None:
    if transposed or tuple(w.shape) != tuple(mask.shape) and tuple(w.shape[::-1]) == tuple(mask.shape):
        w = w.t()  # a Conv1D weight, stored (in, out) (a square one is known only from the section)
    return kept_magnitude_fraction(w, mask) if tuple(w.shape) == tuple(mask.shape) else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def cmd_inspect(args) -> int:
    path = Path(args.path)
    if not path.exists():
        raise CLIError(f"no such checkpoint: {path} (a state dict file or a Hugging Face model folder)")
    section = _section(path)
    conv1d = {name for name, e in section["layers"].items() if e.get("kind") == "conv1d"} if section else set()
    with open_checkpoint(path) as sd:
        if args.dense is None:
            rows = inspect_tensors(sd)
        else:
            with open_checkpoint(args.dense) as dense:
                rows = inspect_tensors(sd, dense, conv1d)
    if not rows:
        raise CLIError(f"{path}: no weight matrix in it (no 2-D float *.weight, no 2:4 layer entries)")
    sparse = [r for r in rows if r["mode"] != "dense" and r["valid"]]
    if args.dense is not None and sparse and all(r["kept"] is None for r in sparse):
        raise CLIError(f"--dense {args.dense}: no 2:4 layer of {path} matched a weight in it by name and shape")
    print(f"{_prog()} inspect {path}" + (f" (config.json: sparse24 format {section.get('format_version')}, "
                                         f"{len(section.get('layers', {}))} 2:4 layer(s) listed)" if section else ""))
    w = max(len(printable(r["layer"])) for r in rows)   # (names are the file's text: escaped, see printable)
    print(f"  {'layer':<{w}}  {'mode':<10}  {'shape':>12}  {'dtype':>8}  {'|w| kept':>8}  {'bytes':>10}  2:4 pattern")
    for r in rows:
        kept = f"{100 * r['kept']:.1f}%" if r["kept"] is not None else "-"
        check = ("exact" if r["valid"] and r["mode"] != "dense" else "exact (stored dense)" if r["valid"]
                 else "-" if r["valid"] is None else f"INVALID: {printable(r['problem'])}")
        mode = r["mode"] + (f" g{r['group_size']}" if r["group_size"] else "") + (" asym" * bool(r.get("asymmetric")))
        print(f"  {printable(r['layer']):<{w}}  {mode:<10}  {str(r['shape']):>12}  {r['dtype']:>8}  {kept:>8}  "
              f"{r['bytes']:>10}  {check}")
    sparse = [r for r in rows if r["mode"] != "dense"]
    bad = [r for r in rows if r["valid"] is False]
    listed = set(section.get("layers", {})) if section else set()
    missing = sorted(listed - {r["layer"] for r in sparse})
    counts = ", ".join(f"{sum(r['mode'] == m for r in sparse)} {m}" for m in ("compressed", "INT8", "INT4", "masked")
                       if any(r["mode"] == m for r in sparse))
    kept = [r["kept"] for r in sparse if r["kept"] is not None]
    print(f"  {len(sparse)} 2:4 layer(s) ({counts or 'none'}), {len(rows) - len(sparse)} dense; "
          f"{len(sparse) - len(bad)} of {len(sparse)} with an exact 2:4 pattern; their bytes "
          f"{sum(r['bytes'] for r in sparse)}, dense weights {sum(r['bytes'] for r in rows if r['mode'] == 'dense')}"
          + (f"; kept |w| {100 * min(kept):.1f}%-{100 * max(kept):.1f}% (mean {100 * sum(kept) / len(kept):.1f}%)"
             if kept else ""))
    if missing:
        print(f"  config.json lists {len(missing)} 2:4 layer(s) with no entries here: "
              f"{', '.join(map(printable, missing[:5]))}"
              + (" ..." if len(missing) > 5 else ""))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    print(f"  {'folder' if path.is_dir() else 'file'}: {size} bytes")
    return 1 if bad or missing else 0


def _section(path: Path) -> dict | None:
    if not (path / "config.json").is_file() or importlib.util.find_spec("transformers") is None:
        return None  # (a folder without config.json: open_checkpoint says so)
    from ..hf import check_section, read_section
    try:
        section = read_section(path)
        if section is not None:
            check_section(section)  # (what from_pretrained checks: the layers and their entries' fields)
        return section
    except ValueError as e:  # config.json is not JSON, or a section that is not one
        raise CLIError(f"{path / 'config.json'}: {_one_line(e)}") from None

"""Throughput plots from the CSV files :mod:`sparse24.tools.bench` writes (reading only;
nothing here measures).

One figure: a row per weight shape, TFLOP/s vs M on the left and speedup vs
dense on the right (log-x; log-y where the values span more than 8x). Several
CSVs (several GPUs, or a GPU and a CPU) overlay in one figure: colour =
provider, line style = device; one legend below the panels.

The speedup panel draws the byte-count ceiling of each sparse format: with
dense weights of ``e`` bytes per element, 2:4 stores ``e/2 + 1/8`` bytes per
dense element (half the values + a 2-bit index each) and INT8 2:4 stores
``1/2 + 1/8`` (+ its fp32 row scales, negligible), INT4 2:4 ``1/4 + 1/8 + 2/128``
(fp16 scales per 128 columns, as the bench stores them). When the weight read
dominates (small M, memory-bound) time scales with bytes, so speedup <=
``e / (e/2 + 1/8)`` = 1.78x for fp16, ``e / 0.625`` = 3.2x for INT8 and
``e / 0.390625`` = 5.12x for INT4 weights vs fp16. At large M the GEMM is
compute-bound and the ceiling does not apply (a kernel without sparse tensor
cores does the dense FLOPs: expect <= 1x there). The axis is set by the
measurements; ceilings far above them are named in one note at the panel's top edge.
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from .._version import __version__
from .bench import COLUMNS, PROVIDERS, SCHEMA, make_parent, write_together

__all__ = ["read_rows", "byte_ceiling", "plot_rows", "plot_csv", "figure"]

_ELT = {"float16": 2, "bfloat16": 2, "float32": 4}
_COLORS = dict(zip(PROVIDERS, ["black", "tab:blue", "tab:cyan", "tab:green", "tab:orange", "tab:red", "tab:pink",
                                "tab:purple", "tab:brown", "tab:olive"]))
# Bytes stored per dense weight by the quantized providers (INT4: group 128, symmetric, as the bench stores it).
_QUANT_BYTES = {"int8": 0.5 + 0.125, "int4": 0.25 + 0.125 + 2 / 128}
_CEILING_COLORS = {"": "tab:blue", "int8": "tab:red", "int4": "tab:purple"}
_STYLES = ["-", "--", ":", "-."]   # one per device
_MARKERS = ["o", "s", "^", "D", "v"]  # one per dtype (a provider's lines keep its colour)
_NUMERIC = {"N": int, "K": int, "M": int, "weight_bytes": int, "median_ms": float, "tflops": float,
            "gbps": float, "speedup_vs_dense": float}


def read_rows(paths) -> list[dict]:
    """Read bench CSVs into rows with numeric fields converted.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file is not a sparse24 bench CSV, or has another schema
            version, a malformed row (a figure not a positive finite number, a
            cell too many or too few, a quote csv cannot close) or a point
            another file or row already has (one line naming the file and what to do).
    Example:
        >>> rows = read_rows(["results/cpu-amd-epyc/bench.csv"])  # doctest: +SKIP
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list({p.resolve(): p for p in map(Path, paths)}.values())  # the same file twice: read once
    rows, seen = [], {}
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"no such CSV file: {path}")
        # utf-8-sig: a file re-saved by Excel ("CSV UTF-8") starts with a BOM that would prefix the first column
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            reader = csv.DictReader(f)
            start = 1  # the line the row csv reads next starts on: where a csv.Error is (csv names none)
            try:
                header = reader.fieldnames or []
                start = reader.line_num + 1
                for row in _checked_rows(path, reader, header, seen):
                    rows.append(row)
                    start = reader.line_num + 1
            except csv.Error as e:  # e.g. a stray quote: csv reads on to the field limit (128 KiB) for its end
                raise ValueError(f"{path} line {start}: not a valid CSV row ({e}); mend the line or "
                                 "re-run 'python -m sparse24 bench'") from None
    if not rows:
        raise ValueError(f"no measurements in {', '.join(map(str, paths))}")
    return rows


def _checked_rows(path: Path, reader: csv.DictReader, header: list, seen: dict):
    """The rows of one bench CSV (``header`` read), each checked and with its numeric fields converted
    (:func:`read_rows`); ``seen`` maps each point already read to where."""
    if "schema" not in header:
        raise ValueError(f"{path} is not a sparse24 bench CSV (no 'schema' column; "
                         f"write one with 'python -m sparse24 bench')")
    missing = [c for c in COLUMNS if c not in header]
    for i, row in enumerate(reader, start=2):
        if row.get("schema") != SCHEMA:
            raise ValueError(f"{path} line {i}: schema {row.get('schema')!r} (sparse24 "
                             f"{row.get('sparse24', '?')}), but this sparse24 {__version__} reads "
                             f"{SCHEMA!r}: re-run 'python -m sparse24 bench'")
        if missing:
            raise ValueError(f"{path}: missing columns {missing} for schema {SCHEMA!r}")
        if None in row or None in row.values():  # more or fewer cells than the header: shifted columns
            raise ValueError(f"{path} line {i}: the number of cells differs from the header's {len(header)}")
        for k, t in _NUMERIC.items():
            try:
                v = t(row[k])
            except ValueError:
                v = None
            # every figure bench writes is a positive finite number; nan/inf/0/negatives
            # would be drawn as nothing, or fail deep in matplotlib
            if v is None or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{path} line {i}: {k} must be a positive "
                                 f"{'integer' if t is int else 'number'}, got {row[k]!r}")
            row[k] = v
        key = (_device_label(row), *(row[c] for c in ("dtype", "shape", "N", "K", "M", "provider")))
        if key in seen:  # one line through both would zigzag between two measurements
            raise ValueError(f"{path} line {i}: {row['provider']} {row['dtype']} {row['shape']} M={row['M']} "
                             f"on {key[0]} is already in {seen[key]}; plot one run per device")
        seen[key] = f"{path} line {i}"
        yield row


def byte_ceiling(provider: str, dtype: str) -> float | None:
    """Memory-bound speedup ceiling of ``provider`` vs dense ``dtype`` weights
    (bytes of dense / bytes as stored); None for dense or unknown dtypes.

    Example:
        >>> round(byte_ceiling("sparse24-triton", "float16"), 2), byte_ceiling("sparse24-int8-triton", "float16")
        (1.78, 3.2)
        >>> byte_ceiling("sparse24-int4-reference", "float16")
        5.12
    """
    e = _ELT.get(dtype)
    if e is None or provider == "dense":
        return None
    return e / _QUANT_BYTES.get(_quant_of(provider), e / 2 + 0.125)


def _quant_of(provider: str) -> str:
    """``"int8"``, ``"int4"`` or ``""`` (16/32-bit values) for a provider name."""
    return next((q for q in _QUANT_BYTES if q in provider), "")


def plot_rows(rows: list[dict], out: str | os.PathLike, title: str | None = None) -> Path:
    """Draw TFLOP/s vs M and speedup vs M (one row of panels per shape) to a PNG.

    Args:
        rows: from :func:`read_rows` (or :func:`sparse24.tools.bench.run_bench`,
            numeric fields as numbers or strings).
        out: PNG path (folders are created).
        title: figure title; default names the devices and dtypes.
    Returns:
        the PNG path.
    """
    fig = figure(rows, title)
    out = Path(out)
    make_parent(out)
    write_together({out: lambda tmp: fig.savefig(tmp, dpi=110, format="png")})
    return out


def figure(rows: list[dict], title: str | None = None):
    """The matplotlib ``Figure`` :func:`plot_rows` saves (rows and title as there)."""
    from matplotlib.figure import Figure  # no pyplot: works headless and leaves the user's backend alone
    from matplotlib.ticker import FuncFormatter

    rows = [{**r, **{k: t(r[k]) for k, t in _NUMERIC.items()}} for r in rows]
    shapes = list(dict.fromkeys((r["shape"], r["N"], r["K"]) for r in rows))
    rows = [{**r, "device": _device_label(r)} for r in rows]
    devices = list(dict.fromkeys(r["device"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    multi_dtype = len(dtypes) > 1
    # CPUs reach GFLOP/s, GPUs TFLOP/s: label in the unit that gives readable numbers
    unit, scale = ("TFLOP/s", 1.0) if max(r["tflops"] for r in rows) >= 1 else ("GFLOP/s", 1e3)
    fig = Figure(figsize=(12, 3.3 * len(shapes) + 1.2), layout="constrained")
    axes = fig.subplots(len(shapes), 2, squeeze=False)
    handles = {}
    for (shape, N, K), (ax_t, ax_s) in zip(shapes, axes):
        here = [r for r in rows if (r["shape"], r["N"], r["K"]) == (shape, N, K)]
        lines = dict.fromkeys((r["device"], r["dtype"], r["provider"]) for r in here)
        for dev, dtype, prov in lines:
            pts = sorted((r["M"], r["tflops"], r["speedup_vs_dense"]) for r in here
                         if (r["device"], r["dtype"], r["provider"]) == (dev, dtype, prov))
            ms, tf, sp = zip(*pts)
            label = prov + (f" {dtype}" if multi_dtype else "") + (f" ({dev})" if len(devices) > 1 else "")
            style = dict(color=_COLORS.get(prov, "gray"), linestyle=_STYLES[devices.index(dev) % len(_STYLES)],
                         marker=_MARKERS[dtypes.index(dtype) % len(_MARKERS)], markersize=3.5)
            handles.setdefault(label, ax_t.plot(ms, [v * scale for v in tf], label=label, **style)[0])
            ax_s.plot(ms, sp, **style)
        _value_axis(ax_t, [r["tflops"] * scale for r in here])
        ax_s.axhline(1.0, color="gray", linewidth=0.8)
        _speedup_axis(ax_s, [r["speedup_vs_dense"] for r in here],
                      sorted({(round(c, 2), dtype, _quant_of(prov)) for _, dtype, prov in lines
                              if (c := byte_ceiling(prov, dtype))}))
        for ax, ylabel in ((ax_t, f"{unit} (2MNK / t)"), (ax_s, "speedup vs dense (same run)")):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xlabel("M (batch rows)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{shape}  (N={N}, K={K})", fontsize=9)
    # one legend for the figure, below the panels: it never covers a curve
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(len(handles), 4),
               fontsize=8, frameon=False)
    if title is None:
        dts = ", ".join(dict.fromkeys(r["dtype"] for r in rows))
        title = f"sparse24 throughput on {' vs '.join(devices)}: {dts}"
    fig.suptitle(title, fontsize=11)
    return fig


# A y range wider than this (max / min) is drawn on a log axis: on a linear one the small
# values (CPU speedups of 0.04-0.4x beside 1x, GFLOP/s at M = 1 beside M = 128) sit on zero.
_LOG_RANGE = 8.0


def _value_axis(ax, values: list[float]) -> None:
    """Log y when the data span more than ``_LOG_RANGE``; else linear from zero."""
    lo, hi = min(values), max(values)
    if hi / lo > _LOG_RANGE:
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.5, hi * 1.5)
    else:
        ax.set_ylim(0, hi * 1.1)


# The ceiling notes are sized for figure()'s panels (12 inches wide in two columns, 3.3 inches a row):
# ~95 characters of 7-point text fit a speedup panel's width, a line of it is ~1/18 of its height.
_NOTE_CHARS = 80
_NOTE_LINE = 9.5 / 170


def _ceiling_label(items: list[tuple[float, str, str]], prefix: str = "byte ceiling ", suffix: str = "") -> str:
    """One note for several ceilings (equal values named once), wrapped to a panel's width."""
    import textwrap
    whats: dict = {}
    for c, dtype, quant in sorted(items):
        whats.setdefault(c, []).append(f"{quant} 2:4 vs {dtype}" if quant else f"{dtype} 2:4")
    text = prefix + ", ".join(f"{c:.2f}x ({', '.join(w)})" for c, w in whats.items()) + suffix
    return "\n".join(textwrap.wrap(text, _NOTE_CHARS, break_on_hyphens=False))


def _speedup_axis(ax, speedups: list[float], ceilings: list[tuple[float, str, str]]) -> None:
    """Axis limits from the measured speedups (and the 1x line), not from the byte ceilings: a
    ceiling within reach of the data is drawn as a line (the axis grows to show it and its label;
    lines closer than a label's height share one label); those far above it (CPU: 0.04-0.4x
    measured, 6.4x ceiling) are one note at the panel's top edge, wrapped inside the panel."""
    lo, hi = min(min(speedups), 1.0), max(max(speedups), 1.0)
    log = hi / lo > _LOG_RANGE
    bottom, start = (lo / 1.5, hi * 1.5) if log else (0.0, hi * 1.15)
    near = sorted(c for c in ceilings if c[0] <= 2 * start)
    while True:   # a ceiling the axis reaches anyway (its room for the notes) is a line too: settles
        far = [c for c in ceilings if c not in near]
        far_text = _ceiling_label(far, "far above \u2191 byte ceiling ") if far else ""
        far_room = (far_text.count("\n") + 1) * _NOTE_LINE + 0.03 if far else 0.0
        top, groups = _notes_top(near, hi, far_room, bottom, start, log)
        reached = [c for c in far if c[0] <= top]
        if not reached:
            break
        near = sorted(near + reached)
    for group in groups:
        for c, quant in dict.fromkeys((c, quant) for c, _, quant in group):
            ax.axhline(c, color=_CEILING_COLORS[quant], linestyle=(0, (4, 3)), linewidth=1, alpha=0.6)
        ax.annotate(_ceiling_label(group, suffix="; memory-bound M"), (0.01, group[-1][0]),
                    xycoords=("axes fraction", "data"), fontsize=7, va="bottom", color="dimgray")
    if far:
        quants = {q for *_, q in far}
        ax.annotate(far_text, (0.99, 0.98), xycoords="axes fraction", ha="right", va="top", fontsize=7,
                    multialignment="right",
                    color=_CEILING_COLORS[quants.pop()] if len(quants) == 1 and "" not in quants else "dimgray")
    if log:
        from matplotlib.ticker import FuncFormatter
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    else:
        ax.set_ylim(0, top)


def _notes_top(near: list, hi: float, far_room: float, bottom: float, start: float, log: bool):
    """``(top, groups)``: the speedup axis' top (at least ``start``) leaving room above the data for
    the far note (``far_room``, a fraction of the panel) and above each group of ``near`` ceiling
    lines (sorted) for its label under that note; a line closer to the one below than that one's
    label is tall joins its group (one label above them all)."""
    def frac(v: float, t: float) -> float:   # v's height in the panel (0: bottom, 1: top) when it ends at t
        return math.log(v / bottom) / math.log(t / bottom) if log else v / t

    def top_for(v: float, room: float) -> float:   # the least top leaving ``room`` (a fraction) above v
        return bottom * (v / bottom) ** (1 / (1 - room)) if log else v / (1 - room)

    def lines(items) -> int:
        return _ceiling_label(items).count("\n") + 1

    base = max(start, top_for(hi, far_room)) if far_room else start
    top, groups = base, []
    for _ in range(3):   # group at this top, then the top those labels need (it grows a little: settles)
        groups = []
        for c in near:
            if groups and frac(c[0], top) < frac(groups[-1][-1][0], top) + (lines(groups[-1]) + 0.3) * _NOTE_LINE:
                groups[-1].append(c)
            else:
                groups.append([c])
        top = max([base] + [top_for(g[-1][0], lines(g) * _NOTE_LINE + far_room + 0.02) for g in groups])
    return top, groups


def _device_label(row: dict) -> str:
    """``"AMD EPYC (CPU, 1 thread)"`` or the GPU's name: CPU figures depend on the thread count."""
    if row.get("device_type") == "cpu":
        n = str(row.get("threads", ""))
        return f"{row['device']} (CPU" + (f", {n} thread{'s' * (n != '1')})" if n else ")")
    return row["device"]


def plot_csv(paths, out: str | os.PathLike, title: str | None = None) -> Path:
    """:func:`read_rows` then :func:`plot_rows`. Returns the PNG path."""
    return plot_rows(read_rows(paths), out, title)

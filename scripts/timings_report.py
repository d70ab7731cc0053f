"""Read the tuner's every-candidate timings (``python -m sparse24 autotune --timings CSV``,
``results/<GPU>/autotune-timings.csv`` from scripts/gpu_check.sh) and say what they mean
for the untuned defaults: per key, the fastest config, the built-in default's time and rank
among the candidates, and the fastest per tile shape (16-row tiles per warp, BLOCK_K); then
how far the defaults are from the best over all keys. No GPU needed.

    python scripts/timings_report.py results/NVIDIA_H200/autotune-timings.csv [--sms 132]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from sparse24.ops.config_space import KernelConfig, builtin_config
from sparse24.tools.tuning import TIMING_COLUMNS, runtime_layout


def read_rows(paths) -> dict:
    """``{(gpu, M, N, K, dtype): [(config, kernel, us or None, dense_us or None, status), ...]}``."""
    keys = defaultdict(list)
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(TIMING_COLUMNS) - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: not an autotune --timings file (columns {sorted(missing)} missing)")
            for r in reader:
                where = f"{path} line {reader.line_num}"
                try:
                    raw = json.loads(r["config"])
                except ValueError as e:
                    raise ValueError(f"{where}: config {r['config']!r} is not JSON ({e})") from None
                try:
                    cfg = KernelConfig.from_json(raw)
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{where}: config {r['config']!r}: {e}") from None
                us, dense = _micros(r, "kernel_us", where), _micros(r, "dense_us", where)
                keys[(r["gpu"], int(r["m"]), int(r["n"]), int(r["k"]), r["dtype"])].append(
                    (cfg, r["kernel"], us, dense, r["status"]))
    return keys


def _micros(row: dict, column: str, where: str) -> float | None:
    """A timing cell: None when empty (the candidate did not run)."""
    text = row[column]
    if not text:
        return None
    try:
        us = float(text)
    except ValueError:
        us = math.nan
    if not (math.isfinite(us) and us > 0):  # a nan would be ranked and reported as "nanx the best"
        raise ValueError(f"{where}: {column} must be a positive finite number of microseconds (or empty), "
                         f"got {text!r}")
    return us


def shape_of(cfg: KernelConfig) -> str:
    """A config's tile shape: ``prefill`` or ``<tiles per warp>t x <BLOCK_K>`` for the decode kernels."""
    if cfg.kernel != "decode":
        return cfg.kernel
    return f"{cfg.block_n // (16 * cfg.num_warps)}t x {cfg.block_k}"


def report_key(key: tuple, rows: list, num_sms: int) -> dict:
    """The figures of one key: best, default (time, rank), best per tile shape, dense."""
    _, M, N, K, dtype = key
    timed = sorted((us, cfg) for cfg, _, us, _, status in rows if us is not None and status == "ok")
    dense = [d for *_, d, _ in rows if d is not None]
    default = builtin_config(M, N, K, num_sms, runtime_layout(dtype), dtype)
    times = {cfg: us for us, cfg in timed}
    per_shape = {}
    for us, cfg in timed:
        per_shape.setdefault(shape_of(cfg), (us, cfg))
    return dict(key=key, best=timed[0] if timed else None, dense=statistics.median(dense) if dense else None,
                default=default, default_us=times.get(default),
                default_rank=1 + [cfg for _, cfg in timed].index(default) if default in times else None,
                candidates=len(rows), timed=len(timed), per_shape=per_shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="autotune --timings files")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's multiprocessors (the defaults depend on it)")
    a = ap.parse_args(argv)
    try:
        keys = read_rows(a.csv)
    except (OSError, ValueError, KeyError) as e:
        print(f"timings_report: {e}", file=sys.stderr)
        return 2
    ratios = []
    for key in sorted(keys, key=lambda k: (k[0], k[4], k[2], k[3], k[1])):
        r = report_key(key, keys[key], a.sms)
        gpu, M, N, K, dtype = key
        print(f"{gpu} M={M} {N}x{K} {dtype}: {r['timed']} of {r['candidates']} candidates timed"
              + (f", dense {r['dense']:.1f} us" if r["dense"] else ""))
        if r["best"] is None:
            print("  no candidate ran")
            continue
        best_us, best = r["best"]
        vs = f" ({r['dense'] / best_us:.2f}x dense)" if r["dense"] else ""
        print(f"  best     {best_us:8.1f} us  {shape_of(best):10} {best}{vs}")
        if r["default_us"] is None:
            print(f"  default  not among the timed candidates: {r['default']}")
        else:
            ratios.append(r["default_us"] / best_us)
            print(f"  default  {r['default_us']:8.1f} us  {shape_of(r['default']):10} rank {r['default_rank']} of "
                  f"{r['timed']}, {r['default_us'] / best_us:.2f}x the best")
        for shape, (us, cfg) in sorted(r["per_shape"].items(), key=lambda kv: kv[1][0]):
            print(f"    {shape:10} best {us:8.1f} us  {cfg}")
    if ratios:
        print(f"defaults timed at {len(ratios)} keys: median {statistics.median(ratios):.2f}x, worst "
              f"{max(ratios):.2f}x the best candidate")
    else:
        print("no key timed its built-in default")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prefill kernel's configs (``kernels/sparse24_prefill.py``, M > 16, the
decode layout): its config space and untuned defaults. Its launch is a variant
of the plan-cached path in :mod:`.launch` (``linear_prefill``, ``run_prefill``).

At M > 16 on CUDA a decode-layout weight runs this kernel (``sparse24::linear``
routes it, :mod:`.op`): each weight tile is decoded once per BLOCK_M rows of x
(32-256, the untuned default chosen per shape by :mod:`.prefill_model`), straight
from the one copy the module holds;
no call converts or decompresses the whole weight (``scripts/bench_host.py
--prefill`` counts the aten ops and bytes a call allocates).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from ..config_space import DECODE_M, KernelConfig, check_prefill_config, prefill_configs, split_factors
from .prefill_model import L2_BYTES_PER_SM_CLK, L2_MEASURED, LATENCY_MAX_M, predicted_time

__all__ = ["prefill_config", "prefill_configs", "check_prefill_config", "cost_key", "natural_tile", "prefill_pair",
           "prefill_costs", "shared_need", "COSTS_FILE", "PAIRS", "COST_KEYS", "ROBUST_TOLERANCE", "ROBUST_L2"]

# The untuned default is the config the time model (:mod:`.prefill_model`) predicts fastest
# for the shape, from each config's costs measured on its sm_90 SASS with the installed
# Triton (scripts/kernel_static_check.py --prefill --write-costs, one table per Triton
# minor version, committed in COSTS_FILE; docs/kernels.md "Prefill path"): of the configs whose
# worst case over the L2 bandwidths ROBUST_L2 (the model's figure and the H200's two measured
# runs, 23.4 and 26.0 B per SM clock) is within ROBUST_TOLERANCE of the best worst case, the best
# at the model's figure. (Until the H200 measured it, the set was 32, 48, 64 and unbounded, to
# cover an L2 figure nobody had measured; the model's figure was an assumed 32.)
COSTS_FILE = Path(__file__).with_name("prefill_costs.json")
PAIRS = ("float16", "bfloat16", "int8-float16", "int8-bfloat16", "int4-float16", "int4-bfloat16")
COST_KEYS = ("regs", "spills", "shared", "per_sm", "loop", "mma", "half", "t_tensor", "t_issue", "alone", "l2_bytes")
ROBUST_TOLERANCE = 0.05   # how far below the best worst case a default's worst case may lie
ROBUST_L2 = (L2_BYTES_PER_SM_CLK, *L2_MEASURED)

# Without a table for the installed Triton (a release not yet measured; the tables cover 3.4-3.9): a
# fixed list, fitted to the model as it was before 2026-12-05 (L2 assumed at 32 B per SM clock,
# a program's loads under its multiply past 64 rows) over the 11 shapes of issue 22 at M =
# 32-4096 for every weight kind and Triton 3.9 and 3.6 (the best sum over M of the minimum over
# shapes, weight kinds and the two L2 bandwidths). Not refitted to the serial rule: what that
# rule prefers past 64 rows, two 64 x 128 programs per SM, is its part no GPU has checked yet.
# Tiles in order, each with the programs (in units of the SMs) it needs before the next,
# smaller one is taken, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SMs); the last tile takes
# whatever is left. One 16-row W tile per warp
# (num_warps == BLOCK_N // 16, the decode layout's fragment ownership) and BLOCK_N >= 64,
# so sm_90 runs wgmma with W from registers (HGMMA). Every program reads its x tile and its
# weight tile through L2 on every K-tile, so the wide tile comes first: 256 x 128 x 64 (8
# warps, x in its own order, one accumulator) reads 656 B (fp16) per column of K for
# 256 x 128 multiply-adds, 128 x 64 x 64 328 B for a quarter of them. Below Triton 3.6 no
# tile is natural (natural_tile): there 256 x 128 would run permuted and serial, so it is
# left out. The wide weight tile, 128 x 256 (the tables' large-M choice for 16-bit and INT8
# weights before the serial rule), is not in the list: how an unmeasured Triton compiles its two
# halves is unknown.
_WIDE = (256, 128, 64, 8, 2, 0.5)
_TILES = ((128, 128, 64, 8, 2, 0.5), (128, 64, 64, 4, 2, 0.0), (64, 64, 128, 4, 2, 0.5), (32, 64, 128, 4, 2, 0.0))
# Up to LATENCY_MAX_M rows the list's small tiles wait out their loads (prefill_model: the latency
# term the H200's 17-64-row runs fitted): they take 3 stages (two K-tiles in flight a program) and
# split along K to FEW_ROWS_PER_SM programs per SM, the fewest either tile fits on an SM at 3 stages
# in the measured Tritons' tables and with Triton 3.5.1 (64 x 64 x 128: 3; 32 x 64 x 128: 4-5, sm_90,
# every weight kind; scripts/kernel_static_check.py's programs_per_sm): 4096 x 4096 at 32 rows
# keeps 34.9 KiB of fp16 weight in flight per SM (split 4), against 8.7 KiB on 2 stages split 2.
FEW_ROWS_STAGES, FEW_ROWS_PER_SM = 3, 3


def untuned_prefill(M: int, N: int, K: int, dtype: str, num_sms: int, shared_memory: int | None,
                    capability) -> KernelConfig:
    """:func:`prefill_config` for a dtype key (``"float16"``, ``"int8-bfloat16"``, ...) at ``M`` rows (taken as
    17 below that) on a GPU of ``num_sms`` SMs, ``shared_memory`` bytes per block and ``capability`` (or None):
    what a launch without a tuned prefill config runs, and what the store reports for it."""
    return prefill_config(max(M, DECODE_M + 1), N, K, num_sms, prefill_pair(dtype), dtype.endswith("float32"),
                          shared_memory, None if capability is None else tuple(capability))


@functools.lru_cache(maxsize=4096)
def prefill_config(M: int, N: int, K: int, num_sms: int = 132, pair: str = "float16", fp32_x: bool = False,
                   shared_memory: int | None = None, capability: tuple[int, int] | None = None) -> KernelConfig:
    """The untuned prefill config for ``M`` rows (``M > 16``) of an ``N x K`` weight:
    of :func:`prefill_configs` (M), each also split along K by the factors of
    :func:`~sparse24.ops.config_space.split_factors` (split-K inside the launch, where the output tiles
    leave SMs idle), the one :func:`~.prefill_model.predicted_time` puts fastest on
    ``num_sms`` SMs (default: an H200's 132) from the installed Triton's cost table for
    ``pair`` (:data:`PAIRS`, :func:`prefill_pair`; a split config costs its split row,
    :func:`cost_key`): of the configs whose worst-case ratio to dense over the L2 bandwidths
    :data:`ROBUST_L2` (the model's 24.7 B per SM clock and the H200's two measured runs) is
    within :data:`ROBUST_TOLERANCE` of the largest, the largest ratio at 24.7. Without a table
    for this Triton: the first tile of a fixed list that wastes at most half its BLOCK_M rows
    and gives enough programs, split along K while that still fits one wave (up to 64 rows: on 3
    stages, and FEW_ROWS_PER_SM programs per SM; docs/kernels.md "Prefill path", "17-64 rows: bytes
    in flight"). Either way only configs whose :func:`shared_need` (float32 x: ``fp32_x``, on a GPU
    of ``capability``) fits ``shared_memory`` bytes, the device's per-program limit (None: no limit;
    where none fits, the one that needs least): Triton refuses a launch that needs more
    (OutOfResources), and the tables' choices assume sm_90's 227 KiB."""
    if M <= DECODE_M:
        raise ValueError(f"the prefill kernel serves M > {DECODE_M}, got M = {M}")
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")
    table = prefill_costs()
    if table is not None:
        space = set(prefill_configs(M))
        by_cfg = {r["cfg"]: r for r in table[pair]["configs"]}
        # (the row that measures it, split factor) for each config of the space, in table order
        rows = [(by_cfg.get(cost_key(dataclasses.replace(r["cfg"], split_k=s))), s) for r in table[pair]["configs"]
                if r["cfg"] in space for s in split_factors(M, N, K, r["cfg"], num_sms)]
        rows = _fitting([(r, s) for r, s in rows if r is not None and not r["spills"] and r["per_sm"] >= 1],
                        lambda rs: shared_need(rs[0]["cfg"], rs[0]["shared"], fp32_x, capability), shared_memory)
        if rows:
            w_bytes = table[pair]["w_bytes"]
            ratios = [[dense / ours for ours, dense in (predicted_time(r, M, N, K, w_bytes, s, l2, num_sms)
                                                        for l2 in ROBUST_L2)] for r, s in rows]
            floor = max(map(min, ratios)) * (1 - ROBUST_TOLERANCE)
            first_best = -max((rat[0], -i) for i, rat in enumerate(ratios) if min(rat) >= floor)[1]
            r, s = rows[first_best]
            return dataclasses.replace(r["cfg"], split_k=s)
    few = M <= LATENCY_MAX_M
    tiles = [(_config(bm, bn, bk, warps, FEW_ROWS_STAGES if few else stages), fill)
             for bm, bn, bk, warps, stages, fill in ((_WIDE,) if natural_tile(256, 128) else ()) + _TILES]
    tiles = _fitting(tiles, lambda cf: shared_need(cf[0], _listed_shared(cf[0], pair), fp32_x, capability),
                     shared_memory)
    for c, fill in tiles:
        if c.block_m < 2 * M and -(-M // c.block_m) * -(-N // c.block_n) >= fill * num_sms:
            break
    tiles, wave = -(-M // c.block_m) * -(-N // c.block_n), (FEW_ROWS_PER_SM if few else 1) * num_sms
    return dataclasses.replace(c, split_k=max((s for s in split_factors(M, N, K, c, num_sms) if tiles * s <= wave),
                                              default=1))


def _fitting(items: list, need, limit: int | None) -> list:
    """``items`` whose ``need(item)`` is at most ``limit`` (None: all), else the one that needs least."""
    if limit is None or not items:
        return items
    return [i for i in items if need(i) <= limit] or [min(items, key=need)]


def shared_need(config: KernelConfig, shared: int, fp32_x: bool = False,
                capability: tuple[int, int] | None = None) -> int:
    """Bytes of shared memory a launch of prefill ``config`` takes, from ``shared``, its cost-table
    row's (compiled for sm_90 with 16-bit x: the pipeline's stages of x and weight tiles), for
    float32 x (``fp32_x``) on a GPU of ``capability`` (None: sm_80 or later). Compiled with Triton
    3.9 for sm_75, sm_80 and sm_86 (tables' 16-bit configs, fp16 weights): 16-bit x needs at most
    the sm_90 figure from sm_80 (sm_86: 104448 against 120832 B at 64 x 128 x 128 on 4 stages);
    float32 x adds its tiles' second two bytes a value and the weight tile once more as float32
    (the CUDA-core dot's operand: 64 x 128 x 128, 4 stages, 251904 B = 120832 + 65536 + 65536). Before
    sm_80 (no asynchronous copies) nothing is staged: the weight tile as float32, and float32 x's
    (sm_75: 65536 B at 64 x 128 x 128, 98304 with float32 x, whatever the stages)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if capability is not None and tuple(capability) < (8, 0):
        return bn * bk * 4 + (bm * bk * 4 if fp32_x else 0)
    return shared + (config.num_stages * bm * bk * 2 + bn * bk * 4 if fp32_x else 0)


def _listed_shared(config: KernelConfig, pair: str) -> int:
    """A fixed-list tile's sm_90 shared memory (for :func:`shared_need`) where no table measures the
    installed Triton: the newest table's, the larger of its split rows (a split's epilogue can take
    more), else an upper bound of every table row (stages of x and weight tiles at two bytes a
    value, and a float32 tile of the output)."""
    tables = _load_costs(str(COSTS_FILE))
    for version in sorted(tables, key=lambda v: tuple(map(int, v.split("."))), reverse=True):
        by_cfg = {r["cfg"]: r["shared"] for r in tables[version][pair]["configs"]}
        got = [by_cfg[k] for k in (dataclasses.replace(config, split_k=s) for s in (1, 2)) if k in by_cfg]
        if got:
            return max(got)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return config.num_stages * (bm + bn) * bk * 2 + bm * bn * 4


def cost_key(config: KernelConfig) -> KernelConfig:
    """The cost-table row that measures ``config``: its own, split along K in two for any
    split (SPLIT_K changes only the code after the main loop; the loop compiles a little
    differently once split)."""
    return dataclasses.replace(config, split_k=min(config.split_k, 2))


def prefill_pair(dtype: str) -> str:
    """The cost table's key (:data:`PAIRS`) for a launch's
    :func:`~sparse24.ops.config_space.dtype_key` (x's dtype, prefixed ``int8-`` / ``int4-`` for
    quantized weights): float32 x counts as float16 (the table measures the 16-bit pairs)."""
    return dtype.replace("float32", "float16")


def prefill_costs(version: tuple[int, ...] | None = None, path: Path | None = None) -> dict | None:
    """The cost table of Triton ``version`` (default: the installed one; its major.minor) from
    ``path`` (default :data:`COSTS_FILE`): ``{pair: {"w_bytes": float, "configs": [row, ...]}}``,
    each row a dict of the model's inputs (``cfg`` a :class:`KernelConfig`; regs, spills,
    shared, per_sm, loop, mma, half, t_tensor, t_issue, alone, l2_bytes), or None when the file
    has no table for that version. Raises ValueError naming the file if it is corrupt."""
    if version is None:
        from sparse24.kernels.interpreter import triton_version
        version = triton_version()
    return _load_costs(str(path or COSTS_FILE)).get(f"{version[0]}.{version[1]}")


@functools.lru_cache(maxsize=8)
def _load_costs(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != 1 or not isinstance(doc.get("tables"), dict):
            raise ValueError("need format 1 and a 'tables' object")
        tables = {}
        for version, t in doc["tables"].items():
            if set(t["pairs"]) != set(PAIRS):
                raise ValueError(f"table {version}: need the pairs {PAIRS}, got {sorted(t['pairs'])}")
            tables[version] = {pair: {"w_bytes": _number(p["w_bytes"]),
                                      "configs": [_cost_row(row) for row in p["configs"]]}
                               for pair, p in t["pairs"].items()}
        return tables
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad prefill cost table {path}: {e}") from None


def _number(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == math.inf:
        raise ValueError(f"need a finite number >= 0, got {v!r}")
    return v


def _cost_row(row: dict) -> dict:
    if set(row) != {"config", *COST_KEYS}:
        raise ValueError(f"a row needs exactly the keys config, {', '.join(COST_KEYS)}; got {sorted(row)}")
    out = {k: _number(row[k]) for k in COST_KEYS}
    if not isinstance(row["config"], list) or len(row["config"]) != 6:
        raise ValueError(f"a row's config is [block_m, block_n, block_k, warps, stages, split_k], got {row['config']!r}")
    *tile, split = row["config"]
    out["cfg"] = check_prefill_config(dataclasses.replace(_config(*tile), split_k=split))
    if split not in (1, 2):
        raise ValueError(f"a row measures split_k 1 or 2 (every split), got {split}")
    return out


@functools.lru_cache(maxsize=None)
def natural_tile(block_m: int, block_n: int) -> bool:
    """Whether the installed Triton runs a BLOCK_M x BLOCK_N prefill tile in x's own column
    order (``kernels/sparse24_prefill.py``, ``natural_tile``: from 128 rows with Triton 3.9;
    with 3.6 at 128 rows and at 256 x 128; before 3.6 none)."""
    from sparse24.kernels.sparse24_prefill import natural_tile as natural
    return natural(block_m, block_n)


@functools.lru_cache(maxsize=None)
def _config(bm, bn, bk, warps, stages) -> KernelConfig:
    return KernelConfig(bm, bn, bk, 8, 1, warps, stages, kernel="prefill")

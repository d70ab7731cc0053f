"""Large-M sparse tensor-core GEMMs on this GPU with the host left out: can a prefill call
beat dense cuBLAS from a 2:4 weight, and from which storage?

The H200 probe of 2026-12-04 (results/NVIDIA_H200/probe_prefill.csv) timed cuSPARSELt's
kernels at 1.2-1.5x dense cuBLAS at 4096 rows, while a call through torch's
``to_sparse_semi_structured`` weight took ~1 ms (host: the plan is made per call). Every
path here is captured in a CUDA graph and timed by replaying it (median of do_bench), so
only GPU time counts:

- ``dense``: ``F.linear`` on the dense fp16 weight (cuBLAS);
- ``cslt``: ``F.linear`` on torch's cuSPARSELt weight (its own compressed copy, ~0.56x);
- ``cutlass``: the same through torch's CUTLASS kernels (``_FORCE_CUTLASS``);
- ``unpack``: sparse24's unpack kernel alone (the decode layout to a dense weight);
- ``unpack_mm``: the unpack route (unpack, then cuBLAS), sparse24's prefill default;
- ``compress``: ``torch._cslt_compress`` of the dense weight;
- ``unpack_cslt``: a route holding sparse24's one copy: unpack, cuSPARSELt compress, then
  cuSPARSELt's product (the scratch is transient).

Each sparse result is checked against ``F.linear`` (max |diff| / max |ref|). Writes
``sparse_mm.csv`` to ``--out`` row by row; a path that fails is reported and written as nan.

    python scripts/gpu_sparse_mm.py --out results/NVIDIA_H200/
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import launch

COLUMNS = ("dense", "cslt", "cutlass", "unpack", "unpack_mm", "compress", "unpack_cslt")


def _graph_us(fn, dev) -> tuple[float, torch.Tensor]:
    """Median GPU time of one replay of ``fn`` captured in a CUDA graph (on CPU, --smoke: one
    eager call's wall time), and the output of the captured call."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        y = fn()
        return 1e6 * (time.perf_counter() - t0), y
    from triton.testing import do_bench
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm up (plans, compiled kernels) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    g.replay()
    torch.cuda.synchronize()
    return do_bench(g.replay, warmup=5, rep=25, return_mode="median") * 1e3, y


def _semi_structured(w: torch.Tensor, cutlass: bool):
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    old = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = cutlass
    try:
        return to_sparse_semi_structured(w)
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = old


def measure(out: Path, dev, shapes, ms) -> list[list]:
    torch.manual_seed(0)
    f = open(out / "sparse_mm.csv", "w", newline="")
    wr = csv.writer(f)
    wr.writerow(["N", "K", "M", *(f"{c}_us" for c in COLUMNS), "worst_rel_diff"])
    rows = []
    for N, K in shapes:
        w = torch.randn(N, K, device=dev, dtype=torch.float16)
        p = pack_decode(sparse24.compress(w))
        wd = p.to_dense().to(torch.float16)   # the weight every path computes with

        def unpack():
            return launch.unpack_dense(p.values, p.meta, p.scale, (N, K), torch.float16, zero=p.zero,
                                       group_size=p.group_size or 0)
        weights = {}
        for name, cutlass in (("cslt", False), ("cutlass", True)):
            try:
                weights[name] = _semi_structured(wd, cutlass)
            except Exception as e:  # noqa: BLE001 (a library path this GPU or build lacks is reported)
                print(f"{N}x{K} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.float16)
            ref = F.linear(x.float(), wd.float())
            paths = {
                "dense": lambda: F.linear(x, wd),
                "cslt": (lambda: F.linear(x, weights["cslt"])) if "cslt" in weights else None,
                "cutlass": (lambda: F.linear(x, weights["cutlass"])) if "cutlass" in weights else None,
                "unpack": unpack,
                "unpack_mm": lambda: F.linear(x, unpack()),
                "compress": lambda: torch._cslt_compress(wd),
                "unpack_cslt": lambda: torch._cslt_sparse_mm(torch._cslt_compress(unpack()), x.t(),
                                                             transpose_result=True),
            }
            r, worst = [N, K, M], 0.0
            for name in COLUMNS:
                fn = paths[name]
                try:
                    if fn is None:
                        raise RuntimeError("no weight")
                    us, y = _graph_us(fn, dev)
                    if name not in ("unpack", "compress"):   # a product: check it
                        d = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        worst = max(worst, d)
                        if d > 1e-2:
                            print(f"  {name}: max |diff| / max |ref| {d:.3g}: wrong, not timed", flush=True)
                            us = float("nan")
                except Exception as e:  # noqa: BLE001 (reported; the sweep goes on)
                    print(f"  {N}x{K} M {M} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    us = float("nan")
                r.append(round(us, 2))
            r.append(f"{worst:.3g}")
            wr.writerow(r)
            f.flush()
            rows.append(r)
            print(f"{N}x{K} M {M:5d}  " + "  ".join(f"{c} {v:8.2f}" for c, v in zip(COLUMNS, r[3:])), flush=True)
    f.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true", help="CPU, one small shape: the code paths only")
    a = ap.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_sparse_mm: no CUDA GPU visible; nothing to measure", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    if a.smoke:
        measure(a.out, torch.device("cpu"), ((128, 256),), (64,))
    else:
        measure(a.out, torch.device("cuda"), ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)),
                (256, 1024, 2048, 4096))
    return 0


if __name__ == "__main__":
    sys.exit(main())

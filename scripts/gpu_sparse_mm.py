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
  cuSPARSELt's product (the scratch is transient);
- ``cslt_alg``: ``torch._cslt_sparse_mm`` on the same compressed weight with the algorithm
  ``torch._cslt_sparse_mm_search`` picked for this shape (``F.linear`` uses algorithm 0).

Then the host, which the graphs leave out: the same products called eagerly, back to back,
wall time per call (median of 5 x 20 calls, synchronised after each 20), as an eager model
sees them: ``dense_eager``, ``cslt_eager`` (``F.linear`` on torch's weight: its Python
dispatch, then the op) and ``cslt_mm_eager`` (the op alone: ``torch._cslt_sparse_mm`` on
the compressed tensor, which makes its cuSPARSELt plan on every call). Where ``cslt_mm_eager``
stays near ``cslt`` the op is usable without graphs; where it sits at ~1 ms the plan is
the cost, and only a kept plan (graphs, or a binding of our own) removes it.

Each sparse result is checked against ``F.linear`` (max |diff| / max |ref|). Writes
``sparse_mm.csv`` to ``--out`` row by row; a path that fails is reported and written as nan.

``--layout`` also writes ``cslt_layout.pt``: what ``torch._cslt_compress`` makes of small
weights whose kept values encode their own row (``rows``) or column (``cols``) under five
2:4 masks chosen so that each group's sequence of kept pairs is its own, fp16 and int8;
``--analyze FILE`` reads such a file on any machine and says whether the kept values lie in
plain row-major order (then a kernel of ours could read cuSPARSELt's copy and a layer could
hold that one copy), which group each 4-bit field of the metadata encodes, and whether that is
the order torchao's sm_90 sparsify kernel writes for cuSPARSELt (values row-major, metadata
reordered: ``sm90_meta_groups``), on the library the GPU has. Then it builds that predicted
buffer from our layout (``sparse24.interop._cusparselt_sm90_buffer``, no dense copy), compares it
with ``torch._cslt_compress``'s and runs cuSPARSELt's product on it (``cslt_layout.txt``).

    python scripts/gpu_sparse_mm.py --out results/NVIDIA_H200/ --layout
    python scripts/gpu_sparse_mm.py --analyze results/NVIDIA_H200/cslt_layout.pt
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
from sparse24.format import _unpack_nibbles
from sparse24.interop import _cusparselt_sm90_buffer, _sm90_meta_fields
from sparse24.ops.linear24 import launch
from sparse24.tools.tuning import time_launches_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_user_view import _wall_us  # noqa: E402  (the same eager timer as the other GPU scripts)

COLUMNS = ("dense", "cslt", "cutlass", "unpack", "unpack_mm", "compress", "unpack_cslt", "cslt_alg",
           "dense_eager", "cslt_eager", "cslt_mm_eager")
EAGER = ("dense_eager", "cslt_eager", "cslt_mm_eager")   # host included: wall time per call


def _graph_us(fn, dev) -> tuple[float, torch.Tensor]:
    """Median GPU time of one replay of ``fn`` captured in a CUDA graph (on CPU, --smoke: one
    eager call's wall time), and the output of the captured call."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        y = fn()
        return 1e6 * (time.perf_counter() - t0), y
    out = []
    return time_launches_us([fn], warmup_ms=5, rep_ms=25, outputs=out), out[0]


def _eager_us(fn, dev) -> tuple[float, torch.Tensor]:
    """Wall time per call of ``fn`` called 20 times back to back and synchronised once (median of
    5: gpu_user_view's timer), the host's time where it exceeds the GPU's, as an eager model sees
    it; with one more call's output."""
    return _wall_us(fn, dev, 20, 5), fn()


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
    wr.writerow(["N", "K", "M", *(f"{c}_us" for c in COLUMNS), "worst_rel_diff", "cslt_alg_id"])
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
            packed = weights["cslt"].packed if "cslt" in weights else None
            alg = None
            if packed is not None:
                try:
                    alg = torch._cslt_sparse_mm_search(packed, x.t(), transpose_result=True)
                except Exception as e:  # noqa: BLE001 (reported; the column is nan)
                    print(f"  {N}x{K} M {M} alg search: {type(e).__name__}: {str(e)[:160]}", flush=True)
            paths = {
                "dense": lambda: F.linear(x, wd),
                "cslt": (lambda: F.linear(x, weights["cslt"])) if "cslt" in weights else None,
                "cutlass": (lambda: F.linear(x, weights["cutlass"])) if "cutlass" in weights else None,
                "unpack": unpack,
                "unpack_mm": lambda: F.linear(x, unpack()),
                "compress": lambda: torch._cslt_compress(wd),
                "unpack_cslt": lambda: torch._cslt_sparse_mm(torch._cslt_compress(unpack()), x.t(),
                                                             transpose_result=True),
                "cslt_alg": (lambda: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True, alg_id=alg))
                if alg is not None else None,
                "dense_eager": lambda: F.linear(x, wd),
                "cslt_eager": (lambda: F.linear(x, weights["cslt"])) if "cslt" in weights else None,
                "cslt_mm_eager": (lambda: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True))
                if packed is not None else None,
            }
            r, worst = [N, K, M], 0.0
            for name in COLUMNS:
                fn = paths[name]
                try:
                    if fn is None:
                        raise RuntimeError("no weight")
                    us, y = (_eager_us if name in EAGER else _graph_us)(fn, dev)
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
            r.append("" if alg is None else alg)
            wr.writerow(r)
            f.flush()
            rows.append(r)
            print(f"{N}x{K} M {M:5d}  " + "  ".join(f"{c} {v:8.2f}" for c, v in zip(COLUMNS, r[3:3 + len(COLUMNS)])),
                  flush=True)
    f.close()
    return rows


PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))   # the six ways to keep 2 of 4
LAYOUT_SHAPES = {torch.float16: (128, 128), torch.int8: (64, 64)}   # codes 1..N and 1..K exact in both
N_MASKS = 5   # 6**5 = 7776 >= 4096 groups: each group's sequence of kept pairs over the masks is its own
NIBBLE_CODES = {"lo | hi << 2": lambda lo, hi: lo | hi << 2, "hi | lo << 2": lambda lo, hi: hi | lo << 2}


def _group_pairs(N: int, K: int, mask_no: int) -> torch.Tensor:
    """(N, K // 4) indices into PAIRS: group G's pair in mask ``mask_no`` is base-6 digit ``mask_no`` of G."""
    groups = torch.arange(N * K // 4).view(N, K // 4)
    return groups // 6 ** mask_no % 6


def _digit_mask(N: int, K: int, mask_no: int) -> torch.Tensor:
    """The (N, K) bool 2:4 mask keeping, in every group, the pair :func:`_group_pairs` gives it."""
    keep = torch.tensor(PAIRS)[_group_pairs(N, K, mask_no)]          # (N, K // 4, 2)
    return torch.zeros(N, K // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).view(N, K)


def dump_layout(path: Path, dev, compress=None) -> dict:
    """Write what ``compress`` (``torch._cslt_compress``) makes of 2:4 weights whose kept values are
    their row + 1 (``rows``) or column + 1 (``cols``), under N_MASKS masks per dtype, to ``path``."""
    compress = compress or torch._cslt_compress
    res = {}
    for dtype, (N, K) in LAYOUT_SHAPES.items():
        entries = []
        try:
            for mask_no in range(N_MASKS):
                mask = _digit_mask(N, K, mask_no)
                rows = torch.arange(1, N + 1)[:, None].expand(N, K) * mask
                cols = torch.arange(1, K + 1)[None, :].expand(N, K) * mask
                entries.append({"mask": mask, "rows": compress(rows.to(dev, dtype)).cpu(),
                                "cols": compress(cols.to(dev, dtype)).cpu()})
        except Exception as e:  # noqa: BLE001 (a dtype this build refuses is recorded, the others kept)
            res[str(dtype)] = {"shape": (N, K), "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        res[str(dtype)] = {"shape": (N, K), "entries": entries}
    torch.save(res, path)
    return res


def _values_order(N: int, K: int, entries) -> tuple[str, torch.Tensor | None]:
    """("plain" | "fixed" | "mask-dependent" | "not values", slots): where the kept values lie in
    the first N*K/2 elements; ``slots[p]`` is the plain row-major slot element p holds (fixed order)."""
    kept, slots, plain, fixed = N * K // 2, None, True, True
    for e in entries:
        mask = e["mask"]
        n, k = e["rows"][:kept].long() - 1, e["cols"][:kept].long() - 1
        if not (((n >= 0) & (n < N) & (k >= 0) & (k < K)).all() and mask[n, k].all()
                and torch.unique(n * K + k).numel() == kept):
            return "not values", None
        slot = n * (K // 2) + mask.cumsum(1)[n, k] - 1   # row n, rank among its kept values
        plain &= bool((slot == torch.arange(kept)).all())
        fixed &= slots is None or bool((slot == slots).all())
        slots = slot
    return ("plain" if plain else "fixed" if fixed else "mask-dependent"), slots


def _meta_map(N: int, K: int, entries) -> tuple[str | None, torch.Tensor]:
    """Which group each 4-bit field of the metadata (the bytes after the kept values, low nibble
    first) encodes: (the encoding of a group's kept pair that explains every field, or None;
    ``groups[p]`` = row * (K // 4) + group for field p, -1 where no group matches)."""
    kept = N * K // 2
    fields = [_unpack_nibbles(e["rows"][kept:].contiguous().view(torch.uint8).view(1, -1)).view(-1).long()
              for e in entries]
    best = (None, torch.full_like(fields[0], -1))
    for name, code in NIBBLE_CODES.items():
        key = torch.zeros(N * K // 4, dtype=torch.long)      # a group's fields over the masks, base 16
        field_key = torch.zeros_like(fields[0])
        for m, f in enumerate(fields):
            pair = torch.tensor(PAIRS)[_group_pairs(N, K, m).reshape(-1)]
            key += code(pair[:, 0], pair[:, 1]) << (4 * m)
            field_key += f << (4 * m)
        lookup = {int(k_): g for g, k_ in enumerate(key.tolist())}
        groups = torch.tensor([lookup.get(int(k_), -1) for k_ in field_key.tolist()])
        if (groups >= 0).sum() > (best[1] >= 0).sum():
            best = (name, groups)
    name, groups = best
    whole = bool((groups >= 0).all()) and torch.unique(groups).numel() == groups.numel() == N * K // 4
    return (name if whole else None), groups


def sm90_meta_groups(N: int, K: int) -> torch.Tensor:
    """The group each 4-bit metadata field holds in cuSPARSELt's sm_90 16-bit layout as torchao's
    sparsify kernel writes it (reverse-engineered there; its index arithmetic in
    ``sparse24.interop._sm90_meta_fields``, nothing measured): ``groups[p]`` = n * (K // 4) + G
    for field p (byte p // 2, low nibble first). N % 64 == 0, K % 32 == 0."""
    groups = torch.full((N * K // 4,), -1, dtype=torch.long)
    groups[_sm90_meta_fields(N, K).reshape(-1)] = torch.arange(N * K // 4)
    return groups


def analyze_layout(path: Path) -> list[str]:
    """Lines saying, per dtype of a :func:`dump_layout` file, whether the kept values lie first in
    plain row-major order (row n, its kept values by column), in one fixed order, or in a
    mask-dependent one; and which group each 4-bit field of the metadata after them encodes."""
    lines = []
    for dtype, d in torch.load(path).items():
        N, K = d["shape"]
        if "error" in d:
            lines.append(f"{dtype} {N}x{K}: compress failed: {d['error']}")
            continue
        order, slots = _values_order(N, K, d["entries"])
        first = d["entries"][0]["rows"]
        meta_bytes = (first.numel() - N * K // 2) * first.element_size()
        head = f"{dtype} {N}x{K}: "
        if order == "not values":
            lines.append(head + f"the first {N * K // 2} elements are not the kept values")
            continue
        if order == "fixed":
            at = ", ".join(f"{int(s) // (K // 2)}:{int(s) % (K // 2)}" for s in slots[:16])
            lines.append(head + f"kept values first, in one fixed order independent of the mask "
                         f"(element p holds row:rank {at}, ...)")
        else:
            lines.append(head + ("kept values first, plain row-major" if order == "plain"
                                 else "kept values first, in an order that depends on the mask"))
        code, groups = _meta_map(N, K, d["entries"])
        G = K // 4
        at = ", ".join(f"{int(g) // G}:{int(g) % G}" for g in groups[:16])
        if code:
            sm90 = N % 64 == 0 and K % 32 == 0 and torch.equal(groups, sm90_meta_groups(N, K))
            lines.append(head + f"then {meta_bytes} B of metadata ({8 * meta_bytes / (N * K // 2):.2f} bits per kept "
                         f"value): every 4-bit field one group, coded {code}; field p holds row:group {at}, ...; "
                         + ("the sm_90 order torchao's sparsify kernel writes" if sm90 else
                            "not the sm_90 order torchao's sparsify kernel writes"))
        else:
            lines.append(head + f"then {meta_bytes} B of metadata; {int((groups >= 0).sum())} of {groups.numel()} "
                         f"4-bit fields match one group's kept pair ({', '.join(NIBBLE_CODES)} tried)")
    return lines


def own_buffer_lines(dev, shapes=((256, 512), (4096, 4096)), compress=None, mm=None) -> list[str]:
    """Per shape and 16-bit dtype: does ``sparse24.interop._cusparselt_sm90_buffer`` (built from our
    layout, no dense copy) equal what ``compress`` (``torch._cslt_compress``) makes of the dense
    weight, values and metadata apart; and is ``mm`` (``torch._cslt_sparse_mm``) on it right
    (max |diff| / max |ref| against the fp32 product, 16 rows of x)? Lines to print."""
    compress = compress or torch._cslt_compress
    mm = mm or torch._cslt_sparse_mm
    lines = []
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for N, K in shapes:
            head = f"own sm_90 buffer {str(dtype)[6:]} {N}x{K}: "
            try:
                p = sparse24.compress(torch.randn(N, K, device=dev, dtype=dtype))
                dense = p.to_dense()
                ours, theirs = _cusparselt_sm90_buffer(p), compress(dense)
                half = N * K // 2
                same = [torch.equal(ours[:half], theirs[:half]),
                        torch.equal(ours[half:].view(torch.uint8), theirs[half:].view(torch.uint8))]
                x = torch.randn(16, K, device=dev, dtype=dtype)
                ref = F.linear(x.float(), dense.float())
                err = ((mm(ours, x.t(), transpose_result=True).float() - ref).abs().max() / ref.abs().max()).item()
                lines.append(head + f"values {'equal' if same[0] else 'DIFFER'}, metadata "
                             f"{'equal' if same[1] else 'DIFFERS'}; cuSPARSELt's product on it: max |diff| / max "
                             f"|ref| {err:.3g} ({'right' if err < 1e-2 else 'WRONG'})")
            except Exception as e:  # noqa: BLE001 (reported; the other shapes go on)
                lines.append(head + f"{type(e).__name__}: {str(e)[:160]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--smoke", action="store_true", help="CPU, one small shape: the code paths only")
    ap.add_argument("--layout", action="store_true", help="also write cslt_layout.pt (cuSPARSELt's compressed layout)")
    ap.add_argument("--analyze", type=Path, metavar="FILE", help="read a cslt_layout.pt (any machine) and stop")
    a = ap.parse_args(argv)
    if a.analyze:
        print("\n".join(analyze_layout(a.analyze)))
        return 0
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_sparse_mm: no CUDA GPU visible; nothing to measure", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    if a.smoke:
        measure(a.out, torch.device("cpu"), ((128, 256),), (64,))
    else:
        if a.layout:   # first: seconds, and the answer does not depend on the sweep
            try:
                dump_layout(a.out / "cslt_layout.pt", torch.device("cuda"))
                lines = analyze_layout(a.out / "cslt_layout.pt") + own_buffer_lines(torch.device("cuda"))
            except Exception as e:  # noqa: BLE001 (reported; the file is kept for --analyze, the sweep goes on)
                lines = [f"layout: {type(e).__name__}: {str(e)[:300]}"]
            (a.out / "cslt_layout.txt").write_text("\n".join(lines) + "\n")
            print("\n".join(lines), flush=True)
        measure(a.out, torch.device("cuda"), ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)),
                (32, 64, 256, 1024, 4096))   # 32, 64: the rows where neither kernel of ours reached dense
    # (2048 left out: ~2.5 s a row with cuSPARSELt's alg search, and 1024 / 4096 bracket it; plan call 1's step)
    return 0


if __name__ == "__main__":
    sys.exit(main())

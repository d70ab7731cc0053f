"""Named weight-shape sets (N out-features x K in-features) for benchmarks and tuning."""
from __future__ import annotations

__all__ = ["SHAPE_SETS", "parse_shapes"]

# Linear-layer shapes of common models, (N, K) = (out_features, in_features).
SHAPE_SETS: dict[str, list[tuple[int, int]]] = {
    # q/k/v/o, gate/up, down
    "llama-7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
    # q/o, k/v (grouped-query attention), gate/up, down
    "llama-3-8b": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
    # attention projections, intermediate, output
    "bert-base": [(768, 768), (3072, 768), (768, 3072)],
    # the shapes the kernel's performance targets are stated for
    "standard": [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)],
}


def parse_shapes(specs: list[str] | tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Turn shape-set names and ``"N,K"`` strings into ``(label, N, K)`` rows.

    Duplicates are dropped, order is kept. Raises ValueError naming the bad spec.

    Example:
        >>> parse_shapes(["bert-base", "64,128"])[-1]
        ('64x128', 64, 128)
    """
    out: list[tuple[str, int, int]] = []
    for spec in specs:
        if spec in SHAPE_SETS:
            rows = [(f"{spec}:{n}x{k}", n, k) for n, k in SHAPE_SETS[spec]]
        else:
            parts = spec.replace("x", ",").split(",")
            try:
                n, k = (int(p) for p in parts)
            except ValueError:
                raise ValueError(f"unknown shape {spec!r}: use one of {sorted(SHAPE_SETS)} or 'N,K'") from None
            if n <= 0 or k <= 0 or k % 4:
                raise ValueError(f"bad shape {spec!r}: need N > 0 and K > 0 divisible by 4")
            rows = [(f"{n}x{k}", n, k)]
        for row in rows:
            if all((r[1], r[2]) != (row[1], row[2]) for r in out):
                out.append(row)
    return out

"""What a whole-model call reports: one :class:`LayerReport` per weight matrix
(swapped, kept, or skipped with the reason) inside a :class:`SparsifyReport`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LayerReport", "SparsifyReport"]


@dataclass
class LayerReport:
    """One layer's line in a :class:`SparsifyReport`.

    Attributes:
        fqn: name in ``model.named_modules()``.
        shape: ``(out_features, in_features)`` (for a module that is not handled: its weight's shape;
            a quantized weight held in a buffer, GPTQ's ``qweight``: the buffer's shape as stored).
        dtype: weight dtype (``torch.qint8`` / ``torch.int32`` for a layer quantized by another tool).
        action: what happened: ``"swapped"``, ``"compressed"``, ``"decompressed"``,
            ``"densified"`` or ``"skipped"``.
        mode: the layer's mode afterwards (None for dense layers).
        reason: why it was skipped, or a note.
        dense_bytes: the dense weight's bytes.
        compressed_bytes: the weight's nominal bytes once compressed: values + 2-bit indices, plus
            for INT8 an fp32 scale per row, for INT4 an fp16 scale per row and group (and a uint8
            zero point beside it unless symmetric); :func:`sparse24.nn.compressed_nbytes`. Padding
            of the stored index words is not counted (``memory_bytes`` of a compressed layer is).
        memory_bytes: the weight's bytes as held now (masked mode: dense weight + 1-byte mask).
        kept_fraction: ``sparsify_`` only: fraction of the original ``sum |W|`` the mask
            keeps (see :func:`sparse24.masks.kept_magnitude_fraction`), to compare methods;
            None while the mask is pending (meta device).
    """
    fqn: str
    shape: tuple
    dtype: torch.dtype
    action: str
    mode: str | None = None
    reason: str = ""
    dense_bytes: int = 0
    compressed_bytes: int = 0
    memory_bytes: int = 0
    kept_fraction: float | None = None


@dataclass
class SparsifyReport:
    """What a whole-model operation did; ``str(report)`` is a readable table.

    Attributes:
        operation: ``"sparsify_"``, ``"compress_"``, ...
        settings: the options used.
        layers: one :class:`LayerReport` per layer considered.
    """
    operation: str
    settings: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)

    @property
    def changed(self) -> list:
        """The :class:`LayerReport` of every layer this call changed (any action but ``"skipped"``)."""
        return [r for r in self.layers if r.action != "skipped"]

    @property
    def swapped(self) -> list:
        """Layers this call converted (for sparsify_: swapped to Sparse24Linear)."""
        return self.changed

    @property
    def skipped(self) -> list:
        """The :class:`LayerReport` of every layer left as it was, each with its ``reason``."""
        return [r for r in self.layers if r.action == "skipped"]

    def _total(self, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.changed)

    @property
    def dense_bytes(self) -> int:
        """Bytes of the changed layers' dense weights (sum of their ``dense_bytes``)."""
        return self._total("dense_bytes")

    @property
    def compressed_bytes(self) -> int:
        """Nominal compressed bytes of the changed layers' weights (sum of their ``compressed_bytes``)."""
        return self._total("compressed_bytes")

    @property
    def memory_bytes(self) -> int:
        """Bytes the changed layers' weights hold now (sum of their ``memory_bytes``)."""
        return self._total("memory_bytes")

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        lines = [f"sparse24.{self.operation}({opts}): {len(self.changed)} layer(s) changed, "
                 f"{len(self.skipped)} skipped"]
        if self.changed:
            w = max(len("layer"), *(len(r.fqn) for r in self.changed))
            kept = any(r.kept_fraction is not None for r in self.changed)
            lines.append(f"  {'layer':<{w}}  {'shape':>12}  {'dtype':>9}  {'mode':>10}  {'dense B':>10}  "
                         f"{'now B':>10}  {'2:4 B':>10}" + ("  kept |W|" if kept else ""))
            for r in self.changed:
                frac = "" if not kept else f"  {r.kept_fraction:>8.4f}" if r.kept_fraction is not None else \
                    f"  {'-':>8}"
                lines.append(f"  {r.fqn:<{w}}  {str(r.shape):>12}  {str(r.dtype)[6:]:>9}  {r.mode or 'dense':>10}  "
                             f"{r.dense_bytes:>10}  {r.memory_bytes:>10}  {r.compressed_bytes:>10}" + frac
                             + (f"  ({r.reason})" if r.reason else ""))
            d, c, m = self.dense_bytes, self.compressed_bytes, self.memory_bytes
            note = "; masked mode holds the dense weight + a 1-byte mask for training" if any(
                r.mode == "masked" for r in self.changed) else ""
            lines.append(f"  weights: {d} B dense -> {c} B compressed ({100 * c / max(d, 1):.1f}%); "
                         f"held now: {m} B ({100 * m / max(d, 1):.1f}%{note})")
        if self.skipped:
            lines.append("  skipped:")
            w = max(len(r.fqn) for r in self.skipped)
            lines += [f"    {r.fqn:<{w}}  {str(r.shape):>12}  {r.reason}" for r in self.skipped]
        return "\n".join(lines)

"""Tensor values kept aside so that a call that fails part way can write them back (the
bottom floor: imports only torch and the shared checks; whole-model calls build on it to stay all or nothing)."""
from __future__ import annotations

from typing import Iterable

import torch

from ._checks import row_chunks

__all__ = ["TensorBackup"]


class TensorBackup:
    """The values of tensors a call is about to write in place, and :meth:`restore` to write
    them back.

    Copies go to the CPU (host memory is the cheaper place for a model-sized copy), unless
    ``same`` offers a tensor already holding equal values (e.g. a teacher's copy of a weight),
    which is then used without a copy. Meta tensors hold no values and are not kept.
    :meth:`keep_pruned` keeps only the entries a 2:4 pruning zeroes (half a weight's bytes).

    Example:
        >>> w = torch.ones(2, 2); backup = TensorBackup(); backup.keep([w])
        >>> _ = w.zero_(); backup.restore(); float(w.sum())
        4.0
    """

    def __init__(self):
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ids: set[int] = set()

    def keep(self, tensors: Iterable[torch.Tensor], same: dict | None = None) -> None:
        """Record the current values of ``tensors`` (each once); ``same``: ``{id(tensor): equal tensor}``."""
        for t in tensors:
            if id(t) in self._ids or t.is_meta:
                continue
            src = (same or {}).get(id(t))
            if not (isinstance(src, torch.Tensor) and src.shape == t.shape and src.dtype == t.dtype
                    and torch.equal(src.detach().to(t.device), t.detach())):
                src = t.detach().to("cpu", copy=True)
            self._saved.append((t, src.detach(), None))
            self._ids.add(id(t))

    def keep_pruned(self, tensors: Iterable[torch.Tensor], mask: torch.Tensor) -> None:
        """Record the entries of ``tensors`` (each of ``mask``'s shape, on its device) where ``mask``
        is False: all that ``t.masked_fill_(~mask, 0)`` overwrites, for half the bytes of a full copy
        with a 2:4 mask (copied to the CPU; ``mask`` is held by reference and must not change)."""
        for t in tensors:
            if id(t) in self._ids or t.is_meta:
                continue
            # in row chunks of ~1M entries (16M on a GPU): boolean indexing builds 8-byte indices per entry
            # taken (a whole bf16 weight at once briefly needed ~5x its bytes on its device; 16M entries
            # held ~176 MiB on a CPU, the whole sparsify_ peak of a 4096 x 4096 layer)
            chunks = row_chunks(t.shape[0], t[0].numel(), t.device, budget=1 << (20 if t.device.type == "cpu" else 24)) \
                if t.dim() else []
            parts = [t.detach()[rows][~mask[rows]].to("cpu") for rows in chunks]
            self._saved.append((t, torch.cat(parts) if parts else t.detach()[~mask].to("cpu"), mask))
            self._ids.add(id(t))

    def restore(self) -> None:
        """Write every recorded value back (in place: the same tensor objects), then forget them (the
        exception a failed call raises keeps its frames, and with them this backup, alive)."""
        with torch.no_grad():
            for t, v, mask in self._saved:
                if mask is None:
                    t.copy_(v)
                else:
                    t.masked_scatter_(~mask, v.to(t.device))
        self._saved.clear()
        self._ids.clear()

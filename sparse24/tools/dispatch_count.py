"""Count what one call does at torch's dispatcher: the aten ops it runs and the
bytes of new storage they allocate. With the kernel launch stubbed out this is
a call's whole device-side footprint apart from the kernel (each aten op on
CUDA tensors is at least one allocation or kernel); ``scripts/bench_host.py
--prefill`` and the prefill routing test use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["DispatchCount", "count_dispatch"]


@dataclass
class DispatchCount:
    """What :func:`count_dispatch` saw: ``ops`` (aten op names, in call order) and
    ``bytes_allocated`` (storage bytes of op outputs that alias no input)."""
    ops: list[str] = field(default_factory=list)
    bytes_allocated: int = 0


class _Counter(TorchDispatchMode):
    def __init__(self, count: DispatchCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count.ops.append(str(func.overloadpacket.__name__))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        seen = set()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in seen:  # a view or an in-place result allocates nothing
                    seen.add(ptr)
                    self.count.bytes_allocated += t.untyped_storage().nbytes()
        return out


def count_dispatch(fn, *args, **kwargs) -> tuple[object, DispatchCount]:
    """Run ``fn(*args, **kwargs)`` once, counting its aten ops and allocated bytes.

    Returns:
        ``(fn's result, DispatchCount)``.
    Example:
        >>> y, c = count_dispatch(torch.mm, torch.ones(2, 3), torch.ones(3, 4))
        >>> c.ops, c.bytes_allocated
        (['mm'], 32)
    """
    count = DispatchCount()
    with _Counter(count):
        result = fn(*args, **kwargs)
    return result, count

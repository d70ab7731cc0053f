"""Keeping masked weights masked, whatever the training loop does: a gradient
hook on each masked weight Parameter (masks its gradient from every use, also
code that reads ``.weight`` directly) and a process-wide optimizer step
post-hook (re-zeroes pruned entries that momentum, Adam state or weight decay
moved). See :mod:`sparse24.nn` for the costs."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = []

# Live masked-mode modules, for the optimizer post-hook (weak: never keeps a model alive).
_MASKED_MODULES: "weakref.WeakSet" = weakref.WeakSet()  # of Sparse24Linear
# Weight Parameter -> weakref to the module that owns it as its masked weight.
_GRAD_HOOKED = WeakIdKeyDictionary()
# Weight Parameters that carry the gradient hook (a frozen one gets it when it first needs a gradient:
# torch refuses a hook on a tensor that does not require grad).
_HAS_HOOK = WeakIdKeyDictionary()
# Module -> (weakref weight, its version, weakref mask, its version) when the weight was last found
# zero at every pruned position: inference skips the per-call where() while both stay unchanged.
_ZERO_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _remask_after_step(optimizer, args, kwargs) -> None:
    """Optimizer step post-hook (every optimizer): re-zero pruned weights."""
    if not _MASKED_MODULES:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    with torch.no_grad():
        for mod in list(_MASKED_MODULES):
            w = mod._parameters.get("weight")
            if w is not None and id(w) in stepped:
                w.masked_fill_(~mod.mask, 0)


register_optimizer_step_post_hook(_remask_after_step)


def _grad_mask_hook(param: nn.Parameter):
    param_ref = weakref.ref(param)

    @torch.utils.hooks.unserializable_hook
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Mask with the mask of the module that currently owns this Parameter
        # as its masked weight (none after densify_ or to_compressed).
        p = param_ref()
        owner = _GRAD_HOOKED.get(p) if p is not None else None
        m = owner() if owner is not None else None
        if m is None or m.__dict__.get("_mode") != "masked" or m._parameters.get("weight") is not p:
            return grad
        return torch.where(m.mask, grad, 0)
    return hook

"""Keeping masked weights masked, whatever the training loop does: a gradient
hook on each masked weight Parameter (masks its gradient from every use, also
code that reads ``.weight`` directly) and a process-wide optimizer step
post-hook (re-zeroes pruned entries that momentum, Adam state or weight decay
moved). See :mod:`sparse24.nn` for the costs. A weight sharded by FSDP2
(a DTensor) gets its gradient masked by a step pre-hook instead: FSDP2 writes
the sharded gradient directly, so no tensor hook sees it."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .sharded import is_dtensor, local_pair, shard_like

__all__ = []

# Live masked-mode modules, for the optimizer post-hook (weak: never keeps a model alive).
_MASKED_MODULES: "weakref.WeakSet" = weakref.WeakSet()  # of Sparse24Linear
# Weight Parameter -> weakref to the module that owns it as its masked weight.
_GRAD_HOOKED = WeakIdKeyDictionary()
# Weight Parameter -> the handle of the gradient hook it carries (a frozen one too: requires_grad is switched
# on just to register it, since torch refuses a hook on a tensor that does not require grad).
_HAS_HOOK = WeakIdKeyDictionary()
# Module -> (weakref weight, its version, weakref mask, its version, their data pointers) when the weight was
# last found zero at every pruned position: inference skips the per-call where() while both stay unchanged.
_ZERO_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stepped_pairs(optimizer, sharded_only: bool = False):
    """``(weight, mask)`` of every masked weight ``optimizer`` steps (only the sharded ones if
    ``sharded_only``); a sharded weight's mask is sharded like it first."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for mod in list(_MASKED_MODULES):
        w = mod._parameters.get("weight")
        if w is None or id(w) not in stepped or (sharded_only and not is_dtensor(w)):
            continue
        if is_dtensor(w):
            mod._buffers["mask"] = shard_like(mod.mask, w)  # no-op once sharded alike
        yield w, mod.mask


def _remask_after_step(optimizer, args, kwargs) -> None:
    """Optimizer step post-hook (every optimizer): re-zero pruned weights."""
    if not _MASKED_MODULES:
        return
    with torch.no_grad():
        for w, mask in _stepped_pairs(optimizer):
            w, mask = local_pair(w, mask)
            w.masked_fill_(~mask, 0)


def _mask_sharded_grads(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: zero the pruned entries of sharded weights' gradients, so that
    no optimizer state (momentum, Adam moments) grows there."""
    if not _MASKED_MODULES:
        return
    with torch.no_grad():
        for w, mask in _stepped_pairs(optimizer, sharded_only=True):
            if w.grad is not None:
                grad, mask = local_pair(w.grad, mask)
                grad.masked_fill_(~mask, 0)


register_optimizer_step_pre_hook(_mask_sharded_grads)
register_optimizer_step_post_hook(_remask_after_step)


def _unhook(w: torch.Tensor) -> None:
    """Remove ``w``'s gradient hook, and with it the weak reference to ``w`` the hook holds."""
    handle = _HAS_HOOK.get(w)
    if handle is not None:
        handle.remove()   # before forgetting it: an interrupt in between leaves it recorded, not doubled
        _HAS_HOOK.pop(w, None)


def _relink_hooks(w: torch.Tensor) -> None:
    """torch.utils.swap_tensors gives ``w`` new data that carries none of the hooks registered on ``w``
    (its table of them stays, no longer called): register the table with the new data (every hook in
    it, as without the swap). A no-op where ``w`` was not swapped."""
    hooks = w._backward_hooks
    if hooks is not None:
        w._backward_hooks = hooks


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

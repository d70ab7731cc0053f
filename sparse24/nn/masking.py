"""Keeping masked weights masked, whatever the training loop does: a gradient
hook on each masked weight Parameter (masks its gradient from every use, also
code that reads ``.weight`` directly) and a process-wide optimizer step
post-hook (re-zeroes pruned entries that momentum, Adam state or weight decay
moved). See :mod:`sparse24.nn` for the costs. A weight sharded by FSDP2
(a DTensor) gets its gradient masked by a step pre-hook instead: FSDP2 writes
the sharded gradient directly, so no tensor hook sees it. The same pre-hook
refuses a step that would train nothing or the wrong thing: an optimizer still
stepping the weight a masked layer replaced (a ``Conv1D``'s, stored transposed),
or holding state of the transposed shape for a masked weight (a dense ``Conv1D``
model's optimizer checkpoint loaded after ``sparsify_``)."""
from __future__ import annotations

import weakref
from typing import Callable

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
# Module -> (weakref weight, its version, weakref mask, its version, view_key of each) when the weight was
# last found zero at every pruned position: inference skips the per-call where() while both stay unchanged.
_ZERO_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Weight Parameter of a transformers Conv1D that a masked layer was built from (with a new, transposed weight
# Parameter) -> weakref to the Conv1D's bias, which that layer shares: how the step pre-hook finds the layer.
_REPLACED = WeakIdKeyDictionary()
# optimizer -> id of the optimizer.state whose shapes _check_optimizer found right; dropped by a
# load_state_dict post-hook (a loaded state may get the freed checked one's id)
_STATE_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# optimizers carrying that post-hook (registered once each)
_LOAD_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


class _StorageRef(weakref.ref):
    """A weak reference to a storage that pickles and deep-copies as a dead one (a plain weak reference
    cannot be pickled; Sparse24Linear holds one in its module state, ``_scale_bf16``): a copy of the
    module holds other storages, which must not match it."""
    __slots__ = ()

    def __reduce__(self):
        return _dead_ref, ()


class _Gone:
    pass


def _dead_ref() -> weakref.ref:
    return weakref.ref(_Gone())   # (the object dies at once)


def view_key(t: torch.Tensor) -> tuple:
    """What, besides its version counter, tells that ``t`` still holds the data a cache was made from:
    ``.data =`` keeps the counter, and the new storage often lands at the freed one's address, so the
    address alone does not. Its storage object, held weakly (torch keeps one Python object per live
    storage: a freed one's reference is dead and never matches a new storage), its address (a resized
    storage) and strides (``w.data = w.data.t()``). RuntimeError for a tensor holding no storage of its
    own (a DTensor): no cache then. See :func:`same_view`."""
    return _StorageRef(t.untyped_storage()), t.data_ptr(), t.stride()


def same_view(key: tuple, t: torch.Tensor) -> bool:
    """Whether ``t`` reads the memory :func:`view_key` recorded in ``key`` (~0.3 us)."""
    return key[0]() is t.untyped_storage() and key[1] == t.data_ptr() and key[2] == t.stride()


def note_replaced(old_weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[], None]:
    """Record that a masked layer sharing ``bias`` is being built to replace ``old_weight`` (see _REPLACED);
    returns what undoes the record."""
    before = _REPLACED.get(old_weight)
    if bias is not None:
        _REPLACED[old_weight] = weakref.ref(bias)
    return lambda: _REPLACED.pop(old_weight, None) if before is None else _REPLACED.__setitem__(old_weight, before)


def _stepped_pairs(optimizer, sharded_only: bool = False):
    """``(weight, mask, module)`` of every masked weight ``optimizer`` steps (only the sharded ones if
    ``sharded_only``); a sharded weight's mask is sharded like it first."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    done = set()   # a weight shared by a module and its copy.copy: once
    for mod in list(_MASKED_MODULES):
        w = mod._parameters.get("weight")
        if w is None or id(w) not in stepped or id(w) in done or (sharded_only and not is_dtensor(w)):
            continue
        done.add(id(w))
        if is_dtensor(w):
            mod._buffers["mask"] = shard_like(mod.mask, w)  # no-op once sharded alike
        yield w, mod.mask, mod


def _remask_after_step(optimizer, args, kwargs) -> None:
    """Optimizer step post-hook (every optimizer): re-zero pruned weights."""
    if not _MASKED_MODULES:
        return
    with torch.no_grad():
        for w, mask, mod in _stepped_pairs(optimizer):
            local_w, local_mask = local_pair(w, mask)
            local_w.masked_fill_(~local_mask, 0)
            if local_w is w and local_mask is mask:  # (a sharded weight: no zero check reads it)
                _note_zero(mod, w, mask)


def _note_zero(mod: nn.Module, w: torch.Tensor, mask: torch.Tensor) -> None:
    """Record in _ZERO_CHECKED that ``mod``'s weight ``w`` is 0 wherever ``mask`` is False (it was just
    zeroed there): the write bumped the version, and the next inference forward (or direct-read hook)
    would otherwise rescan the whole weight, a host sync on GPU. The entry has the layout
    Sparse24Linear._zero_where_pruned reads and writes (nn/linear.py): :func:`zero_key`."""
    if torch.compiler.is_compiling() or w.is_meta:
        return
    try:
        _ZERO_CHECKED[mod] = zero_key(w, mask)
    except RuntimeError:  # inference tensors keep no version counter: no entry, as _zero_where_pruned
        _ZERO_CHECKED.pop(mod, None)


def zero_key(w: torch.Tensor, mask: torch.Tensor) -> tuple:
    """The _ZERO_CHECKED entry of a weight ``w`` found 0 wherever ``mask`` is False: both tensors (held
    weakly), their version counters and :func:`view_key`. RuntimeError for an inference tensor (no version
    counter) or a DTensor (no storage of its own): no entry then."""
    return weakref.ref(w), w._version, weakref.ref(mask), mask._version, view_key(w), view_key(mask)


def still_zero(seen: tuple, w: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the :func:`zero_key` entry ``seen`` still describes ``w`` and ``mask``: the same tensors,
    unchanged in place and holding the same memory. RuntimeError as :func:`zero_key`."""
    return seen[0]() is w and seen[1] == w._version and seen[2]() is mask and seen[3] == mask._version \
        and same_view(seen[4], w) and same_view(seen[5], mask)


def _owner_of(p) -> "nn.Module | None":
    """The live masked-mode module that owns ``p`` as its weight, else None. When the recorded owner has
    died, another live masked module holding ``p`` (a ``copy.copy`` of it, which shares the Parameter)
    becomes the owner: its gradients stay masked."""
    ref = _GRAD_HOOKED.get(p) if p is not None else None
    if ref is None:
        return None
    m = ref()
    if m is None:
        m = next((c for c in list(_MASKED_MODULES) if c._parameters.get("weight") is p
                  and c.__dict__.get("_mode") == "masked"), None)
        if m is None:
            _GRAD_HOOKED.pop(p, None)   # no one masks it: no search on the next backward
            return None
        _GRAD_HOOKED[p] = weakref.ref(m)
    if m.__dict__.get("_mode") != "masked" or m._parameters.get("weight") is not p:
        return None
    return m


def _owner(p: torch.Tensor):
    """The live masked module whose weight is ``p``, else None."""
    m = _owner_of(p)
    return m if m is not None and m in _MASKED_MODULES else None


def _replacing(p: torch.Tensor):
    """The live masked layer built from the Conv1D whose weight ``p`` was, else None."""
    ref = _REPLACED.get(p)
    bias = ref() if ref is not None else None
    if bias is None:
        return None
    return next((m for m in list(_MASKED_MODULES) if m._parameters.get("bias") is bias
                 and m.__dict__.get("_mode") == "masked" and tuple(m.weight.shape) == tuple(p.shape)[::-1]), None)


def _param_name(group: dict, i: int, layer) -> str:
    """``'name'`` where the optimizer was built from ``named_parameters()``, else the layer and the position."""
    names = group.get("param_names")
    if names is not None and i < len(names):
        return repr(names[i])
    origin = " built from a transformers Conv1D" if getattr(layer.__dict__.get("_dense_cls"), "__name__", "") \
        == "Conv1D" else ""
    return f"the weight of a Sparse24Linear(in_features={layer.in_features}, out_features={layer.out_features}){origin}"


def _check_optimizer(optimizer) -> None:
    """Refuse a step (RuntimeError, nothing changed) that steps a Conv1D weight a masked layer replaced
    while not the layer's own weight (it would train nothing the model uses), or that holds a state
    tensor of a masked weight's transposed shape (a dense Conv1D model's state loaded after the swap)."""
    if _REPLACED:
        _check_replaced(optimizer)
    # The state's shapes change only when a state is loaded, which replaces optimizer.state (a step adds
    # entries of the parameters' own shapes): checked once per state object (~1.7 us per parameter a step)
    if _STATE_CHECKED.get(optimizer) == id(optimizer.state):
        return
    if optimizer not in _LOAD_HOOKED:
        optimizer.register_load_state_dict_post_hook(_forget_state_check)
        _LOAD_HOOKED.add(optimizer)
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            m = _owner(p)
            if m is None:
                continue
            _check_order(optimizer, group, i, p, m)
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape != p.shape and v.numel() == p.numel():
                    raise RuntimeError(
                        f"optimizer step refused: optimizer state {k!r} has shape {tuple(v.shape)}, the masked "
                        f"weight {tuple(p.shape)} ({_param_name(group, i, m)}): a state saved for the dense model "
                        "(a transformers Conv1D stores its weight transposed, (in, out)) was loaded into the "
                        "optimizer of the sparsified model. Load it into the dense model's optimizer and then call "
                        "prune_trained_model(model, optimizer), which transposes it (nothing was changed)")
    _STATE_CHECKED[optimizer] = id(optimizer.state)


def _check_order(optimizer, group: dict, i: int, w: torch.Tensor, layer) -> None:
    """Refuse a state that pairs a masked weight with its bias's moments and the bias with the weight's:
    sparse24 before 2026-12-05 listed a layer's parameters (bias, weight), now (weight, bias), and torch's
    load_state_dict pairs states by position; the step then failed in torch after changing other tensors.
    Only a swap: a key bias-shaped in the weight's state and weight-shaped in the bias's (one side alone
    proves nothing: Adafactor's row factor of a weight is bias-shaped, bitsandbytes' absmax may be)."""
    b = layer._parameters.get("bias")
    if b is None:
        return
    sw, sb = optimizer.state.get(w, {}), optimizer.state.get(b, {})
    for k, v in sw.items():
        u = sb.get(k)
        if isinstance(v, torch.Tensor) and isinstance(u, torch.Tensor) and v.shape != w.shape \
                and v.shape == b.shape and u.shape == w.shape:
            raise RuntimeError(
                f"optimizer step refused: optimizer state {k!r} of {_param_name(group, i, layer)} has the bias's "
                f"shape {tuple(v.shape)}, and the bias's the weight's: the optimizer state was saved by sparse24 "
                "before 2026-12-05, whose layers listed their parameters (bias, weight) where they now list "
                "(weight, bias), and torch pairs states by position. Swap each 2:4 layer's two entries in the "
                "saved state's 'state' before loading it, or restart the optimizer (nothing was changed)")


def _forget_state_check(optimizer) -> None:
    """load_state_dict post-hook: the loaded state is checked at the next step (its id() may be the
    checked one's: that state was freed by the load)."""
    _STATE_CHECKED.pop(optimizer, None)


def _check_replaced(optimizer) -> None:
    """The Conv1D half of :func:`_check_optimizer`."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p in _REPLACED:
                layer = _replacing(p)
                if layer is not None and id(layer.weight) not in stepped:
                    raise RuntimeError(
                        f"optimizer step refused: it trains the transformers Conv1D weight {tuple(p.shape)} "
                        f"(param_groups[{g}]['params'][{i}]"
                        + (f", {group['param_names'][i]!r}" if group.get("param_names") else "")
                        + f") that sparsify_ replaced by a new Parameter, the transposed weight of "
                        f"Sparse24Linear(in_features={layer.in_features}, out_features={layer.out_features}): "
                        "no step would reach the model. Pass optimizer= to sparsify_ (or prune_trained_model) or "
                        "build the optimizer after sparsify_ (nothing was changed)")


def _mask_sharded_grads(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: refuse a step that would train the wrong tensors (:func:`_check_optimizer`);
    zero the pruned entries of sharded weights' gradients, so that no optimizer state (momentum, Adam
    moments) grows there."""
    if not _MASKED_MODULES:
        return
    _check_optimizer(optimizer)
    with torch.no_grad():
        for w, mask, _ in _stepped_pairs(optimizer, sharded_only=True):
            if w.grad is not None:
                grad, mask = local_pair(w.grad, mask)
                grad.masked_fill_(~mask, 0)


# Registered for every optimizer, so run eagerly under torch.compile(optimizer.step): Dynamo tracing
# them broke every compiled step in the process into several graphs (on the weak dictionaries' loops),
# also the steps of optimizers that hold no masked weight. Eager, they write the real Parameters.
register_optimizer_step_pre_hook(torch.compiler.disable(_mask_sharded_grads))
register_optimizer_step_post_hook(torch.compiler.disable(_remask_after_step))


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
        m = _owner_of(param_ref())
        if m is None:
            return grad
        return torch.where(m.mask, grad, 0)
    return hook

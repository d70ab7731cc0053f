"""What whole-model calls check before they change a model, and how they put it back
when they fail after changing it (all or nothing).

* :func:`check_calibration`: a calibration dict must name layers of the model, and
  hold statistics for every layer a calibrated method will prune.
* :func:`require_sparse_layers`: mode switches on a model without any 2:4 layer are
  errors, not silent no-ops.
* :class:`ModelRollback`: a record of a model's module tree, its parameters and
  buffers (the same objects, ``requires_grad`` and ``.grad``, and the values of those
  the call will write), and every :class:`~sparse24.nn.Sparse24Linear`'s mode state;
  :meth:`ModelRollback.restore` puts all of it back.
* :func:`record_after_change`: what ``_after_change`` (run at the end of every whole-model call) sets on
  the model, and the function that puts it back when such a call fails.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .._rollback import TensorBackup
from ..nn import Sparse24Linear
from ..nn.masking import _MASKED_MODULES
from ..masks.kept_dense import _is_linear
from .walk import _CALIBRATED_METHODS, _is_transformers_model

__all__ = ["check_calibration", "require_sparse_layers", "ModelRollback", "record_after_change"]


def _few(names: list[str], k: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def check_calibration(model: nn.Module, calibration: dict | None, method: str, planned: Iterable[str],
                      who: str = "sparsify_") -> None:
    """ValueError unless ``calibration`` (``{fqn: LayerStats}`` or None) fits ``model``.

    Every key must be the name of a Linear (or Conv1D, or 2:4 layer) in ``model.named_modules()``:
    statistics collected on a submodule carry names without its prefix and would otherwise
    match nothing. With a calibrated method (wanda, sparsegpt) every layer in ``planned`` (the
    layers about to be pruned) needs its entry; an empty dict is refused as ``None`` is.
    """
    if calibration is None:
        return
    layers = {fqn for fqn, m in model.named_modules() if _is_linear(m) or isinstance(m, Sparse24Linear)}
    unknown = [k for k in calibration if k not in layers]
    if unknown:
        raise ValueError(f"{who}: calibration names {len(unknown)} layer(s) the model does not have: "
                         f"{_few(unknown)}; keys must be the names in model.named_modules() (statistics of a "
                         "submodule lack its prefix: calibrate the model you prune; nothing was changed)")
    if method in _CALIBRATED_METHODS:
        missing = [fqn for fqn in planned if fqn not in calibration]
        if missing:
            raise ValueError(f"{who}: calibration has no statistics for {len(missing)} layer(s) that "
                             f"method={method!r} would prune: {_few(missing)} (did calibrate() run them? it sees "
                             "nn.Linear inputs only); calibrate them, or leave them out with filter_fn (nothing was "
                             "changed)")


def require_sparse_layers(model: nn.Module, who: str) -> None:
    """ValueError if ``model`` holds no :class:`Sparse24Linear`: ``who`` (compress_, ...) would do nothing."""
    if not any(isinstance(m, Sparse24Linear) for m in model.modules()):
        raise ValueError(f"{who}: the model has no Sparse24Linear layer, so there is nothing to switch; "
                         "sparsify_ it first (or check that you passed the sparsified model)")


def record_after_change(model: nn.Module) -> Callable[[], None]:
    """Record what ``_after_change(model)`` may change, before a call runs it; the function returned
    puts it back exactly (to run once the layers are back): ``model``'s load_state_dict pre-hooks
    (``guard_loading`` adds one) and, on a transformers model, the attributes of the model, of its
    config and of its quantizer (``hf.attach`` sets or removes the sparse24 section and the quantizer).
    Shallow: references to the attribute values, no copies."""
    hooks = model._load_state_dict_pre_hooks
    saved_hooks = dict(hooks)
    held = []
    if _is_transformers_model(model):
        objs = (model, getattr(model, "config", None), getattr(model, "hf_quantizer", None))
        held = [(vars(o), dict(vars(o))) for o in objs if o is not None]

    def restore() -> None:
        for attrs, saved in held:
            for k in [k for k in attrs if k not in saved]:
                del attrs[k]
            attrs.update(saved)
        hooks.clear()  # the same table: handles of the user's hooks keep working
        hooks.update(saved_hooks)
    return restore


class ModelRollback:
    """Put a model back exactly as it was when a whole-model call fails part way.

    Recorded at construction: every module's children, parameters, buffers and forward pre-hooks (references,
    so swapped modules and replaced tensors come back as the same objects), every
    parameter's ``requires_grad`` and ``.grad`` (existing gradients copied: backward adds
    to them in place), and each ``Sparse24Linear``'s mode state. The values of ``keep``,
    the tensors the call will write in place, are copied to the CPU, or taken from
    ``same`` (``{id(tensor): tensor holding equal values}``) without a copy.

    Example:
        Not run as a test: ``model`` and ``train`` stand for your own.

        >>> rollback = ModelRollback(model, keep=[p for p in model.parameters() if p.requires_grad])  # doctest: +SKIP
        >>> try:  # doctest: +SKIP
        ...     train(model)
        ... except BaseException:
        ...     rollback.restore(); raise
    """

    def __init__(self, model: nn.Module, keep: Iterable[torch.Tensor] = (), same: dict | None = None):
        self.model = model
        self.after_change = record_after_change(model)
        # (forward pre-hooks too: a call may add the one that keeps directly read weights masked)
        self.modules = [(m, dict(m._modules), dict(m._parameters), dict(m._buffers), dict(m._forward_pre_hooks))
                        for m in model.modules()]
        self.sparse = {m: m._snapshot() for m in model.modules() if isinstance(m, Sparse24Linear)}
        self.flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        self.values = TensorBackup()
        self.values.keep([g for _, _, g in self.flags if g is not None])  # backward accumulates in place
        self.values.keep(list(keep), same)

    def keep(self, tensors: Iterable[torch.Tensor], same: dict | None = None) -> None:
        """Also restore the values of ``tensors`` (see :class:`~sparse24._rollback.TensorBackup`)."""
        self.values.keep(list(tensors), same)

    def restore(self) -> None:
        """Everything recorded comes back; 2:4 layers made since stop masking the weights they shared."""
        # 2:4 layers made since, in the model or swapped out of it (e.g. behind a stand-in), that mask one of
        # its weights: released, so that neither gradients nor optimizer steps of the weight are masked anymore
        own = {id(p) for _, _, params, _, _ in self.modules for p in params.values() if p is not None}
        made = {m for m in self.model.modules() if isinstance(m, Sparse24Linear) and m not in self.sparse}
        made |= {m for m in list(_MASKED_MODULES) if m not in self.sparse and id(m._parameters.get("weight")) in own}
        for m, children, params, buffers, pre_hooks in self.modules:
            for table, saved in ((m._modules, children), (m._parameters, params), (m._buffers, buffers),
                                 (m._forward_pre_hooks, pre_hooks)):
                table.clear()
                table.update(saved)
        for m in made:
            m._release()
        for p, flag, grad in self.flags:
            p.requires_grad_(flag)
            p.grad = grad
        for m, snap in self.sparse.items():
            m._restore(snap)
        self.values.restore()
        self.after_change()  # load pre-hooks and a transformers config's sparse24 section as they were

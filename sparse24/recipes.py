"""Pruning recipes that run inside any training loop.

* :class:`GradualPruner`: gradual magnitude pruning with the cubic schedule of
  Zhu & Gupta (2017, "To prune, or not to prune"), to an unstructured sparsity
  (per layer or global) or to an exact N:M pattern.
* :class:`SRSTE`: training N:M sparse weights from scratch with the
  sparse-refined straight-through estimator of Zhou et al. (2021, "Learning
  N:M fine-grained structured sparse neural networks from scratch").
* :func:`learn_masks` and :func:`distill_` (defined in :mod:`sparse24.learn`,
  re-exported here): learned 2:4 masks (MaskLLM) and the frozen-mask
  distillation recipe for pretrained models.
* :func:`ema_multi_avg_fn`: the EMA for ``torch.optim.swa_utils.AveragedModel``
  of a model with compressed layers (whose integer tensors torch's own average corrupts).

Both work on the ``torch.nn.Linear`` (and Hugging Face ``Conv1D``) layers of a model,
chosen as :func:`sparse24.sparsify_` chooses them: ``filter_fn(module, fqn) -> bool``,
none smaller than ``min_features`` (default ``sparse24.api.MIN_FEATURES``, as sparsify_, which would
leave them dense), never a weight shared with another module (GPT-2's ``lm_head`` is the token
embedding), the output head kept dense unless ``skip_output_head=False``, MoE routers and the parts
of a PEFT adapter layer left alone; what they leave out is in their ``skipped``. They keep the dense
weights as ordinary parameters, so any optimizer works unchanged. The paper's own recipe (prune
once, retrain with the mask frozen) is ``sparsify_`` plus an unchanged training run; see
``scripts/example_prune_retrain.py``.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._checks import check_finite, check_model, with_context
from .api.walk import EXCLUDED_BY, MIN_FEATURES, _too_small, check_min_features
from .format import mask_nm
from .masks.kept_dense import _is_linear, _kept_dense, _shared_weights, _tied_or_head
from .nn import is_conv1d, linear_shape
from .learn import distill_, learn_masks

__all__ = ["GradualPruner", "SRSTE", "ema_multi_avg_fn", "learn_masks", "distill_"]

FilterFn = Callable[[nn.Module, str], bool]


def _parse_nm(nm) -> tuple[int, int]:
    """``(n, m)`` or ``"n:m"`` -> ``(n, m)`` with 1 <= n < m."""
    given = nm  # the error shows what the user wrote, not what parsing left
    if isinstance(nm, str) and nm.count(":") == 1:
        a, b = nm.split(":")
        nm = (int(a), int(b)) if a.strip().isdigit() and b.strip().isdigit() else None
    if (not isinstance(nm, (tuple, list)) or len(nm) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in nm) or not 1 <= nm[0] < nm[1]):
        raise ValueError(f"N:M target must be (n, m) or 'n:m' with integers 1 <= n < m, got {given!r}")
    return int(nm[0]), int(nm[1])


def _linear_layers(model: nn.Module, filter_fn: FilterFn | None, m: int | None, who: str,
                   skip_output_head, min_features: int) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """The ``nn.Linear`` / ``Conv1D`` layers of ``model`` a recipe prunes, by sparsify_'s rules
    (``filter_fn``, ``min_features``, no shared weight, the output head per ``skip_output_head``), and
    ``{fqn: why}`` for those left out. Each layer's weight must be a Parameter of the layer, and with
    an N:M target ``in_features % m == 0`` (ValueError naming it)."""
    check_model(model, filter_fn, f"{who}: ")
    try:
        check_min_features(min_features)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
    try:
        heads = _kept_dense(model, skip_output_head)   # sparsify_'s rules: head, MoE routers, PEFT layers' parts
    except (TypeError, ValueError) as e:
        raise with_context(e, f"{who}: {e}", who)
    shared = _shared_weights(model)
    layers, skipped = [], {}
    for fqn, mod in model.named_modules():
        if not _is_linear(mod):
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            skipped[fqn] = EXCLUDED_BY
        elif why := _too_small(mod, min_features) or _tied_or_head(fqn, mod, shared, heads):
            skipped[fqn] = why
        else:
            layers.append((fqn, mod))
    if not layers:
        why = "; ".join(f"{fqn!r}: {r}" for fqn, r in skipped.items())
        raise ValueError(f"{who}: no torch.nn.Linear layer selected in {type(model).__name__} (nor transformers "
                         "Conv1D)" + (f"; skipped: {why}" if why else ""))
    for fqn, mod in layers:
        if parametrize.is_parametrized(mod, "weight"):
            raise ValueError(f"{who}: layer {fqn!r} already has a parametrized weight (SR-STE applied twice? "
                             "weight_norm, spectral_norm: remove the parametrization first)")
        w = mod._parameters.get("weight")
        if not isinstance(w, nn.Parameter) or mod.weight is not w:
            # what we would prune is a temporary its forward rebuilds: the layer would never be pruned
            raise ValueError(f"{who}: layer {fqn!r}: its weight is a computed tensor ({type(mod.weight).__name__}, "
                             "not a Parameter of the layer: e.g. torch.nn.utils.prune's weight_orig * weight_mask "
                             "or torch.nn.utils.weight_norm, which a forward pre-hook rebuilds at every forward); "
                             "make it a Parameter again first (torch.nn.utils.prune.remove(layer, 'weight'), "
                             "torch.nn.utils.remove_weight_norm(layer)) or exclude the layer with filter_fn")
        if m is not None and linear_shape(mod)[1] % m:
            raise ValueError(f"{who}: layer {fqn!r} has in_features={linear_shape(mod)[1]}, not divisible by m={m}; "
                             "exclude it with filter_fn")
    return layers, skipped


def _rc(w: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``w`` (a layer's weight or gradient) as ``(out, in)``: a view of a Conv1D's ``(in, out)`` one."""
    return w.t() if is_conv1d(layer) else w


class _MaskGrad:
    """A :class:`GradualPruner`'s gradient hook on one weight: zero where the pruner's current mask prunes
    (nothing before its first pruning step). Holds the pruner weakly, so that a pruner nothing else
    references is freed (and removes its hooks)."""

    def __init__(self, pruner: "GradualPruner", fqn: str, transposed: bool):
        self.pruner, self.fqn, self.transposed = weakref.ref(pruner), fqn, transposed

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        pruner = self.pruner()
        if pruner is None or pruner._pruned_k < 0:
            return None
        mask = pruner.masks[self.fqn]
        # (not grad * mask: an inf gradient at a pruned position would become NaN)
        return grad.masked_fill(~(mask.t() if self.transposed else mask), 0)


class GradualPruner:
    """Gradual magnitude pruning with the cubic schedule (Zhu & Gupta 2017).

    At pruning steps ``t = t0, t0 + dt, ..., t0 + n*dt`` (``t0 = start_step``,
    ``dt = frequency``, ``n*dt = end_step - start_step``) the pruned fraction
    becomes

        s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3,

    rising fast at first and flattening as the network has fewer weights left to
    spare. Between pruning steps the masks are frozen; :meth:`step` re-zeroes
    the pruned weights after every optimizer step so the model is exactly
    sparse at every forward. Nothing is pruned before ``start_step``. Pruning
    is monotone: a pruned weight stays pruned.

    The gradient of each selected weight is masked too (a hook on the weight
    Parameter, reading the current masks): zero at pruned positions, as in the
    paper's masked forward (and ``torch.nn.utils.prune``), so gradient clipping
    and the optimizer's moments see only the kept weights. The hooks go with
    :meth:`remove` (call it when done, e.g. before ``sparsify_``, which masks on
    its own) or with the pruner itself once nothing references it; a weight
    that came since (``load_state_dict(assign=True)``) is hooked at the next
    :meth:`step`; a second pruner on the same layers masks with its own masks
    too; a deep copy of the model and the pruner hooks the copy's weights.

    Targets:

    * ``target=0.8`` (a float): unstructured sparsity. ``scope="layer"`` prunes
      each layer to ``s_t`` by magnitude; ``scope="global"`` ranks all selected
      weights together (layers end at different sparsities).
    * ``target=(2, 4)`` or ``"2:4"``: an N:M pattern, ``s_f = 1 - n/m``.
      Approached gradually like this: at each pruning step, the entries an N:M
      magnitude mask would drop from the still-alive weights of each group
      (the ``alive - n`` smallest) are the candidates, and the ``s_t``
      fraction of weights is reached by pruning the smallest-magnitude
      candidates (per layer or globally). So groups lose their weakest
      weights one at a time, never more than ``m - n`` each, and at ``s_f``
      every candidate is pruned: exactly ``n`` of every ``m`` remain.

    Args:
        model: the model; its selected ``nn.Linear`` weights are pruned in place.
        target: float in ``(0, 1)`` or ``(n, m)`` / ``"n:m"``.
        start_step: ``t0``, the first pruning step.
        end_step: the last pruning step, ``t0 + n*dt``; ``> start_step``.
        frequency: ``dt``; ``end_step - start_step`` must be a multiple of it.
        initial_sparsity: ``s_i`` in ``[0, s_f]``.
        scope: ``"layer"`` or ``"global"``.
        filter_fn: ``(module, fqn) -> bool`` choosing layers; default all ``nn.Linear`` and
            Hugging Face ``Conv1D`` but weights shared with another module (tied), the output head and
            layers under ``min_features``.
        skip_output_head: as for :func:`sparse24.sparsify_`: ``True`` keeps the output head dense,
            ``False`` prunes it too, a name or list of names keeps those.
        min_features: as for :func:`sparse24.sparsify_` (default ``sparse24.api.MIN_FEATURES``, 32):
            a layer with fewer input or output features is left out (``sparsify_`` would leave it dense,
            and retraining would revive its pruned weights); ``0`` prunes every layer.
    Attributes:
        masks: ``{fqn: (out, in) bool}``, True = kept (a ``Conv1D``'s too, its weight being ``(in, out)``).
        skipped: ``{fqn: why}``: the Linear / Conv1D layers left out.
    Example:
        Not run as a test: ``model``, ``steps``, ``loss``, ``x`` and ``opt`` stand for your own.

        >>> pruner = GradualPruner(model, (2, 4), start_step=100, end_step=1100, frequency=100)  # doctest: +SKIP
        >>> for t in range(steps):  # doctest: +SKIP
        ...     loss(model(x)).backward(); opt.step(); opt.zero_grad()
        ...     pruner.step(t)
    """

    def __init__(self, model: nn.Module, target=0.5, *, start_step: int = 0, end_step: int, frequency: int = 100,
                 initial_sparsity: float = 0.0, scope: str = "layer", filter_fn: FilterFn | None = None,
                 skip_output_head=True, min_features: int = MIN_FEATURES):
        who = "GradualPruner"
        if isinstance(target, float) and not isinstance(target, bool):
            if not 0.0 < target < 1.0:
                raise ValueError(f"{who}: unstructured target sparsity must be in (0, 1), got {target}")
            self.nm, self.final_sparsity = None, float(target)
        else:
            self.nm = _parse_nm(target)
            self.final_sparsity = 1.0 - self.nm[0] / self.nm[1]
        for name, v in (("start_step", start_step), ("end_step", end_step), ("frequency", frequency)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{who}: {name} must be an int, got {type(v).__name__}")
        if start_step < 0 or frequency < 1 or end_step <= start_step or (end_step - start_step) % frequency:
            raise ValueError(f"{who}: need 0 <= start_step < end_step and frequency >= 1 dividing "
                             f"end_step - start_step, got start_step={start_step}, end_step={end_step}, "
                             f"frequency={frequency}")
        if not 0.0 <= initial_sparsity <= self.final_sparsity:
            raise ValueError(f"{who}: initial_sparsity must be in [0, {self.final_sparsity:g}] (the final "
                             f"sparsity), got {initial_sparsity}")
        if scope not in ("layer", "global"):
            raise ValueError(f"{who}: scope must be 'layer' or 'global', got {scope!r}")
        self.layers, self.skipped = _linear_layers(model, filter_fn, self.nm and self.nm[1], who, skip_output_head,
                                                   min_features)
        self.start_step, self.end_step, self.frequency = start_step, end_step, frequency
        self.initial_sparsity, self.scope = float(initial_sparsity), scope
        self.masks = {fqn: torch.ones(linear_shape(lin), dtype=torch.bool, device=lin.weight.device)
                      for fqn, lin in self.layers}
        self._pruned_k = -1  # index k of the last pruning step t0 + k*dt applied
        self._hooks = []
        self._hook_weights()

    def _hook_weights(self) -> None:
        """Mask each selected weight's gradient (:class:`_MaskGrad`), once per weight: also a weight that
        came after the last call (``load_state_dict(assign=True)``, a module conversion swapping Parameters).
        Another pruner's hooks stay (each masks with its own masks; a dead pruner's pass the gradient)."""
        for fqn, lin in self.layers:
            w = lin.weight
            if not w.is_floating_point() or any(isinstance(fn, _MaskGrad) and fn.pruner() is self
                                                for fn in (w._backward_hooks or {}).values()):
                continue
            # A frozen weight too (torch refuses a hook on it, and keeps one across the toggle): a layer
            # unfrozen later is masked as well.
            frozen = not w.requires_grad
            if frozen:
                try:
                    w.requires_grad_(True)
                except RuntimeError:   # an inference tensor: it trains nothing
                    continue
            try:
                self._hooks.append(w.register_hook(_MaskGrad(self, fqn, is_conv1d(lin))))
            finally:
                if frozen:
                    w.requires_grad_(False)

    def remove(self) -> None:
        """Stop masking the gradients (remove the hooks); :meth:`step` still re-zeroes pruned weights."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self):
        if "_hooks" in self.__dict__:   # (not when __init__ refused its arguments)
            self.remove()

    def __getstate__(self):   # (deep copy, pickle: hooks are not copied; the copy hooks its own weights)
        return {k: v for k, v in self.__dict__.items() if k != "_hooks"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hooks = []
        self._hook_weights()

    def sparsity_at(self, step: int) -> float:
        """The scheduled sparsity ``s_t`` at ``step`` (0 before ``start_step``,
        ``s_f`` after ``end_step``); ``step`` is an int (TypeError otherwise: NaN would give NaN)."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"GradualPruner.sparsity_at: step must be an int, got {type(step).__name__} {step!r}")
        if step < self.start_step:
            return 0.0
        frac = min(step - self.start_step, self.end_step - self.start_step) / (self.end_step - self.start_step)
        return self.final_sparsity + (self.initial_sparsity - self.final_sparsity) * (1.0 - frac) ** 3

    def step(self, step: int) -> float:
        """Call after each optimizer step. Updates the masks when ``step``
        reaches a new pruning step (a skipped pruning step is caught up at the
        next call), then zeroes the pruned weights. Returns the scheduled
        sparsity now in force."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"GradualPruner.step: step must be an int, got {type(step).__name__}")
        if step >= self.start_step:
            k = min((step - self.start_step) // self.frequency, (self.end_step - self.start_step) // self.frequency)
            if k > self._pruned_k:
                self._prune_to(self.sparsity_at(self.start_step + k * self.frequency))
                self._pruned_k = k
        self.apply_masks()
        return 0.0 if self._pruned_k < 0 else self.sparsity_at(self.start_step + self._pruned_k * self.frequency)

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero the pruned weights (the optimizer may have moved them), and mask the gradients of weights
        that came since the last call (new Parameters: their gradients were not masked)."""
        self._hook_weights()
        for fqn, lin in self.layers:   # (not mul_: a pruned weight gone inf would become NaN, and stay NaN)
            _rc(lin.weight, lin).masked_fill_(~self.masks[fqn], 0)

    def sparsity(self) -> float:
        """Measured fraction of pruned weights over the selected layers."""
        total = sum(mk.numel() for mk in self.masks.values())
        return 1.0 - sum(int(mk.sum()) for mk in self.masks.values()) / total

    @torch.no_grad()
    def _scores(self, fqn: str, lin: nn.Module) -> torch.Tensor:
        """Flat prune-order scores of the ``(out, in)`` weight: pruned weights -1 (stay pruned),
        weights an N:M mask must keep +inf (never chosen), else |w|."""
        w = _rc(lin.weight.detach(), lin).contiguous()
        if not bool(torch.isfinite(w).all()):   # (an infinite weight could never be pruned: the target missed)
            raise ValueError(f"GradualPruner: weight of layer {fqn!r} contains NaN or inf")
        score = w.abs().float().masked_fill(~self.masks[fqn], -1.0)
        if self.nm is not None:
            n, m = self.nm
            groups = score.view(-1, m)
            protect = torch.zeros_like(groups, dtype=torch.bool)
            # the n largest alive of each group; ties to the lower column, as mask_nm (topk's order is unspecified)
            protect.scatter_(-1, torch.sort(groups, dim=-1, descending=True, stable=True).indices[:, :n], True)
            score = groups.masked_fill(protect, math.inf).view_as(w)
        return score.flatten()

    def _prune_to(self, sparsity: float) -> None:
        scores = [self._scores(fqn, lin) for fqn, lin in self.layers]
        if self.scope == "layer":
            for (fqn, _), s in zip(self.layers, scores):
                self._prune_smallest([fqn], s, sparsity)
        else:
            self._prune_smallest([fqn for fqn, _ in self.layers], torch.cat(scores), sparsity)

    def _prune_smallest(self, fqns: list[str], scores: torch.Tensor, sparsity: float) -> None:
        """Mark the ``round(sparsity * numel)`` smallest scores pruned (never an
        infinite one) in the masks of ``fqns``, whose flat masks concatenate
        to ``scores``."""
        k = min(round(sparsity * scores.numel()), int(torch.isfinite(scores).sum()))
        keep = torch.ones_like(scores, dtype=torch.bool)
        keep[scores.argsort(stable=True)[:k]] = False  # stable: ties go to the lower index
        for fqn, part in zip(fqns, keep.split([self.masks[f].numel() for f in fqns])):
            self.masks[fqn] = part.view_as(self.masks[fqn])

    def _target(self) -> str:
        return f"{self.nm[0]}:{self.nm[1]}" if self.nm else f"unstructured sparsity {self.final_sparsity:g}"

    def state_dict(self) -> dict:
        """Masks and schedule position, to resume training, and the target they were pruned towards
        (``nm``: ``(n, m)`` or None, ``final_sparsity``), which :meth:`load_state_dict` checks."""
        return {"masks": {k: v.clone() for k, v in self.masks.items()}, "pruned_k": self._pruned_k,
                "nm": self.nm, "final_sparsity": self.final_sparsity}

    def _other_layers(self, masks: dict) -> str:
        """What differs between the layers of a state's ``masks`` and this pruner's, with why this
        pruner leaves out the state's extra layers."""
        extra = [n for n in masks if n not in self.masks]
        missing = [n for n in self.masks if n not in masks]
        parts = [f"the state has {n!r}, which this pruner leaves out ("
                 + self.skipped.get(n, "no Linear / Conv1D layer of that name in the model") + ")" for n in extra]
        if missing:
            parts.append(f"this pruner prunes {', '.join(map(repr, missing))}, which the state lacks")
        return "; ".join(parts)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; checks everything before changing anything.
        A state saved with another target (N:M pattern or final sparsity) is refused: its masks
        would leave the model at the other target (a sparser state loaded into a denser pruner
        even revives weights it pruned). A state without ``nm`` / ``final_sparsity`` (saved
        by an older version) is taken as this pruner's target, if it holds this pruner's layers:
        one of another layer selection is refused naming the layers (older versions pruned the
        output head by default: build that pruner with ``skip_output_head=False``)."""
        who = "GradualPruner.load_state_dict"
        keys = {"masks", "pruned_k", "nm", "final_sparsity"}
        if not isinstance(state, dict) or set(state) not in (keys, {"masks", "pruned_k"}):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{who}: need a dict with keys {sorted(keys)}, got {got}")
        if "nm" in state:
            nm, s_f = state["nm"], state["final_sparsity"]
            nm = tuple(nm) if isinstance(nm, (tuple, list)) else nm
            if nm != self.nm or not isinstance(s_f, float) or not math.isclose(s_f, self.final_sparsity):
                saved = (f"{nm[0]}:{nm[1]}" if isinstance(nm, tuple) and len(nm) == 2
                         else f"unstructured sparsity {s_f!r}")
                raise ValueError(f"{who}: the state was saved by a pruner with target {saved}, this one's target is "
                                 f"{self._target()}: build the pruner with the target the state was saved with "
                                 "(nothing was changed)")
        masks, k = state["masks"], state["pruned_k"]
        if not isinstance(masks, dict):
            raise ValueError(f"{who}: masks do not match this pruner's layers: need a dict {{layer name: bool "
                             f"mask}}, got {type(masks).__name__} (nothing was changed)")
        if set(masks) != set(self.masks):
            raise ValueError(f"{who}: masks do not match this pruner's layers: {self._other_layers(masks)}. Build "
                             "the pruner with the layer selection the state was saved with (filter_fn, "
                             "skip_output_head: a state saved when the output head was pruned by default needs "
                             "skip_output_head=False) (nothing was changed)")
        bad = next((n for n, v in self.masks.items() if not isinstance(masks[n], torch.Tensor)
                    or masks[n].dtype != torch.bool or masks[n].shape != v.shape), None)
        if bad is not None:
            raise ValueError(f"{who}: masks do not match this pruner's layers: the mask of layer {bad!r} is not a "
                             f"bool tensor of the weight's shape {tuple(self.masks[bad].shape)} (nothing was changed)")
        last = (self.end_step - self.start_step) // self.frequency
        if not isinstance(k, int) or isinstance(k, bool) or not -1 <= k <= last:
            raise ValueError(f"{who}: pruned_k must be an int in [-1, {last}], got {k!r}")
        self.masks = {n: masks[n].to(v.device) for n, v in self.masks.items()}
        self._pruned_k = k


def _nm_mask(w: torch.Tensor, n: int, m: int, fqn: str) -> torch.Tensor:
    """``mask_nm(w, n, m)``, its error (a NaN weight after a diverged step) naming SR-STE's layer ``fqn``."""
    try:
        return mask_nm(w, n, m)
    except ValueError as e:
        raise _named(e, fqn) from e


def _named(e: ValueError, fqn: str) -> ValueError:
    return ValueError(f"SRSTE: layer {fqn!r}: {e} (a diverged training step?)")


class _SRSTEFunction(torch.autograd.Function):
    """Forward ``W * M(W)`` (M: N:M magnitude mask of the current W); backward
    the straight-through gradient plus the sparse-refined decay on the pruned
    entries: ``dL/dW = g + decay * (~M) * W`` (Zhou et al. 2021, eq. 5)."""

    @staticmethod
    def forward(ctx, w, n, m, decay):
        mask = mask_nm(w.detach(), n, m)
        ctx.save_for_backward(w, mask)
        ctx.decay = decay
        return torch.where(mask, w, 0)   # (not w * mask: a pruned inf weight would give NaN)

    @staticmethod
    def backward(ctx, grad):
        w, mask = ctx.saved_tensors
        return grad + ctx.decay * w * ~mask, None, None, None


class _NMSTEParametrization(nn.Module):
    def __init__(self, n: int, m: int, decay: float, in_backward: bool = True, transposed: bool = False,
                 fqn: str = ""):
        super().__init__()
        self.n, self.m, self.decay, self.in_backward = n, m, decay, in_backward
        self.fqn = fqn   # the layer's name, for errors
        self.transposed = transposed  # a Conv1D's (in, out) weight: groups run along its first dimension

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        decay = self.decay if self.in_backward else 0.0
        try:
            if self.transposed:
                return _SRSTEFunction.apply(w.t(), self.n, self.m, decay).t()
            return _SRSTEFunction.apply(w, self.n, self.m, decay)
        except ValueError as e:   # (mask_nm's: a NaN weight after a diverged step)
            raise _named(e, self.fqn) from e

    def extra_repr(self) -> str:
        return f"n={self.n}, m={self.m}, decay={self.decay:g}" + ("" if self.in_backward else " (at optimizer.step)")


def _hookable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose step runs step hooks: ``optimizer``, or the one it wraps as
    ``.optimizer``: accelerate's ``AcceleratedOptimizer`` (what ``accelerator.prepare`` returns and HF
    ``Trainer`` holds) is an Optimizer subclass that skips ``Optimizer.__init__``, so it has no hook
    table, and its ``step`` steps the wrapped optimizer, whose hooks run (once per real step, after
    GradScaler's ``unscale_``). TypeError where neither has one: nothing changed yet."""
    seen = set()
    while not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or id(inner) in seen:
            raise TypeError(f"SRSTE: the optimizer ({type(optimizer).__name__}) has no step hooks (an Optimizer "
                            "subclass that skips Optimizer.__init__) and wraps no torch optimizer as .optimizer: "
                            "pass the torch optimizer whose step() it calls; nothing was changed")
        optimizer = inner
    return optimizer


class SRSTE:
    """Train N:M sparse weights from scratch with SR-STE (Zhou et al. 2021).

    Each selected ``nn.Linear`` (or Hugging Face ``Conv1D``, masked along its inputs)
    gets a parametrization: its forward uses ``W * M(W)``, the N:M magnitude mask
    recomputed from the dense weights at every forward, so the mask follows the weights while they train. The
    backward is straight-through (the gradient of the masked weight goes to
    every dense weight) plus the sparse-refined term ``decay * (~M) * W``,
    which pulls the currently pruned weights toward zero and so damps mask
    flip-flopping. Without ``optimizer`` the term is added in the backward, so it
    comes with every use of the weight in a backward pass (a layer called twice in
    one forward, or gradients accumulated over k micro-batches, gets ``k * decay``)
    and a loss-scaled backward shrinks it by the scale (``torch.amp.GradScaler``'s
    ``unscale_`` divides it by 65536 at the start: plain STE in effect). With
    ``torch.amp.GradScaler`` or gradient accumulation, pass ``optimizer``: the backward is then plain
    straight-through and the term is added to each dense weight's gradient when
    ``optimizer.step()`` starts (after ``unscale_`` and any clipping), once per
    step; a fused optimizer, which GradScaler lets unscale inside its step, gets it
    multiplied by the scale it is handed (``optimizer.grad_scale``); with
    ``optimizer.step(closure)`` (LBFGS, PyTorch Lightning) it is added to the
    gradient each closure call computes. The dense weight stays the parameter the optimizer sees
    (``layer.parametrizations.weight.original``, the same Parameter object,
    so an optimizer built before ``SRSTE`` keeps working); state-dict keys
    change accordingly until :meth:`finalize`.

    Args:
        model: the model, modified in place.
        n, m: the pattern, ``1 <= n < m``; each selected layer needs ``in_features % m == 0``.
        decay: ``lambda_W >= 0``; the paper uses 2e-4 with SGD.
        filter_fn: ``(module, fqn) -> bool``; default all ``nn.Linear`` and ``Conv1D`` but weights
            shared with another module (tied), the output head and layers under ``min_features``.
        optimizer: the optimizer training the selected weights: add the decay at its
            step instead of in the backward (see above); until :meth:`finalize`. A wrapper
            holding it as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, which
            ``accelerator.prepare`` returns and HF ``Trainer`` holds) stands for the optimizer it wraps.
        skip_output_head: as for :func:`sparse24.sparsify_` (default True: the head stays dense).
        min_features: as for :func:`sparse24.sparsify_` (default ``sparse24.api.MIN_FEATURES``, 32):
            a layer with fewer input or output features is left out, so that ``sparsify_`` after
            :meth:`finalize` converts every layer trained sparse; ``0`` trains every layer sparse.
    Attributes:
        layers: ``[(fqn, layer)]`` trained sparse; skipped: ``{fqn: why}`` for the Linear / Conv1D left out.
    Example:
        Not run as a test: ``model`` stands for your own, trained in between.

        >>> srste = SRSTE(model, n=2, m=4, decay=2e-4)  # doctest: +SKIP
        >>> # ... train as usual ...
        >>> masks = srste.finalize()   # plain Linear layers, weights exactly 2:4  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, n: int = 2, m: int = 4, decay: float = 2e-4,
                 filter_fn: FilterFn | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 skip_output_head=True, min_features: int = MIN_FEATURES):
        self.n, self.m = _parse_nm((n, m))
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not decay >= 0 or math.isinf(decay):
            raise ValueError(f"SRSTE: decay must be a finite number >= 0, got {decay!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"SRSTE: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        optimizer = None if optimizer is None else _hookable(optimizer)
        self.decay = float(decay)
        self.layers, self.skipped = _linear_layers(model, filter_fn, self.m, "SRSTE", skip_output_head, min_features)
        if optimizer is not None:
            trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
            missing = [fqn for fqn, lin in self.layers if id(lin.weight) not in trained]
            if missing:  # their decay would go to a gradient no step reads
                raise ValueError(f"SRSTE: the optimizer does not train the weight of layer(s) {missing}")
        for fqn, lin in self.layers:   # (register_parametrization runs the mask once: a NaN failed half-way)
            check_finite(lin.weight.detach(), f"SRSTE: layer {fqn!r}'s weight", "fix or exclude it (filter_fn)")
        done, self._hook = [], None
        try:
            # At the step, not in the backward: after GradScaler's unscale_, once whatever the accumulation.
            if optimizer is not None:
                self._hook = optimizer.register_step_pre_hook(self._add_decay)
            for fqn, lin in self.layers:
                order = list(lin._parameters)
                parametrize.register_parametrization(
                    lin, "weight", _NMSTEParametrization(self.n, self.m, self.decay, in_backward=optimizer is None,
                                                         transposed=is_conv1d(lin), fqn=fqn))
                done.append((lin, order))
        except BaseException:   # all or nothing (Ctrl-C, out of memory): the layers done are plain again
            for lin, order in done:
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
                for name in order:   # (the weight comes back last: put in its place, the order model.parameters() had)
                    lin._parameters[name] = lin._parameters.pop(name)
            if self._hook is not None:
                self._hook.remove()
            raise
        self.finalized = False

    def _add_decay(self, optimizer, args, kwargs):
        """Step pre-hook: add the decay now, or, for ``step(closure)``, to the gradient the closure computes
        inside the step (the one the step reads: a gradient there now is replaced by it)."""
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if closure is None:
            self._decay_now(optimizer)
            return None

        def closure_with_decay():
            loss = closure()
            self._decay_now(optimizer)
            return loss
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_with_decay}
        return (args[0], closure_with_decay, *args[2:]), kwargs   # (args[0]: the optimizer)

    @torch.no_grad()
    def _decay_now(self, optimizer) -> None:
        """``grad += decay * (~M) * W`` on each dense weight with a gradient (M: the mask its forwards used,
        as W has not moved since). A fused optimizer under GradScaler unscales inside its step, so its
        gradients are still scaled by ``optimizer.grad_scale`` (None once ``unscale_`` ran): so is the term.
        (Inf/NaN gradients: the fused step skips the update on GradScaler's ``found_inf`` as before.)"""
        scale = getattr(optimizer, "grad_scale", None)
        for fqn, lin in self.layers:
            w = lin.parametrizations.weight.original
            if w.grad is not None:
                term = w * _rc(~_nm_mask(_rc(w, lin), self.n, self.m, fqn), lin)
                if scale is not None:
                    term.mul_(scale.to(term.device))
                w.grad.add_(term, alpha=self.decay)

    @torch.no_grad()
    def current_masks(self) -> dict[str, torch.Tensor]:
        """``{fqn: (out, in) bool}``: the N:M masks the next forward will use."""
        if self.finalized:
            return dict(self.masks)
        return {fqn: _nm_mask(_rc(lin.parametrizations.weight.original, lin), self.n, self.m, fqn)
                for fqn, lin in self.layers}

    @torch.no_grad()
    def finalize(self) -> dict[str, torch.Tensor]:
        """Fix the masks: remove the parametrizations and leave plain
        ``nn.Linear`` layers whose weights are the dense weights times their
        final N:M mask (exactly N:M). For 2:4, ``sparse24.sparsify_(model)``
        then converts them (and ``compress_`` compresses them) without changing
        any value. Returns the masks
        ``{fqn: (out, in) bool}``."""
        if self.finalized:
            raise RuntimeError("SRSTE.finalize: already finalized")
        # the masks of the first call: an interrupted finalize (Ctrl-C) is finished by calling it again
        if "_final_masks" not in self.__dict__:
            self._final_masks = self.current_masks()
        masks = self._final_masks
        if self._hook is not None:
            self._hook.remove()
        for fqn, lin in self.layers:
            if parametrize.is_parametrized(lin, "weight"):
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
            # (again for a layer done before an interruption: the same result; not mul_: inf * 0 is NaN)
            _rc(lin.weight, lin).masked_fill_(~masks[fqn], 0)
        self.masks, self.finalized = masks, True
        return dict(self.masks)


def ema_multi_avg_fn(decay: float = 0.999) -> Callable:
    """The exponential moving average for ``torch.optim.swa_utils.AveragedModel(model,
    multi_avg_fn=ema_multi_avg_fn(decay), use_buffers=True)`` of a model with sparse layers.

    Floating-point tensors get torch's own EMA (``get_ema_multi_avg_fn``'s ``lerp``, the same numbers):
    ``avg = decay * avg + (1 - decay) * current``. Every other tensor is copied from the current model:
    a compressed layer's ``meta`` (packed 2-bit slot indices in int32 words), INT8 / INT4 codes, a masked
    layer's bool ``mask``, BatchNorm's ``num_batches_tracked``. Torch's own functions average those as
    numbers and write them back truncated: every slot index of a compressed layer is rewritten (its
    forward runs, with the wrong weights), and INT8 codes (Parameters, so even with
    ``use_buffers=False``) are truncated at some decays (0.9, 0.9999).

    Args:
        decay: in ``[0, 1]``; the weight of the average so far.
    Returns:
        ``fn(averaged_list, current_list, num_averaged)``, updating ``averaged_list`` in place.
    Example:
        >>> import torch, sparse24
        >>> from torch.optim.swa_utils import AveragedModel
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> _ = sparse24.sparsify_(model, mode="compressed", trainable_values=True, skip_output_head=False)
        >>> ema = AveragedModel(model, multi_avg_fn=ema_multi_avg_fn(0.999), use_buffers=True)
        >>> ema.update_parameters(model)   # after each optimizer step
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        raise ValueError(f"ema_multi_avg_fn: decay must be a number in [0, 1], got {decay!r}")

    @torch.no_grad()
    def ema_update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged) -> None:
        floats = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point() or a.is_complex()]
        if floats:   # (AveragedModel groups by dtype: all or none)
            torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], 1.0 - decay)
        for a, c in zip(averaged, current):
            if not (a.is_floating_point() or a.is_complex()):
                a.copy_(c)
    return ema_update

"""Frozen-mask distillation: :func:`distill_` (see :mod:`sparse24.learn`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .._checks import check_model, check_nonnegative, refuse_inference_mode
from .._progress import progress_bar, progress_enabled
from .objective import (_batch_stream, _check_steps, _failure_note, _nonempty, _Objective, _optimizer_step,
                        _refuse_float16, _rollback_for, _warmup_cosine)

__all__ = ["distill_", "DistillReport"]


@dataclass
class DistillReport:
    """What :func:`distill_` did: ``losses`` per step and the wall ``seconds``."""
    losses: list = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        first = sum(self.losses[:10]) / max(1, len(self.losses[:10]))
        last = sum(self.losses[-10:]) / max(1, len(self.losses[-10:]))
        return f"sparse24.distill_: {len(self.losses)} steps in {self.seconds:.1f} s; loss {first:.4g} -> {last:.4g}"


def distill_(model: nn.Module, batches, steps: int, *, teacher: nn.Module | None = None,
             loss_fn: Callable | None = None, lr: float = 5e-4, warmup: float = 0.02, final_lr: float = 0.0,
             weight_decay: float = 0.0, clip: float | None = 1.0, output_loss="mse", hidden=(),
             hidden_weight: float = 1.0, parameters=None, forward: Callable | None = None,
             callback: Callable | None = None, progress: bool | None = None) -> DistillReport:
    """Retrain a 2:4 model with its masks frozen (the recovery recipe), in place.

    ``Sparse24Linear`` masked layers keep their pruned weights at exactly zero
    through any optimizer, so this trains every given parameter freely: AdamW,
    linear warmup over ``warmup * steps`` steps, cosine decay to
    ``final_lr * lr``, gradient clipping; the models run in the mode they are
    in (``.eval()`` switches dropout off), with autograd on whatever the caller's
    grad mode (inside ``torch.no_grad()`` too; under ``torch.inference_mode()``,
    whose tensors autograd cannot record: a RuntimeError, nothing changed).
    All or nothing: if a step fails (or on
    Ctrl-C), every trained parameter and buffer gets its value from before the call
    back (a copy is kept on the CPU while it runs; save checkpoints from ``callback``
    to keep progress) and the error notes the step and batch. Loss: ``loss_fn(output, batch)``
    and/or distillation from ``teacher`` (``output_loss`` on the outputs plus
    ``hidden_weight`` x the relative MSE of the ``hidden`` modules' outputs,
    averaged over those modules).

    Args:
        model: the 2:4 student (``sparsify_`` / ``learn_masks`` output).
        batches: list (cycled) or iterator of batches (as in :func:`learn_masks`); one batch alone
            (not in a list) is a TypeError.
        steps: optimisation steps.
        teacher: the dense model to distil from.
        loss_fn: ``(output, batch) -> scalar`` task loss.
        lr, warmup, final_lr, weight_decay, clip: optimiser settings (``clip=None``: none).
        output_loss: ``"mse"`` (relative), ``"cosine"``, ``"kl"`` or a callable.
        hidden: names of modules (in both models) whose outputs are matched; under activation
            checkpointing only with ``use_reentrant=False`` (a reentrant segment runs its modules under
            no_grad first, so their term would train nothing: a ValueError, nothing changed).
        parameters: an iterable of the tensors to train, e.g. ``model.lm_head.parameters()`` (default:
            every trainable one of ``model``); not float16 (AdamW cannot train it: use bfloat16, or float32
            weights under ``torch.autocast``). A module, or optimizer param groups (dicts), is a TypeError.
        forward: ``(model, batch) -> output`` (default as in :func:`learn_masks`).
        callback: ``callback(step, loss)`` after each step.
        progress: a tqdm bar on stderr with the last loss (default None: when stderr is a
            terminal or in a notebook; False: none).
    Returns:
        :class:`DistillReport`.
    Example:
        >>> dense = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> import copy
        >>> student = copy.deepcopy(dense); _ = sparse24.sparsify_(student)
        >>> rep = distill_(student, [torch.randn(16, 64)], steps=3, teacher=dense)
        >>> len(rep.losses)
        3
    """
    check_model(model, None)
    refuse_inference_mode("distill_")
    progress = progress_enabled(progress)  # checked before anything changes
    steps = _check_steps(steps)
    for name, v in (("lr", lr),):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    # torch's AdamW refuses a negative weight_decay but not NaN, inf or a str (it then failed mid-training);
    # hidden_weight=inf made the loss NaN at the first step
    for name, v in (("weight_decay", weight_decay), ("hidden_weight", hidden_weight)):
        check_nonnegative(v, name)
    for name, v in (("warmup", warmup), ("final_lr", final_lr)):
        if not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
    batches = _nonempty(batches)
    params = [p for p in (model.parameters() if parameters is None else _check_parameters(parameters))
              if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    names = {id(p): n for n, p in model.named_parameters()}
    _refuse_float16([(names.get(id(p), f"parameters[{i}]"), p) for i, p in enumerate(params)], "distill_")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)  # (refuses its settings before any hook)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(steps, warmup, final_lr))
    objective = _Objective(model, teacher, loss_fn, output_loss, hidden, hidden_weight, forward)  # checks only
    rep, bar = DistillReport(), None
    rollback = _rollback_for(model, params)  # all or nothing: a failure at step k puts back what was trained
    t0 = time.perf_counter()
    try:  # the hooks go on inside: every way out of here (a return, or an exception up to it) removes them
        objective.open()
        bar = progress_bar(_batch_stream(batches, steps), total=steps, desc="distill_", progress=progress,
                           unit="step")
        with torch.enable_grad():  # it trains: under the caller's torch.no_grad() too (see learn_masks)
            for step, batch in enumerate(bar):
                rep.losses.append(_optimizer_step(objective(batch), model, params, clip, opt, sched))
                bar.set_postfix_str(f"loss {rep.losses[-1]:.4g}", refresh=False)
                if callback is not None:
                    callback(step, rep.losses[-1])
        bar.close()
        objective.close()
        rep.seconds = time.perf_counter() - t0
        return rep
    except BaseException as e:
        if bar is not None:
            bar.close()
        objective.close()
        rollback.restore()
        e.add_note(_failure_note("distill_", objective, steps, batches)
                   + ": the model was put back as it was before the call")
        raise


def _check_parameters(parameters) -> list:
    """``parameters`` as a list of tensors, or a TypeError naming the argument: a module (also a
    slice of an ``nn.Sequential``) or optimizer param groups failed deep inside torch before."""
    if isinstance(parameters, nn.Module) and not isinstance(parameters, nn.ParameterList):   # (a list of them)
        raise TypeError(f"parameters is a {type(parameters).__name__} module: pass module.parameters()")
    if isinstance(parameters, torch.Tensor):  # (iterated, its rows: non-leaf tensors AdamW refuses)
        raise TypeError("parameters is a single tensor: pass a list of tensors, e.g. [weight]")
    if not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters must be an iterable of tensors (e.g. module.parameters()), got "
                        f"{type(parameters).__name__}")
    params = list(parameters)
    for i, p in enumerate(params):
        if isinstance(p, dict):  # distill_ has one lr and one schedule: per-group settings have no place
            raise TypeError(f"parameters[{i}] is a dict (an optimizer param group?): pass the tensors themselves, "
                            "e.g. [p for g in groups for p in g['params']]; per-group settings are not supported")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters[{i}] is a {type(p).__name__}, not a torch.Tensor"
                            + (": pass module.parameters()" if isinstance(p, nn.Module) else ""))
    return params

"""What the training loops of :mod:`sparse24.learn` share: the objective (a task
loss and/or distillation from a teacher, on outputs and optionally on chosen
modules' outputs), the batch stream, and one optimizer step."""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import call_with_batch, check_nonnegative, check_separate_teacher, refuse_single_batch
from ..api.guard import ModelRollback
from ..nn import Sparse24Linear

__all__ = ["OUTPUT_LOSSES"]

OUTPUT_LOSSES = ("mse", "cosine", "kl")


def _output_tensor(out, key: str = "logits", use: str = "distil from"):
    """The tensor to distil from (``use``) a model output: itself, ``out[key]`` of a dict-like
    output (Hugging Face ModelOutput), else its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if key in out:
            return out[key]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"cannot {use} a model output of type {type(out).__name__}: return a tensor, "
                    "a tuple or a dict of tensors" + (", or pass loss_fn" if use == "distil from" else ""))


def _relative_mse(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``||s - t||^2 / ||t||^2``: scale-free, so layers of any size weigh alike."""
    return (s.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(1e-12)


def _distill_loss(kind, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if callable(kind):
        return kind(s, t)
    if kind == "mse":
        return _relative_mse(s, t)
    if kind == "cosine":  # mean over every vector along the last dim
        return (1 - F.cosine_similarity(s.float(), t.float(), dim=-1)).mean()
    # "kl": KL(teacher || student) of the softmax over the last dim, mean over positions
    ls, lt = s.float().flatten(0, -2).log_softmax(-1), t.float().flatten(0, -2).log_softmax(-1)
    # 0 log 0 = 0 where the teacher gives no mass (logit -inf): F.kl_div takes 0 * (-inf - ls) as NaN. A student
    # -inf where the teacher has mass stays +inf (a real divergence).
    has_mass = lt > -math.inf
    return (lt.exp() * torch.where(has_mass, lt - ls, 0)).sum() / ls.shape[0]


def _check_same_shape(s: torch.Tensor, t: torch.Tensor, what: str) -> None:
    """ValueError naming both shapes unless the student's ``s`` and the teacher's ``t`` match
    (torch broadcasts some mismatches silently, and names neither model in the others)."""
    if s.shape != t.shape:
        raise ValueError(f"the teacher's output has shape {tuple(t.shape)} but the student's {tuple(s.shape)}: "
                         f"{what} element by element, so the teacher must be the same model before pruning")


class _Objective:
    """``loss(batch)`` of the student: task loss, distillation from the teacher
    (output loss + ``hidden_weight`` x mean relative MSE of the ``hidden``
    modules' outputs), or both summed. Construction only checks the arguments;
    the hooks that catch the hidden outputs live from :meth:`open` to :meth:`close`
    (a caller opens it inside the try whose failure path closes it)."""

    def __init__(self, student, teacher, loss_fn, output_loss, hidden, hidden_weight, forward=None):
        if forward is not None and not callable(forward):
            raise TypeError(f"forward must be callable (model, batch) -> output, got {type(forward).__name__}")
        self.forward = forward or call_with_batch
        if loss_fn is None and teacher is None:
            raise ValueError("nothing to train on: give loss_fn (a task loss) and/or teacher (to distil from)")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, batch) -> loss, got {type(loss_fn).__name__}")
        if teacher is not None and not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
        if teacher is not None:
            check_separate_teacher(student, teacher)
        if not callable(output_loss) and output_loss not in OUTPUT_LOSSES:
            raise ValueError(f"output_loss must be one of {OUTPUT_LOSSES} or a callable (student, teacher) -> loss, "
                             f"got {output_loss!r}")
        hidden = [hidden] if isinstance(hidden, (str, nn.Module)) else list(hidden or ())
        odd = next((h for h in hidden if not isinstance(h, str)), None)
        if odd is not None:  # (a module passed for its name fell through to "not in both models" with its repr)
            name = next((n for n, mod in student.named_modules() if mod is odd), None)
            raise TypeError(f"hidden takes module names (str, as model.named_modules() gives them), got a "
                            f"{type(odd).__name__}" + (f": pass its name, {name!r}" if name else ""))
        if hidden and teacher is None:
            raise ValueError("hidden= (layer-wise distillation) needs a teacher")
        hidden_weight = check_nonnegative(hidden_weight, "hidden_weight")  # (inf would make every loss inf or NaN)
        s_mods, t_mods = dict(student.named_modules()), dict(teacher.named_modules()) if teacher is not None else {}
        missing = [h for h in hidden if h not in s_mods or h not in t_mods]
        if missing:
            raise ValueError(f"hidden modules {missing} are not in both the student and the teacher")
        self.student, self.teacher, self.loss_fn, self.output_loss = student, teacher, loss_fn, output_loss
        self.hidden, self.hidden_weight = hidden, float(hidden_weight)
        self._s, self._t, self._handles = {}, {}, []
        self._no_grad = set()  # the hidden modules whose student output was caught with autograd off
        self._targets = [(mods[h], store, h) for h in hidden for mods, store in ((s_mods, self._s), (t_mods, self._t))]
        self.calls = 0  # losses asked for: the step a failure happened at

    def open(self) -> None:
        """Register the hooks that catch the ``hidden`` modules' outputs (until :meth:`close`)."""
        for mod, store, h in self._targets:
            self._handles.append(mod.register_forward_hook(self._keep(store, h, self._no_grad
                                                                      if store is self._s else None)))

    @staticmethod
    def _keep(store: dict, name: str, no_grad: set | None):
        def hook(mod, args, out):  # a ModelOutput (e.g. a BertModel's encoder): its last_hidden_state
            store[name] = _output_tensor(out, "last_hidden_state", f"match hidden={name!r} on")
            if no_grad is not None:
                (no_grad.discard if torch.is_grad_enabled() else no_grad.add)(name)
        return hook

    def __call__(self, batch) -> torch.Tensor:
        self.calls += 1
        # (a checkpointed segment recomputed in the last backward ran the hooks again after the clear below)
        self._s.clear()
        self._no_grad.clear()
        out = self.forward(self.student, batch)
        loss = self.loss_fn(out, batch) if self.loss_fn is not None else 0.0
        if self.teacher is not None:
            with torch.no_grad():
                ref = self.forward(self.teacher, batch)
            s, t = _output_tensor(out), _output_tensor(ref)
            if not callable(self.output_loss):   # (a loss of one's own may compare other shapes)
                _check_same_shape(s, t, f"output_loss={self.output_loss!r} compares the outputs")
            loss = loss + _distill_loss(self.output_loss, s, t)
            if self.hidden and self.hidden_weight:
                for h in self.hidden:
                    _check_same_shape(self._s[h], self._t[h], f"hidden={h!r} compares the module's outputs")
                    if h in self._no_grad and torch.is_grad_enabled():
                        # reentrant checkpointing runs a segment's first forward under no_grad and the
                        # differentiable one in backward, too late for the loss: the term would train nothing
                        raise ValueError(f"hidden={h!r}: the student's module ran with autograd off (under torch."
                                         "no_grad, or in a segment of reentrant activation checkpointing), so its "
                                         "layer-wise loss would train nothing; use checkpointing with "
                                         "use_reentrant=False (e.g. model.activation_checkpointing_enable("
                                         "{'use_reentrant': False})) or leave "
                                         f"{h!r} out of hidden=")
                layer = sum(_relative_mse(self._s[h], self._t[h]) for h in self.hidden) / len(self.hidden)
                loss = loss + self.hidden_weight * layer
        self._s.clear()
        self._t.clear()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        return loss

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _batch_stream(batches, steps: int):
    """Yield ``steps`` batches (``batches`` checked by :func:`_nonempty`), starting over when a
    re-iterable runs out."""
    reiterable = iter(batches) is not batches
    it, given = iter(batches), 0
    for _ in range(steps):
        try:
            b = next(it)
        except StopIteration:
            if not reiterable or given == 0:
                raise ValueError(f"batches ran out after {given} step(s); steps={steps} needs more "
                                 "(or a re-iterable such as a list, which is cycled)") from None
            it = iter(batches)
            b = next(it)
        given += 1
        yield b


def _nonempty(batches):
    """``batches`` after checking, without losing anything, that it is no single batch and yields at
    least one batch."""
    refuse_single_batch(batches)
    if iter(batches) is batches:  # an iterator: take the first batch and put it back in front
        first = next(batches, None)
        if first is not None:
            return itertools.chain([first], batches)
    elif next(iter(batches), None) is not None:
        return batches
    raise ValueError("batches is empty")


def _refuse_float16(named_params, who: str) -> None:
    """TypeError if a parameter to train with AdamW is float16: its eps (1e-8) is 0 in float16, so every
    weight whose gradient is 0 (a pruned one) becomes 0/0 = NaN at the first step."""
    fp16 = [name for name, p in named_params if p.dtype == torch.float16]
    if fp16:
        more = f" and {len(fp16) - 3} more" if len(fp16) > 3 else ""
        raise TypeError(f"{who}: cannot train float16 parameters ({', '.join(fp16[:3])}{more}): AdamW's eps (1e-8) "
                        "is 0 in float16, so the first step turns weights NaN. Train bfloat16 or float32 weights, or "
                        "keep float32 master weights and run the forward under torch.autocast(dtype=torch.float16) "
                        "(nothing was changed)")


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return steps


def _optimizer_step(loss: torch.Tensor, model: nn.Module, params: list, clip: float | None, opt, sched) -> float:
    """One training step: zero, backward, optional gradient-norm clipping, step, schedule, zero; the loss
    value. Every gradient of ``model`` is cleared, before (gradients left on it before the call must not
    enter step 0) and after: a parameter that requires grad but is not trained (outside ``parameters=``,
    or every weight of ``learn_masks(train_weights=False)``) would hold the sum of every step's."""
    if not bool(torch.isfinite(loss.detach()).all()):   # (Adam would spread it to every weight it trains)
        raise FloatingPointError(f"the loss is {float(loss.detach())}: training diverged or a batch is bad")
    model.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return loss.item()


def _warmup_cosine(steps: int, warmup: float, floor: float):
    """LR factor: linear warmup over ``warmup * steps``, then cosine from 1 down to ``floor``."""
    w = max(1, round(warmup * steps))

    def factor(s: int) -> float:
        if s < w:
            return (s + 1) / w
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - w) / max(1, steps - w)))
    return factor


def _rollback_for(model: nn.Module, trained, same: dict | None = None) -> ModelRollback:
    """What a training call must put back if it fails: ``model``'s structure, the values of the
    ``trained`` tensors and of its buffers (running statistics move in train mode); the 2:4 masks
    are left out: a call that writes some (learn_masks) keeps them, and the weights, just before."""
    masks = {id(m.mask) for m in model.modules() if isinstance(m, Sparse24Linear) and m.mode == "masked"}
    buffers = [b for b in model.buffers() if id(b) not in masks]
    return ModelRollback(model, keep=[*trained, *buffers], same=same)


def _failure_note(who: str, objective: _Objective, steps: int, batches) -> str:
    """Where a training loop stopped (one objective call per step): the step and, for a list of
    batches (cycled), the batch's index."""
    step = objective.calls - 1
    if step >= steps:
        return f"{who}: failed after the {steps} training steps"
    n = len(batches) if hasattr(batches, "__len__") else None
    which = f"batches[{step % n}]" if n else f"the batch drawn for step {step}"
    return f"{who}: failed at step {step} of {steps}, on {which}"

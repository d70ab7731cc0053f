"""Training 2:4 models end to end (layer 6): learned masks and frozen-mask distillation.

* :func:`learn_masks`: MaskLLM (Fang et al., NeurIPS 2024): every 2:4 group of
  every selected ``nn.Linear`` learns a distribution over its 6 patterns
  (:class:`sparse24.masks.LearnableMask`), sampled with the Gumbel-softmax
  under a falling temperature, straight-through hard draws at the end, the
  weights frozen by default; initialised from a one-shot mask (magnitude,
  Wanda, SparseGPT) and trained on a task loss or, by default, by
  distillation from the dense model. The final masks are written into the
  ``Sparse24Linear`` masked layers that :func:`sparse24.sparsify_` makes, so
  ``compress_``, checkpoints and kernels work unchanged.
* :func:`distill_`: the recovery recipe: retrain a 2:4 model with its masks
  frozen toward the dense teacher (output loss plus optional layer-wise
  losses on chosen modules' outputs), AdamW with warmup and cosine decay.

Both take batches as :func:`sparse24.calibrate` does (tensors, tuples or
dicts), and the same objective: ``loss_fn(output, batch)`` if given, plus the
distillation loss if a teacher is given (the default teacher of
:func:`learn_masks` is a frozen copy of the dense model).
"""
from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_model
from .api import MIN_FEATURES, SparsifyReport, sparsify_
from .api.walk import _child_slots, _Undo
from .masks import LearnableMask
from .nn import Sparse24Linear

__all__ = ["learn_masks", "distill_", "LearnReport", "DistillReport", "OUTPUT_LOSSES"]

OUTPUT_LOSSES = ("mse", "cosine", "kl")


# --- the objective: task loss and/or distillation -------------------------------------

def _output_tensor(out):
    """The tensor to distil from a model output: itself, ``logits`` of a dict-like
    output (Hugging Face ModelOutput), else its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" in out:
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"cannot distil from a model output of type {type(out).__name__}: return a tensor, "
                    "a tuple or a dict of tensors, or pass loss_fn")


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
    s, t = s.float().flatten(0, -2), t.float().flatten(0, -2)
    return F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")


def _call(model: nn.Module, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _Objective:
    """``loss(batch)`` of the student: task loss, distillation from the teacher
    (output loss + ``hidden_weight`` x mean relative MSE of the ``hidden``
    modules' outputs), or both summed. Hooks live until :meth:`close`."""

    def __init__(self, student, teacher, loss_fn, output_loss, hidden, hidden_weight, forward=None):
        if forward is not None and not callable(forward):
            raise TypeError(f"forward must be callable (model, batch) -> output, got {type(forward).__name__}")
        self.forward = forward or _call
        if loss_fn is None and teacher is None:
            raise ValueError("nothing to train on: give loss_fn (a task loss) and/or teacher (to distil from)")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, batch) -> loss, got {type(loss_fn).__name__}")
        if teacher is not None and not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
        if not callable(output_loss) and output_loss not in OUTPUT_LOSSES:
            raise ValueError(f"output_loss must be one of {OUTPUT_LOSSES} or a callable (student, teacher) -> loss, "
                             f"got {output_loss!r}")
        hidden = [hidden] if isinstance(hidden, str) else list(hidden or ())
        if hidden and teacher is None:
            raise ValueError("hidden= (layer-wise distillation) needs a teacher")
        if not (isinstance(hidden_weight, (int, float)) and hidden_weight >= 0):
            raise ValueError(f"hidden_weight must be a number >= 0, got {hidden_weight!r}")
        s_mods, t_mods = dict(student.named_modules()), dict(teacher.named_modules()) if teacher is not None else {}
        missing = [h for h in hidden if h not in s_mods or h not in t_mods]
        if missing:
            raise ValueError(f"hidden modules {missing} are not in both the student and the teacher")
        self.student, self.teacher, self.loss_fn, self.output_loss = student, teacher, loss_fn, output_loss
        self.hidden, self.hidden_weight = hidden, float(hidden_weight)
        self._s, self._t, self._handles = {}, {}, []
        for h in hidden:
            self._handles.append(s_mods[h].register_forward_hook(self._keep(self._s, h)))
            self._handles.append(t_mods[h].register_forward_hook(self._keep(self._t, h)))

    @staticmethod
    def _keep(store: dict, name: str):
        def hook(mod, args, out):
            store[name] = out[0] if isinstance(out, (tuple, list)) else out
        return hook

    def __call__(self, batch) -> torch.Tensor:
        out = self.forward(self.student, batch)
        loss = self.loss_fn(out, batch) if self.loss_fn is not None else 0.0
        if self.teacher is not None:
            with torch.no_grad():
                ref = self.forward(self.teacher, batch)
            loss = loss + _distill_loss(self.output_loss, _output_tensor(out), _output_tensor(ref))
            if self.hidden and self.hidden_weight:
                layer = sum(_relative_mse(self._s[h], self._t[h]) for h in self.hidden) / len(self.hidden)
                loss = loss + self.hidden_weight * layer
        self._s.clear()
        self._t.clear()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        return loss

    def close(self) -> None:
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
    """``batches`` after checking, without losing anything, that it yields at least one batch."""
    if isinstance(batches, torch.Tensor) or batches is None or not hasattr(batches, "__iter__"):
        raise TypeError("batches must be an iterable of batches (a list of tensors, tuples or dicts)")
    if iter(batches) is batches:  # an iterator: take the first batch and put it back in front
        first = next(batches, None)
        if first is not None:
            return itertools.chain([first], batches)
    elif next(iter(batches), None) is not None:
        return batches
    raise ValueError("batches is empty")


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return steps


def _optimizer_step(loss: torch.Tensor, params: list, clip: float | None, opt, sched) -> float:
    """One training step: backward, optional gradient-norm clipping, step, schedule, zero; the loss value."""
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _warmup_cosine(steps: int, warmup: float, floor: float):
    """LR factor: linear warmup over ``warmup * steps``, then cosine from 1 down to ``floor``."""
    w = max(1, round(warmup * steps))

    def factor(s: int) -> float:
        if s < w:
            return (s + 1) / w
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - w) / max(1, steps - w)))
    return factor


# --- learned masks -----------------------------------------------------------------

@dataclass
class LearnReport:
    """What :func:`learn_masks` did.

    Attributes:
        sparsify: the :class:`~sparse24.api.SparsifyReport` of the prior's swap
            (layers swapped to ``Sparse24Linear``, and those skipped and why).
        layers: ``{fqn: fraction of groups whose final pattern differs from the prior's}``.
        losses: training loss per step.
        prior_loss, learned_loss: mean loss of the prior's and of the learned
            hard masks on the check batches (None if ``check_batches=0``).
        kept: ``"learned"``, or ``"prior"`` when the learned masks were worse on
            the check batches and were reverted.
        seconds: wall time of the training loop.
        logit_bytes: bytes of all mask logits (``6 * dtype size`` per group for 2:4).
        not_learned: ``{fqn: reason}`` for swapped layers whose mask stayed the prior's.
    """
    sparsify: SparsifyReport
    layers: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    prior_loss: float | None = None
    learned_loss: float | None = None
    kept: str = "learned"
    seconds: float = 0.0
    logit_bytes: int = 0
    not_learned: dict = field(default_factory=dict)

    def __str__(self) -> str:
        changed = sum(self.layers.values()) / max(1, len(self.layers))
        first = sum(self.losses[:10]) / max(1, len(self.losses[:10]))
        last = sum(self.losses[-10:]) / max(1, len(self.losses[-10:]))
        s = (f"sparse24.learn_masks: {len(self.layers)} layer(s) learned over {len(self.losses)} steps in "
             f"{self.seconds:.1f} s; loss {first:.4g} -> {last:.4g}; {100 * changed:.1f}% of groups changed "
             f"pattern on average; logits {self.logit_bytes} B")
        if self.prior_loss is not None:
            s += f"; check loss prior {self.prior_loss:.4g} vs learned {self.learned_loss:.4g}: kept {self.kept}"
        return s + "".join(f"\n  not learned: {k} ({v})" for k, v in self.not_learned.items())


class _Schedule:
    """The shared sampling state of every mask during :func:`learn_masks`."""

    def __init__(self, seed: int):
        self.tau, self.hard, self.noise, self.use = 1.0, False, 1.0, "sample"
        self.generator = torch.Generator().manual_seed(seed)


class _MaskLearningLinear(nn.Module):
    """Stands in for a ``Sparse24Linear`` while its mask is learned:
    ``F.linear(x, weight * mask, bias)`` with the mask drawn per the schedule."""

    def __init__(self, weight: nn.Parameter, bias, mask: LearnableMask, schedule: _Schedule, prior: torch.Tensor):
        super().__init__()
        self.weight, self.bias, self.mask, self.schedule = weight, bias, mask, schedule
        self.register_buffer("prior", prior, persistent=False)

    def current_mask(self) -> torch.Tensor:
        s = self.schedule
        if s.use == "prior":
            return self.prior.to(self.weight.dtype)
        if s.use == "learned":
            return self.mask.hard_mask().to(self.weight.dtype)
        return self.mask.sample(s.tau, s.hard, s.generator, s.noise).to(self.weight.dtype)

    def forward(self, x):
        return F.linear(x, self.weight * self.current_mask(), self.bias)

    def kept_norm_fraction(self) -> torch.Tensor:
        """``||W * mask||^2 / ||W||^2`` of the expected mask (the magnitude regulariser's term)."""
        w2 = self.weight.detach().float().pow(2)
        return (w2 * self.mask.expected_mask()).sum() / w2.sum().clamp_min(1e-12)


def learn_masks(model: nn.Module, batches, steps: int, *, loss_fn: Callable | None = None,
                teacher: nn.Module | None = None, prior: str = "magnitude", calibration: dict | None = None,
                lr: float = 0.05, tau: tuple[float, float] = (2.0, 0.05), hard_fraction: float = 0.2,
                noise=(1.0, 0.05), confidence: float = 3.0, magnitude_reg: float = 0.0, train_weights: bool = False,
                weight_lr: float = 1e-5, weight_decay: float = 0.0, betas: tuple = (0.9, 0.999),
                clip: float | None = None, output_loss="mse", hidden=(), hidden_weight: float = 1.0,
                forward: Callable | None = None, filter_fn=None, min_features: int = MIN_FEATURES, logits_dtype: torch.dtype = torch.float32,
                check_batches: int = 4, seed: int = 0, callback: Callable | None = None) -> LearnReport:
    """Learn the 2:4 masks of ``model``'s Linear layers end to end (MaskLLM), in place.

    1. The selected ``nn.Linear`` layers are swapped for masked-mode
       ``Sparse24Linear`` by ``sparsify_(method=prior, calibration=...)`` (the
       same choice of layers and skips; SparseGPT's rebuilt weights are kept
       at the positions its mask keeps). Layers that already are masked
       ``Sparse24Linear`` keep their mask as the prior.
    2. Each layer gets a :class:`~sparse24.masks.LearnableMask` initialised
       from the prior with ``confidence``. The candidate weights are the
       layer's weights where the prior keeps them and the dense weights
       elsewhere (from the default teacher, a copy of the dense model made
       first; or from ``teacher``'s layer of the same name).
    3. ``steps`` optimisation steps (AdamW on the logits, 5% warmup, cosine to
       10%): the forward uses ``W * m`` with ``m`` a Gumbel-softmax draw at
       temperature falling geometrically from ``tau[0]`` to ``tau[1]`` and
       Gumbel noise scaled from ``noise[0]`` to ``noise[1]`` the same way (so
       the draws settle on the most probable patterns, the masks the model will
       keep, as MaskLLM's logit scaling does); the last ``hard_fraction`` of
       the steps draw hard one-hot masks with straight-through gradients. Loss: ``loss_fn(output, batch)`` and/or
       distillation from the teacher (``output_loss`` on the outputs +
       ``hidden_weight`` x relative MSE of the ``hidden`` modules' outputs),
       minus ``magnitude_reg`` x the mean fraction of ``||W||^2`` the expected
       masks keep (MaskLLM's regulariser keeping the kept weights large).
    4. The most probable pattern of every group is written into the layer's
       ``mask`` buffer (and the weight zeroed off it). If ``check_batches > 0``,
       the loss of the learned and of the prior masks is compared on the first
       ``check_batches`` batches and the prior is restored if it was lower.

    The model and the teacher run in the train/eval mode they are in (call
    ``.eval()`` to switch dropout off); the default teacher is in eval mode.

    Memory: the logits are ``(6, R, C/4)`` per layer in ``logits_dtype``, 6
    floats per group (24 B per 4 weights in fp32; AdamW adds 2 more per logit),
    plus a dense copy of the selected weights (the default teacher).

    Args:
        model: dense model (``nn.Linear`` layers) or one already in masked mode.
        batches: list (cycled) or iterator of batches (tensor, tuple or dict).
        steps: optimisation steps.
        loss_fn: ``(output, batch) -> scalar`` task loss.
        teacher: model to distil from; default: a frozen copy of ``model``
            taken before pruning when ``loss_fn`` is None.
        prior: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"`` (with
            ``calibration`` from ``sparse24.calibrate(model, ...)``).
        lr: logits learning rate. tau: ``(start, end)`` temperatures.
        hard_fraction: share of the steps, at the end, with hard draws.
        noise: ``(start, end)`` Gumbel noise scales, or one number for a
            constant scale. confidence: prior strength (see LearnableMask).
        magnitude_reg: weight of the kept-magnitude regulariser.
        train_weights: also train the candidate weights and every other
            trainable parameter of ``model`` (biases, norms, embeddings) with lr
            ``weight_lr`` and AdamW ``weight_decay`` (on matrices only).
        betas, clip: AdamW betas; gradient-norm clipping (None: none) of the weights when they
            train, else of the logits.
        output_loss: ``"mse"`` (relative), ``"cosine"``, ``"kl"`` or a callable.
        hidden: module names whose outputs are matched layer-wise.
        forward: ``(model, batch) -> output`` (default: ``model(batch)``,
            ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict), e.g.
            to leave the labels of a batch to ``loss_fn``.
        filter_fn, min_features: layer selection as in :func:`sparse24.sparsify_`.
        logits_dtype: ``torch.float32`` or ``torch.bfloat16``...
        check_batches: batches for the final prior-vs-learned check (0: none).
        seed: seeds the Gumbel noise (runs are deterministic for a seed).
        callback: ``callback(step, loss)`` after each step.
    Returns:
        :class:`LearnReport`.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> rep = learn_masks(model, [torch.randn(16, 64)], steps=5)
        >>> type(model[0]).__name__, is_nm(model[0].dense_weight())
        ('Sparse24Linear', True)
    """
    check_model(model, filter_fn)
    steps = _check_steps(steps)
    for name, v in (("lr", lr), ("weight_lr", weight_lr)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if (not isinstance(tau, (tuple, list)) or len(tau) != 2
            or not all(isinstance(t, (int, float)) and 0 < t < math.inf for t in tau)):
        raise ValueError(f"tau must be (start, end) temperatures > 0, got {tau!r}")
    if not (isinstance(hard_fraction, (int, float)) and 0 <= hard_fraction <= 1):
        raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction!r}")
    noise = (noise, noise) if isinstance(noise, (int, float)) and not isinstance(noise, bool) else noise
    if (not isinstance(noise, (tuple, list)) or len(noise) != 2
            or not all(isinstance(v, (int, float)) and 0 <= v < math.inf for v in noise)):
        raise ValueError(f"noise must be a number >= 0 or (start, end) numbers >= 0, got {noise!r}")
    for name, v in (("magnitude_reg", magnitude_reg),):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < math.inf:
        raise ValueError(f"confidence must be a finite number >= 0, got {confidence!r}")
    if logits_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"logits_dtype must be a floating dtype, got {logits_dtype!r}")
    if isinstance(check_batches, bool) or not isinstance(check_batches, int) or check_batches < 0:
        raise ValueError(f"check_batches must be an int >= 0, got {check_batches!r}")
    if isinstance(prior, str) and prior not in ("magnitude", "wanda", "sparsegpt"):
        raise ValueError(f"prior must be 'magnitude', 'wanda' or 'sparsegpt', got {prior!r}")
    batches = _nonempty(batches)
    own_teacher = teacher is None and loss_fn is None
    if own_teacher:
        if any(isinstance(m, Sparse24Linear) for m in model.modules()):
            raise ValueError("model already has Sparse24Linear layers: pass teacher= (the dense model) to distil "
                             "from it, and to take the weights the prior pruned from it")
        teacher = copy.deepcopy(model).eval()
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
    objective = _Objective(model, teacher, loss_fn, output_loss, hidden, hidden_weight, forward)  # checks first
    opt_kwargs = {"lr": lr, "weight_lr": weight_lr, "weight_decay": weight_decay, "betas": tuple(betas), "clip": clip}
    try:
        return _learn(model, batches, steps, objective, teacher, prior, calibration, tau, hard_fraction, noise,
                      confidence, magnitude_reg, train_weights, opt_kwargs, filter_fn, min_features, logits_dtype,
                      check_batches, seed, callback)
    finally:
        objective.close()


def _learn(model, batches, steps, objective, teacher, prior, calibration, tau, hard_fraction, noise, confidence,
           magnitude_reg, train_weights, opt_kwargs, filter_fn, min_features, logits_dtype, check_batches, seed,
           callback) -> LearnReport:
    # 1. dense weights of the layers about to be pruned (a view of the teacher's when it is our copy)
    t_mods = dict(teacher.named_modules()) if teacher is not None else {}
    dense = {}
    for fqn, mod in model.named_modules():
        if (type(mod) in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)
                and (filter_fn is None or filter_fn(mod, fqn))):
            src = t_mods.get(fqn)
            same = isinstance(src, nn.Linear) and src.weight.shape == mod.weight.shape
            dense[fqn] = src.weight.detach() if same else mod.weight.detach().clone()
    report = sparsify_(model, filter_fn, method=prior, calibration=calibration, min_features=min_features)
    # 2. one learnable mask per masked layer
    schedule = _Schedule(seed)
    slots, learners, not_learned = _child_slots(model), {}, {}
    layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)
              and (filter_fn is None or filter_fn(m, fqn))]
    readers = {r.fqn: r.reason for r in report.changed if r.reason}
    for fqn, sp in layers:
        if sp.mode != "masked":
            not_learned[fqn] = "compressed mode: no dense weight to learn a mask over"
            continue
        if fqn in readers:
            not_learned[fqn] = f"its parent reads its weight directly ({readers[fqn]})"
            continue
        src = dense.get(fqn)
        if src is None:
            lin = t_mods.get(fqn)
            src = lin.weight.detach() if isinstance(lin, nn.Linear) and lin.weight.shape == sp.weight.shape else None
        if src is None:
            not_learned[fqn] = "no dense weight for it (no teacher layer of the same name and shape)"
            continue
        with torch.no_grad():
            cand = torch.where(sp.mask, sp.weight, src.to(sp.weight))
        w = nn.Parameter(cand, requires_grad=train_weights)
        lm = LearnableMask(tuple(sp.weight.shape), 2, 4, prior=sp.mask, confidence=confidence, dtype=logits_dtype,
                           device=sp.weight.device)
        learners[fqn] = (sp, _MaskLearningLinear(w, sp.bias, lm, schedule, sp.mask.clone()))
    rep = LearnReport(report, not_learned=not_learned)
    if not learners:
        return rep
    swaps = _Undo()
    for sp, stand_in in learners.values():
        swaps.replace(slots, sp, stand_in)
    try:
        _train_masks(batches, steps, objective, learners, schedule, tau, hard_fraction, noise, magnitude_reg,
                     train_weights, opt_kwargs, check_batches, callback, rep)
    finally:
        # 4. write the masks back (also after an error or Ctrl-C: the model stays a valid 2:4 model)
        for fqn, (sp, stand_in) in learners.items():
            final = stand_in.mask.hard_mask() if rep.kept == "learned" else stand_in.prior
            with torch.no_grad():
                sp.mask.copy_(final)
                sp.weight.copy_(torch.where(final, stand_in.weight.detach(), 0))
            rep.layers[fqn] = float((final != stand_in.prior).view(-1, 4).any(-1).float().mean())
        swaps.undo()  # every layer back into the slots it came from
    rep.logit_bytes = sum(s.mask.logits.numel() * s.mask.logits.element_size() for _, s in learners.values())
    return rep


def _train_masks(batches, steps, objective, learners, schedule, tau, hard_fraction, noise, magnitude_reg,
                 train_weights, opt_kwargs, check_batches, callback, rep) -> None:
    stand_ins = [s for _, s in learners.values()]
    groups = [{"params": [s.mask.logits for s in stand_ins], "lr": opt_kwargs["lr"], "weight_decay": 0.0}]
    if train_weights:  # the candidate weights and every other trainable parameter of the model
        weights = [s.weight for s in stand_ins]
        own = {id(p) for p in weights} | {id(s.mask.logits) for s in stand_ins}
        weights += [p for p in objective.student.parameters() if p.requires_grad and id(p) not in own]
        for decay in (True, False):  # weight decay on matrices only (not on biases and norms)
            groups.append({"params": [p for p in weights if (p.dim() >= 2) == decay], "lr": opt_kwargs["weight_lr"],
                           "weight_decay": opt_kwargs["weight_decay"] if decay else 0.0})
    # Clip what the model trains (the weights when they train): the logits' gradients would otherwise
    # shrink the weights' steps, and Adam's per-logit scaling makes clipping them moot.
    params = [p for g in groups[1:] for p in g["params"]] or groups[0]["params"]
    opt = torch.optim.AdamW(groups, betas=opt_kwargs["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(steps, 0.05, 0.1))
    hard_from = steps - round(hard_fraction * steps)
    t0 = time.perf_counter()
    for step, batch in enumerate(_batch_stream(batches, steps)):
        frac = step / max(1, steps - 1)
        schedule.tau = tau[0] * (tau[1] / tau[0]) ** frac  # geometric: equal time per decade
        schedule.noise = (noise[0] * (noise[1] / noise[0]) ** frac if min(noise) > 0
                          else noise[0] + (noise[1] - noise[0]) * frac)
        schedule.hard, schedule.use = step >= hard_from, "sample"
        loss = objective(batch)
        if magnitude_reg:
            loss = loss - magnitude_reg * sum(s.kept_norm_fraction() for s in stand_ins) / len(stand_ins)
        rep.losses.append(_optimizer_step(loss, params, opt_kwargs["clip"], opt, sched))
        if callback is not None:
            callback(step, rep.losses[-1])
    rep.seconds = time.perf_counter() - t0
    if check_batches:
        rep.learned_loss, rep.prior_loss = (_mean_loss(objective, batches, check_batches, schedule, use)
                                            for use in ("learned", "prior"))
        rep.kept = "learned" if rep.learned_loss <= rep.prior_loss else "prior"


@torch.no_grad()
def _mean_loss(objective, batches, k, schedule, use) -> float:
    schedule.use = use
    losses = [float(objective(b)) for b in _batch_stream(batches, k)]
    return sum(losses) / len(losses)


# --- frozen-mask distillation ------------------------------------------------------

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
             callback: Callable | None = None) -> DistillReport:
    """Retrain a 2:4 model with its masks frozen (the recovery recipe), in place.

    ``Sparse24Linear`` masked layers keep their pruned weights at exactly zero
    through any optimizer, so this trains every given parameter freely: AdamW,
    linear warmup over ``warmup * steps`` steps, cosine decay to
    ``final_lr * lr``, gradient clipping; the models run in the mode they are
    in (``.eval()`` switches dropout off). Loss: ``loss_fn(output, batch)``
    and/or distillation from ``teacher`` (``output_loss`` on the outputs plus
    ``hidden_weight`` x the relative MSE of the ``hidden`` modules' outputs,
    averaged over those modules).

    Args:
        model: the 2:4 student (``sparsify_`` / ``learn_masks`` output).
        batches: list (cycled) or iterator of batches.
        steps: optimisation steps.
        teacher: the dense model to distil from.
        loss_fn: ``(output, batch) -> scalar`` task loss.
        lr, warmup, final_lr, weight_decay, clip: optimiser settings (``clip=None``: none).
        output_loss: ``"mse"`` (relative), ``"cosine"``, ``"kl"`` or a callable.
        hidden: names of modules (in both models) whose outputs are matched.
        parameters: the parameters to train (default: every trainable one of ``model``).
        forward: ``(model, batch) -> output`` (default as in :func:`learn_masks`).
        callback: ``callback(step, loss)`` after each step.
    Returns:
        :class:`DistillReport`.
    Example:
        >>> dense = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> student = copy.deepcopy(dense); _ = sparsify_(student)
        >>> rep = distill_(student, [torch.randn(16, 64)], steps=3, teacher=dense)
        >>> len(rep.losses)
        3
    """
    check_model(model, None)
    steps = _check_steps(steps)
    for name, v in (("lr", lr),):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    for name, v in (("warmup", warmup), ("final_lr", final_lr)):
        if not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
    batches = _nonempty(batches)
    params = [p for p in (model.parameters() if parameters is None else parameters) if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    objective = _Objective(model, teacher, loss_fn, output_loss, hidden, hidden_weight, forward)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(steps, warmup, final_lr))
    rep = DistillReport()
    t0 = time.perf_counter()
    try:
        for step, batch in enumerate(_batch_stream(batches, steps)):
            rep.losses.append(_optimizer_step(objective(batch), params, clip, opt, sched))
            if callback is not None:
                callback(step, rep.losses[-1])
    finally:
        objective.close()
    rep.seconds = time.perf_counter() - t0
    return rep

"""Learned masks over a whole model: :func:`learn_masks` (see :mod:`sparse24.learn`)."""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import as_real, check_model, check_nonnegative, check_seed, refuse_inference_mode
from .._progress import progress_bar, progress_enabled
from ..api import MIN_FEATURES, SparsifyReport, sparsify_
from ..api.walk import _child_slots, _direct_readers, _Undo
from ..masks.kept_dense import _SWAPPABLE, _is_linear, _swappable
from ..masks import LearnableMask
from ..nn import Sparse24Linear
from ..nn.prepare import _linear_weight
from .objective import (_batch_stream, _check_steps, _failure_note, _nonempty, _Objective, _optimizer_step,
                        _refuse_float16, _rollback_for, _warmup_cosine)

__all__ = ["learn_masks", "LearnReport"]


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
        self.step = -1  # the training step: a layer's draw is the same for every forward of one step


class _MaskLearningLinear(nn.Module):
    """Stands in for a ``Sparse24Linear`` while its mask is learned:
    ``F.linear(x, weight * mask, bias)`` with the mask drawn per the schedule."""

    def __init__(self, weight: nn.Parameter, bias, mask: LearnableMask, schedule: _Schedule, prior: torch.Tensor):
        super().__init__()
        self.weight, self.bias, self.mask, self.schedule = weight, bias, mask, schedule
        self.register_buffer("prior", prior, persistent=False)
        self._draw = None  # (step, the generator's state before this layer's draw at that step)

    def current_mask(self) -> torch.Tensor:
        s = self.schedule
        if s.use == "prior":
            return self.prior.to(self.weight.dtype)
        if s.use == "learned":
            return self.mask.hard_mask().to(self.weight.dtype)
        # Activation checkpointing runs the forward again in backward (and restores torch's RNG, not ours): a
        # second call in a step draws the first call's noise again from the state saved then, so the gradient
        # is that of the loss. (A copy of the state, not of the noise: the noise is as large as the logits.)
        gen = s.generator
        if self._draw is not None and self._draw[0] == s.step:
            gen = torch.Generator(gen.device).set_state(self._draw[1])
        else:
            self._draw = (s.step, gen.get_state())
        return self.mask.sample(s.tau, s.hard, gen, s.noise).to(self.weight.dtype)

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
                forward: Callable | None = None, filter_fn=None, min_features: int = MIN_FEATURES,
                skip_output_head=True, logits_dtype: torch.dtype = torch.float32,
                check_batches: int = 4, seed: int = 0, callback: Callable | None = None,
                progress: bool | None = None) -> LearnReport:
    """Learn the 2:4 masks of ``model``'s Linear layers end to end (MaskLLM), in place.

    1. The selected ``nn.Linear`` layers (and transformers ``Conv1D``, GPT-2's, whose
       transposed weight the layer takes) are swapped for masked-mode
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
    The steps run with autograd on whatever the caller's grad mode (inside
    ``torch.no_grad()`` too); under ``torch.inference_mode()``, whose tensors
    autograd cannot record, the call is a RuntimeError (nothing changed).
    Activation checkpointing (``model.activation_checkpointing_enable()``,
    ``torch.utils.checkpoint``) gives the same results: each layer draws its
    mask once per step (a layer run twice in a step uses that draw again), so a
    forward recomputed in backward sees the mask the loss was computed with.
    With ``hidden=`` it needs ``use_reentrant=False`` (a reentrant segment's
    modules run under no_grad first: a ValueError, nothing changed).

    All or nothing: if anything fails (a batch the model cannot run, ``loss_fn``,
    ``callback``, Ctrl-C), the layer swaps are undone and the weights, buffers and
    gradients get their values from before the call back (the pruned weights from the
    teacher's copy where it holds them, the rest from a CPU copy); the error's notes
    give the step and the batch (``batches[i]`` for a list).

    Memory: the logits are ``(6, R, C/4)`` per layer in ``logits_dtype``, 6
    floats per group (24 B per 4 weights in fp32; AdamW adds 2 more per logit),
    plus a dense copy of the selected weights (the default teacher). For the
    rollback: a CPU copy of the trained tensors, and, on a model already in
    masked mode, of those layers' weights while the masks are written back.

    Args:
        model: dense model (``nn.Linear`` or ``Conv1D`` layers) or one already in masked mode.
        batches: list (cycled) or iterator of batches (tensor, tuple, or dict such as a tokenizer's
            output); one batch alone (not in a list) is a TypeError.
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
            ``weight_lr`` and AdamW ``weight_decay`` (a finite number >= 0, on matrices only); not
            float16 weights (use bfloat16, or float32 weights under ``torch.autocast``).
        betas, clip: AdamW betas (two numbers in [0, 1)); gradient-norm clipping (None: none) of the
            weights when they train, else of the logits.
        output_loss: ``"mse"`` (relative), ``"cosine"``, ``"kl"`` or a callable.
        hidden: module names whose outputs are matched layer-wise.
        forward: ``(model, batch) -> output`` (default: ``model(batch)``,
            ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict), e.g.
            to leave the labels of a batch to ``loss_fn``.
        filter_fn, min_features, skip_output_head: layer selection as in
            :func:`sparse24.sparsify_` (the output head stays dense by default): ``filter_fn``
            gets the dense layers (``nn.Linear``, ``Conv1D``), and the layers already a Sparse24Linear,
            whose masks it learns where it returns True; a selection of no layer is a
            ValueError (nothing changed).
        logits_dtype: ``torch.float32`` or ``torch.bfloat16`` (half the memory), or ``torch.float64``;
            not ``torch.float16`` (AdamW cannot train it).
        check_batches: batches for the final prior-vs-learned check (0: none).
        seed: an int seeding the Gumbel noise (runs are deterministic for a seed).
        callback: ``callback(step, loss)`` after each step.
        progress: a tqdm bar on stderr with the last loss (default None: when stderr is a
            terminal or in a notebook; False: none).
    Returns:
        :class:`LearnReport`.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> rep = learn_masks(model, [torch.randn(16, 64)], steps=5)
        >>> type(model[0]).__name__, sparse24.is_nm(model[0].dense_weight())
        ('Sparse24Linear', True)
    """
    check_model(model, filter_fn)
    refuse_inference_mode("learn_masks")
    progress = progress_enabled(progress)  # checked before anything changes
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
    # weight_decay goes into AdamW's param groups, whose values torch does not check (-50 grew the weights)
    for name, v in (("magnitude_reg", magnitude_reg), ("weight_decay", weight_decay), ("hidden_weight", hidden_weight)):
        check_nonnegative(v, name)
    betas = _check_betas(betas)
    seed = check_seed(seed)   # (it was first read after the prior had pruned every layer)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < math.inf:
        raise ValueError(f"confidence must be a finite number >= 0, got {confidence!r}")
    if logits_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise TypeError(f"logits_dtype must be torch.float32, torch.bfloat16 or torch.float64, got {logits_dtype!r}"
                        + (": AdamW's eps (1e-8) is 0 in float16, so a logit whose gradient is 0 turns NaN at the "
                           "first step" if logits_dtype == torch.float16 else ""))
    if train_weights:  # the candidate weights are the layers' weights, trained even where frozen
        layers = {id(getattr(m, "weight", None)) for m in model.modules()
                  if _is_linear(m) or isinstance(m, Sparse24Linear)}
        _refuse_float16([(n, p) for n, p in model.named_parameters() if p.requires_grad or id(p) in layers],
                        "learn_masks(train_weights=True)")
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
    objective = _Objective(model, teacher, loss_fn, output_loss, hidden, hidden_weight, forward)  # checks only
    opt_kwargs = {"lr": lr, "weight_lr": weight_lr, "weight_decay": weight_decay, "betas": betas, "clip": clip}
    # All or nothing: what the call may write (the pruned weights, the weights it trains, buffers) is kept,
    # taken from the teacher's parameters where they hold equal values (our own copy's always do; the
    # teacher's parameters are only read, its buffers may move in train mode).
    t_params = dict(teacher.named_parameters()) if teacher is not None else {}
    same = {id(p): t_params[k] for k, p in model.named_parameters() if k in t_params}
    rollback = _rollback_for(model, [p for p in model.parameters() if train_weights and p.requires_grad]
                             + [m.weight for m in model.modules() if type(m) in _SWAPPABLE], same)
    try:  # the hooks go on inside: every way out of here (a return, or an exception up to it) removes them
        objective.open()
        # it trains: under the caller's torch.no_grad() too (as calibrate runs under no_grad whatever the caller's
        # mode); backward failed at step 0 with torch's "element 0 of tensors does not require grad"
        with torch.enable_grad():
            rep = _learn(model, batches, steps, objective, teacher, prior, calibration, tau, hard_fraction, noise,
                         confidence, magnitude_reg, train_weights, opt_kwargs, filter_fn,
                         {"min_features": min_features, "skip_output_head": skip_output_head}, logits_dtype,
                         check_batches, seed, callback, progress, rollback)
        objective.close()
        return rep
    except BaseException as e:
        objective.close()
        rollback.restore()
        e.add_note("learn_masks: every layer swap and weight change was undone: the model is as it was before the "
                   "call")
        raise


def _check_betas(betas) -> tuple[float, float]:
    """``betas`` as AdamW's ``(beta1, beta2)``, each in [0, 1): torch checks them only when the optimizer is
    built, after the prior has pruned every layer."""
    try:  # any pair AdamW takes: a tuple, a list, Hydra's ListConfig, a numpy array, 0-d tensors
        pair = [as_real(b) for b in betas] if not isinstance(betas, (str, bytes)) else None
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(0 <= b < 1 for b in pair):
        raise ValueError(f"betas must be (beta1, beta2) numbers in [0, 1), got {betas!r}")
    return pair[0], pair[1]


def _learn(model, batches, steps, objective, teacher, prior, calibration, tau, hard_fraction, noise, confidence,
           magnitude_reg, train_weights, opt_kwargs, filter_fn, select, logits_dtype, check_batches, seed,
           callback, progress, rollback) -> LearnReport:
    # 1. dense weights of the layers about to be pruned (a view of the teacher's when it is our copy)
    t_mods = dict(teacher.named_modules()) if teacher is not None else {}
    dense = {}
    for fqn, mod in model.named_modules():
        if _swappable(mod) and (filter_fn is None or filter_fn(mod, fqn)):   # as sparsify_ swaps
            src, w = t_mods.get(fqn), _linear_weight(mod)
            ws = _linear_weight(src) if _is_linear(src) else None
            dense[fqn] = ws if ws is not None and ws.shape == w.shape else w.clone()
    report = sparsify_(model, filter_fn, method=prior, calibration=calibration, **select)
    # 2. one learnable mask per masked layer
    schedule = _Schedule(seed)
    slots, learners, not_learned = _child_slots(model), {}, {}
    # the layers this call swapped (filter_fn chose them as nn.Linear: a filter testing isinstance(m, nn.Linear)
    # would refuse the Sparse24Linear now there) and, of the layers sparse before, those filter_fn selects
    swapped = {r.fqn for r in report.changed}
    layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)
              and (fqn in swapped or filter_fn is None or filter_fn(m, fqn))]
    if not layers:   # (as prune_layerwise_, GradualPruner and SRSTE: a call that learns nothing is refused)
        why = "; ".join(f"{r.fqn!r}: {r.reason}" for r in report.skipped)
        raise ValueError(f"learn_masks: no torch.nn.Linear layer selected in {type(model).__name__} (nor transformers "
                         "Conv1D)" + (f"; skipped: {why}" if why else ""))
    # every layer read directly, the ones masked before this call too: a stand-in there would never run
    readers = _direct_readers(model)
    for fqn, sp in layers:
        if sp.mode != "masked":
            not_learned[fqn] = "compressed mode: no dense weight to learn a mask over"
            continue
        if id(sp) in readers:
            not_learned[fqn] = f"its parent reads its weight directly ({readers[id(sp)]})"
            continue
        src = dense.get(fqn)
        if src is None:
            lin = t_mods.get(fqn)
            src = _linear_weight(lin) if _is_linear(lin) and _linear_weight(lin).shape == sp.weight.shape else None
        if src is None:
            not_learned[fqn] = "no dense weight for it (no teacher layer of the same name and shape)"
            continue
        with torch.no_grad():
            cand = torch.where(sp.mask, sp.weight, src.to(sp.weight))
        w = nn.Parameter(cand, requires_grad=train_weights)
        lm = LearnableMask(tuple(sp.weight.shape), 2, 4, prior=sp.mask, confidence=confidence, dtype=logits_dtype,
                           device=sp.weight.device)
        learners[fqn] = (sp, _MaskLearningLinear(w, sp.bias, lm, schedule, sp.mask.clone()))
    if not learners:  # (learning nothing is refused, as a selection of no layer is; the caller rolls back)
        raise ValueError("learn_masks: no layer to learn: " + "; ".join(f"{k!r}: {v}" for k, v in not_learned.items())
                         + " (decompress_ compressed layers first; nothing was changed)")
    rep = LearnReport(report, not_learned=not_learned)
    swaps = _Undo()
    for sp, stand_in in learners.values():
        swaps.replace(slots, sp, stand_in)
    try:
        _train_masks(batches, steps, objective, learners, schedule, tau, hard_fraction, noise, magnitude_reg,
                     train_weights, opt_kwargs, check_batches, callback, rep, progress)
    except BaseException as e:  # learn_masks puts the whole model back
        swaps.undo()
        e.add_note(_failure_note("learn_masks", objective, steps, batches))
        raise
    # 4. write the masks back, in place (an optimizer may hold the weights). A failure part way (Ctrl-C, out
    # of memory in where()) is undone by learn_masks' rollback, which keeps the values written here first: a
    # layer swapped by this call has its dense weight kept already and a new mask; a layer that was masked
    # before costs a CPU copy of its weight (its old mask is the stand-in's prior, no copy), freed on return.
    rollback.keep([t for sp, _ in learners.values() for t in (sp.weight, sp.mask)],
                  same={id(sp.mask): stand_in.prior for sp, stand_in in learners.values()})
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
                 train_weights, opt_kwargs, check_batches, callback, rep, progress=None) -> None:
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
    bar = progress_bar(_batch_stream(batches, steps), total=steps, desc="learn_masks", progress=progress, unit="step")
    seen = []   # the first check_batches batches drawn: an iterator cannot give them again for the check
    for step, batch in enumerate(bar):
        if len(seen) < check_batches:
            seen.append(batch)
        frac = step / max(1, steps - 1)
        schedule.tau = tau[0] * (tau[1] / tau[0]) ** frac  # geometric: equal time per decade
        schedule.noise = (noise[0] * (noise[1] / noise[0]) ** frac if min(noise) > 0
                          else noise[0] + (noise[1] - noise[0]) * frac)
        schedule.hard, schedule.use, schedule.step = step >= hard_from, "sample", step
        loss = objective(batch)
        if magnitude_reg:
            loss = loss - magnitude_reg * sum(s.kept_norm_fraction() for s in stand_ins) / len(stand_ins)
        rep.losses.append(_optimizer_step(loss, objective.student, params, opt_kwargs["clip"], opt, sched))
        bar.set_postfix_str(f"loss {rep.losses[-1]:.4g}", refresh=False)
        if callback is not None:
            callback(step, rep.losses[-1])
    bar.close()
    rep.seconds = time.perf_counter() - t0
    if check_batches:
        # the same batches for both masks (an iterator's next ones differed between the two, or ran out)
        check = list(_batch_stream(batches, check_batches)) if iter(batches) is not batches else seen
        rep.learned_loss, rep.prior_loss = (_mean_loss(objective, check, schedule, use)
                                            for use in ("learned", "prior"))
        if not (math.isfinite(rep.learned_loss) and math.isfinite(rep.prior_loss)):
            raise FloatingPointError(f"the prior guard's loss is not finite (learned {rep.learned_loss}, prior "
                                     f"{rep.prior_loss})")
        rep.kept = "learned" if rep.learned_loss <= rep.prior_loss else "prior"


@torch.no_grad()
def _mean_loss(objective, check: list, schedule, use) -> float:
    schedule.use = use
    losses = [float(objective(b)) for b in check]
    return sum(losses) / len(losses)

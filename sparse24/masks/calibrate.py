"""Model-wide calibration and layer-by-layer pruning: the statistics the
activation-aware methods need (:class:`LayerStats`), collected with forward
pre-hooks, and SparseGPT-style sequential pruning of a whole model."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from .._checks import (KEYWORD_BATCH, call_with_batch, check_bool, check_model, check_nm, check_separate_teacher,
                       map_keyword_batch, map_sequence_batch, refuse_single_batch, with_context)
from .._rollback import TensorBackup
from .._progress import progress_bar, progress_enabled
from .distributed import agree, check_group, sum_over_ranks
from .kept_dense import _kept_dense, _shared_weights, _tied_or_head, _unswappable
from .nm import METHODS, LayerStats, PruneResult, kept_magnitude_fraction, prune_nm
from .reconstruct import PERCDAMP, damped_hessian, to_weight_dtype

__all__ = ["calibrate", "prune_layerwise_"]

# prune_layerwise_'s options of the fit to a teacher (SparseGPT takes them too)
_TEACHER_FIT_KWARGS = ("percdamp", "shrink")


class _StopForward(Exception):
    """Raised by a calibration hook to end a forward pass early (``stop_early``)."""


def calibrate(model: nn.Module, batches, hessian: bool = False, filter_fn=None, device=None,
              dtype: torch.dtype = torch.float64, stop_early: bool = False,
              token_mask: Callable | None = None, teacher: nn.Module | None = None,
              progress: bool | None = None, group=None) -> dict[str, LayerStats]:
    """Run ``model`` on ``batches`` and collect per-input-channel statistics of every ``nn.Linear``.

    The model runs in eval mode under ``torch.no_grad()`` (its train/eval
    flags are restored afterwards) with forward pre-hooks that are removed
    afterwards, also on error.

    Args:
        model: any module containing ``nn.Linear`` layers.
        batches: iterable of tensors (``model(b)``), tuples/lists
            (``model(*b)``) or dicts and other mappings, a tokenizer's output
            included (``model(**b)``); a one-shot iterator is fine. One batch
            alone (not in a list) is a TypeError.
        hessian: also accumulate ``X^T X`` (``K x K`` per layer; needed by
            ``"sparsegpt"``; costs K^2 memory so off by default).
        filter_fn: optional ``(module, fqn) -> bool`` selecting the layers.
        device: move every tensor of a batch there first (default: leave as is).
        dtype: accumulation dtype (fp64 default; use fp32 on devices without fp64).
        stop_early: end each forward pass as soon as every selected layer has
            seen its input (the rest of the model is not run; only for models
            that call each selected layer once per forward).
        token_mask: optional ``token_mask(batch) -> bool tensor`` shaped like the
            leading dimensions of every selected layer's input (e.g. ``(B, L)``:
            the attention mask of a padded batch); only the rows (tokens) where
            it is True count. Padding positions carry hidden states the model
            never uses; left in, they bias every statistic (on
            all-MiniLM-L6-v2 batches of 32 random sentences are 56% padding).
            A layer whose input lacks the mask's last (token) axis, ``(B, K)``
            for a ``(B, L)`` mask, as BERT's pooler reading one token per
            sequence, has no padding rows: all its rows count. Any other shape
            is a ValueError naming the layer. A layer whose input is a nested
            tensor (``nn.TransformerEncoder`` in eval mode called with a
            ``src_key_padding_mask`` drops the padding itself) counts every token
            it holds, with or without ``token_mask``; a ``token_mask`` there must
            keep exactly those (as many tokens per sequence), else ValueError.
        teacher: optional separate module with an ``nn.Linear`` of the same
            name and ``in_features`` for every selected layer (e.g. a
            ``copy.deepcopy`` of the model made before pruning it). It runs
            first on every batch, and each layer's
            :attr:`LayerStats.xtx_teacher` sums ``x^T x_t`` over the tokens,
            ``x_t`` the teacher layer's input at the same token (the k-th call
            of a layer pairs with the teacher's k-th): what fitting a layer to
            the teacher's outputs needs (:func:`prune_layerwise_`). Implies
            ``hessian=True``.
        progress: a tqdm bar over the batches on stderr (default None: when stderr is a
            terminal or in a notebook; False: none).
        group: data-parallel calibration: a ``torch.distributed`` process group (e.g.
            ``torch.distributed.group.WORLD``) whose ranks each call this with their own
            share of the batches; the statistics are summed over the ranks (one
            ``all_reduce`` per layer), so every rank gets those of all the data. Default
            None: this process's batches only, no communication.
    Returns:
        ``{fqn: LayerStats}`` for each Linear that saw at least one input (on any rank of ``group``),
        ``fqn`` as in ``model.named_modules()``.
    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> stats = calibrate(net, [torch.randn(32, 8)])
        >>> stats["2"].act_norm.shape
        torch.Size([16])
    """
    check_model(model, filter_fn)
    refuse_single_batch(batches)
    progress = progress_enabled(progress)
    hessian, stop_early = check_bool(hessian, "hessian"), check_bool(stop_early, "stop_early")
    check_group(group)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"token_mask must be callable (batch) -> bool tensor, got {type(token_mask).__name__}")
    selected = {fqn: mod for fqn, mod in model.named_modules()
                if isinstance(mod, nn.Linear) and (filter_fn is None or filter_fn(mod, fqn))}
    if teacher is not None:
        _check_teacher(model, teacher, selected)
        hessian = True
    stats: dict[str, LayerStats] = {}
    rows: list = [None]  # the current batch's token mask
    teacher_in: dict[str, list[torch.Tensor]] = {}  # the teacher's inputs of the current batch, in call order
    calls: dict[str, int] = {}  # the model's calls of each layer in the current batch
    seen: set[str] = set()

    def inputs(fqn: str, k: int, args, kwargs) -> torch.Tensor:
        return _token_inputs(fqn, _layer_input(fqn, args, kwargs).detach(), rows[0]).reshape(-1, k).to(dtype)

    def stop_if_done():
        if stop_early and len(seen) == len(selected):
            raise _StopForward

    def teacher_hook(fqn: str, k: int):
        def hook(mod, args, kwargs):
            teacher_in.setdefault(fqn, []).append(inputs(fqn, k, args, kwargs))
            seen.add(fqn)
            stop_if_done()
        return hook

    def hook_for(fqn: str, k: int):
        def hook(mod, args, kwargs):
            x = inputs(fqn, k, args, kwargs)
            s = stats.get(fqn)
            if s is None:
                def zeros(*shape):
                    return torch.zeros(*shape, dtype=dtype, device=x.device)
                s = stats[fqn] = LayerStats(zeros(k), 0, zeros(k, k) if hessian else None,
                                            zeros(k, k) if teacher is not None else None)
            s.sq_sum += (x * x).sum(0)
            s.count += x.shape[0]
            if s.xtx is not None:
                s.xtx.addmm_(x.t(), x)
            if s.xtx_teacher is not None:
                i = calls[fqn] = calls.get(fqn, 0) + 1
                earlier = teacher_in.get(fqn, [])
                if i > len(earlier) or earlier[i - 1].shape != x.shape:
                    raise ValueError(f"the teacher's layer {fqn!r} did not see the same inputs as the model's "
                                     f"(call {i}: {tuple(earlier[i - 1].shape) if i <= len(earlier) else 'none'} vs "
                                     f"{tuple(x.shape)} rows): the teacher must run the same computation")
                s.xtx_teacher.addmm_(x.t(), earlier[i - 1])
            seen.add(fqn)
            stop_if_done()
        return hook

    handles, error = [], None
    modes = [(mod, mod.training) for net in (model, teacher) if net is not None for mod in net.modules()]
    try:
        for fqn, mod in selected.items():
            handles.append(mod.register_forward_pre_hook(hook_for(fqn, mod.in_features), with_kwargs=True))
            if teacher is not None:
                handles.append(teacher.get_submodule(fqn).register_forward_pre_hook(teacher_hook(fqn, mod.in_features),
                                                                                    with_kwargs=True))
        for mod, _ in modes:
            mod.training = False
        with torch.no_grad():
            for i, b in enumerate(progress_bar(batches, desc="calibrate", progress=progress, unit="batch")):
                _check_batch(b, i)
                b = _to_device(b, device)
                if token_mask is not None:
                    rows[0] = _token_rows(token_mask(b))
                teacher_in.clear()
                calls.clear()
                if teacher is not None:
                    seen.clear()
                    _forward(teacher, b)
                seen.clear()
                _forward(model, b)
    except Exception as e:
        if group is None:
            raise
        error = e  # raised on every rank below, so that none waits in the all_reduce for this one
    finally:
        for h in handles:
            h.remove()
        for mod, training in modes:
            mod.training = training
    if group is not None:
        agree(error, group, "calibrate")
        return sum_over_ranks(stats, selected, hessian, teacher is not None, dtype, device, group)
    # A layer that only saw empty inputs has no statistics (all-zero norms would zero SparseGPT's weights).
    return {fqn: s for fqn, s in stats.items() if s.count > 0}


def _forward(model: nn.Module, b) -> None:
    try:
        call_with_batch(model, b)
    except _StopForward:
        pass


def _check_teacher(model: nn.Module, teacher: nn.Module, selected: dict[str, nn.Module]) -> None:
    """The teacher must be a separate module (pruning the model must not change it) with a
    Linear of the same name and width for every selected layer."""
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher must be an nn.Module, got {type(teacher).__name__}")
    check_separate_teacher(model, teacher)
    for fqn, mod in selected.items():
        try:
            t = teacher.get_submodule(fqn)
        except AttributeError:
            t = None
        if not isinstance(t, nn.Linear) or t.in_features != mod.in_features:
            raise ValueError(f"teacher has no nn.Linear {fqn!r} with in_features={mod.in_features} "
                             f"(found {type(t).__name__ if t is not None else 'nothing'}): it must have the model's "
                             "layer names and widths")


def prune_layerwise_(model: nn.Module, batches, n: int = 2, m: int = 4, method: str = "sparsegpt",
                     filter_fn=None, device=None, token_mask: Callable | None = None,
                     teacher: nn.Module | None = None, progress: bool | None = None, group=None,
                     on_layer: Callable | None = None, rollback: bool = True, **kwargs) -> dict[str, PruneResult]:
    """Prune the ``nn.Linear`` layers of ``model`` to N:M in place, one layer at a time,
    each calibrated on the inputs it receives once the layers before it are pruned.

    The layers are those :func:`sparse24.sparsify_` would prune (with its default
    ``skip_output_head=True``; no ``min_features`` limit): not the output head, an MoE router,
    a part of a PEFT adapter layer, a layer whose weight is shared (a head tied to the
    token embedding: pruning it would prune the embedding too), an ``nn.Linear`` subclass
    (transformers' ``FalconLinear``: its forward may differ) nor a parametrized layer
    (``weight_norm``, SR-STE), with sparsify_'s reasons. A ``filter_fn`` picks the layers
    instead; a subclass it picks is pruned in place (its weight Parameter; sparsify_ then
    leaves it an ``nn.Linear`` subclass holding the zeros). Refused either way, naming the
    layer, before anything changes: a shared weight, and a weight that is no Parameter of the
    layer (parametrized, or ``torch.nn.utils.prune``'s: a tensor recomputed on every access,
    so pruning it would change nothing).

    A selected layer the model never calls (its parent reads the weight directly, as WavLM's
    attention passes ``q_proj.weight`` to ``F.multi_head_attention_forward``, or it does not run)
    has no inputs to calibrate on: one warning names all of them, they stay dense and are
    not in the returned dict (``sparsify_`` afterwards prunes them by magnitude); if no
    selected layer is called, ValueError.

    This is how SparseGPT (and Wanda) prune a pretrained model: a layer's
    reconstruction then also absorbs the error of the earlier pruned layers.
    Layers run in the order of their first call in a forward pass of the first
    batch; each costs one more pass over ``batches``, shared by consecutive
    layers that read the same input tensor (a transformer's q, k, v), and cut
    short after the layer when every layer is called once per forward. The weights stay in the
    ``nn.Linear`` modules (zeros off the mask); convert them afterwards with
    ``sparse24.sparsify_(model)``, whose magnitude mask keeps exactly these
    non-zeros (for 2:4 and for any pattern at most as dense: 1:4, 2:8, 1:8 stay
    so through the frozen-mask retraining).

    With a ``teacher`` (the dense model, a separate copy) each layer is fit to
    the teacher's outputs instead of its own: with ``X`` the layer's inputs in
    the partly pruned model and ``X_t`` the teacher layer's inputs at the same
    tokens, the weight pruned is ``W_t = argmin ||X V^T - X_t W^T||^2 +
    lam ||V - W||^2`` (``lam`` = ``percdamp`` x the mean diagonal of ``X^T X /
    tokens``, SparseGPT's damping), so the layer also undoes the error the
    pruned layers before it left in its inputs; with ``method="sparsegpt"``
    and ``refit=True`` the kept weights are that problem's exact solution for
    the chosen mask. On all-MiniLM-L6-v2 (SparseGPT + permutation +
    reconstruction) this took the mean embedding cosine from 0.923 to 0.941;
    without a teacher, layer by layer gave 0.923, the same as one pass. The
    recommended recipe passes ``percdamp=0.1`` (:data:`~sparse24.masks.reconstruct.LAYERWISE_PERCDAMP`;
    the default stays SparseGPT's 0.01): calibrated on 512 lines of code, judged on
    prose, 0.897 -> 0.905 (docs/recipes.md).

    All or nothing: before any layer changes, one forward pass over every batch
    (no statistics) checks that each batch runs, that ``token_mask`` fits every
    layer's input and that every layer gets rows (errors name the batch and the
    layer); the teacher's names, widths and call order are checked on the first
    batch. If a layer still fails later (or on Ctrl-C), the layers already pruned
    get their weights back (a copy of each is kept on the CPU until the call
    returns) and the error says at which layer it stopped.

    Args:
        model: module with ``nn.Linear`` layers.
        batches: a re-iterable collection (e.g. a list) of batches as in :func:`calibrate`.
        n, m: keep ``n`` of every ``m``. Every selected layer needs ``in_features % m == 0``:
            the others are named in a ValueError (leave them out with ``filter_fn``), as is a
            call that selects no layer.
        method: any :data:`METHODS` entry (``"sparsegpt"`` collects each layer's Hessian).
        filter_fn: optional ``(module, fqn) -> bool`` selecting the layers (instead of
            sparsify_'s choice, see above; e.g. ``lambda m, fqn: fqn == "lm_head"`` prunes an
            untied head); one whose weight is shared with another module is a ValueError naming it.
        device, token_mask: passed to :func:`calibrate` (a padded ``nn.TransformerEncoder``'s
            nested layer inputs included).
        teacher: optional separate module with the model's layer names and
            widths, run on the same batches (see above and :func:`calibrate`).
        progress: a tqdm bar over the layers on stderr (default None: when stderr is a
            terminal or in a notebook; False: none).
        group: data-parallel calibration (see :func:`calibrate`): each rank passes its own
            share of the batches and every rank prunes alike, from the statistics of all of them.
        on_layer: optional ``(fqn, PruneResult) -> value``, called right after each layer is
            pruned (its weight already written); the returned dict then holds these values
            instead of the results, so no mask outlives its call (block-by-block pruning
            compresses and writes each layer there).
        rollback: keep a copy of each weight to restore on failure (default). False saves that
            copy (the size of the pruned layers) for callers that discard a failed model.
        **kwargs: method options (``blocksize=``, ``percdamp=``, ``refit=``, ``shrink=``;
            ``percdamp`` and ``shrink`` also apply to the teacher fit, with any method; without a
            teacher only ``"sparsegpt"`` takes them, else TypeError before any pass). ``quantize="int4"``
            (with ``group_size=``, ``symmetric=``; method ``"sparsegpt"``): each layer is
            pruned and quantized jointly (:func:`sparsegpt_prune`), its weight set to the
            dequantized INT4 grid values and its result's ``packed`` the INT4 tensor to store
            (rounding those weights again to nearest would not give the same grid).
    Returns:
        ``{fqn: PruneResult}`` in pruning order; each ``weight`` is the layer's pruned weight
        itself (detached, the same memory), not a copy.
    Example:
        >>> net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> results = prune_layerwise_(net, [torch.randn(64, 16)])
        >>> [round(r.kept_fraction, 1) > 0.5 for r in results.values()]
        [True, True]
    """
    check_model(model, filter_fn)
    progress = progress_enabled(progress)
    rollback = check_bool(rollback, "rollback")
    check_group(group)
    error = None
    fit_kw = {k: kwargs[k] for k in _TEACHER_FIT_KWARGS if k in kwargs}   # (the teacher fit's options)
    try:  # with a group, every rank learns whether any rank's input failed a check (no rank waits)
        refuse_single_batch(batches)
        if iter(batches) is batches:
            raise TypeError("batches must be re-iterable (a list or a DataLoader, not an iterator or generator): "
                            "every layer needs its own pass over them")
        if method not in METHODS:
            raise ValueError(f"unknown mask method {method!r}; choose one of {', '.join(METHODS)}")
        first = next(iter(batches), None)
        if first is None:
            raise ValueError("batches is empty: prune_layerwise_ needs calibration inputs")
        if token_mask is not None and not callable(token_mask):
            raise TypeError(f"token_mask must be callable (batch) -> bool tensor, got {type(token_mask).__name__}")
        fit_only = sorted(fit_kw)
        if fit_only and teacher is None and method != "sparsegpt":  # (else a TypeError after the first pass)
            raise TypeError(f"{'= and '.join(fit_only)}= only appl{'y' if len(fit_only) > 1 else 'ies'} to "
                            f"method='sparsegpt' and to the fit to a teacher: with method={method!r} and no "
                            "teacher= there is nothing to apply it to; pass teacher= or leave it out (nothing was "
                            "changed)")
        check_nm(n, m)
        names, kept = _layers_to_prune(model, filter_fn)
        if not names:
            why = "; ".join(f"{fqn!r}: {r}" for fqn, r in list(kept.items())[:5]) \
                + (f"; and {len(kept) - 5} more" if len(kept) > 5 else "")
            subclass = any(r.endswith("; not swapped") for r in kept.values())  # (transformers' FalconLinear)
            raise ValueError(f"prune_layerwise_: no nn.Linear layer selected in {type(model).__name__}"
                             + (" (filter_fn accepted none)" if filter_fn is not None else "")
                             + (f"; kept dense: {why}" if why else "")
                             + ("; a filter_fn that picks an nn.Linear subclass prunes its weight in place "
                                "(sparsify_ leaves it an nn.Linear subclass)" if subclass else ""))
        # Refused, not left dense without a word (m dividing no layer made the whole call a no-op)
        misfit = [f"{fqn!r} (in_features={mod.in_features})" for mod, fqn in names.items() if mod.in_features % m]
        if misfit:
            raise ValueError(f"prune_layerwise_: layer(s) {', '.join(misfit[:5])}"
                             + (f" and {len(misfit) - 5} more" if len(misfit) > 5 else "")
                             + f" cannot be pruned to {n}:{m}: in_features is not divisible by m={m}; exclude them "
                             "with filter_fn (nothing was changed)")
        # Everything checked before any layer changes, so that bad input changes nothing.
        calls = _check_inputs(model, names, batches, device, token_mask)
        if teacher is not None:
            _check_teacher(model, teacher, {fqn: mod for mod, fqn in names.items()})
            t_names = {teacher.get_submodule(fqn): fqn for fqn in names.values()}
            if [fqn for fqn, _ in _check_inputs(teacher, t_names, [first], device)] != [fqn for fqn, _ in calls]:
                raise ValueError("the teacher calls its layers in another order or number than the model does on "
                                 "the first batch: it must run the same computation (the model before pruning)")
    except Exception as e:
        if group is None:
            raise
        error = e
    if group is not None:
        agree(error, group, "prune_layerwise_'s checks")
        order = [None] * dist.get_world_size(group)
        dist.all_gather_object(order, [fqn for fqn, _ in calls], group=group)
        if any(o != order[0] for o in order):  # (each rank's sums would be added to another layer's)
            raise ValueError(f"the ranks' first batches run different layers or orders ({order[0][:3]} ... on rank 0, "
                             f"{next(o for o in order if o != order[0])[:3]} ... on another): every rank must prune "
                             "the same layers in the same order (nothing was changed)")
    # Layers the model never calls (_check_inputs refused those called on later batches only): their parent
    # reads the weight directly (WavLM's attention hands q_proj.weight to F.multi_head_attention_forward), so no
    # hook sees their inputs. Named once, not left out without a word; none at all changes nothing.
    called = {fqn for fqn, _ in calls}
    uncalled = [fqn for fqn in names.values() if fqn not in called]
    shown = f"{uncalled[:5]}" + (f" and {len(uncalled) - 5} more" if len(uncalled) > 5 else "")
    if uncalled and not called:
        raise ValueError(f"prune_layerwise_: the model calls none of the selected layers ({shown}): their parents "
                         "read the weights directly or the model never runs them, so there are no inputs to "
                         "calibrate them on; sparsify_ prunes them by magnitude (nothing was changed)")
    if uncalled:
        warnings.warn(f"prune_layerwise_: layer(s) {shown} are never called on these batches (their parent reads "
                      "the weight directly, as WavLM's attention does, or the model does not run them): no inputs to "
                      "calibrate them on, so they stay dense here and are not in the result; sparsify_ afterwards "
                      "prunes them by magnitude, or leave them out with filter_fn", stacklevel=2)
    once = len(called) == len(calls)  # every layer called once per forward
    # Waves: consecutive layers reading the very same input tensor (q, k, v) are pruned together,
    # with one pass; each pass stops at the wave when layers are called once per forward.
    waves: list[list[str]] = []
    seen: set[str] = set()
    for fqn, same_input in calls:
        if fqn in seen:
            continue
        seen.add(fqn)
        if once and waves and same_input:
            waves[-1].append(fqn)
        else:
            waves.append([fqn])
    results: dict[str, PruneResult] = {}
    layers = dict(model.named_modules())
    # The other methods take no percdamp= / shrink=: with a teacher those are the fit's alone
    method_kw = kwargs if method == "sparsegpt" else {k: v for k, v in kwargs.items() if k not in fit_kw}
    bar = progress_bar(total=sum(map(len, waves)), desc="prune_layerwise_", progress=progress, unit="layer")
    backup = TensorBackup()  # the weights pruned so far, written back if a later layer fails
    at = ""
    try:
        for wave in waves:
            bar.set_postfix_str(wave[0], refresh=False)
            at = f"the calibration pass of layer(s) {wave}"
            stats = calibrate(model, batches, hessian=method == "sparsegpt", device=device, stop_early=once,
                              filter_fn=lambda mod, name, wave=wave: name in wave, token_mask=token_mask,
                              teacher=teacher, progress=False, group=group)
            for fqn in wave:
                at = f"layer {fqn!r}"
                if fqn not in stats:
                    raise ValueError(f"layer {fqn!r} received no input rows from batches: nothing to calibrate it on")
                lin = layers[fqn]
                if rollback:
                    backup.keep([lin.weight])
                if teacher is None:
                    # written into the layer's own memory: no second copy of the model, nor of the layer
                    r = prune_nm(lin.weight, n, m, method, calibration=stats[fqn], out=lin.weight.detach(),
                                 **method_kw)
                else:
                    # W_t pruned in its own memory, so that the kept fraction is of the layer's dense weight
                    # (as documented and as the CLI reports it), not of the internal W_t, before it is written
                    w_t = _teacher_target(lin.weight, stats[fqn], **fit_kw)
                    r = prune_nm(w_t, n, m, method, calibration=stats[fqn], out=w_t, **method_kw)
                    kept = kept_magnitude_fraction(lin.weight, r.mask)
                    with torch.no_grad():
                        lin.weight.copy_(r.weight)
                    r = dataclasses.replace(r, weight=lin.weight.detach(), kept_fraction=kept)
                    del w_t
                results[fqn] = r if on_layer is None else on_layer(fqn, r)
                del r
            bar.update(len(wave))
    except BaseException as e:
        backup.restore()
        e.add_note(f"prune_layerwise_: failed at {at} " + (
            f"(the {len(results)} layer(s) pruned before were restored: the model is as it was)" if rollback
            else f"(rollback=False: the {len(results)} layer(s) pruned before stay pruned)"))
        raise
    finally:
        bar.close()
    return results


def _layers_to_prune(model: nn.Module, filter_fn) -> tuple[dict[nn.Module, str], dict[str, str]]:
    """``({layer: fqn} to prune, {fqn: why} of the nn.Linear layers kept dense)``: without ``filter_fn``,
    sparsify_'s choice (the helpers GradualPruner and SRSTE use too): no nn.Linear subclass or parametrized
    layer (with sparsify_'s reasons, :func:`_unswappable`), output head, MoE router or part of a PEFT adapter
    layer, and no layer whose weight is shared (tied: pruning a head tied to the token embedding prunes the
    embedding too); with ``filter_fn``, the layers it accepts (a subclass too: its weight is pruned in place).
    Either way a layer whose weight is shared, or is no Parameter of its own (parametrized, torch's
    ``prune``: a tensor computed on every access, so writing it would change nothing), is refused
    (ValueError naming it)."""
    shared = _shared_weights(model)
    heads = _kept_dense(model, True) if filter_fn is None else {}
    names, kept, refused = {}, {}, []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or (filter_fn is not None and not filter_fn(mod, fqn)):
            continue
        if filter_fn is None and (why := _unswappable(mod) or _tied_or_head(fqn, mod, shared, heads)):
            kept[fqn] = why   # (first: a head kept dense needs no Parameter of its own)
        elif not isinstance(mod._parameters.get("weight"), nn.Parameter):
            why = _unswappable(mod) if parametrize.is_parametrized(mod, "weight") else \
                f"its weight is a computed {type(mod.weight).__name__} (e.g. torch.nn.utils.prune), no Parameter"
            refused.append(f"{fqn!r}: {why}; pruning the computed weight would change nothing")
        elif why := _tied_or_head(fqn, mod, shared, heads):   # (with filter_fn only)
            refused.append(f"{fqn!r}: {why}")
        else:
            names[mod] = fqn
    if refused:
        raise ValueError(f"prune_layerwise_: {'filter_fn selects ' if filter_fn is not None else ''}layer(s) "
                         f"that cannot be pruned: {'; '.join(refused[:5])}"
                         + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
                         + "; leave them out with filter_fn (nothing was changed)")
    return names, kept


def _token_inputs(fqn: str, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows of a layer's input ``x`` (``(..., K)``) that the batch's token mask ``rows``
    keeps: ``x[rows]`` when ``x``'s leading dimensions are the mask's; all of them when ``x``
    lacks the mask's last (token) axis (a pooler's ``(B, K)`` under a ``(B, L)`` mask); else
    ValueError naming the layer. A nested ``x``: :func:`_nested_rows`."""
    if x.is_nested:
        return _nested_rows(fqn, x, rows)
    if rows is None:
        return x
    lead, want = tuple(x.shape[:-1]), tuple(rows.shape)
    if lead == want:
        return x[rows]
    if lead == want[:-1]:  # one row per sequence: no padding positions to drop
        return x
    raise ValueError(f"token_mask gave shape {want} but layer {fqn!r} reads an input of shape {tuple(x.shape)}: "
                     f"its leading dimensions must be the mask's {want} (or {want[:-1]}, one row per sequence)")


def _nested_rows(fqn: str, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A nested input as ``(tokens, K)`` rows: ``nn.TransformerEncoder`` in eval mode, called with a
    ``src_key_padding_mask``, hands its layers the real tokens of each sequence only (the padding
    dropped), which has no shape to reshape. The token mask ``rows`` cannot pick rows of it (its
    positions are the padded batch's): it must keep exactly as many tokens of each sequence as the
    nested input holds (the padding mask's complement does), and then every row counts; else
    ValueError naming the layer."""
    parts = x.unbind()
    if rows is not None:
        held = [t.numel() // max(1, t.shape[-1]) for t in parts]
        kept = rows.reshape(len(parts), -1).sum(1).tolist() if rows.dim() and rows.shape[0] == len(parts) else None
        if kept != held:
            raise ValueError(f"layer {fqn!r} reads a nested tensor (torch dropped the padding: nn.TransformerEncoder "
                             f"with src_key_padding_mask) of {held} tokens per sequence, but token_mask keeps "
                             f"{kept if kept is not None else f'a mask of shape {tuple(rows.shape)}'}: on such "
                             "a model token_mask can only keep the non-padding tokens (or leave it out)")
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in parts])


def _check_inputs(model: nn.Module, names: dict[nn.Module, str], batches, device,
                  token_mask: Callable | None = None) -> list[tuple[str, bool]]:
    """One forward pass over every batch (no statistics, nothing changed) that checks what
    layer-by-layer pruning would otherwise meet part way: every batch runs, ``token_mask``
    fits every ``names`` layer's input (:func:`_token_inputs`), every layer called gets rows.

    Returns ``(layer name, reads the same input tensor as the call before)`` for every call
    of the ``names`` layers in the forward pass of the first batch. Only the last input is
    held, so no activation beyond one is kept alive.
    """
    calls: list[tuple[str, bool]] = []
    last, rows, index = [None], [None], [0]
    counts: dict[str, int] = {}

    def record(mod, args, kwargs):
        fqn = names[mod]
        x = _layer_input(fqn, args, kwargs)
        if index[0] == 0:
            calls.append((fqn, x is last[0]))
            last[0] = x
        kept = _token_inputs(fqn, x, rows[0])   # (a nested x has no shape: its rows have)
        counts[fqn] = counts.get(fqn, 0) + kept.numel() // max(1, kept.shape[-1])
    handles = [mod.register_forward_pre_hook(record, with_kwargs=True) for mod in names]
    try:
        for index[0], b in enumerate(batches):
            _check_batch(b, index[0])
            try:
                if token_mask is not None:
                    rows[0] = _token_rows(token_mask(_to_device(b, device)))
                calibrate(model, [b], device=device, filter_fn=lambda mod, fqn: False,  # no statistics collected
                          progress=False)
            except Exception as e:
                raise with_context(e, f"batch {index[0]}: {e} (checked before pruning: nothing was changed)",
                                   f"prune_layerwise_: batch {index[0]} failed in the check before pruning "
                                   "(nothing was changed)")
            last[0] = None
    finally:
        for h in handles:
            h.remove()
    first = {fqn for fqn, _ in calls}
    later = [fqn for fqn in counts if fqn not in first]
    if later:  # (they were left dense, without a word, while their statistics were there)
        raise ValueError(f"layer(s) {later[:5]} run on later batches but not on the first: layer-by-layer pruning "
                         "takes its layers and their order from the first batch; put first a batch that runs every "
                         "layer to prune, or leave those out with filter_fn (nothing was changed)")
    empty = [fqn for fqn, c in counts.items() if c == 0]
    if empty:
        raise ValueError(f"layer(s) {empty} received no input rows from batches (token_mask keeps none of their "
                         "tokens): nothing to calibrate them on (nothing was changed)")
    return calls


def _layer_input(fqn: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """A Linear's input, given positionally or by name (``lin(input=x)``); TypeError naming the
    layer if it is not a tensor (the hooks run before the Linear could refuse it)."""
    x = args[0] if args else next(iter(kwargs.values()))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"layer {fqn!r} was called on a {type(x).__name__}, not a tensor")
    return x


def _check_batch(b, i: int) -> None:
    """TypeError naming batch ``i`` if it is, or directly holds, a numpy array: torch modules take
    tensors (the numpy array reached the layers' hooks, an AttributeError there)."""
    parts = b.items() if isinstance(b, Mapping) else enumerate(b) if isinstance(b, (tuple, list)) else [(None, b)]
    for k, v in parts:
        if isinstance(v, np.ndarray):
            raise TypeError(f"batch {i}{'' if k is None else f'[{k!r}]'} is a numpy.ndarray {v.shape}: batches hold "
                            "torch tensors (convert with torch.from_numpy)")


def _teacher_target(w: torch.Tensor, stats: LayerStats, percdamp: float = PERCDAMP,
                    shrink: float = 0.0) -> torch.Tensor:
    """The dense weight that best maps this layer's inputs to its teacher's outputs.

    Args:
        w: ``(R, C)`` the teacher's weight (the layer's dense weight).
        stats: the layer's :class:`LayerStats` from ``calibrate(..., teacher=)``.
        percdamp: ridge ``lam`` as a fraction of the mean diagonal of ``H = X^T X / tokens``
            (SparseGPT's damping).
        shrink: in [0, 1]: weight ``a`` of a second, synthetic set of inputs, independent
            channels with the measured variances ``D = diag(H)`` and the teacher's input equal
            to the layer's (so its target is ``W`` itself), mixed with ``1 - a`` of the measured ones.
    Returns:
        ``(R, C)`` ``W_t = argmin_V (1 - a) ||X V^T - X_t W^T||^2 / tokens + a (V - W) D (V - W)^T
        + lam ||V - W||^2`` in ``w``'s dtype: ``W_t^T = ((1 - a) H + a D + lam I)^-1 ((1 - a)
        X^T X_t / tokens + a D + lam I) W^T``. Both terms pull towards ``W``, so ``W_t = W`` when
        the inputs equal the teacher's.
    """
    if stats.xtx_teacher is None:
        raise ValueError("no teacher statistics: collect them with calibrate(..., teacher=)")
    hess = stats.hessian.to(device=w.device, dtype=torch.float64)
    H, _ = damped_hessian(hess, w.shape[1], percdamp, w.device, shrink)
    cross = stats.xtx_teacher.to(device=w.device, dtype=torch.float64) / max(stats.count, 1)
    # H - (1 - a) hess = a D + lam I (and 1 on never-firing inputs, which H treats the same way)
    rhs = (1 - shrink) * cross + H - (1 - shrink) * hess
    target = torch.linalg.solve(H, rhs @ w.detach().to(torch.float64).T).T
    return to_weight_dtype(target, w.dtype, "the weight fit to the teacher's outputs")


def _token_rows(rows) -> torch.Tensor:
    if not isinstance(rows, torch.Tensor) or rows.dtype.is_floating_point or rows.dtype.is_complex:
        raise TypeError(f"token_mask must return a bool (or 0/1 integer) tensor, got "
                        f"{getattr(rows, 'dtype', type(rows).__name__)}")
    if rows.dtype != torch.bool:
        if bool(((rows != 0) & (rows != 1)).any()):
            raise ValueError("token_mask returned an integer tensor with values other than 0 and 1")
        rows = rows.bool()
    return rows


def _to_device(b, device):
    if device is None:
        return b
    if isinstance(b, torch.Tensor):
        return b.to(device)
    if isinstance(b, KEYWORD_BATCH):
        return map_keyword_batch(b, lambda v: _to_device(v, device))
    if isinstance(b, (tuple, list)):
        return map_sequence_batch(b, lambda v: _to_device(v, device))
    return b

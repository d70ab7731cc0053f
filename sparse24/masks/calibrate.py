"""Model-wide calibration and layer-by-layer pruning: the statistics the
activation-aware methods need (:class:`LayerStats`), collected with forward
pre-hooks, and SparseGPT-style sequential pruning of a whole model."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .._checks import check_model
from .nm import METHODS, LayerStats, PruneResult, prune_nm

__all__ = ["calibrate", "prune_layerwise_"]


class _StopForward(Exception):
    """Raised by a calibration hook to end a forward pass early (``stop_early``)."""


def calibrate(model: nn.Module, batches, hessian: bool = False, filter_fn=None, device=None,
              dtype: torch.dtype = torch.float64, stop_early: bool = False,
              token_mask: Callable | None = None) -> dict[str, LayerStats]:
    """Run ``model`` on ``batches`` and collect per-input-channel statistics of every ``nn.Linear``.

    The model runs in eval mode under ``torch.no_grad()`` (its train/eval
    flags are restored afterwards) with forward pre-hooks that are removed
    afterwards, also on error.

    Args:
        model: any module containing ``nn.Linear`` layers.
        batches: iterable of tensors (``model(b)``), tuples/lists
            (``model(*b)``) or dicts (``model(**b)``).
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
    Returns:
        ``{fqn: LayerStats}`` for each Linear that saw at least one input,
        ``fqn`` as in ``model.named_modules()``.
    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> stats = calibrate(net, [torch.randn(32, 8)])
        >>> stats["2"].act_norm.shape
        torch.Size([16])
    """
    check_model(model, filter_fn)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    stats: dict[str, LayerStats] = {}

    def hook_for(fqn: str, k: int):
        def hook(mod, args):
            x = args[0].detach()
            if rows[0] is not None:
                if tuple(x.shape[:-1]) != tuple(rows[0].shape):
                    raise ValueError(f"token_mask gave shape {tuple(rows[0].shape)} but layer {fqn!r} reads an "
                                     f"input of shape {tuple(x.shape)}: it must match the leading dimensions")
                x = x[rows[0]]
            x = x.reshape(-1, k).to(dtype)
            s = stats.get(fqn)
            if s is None:
                s = stats[fqn] = LayerStats(torch.zeros(k, dtype=dtype, device=x.device), 0,
                                            torch.zeros(k, k, dtype=dtype, device=x.device) if hessian else None)
            s.sq_sum += (x * x).sum(0)
            s.count += x.shape[0]
            if s.xtx is not None:
                s.xtx.addmm_(x.t(), x)
            seen.add(fqn)
            if stop_early and len(seen) == len(handles):
                raise _StopForward
        return hook

    seen: set[str] = set()
    rows: list = [None]  # the current batch's token mask
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"token_mask must be callable (batch) -> bool tensor, got {type(token_mask).__name__}")

    handles, modes = [], [(mod, mod.training) for mod in model.modules()]
    try:
        for fqn, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and (filter_fn is None or filter_fn(mod, fqn)):
                handles.append(mod.register_forward_pre_hook(hook_for(fqn, mod.in_features)))
        model.eval()
        with torch.no_grad():
            for b in batches:
                b = _to_device(b, device)
                seen.clear()
                if token_mask is not None:
                    rows[0] = _token_rows(token_mask(b))
                try:
                    if isinstance(b, dict):
                        model(**b)
                    elif isinstance(b, (tuple, list)):
                        model(*b)
                    else:
                        model(b)
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
        for mod, training in modes:
            mod.training = training
    # A layer that only saw empty inputs has no statistics (all-zero norms would zero SparseGPT's weights).
    return {fqn: s for fqn, s in stats.items() if s.count > 0}


def prune_layerwise_(model: nn.Module, batches, n: int = 2, m: int = 4, method: str = "sparsegpt",
                     filter_fn=None, device=None, token_mask: Callable | None = None,
                     **kwargs) -> dict[str, PruneResult]:
    """Prune every ``nn.Linear`` of ``model`` to N:M in place, one layer at a time,
    each calibrated on the inputs it receives once the layers before it are pruned.

    This is how SparseGPT (and Wanda) prune a pretrained model: a layer's
    reconstruction then also absorbs the error of the earlier pruned layers.
    Layers run in the order of their first call in a forward pass of the first
    batch; each costs one more pass over ``batches``, shared by consecutive
    layers that read the same input tensor (a transformer's q, k, v), and cut
    short after the layer when every layer is called once per forward. The weights stay in the
    ``nn.Linear`` modules (zeros off the mask); convert them afterwards with
    ``sparse24.sparsify_(model)``, whose magnitude mask keeps exactly these
    non-zeros.

    Args:
        model: module with ``nn.Linear`` layers (``in_features % m == 0`` to be pruned).
        batches: a re-iterable collection (e.g. a list) of batches as in :func:`calibrate`.
        n, m: keep ``n`` of every ``m``.
        method: any :data:`METHODS` entry (``"sparsegpt"`` collects each layer's Hessian).
        filter_fn: optional ``(module, fqn) -> bool`` selecting layers.
        device, token_mask: passed to :func:`calibrate`.
        **kwargs: method options (``blocksize=``, ``percdamp=``, ``refit=``).
    Returns:
        ``{fqn: PruneResult}`` in pruning order.
    Example:
        >>> net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> results = prune_layerwise_(net, [torch.randn(64, 16)])
        >>> [round(r.kept_fraction, 1) > 0.5 for r in results.values()]
        [True, True]
    """
    check_model(model, filter_fn)
    if iter(batches) is batches:
        raise TypeError("batches must be re-iterable (a list or a DataLoader, not an iterator or generator): "
                        "every layer needs its own pass over them")
    if method not in METHODS:
        raise ValueError(f"unknown mask method {method!r}; choose one of {', '.join(METHODS)}")
    first = next(iter(batches), None)
    if first is None:
        raise ValueError("batches is empty: prune_layerwise_ needs calibration inputs")
    names = {mod: fqn for fqn, mod in model.named_modules()
             if isinstance(mod, nn.Linear) and mod.in_features % m == 0 and (filter_fn is None or filter_fn(mod, fqn))}
    # (layer, reads the same input tensor as the call before) in call order, first batch; only the
    # last input is held, so no activation beyond one is kept alive
    calls: list[tuple[str, bool]] = []
    last = [None]

    def record(mod, args):
        calls.append((names[mod], args[0] is last[0]))
        last[0] = args[0]
    handles = [mod.register_forward_pre_hook(record) for mod in names]
    try:
        # one batch, only to learn the call order (no statistics collected)
        calibrate(model, [first], device=device, filter_fn=lambda mod, fqn: False)
    finally:
        for h in handles:
            h.remove()
    once = len({fqn for fqn, _ in calls}) == len(calls)  # every layer called once per forward
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
    last[0] = None
    results: dict[str, PruneResult] = {}
    layers = dict(model.named_modules())
    for wave in waves:
        stats = calibrate(model, batches, hessian=method == "sparsegpt", device=device, stop_early=once,
                          filter_fn=lambda mod, name, wave=wave: name in wave, token_mask=token_mask)
        for fqn in wave:
            if fqn not in stats:
                raise ValueError(f"layer {fqn!r} received no input rows from batches: nothing to calibrate it on")
            lin = layers[fqn]
            r = prune_nm(lin.weight, n, m, method, calibration=stats[fqn], **kwargs)
            with torch.no_grad():
                lin.weight.copy_(r.weight)
            results[fqn] = r
    return results


def _token_rows(rows) -> torch.Tensor:
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.bool, torch.int64, torch.int32, torch.uint8):
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
    if isinstance(b, dict):
        return {k: _to_device(v, device) for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        return type(b)(_to_device(v, device) for v in b)
    return b

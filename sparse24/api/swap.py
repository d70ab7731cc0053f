"""Whole-model 2:4 sparsity: swap ``nn.Linear`` instances in place (layer 6; the
names are gathered in :mod:`sparse24.api`).

* :func:`sparsify_`: every eligible ``nn.Linear`` (and Hugging Face ``Conv1D``,
  GPT-2's Linear with a transposed weight) -> :class:`Sparse24Linear` (masked or
  compressed), with a :class:`SparsifyReport` of what was swapped, what was
  skipped and why (every other module holding a weight matrix included), and the
  weight bytes.
* :func:`compress_` / :func:`decompress_`: switch every ``Sparse24Linear``
  between masked (training) and compressed (inference) mode; outputs unchanged.
* :func:`densify_`: back to plain ``nn.Linear`` (or ``Conv1D``) holding the masked weights.
* :func:`prune_trained_model`: the ASP-style one call that prunes a trained
  model and leaves it, and its optimizer, ready to retrain with frozen masks.
* :func:`count_parameters`: parameter counts that mean the same in both modes.

All or nothing: each of these computes everything that can fail (masks,
compressed weights, new modules) before it changes the model; then the changes
(module swaps, mode switches, zeroing the pruned entries of shared weights in
place, the hooks that keep them masked, a transformers config's sparse24 section)
are one section, undone as a whole on any exception up to the return (Ctrl-C and
out of memory included). The pruned entries that sparsify_ zeroes in place are
copied to the CPU just before (half of each weight, see :func:`sparsify_`).
Frozen layers (``requires_grad=False``, as under PEFT) are sparsified and stay frozen.

Modules are swapped by assigning new children; classes are never patched.
Layers whose weight other code reads directly are handled explicitly:

* ``nn.MultiheadAttention`` reads ``out_proj.weight`` in its functional
  forward, and ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``
  through its first layer) read ``linear1/linear2.weight`` in their inference
  fast path. Masked mode serves them correctly: the stored weight is exactly
  zero where pruned and its gradient is masked from every use. Compressed mode
  has no dense weight to read, so these layers stay in masked mode (reported).
  Their own forward never runs, so a forward pre-hook on the parent re-zeroes their
  pruned entries after an in-place write outside an optimizer step (a re-init);
  inside ``nn.TransformerEncoderLayer`` it sits on the module above (see
  :func:`walk._sync_reader_hooks`; docs/modules.md).
* a weight shared with another module (tied embeddings) is skipped: masking it
  would silently prune the other module too.
* the output head of a language model (``skip_output_head=True``, the default)
  stays dense, as SparseGPT, Wanda and published 2:4 LLM checkpoints keep it.

On a model built on the meta device nothing is computed: layers get a pending
mask, filled in by ``load_state_dict`` from the dense weights (see
:mod:`sparse24.nn`). On a ``transformers`` model, each call also records the
sparse24 section of ``model.config`` that ``save_pretrained`` writes (see
:mod:`sparse24.hf`; ``transformers`` is never imported by this module itself).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import traceback
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._checks import check_finite, check_model, with_context
from .._rollback import TensorBackup
from ..format import Sparse24Tensor
from ..masks import kept_magnitude_fraction
from ..nn import Sparse24Linear
from ..nn.masking import note_replaced
from ..nn.prepare import (_check_mode, _linear_weight, _prepare, check_finite_bias, describe_quant, is_conv1d,
                          quant_options, sparser_note)
from .guard import check_calibration, record_after_change, require_sparse_layers
from .report import LayerReport, SparsifyReport
from ..masks.kept_dense import _is_linear, _kept_dense, _shared_weights
from .walk import (MIN_FEATURES, FilterFn, _after_change, _check_foreign_quantization, _child_slots, _direct_readers,
                   _entry, _load_hooks_reason, _not_handled, _skip_reason, _sync_reader_hooks, _Undo,
                   check_min_features)

__all__ = ["sparsify_", "densify_", "compress_", "decompress_", "prune_trained_model", "count_parameters",
           "SparsifyReport", "LayerReport", "MIN_FEATURES"]


# --- public API ------------------------------------------------------------------

def _frees_on_failure(call):
    """A whole-model call whose failure (after its undo) lets go of what it built: the exception's
    frames held every mask, compressed weight and rollback copy made so far (a notebook keeps the
    last exception, so a retry after running out of GPU memory ran out again). The frames' locals
    are cleared; the traceback's text is kept."""
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)
            raise
    return wrapper


@_frees_on_failure
def sparsify_(model: nn.Module, filter_fn: FilterFn | None = None, mode: str = "masked", method: str = "magnitude",
              calibration: dict | None = None, quantize: str | None = None, min_features: int = MIN_FEATURES,
              trainable_values: bool = False, skip_output_head: bool | str | Iterable[str] = True,
              optimizer: torch.optim.Optimizer | None = None, group_size: int | None = None,
              symmetric: bool | None = None, **mask_kwargs) -> SparsifyReport:
    """Swap every eligible ``nn.Linear`` (and Hugging Face ``Conv1D``) of ``model`` for a
    :class:`Sparse24Linear`, in place; all or nothing.

    Masked mode shares each ``nn.Linear``'s weight/bias Parameters (optimizers keep
    working) and zeroes the pruned weights in place; ``requires_grad`` is kept. On the
    meta device masks are pending until the weights are loaded (``load_state_dict``).

    Args:
        model: any ``nn.Module``.
        filter_fn: ``(module, fqn) -> bool``; only layers it accepts are swapped.
        mode: ``"masked"`` (retraining) or ``"compressed"`` (inference).
        method: mask method (``"magnitude"``, ``"2d_greedy"``, ``"2d_optimal"``,
            ``"wanda"``, ``"sparsegpt"``).
        calibration: ``{fqn: LayerStats}`` from ``sparse24.calibrate(model, batches)``
            (needed by ``"wanda"`` and ``"sparsegpt"``); ``calibration[fqn]`` goes to
            the mask method of layer ``fqn``. A key naming no layer of ``model``, or a layer
            to prune without its entry, is a ValueError naming them (``filter_fn`` leaves
            layers out).
        quantize: ``None``, ``"int8"`` or ``"int4"`` (compressed mode).
        min_features: skip layers with fewer input or output features.
        trainable_values: compressed mode: ``values`` require grad (frozen layers stay frozen).
        skip_output_head: ``True`` (default): keep the output head dense: the model's
            ``get_output_embeddings()`` where it has one (transformers), else one Linear with as
            many outputs as the input embedding has rows (the one tied to it, else the last); ``False``: prune it too; a layer name
            or a list of names: keep those.
        optimizer: masked mode only; an optimizer training the model: a layer whose weight becomes a new
            Parameter (a ``Conv1D``'s, stored transposed) is swapped in it, with its state
            transposed (see :func:`prune_trained_model`, which also zeroes the pruned state).
        group_size, symmetric: ``quantize="int4"`` only: scales per ``group_size`` input
            columns (32, 64, 128; default 128), zero points when ``symmetric=False``.
        **mask_kwargs: more options for the mask method.
    Returns:
        :class:`SparsifyReport` (``print(report)`` for a table), skipped layers and every
        module holding a weight matrix that is not handled (``nn.Embedding``, ``nn.Conv2d``, ...)
        with the reason.
    Raises:
        ValueError naming the layer, nothing changed: an inf/NaN weight or bias, calibration that does
        not fit the model, a mask method failing on a layer. Any exception (Ctrl-C, out of
        memory) leaves the model as it was.
    Memory: while the swapped layers' shared weights are pruned in place, the entries that
    pruning zeroes (half of each weight, and of a gradient it holds) are copied to the CPU, so
    that a failure can write them back; freed on return (and on failure). A SparseGPT weight
    (rewritten whole) is copied whole, and until the swap every reconstructed weight is held
    on its device beside the model's (a second copy of the pruned weights: on a GPU without
    room for it, prune layer by layer with ``prune_layerwise_``, then ``sparsify_``). Masked
    mode keeps a 1-byte mask per weight.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> report = sparsify_(model)
        >>> [r.fqn for r in report.swapped], [r.fqn for r in report.skipped]
        (['0'], ['2'])
    """
    return _sparsify(model, filter_fn, mode, method, calibration, quantize, min_features, trainable_values,
                     skip_output_head, optimizer, group_size, symmetric, mask_kwargs)


def _sparsify(model, filter_fn, mode, method, calibration, quantize, min_features, trainable_values, skip_output_head,
              optimizer, group_size, symmetric, mask_kwargs, zero_state: bool = False,
              operation: str = "sparsify_") -> SparsifyReport:
    """:func:`sparsify_`; ``zero_state``: also zero ``optimizer``'s state at the pruned entries (in
    the same undoable section, see :func:`prune_trained_model`); ``operation``: the report's."""
    check_model(model, filter_fn)
    quant = _check_mode(mode, quantize, trainable_values, group_size, symmetric)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer is not None and mode != "masked":
        # compressed layers hold new tensors (kept values), none of them the Parameters the optimizer trains
        raise ValueError(f"optimizer goes with mode='masked' (retraining keeps each weight Parameter); mode={mode!r} "
                         "makes new tensors: build the optimizer after sparsify_ (nothing was changed)")
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if calibration is not None and not isinstance(calibration, dict):
        raise TypeError(f"calibration must be a dict {{fqn: stats}} from sparse24.calibrate, "
                        f"got {type(calibration).__name__}")
    check_min_features(min_features)
    _check_foreign_quantization(model)
    heads = _kept_dense(model, skip_output_head)
    settings = {"mode": mode, "method": method, **quant}
    settings.update({k: v for k, v in (("calibration", calibration and "given"),) if v})
    report = SparsifyReport(operation, settings)
    slots, readers, shared = _child_slots(model), _direct_readers(model), _shared_weights(model)
    plan = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, Sparse24Linear):
            report.layers.append(_entry(fqn, mod, "skipped", "already a Sparse24Linear"))
        elif (line := _not_handled(fqn, mod)) is not None:
            report.layers.append(line)
        elif not _is_linear(mod):
            continue
        elif why := _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, heads, method, calibration):
            report.layers.append(_entry(fqn, mod, "skipped", why))
        else:
            plan.append((fqn, mod))
    check_calibration(model, calibration, method, [fqn for fqn, _ in plan])
    # 1. Compute every mask (and compressed weight) and build every new module: nothing changes yet.
    built = []
    for fqn, mod in plan:
        note = readers.get(id(mod), "")
        layer_mode = "masked" if note else mode
        if note and mode == "compressed":
            note = f"kept in masked mode: {note}"
        train_values = bool(trainable_values) and layer_mode == "compressed"
        try:
            work = _prepare(mod, None, layer_mode, method, quant if layer_mode == "compressed" else {},
                            None if calibration is None else calibration.get(fqn), train_values, mask_kwargs)
            new = Sparse24Linear._empty()._adopt(mod, work, train_values, finish=False)
        except (ValueError, TypeError) as e:
            raise with_context(e, f"sparsify_: layer {fqn!r}: {e} (nothing was changed)",
                               f"sparsify_: layer {fqn!r} (nothing was changed)")
        if work.pending is not None:
            kept = None
            note = "; ".join(filter(None, [note, f"mask pending (meta device): computed by {method!r} when "
                                                 "load_state_dict brings the weights"]))
        else:  # of the weight before pruning
            kept = kept_magnitude_fraction(_linear_weight(mod), work.mask)
            note = "; ".join(filter(None, [note, sparser_note(work.mask)]))
        built.append((fqn, mod, new, note, kept))
    moves = _optimizer_moves(optimizer, [(mod, new) for _, mod, new, _, _ in built]) if optimizer is not None else []
    # 2. Swap, 3. prune the shared weights in place (the entries overwritten are kept first) and register the
    # masking, 4. record the config: one section, undone as a whole on any failure up to the return.
    with _changing(model) as undo:
        for _, mod, new, _, _ in built:
            undo.replace(slots, mod, new)
            _note_replaced(mod, new, undo)
        for move in moves:
            move(undo)
        overwritten = TensorBackup()
        undo.add(overwritten.restore)
        for fqn, mod, new, note, kept in built:
            _prune_in_place(new, mod, overwritten, undo, optimizer if zero_state else None)
            report.layers.append(_entry(fqn, new, "swapped", note))
            report.layers[-1].kept_fraction = kept
    return report


def _prune_in_place(new: Sparse24Linear, old: nn.Module, overwritten: TensorBackup, undo: _Undo,
                    optimizer: torch.optim.Optimizer | None) -> None:
    """``new._finish()`` (prune the weight it shares with ``old``, and its gradient, in place; register
    the masking), undoable: what it overwrites is kept in ``overwritten`` first and ``undo`` releases
    ``new``. With ``optimizer``, also zero the weight's optimizer state at the pruned entries (kept alike)."""
    new_w, mask = new.__dict__.get("_finish_args") or (None, None)
    if mask is None:  # compressed: nothing shared to prune, no masking to register
        new._finish()
        return
    w = new.weight
    shared = w is old.weight  # else a new Parameter (Conv1D's transposed weight), its optimizer state new too
    state = [v for v in (optimizer.state.get(w, {}).values() if optimizer is not None else ())
             if isinstance(v, torch.Tensor) and v.shape == mask.shape]
    if shared:
        if new_w is None:
            overwritten.keep_pruned([w], mask)
        else:  # SparseGPT's rebuilt weight replaces every entry
            overwritten.keep([w])
        overwritten.keep_pruned([t for t in (w.grad, *state) if t is not None], mask)
    undo.add(new._release)
    new._finish()
    with torch.no_grad():
        for v in state:
            v.masked_fill_(~mask, 0)


def _note_replaced(old: nn.Module, new: Sparse24Linear, undo: _Undo) -> None:
    """Where the swap takes a ``Conv1D`` out of the model for a masked layer (a new, transposed weight
    Parameter), record its weight, so that an optimizer still stepping it is refused at its step
    (:mod:`..nn.masking`); undoable. Only a swap records it: a layer merely built from a Conv1D
    (``from_linear``) leaves the Conv1D the model's, its weight the one to train."""
    if not (is_conv1d(old) and new.mode == "masked"):
        return
    undo.add(note_replaced(old.weight, old.bias))


def _optimizer_moves(optimizer, pairs) -> list[Callable[[_Undo], None]]:
    """Where a swap gives a layer a new weight Parameter (Conv1D: stored transposed), the
    steps that hand the optimizer the new Parameter and its state (transposed copies,
    computed now) in place of the old one's."""
    index = {id(p): (group, i) for group in optimizer.param_groups for i, p in enumerate(group["params"])}
    moves = []
    for old_layer, new in pairs:
        old, w = old_layer.weight, new.weight
        if w is old or id(old) not in index:
            continue
        group, i = index[id(old)]
        state = {k: (v.t().contiguous() if isinstance(v, torch.Tensor) and v.shape == old.shape and v.dim() == 2
                     else v) for k, v in optimizer.state.get(old, {}).items()}

        def move(undo, group=group, i=i, old=old, w=w, state=state):
            group["params"][i] = w
            undo.add(lambda: group["params"].__setitem__(i, old))
            if old in optimizer.state:
                # the old Parameter is in no group now: a stale entry breaks optimizer.state_dict() (KeyError)
                # and keeps the dense weight and its moments alive
                old_state = optimizer.state.pop(old)
                undo.add(lambda: optimizer.state.__setitem__(old, old_state))
                optimizer.state[w] = state
                undo.add(lambda: optimizer.state.pop(w, None))
        moves.append(move)
    return moves


@contextlib.contextmanager
def _changing(model: nn.Module):
    """The changing section of a whole-model call: yields an :class:`_Undo` the section records its
    changes in, then puts the forward pre-hooks that keep directly read masked weights masked where
    they are needed (and only there, see :func:`walk._sync_reader_hooks`), runs ``_after_change``
    (hooks, a transformers config's sparse24 section) at its end, and on any exception up to there
    undoes everything, the config's state included."""
    undo = _Undo()
    undo.add(record_after_change(model))  # undone last, once the layers are back
    try:
        yield undo
        _sync_reader_hooks(model, undo)
        _after_change(model)
    except BaseException:
        undo.undo()
        raise


def _refuse_reparametrized(who: str, layers: list[tuple[str, Sparse24Linear]], bias: bool = False) -> None:
    """ValueError naming the first of ``layers`` whose weight (compressed: ``values``), or with ``bias``
    its bias, is reparametrized (``torch.nn.utils.parametrize``, or the forward pre-hooks of
    ``torch.nn.utils.prune`` and the old ``weight_norm`` / ``spectral_norm``): a mode switch would
    leave the dense original behind (held, saved, in the way of ``decompress_``), and ``densify_``
    finds no Parameter to hand over."""
    for fqn, m in layers:
        hooks = {getattr(h, "_tensor_name", getattr(h, "name", None)): type(h).__name__
                 for h in m._forward_pre_hooks.values()}
        for name in ("weight" if m.mode == "masked" else "values", "bias")[:2 if bias else 1]:
            if parametrize.is_parametrized(m, name):
                by, how = "torch.nn.utils.parametrize", f"parametrize.remove_parametrizations(layer, {name!r})"
            elif name in hooks and name not in m._parameters:
                by, how = f"a {hooks[name]} forward pre-hook", "torch.nn.utils.prune.remove(layer, name), " \
                                                              "remove_weight_norm or remove_spectral_norm"
            else:
                continue
            raise ValueError(f"{who}: layer {fqn!r}: its {name!r} is reparametrized by {by}, whose original "
                             f"tensors {who} would leave behind: remove it first ({how}) (nothing was changed)")


def _sparse_layers(model: nn.Module) -> list[tuple[str, Sparse24Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)]


def _switch_all(model: nn.Module, steps: list[tuple[Sparse24Linear, Callable[[], object]]],
                report_of: Callable[[], SparsifyReport]) -> SparsifyReport:
    """compress_ / decompress_'s changing section: run each ``(layer, switch)``, then make the report;
    any failure up to the return puts every layer reached back as it was."""
    with _changing(model) as undo:
        for m, switch in steps:
            undo.add(lambda m=m, snap=m._snapshot(): m._restore(snap))
            switch()
        report = report_of()
    return report


@_frees_on_failure
def compress_(model: nn.Module, quantize: str | None = None, trainable_values: bool = False, *,
              group_size: int | None = None, symmetric: bool | None = None, packed: dict | None = None
              ) -> SparsifyReport:
    """Switch every masked :class:`Sparse24Linear` of ``model`` to compressed mode; all or nothing.

    Outputs do not change (unless ``quantize`` is set). Layers whose weight is
    read directly by their parent (``nn.MultiheadAttention.out_proj``, ...)
    stay masked and are reported as skipped. The dense weight Parameters are
    dropped: build a new optimizer if you train afterwards.

    Args:
        model: a model prepared by :func:`sparsify_`.
        quantize: ``None``, ``"int8"`` or ``"int4"``.
        trainable_values: the compressed ``values`` require grad (frozen layers stay frozen).
        group_size, symmetric: INT4 only: 32, 64 or 128 input columns per fp16 scale
            (default 128); ``symmetric=False`` adds uint8 zero points (default True).
        packed: ``{layer name: Sparse24Tensor}`` (or results with a ``.packed`` one, as
            ``prune_layerwise_(..., quantize="int4")`` returns): quantized weights to store
            as they are for those masked layers instead of rounding their weight again
            (a second rounding would lose the joint SparseGPT + GPTQ grid). Each must be
            quantized as ``quantize`` / ``group_size`` / ``symmetric`` say and dequantize
            exactly to the layer's current masked weight.
    Returns:
        :class:`SparsifyReport`.
    Raises:
        ValueError (nothing changed): the model has no ``Sparse24Linear`` (never sparsified:
        compressing it would silently do nothing), a masked layer's weight or a layer's bias holds
        inf/NaN, a layer is reparametrized (``torch.nn.utils.parametrize``, ``prune``,
        ``weight_norm``: remove it first).
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); _ = sparsify_(model)
        >>> compress_(model).changed[0].mode
        'compressed'
    """
    check_model(model, None)
    quant = _check_mode("compressed", quantize, trainable_values, group_size, symmetric)
    require_sparse_layers(model, "compress_")
    layers, readers = _sparse_layers(model), _direct_readers(model)
    for fqn, m in layers:  # refuse before changing anything
        if m.mode == "compressed" and m._quant() != quant:
            raise ValueError(f"layer {fqn!r} is already compressed with {describe_quant(m._quant())}; "
                             f"decompress_ first to re-compress with {describe_quant(quant)}")
    given = _check_packed(packed, layers, readers, quant)
    todo = [(fqn, m) for fqn, m in layers if id(m) not in readers
            and not (m.mode == "compressed" and trainable_values == m.values.requires_grad)]
    _refuse_reparametrized("compress_", todo)
    # Compress every masked layer first, so a failing one (e.g. inf weights with int8) leaves the model untouched.
    packed = {}
    for fqn, m in todo:
        try:
            if m.mode == "masked":
                check_finite(m.weight)
            check_finite_bias(m.bias)
            packed[fqn] = given[fqn] if fqn in given else m._compressed_form(quant)
        except (ValueError, TypeError) as e:
            raise with_context(e, f"compress_: layer {fqn!r}: {e} (nothing was changed)",
                               f"compress_: layer {fqn!r} (nothing was changed)")
    def report_of() -> SparsifyReport:
        report = SparsifyReport("compress_", quant)
        for fqn, m in layers:
            if id(m) in readers:
                report.layers.append(_entry(fqn, m, "skipped", f"kept in masked mode: {readers[id(m)]}"))
            elif fqn not in packed:
                report.layers.append(_entry(fqn, m, "skipped", "already compressed"))
            else:
                report.layers.append(_entry(fqn, m, "compressed"))
        return report
    return _switch_all(model, [(m, lambda m=m, p=packed[fqn]: m._set_compressed(p, trainable_values,
                                                                                  m._requires_grad()))
                               for fqn, m in layers if fqn in packed], report_of)


def _check_packed(packed: dict | None, layers: list, readers: dict, quant: dict) -> dict:
    """compress_'s ``packed``: every entry names a masked layer it can take as it is (see compress_)."""
    if packed is None:
        return {}
    if not isinstance(packed, dict):
        raise TypeError(f"packed must be a dict of layer name -> Sparse24Tensor, got {type(packed).__name__}")
    masked = {fqn: m for fqn, m in layers if m.mode == "masked" and id(m) not in readers}
    out = {}
    for fqn, p in packed.items():
        p = getattr(p, "packed", p)
        where = f"compress_: packed[{fqn!r}]"
        if fqn not in masked:
            raise ValueError(f"{where}: no masked 2:4 layer of that name can take it (nothing was changed)")
        if not isinstance(p, Sparse24Tensor):
            raise TypeError(f"{where}: needs a Sparse24Tensor, got {type(p).__name__} (nothing was changed)")
        got = quant_options(p.quantized, p.group_size, None if p.group_size is None else p.zero is None)
        if got != quant:
            raise ValueError(f"{where} is {describe_quant(got)}, compress_ was asked for {describe_quant(quant)} "
                             "(nothing was changed)")
        m = masked[fqn]
        if tuple(p.shape) != (m.out_features, m.in_features) or p.device != m.weight.device \
                or not torch.equal(p.to_dense().to(m.weight.dtype), m.dense_weight()):
            raise ValueError(f"{where} does not dequantize to the layer's masked weight (another model, or the "
                             "layer changed since it was pruned) (nothing was changed)")
        out[fqn] = p if p.dtype == m.dtype else p.to(dtype=m.dtype)
    return out


@_frees_on_failure
def decompress_(model: nn.Module) -> SparsifyReport:
    """Switch every compressed :class:`Sparse24Linear` of ``model`` back to masked
    mode (outputs unchanged; new weight Parameters, trainable again unless frozen); all or nothing.

    Returns:
        :class:`SparsifyReport`.
    Raises:
        ValueError: the model has no ``Sparse24Linear`` (nothing to switch).
    """
    check_model(model, None)
    require_sparse_layers(model, "decompress_")
    todo = [(fqn, m) for fqn, m in _sparse_layers(model) if m.mode == "compressed"]
    _refuse_reparametrized("decompress_", todo)

    def report_of() -> SparsifyReport:
        report = SparsifyReport("decompress_")
        report.layers += [_entry(fqn, m, "decompressed") for fqn, m in todo]
        return report
    return _switch_all(model, [(m, m.to_masked) for _, m in todo], report_of)


@_frees_on_failure
def densify_(model: nn.Module) -> SparsifyReport:
    """Replace every :class:`Sparse24Linear` by a plain ``nn.Linear`` (the class
    it came from; ``Conv1D`` for GPT-2's) holding the masked dense weight; outputs unchanged.

    Masked-mode ``nn.Linear`` layers hand over their weight and bias Parameters (an
    optimizer keeps working, now without the mask); the others get new dense weights.

    Returns:
        :class:`SparsifyReport`.
    Raises:
        ValueError (nothing changed): the model has no ``Sparse24Linear`` (nothing to switch), a
        layer's weight or bias is reparametrized (``torch.nn.utils.parametrize``, ``prune``,
        ``weight_norm``: remove it first), a layer has load_state_dict pre-hooks (they were registered
        for its 2:4 entries; a swap would drop them: remove them first).
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); _ = sparsify_(model)
        >>> _ = densify_(model); type(model[0]).__name__
        'Linear'
    """
    check_model(model, None)
    require_sparse_layers(model, "densify_")
    report = SparsifyReport("densify_")
    slots = _child_slots(model)
    layers = _sparse_layers(model)
    if any(not fqn for fqn, _ in layers):
        raise ValueError("the model itself is a Sparse24Linear: nothing holds it to swap; "
                         "use model.to_dense_module()")
    _refuse_reparametrized("densify_", layers, bias=True)
    for fqn, m in layers:   # (sparsify_ leaves such a layer dense; this way back refuses rather than drop them)
        if _load_hooks_reason(m):
            raise ValueError(f"densify_: layer {fqn!r} has load_state_dict pre-hooks, registered for its 2:4 "
                             "entries, which the dense layer put in its place would not have: remove them first "
                             "(nothing was changed)")
    built = [(fqn, m, m.to_dense_module(release=False)) for fqn, m in layers]
    # Swap, stop masking the handed-over weights, record the config: undone as a whole on any failure up to the
    # return (a layer not released yet would go on masking its weight, now a dense layer's).
    with _changing(model) as undo:
        for _, m, dense in built:
            undo.replace(slots, m, dense)
        for fqn, m, dense in built:
            undo.add(lambda m=m, snap=m._snapshot(): m._restore(snap))
            m._release()
            report.layers.append(_entry(fqn, dense, "densified"))
    return report


@_frees_on_failure
def prune_trained_model(model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> SparsifyReport:
    """Prune a trained model to 2:4 and leave it ready to retrain with the masks frozen; all or nothing.

    The ASP-style one call: :func:`sparsify_` in masked mode (same Parameter
    objects, so ``optimizer`` keeps training them; a ``Conv1D``'s transposed weight
    is a new Parameter, which the optimizer gets in place of the old one, with its
    state transposed), then the optimizer's per-parameter state (momentum, Adam
    moments) is zeroed at the pruned positions so the retraining starts as if those
    weights never existed. Afterwards every ``optimizer.step()`` keeps the pruned
    weights at exactly 0.

    Args:
        model: a trained model.
        optimizer: the ``torch.optim.Optimizer`` that trains it (state kept).
        **kwargs: :func:`sparsify_` options (``filter_fn``, ``method``,
            ``calibration``, ``min_features``, ``skip_output_head``...); ``mode`` is always masked.
    Returns:
        :class:`SparsifyReport`.
    Memory: as :func:`sparsify_`, plus, during the call, the pruned half of every optimizer
    state tensor shaped like a weight (Adam: two per weight) copied to the CPU, so that a
    failure can write it back.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); opt = torch.optim.AdamW(model.parameters())
        >>> len(prune_trained_model(model, opt).swapped)
        1
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if kwargs.get("mode", "masked") != "masked" or kwargs.get("quantize") is not None:
        raise ValueError("prune_trained_model retrains in masked mode; compress_ after retraining")
    kwargs.pop("mode", None)
    args = inspect.signature(sparsify_).bind(model, mode="masked", optimizer=optimizer, **kwargs)
    args.apply_defaults()
    options = dict(args.arguments)
    # the optimizer state is zeroed in sparsify_'s undoable section (a failure puts it back too)
    return _sparsify(**options, zero_state=True, operation="prune_trained_model")


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts that mean the same in masked and compressed mode.

    ``model.parameters()`` (and transformers' ``num_parameters()``) count Parameters
    only: a masked layer's dense weight counts fully (pruned zeros included), a
    compressed one only its ``values`` tensor, whose size depends on the storage (16-bit
    and INT8 layout v1: the kept half, R*C/2; INT4: two codes per byte, R*C/4; the decode
    layout held on CUDA: padded to 128 rows and whole 64-column atoms, so it can exceed
    R*C on small layers), so that number changes with :func:`compress_` without the model
    changing. ``dense`` and ``nonzero`` do not depend on the storage.

    Returns:
        ``{"parameters": numel of model.parameters(), "dense": the count as if every 2:4
        layer were dense (R*C each), "nonzero": the count with every 2:4 layer's pruned
        half removed (R*C/2 each)}``.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); _ = sparsify_(model)
        >>> count_parameters(model)
        {'parameters': 4160, 'dense': 4160, 'nonzero': 2112}
    """
    check_model(model, None)
    total = sum(p.numel() for p in model.parameters())
    dense = nonzero = total
    for m in {id(m): m for m in model.modules() if isinstance(m, Sparse24Linear)}.values():
        RC = m.out_features * m.in_features
        held = sum(p.numel() for name, p in m._parameters.items() if name in ("weight", "values") and p is not None)
        dense += RC - held
        nonzero += RC // 2 - held
    return {"parameters": total, "dense": dense, "nonzero": nonzero}

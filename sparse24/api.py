"""Whole-model 2:4 sparsity: swap ``nn.Linear`` instances in place (layer 5).

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
compressed weights, new modules) before it changes the model, and undoes its
module swaps if one fails; the one step left after that, zeroing the pruned
entries of shared weights in place, cannot fail short of running out of memory.
Frozen layers (``requires_grad=False``, as under PEFT) are sparsified and stay frozen.

Modules are swapped by assigning new children; classes are never patched.
Layers whose weight other code reads directly are handled explicitly:

* ``nn.MultiheadAttention`` reads ``out_proj.weight`` in its functional
  forward, and ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``
  through its first layer) read ``linear1/linear2.weight`` in their inference
  fast path. Masked mode serves them correctly: the stored weight is exactly
  zero where pruned and its gradient is masked from every use. Compressed mode
  has no dense weight to read, so these layers stay in masked mode (reported).
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

import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ._checks import check_model
from .masks import kept_magnitude_fraction
from .nn import Sparse24Linear, compressed_nbytes, is_conv1d, linear_shape, memory_nbytes
from .nn.prepare import _check_mode, _linear_weight, _prepare

__all__ = ["sparsify_", "densify_", "compress_", "decompress_", "prune_trained_model", "count_parameters",
           "SparsifyReport", "LayerReport"]

FilterFn = Callable[[nn.Module, str], bool]
# Smaller layers are skipped: under 32 input columns the packed metadata word
# is partly padding, and a layer that small costs less than one kernel launch.
MIN_FEATURES = 32
# Mask methods that need per-layer calibration statistics.
_CALIBRATED_METHODS = ("wanda", "sparsegpt")
# Parents that read these children's `.weight` directly instead of calling them.
_DIRECT_READERS = {
    nn.MultiheadAttention: ("out_proj", "nn.MultiheadAttention reads out_proj.weight in its functional forward"),
    nn.TransformerEncoderLayer: ("linear1", "linear2",
                                 "nn.TransformerEncoderLayer reads linear1/linear2.weight in its inference fast path"),
}
_SWAPPABLE = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)
_CONV = "a convolution: sparse24's layers and kernels are matmuls (nn.Linear, transformers Conv1D); 2:4 " \
        "convolutions are not implemented"
# Why modules that hold a weight matrix but are no Linear are left alone (checked in this order).
_NOT_HANDLED = (
    ((nn.Embedding, nn.EmbeddingBag), "a lookup table, not a matmul: 2:4 would speed nothing up"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), _CONV),
    ((nn.MultiheadAttention,), "its in_proj_weight is used inside F.multi_head_attention_forward, not by a "
                               "Linear (its out_proj is handled)"),
    ((nn.RNNBase,), "recurrent weights are used inside the fused RNN kernel, not by a Linear"),
    ((nn.Bilinear,), "a bilinear form, not a Linear"),
)


@dataclass
class LayerReport:
    """One layer's line in a :class:`SparsifyReport`.

    Attributes:
        fqn: name in ``model.named_modules()``.
        shape: ``(out_features, in_features)`` (for a module that is not handled: its weight's shape).
        dtype: weight dtype.
        action: what happened: ``"swapped"``, ``"compressed"``, ``"decompressed"``,
            ``"densified"`` or ``"skipped"``.
        mode: the layer's mode afterwards (None for dense layers).
        reason: why it was skipped, or a note.
        dense_bytes: the dense weight's bytes.
        compressed_bytes: the weight's bytes once compressed (values + 2-bit indices + INT8 scales).
        memory_bytes: the weight's bytes as held now (masked mode: dense weight + 1-byte mask).
        kept_fraction: ``sparsify_`` only: fraction of the original ``sum |W|`` the mask
            keeps (see :func:`sparse24.masks.kept_magnitude_fraction`), to compare methods;
            None while the mask is pending (meta device).
    """
    fqn: str
    shape: tuple
    dtype: torch.dtype
    action: str
    mode: str | None = None
    reason: str = ""
    dense_bytes: int = 0
    compressed_bytes: int = 0
    memory_bytes: int = 0
    kept_fraction: float | None = None


@dataclass
class SparsifyReport:
    """What a whole-model operation did; ``str(report)`` is a readable table.

    Attributes:
        operation: ``"sparsify_"``, ``"compress_"``, ...
        settings: the options used.
        layers: one :class:`LayerReport` per layer considered.
    """
    operation: str
    settings: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)

    @property
    def changed(self) -> list:
        return [r for r in self.layers if r.action != "skipped"]

    @property
    def swapped(self) -> list:
        """Layers this call converted (for sparsify_: swapped to Sparse24Linear)."""
        return self.changed

    @property
    def skipped(self) -> list:
        return [r for r in self.layers if r.action == "skipped"]

    def _total(self, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.changed)

    @property
    def dense_bytes(self) -> int:
        return self._total("dense_bytes")

    @property
    def compressed_bytes(self) -> int:
        return self._total("compressed_bytes")

    @property
    def memory_bytes(self) -> int:
        return self._total("memory_bytes")

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        lines = [f"sparse24.{self.operation}({opts}): {len(self.changed)} layer(s) changed, "
                 f"{len(self.skipped)} skipped"]
        if self.changed:
            w = max(len("layer"), *(len(r.fqn) for r in self.changed))
            kept = any(r.kept_fraction is not None for r in self.changed)
            lines.append(f"  {'layer':<{w}}  {'shape':>12}  {'dtype':>9}  {'mode':>10}  {'dense B':>10}  "
                         f"{'now B':>10}  {'2:4 B':>10}" + ("  kept |W|" if kept else ""))
            for r in self.changed:
                frac = "" if not kept else f"  {r.kept_fraction:>8.4f}" if r.kept_fraction is not None else \
                    f"  {'-':>8}"
                lines.append(f"  {r.fqn:<{w}}  {str(r.shape):>12}  {str(r.dtype)[6:]:>9}  {r.mode or 'dense':>10}  "
                             f"{r.dense_bytes:>10}  {r.memory_bytes:>10}  {r.compressed_bytes:>10}" + frac
                             + (f"  ({r.reason})" if r.reason else ""))
            d, c, m = self.dense_bytes, self.compressed_bytes, self.memory_bytes
            note = "; masked mode holds the dense weight + a 1-byte mask for training" if any(
                r.mode == "masked" for r in self.changed) else ""
            lines.append(f"  weights: {d} B dense -> {c} B compressed ({100 * c / max(d, 1):.1f}%); "
                         f"held now: {m} B ({100 * m / max(d, 1):.1f}%{note})")
        if self.skipped:
            lines.append("  skipped:")
            w = max(len(r.fqn) for r in self.skipped)
            lines += [f"    {r.fqn:<{w}}  {str(r.shape):>12}  {r.reason}" for r in self.skipped]
        return "\n".join(lines)


# --- walking a model --------------------------------------------------------------

def _child_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) -> every (parent, attribute name) holding it (a module may be reused)."""
    slots: dict[int, list] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                slots.setdefault(id(child), []).append((parent, name))
    return slots


def _set_child(parent: nn.Module, name: str, new: nn.Module) -> None:
    setattr(parent, name, new)


class _Undo:
    """Changes to a model that can be taken back: each step records its inverse."""

    def __init__(self):
        self._steps: list[Callable[[], None]] = []

    def replace(self, slots, old: nn.Module, new: nn.Module) -> None:
        """Put ``new`` in every slot holding ``old``."""
        for parent, name in slots[id(old)]:
            self._steps.append(lambda parent=parent, name=name: parent._modules.__setitem__(name, old))
            _set_child(parent, name, new)

    def add(self, inverse: Callable[[], None]) -> None:
        self._steps.append(inverse)

    def undo(self) -> None:
        for step in reversed(self._steps):
            step()
        self._steps.clear()


def _direct_readers(model: nn.Module) -> dict[int, str]:
    """id(child Linear) -> why its weight is read directly by its parent."""
    out = {}
    for mod in model.modules():
        for cls, (*names, why) in _DIRECT_READERS.items():
            if isinstance(mod, cls):
                for n in names:
                    out[id(getattr(mod, n))] = why
    return out


def _shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the qualified names it is registered under, for parameters registered twice or more."""
    names: dict[int, list[str]] = {}
    for fqn, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{fqn}.{pname}" if fqn else pname)
    return {k: v for k, v in names.items() if len(v) > 1}


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or is_conv1d(mod)


def _input_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The token embedding: the model's ``get_input_embeddings()`` (transformers), else its
    largest ``nn.Embedding`` (position and type embeddings are smaller than a vocabulary)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
    tables = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if isinstance(emb, nn.Embedding):
        return next(((fqn, m) for fqn, m in tables if m is emb), None)
    return max(tables, key=lambda t: t[1].num_embeddings, default=None)


def _output_heads(model: nn.Module, skip_output_head) -> dict[int, str]:
    """id(layer) -> why it is kept dense as the output head."""
    if skip_output_head is False or skip_output_head is None:
        return {}
    if skip_output_head is not True:
        names = [skip_output_head] if isinstance(skip_output_head, str) else list(skip_output_head)
        modules = dict(model.named_modules())
        out = {}
        for name in names:
            if not isinstance(name, str) or not _is_linear(modules.get(name)):
                raise ValueError(f"skip_output_head names {name!r}, which is no nn.Linear (or Conv1D) of the model")
            out[id(modules[name])] = "named by skip_output_head"
        return out
    keep = "kept dense, as LLM pruning does (SparseGPT, Wanda); skip_output_head=False prunes it"
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):  # a transformers model names its head (None: it has none)
        head = get()
        return {id(head): f"output head (the model's get_output_embeddings()): {keep}"} if _is_linear(head) else {}
    found = _input_embedding(model)
    if found is None:
        return {}
    name, emb = found
    return {id(mod): f"output head ({emb.num_embeddings} outputs = the vocabulary of the input embedding {name!r}): "
                     f"{keep}" for mod in model.modules()
            if _is_linear(mod) and linear_shape(mod)[0] == emb.num_embeddings}


def _entry(fqn: str, mod: nn.Module, action: str, reason: str = "") -> LayerReport:
    R, C = linear_shape(mod)
    if isinstance(mod, Sparse24Linear):
        dtype, mode = mod.dtype, mod.mode
        elt = torch.empty(0, dtype=dtype).element_size()
        comp, mem = compressed_nbytes(R, C, elt, mod.quantize == "int8"), memory_nbytes(mod)
    else:
        dtype, mode = mod.weight.dtype, None
        elt = mod.weight.element_size()
        comp = compressed_nbytes(R, C, elt) if C % 4 == 0 else 0
        mem = mod.weight.numel() * elt
    return LayerReport(fqn, (R, C), dtype, action, mode, reason, R * C * elt, comp, mem)


def _not_handled(fqn: str, mod: nn.Module) -> LayerReport | None:
    """A report line for a module owning a weight matrix that sparsify_ leaves alone, else None."""
    if _is_linear(mod) or isinstance(mod, Sparse24Linear):
        return None
    mats = [(n, p) for n, p in mod._parameters.items() if p is not None and p.dim() >= 2]
    if not mats:
        return None
    pname, p = mats[0]
    why = next((why for types, why in _NOT_HANDLED if isinstance(mod, types)),
               f"holds a weight matrix ({pname!r}) but is no nn.Linear or transformers Conv1D")
    return LayerReport(fqn, tuple(p.shape), p.dtype, "skipped", reason=f"not handled: {type(mod).__name__}: {why}")


def _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, heads, method, calibration) -> str:
    """Why ``mod`` (an nn.Linear or Conv1D) cannot be swapped, or "" if it can."""
    if not fqn:
        return "the model itself is this Linear (no parent to swap it in); use Sparse24Linear.from_linear"
    if type(mod) not in _SWAPPABLE and not (is_conv1d(mod) and type(mod).__name__ == "Conv1D"):
        if torch.nn.utils.parametrize.is_parametrized(mod):
            return "weight is parametrized (e.g. SR-STE, weight_norm); remove the parametrization first"
        return f"{type(mod).__name__} subclasses nn.Linear and may change its forward; not swapped"
    if filter_fn is not None and not filter_fn(mod, fqn):
        return "excluded by filter_fn"
    R, C = linear_shape(mod)
    if C % 4:
        return f"in_features={C} is not divisible by 4"
    if min(R, C) < min_features:
        return f"smaller than min_features={min_features} ({R}x{C}): too small to gain"
    if not mod.weight.is_floating_point():
        return f"weight dtype {mod.weight.dtype} is not floating point"
    if id(mod.weight) in shared:
        others = [n for n in shared[id(mod.weight)] if n != f"{fqn}.weight"]
        return f"weight is shared with {', '.join(others)} (tied): pruning it would also prune those"
    if id(mod) in heads:
        return heads[id(mod)]
    if method in _CALIBRATED_METHODS and calibration is not None and fqn not in calibration:
        why = (f"{readers[id(mod)]}, so calibrate() never sees its input" if id(mod) in readers
               else "was it run during calibrate()?")
        return f"no calibration statistics for this layer (method={method!r}): {why}"
    return ""


# --- Hugging Face models (transformers is imported by the caller, never here) ---------

def _is_transformers_model(model: nn.Module) -> bool:
    utils = sys.modules.get("transformers.modeling_utils")
    return utils is not None and isinstance(model, utils.PreTrainedModel)


def _check_foreign_quantization(model: nn.Module) -> None:
    """A transformers model quantized by another method cannot also carry sparse24's config section."""
    if not _is_transformers_model(model):
        return
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if qc is not None and method != "sparse24":
        raise ValueError(f"the model is already quantized with {method!r}: its config.json cannot describe 2:4 "
                         f"layers as well, so save_pretrained would lose them (nothing was changed)")


def _after_change(model: nn.Module) -> None:
    """Record the sparse24 section of a transformers model's config (what save_pretrained writes)."""
    if _is_transformers_model(model):
        from . import hf
        hf.attach(model)


# --- public API ------------------------------------------------------------------

def sparsify_(model: nn.Module, filter_fn: FilterFn | None = None, mode: str = "masked", method: str = "magnitude",
              calibration: dict | None = None, quantize: str | None = None, min_features: int = MIN_FEATURES,
              trainable_values: bool = False, skip_output_head: bool | str | Iterable[str] = True,
              optimizer: torch.optim.Optimizer | None = None, **mask_kwargs) -> SparsifyReport:
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
            the mask method of layer ``fqn``.
        quantize: ``None`` or ``"int8"`` (compressed mode).
        min_features: skip layers with fewer input or output features.
        trainable_values: compressed mode: ``values`` require grad (frozen layers stay frozen).
        skip_output_head: ``True`` (default): keep the output head dense: the model's
            ``get_output_embeddings()`` where it has one (transformers), else any Linear with as
            many outputs as the input embedding has rows; ``False``: prune it too; a layer name
            or a list of names: keep those.
        optimizer: an optimizer training the model: a layer whose weight becomes a new
            Parameter (a ``Conv1D``'s, stored transposed) is swapped in it, with its state
            transposed (see :func:`prune_trained_model`, which also zeroes the pruned state).
        **mask_kwargs: more options for the mask method.
    Returns:
        :class:`SparsifyReport` (``print(report)`` for a table), skipped layers and every
        module holding a weight matrix that is not handled (``nn.Embedding``, ``nn.Conv2d``, ...)
        with the reason.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> report = sparsify_(model)
        >>> [r.fqn for r in report.swapped], [r.fqn for r in report.skipped]
        (['0'], ['2'])
    """
    check_model(model, filter_fn)
    _check_mode(mode, quantize, trainable_values)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if calibration is not None and not isinstance(calibration, dict):
        raise TypeError(f"calibration must be a dict {{fqn: stats}} from sparse24.calibrate, "
                        f"got {type(calibration).__name__}")
    if not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"min_features must be a non-negative int, got {min_features!r}")
    _check_foreign_quantization(model)
    heads = _output_heads(model, skip_output_head)
    settings = {"mode": mode, "method": method}
    settings.update({k: v for k, v in (("quantize", quantize), ("calibration", calibration and "given")) if v})
    report = SparsifyReport("sparsify_", settings)
    slots, readers, shared = _child_slots(model), _direct_readers(model), _shared_weights(model)
    plan = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, Sparse24Linear):
            report.layers.append(_entry(fqn, mod, "skipped", "already a Sparse24Linear"))
        elif not _is_linear(mod):
            line = _not_handled(fqn, mod)
            if line is not None:
                report.layers.append(line)
        elif why := _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, heads, method, calibration):
            report.layers.append(_entry(fqn, mod, "skipped", why))
        else:
            plan.append((fqn, mod))
    # 1. Compute every mask (and compressed weight) and build every new module: nothing changes yet.
    built = []
    for fqn, mod in plan:
        note = readers.get(id(mod), "")
        layer_mode = "masked" if note else mode
        if note and mode == "compressed":
            note = f"kept in masked mode: {note}"
        train_values = trainable_values and layer_mode == "compressed"
        try:
            work = _prepare(mod, None, layer_mode, method, quantize if layer_mode == "compressed" else None,
                            None if calibration is None else calibration.get(fqn), train_values, mask_kwargs)
            new = Sparse24Linear._empty()._adopt(mod, work, train_values, finish=False)
        except (ValueError, TypeError) as e:
            raise type(e)(f"sparsify_: layer {fqn!r}: {e} (nothing was changed)") from e
        if work.pending is not None:
            kept = None
            note = "; ".join(filter(None, [note, f"mask pending (meta device): computed by {method!r} when "
                                                 "load_state_dict brings the weights"]))
        else:  # of the weight before pruning
            kept = kept_magnitude_fraction(_linear_weight(mod), work.mask)
        built.append((fqn, mod, new, note, kept))
    moves = _optimizer_moves(optimizer, [(mod, new) for _, mod, new, _, _ in built]) if optimizer is not None else []
    # 2. Swap (undone if one fails), 3. prune shared weights in place and register the masking.
    undo = _Undo()
    try:
        for _, mod, new, _, _ in built:
            undo.replace(slots, mod, new)
        for move in moves:
            move(undo)
    except BaseException:
        undo.undo()
        raise
    for fqn, mod, new, note, kept in built:
        new._finish()
        report.layers.append(_entry(fqn, new, "swapped", note))
        report.layers[-1].kept_fraction = kept
    _after_change(model)
    return report


def _optimizer_moves(optimizer, pairs) -> list[Callable[[_Undo], None]]:
    """Where a swap gives a layer a new weight Parameter (Conv1D: stored transposed), the
    steps that hand the optimizer the new Parameter and its state (transposed copies,
    computed now)."""
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
                optimizer.state[w] = state
                undo.add(lambda: optimizer.state.pop(w, None))
        moves.append(move)
    return moves


def _sparse_layers(model: nn.Module) -> list[tuple[str, Sparse24Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)]


def _switch_all(steps: list[tuple[Sparse24Linear, Callable[[], object]]]) -> None:
    """Run each ``(layer, switch)``; if one fails, put every layer back as it was."""
    done = []
    try:
        for m, switch in steps:
            done.append((m, m._snapshot()))
            switch()
    except BaseException:
        for m, snap in reversed(done):
            m._restore(snap)
        raise


def compress_(model: nn.Module, quantize: str | None = None, trainable_values: bool = False) -> SparsifyReport:
    """Switch every masked :class:`Sparse24Linear` of ``model`` to compressed mode; all or nothing.

    Outputs do not change (unless ``quantize="int8"``). Layers whose weight is
    read directly by their parent (``nn.MultiheadAttention.out_proj``, ...)
    stay masked and are reported as skipped. The dense weight Parameters are
    dropped: build a new optimizer if you train afterwards.

    Args:
        model: a model prepared by :func:`sparsify_`.
        quantize: ``None`` or ``"int8"``.
        trainable_values: the compressed ``values`` require grad (frozen layers stay frozen).
    Returns:
        :class:`SparsifyReport`.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); _ = sparsify_(model)
        >>> compress_(model).changed[0].mode
        'compressed'
    """
    check_model(model, None)
    _check_mode("compressed", quantize, trainable_values)
    layers, readers = _sparse_layers(model), _direct_readers(model)
    for fqn, m in layers:  # refuse before changing anything
        if m.mode == "compressed" and m.quantize != quantize:
            raise ValueError(f"layer {fqn!r} is already compressed with quantize={m.quantize!r}; "
                             f"decompress_ first to re-compress with quantize={quantize!r}")
    # Compress every masked layer first, so a failing one (e.g. inf weights with int8) leaves the model untouched.
    packed = {}
    for fqn, m in layers:
        if id(m) in readers or (m.mode == "compressed" and trainable_values == m.values.requires_grad):
            continue
        try:
            packed[fqn] = m._compressed_form(quantize)
        except (ValueError, TypeError) as e:
            raise type(e)(f"compress_: layer {fqn!r}: {e} (nothing was changed)") from e
    _switch_all([(m, lambda m=m, p=packed[fqn]: m._set_compressed(p, trainable_values, m._requires_grad()))
                 for fqn, m in layers if fqn in packed])
    report = SparsifyReport("compress_", {"quantize": quantize} if quantize else {})
    for fqn, m in layers:
        if id(m) in readers:
            report.layers.append(_entry(fqn, m, "skipped", f"kept in masked mode: {readers[id(m)]}"))
        elif fqn not in packed:
            report.layers.append(_entry(fqn, m, "skipped", "already compressed"))
        else:
            report.layers.append(_entry(fqn, m, "compressed"))
    _after_change(model)
    return report


def decompress_(model: nn.Module) -> SparsifyReport:
    """Switch every compressed :class:`Sparse24Linear` of ``model`` back to masked
    mode (outputs unchanged; new weight Parameters, trainable again unless frozen); all or nothing.

    Returns:
        :class:`SparsifyReport`.
    """
    check_model(model, None)
    report = SparsifyReport("decompress_")
    todo = [(fqn, m) for fqn, m in _sparse_layers(model) if m.mode == "compressed"]
    _switch_all([(m, m.to_masked) for _, m in todo])
    report.layers += [_entry(fqn, m, "decompressed") for fqn, m in todo]
    _after_change(model)
    return report


def densify_(model: nn.Module) -> SparsifyReport:
    """Replace every :class:`Sparse24Linear` by a plain ``nn.Linear`` (the class
    it came from; ``Conv1D`` for GPT-2's) holding the masked dense weight; outputs unchanged.

    Masked-mode ``nn.Linear`` layers hand over their weight and bias Parameters (an
    optimizer keeps working, now without the mask); the others get new dense weights.

    Returns:
        :class:`SparsifyReport`.
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64)); _ = sparsify_(model)
        >>> _ = densify_(model); type(model[0]).__name__
        'Linear'
    """
    check_model(model, None)
    report = SparsifyReport("densify_")
    slots = _child_slots(model)
    layers = _sparse_layers(model)
    if any(not fqn for fqn, _ in layers):
        raise ValueError("the model itself is a Sparse24Linear: nothing holds it to swap; "
                         "use model.to_dense_module()")
    built = [(fqn, m, m.to_dense_module(release=False)) for fqn, m in layers]
    undo = _Undo()
    try:
        for _, m, dense in built:
            undo.replace(slots, m, dense)
    except BaseException:
        undo.undo()
        raise
    for fqn, m, dense in built:
        m._release()
        report.layers.append(_entry(fqn, dense, "densified"))
    _after_change(model)
    return report


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
    report = sparsify_(model, mode="masked", optimizer=optimizer, **kwargs)
    report.operation = "prune_trained_model"
    with torch.no_grad():
        for r in report.changed:
            m = model.get_submodule(r.fqn)
            for v in optimizer.state.get(m.weight, {}).values():
                if isinstance(v, torch.Tensor) and v.shape == m.mask.shape:
                    v.masked_fill_(~m.mask, 0)
    return report


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts that mean the same in masked and compressed mode.

    ``model.parameters()`` (and transformers' ``num_parameters()``) count Parameters
    only: a masked layer's dense weight counts fully (pruned zeros included), a
    compressed one's ``values`` are buffers and do not count, so that number
    halves-and-more after :func:`compress_` without the model changing.

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

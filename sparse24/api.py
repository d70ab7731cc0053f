"""Whole-model 2:4 sparsity: swap ``nn.Linear`` instances in place (layer 5).

* :func:`sparsify_`: every eligible ``nn.Linear`` -> :class:`Sparse24Linear`
  (masked or compressed), with a :class:`SparsifyReport` of what was swapped,
  what was skipped and why, and the weight bytes.
* :func:`compress_` / :func:`decompress_`: switch every ``Sparse24Linear``
  between masked (training) and compressed (inference) mode; outputs unchanged.
* :func:`densify_`: back to plain ``nn.Linear`` holding the masked weights.
* :func:`prune_trained_model`: the ASP-style one call that prunes a trained
  model and leaves it, and its optimizer, ready to retrain with frozen masks.

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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ._checks import check_model
from .masks import kept_magnitude_fraction
from .nn import Sparse24Linear, _check_mode, _prepare, compressed_nbytes, memory_nbytes

__all__ = ["sparsify_", "densify_", "compress_", "decompress_", "prune_trained_model", "SparsifyReport",
           "LayerReport"]

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


@dataclass
class LayerReport:
    """One layer's line in a :class:`SparsifyReport`.

    Attributes:
        fqn: name in ``model.named_modules()``.
        shape: ``(out_features, in_features)``.
        dtype: weight dtype.
        action: what happened: ``"swapped"``, ``"compressed"``, ``"decompressed"``,
            ``"densified"`` or ``"skipped"``.
        mode: the layer's mode afterwards (None for dense layers).
        reason: why it was skipped, or a note.
        dense_bytes: the dense weight's bytes.
        compressed_bytes: the weight's bytes once compressed (values + 2-bit indices + INT8 scales).
        memory_bytes: the weight's bytes as held now (masked mode: dense weight + 1-byte mask).
        kept_fraction: ``sparsify_`` only: fraction of the original ``sum |W|`` the mask
            keeps (see :func:`sparse24.masks.kept_magnitude_fraction`), to compare methods.
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
                lines.append(f"  {r.fqn:<{w}}  {str(r.shape):>12}  {str(r.dtype)[6:]:>9}  {r.mode or 'dense':>10}  "
                             f"{r.dense_bytes:>10}  {r.memory_bytes:>10}  {r.compressed_bytes:>10}"
                             + (f"  {r.kept_fraction:>8.4f}" if r.kept_fraction is not None else "")
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


def _replace(slots, old: nn.Module, new: nn.Module) -> None:
    for parent, name in slots[id(old)]:
        setattr(parent, name, new)


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


def _entry(fqn: str, mod: nn.Module, action: str, reason: str = "") -> LayerReport:
    R, C = mod.out_features, mod.in_features
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


def _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, method, calibration) -> str:
    """Why ``mod`` (an nn.Linear) cannot be swapped, or "" if it can."""
    if not fqn:
        return "the model itself is this Linear (no parent to swap it in); use Sparse24Linear.from_linear"
    if type(mod) not in _SWAPPABLE:
        if torch.nn.utils.parametrize.is_parametrized(mod):
            return "weight is parametrized (e.g. SR-STE, weight_norm); remove the parametrization first"
        return f"{type(mod).__name__} subclasses nn.Linear and may change its forward; not swapped"
    if filter_fn is not None and not filter_fn(mod, fqn):
        return "excluded by filter_fn"
    if mod.in_features % 4:
        return f"in_features={mod.in_features} is not divisible by 4"
    if min(mod.in_features, mod.out_features) < min_features:
        return f"smaller than min_features={min_features} ({mod.out_features}x{mod.in_features}): too small to gain"
    if not mod.weight.is_floating_point():
        return f"weight dtype {mod.weight.dtype} is not floating point"
    if id(mod.weight) in shared:
        others = [n for n in shared[id(mod.weight)] if n != f"{fqn}.weight"]
        return f"weight is shared with {', '.join(others)} (tied): pruning it would also prune those"
    if method in _CALIBRATED_METHODS and calibration is not None and fqn not in calibration:
        why = (f"{readers[id(mod)]}, so calibrate() never sees its input" if id(mod) in readers
               else "was it run during calibrate()?")
        return f"no calibration statistics for this layer (method={method!r}): {why}"
    return ""


# --- public API ------------------------------------------------------------------

def sparsify_(model: nn.Module, filter_fn: FilterFn | None = None, mode: str = "masked", method: str = "magnitude",
              calibration: dict | None = None, quantize: str | None = None, min_features: int = MIN_FEATURES,
              trainable_values: bool = False, **mask_kwargs) -> SparsifyReport:
    """Swap every eligible ``nn.Linear`` of ``model`` for a :class:`Sparse24Linear`, in place.

    Masked mode shares each layer's weight/bias Parameters (optimizers keep
    working) and zeroes the pruned weights in place.

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
        trainable_values: compressed mode: ``values`` are Parameters.
        **mask_kwargs: more options for the mask method.
    Returns:
        :class:`SparsifyReport` (``print(report)`` for a table).
    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> report = sparsify_(model)
        >>> [r.fqn for r in report.swapped], [r.fqn for r in report.skipped]
        (['0'], ['2'])
    """
    check_model(model, filter_fn)
    _check_mode(mode, quantize, trainable_values)
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if calibration is not None and not isinstance(calibration, dict):
        raise TypeError(f"calibration must be a dict {{fqn: stats}} from sparse24.calibrate, "
                        f"got {type(calibration).__name__}")
    if not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"min_features must be a non-negative int, got {min_features!r}")
    settings = {"mode": mode, "method": method}
    settings.update({k: v for k, v in (("quantize", quantize), ("calibration", calibration and "given")) if v})
    report = SparsifyReport("sparsify_", settings)
    slots, readers, shared = _child_slots(model), _direct_readers(model), _shared_weights(model)
    plan = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        why = _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, method, calibration)
        if why:
            report.layers.append(_entry(fqn, mod, "skipped", why))
        else:
            plan.append((fqn, mod))
    # Compute every mask (and compressed weight) first, so a failing layer leaves the model untouched.
    prepared = []
    for fqn, mod in plan:
        note = readers.get(id(mod), "")
        layer_mode = "masked" if note else mode
        if note and mode == "compressed":
            note = f"kept in masked mode: {note}"
        train_values = trainable_values and layer_mode == "compressed"
        try:
            work = _prepare(mod, None, layer_mode, method, quantize if layer_mode == "compressed" else None,
                            None if calibration is None else calibration.get(fqn), train_values, mask_kwargs)
        except (ValueError, TypeError) as e:
            raise type(e)(f"sparsify_: layer {fqn!r}: {e} (nothing was changed)") from e
        kept = kept_magnitude_fraction(mod.weight.detach(), work[1])  # of the weight before pruning
        prepared.append((fqn, mod, work, train_values, note, kept))
    for fqn, mod, work, train_values, note, kept in prepared:
        new = Sparse24Linear._empty()._adopt(mod, *work, train_values)
        _replace(slots, mod, new)
        report.layers.append(_entry(fqn, new, "swapped", note))
        report.layers[-1].kept_fraction = kept
    return report


def _sparse_layers(model: nn.Module) -> list[tuple[str, Sparse24Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)]


def compress_(model: nn.Module, quantize: str | None = None, trainable_values: bool = False) -> SparsifyReport:
    """Switch every masked :class:`Sparse24Linear` of ``model`` to compressed mode.

    Outputs do not change (unless ``quantize="int8"``). Layers whose weight is
    read directly by their parent (``nn.MultiheadAttention.out_proj``, ...)
    stay masked and are reported as skipped. The dense weight Parameters are
    dropped: build a new optimizer if you train afterwards.

    Args:
        model: a model prepared by :func:`sparsify_`.
        quantize: ``None`` or ``"int8"``.
        trainable_values: make the compressed ``values`` Parameters.
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
        if id(m) in readers or (m.mode == "compressed" and trainable_values == isinstance(m.values, nn.Parameter)):
            continue
        try:
            packed[fqn] = m._compressed_form(quantize)
        except (ValueError, TypeError) as e:
            raise type(e)(f"compress_: layer {fqn!r}: {e} (nothing was changed)") from e
    report = SparsifyReport("compress_", {"quantize": quantize} if quantize else {})
    for fqn, m in layers:
        if id(m) in readers:
            report.layers.append(_entry(fqn, m, "skipped", f"kept in masked mode: {readers[id(m)]}"))
        elif fqn not in packed:
            report.layers.append(_entry(fqn, m, "skipped", "already compressed"))
        else:
            m._set_compressed(packed[fqn], trainable_values)
            report.layers.append(_entry(fqn, m, "compressed"))
    return report


def decompress_(model: nn.Module) -> SparsifyReport:
    """Switch every compressed :class:`Sparse24Linear` of ``model`` back to masked
    mode (outputs unchanged; new weight Parameters, trainable again).

    Returns:
        :class:`SparsifyReport`.
    """
    check_model(model, None)
    report = SparsifyReport("decompress_")
    for fqn, m in _sparse_layers(model):
        if m.mode == "compressed":
            m.to_masked()
            report.layers.append(_entry(fqn, m, "decompressed"))
    return report


def densify_(model: nn.Module) -> SparsifyReport:
    """Replace every :class:`Sparse24Linear` by a plain ``nn.Linear`` (the class
    it came from) holding the masked dense weight; outputs unchanged.

    Masked-mode layers hand over their weight and bias Parameters (an optimizer
    keeps working, now without the mask); compressed ones get new dense weights.

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
    for fqn, m in _sparse_layers(model):
        if not fqn:
            raise ValueError("the model itself is a Sparse24Linear: nothing holds it to swap; "
                             "build nn.Linear from model.dense_weight() yourself")
        cls = getattr(m, "_dense_cls", nn.Linear)
        lin = cls(m.in_features, m.out_features, bias=False, device="meta")
        if m.mode == "masked":
            weight = m.weight
            with torch.no_grad():
                weight.masked_fill_(~m.mask, 0)
            m._release()
        else:
            weight = nn.Parameter(m.dense_weight())
        lin.weight, lin.bias = weight, m.bias
        _replace(slots, m, lin)
        report.layers.append(_entry(fqn, lin, "densified"))
    return report


def prune_trained_model(model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> SparsifyReport:
    """Prune a trained model to 2:4 and leave it ready to retrain with the masks frozen.

    The ASP-style one call: :func:`sparsify_` in masked mode (same Parameter
    objects, so ``optimizer`` keeps training them), then the optimizer's
    per-parameter state (momentum, Adam moments) is zeroed at the pruned
    positions so the retraining starts as if those weights never existed.
    Afterwards every ``optimizer.step()`` keeps the pruned weights at exactly 0.

    Args:
        model: a trained model.
        optimizer: the ``torch.optim.Optimizer`` that trains it (state kept).
        **kwargs: :func:`sparsify_` options (``filter_fn``, ``method``,
            ``calibration``, ``min_features``...); ``mode`` is always masked.
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
    report = sparsify_(model, mode="masked", **kwargs)
    report.operation = "prune_trained_model"
    with torch.no_grad():
        for r in report.changed:
            m = model.get_submodule(r.fqn)
            for v in optimizer.state.get(m.weight, {}).values():
                if isinstance(v, torch.Tensor) and v.shape == m.mask.shape:
                    v.masked_fill_(~m.mask, 0)
    return report


"""The :class:`Sparse24Linear` module (see :mod:`sparse24.nn` for its modes and
mechanisms): its construction, the two modes and the switches between them,
forward, and moves. (Under 600 lines: one class whose parts share the
module's state; what has a seam lives beside it: ``prepare`` (a swap computed
before anything changes), ``masking`` (the hooks), ``layout`` (v1 or decode)
and ``state`` (state dicts), the last two as mixins of the class.)"""
from __future__ import annotations

import sys
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.utils import parametrize

from .._checks import check_bool, check_finite, is_exporting, refuse_meta
from ..decode_format import DecodePacked, _with_sp_words, decode_dims
from ..format import (FLOAT_DTYPES, Sparse24Tensor, _pack_nibbles, compress, int4_quantize, quantize_values,
                      transformed)
from ..ops import linear24
from ..ops.linear24 import launch, op
from .layout import LayoutMixin
from .masking import (_GRAD_HOOKED, _HAS_HOOK, _MASKED_MODULES, _ZERO_CHECKED, _grad_mask_hook, _owner_of,
                      _relink_hooks, _unhook, same_view, still_zero, zero_key)
from .prepare import (_check_mode, _placeholder, _prepare, _Prepared, is_conv1d, is_conv1d_class,
                      describe_quant, linear_shape, quant_options)
from .sharded import gather_mask, is_dtensor, shard_like
from .state import StateDictMixin, stored_scale_dtype

__all__ = ["Sparse24Linear"]

# The module's attributes a mode or layout switch changes (besides its tensors).
_MODE_STATE = ("_mode", "_dtype", "_weight_requires_grad", "_pending", "_layout", "_layout_pref", "_group_size",
               "_scale_bf16")
# Compressed mode's tensors (``zero`` and ``group_size`` only when INT4; see _set_compressed).
_COMPRESSED = ("values", "meta", "scale", "zero", "group_size")


# module -> {(x's shape, dtype): what a kernel-path call of that shape launched} (Sparse24Linear.forward's
# fast path); weak keys and weak tensor references: nothing of it is copied or pickled with a module, and
# it keeps no module or tensor alive
_FAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
launch.on_release(_FAST.clear)   # release_workspaces(): the kept plans hold split-K workspaces


_ABSENT = object()  # a name missing from the module's _parameters

# INT4 layers that add_to_kept_ has warned about (its grid merge): once each; weak
_INT4_MERGE_WARNED: "weakref.WeakSet" = weakref.WeakSet()


def _ref(t):
    return None if t is None else weakref.ref(t)


def _settle(layer: "Sparse24Linear") -> None:
    """``layer._settle_layout(keep_values=True)``, its fast-path plan dropped when the layout changed."""
    if layer._settle_layout(keep_values=True):
        _FAST.pop(layer, None)


# _settle outside a compiled graph: it re-packs the values Parameter's data in place, which Dynamo cannot trace
_settle_eagerly = torch.compiler.disable(_settle, reason=(
    "sparse24: a compressed layer made trainable in the decode layout settles to layout v1 in eager mode "
    "(the op's backward takes layout v1); for fullgraph=True call layer.to_layout('v1') before compiling"))


class Sparse24Linear(LayoutMixin, StateDictMixin, nn.Module):
    """``nn.Linear`` whose weight is 2:4 sparse, in ``"masked"`` (training) or
    ``"compressed"`` (inference) mode; see the module docstring.

    Build it from an existing layer with :meth:`from_linear`, or directly
    (``Sparse24Linear(in_features, out_features)`` initializes like
    ``nn.Linear`` and prunes by magnitude; on ``device="meta"`` the mask waits
    for the weights, see the module docstring).

    Args:
        in_features: C, divisible by 4. out_features: R.
        bias: add a learnable bias.
        mode: ``"masked"`` or ``"compressed"``.
        quantize: ``None``, ``"int8"`` or ``"int4"`` (compressed mode only).
        trainable_values: compressed mode: ``values`` requires grad.
        group_size, symmetric: INT4 only: scales per ``group_size`` input columns (32, 64
            or 128; default 128); ``symmetric=False`` adds uint8 zero points (default True).
        device, dtype: as for ``nn.Linear``.
    Shapes:
        input ``(..., C)`` -> output ``(..., R)``.
    Example:
        >>> layer = Sparse24Linear.from_linear(nn.Linear(64, 32))
        >>> layer(torch.randn(5, 64)).shape
        torch.Size([5, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mode: str = "masked",
                 quantize: str | None = None, trainable_values: bool = False, group_size: int | None = None,
                 symmetric: bool | None = None, device=None, dtype=None):
        super().__init__()
        quant = quant_options(quantize, group_size, symmetric)
        dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._adopt(dense, _prepare(dense, None, mode, "magnitude", quant, None, trainable_values, {}),
                    trainable_values)

    @classmethod
    def from_linear(cls, linear: nn.Module, mask: torch.Tensor | None = None, mode: str = "masked",
                    method: str = "magnitude", quantize: str | None = None, calibration=None,
                    trainable_values: bool = False, group_size: int | None = None, symmetric: bool | None = None,
                    **mask_kwargs) -> "Sparse24Linear":
        """Build a Sparse24Linear from ``linear``.

        Masked mode SHARES an ``nn.Linear``'s weight and bias Parameters (so an
        optimizer holding them keeps working) and zeroes the pruned weights in
        place; a Hugging Face ``Conv1D`` stores its weight transposed, so its
        weight becomes a new ``(R, C)`` Parameter (same ``requires_grad``).
        Compressed mode shares the bias and copies the kept values. A layer on
        the meta device gets a pending mask (computed when weights are loaded).

        Args:
            linear: an ``nn.Linear`` (weight ``(R, C)``, ``C % 4 == 0``) or a
                ``transformers`` ``Conv1D`` (weight ``(C, R)``).
            mask: optional ``(R, C)`` bool 2:4 mask; default: computed by ``method``.
            mode: ``"masked"`` or ``"compressed"``.
            method: mask method for ``sparse24.mask_nm`` / ``sparse24.masks.prune_nm``
                (``"magnitude"``, ``"2d_greedy"``, ``"2d_optimal"``, ``"wanda"``,
                ``"sparsegpt"``; the latter two need ``calibration`` or
                ``act_norm=`` / ``hessian=``). SparseGPT's reconstructed
                weights are stored.
            quantize: ``None``, ``"int8"`` or ``"int4"`` (compressed mode).
            calibration: this layer's statistics from ``sparse24.calibrate``.
            trainable_values: compressed mode: ``values`` requires grad (kept frozen when
                ``linear``'s weight is).
            group_size, symmetric: INT4 only (see the class docstring).
            **mask_kwargs: passed to the mask method.
        Returns:
            the new module (``linear`` itself is not replaced; see ``sparsify_``).
        Example:
            >>> lin = nn.Linear(32, 16)
            >>> sp = Sparse24Linear.from_linear(lin, mode="compressed")
            >>> sp.values.shape, sp.meta.shape
            (torch.Size([16, 16]), torch.Size([1, 16]))
        """
        quant = quant_options(quantize, group_size, symmetric)
        prepared = _prepare(linear, mask, mode, method, quant, calibration, trainable_values, mask_kwargs)
        return cls._empty()._adopt(linear, prepared, trainable_values)

    @classmethod
    def _empty(cls) -> "Sparse24Linear":
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        return mod

    def _adopt(self, linear, prepared: _Prepared, trainable_values: bool, finish: bool = True) -> "Sparse24Linear":
        """Take over ``linear`` with what :func:`_prepare` computed. ``finish=False`` leaves
        the shared weight unpruned and the module unregistered, so a caller can swap
        several layers and undo the swaps before anything else changed; it then calls
        :meth:`_finish` on each."""
        new_w, mask, p, pending = prepared
        self.in_features, self.out_features = C, R = linear_shape(linear)[::-1]
        self._dense_cls = type(linear)  # to_dense_module restores e.g. MultiheadAttention's out_proj class, Conv1D
        self._pending = pending
        self.training = linear.training  # a swap inside an eval model stays in eval mode
        self.bias = linear.bias
        requires_grad = linear.weight.requires_grad
        if p is None:
            if is_conv1d(linear):  # a new (R, C) Parameter, pruned now: the Conv1D's (C, R) one cannot be shared
                w = linear.weight.detach().t() if new_w is None else new_w
                w = nn.Parameter(w.contiguous() if w.is_meta else torch.where(mask, w, 0), requires_grad=requires_grad)
                new_w = None
            else:
                w = linear.weight
            self._finish_args = (new_w, mask)
            self._set_masked(w, mask, track=False)
        else:
            self._finish_args = None
            self._set_compressed(p, trainable_values, requires_grad)
        return self._finish() if finish else self

    def _finish(self) -> "Sparse24Linear":
        """Prune the (shared) masked weight in place, and a gradient it already has (mid
        accumulation: clipping and the optimizer read it), and register the masking (cannot fail
        short of running out of memory)."""
        args = self.__dict__.pop("_finish_args", None)
        if args is not None:
            new_w, mask = args
            w = self.weight
            if not w.is_meta:
                with torch.no_grad():
                    if new_w is None:
                        w.masked_fill_(~mask, 0)
                    else:
                        w.copy_(new_w)
                    if w.grad is not None:
                        w.grad.masked_fill_(~mask, 0)
            self._track_masked()
        return self

    # -- mode plumbing --
    def _set_masked(self, weight: nn.Parameter, mask: torch.Tensor, track: bool = True) -> None:
        for name in _COMPRESSED:
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        for name in ("_dtype", "_weight_requires_grad", "_layout", "_layout_pref", "_group_size"):
            self.__dict__.pop(name, None)
        self.weight = weight
        self._bias_last()
        self.register_buffer("mask", mask)
        self._mode = "masked"
        if track:
            self._track_masked()

    def _bias_last(self) -> None:
        """Parameters in nn.Linear's order, (weight or values, bias): an optimizer's state dict pairs
        its entries with parameters by position, so a checkpoint of the dense model's optimizer (or
        of one prune_trained_model kept) resumes into one built from model.parameters() after."""
        if "bias" in self._parameters:
            self._parameters["bias"] = self._parameters.pop("bias")

    def _set_compressed(self, p: Sparse24Tensor, trainable_values: bool, requires_grad: bool = True) -> None:
        # The new tensors first: a failure making them leaves this layer as it was (nothing released yet).
        # INT4: the group size as a 0-d int32 entry too, so that a checkpoint says which it holds (a
        # scale's shape does not tell 64 from 128 when C <= 64); the Python int is what forward reads.
        values = nn.Parameter(p.values, requires_grad=bool(trainable_values and requires_grad))
        group_size = None if p.group_size is None else torch.tensor(p.group_size, dtype=torch.int32, device=p.device)
        self._release()
        for name in ("weight", "mask", "values"):
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        self.values = values
        self._bias_last()
        self.register_buffer("meta", p.meta)
        self.register_buffer("scale", p.scale)  # None unless quantized (then not in the state dict)
        self.register_buffer("zero", p.zero)  # INT4 asymmetric only
        self._group_size = p.group_size
        self.register_buffer("group_size", group_size)
        self._dtype = p.dtype  # logical dtype (differs from values' when quantized)
        self._weight_requires_grad = requires_grad  # a frozen layer stays frozen through to_masked
        self._mode = "compressed"
        self._layout = "v1"
        self._mark_uninitialized()   # (a placeholder of a pending layer on a real device: no weights in it)
        self._settle_layout()

    def _track_masked(self) -> None:
        """Register for the optimizer post-hook and make this module the owner
        of its weight's gradient hook (hooking each Parameter once, a frozen one too)."""
        _MASKED_MODULES.add(self)
        w = self.weight
        _GRAD_HOOKED[w] = weakref.ref(self)
        self._hook_if_needed(w)

    @staticmethod
    def _hook_if_needed(w: nn.Parameter) -> None:
        if w in _HAS_HOOK or not (w.requires_grad or w.is_floating_point()):
            return
        frozen = not w.requires_grad
        # A frozen weight is hooked now too: a parent reading .weight directly (MultiheadAttention's
        # out_proj) never runs forward's retry, so once unfrozen its gradient went unmasked. torch
        # refuses a hook on a tensor that does not require grad, and keeps one across the toggle.
        if frozen:
            try:
                w.requires_grad_(True)
            except RuntimeError:  # an inference tensor (never trained): left to forward's retry
                return
        try:
            _HAS_HOOK[w] = w.register_hook(_grad_mask_hook(w))   # recorded at once: an interrupt leaks no hook
        finally:
            if frozen:
                w.requires_grad_(False)

    def _release(self) -> None:
        """Stop masking this module's weight (its Parameter is handed to someone else)."""
        _MASKED_MODULES.discard(self)
        _ZERO_CHECKED.pop(self, None)
        w = self._parameters.get("weight")
        if w is not None and w in _GRAD_HOOKED and _GRAD_HOOKED[w]() is self:
            del _GRAD_HOOKED[w]
            _unhook(w)  # nothing of sparse24 stays on it (a weak reference stops torch's swap_tensors)

    def _snapshot(self) -> tuple:
        """Everything a mode switch changes (references, no copies), for :meth:`_restore`."""
        keys = _MODE_STATE
        return dict(self._parameters), dict(self._buffers), {k: self.__dict__[k] for k in keys if k in self.__dict__}

    def _restore(self, snap: tuple) -> None:
        """Undo changes since :meth:`_snapshot` (the same tensor objects come back)."""
        self._release()
        params, buffers, attrs = snap
        self._parameters.clear()
        self._parameters.update(params)
        self._buffers.clear()
        self._buffers.update(buffers)
        for k in _MODE_STATE:
            self.__dict__.pop(k, None)
        self.__dict__.update(attrs)
        if self._mode == "masked":
            self._track_masked()

    def __setstate__(self, state):
        # deepcopy / unpickle: hooks are not copied; re-arm them on the new objects. copy.copy shares the
        # weight Parameter (and the parameter dict): its live owner stays the owner (the copy taking over left
        # the weight's gradients unmasked once the copy died, e.g. torch's pipelining copies children so);
        # the copy is registered as masked, so it takes over should the owner die first (masking._owner_of).
        super().__setstate__(state)
        if self.__dict__.get("_mode") == "masked":
            if _owner_of(self._parameters.get("weight")) is None:
                self._track_masked()
            else:
                _MASKED_MODULES.add(self)
        elif self.__dict__.get("_mode") == "compressed":
            # pickled by an earlier sparse24: before INT4 (2026-11-30), before the decode layout, before
            # the mask's saved trainability; before 2026-12-02 a quantized decode layout held its keep masks
            # without the mma.sp words after them
            self.__dict__.setdefault("_group_size", None)
            for name in ("zero", "group_size"):
                self._buffers.setdefault(name, None)
            self.__dict__.setdefault("_layout", "v1")
            self.__dict__.setdefault("_weight_requires_grad", True)
            b = self._buffers
            if self._layout == "decode" and b["scale"] is not None \
                    and b["meta"].shape[-1] == decode_dims(self.out_features, self.in_features)[2]:
                b["meta"] = _with_sp_words(self._parameters["values"], b["meta"], (self.out_features,
                                           self.in_features), self._dtype, b["scale"], b["zero"], self._group_size)

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight", "mask") and self.__dict__.get("_mode") == "compressed" and "values" in self._parameters:
            # forward reads values/meta: a dense weight set here was ignored, and went into the state dict
            # (which a compressed layer's strict load then refuses). (Switching to masked mode removes
            # values before it sets the weight.)
            raise AttributeError(f"Sparse24Linear in compressed mode has no dense {name!r} to set (it stores "
                                 "values/meta): call .to_masked() first, then set it; nothing was changed")
        # FSDP2's fully_shard installs the sharded weight with setattr (the plain
        # nn.Module.__setattr__ would be bypassed): shard the mask alike, at once.
        if name == "weight" and is_dtensor(value) and self.__dict__.get("_mode") == "masked":
            self._buffers["mask"] = shard_like(self._buffers["mask"], value)
        if name in ("weight", "values") and is_dtensor(value) and not self.__dict__.get("_sharded"):
            # Marked for good (see _is_sharded): FSDP sets its gathered, plain tensors before each forward
            if name == "values" and self.__dict__.get("_layout") == "decode":
                warnings.warn(f"{self._who()} is sharded (fully_shard) holding the decode layout: its forward "
                              "works, but its state dict cannot be taken (state_dict, get_model_state_dict, "
                              "torch.distributed.checkpoint and loads raise) nor its layout changed; call "
                              "to_layout('v1') on compressed layers before fully_shard", UserWarning, stacklevel=2)
            self.__dict__["_sharded"] = True
        super().__setattr__(name, value)

    def _who(self, name: str | None = None) -> str:
        """This layer in an error message: ``name`` (its path in the model, e.g. a state dict's prefix) or its shape."""
        return f"layer {name!r}" if name else \
            f"Sparse24Linear(in_features={self.in_features}, out_features={self.out_features})"

    def _is_sharded(self) -> bool:
        """True where FSDP2 (fully_shard) manages this layer's parameters, or they are DTensors. In FSDP's
        forward they are its gathered, plain tensors, so __setattr__ marks the layer once it sees a DTensor."""
        return bool(self.__dict__.get("_sharded")) or is_dtensor(self.weight if self._mode == "masked" else self.values)

    def _refuse_sharded(self, what: str, name: str | None = None) -> None:
        """RuntimeError where this layer is sharded (:meth:`_is_sharded`): ``what`` it cannot do, said of
        ``name`` (see :meth:`_who`). Called before anything changes."""
        if not self._is_sharded():
            return
        if self._mode == "compressed" and self._layout == "decode":
            # (its layout v1 tensors, which every whole-weight form and state dict is built from, need the whole
            # decode tensors; FSDP holds a piece of them, of the shape it sharded)
            raise RuntimeError(f"{self._who(name)} was sharded (e.g. by fully_shard) holding the decode layout, so "
                               f"it cannot {what}: call to_layout('v1') on compressed layers before fully_shard (a "
                               "frozen 16-bit, INT8 or INT4 layer takes the decode layout on an NVIDIA GPU); "
                               "nothing was changed")
        tensor = "weight is" if self._mode == "masked" else "values are"
        raise RuntimeError(f"{self._who(name)}'s {tensor} sharded (a DTensor, e.g. by fully_shard), so it "
                           f"cannot {what}: gather a full state dict (torch.distributed.checkpoint.state_dict."
                           "get_model_state_dict with full_state_dict=True) into an unsharded model first; "
                           "nothing was changed")

    def __delattr__(self, name: str) -> None:
        # torch.nn.utils.parametrize deletes the tensor first, then cannot file the parametrization under a
        # name nn.ModuleDict has as an attribute ("values": ModuleDict.values) and raises with the layer left
        # without its weight: refuse that call before anything changes (docs/modules.md)
        if hasattr(nn.ModuleDict, name) and sys._getframe(1).f_code is parametrize.register_parametrization.__code__:
            raise ValueError(f"torch.nn.utils.parametrize cannot parametrize a tensor named {name!r} (the name of an "
                             f"nn.ModuleDict attribute), so a compressed Sparse24Linear's {name} cannot be "
                             "parametrized; parametrize the weight in masked mode (to_masked()) instead. "
                             "Nothing was changed")
        super().__delattr__(name)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("weight", "mask") and self.__dict__.get("_mode") == "compressed":
                raise AttributeError(f"Sparse24Linear in compressed mode has no dense {name!r} (it stores "
                                     "values/meta); use .dense_weight() or .to_masked()") from None
            raise

    @property
    def mode(self) -> str:
        """``"masked"`` (dense weight + mask, trains) or ``"compressed"`` (values + 2-bit slots)."""
        return self._mode

    @property
    def quantize(self) -> str | None:
        """``None``, ``"int8"`` or ``"int4"`` (compressed mode)."""
        if self._mode != "compressed" or self.scale is None:
            return None
        return "int8" if self._group_size is None else "int4"

    @property
    def symmetric(self) -> bool | None:
        """INT4: False when the layer stores zero points; None unless INT4."""
        return None if self.quantize != "int4" else self.zero is None

    def _quant(self) -> dict:
        """This layer's quantization as :func:`sparse24.nn.quant_options` gives it."""
        q = self.quantize
        return quant_options(q, self._group_size, self.symmetric) if q == "int4" else quant_options(q)

    @property
    def pending(self) -> bool:
        """True while the mask waits for real weights (built on the meta device)."""
        return self.__dict__.get("_pending") is not None

    @property
    def dtype(self) -> torch.dtype:
        """Logical weight dtype (the dequantized dtype when int8)."""
        return self.weight.dtype if self._mode == "masked" else self._dtype

    @property
    def device(self) -> torch.device:
        """The device of the weight (masked mode) or of the compressed values."""
        return self.weight.device if self._mode == "masked" else self.values.device

    def _refuse_pending(self, what: str) -> None:
        """RuntimeError while the mask is pending, after taking what a loader set (finish_loading)."""
        self._finish_if_loaded()
        if self.pending:
            raise RuntimeError(self._pending_message(what))

    def _mark_uninitialized(self) -> None:
        """A pending layer now holds real memory that no weights were loaded into (``to_empty``, a mode
        switch while pending): it must not finish loading by itself (:meth:`finish_loading`)."""
        if self.pending and not self._holds_meta():
            self._pending = {**self._pending, "uninitialized": True}   # (a new dict: a snapshot keeps the old)

    def sparse_tensor(self) -> Sparse24Tensor:
        """The ``(R, C)`` = ``(out_features, in_features)`` weight as a :class:`Sparse24Tensor`
        (views of the buffers in compressed mode and layout v1; re-ordered from the decode layout)."""
        self._refuse_pending("give its 2:4 weight")
        if self._mode == "masked" or self.__dict__.get("_layout") == "decode":
            # (layout v1 gives its own tensors as they are, sharded ones too: validate() reads each rank's piece)
            self._refuse_sharded("give its 2:4 weight")
        if self._mode == "masked":
            return compress(self.weight.detach(), self.mask)
        if self.__dict__.get("_layout") == "decode":
            return DecodePacked(self.values.detach(), self.meta, (self.out_features, self.in_features), self._dtype,
                                self.scale, zero=self.zero, group_size=self._group_size, check=False).to_sparse24()
        return Sparse24Tensor(self.values.detach(), self.meta, (self.out_features, self.in_features),
                              self._dtype, self.scale, zero=self.zero, group_size=self._group_size, check=False)

    def dense_weight(self) -> torch.Tensor:
        """``(R, C)`` dense weight with zeros at the pruned positions (a new, detached tensor;
        dequantized when INT8/INT4)."""
        self._refuse_pending("give its weight")
        self._refuse_sharded("give its weight")
        if self._mode == "masked":
            return torch.where(self.mask, self.weight.detach(), 0)
        return self.sparse_tensor().to_dense()

    def to_dense_module(self, release: bool = True) -> nn.Module:
        """A plain layer of the class this one replaced (``nn.Linear``, or ``Conv1D`` with the
        weight transposed back) holding the masked dense weight; outputs unchanged.

        A masked-mode ``nn.Linear`` gets this layer's weight and bias Parameters
        (pruned entries zeroed; an optimizer keeps training them, now without the
        mask); otherwise a new weight Parameter (same ``requires_grad``). This
        layer is left as it is, apart from no longer masking a handed-over weight
        (``release=False``: still masking it, for a caller that may undo the swap
        and calls :meth:`_release` later).

        Args:
            release: a bool (default True): stop masking the handed-over weight.
        Returns:
            ``nn.Linear`` (weight ``(R, C)``) or ``Conv1D`` (weight ``(C, R)``).
        """
        release = check_bool(release, "release")
        self._refuse_pending("be densified")
        self._refuse_sharded("be densified")
        cls = self.__dict__.get("_dense_cls", nn.Linear)
        R, C = self.out_features, self.in_features
        with torch.device("meta"):  # no dense random init: the weight is set below
            dense = cls(R, C) if is_conv1d_class(cls) else cls(C, R, bias=False)
        if self._mode == "masked" and not is_conv1d_class(cls):
            weight = self.weight
            with torch.no_grad():
                weight.masked_fill_(~self.mask, 0)
            if release:
                self._release()
        else:
            requires_grad = self.weight.requires_grad if self._mode == "masked" else self._weight_requires_grad
            w = self.dense_weight()
            weight = nn.Parameter(w.t().contiguous() if is_conv1d_class(cls) else w, requires_grad=requires_grad)
        dense.weight, dense.bias = weight, self.bias
        return dense.train(self.training)  # (built in train mode) the swap keeps an eval model in eval mode

    def add_to_kept_(self, delta: torch.Tensor) -> "Sparse24Linear":
        """Add ``delta`` at the kept positions only, in place: the 2:4 pattern and the mode do not
        change (what merging a dense LoRA update into this layer means; see :mod:`sparse24.lora`).

        Args:
            delta: ``(R, C)`` finite floating tensor; its entries at pruned positions are ignored.
        Returns:
            self. Masked mode updates ``weight`` (same Parameter), compressed mode ``values``;
            INT8 values are dequantized, updated in fp32 and requantized (new ``scale``). INT4
            values move to the point of the layer's own grid nearest the exact ``W + delta``
            (scales and zero points do not change, so the layer keeps its format): within half
            its group's step inside the grid's range, at the range's end outside it; a
            :class:`UserWarning` says how many codes changed and how many were clipped (an
            update under half a step rounds away), on the layer's first INT4 merge only (a
            merge/unmerge loop would repeat it for every layer).
        Raises:
            ValueError, nothing changed: a wrong or non-finite ``delta``, a merged weight that is not
            finite in the layer's dtype (a float32 ``delta`` past a float16 layer's 65504; INT8: its
            dequantized values), or ``delta`` or the layer on the meta device.
            RuntimeError, nothing changed: the layer holds inference tensors (built, compressed or
            loaded under ``torch.inference_mode``) and the call is made outside it.
        """
        # (not the decorator: the INT4 merge warning's stacklevel then reaches the caller)
        with torch.no_grad():
            self._refuse_pending("be updated")
            self._refuse_sharded("be updated")
            R, C = self.out_features, self.in_features
            if not isinstance(delta, torch.Tensor) or tuple(delta.shape) != (R, C) or not delta.is_floating_point():
                raise ValueError(f"delta must be a floating ({R}, {C}) tensor, got "
                                 + (f"{delta.dtype} {tuple(delta.shape)}" if isinstance(delta, torch.Tensor)
                                    else type(delta).__name__))
            refuse_meta(delta, "delta")
            refuse_meta(self, "this layer's weight")
            if not bool(torch.isfinite(delta).all()):
                # (INT4 would round NaN to a code silently: its lowest grid point)
                raise ValueError("delta has NaN or infinite entries (a diverged adapter?); nothing was changed")
            # The tensors written in place below (the decode layout's values and meta after a round trip through
            # layout v1: kept as new ones where inference tensors, see _keep_decode_tensors)
            written = [self.weight] if self._mode == "masked" else \
                [t for t in (self.values if self._layout == "v1" else None,
                             self.scale if self.quantize == "int8" else None) if t is not None]
            if any(t.is_inference() for t in written) and not torch.is_inference_mode_enabled():
                # torch raises only after the copy has written (INT8: new values beside the old scale)
                raise RuntimeError(f"Sparse24Linear(in_features={C}, out_features={R}) holds inference tensors "
                                   "(made under torch.inference_mode), which torch updates in place only inside "
                                   "it: call add_to_kept_ under torch.inference_mode(); nothing was changed")
            # A finite delta may still overflow the layer's dtype (a float32 update into float16): every
            # result is computed out of place and checked as stored, before anything is written.
            if self._mode == "masked":
                new = self.weight + torch.where(self.mask, delta.to(self.weight.dtype), 0)
                _check_merged(torch.where(self.mask, new, 0), "weight", self.dtype)
                self.weight.copy_(new)
                return self
            p = self.sparse_tensor()   # (the decode layout: a copy in layout v1's order, as written below)
            kept = delta.reshape(R, C // 4, 4).gather(-1, p.slots().to(delta.device)).reshape(R, C // 2)
            if self.scale is None:
                new = {"values": p.values + kept.to(p.values.dtype)}
                _check_merged(new["values"], "weight (kept values)", self.dtype)
            elif self.quantize == "int4":   # (its scales do not change: the grid stays in the dtype's range)
                new = {"values": _onto_int4_grid(p, p.dequantized_values(torch.float32) + kept.float(), self)}
            else:
                merged = Sparse24Tensor(p.dequantized_values(torch.float32) + kept.float(), p.meta, p.shape,
                                        torch.float32, check=False)
                q = quantize_values(merged)
                _check_merged(q.dequantized_values(self.dtype), "weight (kept values, dequantized)", self.dtype)
                new = {"values": q.values, "scale": q.scale}
            # (written into the tensors held before: shared memory; a layer in layout v1 keeps its values
            # Parameter, which an optimizer may hold: forward settles it in the same Parameter)
            with self._repacked_in_place(settle=False):
                for name, t in new.items():
                    getattr(self, name).copy_(t)
            return self

    def to_compressed(self, quantize: str | None = None, trainable_values: bool = False, *,
                      group_size: int | None = None, symmetric: bool | None = None) -> "Sparse24Linear":
        """Switch to compressed mode in place (outputs unchanged unless ``quantize``). Returns self.

        The dense weight Parameter is dropped: an optimizer holding it no
        longer trains this layer. ``group_size`` / ``symmetric``: INT4 only (see the class).
        """
        quant = _check_mode("compressed", quantize, trainable_values, group_size, symmetric)
        if self._mode == "compressed":
            if quant != self._quant():
                raise ValueError(f"already compressed with {describe_quant(self._quant())}; call to_masked() first "
                                 f"to re-compress with {describe_quant(quant)}")
            if trainable_values and self._layout == "decode":
                self._convert_layout("v1")  # gradients of the kept values need layout v1
            self.values.requires_grad_(bool(trainable_values))
            self._settle_layout()
            return self
        self._set_compressed(self._compressed_form(quant), trainable_values, self._requires_grad())
        return self

    def _requires_grad(self) -> bool:
        return self.weight.requires_grad if self._mode == "masked" else self._weight_requires_grad

    def _compressed_form(self, quant: dict) -> Sparse24Tensor:
        """The weight as compressed mode holds it (``quant``: :func:`~sparse24.nn.quant_options`);
        changes nothing (so a caller can prepare several layers before switching any)."""
        self._refuse_sharded("be compressed")
        self._finish_if_loaded()   # (a loader's tensors: compressed from them, not dropped for a placeholder)
        if self.pending:  # no values yet: the right shapes, filled when the weights are loaded
            return _placeholder(self.out_features, self.in_features, self.dtype, quant, self.device)
        if self._mode == "compressed":
            return self.sparse_tensor()
        return compress(self.weight.detach(), self.mask, **quant)

    def to_masked(self) -> "Sparse24Linear":
        """Switch to masked mode in place (outputs unchanged). Returns self.

        The mask is read back from the stored slots: a group whose original
        mask kept fewer than 2 entries now keeps 2 (the extra kept entry is 0,
        so outputs do not change, but retraining may grow it). The new weight
        Parameter requires grad unless the layer was frozen.
        """
        if self._mode == "masked":
            return self
        requires_grad = self._weight_requires_grad
        self._refuse_sharded("switch to masked mode")
        self._finish_if_loaded()
        if self.pending:
            R, C = self.out_features, self.in_features
            weight = torch.empty(R, C, dtype=self._dtype, device=self.device)
            self._set_masked(nn.Parameter(weight, requires_grad=requires_grad),
                             torch.empty(R, C, dtype=torch.bool, device=self.device))
            self._mark_uninitialized()
            return self
        p = self.sparse_tensor()
        self._set_masked(nn.Parameter(p.to_dense(), requires_grad=requires_grad), p.kept_mask())
        return self

    # -- forward --
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features)`` -> ``(..., out_features)``, as ``nn.Linear`` with the 2:4 weight.
        Compressed mode takes nested tensors of layout ``torch.jagged`` only (strided: TypeError).
        Unlike ``nn.Linear`` and masked mode (a RuntimeError), compressed mode takes a floating x of
        another dtype than the weight's, computes with the weight cast to it and returns x's dtype (as
        :func:`sparse24.linear`); its errors for a wrong feature count, a 0-d or an integer x are a
        ValueError / TypeError (``nn.Linear``: RuntimeError)."""
        if not torch.compiler.is_compiling() and type(x) is torch.Tensor and not x.is_nested:
            fast = _FAST.get(self)
            fast = None if fast is None else fast.get((x.shape, x.dtype))
            if fast is not None:
                # The plan a call of this shape and dtype launched before, again, where the path below would
                # launch the same plan on the same tensors: the module's tensors (so its mode, layout and
                # dtypes), x's device, no autocast, no autograd, torch's deterministic switch, no config
                # re-read or workspace release since. (Host time is what a decode-sized call costs.)
                plan, values, meta, scale, bias, zero, device, kind, deterministic, epoch, M = fast
                params, buffers = self._parameters, self._buffers
                v, b = params.get("values"), params.get("bias")
                m, sc, z = buffers.get("meta"), buffers.get("scale"), buffers.get("zero")
                # (a tensor that was None must be None, one that was kept the same live object: a reference
                # that died matches nothing)
                if v is not None and v is values() and m is not None and m is meta() \
                        and (sc is None if scale is None else sc is not None and sc is scale()) \
                        and (b is None if bias is None else b is not None and b is bias()) \
                        and (z is None if zero is None else z is not None and z is zero()) \
                        and launch.PLAN_EPOCH[0] == epoch and x.get_device() == device \
                        and self.__dict__.get("_pending") is None and not torch.is_autocast_enabled(kind) \
                        and torch.are_deterministic_algorithms_enabled() is deterministic \
                        and not torch._C._are_functorch_transforms_active() \
                        and (not torch._C._len_torch_dispatch_stack() or not op.counting_flops()) \
                        and not (torch.is_grad_enabled() and (x.requires_grad or v.requires_grad
                                                              or b is not None and b.requires_grad
                                                              or sc is not None and sc.requires_grad)) \
                        and not op.has_tangent(x, v, b, sc):
                    if x.dim() == 2:
                        return plan(x, v, m, sc, b, M, z)
                    return plan(x.reshape(M, x.shape[-1]), v, m, sc, b, M, z).view(*x.shape[:-1], plan.N)
        if self.__dict__.get("_pending") is not None:
            # no finishing here: torch.func.functional_call swaps the caller's tensors in for one call, and
            # finishing would prune them in place and leave this layer half loaded (finish_loading, a move)
            raise RuntimeError(self._pending_message("run"))
        if is_fx_symbolic_tracing() and (self._mode == "masked" or isinstance(x, torch.fx.Proxy)):
            # torch.fx.symbolic_trace: x and the module's tensors are proxies (no control flow on them).
            # make_fx sets the same flag with real (traced) tensors: a compressed layer then takes its
            # forward below, which routes torch.func / forward AD to the reference and applies autocast
            return self._fx_forward(x)
        if self._mode == "masked":
            w, mask = self.weight, self.mask
            if is_dtensor(mask) and not is_dtensor(w):
                # in FSDP2's forward: the weight is gathered, the mask still sharded
                return F.linear(x, torch.where(gather_mask(mask), w, 0), self.bias)
            if w.requires_grad and torch.is_grad_enabled():
                if not torch.compiler.is_compiling():
                    self._hook_if_needed(w)  # one _track_masked could not hook (see there)
                    if mask.is_inference() and not torch.is_inference_mode_enabled():
                        # (made under torch.inference_mode) where() saves its condition for backward, and
                        # torch refuses to save an inference tensor; nn.Linear saves no weight-side tensor
                        mask = mask.clone()
            elif not (torch.compiler.is_compiling() or torch.jit.is_tracing()) and not transformed(w) \
                    and self._zero_where_pruned(w):
                # No gradient for the weight and it is exactly 0 where pruned: the product is the same
                # without the where(), which costs a pass over the whole weight per call (11.8x
                # nn.Linear at M = 1; scripts/bench_hf.py). Not for a weight torch.func transforms or a dual
                # weight of forward-mode AD: its tangent may be nonzero where pruned. Not traced: Dynamo
                # cannot trace transformed() (a graph break per layer), and a traced graph keeps the
                # masking (torch.jit.trace records with gradients on, then checks the graph under no_grad).
                return F.linear(x, w, self.bias)
            return F.linear(x, torch.where(mask, w, 0), self.bias)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.is_nested:
            # the op takes plain tensors: a jagged one's packed values (strided: a TypeError)
            return op.on_jagged(x, self.forward, f"{type(self).__name__}'s input")
        dev = x.device.type
        # (torch has no autocast state for meta: it raises; autocast leaves float64 as it is)
        if dev != "meta" and x.dtype != torch.float64 and torch.is_autocast_enabled(dev):
            # Autocast does not see inside the op: cast explicitly, as it would for F.linear.
            x = x.to(torch.get_autocast_dtype(dev))
            with torch.autocast(dev, enabled=False):
                return self._compressed_forward(x)
        return self._compressed_forward(x)

    def _fx_forward(self, x):
        """forward as torch.fx.symbolic_trace records it: the masked product, or the registered op on
        the compressed tensors (``torch.ops.sparse24.linear``; the graph reads the module's tensors)."""
        if self._mode == "masked":
            return F.linear(x, torch.where(self.mask, self.weight, 0), self.bias)
        if isinstance(x, torch.fx.Proxy) and getattr(x.tracer, "root", None) is self:
            # the GraphModule built from a traced root copies its buffers, and its own `meta` dict then
            # fails on ours (a bare TypeError from torch after the whole trace)
            raise TypeError("torch.fx.symbolic_trace of a compressed Sparse24Linear alone: its 'meta' buffer "
                            "clashes with GraphModule.meta; trace a module holding it (nn.Sequential(layer))")
        return torch.ops.sparse24.linear(x, self.values, self.meta, self.scale, self.zero, self.bias, self._dtype,
                                         "auto", self.out_features, self._group_size or 0)

    def _zero_where_pruned(self, w: torch.Tensor) -> bool:
        """True if ``w`` is 0 at every pruned position, checked once per in-place change of
        the weight or the mask (torch's version counters) and per new data set through ``.data =``
        (e.g. by vector_to_parameters: a new storage, the version counter stays; also one that
        lands at the freed storage's address, see masking.view_key); every call for a CPU weight in
        shared memory. False under tracing, on the meta device, for inference tensors (no version
        counter) and DTensors (no storage of their own)."""
        if torch.compiler.is_compiling() or w.is_meta:
            return False
        m = self.mask
        try:
            # A CPU weight in shared memory (share_memory(), torch.multiprocessing): another process's write
            # bumps no version counter here, so no cache: scanned per call (CUDA tensors count as shared
            # always; writes through CUDA IPC go unseen, see docs/modules.md)
            shared = not w.is_cuda and w.untyped_storage().is_shared()
            seen = None if shared else _ZERO_CHECKED.get(self)
            if seen is not None and still_zero(seen, w, m):
                return True
            key = zero_key(w, m)   # (taken before the scan: a write during it forces the next check)
        except RuntimeError:  # "Inference tensors do not track version counter"; a DTensor's storage
            return False
        with torch.no_grad():
            if bool(torch.where(m, 0, w).any()):
                # forget the old answer: its data pointers, once freed, may come back with other data
                _ZERO_CHECKED.pop(self, None)
                return False
        if not shared:
            _ZERO_CHECKED[self] = key
        return True

    def _compressed_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The module's dicts, not attribute access: nn.Module.__getattr__ costs ~1 us a name,
        # and at decode sizes host time is what a call costs (scripts/bench_host.py).
        params, buffers = self._parameters, self._buffers
        values = params.get("values")
        if values is None:  # an nn.DataParallel replica: torch's replicate() sets its parameters as attributes
            values = self.values
        if values.requires_grad and values.dim() != 2 or values.is_cuda and values.dim() == 2:
            # made trainable since (needs layout v1), or placed on CUDA without .to() (a loader's direct
            # assignment): settle the layout (a no-op where layout v1 is what this layer wants), in the
            # same Parameter (an optimizer may hold it); plans kept for the old data go with it
            if not torch.compiler.is_compiling():
                _settle(self)
                values = self.values
            elif values.requires_grad and values.dim() != 2 and not is_exporting():
                # under torch.compile only a layer made trainable (the op's backward takes layout v1; it
                # reads either layout forward): settled outside the graph, once (one graph break; Dynamo's
                # guards on the values' shape then recompile for layout v1)
                _settle_eagerly(self)
                values = self.values
        linear24.check_input(x, self.in_features, values.device)
        scale = buffers["scale"]
        if scale is not None and scale.dtype != stored_scale_dtype(self._group_size):
            self._check_scale_dtype()   # cast since (a loader's dtype=): the error names the layer and the cause
        # INT4 in the decode layout: bfloat16 scales where exact (LayoutMixin), in eager mode only: a
        # compiled graph cannot see an in-place change of the float16 scales (it kept the stale copy)
        if x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
            copy = self.__dict__.get("_scale_bf16")
            if copy is not None and copy[0] is scale and copy[1] == scale._version and same_view(copy[3], scale):
                scale = copy[2]
        bias, zero, group_size = params.get("bias", _ABSENT), buffers["zero"], self._group_size or 0
        if bias is _ABSENT:  # a replica's, a parametrized one (a property), or none (an attribute None)
            bias = self.bias
        out = linear24.forward(x, values, buffers["meta"], scale, bias, self._dtype, self.out_features, zero=zero,
                               group_size=group_size)
        if not torch.compiler.is_compiling():
            # keep the plan this call launched (if the kernel ran) for the fast path above; not for INT4
            # with bfloat16 x, whose scales are the module's exact copy (checked per call above)
            plan = None if scale is not buffers["scale"] else op.kernel_plan(x, values, scale, bias, self.out_features,
                                                                              zero, group_size)
            if plan is not None:
                entries = _FAST.get(self)
                if entries is None:
                    entries = _FAST[self] = {}
                elif len(entries) >= 16:   # a few shapes (decode batch sizes) a module sees over and over
                    entries.clear()
                # weak references: a kept plan never keeps a moved or replaced weight alive
                entries[(x.shape, x.dtype)] = (
                    plan, weakref.ref(values), weakref.ref(buffers["meta"]), _ref(scale), _ref(bias), _ref(zero),
                    x.get_device(), x.device.type, torch.are_deterministic_algorithms_enabled(), launch.PLAN_EPOCH[0],
                    x.shape[0] if x.dim() == 2 else x.shape[:-1].numel())
        return out

    # -- dtype/device moves: only floating tensors follow a dtype change --
    def _apply(self, fn, recurse=True):
        # A conversion failing part way (out of memory, a swap torch refuses) puts back the tensors and
        # the state this layer held (logical dtype, decode layout); torch may have converted some
        # tensors in place by then (as an nn.Linear's), so the dtype follows unquantized values.
        # A pending layer whose tensors a loader set directly takes them first (accelerate's dispatch_model
        # moves the model after loading it): a mask computed from a dense weight, not left on the meta device.
        self._finish_if_loaded()
        from_meta = self.pending and self._holds_meta()
        snap = self._snapshot()
        held = self._drop_weak_refs()
        try:
            self._convert(fn, recurse)
        except BaseException as e:
            self._restore(snap)
            if self._mode == "compressed" and self.scale is None:
                self._dtype = self.values.dtype
            if from_meta and isinstance(e, NotImplementedError):   # torch's "Cannot copy out of meta tensor"
                raise RuntimeError(self._pending_message("be moved")) from e
            raise
        finally:
            self._rearm(held)
        if from_meta:
            self._mark_uninitialized()   # to_empty: real memory, no weights in it yet
        return self

    def _convert(self, fn, recurse: bool) -> None:
        # ints (meta, INT4 zero points and group size), bools (mask), int8/uint8 values and the
        # scales (fp32 INT8, fp16 INT4) keep their dtype (e.g. under module.half() or
        # module.type(...)); they only change device. Moves and casts act on layout v1 (the
        # layout settles after), so what is kept is taken after that conversion: the decode
        # layout's INT8 values and meta have other dtypes and shapes than layout v1's.
        if self._mode == "compressed" and self._layout == "decode":
            self._convert_layout("v1")
        # From the meta device (to_empty(), the usual re-materialization before a load) the new tensors hold
        # uninitialized memory: packing it (an INT8 byte of -128 was refused) is left to the load's or the
        # first CUDA forward's settling, the layer stays in layout v1 until then
        from_meta = self._mode == "compressed" and self.values.is_meta
        keep = {n: b for n, b in self._buffers.items()
                if b is not None and (n == "scale" or not b.is_floating_point())}
        keep_params = {n: p.detach() for n, p in self._parameters.items()
                       if p is not None and not p.is_floating_point()}
        if self._mode == "compressed":
            probe = fn(torch.empty(0, dtype=self._dtype, device=self.values.device))
            if probe.dtype in FLOAT_DTYPES:
                self._dtype = probe.dtype
        weight_before = self._parameters.get("weight")
        super()._apply(fn, recurse)
        for name, old in keep.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(self._buffers[name].device)
        for name, old in keep_params.items():  # int8 values
            if self._parameters[name].dtype != old.dtype:
                self._parameters[name].data = old.to(self._parameters[name].device)
        if self._mode == "compressed" and self.scale is None:
            self._dtype = self.values.dtype
        if self._mode == "masked" and self.weight is not weight_before:
            self._track_masked()  # new Parameter object (e.g. overwrite_module_params_on_conversion)
        if not from_meta:
            self._settle_layout()

    def _load_from_state_dict(self, *args, **kwargs):
        held = self._drop_weak_refs()
        try:
            super()._load_from_state_dict(*args, **kwargs)
        finally:
            self._rearm(held)

    def _drop_weak_refs(self) -> tuple | None:
        """Before torch.utils.swap_tensors (what conversions and loads do under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``), which refuses a tensor
        that has weak references: drop those sparse24 holds to this layer's tensors (kept plans, the
        zero check, the masked weight's owner entry and gradient hook). Returns what
        :meth:`_rearm` puts back after; None (nothing dropped) when that flag is off."""
        if not torch.__future__.get_swap_module_params_on_conversion():
            return None
        _FAST.pop(self, None)
        _ZERO_CHECKED.pop(self, None)
        w = self._parameters.get("weight")
        if w is None:
            return None
        owner = _GRAD_HOOKED.pop(w, None)
        _unhook(w)
        return w, owner

    def _rearm(self, held: tuple | None) -> None:
        """Undo :meth:`_drop_weak_refs` (``held``: what it returned; None: nothing was dropped): the
        weight Parameter keeps its identity through a swap, its new data needs the hooks again."""
        if held is None:
            return
        w, owner = held
        if owner is not None:
            _GRAD_HOOKED.setdefault(w, owner)  # (a failed call's _restore may have re-armed it already)
        _relink_hooks(w)
        self._hook_if_needed(w)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, "
             f"bias={self.bias is not None}, mode={self._mode}")
        if self._mode == "compressed":
            s += f", dtype={self._dtype}" + (f", {describe_quant(self._quant())}" if self.scale is not None else "")
            s += ", trainable_values=True" if self.values.requires_grad else ""
            s += ", layout=decode" if self._layout == "decode" else ""
        if self.pending:
            s += f", mask pending ({self._pending['method']})"
        return s


def _check_merged(t: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """add_to_kept_: ValueError unless the merged ``t`` (as the layer will hold it) is finite."""
    check_finite(t, f"the merged {what}", f"delta is finite, but W + delta overflows the layer's {dtype} "
                 "(a diverged adapter?); nothing was changed")


def _onto_int4_grid(p: Sparse24Tensor, v: torch.Tensor, layer: "Sparse24Linear") -> torch.Tensor:
    """INT4 bytes ``(R, C/4)`` of kept values ``v`` ``(R, C/2)`` fp32 rounded to the nearest point of
    ``p``'s grid (its scales and zero points; a value past the grid's range goes to its end), with a
    warning, on ``layer``'s first merge, that counts the codes changed and the values clipped."""
    codes, _, _ = int4_quantize(v, p.group_size, p.zero is None, scale=p.scale, zero=p.zero)
    packed = _pack_nibbles(codes)
    if layer not in _INT4_MERGE_WARNED:
        q = Sparse24Tensor(packed, p.meta, p.shape, torch.float32, p.scale, zero=p.zero,
                           group_size=p.group_size, check=False)
        step = p._per_value(p.scale).float()
        err = (q.dequantized_values(torch.float32) - v).abs() / step
        clipped = int((err > 0.5 * (1 + 2.0 ** -20)).sum())  # slack: fp32 rounding of v / scale
        moved = int((codes != p.int4_codes()).sum())
        # stacklevel 3: add_to_kept_'s caller. Once per layer: the counts change per call, so Python's
        # filter would show one per layer per merge (a merge/unmerge loop: one per layer per step)
        warnings.warn(f"INT4 merge onto the layer's own grid (Sparse24Linear(in_features={layer.in_features}, "
                      f"out_features={layer.out_features}); scales and zero points kept): {moved} of "
                      f"{codes.numel()} kept weights changed code, {clipped} clipped at their group's range (error "
                      f"up to {float(err.max()) if err.numel() else 0.0:.3g} steps); updates under half a step round "
                      "away: keep the adapter unmerged for its full effect, or merge into float weights (to_masked(), "
                      "merge, to_compressed(quantize='int4')). Shown on a layer's first merge only", UserWarning,
                      stacklevel=3)
        _INT4_MERGE_WARNED.add(layer)   # (after: a warning turned into an error comes again)
    return packed

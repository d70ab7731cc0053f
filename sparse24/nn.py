"""``Sparse24Linear``: a drop-in ``nn.Linear`` with a 2:4-sparse weight (layer 4).

Two modes, switchable both ways without changing outputs:

* ``"masked"`` (training, the prune-then-retrain recipe): a dense ``weight``
  Parameter plus a frozen bool ``mask`` buffer. Three mechanisms keep the
  pruned weights at exactly zero whatever the training loop does:

  1. forward uses ``where(mask, weight, 0)``, so outputs and the module's own
     gradients are masked even if the stored weight were ever changed;
  2. a gradient hook on the weight Parameter masks its gradient from *every*
     use, also from code that reads ``.weight`` directly (e.g.
     ``nn.MultiheadAttention`` reads ``out_proj.weight``), before clipping or
     the optimizer see it;
  3. a process-wide optimizer step post-hook re-zeroes the pruned entries of
     every masked weight the optimizer just stepped. Zero gradients alone do
     not suffice: momentum or Adam state from dense training, or weight decay
     on a non-zero entry, still move a pruned weight.

  Cost of (1) + (2): a 512x2048x2048 fp32 forward + backward took 1.16x the
  time of ``nn.Linear`` (each alone 1.06-1.09x; 2-core CPU, median of 12, two runs); (3) is
  one masked fill per weight per optimizer step.

* ``"compressed"`` (inference): buffers ``values`` (R, C/2), ``meta`` (the
  packed 2-bit slots) and, for INT8, ``scale`` (R,) fp32, exactly
  :class:`sparse24.Sparse24Tensor`'s tensors; forward is one call of the
  registered op ``sparse24::linear`` (Triton on CUDA, reference on CPU), direct
  (no autograd, no dispatcher) when no gradient is needed. Backward gives input
  gradients, and gradients for the kept values when ``values`` is a Parameter
  (``trainable_values=True``).

State dicts hold plain tensors only (safetensors-compatible); loading checks
the entries and raises a clear error for dense, mismatched or corrupt ones.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .format import FLOAT_DTYPES, Sparse24Tensor, _check_mask24, compress
from .masks import mask_nm, prune_nm
from .ops import linear24

__all__ = ["Sparse24Linear", "MODES", "QUANTIZE"]

MODES = ("masked", "compressed")
QUANTIZE = (None, "int8")


# --- keeping masked weights masked --------------------------------------------------

# Live masked-mode modules, for the optimizer post-hook (weak: never keeps a model alive).
_MASKED_MODULES: "weakref.WeakSet[Sparse24Linear]" = weakref.WeakSet()
# Weight Parameter -> weakref to the module whose gradient hook it carries.
_GRAD_HOOKED = WeakIdKeyDictionary()


def _remask_after_step(optimizer, args, kwargs) -> None:
    """Optimizer step post-hook (every optimizer): re-zero pruned weights."""
    if not _MASKED_MODULES:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    with torch.no_grad():
        for mod in list(_MASKED_MODULES):
            w = mod._parameters.get("weight")
            if w is not None and id(w) in stepped:
                w.masked_fill_(~mod.mask, 0)


register_optimizer_step_post_hook(_remask_after_step)


def _grad_mask_hook(param: nn.Parameter):
    param_ref = weakref.ref(param)

    @torch.utils.hooks.unserializable_hook
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Mask with the mask of the module that currently owns this Parameter
        # as its masked weight (none after densify_ or to_compressed).
        p = param_ref()
        owner = _GRAD_HOOKED.get(p) if p is not None else None
        m = owner() if owner is not None else None
        if m is None or m.__dict__.get("_mode") != "masked" or m._parameters.get("weight") is not p:
            return grad
        return torch.where(m.mask, grad, 0)
    return hook


# --- the module -----------------------------------------------------------------------

def _check_mode(mode, quantize, trainable_values) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if mode == "masked" and quantize is not None:
        raise ValueError("quantize applies to mode='compressed' (masked mode trains the dense weight); "
                         "compress afterwards with to_compressed(quantize=...) / sparse24.compress_")
    if trainable_values and (mode != "compressed" or quantize is not None):
        raise ValueError("trainable_values needs mode='compressed' with floating values (quantize=None)")


def _prune_weight(weight: torch.Tensor, method: str = "magnitude", calibration=None,
                  **mask_kwargs) -> tuple[torch.Tensor | None, torch.Tensor]:
    """2:4-prune one weight with ``method`` (nothing is modified).

    Returns ``(new_weight, mask)``: ``(R, C)`` bool mask and, for methods that
    also reconstruct the kept weights (SparseGPT), the ``(R, C)`` weight to
    store; ``None`` when that is just ``weight * mask`` (no copy kept).
    """
    w = weight.detach()
    if method == "magnitude" and calibration is None:  # the mask is all: no weight copy, no report
        return None, mask_nm(w, 2, 4, **mask_kwargs)
    r = prune_nm(w, 2, 4, method=method, calibration=calibration, **mask_kwargs)
    return (None if torch.equal(r.weight, w * r.mask) else r.weight), r.mask


def _prepare(linear, mask, mode, method, quantize, calibration, trainable_values, mask_kwargs):
    """Validate and compute a swap without changing anything: ``(new_w, mask, p)``
    with ``p`` the compressed weight (compressed mode) or None."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
    _check_mode(mode, quantize, trainable_values)
    w = linear.weight
    if not isinstance(w, nn.Parameter):
        raise ValueError(f"the Linear's weight is a computed tensor ({type(w).__name__}, e.g. a "
                         "parametrization such as SR-STE or weight_norm); remove it first")
    if linear.in_features % 4:
        raise ValueError(f"in_features ({linear.in_features}) must be divisible by 4 for 2:4 sparsity")
    if mask is None:
        new_w, mask = _prune_weight(w, method, calibration, **mask_kwargs)
    else:
        if method != "magnitude" or calibration is not None or mask_kwargs:
            raise ValueError("give either a mask or a method (with its options), not both")
        new_w, mask = None, _check_mask24(mask, w).clone()
    p = None
    if mode == "compressed":
        p = compress(w.detach() if new_w is None else new_w, mask, quantize=quantize)
    return new_w, mask, p


def _mask_from_slots(p: Sparse24Tensor) -> torch.Tensor:
    """``(R, C)`` bool, True at the two stored slots of every group."""
    R, C = p.shape
    keep = torch.zeros(R, C // 4, 4, dtype=torch.bool, device=p.device)
    keep.scatter_(-1, p.slots(), True)
    return keep.view(R, C)


class Sparse24Linear(nn.Module):
    """``nn.Linear`` whose weight is 2:4 sparse, in ``"masked"`` (training) or
    ``"compressed"`` (inference) mode; see the module docstring.

    Build it from an existing layer with :meth:`from_linear`, or directly
    (``Sparse24Linear(in_features, out_features)`` initializes like
    ``nn.Linear`` and prunes by magnitude).

    Args:
        in_features: C, divisible by 4. out_features: R.
        bias: add a learnable bias.
        mode: ``"masked"`` or ``"compressed"``.
        quantize: ``None`` or ``"int8"`` (compressed mode only).
        trainable_values: compressed mode: ``values`` is a Parameter.
        device, dtype: as for ``nn.Linear``.
    Shapes:
        input ``(..., C)`` -> output ``(..., R)``.
    Example:
        >>> layer = Sparse24Linear.from_linear(nn.Linear(64, 32))
        >>> layer(torch.randn(5, 64)).shape
        torch.Size([5, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mode: str = "masked",
                 quantize: str | None = None, trainable_values: bool = False, device=None, dtype=None):
        super().__init__()
        dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._adopt(dense, *_prepare(dense, None, mode, "magnitude", quantize, None, trainable_values, {}),
                    trainable_values)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mask: torch.Tensor | None = None, mode: str = "masked",
                    method: str = "magnitude", quantize: str | None = None, calibration=None,
                    trainable_values: bool = False, **mask_kwargs) -> "Sparse24Linear":
        """Build a Sparse24Linear from ``linear``.

        Masked mode SHARES ``linear``'s weight and bias Parameters (so an
        optimizer holding them keeps working) and zeroes the pruned weights in
        place; compressed mode shares the bias and copies the kept values.

        Args:
            linear: an ``nn.Linear`` (weight ``(R, C)``, ``C % 4 == 0``).
            mask: optional ``(R, C)`` bool 2:4 mask; default: computed by ``method``.
            mode: ``"masked"`` or ``"compressed"``.
            method: mask method for ``sparse24.mask_nm`` / ``sparse24.masks.prune_nm``
                (``"magnitude"``, ``"2d_greedy"``, ``"2d_optimal"``, ``"wanda"``,
                ``"sparsegpt"``; the latter two need ``calibration`` or
                ``act_norm=`` / ``hessian=``). SparseGPT's reconstructed
                weights are stored.
            quantize: ``None`` or ``"int8"`` (compressed mode).
            calibration: this layer's statistics from ``sparse24.calibrate``.
            trainable_values: compressed mode: make ``values`` a Parameter.
            **mask_kwargs: passed to the mask method.
        Returns:
            the new module (``linear`` itself is not replaced; see ``sparsify_``).
        Example:
            >>> lin = nn.Linear(32, 16)
            >>> sp = Sparse24Linear.from_linear(lin, mode="compressed")
            >>> sp.values.shape, sp.meta.shape
            (torch.Size([16, 16]), torch.Size([1, 16]))
        """
        prepared = _prepare(linear, mask, mode, method, quantize, calibration, trainable_values, mask_kwargs)
        return cls._empty()._adopt(linear, *prepared, trainable_values)

    @classmethod
    def _empty(cls) -> "Sparse24Linear":
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        return mod

    def _adopt(self, linear: nn.Linear, new_w, mask, p, trainable_values: bool) -> "Sparse24Linear":
        """Take over ``linear`` with what :func:`_prepare` computed (cannot fail)."""
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._dense_cls = type(linear)  # densify_ restores e.g. MultiheadAttention's out_proj class
        self.bias = linear.bias
        if p is None:
            w = linear.weight
            with torch.no_grad():
                if new_w is None:
                    w.masked_fill_(~mask, 0)
                else:
                    w.copy_(new_w)
            self._set_masked(w, mask)
        else:
            self._set_compressed(p, trainable_values)
        return self

    # -- mode plumbing --
    def _set_masked(self, weight: nn.Parameter, mask: torch.Tensor) -> None:
        for name in ("values", "meta", "scale"):
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        self.__dict__.pop("_dtype", None)
        self.weight = weight
        self.register_buffer("mask", mask)
        self._mode = "masked"
        self._track_masked()

    def _set_compressed(self, p: Sparse24Tensor, trainable_values: bool) -> None:
        self._release()
        for name in ("weight", "mask", "values"):
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        if trainable_values:
            self.values = nn.Parameter(p.values)
        else:
            self.register_buffer("values", p.values)
        self.register_buffer("meta", p.meta)
        self.register_buffer("scale", p.scale)  # None unless int8 (then not in the state dict)
        self._dtype = p.dtype  # logical dtype (differs from values' when int8)
        self._mode = "compressed"

    def _track_masked(self) -> None:
        """Register for the optimizer post-hook and make this module the owner
        of its weight's gradient hook (hooking each Parameter once)."""
        _MASKED_MODULES.add(self)
        w = self.weight
        if w not in _GRAD_HOOKED:
            w.register_hook(_grad_mask_hook(w))
        _GRAD_HOOKED[w] = weakref.ref(self)

    def _release(self) -> None:
        """Stop masking this module's weight (its Parameter is handed to someone else)."""
        _MASKED_MODULES.discard(self)
        w = self._parameters.get("weight")
        if w is not None and w in _GRAD_HOOKED and _GRAD_HOOKED[w]() is self:
            del _GRAD_HOOKED[w]

    def __setstate__(self, state):
        # deepcopy / unpickle: hooks are not copied; re-arm them on the new objects.
        super().__setstate__(state)
        if self.__dict__.get("_mode") == "masked":
            self._track_masked()

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
        return self._mode

    @property
    def quantize(self) -> str | None:
        return "int8" if self._mode == "compressed" and self.scale is not None else None

    @property
    def dtype(self) -> torch.dtype:
        """Logical weight dtype (the dequantized dtype when int8)."""
        return self.weight.dtype if self._mode == "masked" else self._dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device if self._mode == "masked" else self.values.device

    def sparse_tensor(self) -> Sparse24Tensor:
        """The weight as a :class:`Sparse24Tensor` (views of the buffers in compressed mode)."""
        if self._mode == "masked":
            return compress(self.weight.detach(), self.mask)
        return Sparse24Tensor(self.values.detach(), self.meta, (self.out_features, self.in_features),
                              self._dtype, self.scale, check=False)

    def dense_weight(self) -> torch.Tensor:
        """``(R, C)`` dense weight with zeros at the pruned positions (a new, detached tensor;
        dequantized when int8)."""
        if self._mode == "masked":
            return torch.where(self.mask, self.weight.detach(), 0)
        return self.sparse_tensor().to_dense()

    def to_compressed(self, quantize: str | None = None, trainable_values: bool = False) -> "Sparse24Linear":
        """Switch to compressed mode in place (outputs unchanged unless ``quantize``). Returns self.

        The dense weight Parameter is dropped: an optimizer holding it no
        longer trains this layer.
        """
        _check_mode("compressed", quantize, trainable_values)
        if self._mode == "compressed":
            if quantize != self.quantize:
                raise ValueError(f"already compressed with quantize={self.quantize!r}; call to_masked() first "
                                 f"to re-compress with quantize={quantize!r}")
            if trainable_values == isinstance(self.values, nn.Parameter):
                return self
        self._set_compressed(self._compressed_form(quantize), trainable_values)
        return self

    def _compressed_form(self, quantize: str | None) -> Sparse24Tensor:
        """The weight as compressed mode holds it; changes nothing (so a caller can
        prepare several layers before switching any)."""
        if self._mode == "compressed":
            return self.sparse_tensor()
        return compress(self.weight.detach(), self.mask, quantize=quantize)

    def to_masked(self) -> "Sparse24Linear":
        """Switch to masked mode in place (outputs unchanged). Returns self.

        The mask is read back from the stored slots: a group whose original
        mask kept fewer than 2 entries now keeps 2 (the extra kept entry is 0,
        so outputs do not change, but retraining may grow it).
        """
        if self._mode == "masked":
            return self
        p = self.sparse_tensor()
        self._set_masked(nn.Parameter(p.to_dense()), _mask_from_slots(p))
        return self

    # -- forward --
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features)`` -> ``(..., out_features)``, as ``nn.Linear`` with the 2:4 weight."""
        if self._mode == "masked":
            return F.linear(x, torch.where(self.mask, self.weight, 0), self.bias)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Autocast does not see inside the op: cast explicitly, as it would for F.linear.
            x = x.to(torch.get_autocast_dtype(dev))
            with torch.autocast(dev, enabled=False):
                return self._compressed_forward(x)
        return self._compressed_forward(x)

    def _compressed_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The module's dicts, not attribute access: nn.Module.__getattr__ costs ~1 us a name,
        # and at decode sizes host time is what a call costs (scripts/bench_host.py).
        params, buffers = self._parameters, self._buffers
        values = buffers["values"] if "values" in buffers else params["values"]
        linear24.check_input(x, self.in_features, values.device)
        return linear24.forward(x, values, buffers["meta"], buffers["scale"], params.get("bias"), self._dtype)

    # -- dtype/device moves: only floating tensors follow a dtype change --
    def _apply(self, fn, recurse=True):
        # ints (meta), bools (mask), int8 values and the fp32 INT8 scales keep their dtype
        # (e.g. under module.half() or module.type(...)); they only change device.
        keep = {n: b for n, b in self._buffers.items()
                if b is not None and (n == "scale" or not b.is_floating_point())}
        if self._mode == "compressed":
            probe = fn(torch.empty(0, dtype=self._dtype, device=self.values.device))
            if probe.dtype in FLOAT_DTYPES:
                self._dtype = probe.dtype
        weight_before = self._parameters.get("weight")
        super()._apply(fn, recurse)
        for name, old in keep.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(self._buffers[name].device)
        if self._mode == "compressed" and self.scale is None:
            self._dtype = self.values.dtype
        if self._mode == "masked" and self.weight is not weight_before:
            self._track_masked()  # new Parameter object (e.g. overwrite_module_params_on_conversion)
        return self

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, "
             f"bias={self.bias is not None}, mode={self._mode}")
        if self._mode == "compressed":
            s += f", dtype={self._dtype}" + (", quantize=int8" if self.scale is not None else "")
            s += ", trainable_values=True" if isinstance(self.values, nn.Parameter) else ""
        return s

    # -- checks, state dict --
    def validate(self) -> "Sparse24Linear":
        """Raise ValueError if the sparse state is inconsistent; returns self."""
        R, C = self.out_features, self.in_features
        if self._mode == "masked":
            _check_state_masked(self.weight.detach(), self.mask, (R, C), "")
        else:
            self.sparse_tensor().validate()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        try:
            self._check_state(state_dict, prefix)
        except (ValueError, TypeError) as e:
            error_msgs.append(f"{prefix[:-1] or 'Sparse24Linear'}: {e}")
            return  # nothing of this module changes
        weight_before = self._parameters.get("weight")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self._mode == "masked" and self.weight is not weight_before:
            self._track_masked()  # load_state_dict(assign=True) installs new Parameters

    def _check_state(self, sd: dict, prefix: str) -> None:
        """Validate this layer's entries of a state dict before anything is copied."""
        R, C = self.out_features, self.in_features
        has = {k for k in ("weight", "mask", "values", "meta", "scale") if prefix + k in sd}
        for k in has:
            if not isinstance(sd[prefix + k], torch.Tensor):
                raise TypeError(f"'{prefix}{k}' must be a tensor, got {type(sd[prefix + k]).__name__}")
        quantized = self.quantize is not None
        want = {"weight", "mask"} if self._mode == "masked" else {"values", "meta"} | ({"scale"} if quantized else set())
        if has == want:
            pass
        elif has == {"weight"}:
            raise ValueError(f"got a dense checkpoint ('{prefix}weight' without a 2:4 mask) for a 2:4 layer in "
                             f"{self._mode} mode; load dense weights before sparsify_, or into a densify_'d model")
        elif self._mode == "compressed" and has == {"weight", "mask"}:
            raise ValueError("got a masked-mode checkpoint (weight + mask) for a compressed layer; load it "
                             "into the masked model, then compress_ (or decompress_ this model first)")
        elif self._mode == "masked" and has >= {"values", "meta"}:
            raise ValueError("got a compressed checkpoint (values + meta) for a masked-mode layer; "
                             "compress_ this model before loading (or decompress_ it after)")
        elif "scale" in has and not quantized:
            raise ValueError("got an INT8 checkpoint (values + scale) for an unquantized layer; "
                             "build the model with quantize='int8'")
        elif quantized and "scale" not in has:
            raise ValueError("this layer is INT8-quantized but the checkpoint has no scale: it is not INT8")
        elif not has:
            return  # entries missing altogether: nn.Module reports missing keys (strict mode)
        elif not has >= want:
            # Loading part of the set (e.g. a mask alone) would pair it with the old tensors unchecked.
            raise ValueError(f"incomplete 2:4 entries: got {sorted(has)}, a {self._mode} layer needs all of "
                             f"{sorted(want)} (or none)")
        # else: all wanted entries plus extras (reported as unexpected by nn.Module): check the wanted ones
        if self._mode == "masked":
            _check_state_masked(sd[prefix + "weight"], sd[prefix + "mask"], (R, C), prefix)
            return
        values, meta, scale = sd[prefix + "values"], sd[prefix + "meta"], sd.get(prefix + "scale")
        if not quantized and not values.is_floating_point():
            raise TypeError(f"'{prefix}values' must be floating point for an unquantized layer, got {values.dtype}")
        if quantized and values.dtype != torch.int8:
            raise TypeError(f"'{prefix}values' must be int8 for an INT8 layer, got {values.dtype}")
        dtype = None if scale is None else self._dtype
        Sparse24Tensor(values, meta, (R, C), dtype, scale).validate()  # shapes, dtypes, corrupt slots


def _check_state_masked(weight: torch.Tensor, mask: torch.Tensor, shape, prefix: str) -> None:
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"'{prefix}weight' has shape {tuple(weight.shape)}, expected {tuple(shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"'{prefix}weight' must be floating point, got {weight.dtype}")
    if mask.device != weight.device:
        mask = mask.to(weight.device)
    _check_mask24(mask, weight)
    if bool((weight.detach()[~mask] != 0).any()):
        raise ValueError(f"'{prefix}weight' is non-zero where '{prefix}mask' is False: not a 2:4 masked weight")


def compressed_nbytes(out_features: int, in_features: int, element_size: int, quantized: bool = False) -> int:
    """Bytes of a compressed ``(R, C)`` weight: values + 2-bit indices (+ fp32 scales if INT8)."""
    R, C = out_features, in_features
    half = R * (C // 2)
    return half * (1 if quantized else element_size) + half * 2 // 8 + (4 * R if quantized else 0)


def memory_nbytes(mod: Sparse24Linear) -> int:
    """Bytes the module holds for its weight now (masked: dense weight + bool mask)."""
    if mod.mode == "masked":
        return mod.weight.numel() * mod.weight.element_size() + mod.mask.numel()
    return sum(t.numel() * t.element_size() for t in (mod.values, mod.meta, mod.scale) if t is not None)


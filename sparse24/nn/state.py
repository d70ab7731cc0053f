"""How a :class:`~sparse24.nn.Sparse24Linear` enters and leaves a state dict:
its entries are checked before anything is copied (dense, masked, compressed,
INT8 and INT4 checkpoints are told apart; a partial, mismatched or corrupt one is a
clear error), a layer whose mask is pending (built on the meta device) computes
it from the dense weight that arrives, and compressed entries are always
layout v1. Kept apart from the class only for length: these methods read and
write the module's own state."""
from __future__ import annotations

import sys
import weakref

import torch
from torch.nn.utils import parametrize

from .._checks import FLOAT_DTYPES, check_finite, computable, local_piece
from ..format import Sparse24Tensor, _check_mask24, compress, is_nm
from . import prepare
from .prepare import is_conv1d_class
from .sharded import agree, is_dtensor, local_pair, shard_like

__all__ = ["check_state", "StateDictMixin", "compressed_entries", "guard_loading"]


# A compressed layer's entries by quantization (INT4 asymmetric adds "zero").
_COMPRESSED_KEYS = {None: {"values", "meta"}, "int8": {"values", "meta", "scale"},
                    "int4": {"values", "meta", "scale", "group_size"}}
_ALL_KEYS = ("weight", "mask", "values", "meta", "scale", "zero", "group_size")


def _wanted(self) -> set:
    if self._mode == "masked":
        # A parametrized weight (torch.nn.utils.parametrize, e.g. SR-STE) is saved as its original(s), a child's
        # entries ("parametrizations.weight.original"), which may be dense: the mask is the layer's own entry.
        return {"mask"} if parametrize.is_parametrized(self, "weight") else {"weight", "mask"}
    return _COMPRESSED_KEYS[self.quantize] | ({"zero"} if self.symmetric is False else set())


def _quant_mismatch(self, has: set) -> str | None:
    """Why a compressed checkpoint holding the entries ``has`` does not fit this compressed layer
    (INT8 vs INT4 vs unquantized, symmetric vs not), or None."""
    theirs = "int4" if "group_size" in has else "int8" if "scale" in has else None
    names = {None: "an unquantized", "int8": "an INT8", "int4": "an INT4"}
    hint = {None: "without quantize", "int8": "with quantize='int8'", "int4": "with quantize='int4' and its group_size"}
    if theirs != self.quantize:
        if self.quantize and "scale" not in has:
            return f"this layer is {self.quantize.upper()}-quantized but the checkpoint has no scale: it is not " \
                   f"{self.quantize.upper()}"
        return f"got {names[theirs]} checkpoint ({' + '.join(sorted(has & {'values', 'scale', 'group_size'}))}) " \
               f"for {names[self.quantize]} layer; build the model {hint[theirs]}"
    if theirs == "int4" and ("zero" in has) == self.symmetric:
        return ("got an asymmetric INT4 checkpoint (with zero points) for a symmetric INT4 layer; build it with "
                "symmetric=False") if self.symmetric else ("got a symmetric INT4 checkpoint (no zero points) for an "
                                                            "asymmetric INT4 layer; build it with symmetric=True")
    return None


def check_state(self, sd: dict, prefix: str) -> None:
    """Validate this layer's entries of a state dict before anything is copied. A non-strict call
    may bring part of them (see :func:`_check_part`)."""
    has = {k for k in _ALL_KEYS if prefix + k in sd}
    for k in has:
        if not isinstance(sd[prefix + k], torch.Tensor):
            raise TypeError(f"'{prefix}{k}' must be a tensor, got {type(sd[prefix + k]).__name__}")
    if _is_own_marker(self, sd, prefix + "weight", prefix):
        # A compressed layer's marker (sparse24.hf), taken and ignored (a shard may hold it apart from the
        # layer's entries): no entry of the layer, strict or not.
        has.discard("weight")
    want = _wanted(self)
    if has == want:
        pass
    elif not has:
        return  # entries missing altogether: nn.Module reports missing keys (strict mode)
    elif has == {"weight"} and not (self._mode == "masked" and _non_strict_call()
                                    and _is_24(sd[prefix + "weight"], self)):  # (a shard's part of a masked layer)
        raise ValueError(f"got a dense checkpoint ('{prefix}weight' without a 2:4 mask) for a 2:4 layer in "
                         f"{self._mode} mode; load dense weights before sparsify_, or into a densify_'d model")
    elif self._mode == "compressed" and has == {"weight", "mask"}:
        raise ValueError("got a masked-mode checkpoint (weight + mask) for a compressed layer; load it "
                         "into the masked model, then compress_ (or decompress_ this model first)")
    elif self._mode == "masked" and has >= {"values", "meta"}:
        raise ValueError("got a compressed checkpoint (values + meta) for a masked-mode layer; compress_ this "
                         "model before loading (or decompress_ it after). If compress_ keeps this layer masked (its "
                         "report: 'kept in masked mode': its parent reads .weight directly), it takes no compressed "
                         "entries: the checkpoint was written for a model without that reader (`python -m sparse24 "
                         "prune` of a raw state dict sees no code); prune this model itself instead (sparsify_, or "
                         "`prune` of its Hugging Face folder)")
    elif self._mode == "compressed" and has >= {"values", "meta"} and _quant_mismatch(self, has) and not (
            has < want and _non_strict_call()):  # (a shard may end right after meta: _check_part checks the part)
        raise ValueError(_quant_mismatch(self, has))
    elif self._mode == "masked" and has & {"scale", "zero", "group_size"}:
        raise ValueError(f"got a quantized checkpoint ({', '.join(sorted(has & {'scale', 'zero', 'group_size'}))}) "
                         "for a masked-mode layer; compress_ this model with its quantization before loading")
    elif not has >= want:
        if has <= want and _non_strict_call():
            _check_part(self, sd, prefix, has, want)
            return
        # Loading part of the set (e.g. a mask alone) would pair it with the old tensors unchecked.
        raise ValueError(f"incomplete 2:4 entries: got {sorted(has)}, a {self._mode} layer needs all of "
                         f"{sorted(want)} (or none)")
    # else: all wanted entries plus extras (reported as unexpected by nn.Module): check the wanted ones
    _check_set(self, sd, prefix, want)


def _check_part(self, sd: dict, prefix: str, has: set, want: set) -> None:
    """A non-strict call bringing part of this layer's 2:4 entries (``has``): a sharded checkpoint
    loaded one shard per call (transformers' ``load_sharded_checkpoint``, so ``Trainer``'s resume),
    whose boundaries fall between a layer's entries. The part is taken when, with the layer's own
    other entries, it makes a valid 2:4 layer (a weight zero where the layer's mask is False, a mask
    its weight fits, values beside the meta), and refused otherwise: each call stays all or nothing
    and no state is kept between calls. (Stashing a part until the rest arrives would also take a
    checkpoint whose masks differ from the layer's, refused here, but would leave a layer holding
    tensors from a call that never completes.)"""
    own = {} if self._holds_meta() else _local_state(self)
    if not own:
        why = "it holds no weights yet: built on the meta device"
    elif any(is_dtensor(t) or t.is_meta for t in [*(sd[prefix + k] for k in has), *own.values()]):
        why = "sharded (DTensor) or meta entries are checked as a whole set only"
    else:
        device = sd[prefix + min(has)].device
        candidate = {prefix + k: own[k].detach().to(device) for k in want - has} | {prefix + k: sd[prefix + k]
                                                                                     for k in has}
        try:
            _check_set(self, candidate, prefix, want)
            return
        except (ValueError, TypeError) as e:
            why = str(e)
    kind = _quant_mismatch(self, has) if self._mode == "compressed" else None
    raise ValueError(f"incomplete 2:4 entries: got {sorted(has)} without {sorted(want - has)}, and with this layer's "
                     f"own they are not a valid 2:4 layer ({why}); a non-strict load takes part of a layer's entries "
                     f"only when they are: load all of {sorted(want)} in one call"
                     + (f" (if these are all the entries: {kind})" if kind else ""))


def _is_24(w: torch.Tensor, layer) -> bool:
    """Whether ``w`` may be a masked 2:4 layer's weight (of ``layer``'s shape, at most 2 non-zeros in
    each group of 4), not a dense one."""
    R, C = layer.out_features, layer.in_features
    if is_dtensor(w) or w.is_meta or not w.is_floating_point() or tuple(w.shape) != (R, C):
        return False
    return is_nm(computable(w), 2, 4)


def _is_marker(t) -> bool:
    """Whether ``t`` is the one-byte ``<layer>.weight`` marker saved beside a compressed layer's
    entries (see :mod:`sparse24.hf`)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and tuple(t.shape) == (1,)


def _is_own_marker(layer, sd: dict, key: str, prefix: str) -> bool:
    """Whether ``sd[key]`` is compressed ``layer``'s own marker (``prefix + "weight"``). The layer takes
    it and ignores it: a saved folder's tensors (Trainer's resume, a strict ``load_state_dict`` of its
    ``model.safetensors``) hold one per compressed layer, which has no ``weight`` entry, and torch and
    the strict checks would report it as unexpected. A dense weight there is still refused."""
    return key == prefix + "weight" and isinstance(layer, StateDictMixin) and layer._mode == "compressed" \
        and _is_marker(sd.get(key))


def _check_set(self, sd: dict, prefix: str, want: set) -> None:
    """Check a whole set of this layer's 2:4 entries (``want``, all in ``sd``)."""
    R, C = self.out_features, self.in_features
    quantized = self.quantize is not None
    if self._mode == "masked" and want == {"mask"}:
        _check_mask_alone(sd[prefix + "mask"], (R, C), prefix)
        return
    if self._mode == "masked":   # (its weight checked finite there, after a sharded pair's gather)
        _check_state_masked(sd[prefix + "weight"], sd[prefix + "mask"], (R, C), prefix, _CORRUPT)
        return
    _check_finite_entries(sd, prefix, sorted(want))
    values, meta, scale = sd[prefix + "values"], sd[prefix + "meta"], sd.get(prefix + "scale")
    if not quantized and not values.is_floating_point():
        raise TypeError(f"'{prefix}values' must be floating point for an unquantized layer, got {values.dtype}")
    if self.quantize == "int8" and values.dtype != torch.int8:
        raise TypeError(f"'{prefix}values' must be int8 for an INT8 layer, got {values.dtype}")
    if self.quantize == "int4":
        check_int4_entries(sd[prefix + "group_size"], scale, self._group_size, prefix)
    dtype = None if scale is None else self._dtype
    # shapes, dtypes, corrupt slots and zero points
    Sparse24Tensor(values, meta, (R, C), dtype, scale, zero=sd.get(prefix + "zero"), group_size=self._group_size)


def _make_contiguous(layer) -> None:
    """``load_state_dict(assign=True)`` installs the file's tensors as they are; the kernels and the
    decode layout (held on CUDA) read the compressed ones as contiguous arrays."""
    for table in (layer._parameters, layer._buffers):
        for name in ("values", "meta", "scale", "zero"):
            t = table.get(name)
            if t is not None and not t.is_contiguous():
                table[name] = (torch.nn.Parameter(t.contiguous(), requires_grad=t.requires_grad)
                               if isinstance(t, torch.nn.Parameter) else t.contiguous())


def check_int4_entries(group_size: torch.Tensor, scale: torch.Tensor, expected: int, prefix: str = "") -> None:
    """An INT4 layer's ``group_size`` entry (a 0-d integer tensor equal to the layer's group size)
    and its scales (positive: the quantizers never write 0 or a negative scale, so one is a corrupt
    file). Shapes and dtypes are checked by :class:`~sparse24.format.Sparse24Tensor`."""
    if group_size.dim() != 0 or group_size.dtype not in (torch.int32, torch.int64) or group_size.is_meta:
        raise ValueError(f"'{prefix}group_size' must be a 0-d int32 tensor holding the INT4 group size, got "
                         f"{group_size.dtype} of shape {tuple(group_size.shape)}")
    if int(group_size) != expected:
        raise ValueError(f"the checkpoint's INT4 group size is {int(group_size)}, this layer's is {expected}; build "
                         f"the model with group_size={int(group_size)}")
    # float16 only: Sparse24Tensor refuses other dtypes after, and float8 has no comparison kernel on
    # CPU (its error named no entry; found by fuzzing)
    if scale.dtype == torch.float16 and not scale.is_meta and bool((scale <= 0).any()):
        r, k = (int(i) for i in (scale <= 0).nonzero()[0])
        raise ValueError(f"corrupt INT4 scales: '{prefix}scale'[{r}, {k}] is {float(scale[r, k])}, not positive")


def compressed_entries(p: Sparse24Tensor) -> dict[str, torch.Tensor]:
    """The state-dict entries of a compressed :class:`~sparse24.nn.Sparse24Linear` holding ``p``:
    ``p.state_tensors()`` plus, for INT4, the 0-d int32 ``group_size`` entry.

    Example:
        >>> sorted(compressed_entries(sparse24.compress(torch.randn(8, 64), quantize="int4")))
        ['group_size', 'meta', 'scale', 'values']
    """
    entries = p.state_tensors()
    if p.group_size is not None:
        entries["group_size"] = torch.tensor(p.group_size, dtype=torch.int32, device=p.device)
    return entries


_CORRUPT = "a corrupt or diverged checkpoint"


def _check_finite_entries(sd: dict, prefix: str, keys) -> None:
    """A checkpoint's floating entries must be finite: inf/NaN values (a corrupt file, a diverged
    run) would load without a word and spread to every output."""
    for k in keys:
        check_finite(sd[prefix + k], f"'{prefix}{k}'", _CORRUPT)


def _check_entries(self, sd: dict, prefix: str) -> None:
    """:func:`check_state` and :func:`_check_whole`. A sharded (DTensor) entry is checked on each rank's
    own piece, so a corrupt part may fail on some ranks only: one agreement over the mesh then makes
    every rank raise (sharded.agree; a rank left out would wait in the next collective, a hang under
    NCCL). Every rank checks the same layers with the same kinds of entries, so each makes the same
    collectives; a plain state dict makes none."""
    sharded = [sd[prefix + k] for k in _ENTRY_NAMES if is_dtensor(sd.get(prefix + k))]
    error = None
    try:
        check_state(self, sd, prefix)
        _check_whole(self, sd, prefix)
    except Exception as e:
        if not sharded:
            raise
        error = e
        if not isinstance(e, (ValueError, TypeError)):   # (an unforeseen failure on one rank: agreed all the same)
            error = ValueError(f"{type(e).__name__}: {e}")
            error.__cause__ = e
    if sharded:
        agree(error, sharded[0])


def stored_scale_dtype(group_size) -> torch.dtype:
    """The dtype sparse24 stores a quantized layer's scales in: float16 for INT4 (``group_size`` set),
    float32 for INT8."""
    return torch.float16 if group_size else torch.float32


def _not_loaded(layer, own: dict | None = None) -> list:
    """The names of a pending ``layer``'s entries still on the meta device (``own``: its
    :func:`_local_state`), a masked layer's mask aside where its weight is loaded (a dense weight:
    the mask is computed from it)."""
    own = _local_state(layer) if own is None else own
    dense = layer._mode == "masked" and "weight" in own and not own["weight"].is_meta
    return [n for n, t in own.items() if t.is_meta and not (dense and n == "mask")]


def _check_whole(self, sd: dict, prefix: str) -> None:
    """All of this layer's entries load or none, the bias with the 2:4 set (found by fuzzing:
    tests/tools/test_fuzz.py): torch copies entry by entry and reports a bad or missing bias
    at the end, which left new 2:4 values beside the old bias. As for the 2:4 set, this holds
    with ``strict=False`` too for a whole 2:4 set; a part of one (a shard's) may come without it."""
    # (names only: a decode-layout layer's state_dict() re-orders its tensors to layout v1, ~80 ms for a
    # 2048x2048 INT8 layer on a CPU, and a non-strict load of other modules' entries comes through here)
    own = _local_names(self) + [f"{n}.{k}" for n, c in self._modules.items() if c is not None
                                for k in c.state_dict(keep_vars=True)]
    given = [k for k in own if prefix + k in sd]
    # A non-strict call may bring part of a 2:4 set (check_state checked it), with or without the bias:
    # a checkpoint saved in state-dict order keeps the bias between the 2:4 entries (weight, bias, mask),
    # so a shard holding a whole set holds its bias too.
    # (a parametrized weight's originals belong to the set, though only its mask is checked)
    whole_set = _wanted(self) | {k for k in own if k.startswith("parametrizations.weight.original")} <= set(given)
    if given and len(given) < len(own) and (whole_set or not _non_strict_call()):
        raise ValueError(f"missing {', '.join(repr(prefix + k) for k in own if k not in given)} beside "
                         f"{', '.join(repr(prefix + k) for k in given)}: a layer loads all its entries or none")
    if self.bias is not None and prefix + "bias" in sd:
        bias = sd[prefix + "bias"]
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"'{prefix}bias' must be a tensor, got {type(bias).__name__}")
        if bias.shape != self.bias.shape:
            raise ValueError(f"'{prefix}bias' has shape {tuple(bias.shape)}, expected {tuple(self.bias.shape)}")
        if bias.is_complex():   # torch would drop the imaginary part with a warning (found by fuzzing)
            raise TypeError(f"'{prefix}bias' must be real, got {bias.dtype}")
        _check_finite_entries(sd, prefix, ["bias"])


def _check_state_masked(weight: torch.Tensor, mask: torch.Tensor, shape, prefix: str, why: str | None = None) -> None:
    """A masked layer's weight and mask; ``why`` given: the weight is checked finite too (the message's why)."""
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"'{prefix}weight' has shape {tuple(weight.shape)}, expected {tuple(shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"'{prefix}weight' must be floating point, got {weight.dtype}")
    # Sharded (FSDP2): each rank checks its own rows, or the gathered whole where shards split 2:4 groups;
    # gathered first, before any check that may fail on one rank only, so every rank makes the same collectives.
    pair = local_pair(weight, mask, whole_groups=True)
    row0 = 0 if pair[0].shape == weight.shape else local_piece(weight)[1][0]  # (own rows: where they start)
    if why is not None:
        check_finite(weight, f"'{prefix}weight'", why)   # (a DTensor: its own piece, no communication)
    weight, mask = pair
    if mask.device != weight.device:
        mask = mask.to(weight.device)
    _check_mask24(mask, weight, row0)
    if bool(((computable(weight) != 0) & ~mask).any()):
        raise ValueError(f"'{prefix}weight' is non-zero where '{prefix}mask' is False: not a 2:4 masked weight")


def _check_mask_alone(mask: torch.Tensor, shape, prefix: str) -> None:
    """A parametrized weight's mask: shape, dtype and the 2:4 pattern. Nothing ties it to the saved
    original, which may be dense (SR-STE's is): forward applies the mask to the parametrization's output."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"'{prefix}mask' has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if is_dtensor(mask):   # (whole 2:4 groups; every rank gathers, so all make the same collectives)
        mask = mask.full_tensor()
    _check_mask24(mask, torch.zeros((), device=mask.device).expand(shape))   # (a weight's shape, no memory)


class StateDictMixin:
    """Validation, state-dict saving and loading of :class:`~sparse24.nn.Sparse24Linear`."""

    def validate(self) -> "StateDictMixin":
        """Raise ValueError if the sparse state is inconsistent; returns self."""
        self._finish_if_loaded()
        if self.pending:
            raise ValueError("the 2:4 mask is pending: the layer was built on the meta device and no weights "
                             "were loaded yet")
        R, C = self.out_features, self.in_features
        if self._mode == "masked":
            _check_state_masked(self.weight.detach(), self.mask, (R, C), "")
        else:
            self._check_scale_dtype()
            if self.quantize == "int4":
                check_int4_entries(self.group_size, self.scale, self._group_size)
            self.sparse_tensor().validate()
        _check_finite_entries(dict(self.named_parameters(recurse=False)) | dict(self.named_buffers(recurse=False)),
                              "", [k for k in ("weight", "values", "scale", "bias") if getattr(self, k, None) is not None])
        return self

    def _finish_loading(self, trainable_values: bool = False) -> None:
        """After a loader assigned this layer's tensors directly (Hugging Face's
        ``from_pretrained`` sets attributes, bypassing ``load_state_dict``, and makes every
        floating one a Parameter requiring grad): check them, clear the pending mask,
        freeze the compressed values unless ``trainable_values``, re-register the masking.
        Raises ValueError on corrupt ones."""
        self._pending = None
        if self._mode == "compressed":
            self.__dict__.pop("weight", None)  # a loader's stand-in (see sparse24.hf)
            self.values.requires_grad_(bool(trainable_values) and self.values.is_floating_point())
            if self.scale is None:
                self._dtype = self.values.dtype
        try:
            self.validate()
        except ValueError as e:
            raise ValueError(f"corrupt 2:4 layer ({self.out_features}x{self.in_features}, {self._mode}): {e}") from None
        if self._mode == "masked":
            self._track_masked()
        self._settle_layout()

    def finish_loading(self) -> "StateDictMixin":
        """Take the tensors a loader set directly into this layer, built on the meta device with its
        mask pending: a loader that bypasses ``load_state_dict``, such as accelerate's
        ``load_checkpoint_in_model`` / ``load_checkpoint_and_dispatch`` (``set_module_tensor_to_device``).

        The layer does this by itself at a move (``.to()``, e.g. ``dispatch_model``'s), ``validate()``,
        ``compress_`` / ``to_masked`` or a read of its weight once every tensor is set, but not in its
        forward (which refuses until then: ``torch.func.functional_call`` swaps tensors in for one
        call, which are not a load, and must not be pruned in place), and not where it was re-materialized
        by ``to_empty`` (its memory is then uninitialized, and only this call says a loader has filled it
        since). For a whole model: ``for m in model.modules(): if isinstance(m, Sparse24Linear):
        m.finish_loading()``. They are checked
        as ``load_state_dict`` checks a checkpoint's entries: a 2:4 set (``weight`` + ``mask``, or
        ``values`` + ``meta`` (+ ``scale``, ``zero``, ``group_size``)) is taken as it is; a masked layer
        holding a dense ``weight`` (its mask still on the meta device: the checkpoint had none) gets
        its mask computed by the method it was sparsified with, and its pruned weights zeroed in place.
        Does nothing when no mask is pending.

        Returns:
            self.
        Raises:
            RuntimeError, nothing changed: a tensor still on the meta device (not loaded); a dense weight
            in a layer that replaced a Hugging Face ``Conv1D`` (its checkpoints store ``(in, out)``: a
            square one set directly cannot be told from its transpose); a sharded (DTensor) layer.
            ValueError, nothing changed: the tensors are not a valid 2:4 layer (e.g. INT8 / INT4 scales
            a loader's ``dtype=`` cast).
        """
        if self.pending:
            self._finish_direct_load()
        return self

    def _finish_if_loaded(self) -> None:
        """:meth:`finish_loading` where the layer may decide alone that its tensors were loaded: none is
        on the meta device (a masked layer's mask aside, beside a dense weight) and none is memory that
        ``to_empty`` (or a mode switch while pending) made. Not for a sharded layer (FSDP sets its
        gathered tensors in its forward: they are not a loader's), nor while compiling."""
        pending = self.__dict__.get("_pending")
        if pending is None or pending.get("uninitialized") or self.__dict__.get("_sharded") \
                or torch.compiler.is_compiling() or _not_loaded(self):
            return
        self._finish_direct_load()

    def _finish_direct_load(self) -> None:
        """:meth:`finish_loading` of a pending layer."""
        own = _local_state(self)
        left = _not_loaded(self, own)
        if left:
            raise RuntimeError(self._pending_message("finish loading", left))
        if any(is_dtensor(t) for t in own.values()):
            raise RuntimeError(f"{self._who()} is sharded (DTensor entries): load it with torch.distributed."
                               "checkpoint.state_dict.set_model_state_dict (load_state_dict), which computes or "
                               "checks its 2:4 entries; nothing was changed")
        dense = self._mode == "masked" and own["mask"].is_meta
        if dense and is_conv1d_class(self.__dict__.get("_dense_cls")):
            raise RuntimeError(f"{self._who()} replaced a Hugging Face Conv1D, whose dense checkpoints store the "
                               "weight as (in, out), and its dense weight was set directly (not by load_state_dict): "
                               "a square one cannot be told from its transpose. Load the dense checkpoint with "
                               "load_state_dict (which turns it), or load the dense model first, then sparsify_; "
                               "nothing was changed")
        self._check_scale_dtype()
        sd = {k: t.detach() for k, t in own.items()}
        try:
            if dense:
                del sd["mask"]
                self._fill_from_dense(sd, "")   # (the dense weight -> pruned weight + mask, as a load computes them)
            _check_entries(self, sd, "")
        except (ValueError, TypeError) as e:
            raise ValueError(f"{self._who()}: the tensors a loader set are not a valid 2:4 layer: {e}; nothing was "
                             "changed (its mask is still pending). A dense checkpoint loads with load_state_dict, "
                             "which computes the masks") from None
        if dense:
            with torch.no_grad():
                self.weight.copy_(sd["weight"])   # (the loader's Parameter stays: pruned in place)
            self._buffers["mask"] = sd["mask"]
        self._pending = None
        if self._mode == "masked":
            self._track_masked()   # the loader installed a new weight Parameter
        else:
            _make_contiguous(self)
            self._take_assigned_dtype(None)   # the loaded values' dtype, as assign=True takes it
            self._settle_layout()

    def _pending_message(self, what: str, left: list | None = None) -> str:
        """Why this pending layer cannot do ``what`` yet, and how to load it (``left``: its entries
        still on the meta device; default: found here)."""
        left = _not_loaded(self) if left is None else left
        head = f"{self._who()} was built without weights (meta device), its 2:4 mask pending"
        if left:
            return (f"{head}, and its {', '.join(repr(n) for n in left)} {'is' if len(left) == 1 else 'are'} not "
                    f"loaded (still on the meta device), so it cannot {what} yet: load the weights with "
                    "load_state_dict (from dense weights it computes the mask), or a 2:4 checkpoint that sparse24 "
                    "saved with a loader that sets tensors directly (accelerate's load_checkpoint_in_model / "
                    "load_checkpoint_and_dispatch; a masked layer takes dense weights there too). A dense "
                    "checkpoint for compressed layers (or layers that replaced a Conv1D) needs load_state_dict, "
                    "or load the dense model first, then sparsify_")
        if self._pending.get("uninitialized"):
            return (f"{head}, and its tensors hold uninitialized memory (to_empty, or a mode switch while "
                    f"pending), so it cannot {what} yet: load the weights with load_state_dict (from dense "
                    "weights it computes the mask); if a loader has set its tensors directly since (accelerate's "
                    "load_checkpoint_in_model), call finish_loading() on it")
        return f"{head}, so it cannot {what} yet: call finish_loading() on it once its tensors are loaded"

    def _check_scale_dtype(self) -> None:
        """ValueError naming this layer where its INT8 / INT4 scales are not in the dtype sparse24
        stores them in (float32 / float16): a cast that rounded them (a loader's ``dtype=``, e.g.
        accelerate's ``load_checkpoint_and_dispatch(..., dtype=torch.bfloat16)``), which cannot be undone."""
        scale = self._buffers.get("scale") if self._mode == "compressed" else None
        want = stored_scale_dtype(self.__dict__.get("_group_size"))
        if scale is None or scale.dtype == want:
            return
        kind = "INT4" if want == torch.float16 else "INT8"
        raise ValueError(f"{self._who()}'s {kind} scales are {scale.dtype}, not {want} as sparse24 stores them: "
                         "they were cast (e.g. by a loader's dtype=, such as accelerate's load_checkpoint_and_"
                         "dispatch(..., dtype=...)), which may have rounded them beyond repair. Reload the checkpoint "
                         f"without dtype= (model.to(dtype) after it casts the rest and keeps {kind} scales in {want})")

    def _holds_meta(self) -> bool:
        return any(t is not None and t.is_meta for t in (*self._parameters.values(), *self._buffers.values()))

    def _refuse_sharded_entries(self, state_dict: dict | None, prefix: str) -> None:
        """RuntimeError naming the layer (``prefix``) where it was sharded (fully_shard) holding the decode
        layout and its state-dict entries are made (``state_dict`` None: saving) or brought (its values or
        meta): they are layout v1's, which need the whole decode tensors, of which FSDP holds a piece."""
        if self._mode == "compressed" and self._layout == "decode" \
                and (state_dict is None or prefix + "values" in state_dict or prefix + "meta" in state_dict):
            self._refuse_sharded("give or take state dict entries (layout v1's)", prefix[:-1])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._refuse_sharded_entries(None, prefix)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._mode == "compressed" and self._layout == "decode":  # checkpoints hold layout v1, always
            p = self.sparse_tensor()
            destination[prefix + "values"], destination[prefix + "meta"] = p.values, p.meta

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Entries are layout v1 (see _save_to_state_dict): a decode-layout layer takes them in layout v1, and
        # only when they bring values or meta (the two tensors whose layouts differ; a non-strict load of other
        # modules' entries, as PEFT's adapter load, re-packed every layer). Loaded in place (not assign=True),
        # the re-packed data goes into the tensors held before, as in layout v1 (_keep_decode_tensors).
        try:
            self._refuse_sharded_entries(state_dict, prefix)
        except RuntimeError as e:   # (torch reports error_msgs at the end of the load)
            error_msgs.append(str(e))
            return
        repack = prefix + "values" in state_dict or prefix + "meta" in state_dict
        with self._repacked_in_place(repack, keep=not local_metadata.get("assign_to_params_buffers", False)):
            self._load_v1(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _load_v1(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        try:
            checked, dense_dtype = _already_checked(self, state_dict, prefix)  # by the model's hook (guard_loading)
            if not checked:
                if self.pending and self._has_dense_entry_only(state_dict, prefix):
                    dense_dtype = self._fill_from_dense(state_dict, prefix)  # the weights arrived: compute the mask
                _check_entries(self, state_dict, prefix)
                unexpected = _own_unexpected_keys(self, state_dict, prefix)
                if unexpected:  # torch reports them only after copying
                    error_msgs.append(f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}. ")
                    return
        except (ValueError, TypeError) as e:
            error_msgs.append(f"{prefix[:-1] or 'Sparse24Linear'}: {e}")
            return  # nothing of this module changes
        assign = local_metadata.get("assign_to_params_buffers", False)
        if self._holds_meta():  # copying into meta tensors is a no-op: the loaded tensors must be taken as they are
            local_metadata, assign = {**local_metadata, "assign_to_params_buffers": True}, True
        weight_before = self._parameters.get("weight")
        n_missing, n_unexpected = len(missing_keys), len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if prefix + "weight" in unexpected_keys[n_unexpected:] and _is_own_marker(self, state_dict, prefix + "weight",
                                                                                   prefix):
            unexpected_keys.remove(prefix + "weight")  # (torch lists it: this layer has no weight to take it)
        if self.pending and len(missing_keys) == n_missing and not self._holds_meta():
            self._pending = None
        if self._mode == "masked" and self._parameters.get("weight") is not weight_before:  # (parametrized: None)
            self._track_masked()  # load_state_dict(assign=True) installs new Parameters
        if self._mode == "compressed":
            _make_contiguous(self)
            if assign and prefix + "values" in state_dict:
                self._take_assigned_dtype(dense_dtype)

    def _take_assigned_dtype(self, dense_dtype: torch.dtype | None) -> None:
        """After ``assign=True`` installed the file's tensors, the logical dtype is theirs, as an
        nn.Linear's becomes (the old one beside 16-bit values made every forward raise). Quantized
        values do not tell it: the dense weight's they were computed from (a pending layer), else
        the bias's; neither (a bias-less INT8/INT4 checkpoint): unchanged."""
        if self.scale is None:
            self._dtype = self.values.dtype
            return
        bias = self._parameters.get("bias")
        dtype = dense_dtype or (None if bias is None else bias.dtype)
        if dtype in FLOAT_DTYPES:
            self._dtype = dtype

    def _has_dense_entry_only(self, sd: dict, prefix: str) -> bool:
        return prefix + "weight" in sd and not any(prefix + k in sd for k in _ALL_KEYS[1:]) and not (
            self._mode == "compressed" and _is_marker(sd[prefix + "weight"]))  # (a compressed layer's marker)

    def _fill_from_dense(self, sd: dict, prefix: str) -> torch.dtype:
        """Replace a dense ``weight`` entry of ``sd`` by this layer's 2:4 entries, pruned by the
        pending method (``sd`` is load_state_dict's own copy: changing it is allowed). Returns the
        dense weight's dtype (what an assigned quantized layer computes in: _take_assigned_dtype)."""
        w = sd.pop(prefix + "weight")
        if not is_dtensor(w):
            sd.update({prefix + k: v for k, v in self.entries_from_dense(w)[0].items()})
            return w.dtype
        # FSDP2's load of a meta-built model (set_model_state_dict): the mask methods need whole rows
        # and m x m blocks, so they run on the gathered weight (every rank loads, in the same order);
        # each rank keeps its own pieces, sharded like the weight (sharded.py)
        if self._mode != "masked":
            raise ValueError("a sharded (DTensor) dense weight can fill a pending layer in masked mode only: "
                             "load it into the masked model, then compress")
        entries = self.entries_from_dense(w.full_tensor())[0]
        sd.update({prefix + k: shard_like(v, w) for k, v in entries.items()})
        return w.dtype

    def entries_from_dense(self, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The state-dict entries this layer holds for a dense weight, pruned by the method it
        was built with (a pending layer's; magnitude otherwise). Changes nothing.

        Args:
            weight: ``(R, C)`` dense floating weight; ``(C, R)`` when this layer replaced a
                Hugging Face ``Conv1D`` (as Conv1D and its checkpoints store it).
        Returns:
            ``(entries, mask)``: ``{"weight", "mask"}`` (masked mode) or ``{"values", "meta"}``
            (+ ``"scale"``, INT4 ``"zero"``, ``"group_size"``) in this layer's mode, and the ``(R, C)`` bool mask.
        """
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
        R, C = self.out_features, self.in_features
        conv1d = is_conv1d_class(self.__dict__.get("_dense_cls"))
        if tuple(weight.shape) != ((C, R) if conv1d else (R, C)):
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {(C, R) if conv1d else (R, C)}"
                             + (" (a Conv1D stores (in, out))" if conv1d else ""))
        w = weight.t() if conv1d else weight
        if not w.is_floating_point():
            raise TypeError(f"weight must be floating point, got {w.dtype}")
        pending = self.__dict__.get("_pending") or {"method": "magnitude", "kwargs": {}}
        new_w, mask = prepare._prune_weight(w, pending["method"], **pending["kwargs"])
        kept = w if new_w is None else new_w
        if self._mode == "masked":
            return {"weight": torch.where(mask, kept, 0), "mask": mask}, mask  # the caller's tensor stays
        return compressed_entries(compress(kept, mask, **self._quant())), mask


# --- the whole model: all or nothing -------------------------------------------------------

def guard_loading(model: torch.nn.Module) -> None:
    """Make ``model.load_state_dict`` all or nothing for the 2:4 layers' sake.

    torch copies module by module and reports errors at the end, so a refused 2:4 entry (or a
    size mismatch, a missing key in strict mode) left every other module holding the file's
    tensors (found by fuzzing: tests/tools/test_fuzz.py). A load_state_dict pre-hook on
    ``model`` checks the whole state dict first, before any module copies anything: every 2:4
    layer's entries (as the layer does), what torch refuses for other modules (a non-tensor, a
    size mismatch) and, for a strict call, missing and unexpected keys. A module with its own
    loading code (``_load_from_state_dict``, e.g. BatchNorm, or load pre-hooks) may rename or
    convert its entries: its subtree is left to it and torch, the rest is checked. It runs
    where torch reaches ``model``: for ``model.load_state_dict`` and for a parent's, where it
    covers ``model``'s part (a submodule's own ``load_state_dict`` is the layers' business).
    Each layer skips the checks the hook already made on the same tensors. Idempotent.

    Args:
        model: any ``nn.Module`` (a lone :class:`~sparse24.Sparse24Linear` needs none: it
            loads all its entries or none by itself, and refuses unexpected keys under it
            in a strict call before copying anything).
    """
    if isinstance(model, StateDictMixin) or any(getattr(h, "hook", h) is _whole_model_check
                                                for h in model._load_state_dict_pre_hooks.values()):
        return
    model.register_load_state_dict_pre_hook(_whole_model_check)


def _whole_model_check(model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    """The pre-hook of :func:`guard_loading`: raises RuntimeError (torch's wording) listing every
    problem before anything is copied; ``state_dict`` is torch's own copy (a pending layer's dense
    weight is replaced by its 2:4 entries here, as the layer would)."""
    errors, checked = [], []
    odd = [k for k in state_dict if not isinstance(k, str)]
    if odd:  # torch's loader calls str methods on every key, whether strict or not
        errors.append(f"state_dict keys must be strings (module paths), got {', '.join(repr(k) for k in odd[:5])}")
    for fqn, m in _loading_walk(model, prefix):
        if m is None:
            continue  # a module that may rewrite its entries: torch and it decide (about its subtree only)
        if isinstance(m, StateDictMixin):
            try:
                m._refuse_sharded_entries(state_dict, fqn)   # (here: before any module copies)
                dense_dtype = None
                if m.pending and m._has_dense_entry_only(state_dict, fqn):
                    dense_dtype = m._fill_from_dense(state_dict, fqn)
                _check_entries(m, state_dict, fqn)
                checked.append((m, fqn, dense_dtype))
            except (ValueError, TypeError) as e:
                errors.append(f"{fqn[:-1] or 'Sparse24Linear'}: {e}")
            except RuntimeError as e:   # (_refuse_sharded: the message names the layer)
                errors.append(str(e))
            continue
        for name, t in _local_state(m).items():
            v = state_dict.get(fqn + name, t)
            if v is t or torch.nn.parameter.is_lazy(t):
                continue
            if not isinstance(v, torch.Tensor):
                errors.append(f"'{fqn}{name}' must be a tensor, got {type(v).__name__}")
            elif not (t.dim() == 0 and v.dim() == 1 and v.numel() >= 1) and v.shape != t.shape:  # torch takes v[0]
                errors.append(f"size mismatch for {fqn}{name}: copying a param with shape {v.shape} from "
                              f"checkpoint, the shape in current model is {t.shape}.")
    if _strict_call(model):
        missing, unexpected = _incompatible_keys(model, state_dict, prefix)
        if unexpected:
            errors.insert(0, f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}. ")
        if missing:
            errors.insert(0, f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}. ")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__} (load_state_dict copied nothing):\n\t"
                           + "\n\t".join(errors))
    # The layers skip these checks on these very tensors. The records are kept on torch's own copy of
    # the state dict (the call's frame holds it), so none outlives the call, whether it completes or
    # another module's loader raises part way (a record left on a layer made it unpicklable: weakrefs).
    # No call found (a loader calling _load_from_state_dict itself: transformers < 4.50, DeepSpeed):
    # in _NO_CALL_RECORDS, which no layer holds; the layer must get the dense dtype _fill_from_dense saw.
    records = _call_records()
    for m, fqn, dense_dtype in checked:
        refs = _entry_refs(state_dict, fqn)
        if records is not None:
            records[id(m), fqn] = (m, refs, dense_dtype)
        else:
            _NO_CALL_RECORDS.setdefault(m, {})[fqn] = (None, refs, dense_dtype)  # (m itself would keep m alive)


_ENTRY_NAMES = ("weight", "mask", "values", "meta", "scale", "zero", "group_size", "bias")


def _entry_refs(sd: dict, prefix: str) -> dict:
    """Weak references to a layer's entries in ``sd`` (None where absent): what the hook checked."""
    return {k: weakref.ref(sd[prefix + k]) if prefix + k in sd else None for k in _ENTRY_NAMES}


def _call_records() -> dict | None:
    """The whole-model hook's records for the load_state_dict call under way, ``{(id(layer), prefix):
    (layer, refs, dense dtype)}``: an attribute of torch's own copy of the state dict (an OrderedDict),
    dropped with it when the call ends. None when no such call is found."""
    call = _load_call()
    sd = None if call is None else call.get("state_dict")
    if not hasattr(sd, "__dict__"):
        return None
    return sd.__dict__.setdefault("_sparse24_checked", {})


# Layer -> {prefix: record} of the whole-model hook under a loader calling _load_from_state_dict itself
# (no load_state_dict call to keep them on; see _whole_model_check). Weak keys, and nothing on the layer:
# a record a refused load left behind neither keeps the layer alive nor stops pickling it; it can only
# match the very tensors it was made for (weak references, compared by identity).
_NO_CALL_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _already_checked(layer, sd: dict, prefix: str) -> tuple[bool, torch.dtype | None]:
    """Whether the whole-model hook checked exactly these tensors for this layer (consumed once),
    and the dtype of the dense weight it replaced by 2:4 entries (None if it replaced none)."""
    records, own = _call_records(), _NO_CALL_RECORDS.get(layer)
    record = own.pop(prefix, None) if own is not None else None  # consumed either way
    if records is not None:  # under a load_state_dict call only its own records count
        record = records.pop((id(layer), prefix), None)
    if record is None:
        return False, None
    _, refs, dense_dtype = record
    same = all((r is None) == (prefix + k not in sd) and (r is None or r() is sd[prefix + k])
               for k, r in refs.items())
    return same, dense_dtype if same else None


def _own_unexpected_keys(layer, sd: dict, prefix: str) -> list:
    """For a strict call of ``layer``'s own load_state_dict (a lone layer: no whole-model hook),
    the keys of ``sd`` that are none of its entries (nor a child's). Under a parent's call,
    torch's report stands."""
    if not _strict_call(layer, own=True):
        return []
    own = set(_key_names(layer)) | set(layer._modules)
    return [k for k in sd if isinstance(k, str) and k.startswith(prefix)
            and k[len(prefix):].partition(".")[0] not in own and not _is_own_marker(layer, sd, k, prefix)]


def _loads_plainly(m: torch.nn.Module) -> bool:
    """``m`` loads its entries as nn.Module does: no own _load_from_state_dict, no other pre-hook."""
    return type(m)._load_from_state_dict is torch.nn.Module._load_from_state_dict and all(
        getattr(h, "hook", h) is _whole_model_check for h in m._load_state_dict_pre_hooks.values())


def _loading_walk(model, prefix: str):
    """``(prefix, module)`` in the order torch's load_state_dict visits them (a module reused under
    two names twice); ``(prefix, None)`` in place of a subtree whose loading cannot be foreseen
    (a module with its own _load_from_state_dict or pre-hooks may rename or convert entries)."""
    stack = [(prefix, model)]
    while stack:
        p, m = stack.pop()
        if not (isinstance(m, StateDictMixin) or _loads_plainly(m)):
            yield p, None
            continue
        yield p, m
        stack.extend((p + n + ".", c) for n, c in reversed(m._modules.items()) if c is not None)


def _local_state(m: torch.nn.Module) -> dict:
    """The entries ``m`` itself saves and loads (persistent parameters and buffers)."""
    out = {}
    m._save_to_state_dict(out, "", keep_vars=True)
    return out


def _local_names(layer) -> list:
    """The names of the entries a :class:`StateDictMixin` ``layer`` itself saves and loads, in
    :func:`_local_state`'s order, without computing them (its _save_to_state_dict writes the same names
    as nn.Module's: its non-None parameters and persistent buffers)."""
    return [n for n, t in layer._parameters.items() if t is not None] + [
        n for n, t in layer._buffers.items() if t is not None and n not in layer._non_persistent_buffers_set]


def _key_names(layer) -> list:
    """:func:`_local_names`, and ``_extra_state`` where the class defines ``get_extra_state`` (torch saves it
    then): the keys a strict load expects of ``layer`` itself (the extra state is no 2:4 entry)."""
    extra = type(layer).get_extra_state is not torch.nn.Module.get_extra_state
    return _local_names(layer) + (["_extra_state"] if extra else [])


def _incompatible_keys(model, sd: dict, prefix: str) -> tuple[list, list]:
    """Missing and unexpected keys as torch's strict load reports them, for ``model`` at ``prefix``."""
    missing, unexpected, local = [], [], {}
    for p, m in _loading_walk(model, prefix):
        if m is None:  # its own loading code decides what it misses and what it takes
            local[p] = None
            continue
        # (names only: a decode-layout layer's own state is re-ordered to layout v1 when computed)
        local[p] = (m, _key_names(m) if isinstance(m, StateDictMixin) else _local_state(m))
        missing += [p + k for k in local[p][1] if p + k not in sd]
    for k in sd:  # torch's rule, per key down its path: a name followed by more is a child, the last an entry
        if not isinstance(k, str):  # refused by the caller (torch would raise AttributeError on it)
            continue
        p = prefix
        while k.startswith(p) and local[p] is not None:  # (an "_extra_state" entry: own only where there is one)
            m, own = local[p]
            head, dot, _ = k[len(p):].partition(".")
            if head not in (m._modules if dot else own):
                if not _is_own_marker(m, sd, k, p):
                    unexpected.append(k)
                break
            if not dot or m._modules[head] is None:
                break
            p += head + "."
    return missing, unexpected


def _load_call() -> dict | None:
    """The locals of the load_state_dict call under way (its frame), or None when no such frame is
    found (a loader calling _load_from_state_dict itself). torch passes strict=True to every module's
    loading code whatever the call says, so the caller's own argument is read there."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is torch.nn.Module.load_state_dict.__code__:
            return f.f_locals
        f = f.f_back
    return None


def _non_strict_call() -> bool:
    """Whether the load_state_dict call under way says ``strict=False``; False when none is found."""
    call = _load_call()
    return call is not None and not call.get("strict", True)


def _strict_call(model, own: bool = False) -> bool:
    """Whether the load_state_dict call under way is strict (``own``: and is ``model``'s own, not
    a parent's); torch reports missing keys only at the end, after copying. False when no such call
    is found (a loader calling _load_from_state_dict itself: torch's report stands)."""
    call = _load_call()
    return call is not None and bool(call.get("strict", True)) and (not own or call.get("self") is model)

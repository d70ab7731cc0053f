"""Checking a state dict's entries for a :class:`~sparse24.nn.Sparse24Linear`
before anything is copied: dense, masked, compressed and INT8 checkpoints
are told apart, and a partial, mismatched or corrupt one is a clear error."""
from __future__ import annotations

import torch

from ..format import Sparse24Tensor, _check_mask24

__all__ = ["check_state"]


def check_state(self, sd: dict, prefix: str) -> None:
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

"""Which modules are linear layers, and their shapes: ``nn.Linear`` and Hugging Face's ``Conv1D``
(GPT-2 and relatives; its weight is stored transposed), detected without importing transformers.
Below every other layer: the modules, the mask methods and the whole-model calls all ask it."""
from __future__ import annotations

import sys

__all__ = ["is_conv1d", "is_conv1d_class", "linear_shape"]


def is_conv1d(module) -> bool:
    """True for Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2 and relatives): a
    Linear whose weight is stored transposed, ``(in_features, out_features)``. Detected
    without importing transformers (a Conv1D exists only once transformers is imported)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def linear_shape(module) -> tuple[int, int]:
    """``(out_features, in_features)`` of an ``nn.Linear``, a Hugging Face ``Conv1D`` or a
    :class:`Sparse24Linear`."""
    if is_conv1d(module):
        C, R = module.weight.shape
        return R, C
    return module.out_features, module.in_features


def is_conv1d_class(cls) -> bool:
    """True for the Hugging Face ``Conv1D`` class (see :func:`is_conv1d`)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(cls, type) and issubclass(cls, utils.Conv1D)

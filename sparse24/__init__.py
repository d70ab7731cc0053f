"""sparse24: 2:4 (and N:M) structured sparsity for PyTorch with Triton kernels.

Layers, bottom to top: ``format`` (masks, compressed layout; ``quant``, INT8,
and ``interop``, torch's 2:4 tensors, beside it) -> ``kernels`` (Triton) ->
``ops`` (launchers, references, backend choice) -> ``nn`` (modules) ->
``api``, ``masks``, ``recipes``, ``learn`` (whole-model swaps, mask methods,
pruning recipes, learned masks and distillation; ``evaluate``, fidelity to the dense model) -> tools (``tuning``, ``bench``, ``plot``, ``demo``, CLI).
"""
import importlib
import os
import sys

from .decode_format import DecodePacked, pack_decode
from .format import FLOAT_DTYPES, Sparse24Tensor, compress, is_nm
from .masks import mask_nm
from .ops.linear24 import linear, linear_reference

from ._version import __version__

# Public names from the upper layers, imported on first use so that
# ``import sparse24`` stays light (no triton, no matplotlib).
_LAZY = {
    "Sparse24Linear": "nn",
    "sparsify_": "api", "densify_": "api", "compress_": "api", "decompress_": "api",
    "prune_trained_model": "api", "SparsifyReport": "api", "count_parameters": "api",
    "from_pretrained": "hf",
    "calibrate": "masks", "search_permutation": "masks", "apply_permutation": "masks",
    "kept_magnitude_fraction": "masks", "prune_nm": "masks", "PruneResult": "masks",
    "sparsegpt_prune": "masks", "reconstruct_weight": "masks", "prune_layerwise_": "masks", "LayerStats": "masks",
    "GradualPruner": "recipes", "SRSTE": "recipes", "ema_multi_avg_fn": "recipes",
    "learn_masks": "learn", "distill_": "learn", "LearnableMask": "masks",
    "mean_pool": "evaluate", "sentence_embeddings": "evaluate", "embedding_fidelity": "evaluate",
    "bits_per_char": "evaluate",
    "PermutationGroup": "masks", "find_permutation_groups": "masks", "check_group": "masks",
    "permute_model_": "masks", "token_noise": "masks",
    "quantize_values": "format", "sqnr_db": "quant",
    "to_semi_structured": "interop", "from_semi_structured": "interop",
    "to_cutlass_layout": "interop", "from_cutlass_layout": "interop",
}


if "transformers" in sys.modules:  # a transformers user: its loaders should know sparse24 folders now
    try:
        from . import hf
        hf.register()
    except ImportError:  # a transformers too old or broken for the integration: sparse24 itself still works
        pass

if os.environ.get("SPARSE24_AUTOTUNE") == "1":
    from .tools import tuning  # noqa: F401  (plugs the live tuner into the config store)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'sparse24' has no attribute {name!r}")


def __dir__():
    # the lazily imported names too: tab completion shows the whole API
    return sorted({*globals(), *_LAZY})


__all__ = ["Sparse24Tensor", "compress", "is_nm", "mask_nm", "linear", "linear_reference", "FLOAT_DTYPES",
           "DecodePacked", "pack_decode",
           "__version__", *_LAZY]

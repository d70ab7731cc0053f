"""Whole-model 2:4 sparsity (layer 6): the in-place swaps of :mod:`.swap`, the
report of :mod:`.report`; :mod:`.walk` finds the layers and their reasons."""
from .report import LayerReport, SparsifyReport
from .swap import (MIN_FEATURES, compress_, count_parameters, decompress_, densify_, prune_trained_model,
                   sparsify_)

__all__ = ["sparsify_", "densify_", "compress_", "decompress_", "prune_trained_model", "count_parameters",
           "SparsifyReport", "LayerReport", "MIN_FEATURES"]

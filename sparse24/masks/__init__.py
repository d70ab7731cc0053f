"""Better N:M masks (layer 2, above the storage format): per-tensor methods
(:mod:`~sparse24.masks.nm`: magnitude, Wanda, SparseGPT, 2-D transposable),
learnable masks (:mod:`~sparse24.masks.learned`, MaskLLM's
per-group pattern logits), model-wide calibration and layer-by-layer pruning
(:mod:`~sparse24.masks.calibrate`; token noise for small or off-domain calibration text,
:mod:`~sparse24.masks.augment`), input-channel permutations
(:mod:`~sparse24.masks.permutation`) and their model-wide use with calibrated
importance (:mod:`~sparse24.masks.permute_model`). Pure torch, any device.
"""
from .augment import token_noise
from .calibrate import calibrate, prune_layerwise_
from .learned import LearnableMask, nm_patterns
from .nm import METHODS, LayerStats, PruneResult, kept_magnitude_fraction, mask_nm, prune_nm
from .permutation import apply_permutation, search_permutation
from .permute_model import PermutationGroup, check_group, find_permutation_groups, group_importance, permute_model_
from .reconstruct import reconstruct_weight
from .sparsegpt import sparsegpt_prune
from .two_d import block_patterns

__all__ = ["METHODS", "mask_nm", "prune_nm", "PruneResult", "kept_magnitude_fraction", "sparsegpt_prune",
           "reconstruct_weight", "LayerStats", "calibrate", "prune_layerwise_", "block_patterns",
           "search_permutation", "apply_permutation",
           "LearnableMask", "nm_patterns", "PermutationGroup", "check_group", "find_permutation_groups",
           "group_importance", "permute_model_", "token_noise"]

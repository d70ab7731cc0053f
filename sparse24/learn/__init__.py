"""Training 2:4 models end to end (layer 6): learned masks and frozen-mask distillation.

* :func:`learn_masks`: MaskLLM (Fang et al., NeurIPS 2024): every 2:4 group of
  every selected ``nn.Linear`` learns a distribution over its 6 patterns
  (:class:`sparse24.masks.LearnableMask`), sampled with the Gumbel-softmax
  under a falling temperature, straight-through hard draws at the end, the
  weights frozen by default; initialised from a one-shot mask (magnitude,
  Wanda, SparseGPT) and trained on a task loss or, by default, by
  distillation from the dense model. The final masks are written into the
  ``Sparse24Linear`` masked layers that :func:`sparse24.sparsify_` makes, so
  ``compress_``, checkpoints and kernels work unchanged.
* :func:`distill_`: the recovery recipe: retrain a 2:4 model with its masks
  frozen toward the dense teacher (output loss plus optional layer-wise
  losses on chosen modules' outputs), AdamW with warmup and cosine decay.

Both take batches as :func:`sparse24.calibrate` does (tensors, tuples or
dicts), and the same objective: ``loss_fn(output, batch)`` if given, plus the
distillation loss if a teacher is given (the default teacher of
:func:`learn_masks` is a frozen copy of the dense model).
"""

from .distill import DistillReport, distill_
from .learned_masks import LearnReport, learn_masks
from .objective import OUTPUT_LOSSES

__all__ = ["learn_masks", "distill_", "LearnReport", "DistillReport", "OUTPUT_LOSSES"]

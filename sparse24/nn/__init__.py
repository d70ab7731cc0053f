"""``Sparse24Linear``: a drop-in ``nn.Linear`` with a 2:4-sparse weight (layer 5).

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

* ``"compressed"`` (inference): Parameter ``values`` (R, C/2), frozen unless
  ``trainable_values=True``, and buffers ``meta`` (the packed 2-bit slots) and,
  for INT8, ``scale`` (R,) fp32; for INT4 (``quantize="int4"``), ``values``
  (R, C/4) uint8, ``scale`` (R, ceil(C/group_size)) fp16, ``zero`` (same shape,
  uint8, asymmetric only) and ``group_size``, a 0-d int32 entry that makes a
  checkpoint say its group size: exactly :class:`sparse24.Sparse24Tensor`'s
  tensors. ``values`` is a Parameter so that parameter counts
  (``num_parameters()``) see the kept weights and tools that place adapters by
  a layer's first Parameter (PEFT) find it. Forward is one call of the
  registered op ``sparse24::linear`` (Triton on CUDA, reference on CPU), direct
  (no autograd, no dispatcher) when no gradient is needed. Backward gives input
  gradients, and gradients for the kept values when they require grad.

* Inference in masked mode: when no gradient is needed, forward multiplies by
  the stored weight directly (no ``where`` over the whole weight per call), once
  it has checked that the weight is zero at every pruned position; the check
  reruns after any in-place change torch's version counter records (optimizer
  steps, ``copy_``, ``masked_fill_``; writes through ``.data`` are not seen).

State dicts hold plain tensors only (safetensors-compatible); loading checks
the entries and raises a clear error for dense, mismatched or corrupt ones.
Under FSDP2 (``fully_shard``, after ``sparsify_``) the mask is a DTensor sharded
like its weight, so distributed checkpoints hold and reshard both
(:mod:`sparse24.nn.sharded`, docs/distributed.md).

A layer built on the meta device (``Sparse24Linear(..., device="meta")``,
``sparsify_`` of a model built under ``torch.device("meta")``) holds shapes only:
its mask is *pending* and is computed, by the method it was built with, when
``load_state_dict`` brings the dense weight (or taken as is when it brings the
2:4 entries). ``to_empty`` keeps it pending; forward refuses until then.
A loader that sets the tensors directly (accelerate's ``load_checkpoint_in_model``)
leaves it pending until a move (``.to()``, as ``dispatch_model`` makes) or
:meth:`Sparse24Linear.finish_loading` takes them, once all are set (after ``to_empty``,
only that call); a forward before then refuses, naming that call.

Hugging Face ``Conv1D`` (GPT-2 and relatives: ``y = x @ W + b`` with ``W`` stored
``(in, out)``) is the Linear it is: :meth:`Sparse24Linear.from_linear` takes it
with the weight transposed, and :meth:`Sparse24Linear.to_dense_module` gives the
Conv1D back.
"""
from .linear import Sparse24Linear
from .prepare import (MODES, QUANTIZE, compressed_nbytes, is_conv1d, is_conv1d_class, linear_shape, memory_nbytes,
                      quant_options)
from .state import compressed_entries

__all__ = ["Sparse24Linear", "MODES", "QUANTIZE", "quant_options", "compressed_entries", "is_conv1d", "is_conv1d_class",
           "linear_shape",
           "compressed_nbytes", "memory_nbytes"]

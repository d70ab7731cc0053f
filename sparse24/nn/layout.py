"""The compressed weight's layout, as a part of :class:`~sparse24.nn.Sparse24Linear`:
layout v1 (the interchange format: state dicts and checkpoints hold it, always) or
the decode layout (what the decode kernel reads; held by frozen float16/bfloat16/INT8/INT4
weights on a GPU the compiled kernels run on: NVIDIA, sm_70 or later; INT4's scales and zero
points are the same tensors in both layouts, only values and meta are re-ordered). Kept apart
from the class only for length: these methods read and write the module's own state."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..decode_format import pack_decode
from ..ops.linear24.launch import kernels_run_on
from .masking import view_key

__all__ = ["LayoutMixin"]

# Values the decode layout holds (INT8 and INT4 too: quantized values have scales); others stay in layout v1.
_DECODE_DTYPES = (torch.float16, torch.bfloat16)


def _bf16_copy(scale: torch.Tensor) -> tuple | None:
    """``(scale, its version counter, its bfloat16 copy, its masking.view_key)`` where bfloat16 holds
    every scale exactly, else None. None too for an inference tensor (built or loaded under
    ``torch.inference_mode``): it counts no versions, so an in-place change could not be seen."""
    try:
        version, where = scale._version, view_key(scale)
    except RuntimeError:
        return None
    b = scale.to(torch.bfloat16)
    if not torch.equal(b.to(scale.dtype), scale):
        return None
    return scale, version, b, where


class LayoutMixin:
    """:meth:`to_layout`, :attr:`layout` and the conversions behind them."""

    def _wanted_layout(self) -> str:
        """The decode layout for a frozen float16/bfloat16/INT8/INT4 weight on a GPU the compiled kernels
        run on (an NVIDIA one of compute capability 7.0 or later: not ROCm's "cuda" devices; or where
        :meth:`to_layout` asked for it), layout v1 otherwise (the reference reads it best). A sharded layer
        (FSDP2's fully_shard) keeps the layout it was sharded in: FSDP holds its values in that shape (in its
        forward it sets its gathered values, which settling would re-order under it)."""
        if self._is_sharded():
            return self._layout
        values = self.values
        if values.requires_grad or values.is_meta or not (self.scale is not None
                                                          or values.dtype in _DECODE_DTYPES):
            return "v1"  # gradients of the kept values, and fp32/fp64 values, need layout v1
        pref = self.__dict__.get("_layout_pref")
        if pref is not None:
            return pref
        return "decode" if values.is_cuda and kernels_run_on(values.device) else "v1"

    def _settle_layout(self, keep_values: bool = False) -> bool:
        """Hold the layout :meth:`_wanted_layout` says; True if it changed. ``keep_values``: see
        :meth:`_convert_layout`."""
        if self._mode == "compressed" and not self.pending:
            wanted = self._wanted_layout()
            if wanted != self._layout:
                self._convert_layout(wanted, keep_values)
                return True
        return False

    def _convert_layout(self, layout: str, keep_values: bool = False) -> None:
        """Hold the compressed tensors in ``layout`` (new tensor objects: a snapshot taken
        before keeps the old ones, so an all-or-nothing call can still undo). ``keep_values``:
        the same ``values`` Parameter holds the new data instead (forward settling a layer just
        unfrozen: an optimizer built since holds that Parameter, and a new one would never train)."""
        self._refuse_sharded(f"change its layout to {layout!r}")  # (a move or a load of a decode-layout one)
        p = self.sparse_tensor()
        new = pack_decode(p) if layout == "decode" else p
        # share_memory() shares layout v1 (moves act on it, see _apply): the new tensors stay shared
        shared = [t.device.type == "cpu" and t.is_shared() for t in (self.values, self.meta)]
        if keep_values:
            self.values.data = new.values
        else:
            self._parameters["values"] = nn.Parameter(new.values, requires_grad=self.values.requires_grad)
        self._buffers["meta"] = new.meta
        for t, was_shared in zip((self.values, self.meta), shared):
            if was_shared:
                t.share_memory_()
        self._layout = layout
        # INT4 scales that bfloat16 holds exactly (quantized from a bfloat16 weight: bf16_exact_scales):
        # the decode layout keeps them as bfloat16 too, for bfloat16 x, whose kernels then scale a
        # register pair in two fma instead of three (docs/kernels.md, "INT4 weights"); small: 2 bytes
        # per group of 32-128 weights. Tied to the float16 tensor it copies, that tensor's version and
        # storage (masking.view_key: not its address alone, which new data set through ``.data =`` may
        # reuse): eager forward passes the copy only while all three hold (a replaced or changed scale,
        # or new data set through ``.data =``, reads float16; so does a compiled one, which cannot check).
        self._scale_bf16 = _bf16_copy(self.scale) if layout == "decode" and self._group_size else None

    def _decode_held(self) -> tuple | None:
        """``(values, meta)`` when this layer holds the decode layout (for :meth:`_keep_decode_tensors`), else None."""
        if self._mode == "compressed" and self.__dict__.get("_layout") == "decode":
            return self._parameters["values"], self._buffers["meta"]
        return None

    def _keep_decode_tensors(self, held: tuple | None) -> None:
        """After a call that re-packed this layer through layout v1 (new tensors from :meth:`_convert_layout`):
        write the new decode-layout data into ``held``, the ``(values, meta)`` it held before
        (:meth:`_decode_held`), and hold those again, as layout v1 is written in place. Another process may
        map their memory (``share_memory()``, CUDA IPC), an optimizer or a captured CUDA graph may hold
        them: a new tensor left all of these on the old weights, silently. For a given layer the decode
        tensors' shapes and dtypes do not change; where they do not fit anyway (another device: a load with
        ``assign=True``) or cannot be written (inference tensors outside inference mode), the new ones stay."""
        if held is None or self.__dict__.get("_layout") != "decode":
            return
        new = self._parameters["values"], self._buffers["meta"]
        if any(n is o for n, o in zip(new, held)):
            return
        if not all(n.shape == o.shape and n.dtype == o.dtype and n.device == o.device for n, o in zip(new, held)) \
                or any(o.is_inference() for o in held) and not torch.is_inference_mode_enabled():
            return
        with torch.no_grad():
            for n, o in zip(new, held):
                o.copy_(n)
        self._parameters["values"], self._buffers["meta"] = held

    @contextlib.contextmanager
    def _repacked_in_place(self, repack: bool = True, keep: bool = True, settle: bool = True):
        """Run the body with this layer in layout v1 where it holds the decode layout and ``repack``; after
        it, settle the layout (:meth:`_settle_layout`; ``settle=False``: only back to the decode layout it
        held, a layer held in layout v1 stays so, in the same tensors) and, unless ``keep`` is False (a load
        with ``assign=True``), write the re-packed data into the tensors held before
        (:meth:`_keep_decode_tensors`)."""
        held = self._decode_held() if repack else None
        if held is not None:
            self._convert_layout("v1")
        try:
            yield
        finally:
            if settle:
                self._settle_layout()
            elif held is not None:
                self._convert_layout("decode")
            self._keep_decode_tensors(held if keep else None)

    def to_layout(self, layout: str) -> "LayoutMixin":
        """Hold the compressed weight in ``layout``: ``"decode"`` (what the decode
        kernel reads: float16/bfloat16/INT8/INT4 values, not trainable), ``"v1"``, or
        ``"auto"`` (the default: decode on an NVIDIA GPU of compute capability 7.0 or later,
        v1 elsewhere: CPU, ROCm, older GPUs). Outputs and state
        dicts (always layout v1) do not change. Returns self.

        On a CPU a decode-layout layer's forward runs the reference, not the decode kernel: it
        re-orders each 128-row block back to layout v1 on every call (5-7.5x layout v1's time), so
        keep layout v1 there. The kernel runs on CPU tensors (Triton's interpreter, slow: for
        tests) only through ``sparse24.linear(x, p, backend="triton")``.

        A layer sharded by FSDP2's ``fully_shard`` keeps the layout it was sharded in (asking for
        another raises RuntimeError, nothing changed): shard compressed layers in layout v1
        (``to_layout("v1")`` before ``fully_shard``; one sharded in the decode layout runs forward
        but cannot give or load a state dict).

        Example:
            >>> from sparse24 import Sparse24Linear
            >>> layer = Sparse24Linear(64, 32, mode="compressed", dtype=torch.float16)
            >>> layer.to_layout("decode").layout   # e.g. to test the layout on CPU tensors
            'decode'
        """
        if layout not in ("v1", "decode", "auto"):
            raise ValueError(f"layout must be 'v1', 'decode' or 'auto', got {layout!r}")
        if self._mode != "compressed":
            raise ValueError("only compressed mode has a layout (masked mode holds the dense weight)")
        if layout != "auto" and layout != self._layout:
            self._refuse_sharded(f"change its layout to {layout!r} (FSDP holds its values in the shape they were "
                                 "sharded in)")
        snap = self._snapshot()
        self._layout_pref = None if layout == "auto" else layout
        try:
            if layout == "decode" and self._wanted_layout() != "decode":
                raise ValueError("the decode layout holds float16, bfloat16, INT8 or INT4 values that do not train; "
                                 f"this layer has {self.values.dtype} values "
                                 f"(requires_grad={self.values.requires_grad})")
            if not self._settle_layout() and self._layout == "decode" and self._group_size:
                # asked again: a new copy of the INT4 scales (a write through .data went unseen; _convert_layout)
                self._scale_bf16 = _bf16_copy(self.scale)
        except BaseException:
            self._restore(snap)  # refused: nothing changes (the preference included)
            raise
        return self

    @property
    def layout(self) -> str | None:
        """``"v1"`` or ``"decode"`` in compressed mode (see :meth:`to_layout`), None in masked mode."""
        return self.__dict__.get("_layout") if self._mode == "compressed" else None

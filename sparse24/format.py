"""N:M masks and the compressed 2:4 storage format (pure torch, any device).

(Over 400 lines by design: the bit layout is defined once, here, next to every
function that writes or reads it: the magnitude masks that choose the slots,
``compress``, ``to_dense``, ``validate`` and the INT8 values.)

Bit layout of a compressed 2:4 weight ``W`` of logical shape ``(R, C)``
(R output rows, C input columns, ``C % 4 == 0``). This is the one place the
layout is defined; the Triton kernels in ``sparse24.kernels`` decode exactly this.

* ``values``: ``(R, C // 2)``, row-major, the weight's dtype (int8 when
  quantized). Group ``g`` (dense columns ``4g .. 4g+3``) owns ``values[:, 2g]``
  and ``values[:, 2g + 1]``, in increasing slot order.
* ``meta``: ``(ceil(C / 32), R)`` int32, i.e. *transposed* so that a kernel
  loading the metadata of one K-tile for a block of rows reads contiguous
  memory along R, whatever its BLOCK_K (a multiple of 32). Word ``meta[w, r]``
  describes values ``16w .. 16w + 15`` of row ``r`` (dense columns
  ``32w .. 32w + 31``): bits ``2j, 2j+1`` hold the slot (0..3, position
  inside its group of 4) of value ``16w + j``. So each group is one nibble,
  ``slot_lo | slot_hi << 2`` with ``slot_lo < slot_hi``. Bits past the last
  group of a row (when ``C % 32 != 0``) are zero. Bit 31 may be set, so
  decoders must mask after shifting (``(word >> 2j) & 3``).
* ``scale``: ``None``, or ``(R,)`` float32 per-output-row scales when the
  values are int8: ``W[r, c] = values[r, j] * scale[r]``.

INT4 (``quantize="int4"``, W4A16) keeps ``meta`` exactly as above and stores:

* ``values``: ``(R, C // 4)`` uint8, one byte per group: byte ``g`` of row ``r``
  holds kept value ``2g`` (the lower slot) in bits 0-3 and ``2g + 1`` (the
  higher slot) in bits 4-7, each an unsigned 4-bit code ``u`` (0..15).
* ``scale``: ``(R, ceil(C / group_size))`` float16; quantization group ``k`` of
  a row covers dense columns ``k * group_size .. (k + 1) * group_size - 1``
  (``group_size`` 32, 64 or 128; the last group of a row may be short), i.e.
  kept values ``k * group_size / 2 ..``.
* ``zero``: ``None`` (symmetric: the zero point is 8 for every group) or
  ``(R, ceil(C / group_size))`` uint8 zero points 0..15 (asymmetric).

  ``W[r, c] = (u - zero[r, k]) * scale[r, k]``, evaluated exactly in float32
  (a 5-bit integer times an fp16 scale fits float32's mantissa), then cast to
  the logical dtype. Storage per weight: 0.25 B of values + 0.125 B of slots +
  2 / group_size B of scales (+ 1 / group_size B of zero points): 0.390625 B at
  group 128 symmetric, 19.53% of dense fp16 (0.3984375 B, 19.92%, asymmetric).
  The codes are offset-binary so that a kernel turns a nibble into a float16
  with one OR of 0x6400 (1024 + u) and folds the offset into the zero point.
  A bfloat16 weight's scales are float16 values with at most 8 significant
  bits (:func:`bf16_exact_scales`), which bfloat16 holds too: with bfloat16 x
  the kernels then scale each code in one step, still exactly rounded once.

A group whose mask keeps fewer than 2 columns is stored with zero values in
the lowest unused slots, so every group always names two distinct slots;
``validate`` rejects anything else.

The decode-path kernels read a second layout, the same kept values and slots
re-ordered into the order their threads consume them and with the slots
re-encoded as keep masks: :class:`sparse24.decode_format.DecodePacked` (decode
layout, version 1), defined in ``sparse24/decode_format.py``.
"""
from __future__ import annotations

import sys

import torch
import torch.autograd.forward_ad as _fwAD

from ._checks import (FLOAT_DTYPES, check_bool, check_mask, check_nm, check_weight, local_piece, refuse_meta,
                      row_chunks)

__all__ = ["mask_nm", "is_nm", "Sparse24Tensor", "compress", "quantize_values", "QUANT_MODES", "FLOAT_DTYPES",
           "INT4_GROUP_SIZES", "bf16_exact_scales"]


# The integer view of each float dtype: for finite values, comparing
# ``bits & max`` orders magnitudes exactly, and integer compares are much
# cheaper on CPU than fp16 compares (0.055 s vs 0.21 s for torch.topk on a
# 4096x4096 fp16 weight, 2-core x86).
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float32: torch.int32, torch.float64: torch.int64}


def _magnitude_keys(w: torch.Tensor) -> torch.Tensor:
    """Integer keys ordering ``|w|`` exactly, same shape as w; rejects NaN."""
    ity = _INT_VIEW[w.dtype]
    keys = w.contiguous().view(ity) & torch.iinfo(ity).max
    # NaN keys are the only ones above +inf's; an integer max is much cheaper
    # than torch.isnan on fp16 (measured 6x on 2-core x86).
    if keys.numel() and int(keys.max()) > _INF_KEY[w.dtype]:
        raise ValueError("weight contains NaN: no magnitude order exists")
    return keys


_INF_KEY = {dt: int(torch.tensor(float("inf"), dtype=dt, device="cpu").view(_INT_VIEW[dt])) for dt in _INT_VIEW}
_PAIRS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def _build_luts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two lookup tables of group nibbles ``slot_lo | slot_hi << 2``.

    ``from_compares[code]``: ``code`` bit b says whether column i beats column j
    for the b-th pair (i, j) of ``_PAIRS``; the two columns beaten by fewer than
    two others are kept. ``from_keep[bits]``: ``bits`` = the 4 kept flags of a
    group (at most 2 set); short groups are filled with the lowest free slots.
    """
    # On the CPU whatever torch's default device (filled entry by entry; _lookup moves them to the data)
    from_compares = torch.zeros(64, dtype=torch.uint8, device="cpu")
    for code in range(64):
        beaten = [0] * 4
        for b, (i, j) in enumerate(_PAIRS):
            beaten[j if (code >> b) & 1 else i] += 1
        kept = [c for c in range(4) if beaten[c] < 2]
        if len(kept) == 2:  # other codes are cyclic, impossible for a total order
            from_compares[code] = kept[0] | kept[1] << 2
    from_keep = torch.full((16,), _BAD, dtype=torch.uint8, device="cpu")  # _BAD: more than 2 kept
    for bits in range(16):
        kept = [c for c in range(4) if (bits >> c) & 1]
        kept = sorted(kept + [c for c in range(4) if c not in kept][: max(0, 2 - len(kept))])
        if len(kept) == 2:
            from_keep[bits] = kept[0] | kept[1] << 2
    return from_compares, from_keep


_BAD = 0xFF
_NIB_FROM_COMPARES, _NIB_FROM_KEEP = _build_luts()


def _lookup(lut: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return torch.take(lut.to(code.device), code.long())


def _nibbles24(w: torch.Tensor) -> torch.Tensor:
    """(R, C) float -> (R*C/4,) uint8 nibbles of the 2 largest |w| per group.

    Six integer compares and a table lookup instead of a sort (2x faster than
    computing ranks, 0.2 s vs 0.9 s for topk on 4096x4096 fp16, 2-core x86).
    Ties go to the lower column: column i beats j (i < j) when |w_i| >= |w_j|.
    A block of rows at a time (:func:`~sparse24._checks.row_chunks`): whole, the keys (the weight's size) and
    the int64 table index (2 bytes per weight) outweighed the weight.
    """
    R, C = w.shape
    u8 = torch.uint8
    nib = torch.empty(R, C // 4, dtype=u8, device=w.device)
    for rows in row_chunks(R, C, w.device):
        k = _magnitude_keys(w[rows]).view(-1, 4)
        code = torch.zeros(k.shape[0], dtype=u8, device=w.device)
        for b, (i, j) in enumerate(_PAIRS):
            code |= (k[:, i] >= k[:, j]).view(u8) << b
        block = nib[rows]
        block.copy_(_lookup(_NIB_FROM_COMPARES, code).view(block.shape))
    return nib.view(-1)


def _nibble_mask(nib: torch.Tensor) -> torch.Tensor:
    """(G,) nibbles -> (G, 4) bool keep flags, through a 16-entry table of keep bits."""
    bits = _lookup(_KEEP_BITS, nib)
    return ((bits.unsqueeze(-1) >> torch.arange(4, dtype=torch.uint8, device=nib.device)) & 1).bool()


_KEEP_BITS = torch.tensor([(1 << (b & 3)) | (1 << (b >> 2)) if (b & 3) < (b >> 2) else 0 for b in range(16)],
                          dtype=torch.uint8, device="cpu")


def mask_nm(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """N:M mask keeping the ``n`` largest-magnitude entries of every ``m``
    consecutive entries along the last (input) dimension.

    Keeping the ``n`` largest magnitudes of each group maximizes the kept
    total magnitude, group by group, so the mask is optimal among N:M masks.
    Ties go to the lower column index (deterministic on every device). Other
    mask methods (2-D, Wanda, SparseGPT) build on this one in
    :mod:`sparse24.masks`; ``sparse24.mask_nm(w, n, m, method=...)`` picks one.

    Args:
        w: ``(R, C)`` floating weight, ``C % m == 0``. Any device but meta (ValueError: no values);
            not a DTensor (TypeError: ``full_tensor()`` it first).
        n, m: keep ``n`` of every ``m``.
    Returns:
        ``(R, C)`` bool mask on ``w``'s device.
    Example:
        >>> mask = mask_nm(torch.randn(8, 16), 2, 4)
        >>> int(mask.sum())
        64
    """
    check_nm(n, m)
    check_weight(w, m)
    if n == 2 and m == 4:   # a block of rows at a time: whole, this peaked at 1.25x a bf16 weight, now 0.5x
        R, C = w.shape
        mask = torch.empty(R, C, dtype=torch.bool, device=w.device)
        for rows in row_chunks(R, C, w.device):
            block = mask[rows]
            block.copy_(_nibble_mask(_nibbles24(w[rows])).view(block.shape))
        return mask
    keys = _magnitude_keys(w).view(-1, m)
    # A stable descending sort keeps the lower column first among equal keys.
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    mask = torch.zeros_like(keys, dtype=torch.bool)
    mask.scatter_(-1, order[:, :n], True)
    return mask.view(w.shape)


def is_nm(w: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True if every group of ``m`` consecutive entries along the last
    dimension of ``w`` (any shape with at least 1 dim, last dim divisible by m;
    not on the meta device) has at most ``n`` non-zeros."""
    check_nm(n, m)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() == 0:
        raise ValueError("w must have at least 1 dimension, got a 0-d tensor")
    if w.shape[-1] % m != 0:
        raise ValueError(f"last dimension ({w.shape[-1]}) must be divisible by m={m}")
    refuse_meta(w, "w")
    # Counted in the smallest integer that holds m: a bool sum defaults to int64, 2 bytes per fp16 weight
    # (5.5x the weight's bytes in all, the peak of every magnitude prune; uint8: the bool tensor's 1 byte)
    count = torch.uint8 if m < 256 else torch.int32
    return bool(((w != 0).reshape(-1, m).sum(-1, dtype=count) <= n).all())


# --- packing -----------------------------------------------------------------



def _pack_meta(nib: torch.Tensor) -> torch.Tensor:
    """(R, G) int32 nibbles (slot_lo | slot_hi << 2) -> (ceil(G/8), R) int32 words."""
    R, G = nib.shape
    pad = (-G) % 8
    if pad:
        nib = torch.nn.functional.pad(nib, (0, pad))
    # explicit word count: a -1 would be ambiguous for R == 0 rows
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=nib.device)  # a factory call: traceable
    words = (nib.view(R, (G + pad) // 8, 8) << shifts).sum(-1, dtype=torch.int32)
    return words.t().contiguous()


def _slot_nibbles(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """(W, R) int32 words -> (R, groups) int32 group nibbles ``slot_lo | slot_hi << 2``."""
    R = meta.shape[1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=meta.device)
    return ((meta.t().unsqueeze(-1) >> shifts) & 15).reshape(R, 8 * meta.shape[0])[:, :groups]


def _unpack_slots(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """(W, R) int32 words -> (R, groups, 2) int64 slots.

    Shifts out whole nibbles and maps them through a 16-row table: half the
    shifts of unpacking 2-bit fields, and the int64 index comes out of one
    gather (to_dense of 4096x4096 fp32: 0.16 s vs 0.20 s, loaded 2-core x86).
    The constants are built here from factory calls, not kept as module-level
    tensors: the registered op's backward calls this under torch.compile /
    export tracing, where a real tensor constant among fake tensors is an error.
    """
    R = meta.shape[1]
    nib = _slot_nibbles(meta, groups)  # (R, groups) int32
    codes = torch.arange(16, device=meta.device)
    table = torch.stack((codes & 3, codes >> 2), dim=-1)  # nibble -> (slot_lo, slot_hi)
    return table.index_select(0, nib.reshape(-1)).view(R, groups, 2)


def transformed(*tensors) -> bool:
    """Whether any of ``tensors`` (None allowed) is wrapped by torch.func (vmap, grad, jvp ...) or dual:
    a plain tensor (e.g. the weight when vmap maps only x) keeps the fast in-place paths."""
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors) \
        or has_tangent(*tensors)


def has_tangent(*tensors) -> bool:
    """Whether any of ``tensors`` (None allowed) is a dual tensor of ``torch.autograd.forward_ad``."""
    return _fwAD._current_level >= 0 and any(t is not None and _fwAD.unpack_dual(t).tangent is not None
                                             for t in tensors)


# Elements per block of to_dense on a CPU: 256K (1 MiB fp32) stays in cache between zeroing and
# scattering (64-row blocks of a 4096-column weight; 16- and 256-row blocks were slower).
_DENSE_BLOCK = 1 << 18


def _build_byte_columns(device) -> torch.Tensor:
    """``(256, 4)`` int64: a metadata byte (groups ``2k``, ``2k+1``: nibbles ``slot_lo | slot_hi << 2``)
    -> the columns of its four kept values among the pair's 8 dense columns. Built from factory
    calls (as in :func:`_unpack_slots`: to_dense runs under tracing in the op's backward)."""
    b = torch.arange(256, device=device)
    lo, hi = b & 15, b >> 4
    return torch.stack((lo & 3, lo >> 2, 4 + (hi & 3), 4 + (hi >> 2)), dim=-1)


_BYTE_COLUMNS: dict = {}   # device -> _build_byte_columns(device), eager mode only


def _byte_columns(device: torch.device) -> torch.Tensor:
    """:func:`_build_byte_columns`, built once per device in eager mode: it is 11 small ops (~25 us on
    a CPU, a third of a small compressed layer's call), and the reference decompresses a large weight
    in several row blocks. Built afresh while tracing (torch.compile, export, jit.trace, a fake-tensor
    or other dispatch mode: a real tensor constant among fake tensors is an error), under torch.func
    (inside grad a new tensor is a wrapper of that call's level) and during CUDA graph capture (whose
    private memory pool should not hold a long-lived tensor)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active() \
            or device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _build_byte_columns(device)
    table = _BYTE_COLUMNS.get(device)
    if table is None:
        table = _BYTE_COLUMNS[device] = _build_byte_columns(device)
    return table


class Sparse24Tensor:
    """A 2:4-sparse matrix stored compressed: kept values plus 2-bit slots.

    Plain tensors only (``values``, ``meta``, optional ``scale`` and ``zero``),
    so it can live in a state dict. See the module docstring for the bit layout.

    Attributes:
        values: ``(R, C // 2)`` kept values (``dtype``; int8 when INT8), or
            ``(R, C // 4)`` uint8, two 4-bit codes per byte, when INT4.
        meta: ``(ceil(C / 32), R)`` int32 packed slots.
        scale: ``None``; ``(R,)`` float32 (INT8); ``(R, ceil(C / group_size))``
            float16 (INT4).
        zero: ``None``, or ``(R, ceil(C / group_size))`` uint8 INT4 zero points.
        group_size: INT4 quantization group along C (32, 64 or 128), else None.
        quantized: ``None``, ``"int8"`` or ``"int4"``.
        shape: logical ``(R, C)``.
        dtype: logical dtype of the dense matrix.

    The constructor checks shapes, dtypes and devices, and with ``check=True``
    (the default) also runs :meth:`validate` on the metadata.
    """

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, shape, dtype: torch.dtype | None = None,
                 scale: torch.Tensor | None = None, *, zero: torch.Tensor | None = None,
                 group_size: int | None = None, check: bool = True):
        if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2:
            raise ValueError(f"shape must be a logical (R, C) pair, got {shape!r}")
        R, C = (int(s) for s in shape)
        if C % 4 != 0 or R < 0 or C < 0:
            raise ValueError(f"logical shape must be (R, C) with C divisible by 4, got {(R, C)}")
        if not isinstance(values, torch.Tensor) or not isinstance(meta, torch.Tensor):
            raise TypeError("values and meta must be tensors")
        for name, t in (("scale", scale), ("zero", zero)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        int4 = group_size is not None
        if zero is not None and not int4:
            raise ValueError("zero points belong to INT4 weights: pass group_size too")
        want = (R, C // 4) if int4 else (R, C // 2)
        if tuple(values.shape) != want:
            raise ValueError(f"values must have shape {want} for logical shape {(R, C)}"
                             f"{' (INT4: one byte per group)' if int4 else ''}, got {tuple(values.shape)}")
        if meta.dtype != torch.int32 or tuple(meta.shape) != ((C + 31) // 32, R):
            raise ValueError(f"meta must be int32 of shape {((C + 31) // 32, R)}, got {meta.dtype} {tuple(meta.shape)}")
        if any(t is not None and t.device != values.device for t in (meta, scale, zero)):
            raise ValueError("values, meta, scale and zero must be on one device")
        if scale is None:
            if int4:
                raise ValueError("INT4 weights need scales")
            if values.dtype not in FLOAT_DTYPES:
                raise TypeError(f"unquantized values must be floating point, got {values.dtype}")
            dtype = values.dtype if dtype is None else dtype
            if dtype != values.dtype:
                raise TypeError(f"dtype {dtype} does not match values' dtype {values.dtype}")
        else:
            if int4:
                _check_int4_fields(values, scale, zero, group_size, R, C)
            elif values.dtype != torch.int8:
                raise TypeError(f"quantized values must be int8 (or uint8 with group_size for INT4), "
                                f"got {values.dtype}")
            elif scale.dtype != torch.float32 or tuple(scale.shape) != (R,):
                raise ValueError(f"scale must be float32 of shape {(R,)}, got {scale.dtype} {tuple(scale.shape)}")
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"quantized tensors need a floating logical dtype, got {dtype}")
        self.values, self.meta, self.scale, self.zero = values, meta, scale, zero
        self.group_size = int(group_size) if int4 else None
        self.shape = torch.Size((R, C))
        self.dtype = dtype
        # Hand-built metadata may claim one slot twice, which every backend would
        # decode to a different wrong matrix; callers whose metadata is valid by
        # construction (compress, to, the modules' forward) skip the full unpack.
        if check:
            self.validate()

    # -- basic properties --
    @property
    def device(self) -> torch.device:
        """The device of every tensor it holds (``values``, ``meta``, ``scale``, ``zero``)."""
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes of values + 2-bit indices (R * C/2 indices of 2 bits, rounded
        up to whole bytes), without the int32 padding of ``meta``. Scales are
        reported by :attr:`scale_nbytes`."""
        R, C = self.shape
        return self.values.numel() * self.values.element_size() + (R * C + 7) // 8

    @property
    def quantized(self) -> str | None:
        """``None``, ``"int8"`` or ``"int4"``."""
        if self.scale is None:
            return None
        return "int4" if self.group_size is not None else "int8"

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the scales and (INT4, asymmetric) zero points."""
        return sum(t.numel() * t.element_size() for t in (self.scale, self.zero) if t is not None)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense matrix in the stored element type (int8 when INT8,
        half a byte per weight when INT4)."""
        if self.group_size is not None:
            return (self.shape.numel() + 1) // 2
        return self.shape.numel() * self.values.element_size()

    def __repr__(self) -> str:
        q = f", quantized={self.quantized}" if self.scale is not None else ""
        if self.group_size is not None:
            q += f", group_size={self.group_size}, {'asymmetric' if self.zero is not None else 'symmetric'}"
        return f"Sparse24Tensor(shape={tuple(self.shape)}, dtype={self.dtype}{q}, device={self.device})"

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Sparse24Tensor":
        """Move to ``device`` and/or cast the (unquantized) values to ``dtype``
        (a quantized tensor changes only its logical dtype). As with ``torch.Tensor.to``,
        a dtype may come first alone: ``p.to(torch.bfloat16)``. The int32 ``meta`` (and the
        scales and zero points) keep their dtypes; every shape stays the same."""
        if isinstance(device, torch.dtype):   # to(dtype): it reached .to(device) and cast the int32 meta
            if dtype is not None:
                raise TypeError(f"Sparse24Tensor.to got two dtypes ({device} and dtype={dtype}): pass the device first")
            device, dtype = None, device
        if device is not None and not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"Sparse24Tensor.to: device must be a torch.device, str or int, got "
                            f"{type(device).__name__} (cast with dtype=)")
        values = self.values.to(device)
        if dtype is not None and dtype != self.dtype:
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"cannot cast a Sparse24Tensor to {dtype}")
            if self.scale is None:
                values = values.to(dtype)
        scale, zero = (None if t is None else t.to(device) for t in (self.scale, self.zero))
        return Sparse24Tensor(values, self.meta.to(device), self.shape, dtype or self.dtype, scale, zero=zero,
                              group_size=self.group_size, check=False)

    def slots(self, rows: slice | None = None) -> torch.Tensor:
        """``(R, C // 4, 2)`` int64 slot (0..3) of each kept value, or of ``rows`` only: 4 bytes per
        weight, so a pass over a large weight takes a block of rows at a time."""
        if rows is not None and not isinstance(rows, slice):
            raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
        return _unpack_slots(self.meta if rows is None else self.meta[:, rows], self.shape[1] // 4)

    def kept_mask(self) -> torch.Tensor:
        """``(R, C)`` bool: the positions this weight keeps (its 2-bit slots), whatever the values."""
        R, C = self.shape
        keep = torch.zeros(R, C // 4, 4, dtype=torch.bool, device=self.device)
        for rows in row_chunks(R, C, self.device):   # (the int64 slots a block of rows at a time)
            keep[rows].scatter_(-1, self.slots(rows), True)
        return keep.view(R, C)

    def dequantized_values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(R, C // 2)`` kept values in ``dtype`` (default: the logical dtype), one of
        :data:`FLOAT_DTYPES` (TypeError otherwise: an integer or bool dtype would truncate them)."""
        if dtype is not None and not isinstance(dtype, torch.dtype):
            # (Tensor.to(3) would read 3 as a device)
            raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype ({', '.join(map(str, FLOAT_DTYPES))}), got {dtype}: "
                            "the dequantized values are not integers")
        return self._dequantized(slice(None)).to(dtype or self.dtype)

    def int4_codes(self) -> torch.Tensor:
        """INT4 only: ``(R, C // 2)`` uint8 codes ``u`` (0..15) of the kept values, in values order."""
        if self.group_size is None:
            raise ValueError("int4_codes() needs an INT4 tensor")
        return _unpack_nibbles(self.values)

    def _dequantized(self, rows: slice) -> torch.Tensor:
        """Kept values of ``rows`` as stored (unquantized) or dequantized in float32 (an INT8 float64
        weight's in float64: ``q * scale`` is exact there, not in float32; INT4's is exact in float32)."""
        values = self.values[rows]
        if self.scale is None:
            return values
        if self.group_size is None:
            wide = torch.float64 if self.dtype == torch.float64 else torch.float32
            return values.to(wide) * self.scale[rows, None].to(wide)
        zero = 8.0 if self.zero is None else self._per_value(self.zero[rows]).float()
        return (_unpack_nibbles(values).float() - zero) * self._per_value(self.scale[rows]).float()

    def _per_value(self, t: torch.Tensor) -> torch.Tensor:
        """``(r, groups)`` per-quantization-group tensor -> ``(r, C // 2)``, one per kept value."""
        return t.repeat_interleave(self.group_size // 2, dim=1)[:, :self.shape[1] // 2]

    def to_dense(self, rows: slice | None = None) -> torch.Tensor:
        """Decompress to the dense ``(R, C)`` matrix (or ``rows`` of it), zeros elsewhere.

        One scatter per block of rows into a zeroed block, at column indices read from
        each metadata byte (two groups) through a 256-entry table; on a CPU the blocks
        are cache-sized, so the zeros and the values are written while the block is in
        cache (4096x4096 fp32, 1 thread of a loaded 2-core AMD EPYC: 1.3-1.5x a
        ``clone`` of the result, where unpacking every slot to an int64 index first
        took 3x; see scripts/bench_core.py). Under torch.func or forward-mode AD the blocks
        are computed out of place (vmap over stacked weights, jvp / jacfwd w.r.t. the values).
        """
        R, C = self.shape
        if rows is not None and not isinstance(rows, slice):
            raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
        rows = slice(None) if rows is None else rows
        meta, row_ids = self.meta[:, rows], range(R)[rows]
        r, pairs = len(row_ids), (C // 4 + 1) // 2  # groups are read two (one byte) at a time
        # metadata batched by vmap (stacked models' buffers): torch < 2.13 has no batching rule for the
        # uint8 view below ("Batching rule not implemented for aten::view.dtype"): its bytes by shifts there
        meta_wrapped = transformed(meta)
        if meta_wrapped or transformed(self.values, self.scale, self.zero):
            # torch.func (e.g. vmap over stacked weights) or forward-mode AD: batched tensors cannot be
            # written into a plain buffer and the int16 view below drops a tangent, so these go out of
            # place, a block at a time, joined at the end
            out, blocks = None, []
        else:
            out = torch.empty(r, C, dtype=self.dtype, device=self.device)
        columns = _byte_columns(self.device)
        # An even group count: scatter each byte's four values into its own 8 columns, a (rows, pairs, 8)
        # view, at the table's columns 0..7 as they are. An odd one (C % 8 == 4) ends in a padding group
        # whose columns lie past C: there the columns are offset to whole rows and the padding dropped.
        base = None if C % 8 == 0 else torch.arange(0, 8 * pairs, 8, device=self.device).view(pairs, 1)
        step = max(1, _DENSE_BLOCK // max(C, 1)) if self.device.type == "cpu" else max(r, 1)
        for r0 in range(0, r, step):
            r1 = min(r, r0 + step)
            n = r1 - r0
            # (rows, words), a copy with unit last stride: with one word per row .contiguous() keeps
            # the transposed view (a size-1 dim's stride does not count), which view(uint8) refuses
            m = meta[:, r0:r1].t().clone(memory_format=torch.contiguous_format)
            # byte j of a word = its bits 8j..8j+7: on a little-endian machine, its j-th byte in memory
            # (a view: 1/5 of the time of the shifts, which big-endian machines still need)
            byte = m.view(torch.uint8).int() if sys.byteorder == "little" and not meta_wrapped else \
                (m.unsqueeze(-1) >> torch.arange(0, 32, 8, dtype=torch.int32, device=m.device)) & 255
            byte = byte.reshape(n, 4 * m.shape[1])[:, :pairs]
            idx = columns.index_select(0, byte.reshape(-1)).view(n, pairs, 4)
            # dequantized as dequantized_values does, a block at a time
            sub = row_ids[r0:r1]
            v = self._dequantized(slice(sub.start, sub.stop, sub.step)).to(self.dtype)
            if base is None:
                shape, dim, v = (n, pairs, 8), 2, v.reshape(n, pairs, 4)
            else:
                shape, dim, idx = (n, C), 1, (idx + base).view(n, 4 * pairs)[:, :C // 2]
            if out is None:
                blocks.append(torch.zeros(shape, dtype=self.dtype, device=self.device).scatter(dim, idx, v)
                              .reshape(n, C))
                continue
            block = out[r0:r1]
            block.zero_()
            if block.element_size() == 2 and not v.requires_grad:  # fp16 / bf16 moved as int16 bits: torch's
                block, v = block.view(torch.int16), v.view(torch.int16)  # CPU scatter of them is ~6x slower
            block.view(shape).scatter_(dim, idx, v)
        if out is None:   # (no blocks: no rows)
            return torch.cat(blocks) if len(blocks) > 1 else blocks[0] if blocks else \
                torch.zeros(0, C, dtype=self.dtype, device=self.device)
        return out

    def validate(self) -> "Sparse24Tensor":
        """Check the metadata is well formed; raise ValueError naming the
        first bad row/group. Returns self."""
        R, C = self.shape
        chunks = row_chunks(R, C, self.device)   # (a block of rows at a time: it runs on every load)
        for rows in chunks:
            nib = _slot_nibbles(self.meta[:, rows], C // 4)
            bad = (nib & 3) >= (nib >> 2)  # duplicate or unordered slots
            if bool(bad.any()):
                r, g = (int(i) for i in bad.nonzero()[0])
                lo, hi = int(nib[r, g]) & 3, int(nib[r, g]) >> 2
                raise ValueError(f"corrupt metadata at row {rows.start + r}, group {g} (columns {4 * g}.."
                                 f"{4 * g + 3}): kept values claim slots {lo} and {hi}; need two distinct slots "
                                 "in increasing order")
        if C % 32:
            used = 2 * ((C // 2) % 16)  # bits of the last word that belong to real groups
            tail = self.meta[-1] >> used
            if bool((tail != 0).any()):
                r = int((tail != 0).nonzero()[0])
                raise ValueError(f"corrupt metadata at row {r}: padding bits past column {C} are not zero")
        if self.scale is not None and not bool(torch.isfinite(self.scale).all()):
            raise ValueError("corrupt scales: non-finite values")
        # (a DTensor, FSDP2's sharded values: this rank's own piece, without communication, so that this may
        # fail on some ranks only; the loader makes the ranks agree, sparse24.nn.state)
        values, (r0, c0) = local_piece(self.values) if self.values.dtype == torch.int8 else (None, (0, 0))
        for rows in row_chunks(values.shape[0], C, values.device) if values is not None else ():
            low = values[rows] == -128
            if bool(low.any()):
                # symmetric INT8 (quantize_values writes -127..127); the decode layout's sign-magnitude bytes
                # cannot hold -128, so a layer loading it would fail later, on its first move to CUDA
                r, c = (int(i) for i in low.nonzero()[0])
                raise ValueError(f"corrupt INT8 values at row {r0 + rows.start + r}, kept value {c0 + c}: -128 is "
                                 "outside the format's range -127..127")
        if self.zero is not None and bool((self.zero > 15).any()):
            r, k = (int(i) for i in (self.zero > 15).nonzero()[0])
            raise ValueError(f"corrupt INT4 zero points at row {r}, group {k}: {int(self.zero[r, k])} is not in 0..15")
        return self

    # -- state dict helpers --
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{"values", "meta"}`` plus ``"scale"`` when quantized and ``"zero"`` when
        INT4 asymmetric (shapes in the class docstring): the plain tensors to store
        (the same objects, not copies). An INT4 tensor's ``group_size`` is not a
        tensor: whoever stores these stores it beside them."""
        d = {"values": self.values, "meta": self.meta}
        if self.scale is not None:
            d["scale"] = self.scale
        if self.zero is not None:
            d["zero"] = self.zero
        return d


def compress(w: torch.Tensor, mask: torch.Tensor | None = None, **kwargs) -> Sparse24Tensor:
    """Compress a weight to the 2:4 format.

    Args:
        w: ``(R, C)`` floating weight, ``C % 4 == 0``, any device.
        mask: optional ``(R, C)`` bool mask with at most 2 True per group of
            4 along the last dim; default: the 2:4 magnitude mask.
        quantize: ``None``, ``"int8"`` or ``"int4"`` (see :mod:`sparse24.quant`).
        group_size, symmetric: INT4 only, passed to :func:`quantize_values` (None: the default,
            128 and True, as :func:`sparse24.nn.quant_options` reads them).
    Returns:
        :class:`Sparse24Tensor` with ``to_dense() == w * mask`` exactly (unquantized).
    Raises:
        TypeError: ``group_size`` / ``symmetric`` given (not None) without ``quantize="int4"``,
            a ``symmetric`` that is not a bool, ``w`` a DTensor (``full_tensor()`` it first); ValueError:
            an unknown mode or group size, ``w`` on the meta device.
    Example:
        >>> p = compress(torch.randn(16, 32))
        >>> p.values.shape, p.meta.shape
        (torch.Size([16, 16]), torch.Size([1, 16]))
    """
    quantize = kwargs.pop("quantize", None)
    qargs = {k: kwargs.pop(k) for k in ("group_size", "symmetric") if k in kwargs}
    if kwargs:
        raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
    if quantize is not None:
        _check_quant_mode(quantize)
    qargs = _quant_args(quantize, **qargs)  # checked before the work: quantize_values would refuse them after it
    check_weight(w, 4)
    R, C = w.shape
    # The nibbles of every row first (a byte per group), so a NaN or a bad mask is refused before any value
    # is gathered; then the values a block of rows at a time, stitched: each group, meta word, scale and
    # INT4 group belongs to one row, so the result is the whole weight's, bit for bit. Whole, the int64
    # slots and float32 temporaries peaked at 4.7x (16-bit), 6.7x (INT8), 8.7x (INT4) a bf16 weight.
    nib = (_nibbles24(w) if mask is None else _mask_nibbles24(mask, w)).view(R, C // 4)
    w = w.detach()
    chunks = row_chunks(R, C, w.device)
    if len(chunks) <= 1 or transformed(w):   # (torch.func / forward AD: out of place, in one piece)
        return _compress_rows(w, mask, nib, quantize, qargs)
    values = meta = scale = zero = None
    for rows in chunks:
        p = _compress_rows(w[rows], None if mask is None else mask[rows], nib[rows], quantize, qargs)
        if values is None:
            values = p.values.new_empty((R, *p.values.shape[1:]))
            meta = p.meta.new_empty(p.meta.shape[0], R)
            scale, zero = (None if t is None else t.new_empty((R, *t.shape[1:])) for t in (p.scale, p.zero))
        values[rows], meta[:, rows] = p.values, p.meta
        for out, t in ((scale, p.scale), (zero, p.zero)):
            if out is not None:
                out[rows] = t
    return Sparse24Tensor(values, meta, (R, C), w.dtype, scale, zero=zero, group_size=p.group_size, check=False)


def _compress_rows(w: torch.Tensor, mask: torch.Tensor | None, nib: torch.Tensor, quantize, qargs: dict
                   ) -> Sparse24Tensor:
    """:func:`compress` of ``w`` (rows of a detached weight) given its ``(r, C/4)`` uint8 group nibbles."""
    R, C = w.shape
    w4 = w.contiguous().view(-1, 4)
    if mask is not None:
        # Zero the dropped columns: a short group's filler slots then hold zeros.
        w4 = torch.where(mask.contiguous().view(-1, 4), w4, torch.zeros((), dtype=w.dtype, device=w.device))
    nib = nib.reshape(-1)
    slots = torch.stack([nib & 3, nib >> 2], dim=-1).long()
    if w4.element_size() == 2 and not transformed(w4):
        # 16-bit values gathered as int16 bits (as to_dense scatters them): torch's CPU gather of
        # bfloat16 rewrites a NaN's sign and payload, and compress -> to_dense is bit-exact
        values = w4.view(torch.int16).gather(-1, slots).view(w.dtype).view(R, C // 2)
    else:
        values = w4.gather(-1, slots).view(R, C // 2)
    meta = _pack_meta(nib.view(R, C // 4).int())
    p = Sparse24Tensor(values, meta, (R, C), w.dtype, check=False)
    if quantize is not None:
        p = quantize_values(p, quantize, **qargs)
    return p


# --- quantized values (INT8, INT4) --------------------------------------------

QUANT_MODES = ("int8", "int4")
_QMAX = 127  # symmetric: -128 is never used, so negation cannot overflow
INT4_GROUP_SIZES = (32, 64, 128)
_INT4_ZERO = 8  # the symmetric zero point: codes 1..15 hold -7..7


def _check_quant_mode(mode) -> None:
    """TypeError / ValueError unless ``mode`` is one of :data:`QUANT_MODES`."""
    if not isinstance(mode, str):
        raise TypeError(f"quantization mode must be a string, one of {QUANT_MODES}, got {type(mode).__name__}")
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; supported: {', '.join(map(repr, QUANT_MODES))}")


def int4_options(group_size=None, symmetric=None) -> tuple[int, bool]:
    """INT4's ``(group_size, symmetric)`` checked, None standing for the default (128, True): the one
    check behind :func:`compress`, :func:`quantize_values` and :func:`sparse24.nn.quant_options`.
    ValueError for a group size other than 32, 64 or 128; TypeError for a ``symmetric`` that is
    not a bool (a string ``"False"`` would read as True)."""
    group_size = check_group_size(128 if group_size is None else group_size)
    symmetric = True if symmetric is None else check_bool(symmetric, "symmetric")
    return group_size, symmetric


def _quant_args(mode, group_size=None, symmetric=None) -> dict:
    """The INT4 options of ``mode`` as keyword arguments (``{}`` for another mode, None included);
    TypeError for one given (not None) to a mode other than INT4."""
    if mode != "int4":
        given = sorted(k for k, v in (("group_size", group_size), ("symmetric", symmetric)) if v is not None)
        if given:
            raise TypeError(f"{given} only apply to quantize='int4', got quantize={mode!r}")
        return {}
    group_size, symmetric = int4_options(group_size, symmetric)
    return {"group_size": group_size, "symmetric": symmetric}


def quantize_values(p: Sparse24Tensor, mode: str = "int8", *, group_size: int | None = None,
                    symmetric: bool | None = None) -> Sparse24Tensor:
    """Round the kept values of a 2:4 weight to INT8 or INT4 (round to nearest).

    INT8: one float32 scale per output row, ``scale[r] = max_j |values[r, j]| / 127``
    (1.0 for an all-zero row), ``q = round(values / scale)`` clamped to [-127, 127].

    INT4: one float16 scale per row and quantization group of ``group_size``
    dense columns (see the module docstring). Symmetric: ``scale = amax / 7``
    (rounded to float16, at least 2**-24, a subnormal one never down; 1.0 for an all-zero group; a bfloat16
    weight's rounded up to 8 significant bits, :func:`bf16_exact_scales`),
    ``u = round(v / scale) + 8`` clamped to 1..15. Asymmetric: ``lo, hi`` =
    the group's min and max with 0 included, ``scale = (hi - lo) / 15``,
    ``zero = round(-lo / scale)`` in 0..15, ``u = round(v / scale) + zero``
    clamped to 0..15. A float16 weight's grids end inside float16's range (a scale
    whose grid would reach past 65504 goes one float16 step down; such an asymmetric
    group takes the symmetric grid, zero point 8). Rounding is half to even; every kept value's error is at
    most ``scale / 2`` (up to the float16 rounding of ``scale``).

    Args:
        p: unquantized :class:`Sparse24Tensor` ``(R, C)`` (any float dtype, any device).
        mode: ``"int8"`` or ``"int4"``.
        group_size: INT4: 32, 64 or 128 (a row's last group may be short); None: 128.
        symmetric: INT4: False adds per-group zero points; None: True. INT8 takes neither
            (TypeError unless both are None).
    Returns:
        A new :class:`Sparse24Tensor` sharing ``p.meta`` (not copied), with ``p``'s
        logical dtype: INT8 ``values`` int8 ``(R, C/2)`` and ``scale`` float32
        ``(R,)``; INT4 ``values`` uint8 ``(R, C/4)``, ``scale`` float16
        ``(R, ceil(C / group_size))`` and ``zero`` (asymmetric) uint8 of that shape.
    Raises:
        TypeError: ``p`` is not a Sparse24Tensor, ``mode`` is not a string, ``symmetric`` is not
            a bool, or INT8 got ``group_size`` / ``symmetric``.
        ValueError: unknown mode or group size, ``p`` already quantized,
            non-finite values, an INT4 scale beyond float16's range.
    Example:
        >>> q = quantize_values(sparse24.compress(torch.randn(8, 32)), "int8")
        >>> q.values.dtype, q.scale.shape, q.nbytes / q.dense_nbytes
        (torch.int8, torch.Size([8]), 0.625)
        >>> q4 = quantize_values(sparse24.compress(torch.randn(8, 256)), "int4")
        >>> q4.values.shape, q4.scale.shape
        (torch.Size([8, 64]), torch.Size([8, 2]))
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"quantize_values needs a Sparse24Tensor (see sparse24.compress), got {type(p).__name__}")
    _check_quant_mode(mode)
    qargs = _quant_args(mode, group_size, symmetric)
    if p.scale is not None:
        raise ValueError("this Sparse24Tensor is already quantized (it has scales); quantize the float weight instead")
    v = p.values.float()
    if not bool(torch.isfinite(v).all()):
        raise ValueError("cannot quantize: the weight has non-finite (inf/NaN) kept values")
    if mode == "int4":
        group_size = qargs["group_size"]
        codes, scale, zero = int4_quantize(v, group_size, qargs["symmetric"], bf16_scales=p.dtype == torch.bfloat16,
                                           fp16_weights=p.dtype == torch.float16)
        return Sparse24Tensor(_pack_nibbles(codes), p.meta, p.shape, p.dtype, scale, zero=zero,
                              group_size=group_size, check=False)
    amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(v / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return Sparse24Tensor(q, p.meta, p.shape, p.dtype, scale, check=False)


def check_group_size(group_size) -> int:
    """Raise unless ``group_size`` is an INT4 group size (32, 64 or 128); return it."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return group_size


def int4_quantize(v: torch.Tensor, group_size: int, symmetric: bool = True,
                  scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, bf16_scales: bool = False,
                  fp16_weights: bool = False):
    """Round kept values to INT4 codes on a group-wise grid (the rule of :func:`quantize_values`).

    Args:
        v: ``(R, n)`` float32 kept values in values order (``n = C / 2``; a row's
            kept values ``k * group_size / 2 ..`` form quantization group ``k``).
        group_size, symmetric: as in :func:`quantize_values`.
        scale, zero: an existing grid ``(R, ceil(2n / group_size))`` (float16,
            uint8 or None) to round onto instead of computing one from ``v``
            (what GPTQ-style quantizers do column by column).
        bf16_scales: new scales rounded up to values bfloat16 holds exactly
            (:func:`bf16_exact_scales`), as :func:`quantize_values` does for bfloat16 weights.
        fp16_weights: new grids end inside float16's range (:func:`_inside_fp16`), as
            :func:`quantize_values` makes them for float16 weights.
    Returns:
        ``(codes (R, n) uint8 0..15, scale float16, zero uint8 or None)``.
    """
    R, n = v.shape
    half = group_size // 2
    groups = -(-n // half)
    if scale is None:
        padded = v.new_zeros(R, groups * half)
        padded[:, :n] = v
        g = padded.view(R, groups, half)
        if symmetric:
            amax = g.abs().amax(-1) if half else g.new_zeros(R, groups)
            s = torch.where(amax > 0, amax / (15 - _INT4_ZERO), torch.ones_like(amax))
        else:
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        if bool((s > torch.finfo(torch.float16).max).any()):
            raise ValueError("cannot quantize to INT4: a group's scale exceeds float16's range (|w| > 458,528)")
        scale = bf16_exact_scales(s) if bf16_scales else _half_scales(s)
        if not symmetric:
            zero = torch.round(-lo / scale.float()).clamp_(0, 15).to(torch.uint8)
        if fp16_weights:
            scale, zero = _inside_fp16(scale, zero, g)
    s = scale.float().repeat_interleave(half, dim=1)[:, :n]
    if zero is None:
        codes = torch.round(v / s).clamp_(1 - _INT4_ZERO, 15 - _INT4_ZERO) + _INT4_ZERO
    else:
        z = zero.float().repeat_interleave(half, dim=1)[:, :n]
        codes = (torch.round(v / s) + z).clamp_(0, 15)
    return codes.to(torch.uint8), scale, zero


def _inside_fp16(scale: torch.Tensor, zero: torch.Tensor | None, g: torch.Tensor):
    """Grids of float16 weights whose ends lie inside float16's range (|grid point| <= 65504).
    A group reaching 65504 got a scale rounded up (fp16(65504 / 7) = 9360: 7 x 9360 = 65520, inf in
    float16, so in every float16 dequantization: to_dense, the reference backend, a kernel's 16-bit
    operands). Symmetric: such a scale goes down one float16 step (to at most amax / 7: the group's
    largest value clips by under 7 steps of the scale's last bit, as a normal scale rounded down
    does). Asymmetric (its zero point's rounding may also put an end past the group's range):
    such a group takes the symmetric grid instead (zero point 8, codes 1..15)."""
    fmax = torch.finfo(torch.float16).max

    def down(s):   # one float16 step toward 0 where 7 steps reach past float16 (positive: bits - 1)
        return torch.where(7 * s.float() > fmax, (s.view(torch.int16) - 1).view(torch.float16), s)

    if zero is None:
        return down(scale), None
    z = zero.float()
    over = torch.maximum(z, 15 - z) * scale.float() > fmax
    if not bool(over.any()):
        return scale, zero
    sym = down(_half_scales(g.abs().amax(-1) / (15 - _INT4_ZERO)))
    return torch.where(over, sym, scale), torch.where(over, torch.full_like(zero, _INT4_ZERO), zero)


def _half_scales(s: torch.Tensor) -> torch.Tensor:
    """float16 scales of fp32 ``s``: rounded to nearest, except that a subnormal one rounded down goes up
    one step (float16's subnormals are 2**-24 apart: rounded down, a group of weights around 1e-4 or less
    clipped by up to several steps; a normal one rounded down clips by at most 15 x 2**-11 of a step)."""
    h = s.clamp(min=2.0 ** -24).half()
    low = (h.float() < s) & (h < 2.0 ** -14)
    return torch.where(low, h + 2.0 ** -24, h)   # (a Python scalar: no tensor on torch's default device)


# The largest float16 value with 8 significant bits (0xFF << 8): float16's max, 65504, has 11
_BF16_EXACT_MAX = 65280.0


def bf16_exact_scales(s: torch.Tensor) -> torch.Tensor:
    """Positive float scales -> float16 scales that bfloat16 also holds exactly: each rounded
    up to 8 significant bits on float16's grid (multiples of 2**-24), at least 2**-24, at
    most 65280 (the largest such; a scale above it, |w| > 456,960, goes down to it and its
    group's largest values clip by < 0.4%). With bfloat16 x the kernels then multiply a code
    by its scale in one step, exactly rounded once (an 11-bit float16 scale takes one more
    fma per register pair: docs/kernels.md, "INT4 weights"). Rounding up keeps every group's
    values inside its grid; the step grows by less than 2**-7 (relative).

    Args:
        s: any shape, finite, positive (float32 or float64).
    Returns:
        float16 tensor of ``s``'s shape.
    """
    s = s.double().clamp(2.0 ** -24, _BF16_EXACT_MAX)
    _, e = torch.frexp(s)   # s = m * 2**e, 0.5 <= m < 1: 8 significant bits are steps of 2**(e - 8)
    step = torch.ldexp(torch.ones_like(s), (e - 8).clamp(min=-24))
    return (torch.ceil(s / step) * step).clamp(max=_BF16_EXACT_MAX).half()


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``(R, n)`` uint8 codes 0..15 (n even) -> ``(R, n / 2)`` bytes, even index in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """``(R, n / 2)`` uint8 bytes -> ``(R, n)`` codes, the inverse of :func:`_pack_nibbles`."""
    return torch.stack((values & 15, values >> 4), dim=-1).view(values.shape[0], 2 * values.shape[1])  # (not -1: 0 rows)


def _check_int4_fields(values, scale, zero, group_size, R: int, C: int) -> None:
    """The constructor's INT4 checks: dtypes and shapes of values, scale, zero; the group size."""
    check_group_size(group_size)
    groups = -(-C // group_size)
    if values.dtype != torch.uint8:
        raise TypeError(f"INT4 values must be uint8 (two 4-bit codes per byte), got {values.dtype}")
    if scale.dtype != torch.float16 or tuple(scale.shape) != (R, groups):
        raise ValueError(f"INT4 scale must be float16 of shape {(R, groups)} (group_size {group_size}), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if zero is not None and (zero.dtype != torch.uint8 or tuple(zero.shape) != (R, groups)):
        raise ValueError(f"INT4 zero points must be uint8 of shape {(R, groups)}, got {zero.dtype} {tuple(zero.shape)}")


def _mask_nibbles24(mask: torch.Tensor, w: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Check a 2:4 mask for ``w``; return its (R*C/4,) uint8 group nibbles.

    One table lookup of the 4 kept flags both packs the slots and finds groups
    keeping more than 2 (ValueError naming the first row/group; ``row0``: the
    index of ``mask``'s first row in a whole one it is a piece of).
    """
    check_mask(mask, w)
    R, C = w.shape
    nib = torch.empty(R, C // 4, dtype=torch.uint8, device=w.device)
    for rows in row_chunks(R, C, w.device):   # (the int64 lookup index of the whole mask was 2 B per weight)
        # clamp: a bool stored as a byte other than 0/1 (a corrupt file) is True to torch, and a
        # raw byte above 1 would index past the table (fuzzing found it: tests/format/test_fuzz_findings.py)
        k = mask[rows].contiguous().view(-1, 4).view(torch.uint8).clamp(max=1)
        block = nib[rows]
        block.copy_(_lookup(_NIB_FROM_KEEP, k[:, 0] | k[:, 1] << 1 | k[:, 2] << 2 | k[:, 3] << 3).view(block.shape))
        bad = block == _BAD
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            r += rows.start
            kept = int(mask[r, 4 * g:4 * g + 4].sum())
            raise ValueError(f"mask is not 2:4: row {row0 + r}, group {g} (columns {4 * g}..{4 * g + 3}) keeps "
                             f"{kept} of 4")
    return nib.view(-1)


def _check_mask24(mask: torch.Tensor, w: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Check a 2:4 mask for ``w`` (``row0``: see :func:`_mask_nibbles24`); return it contiguous."""
    _mask_nibbles24(mask, w, row0)
    return mask.contiguous()

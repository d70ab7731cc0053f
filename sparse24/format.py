"""N:M masks and the compressed 2:4 storage format (pure torch, any device).

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

A group whose mask keeps fewer than 2 columns is stored with zero values in
the lowest unused slots, so every group always names two distinct slots;
``validate`` rejects anything else.

The decode-path kernels (M <= 16) read a second layout, the same kept values
and slots re-ordered into the order their threads consume them and with the
slots re-encoded as keep masks: :class:`DecodePacked` (decode layout,
version 1), defined in the "decode layout" section at the end of this file.
"""
from __future__ import annotations

import torch

__all__ = ["mask_nm", "is_nm", "Sparse24Tensor", "compress", "FLOAT_DTYPES", "DecodePacked", "pack_decode",
           "DECODE_LAYOUT_VERSION"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The integer view of each float dtype: for finite values, comparing
# ``bits & max`` orders magnitudes exactly, and integer compares are much
# cheaper on CPU than fp16 compares (0.055 s vs 0.21 s for torch.topk on a
# 4096x4096 fp16 weight, 2-core x86).
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float32: torch.int32, torch.float64: torch.int64}


def _check_weight(w: torch.Tensor, m: int, name: str = "weight") -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {w.dtype}")
    if w.shape[1] % m != 0:
        raise ValueError(f"{name}'s last dimension ({w.shape[1]}) must be divisible by m={m}")


def _check_nm(n: int, m: int) -> None:
    if not (isinstance(n, int) and isinstance(m, int)) or m < 1 or not 0 <= n <= m:
        raise ValueError(f"need integers 0 <= n <= m and m >= 1, got n={n!r}, m={m!r}")


def _magnitude_keys(w: torch.Tensor) -> torch.Tensor:
    """Integer keys ordering ``|w|`` exactly, same shape as w; rejects NaN."""
    ity = _INT_VIEW[w.dtype]
    keys = w.contiguous().view(ity) & torch.iinfo(ity).max
    # NaN keys are the only ones above +inf's; an integer max is much cheaper
    # than torch.isnan on fp16 (measured 6x on 2-core x86).
    if keys.numel() and int(keys.max()) > _INF_KEY[w.dtype]:
        raise ValueError("weight contains NaN: no magnitude order exists")
    return keys


_INF_KEY = {dt: int(torch.tensor(float("inf"), dtype=dt).view(_INT_VIEW[dt])) for dt in _INT_VIEW}
_PAIRS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def _build_luts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two lookup tables of group nibbles ``slot_lo | slot_hi << 2``.

    ``from_compares[code]``: ``code`` bit b says whether column i beats column j
    for the b-th pair (i, j) of ``_PAIRS``; the two columns beaten by fewer than
    two others are kept. ``from_keep[bits]``: ``bits`` = the 4 kept flags of a
    group (at most 2 set); short groups are filled with the lowest free slots.
    """
    from_compares = torch.zeros(64, dtype=torch.uint8)
    for code in range(64):
        beaten = [0] * 4
        for b, (i, j) in enumerate(_PAIRS):
            beaten[j if (code >> b) & 1 else i] += 1
        kept = [c for c in range(4) if beaten[c] < 2]
        if len(kept) == 2:  # other codes are cyclic, impossible for a total order
            from_compares[code] = kept[0] | kept[1] << 2
    from_keep = torch.full((16,), _BAD, dtype=torch.uint8)  # _BAD: more than 2 kept
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
    """
    k = _magnitude_keys(w).view(-1, 4)
    u8 = torch.uint8
    code = torch.zeros(k.shape[0], dtype=u8, device=w.device)
    for b, (i, j) in enumerate(_PAIRS):
        code |= (k[:, i] >= k[:, j]).view(u8) << b
    return _lookup(_NIB_FROM_COMPARES, code)


def _nibble_mask(nib: torch.Tensor) -> torch.Tensor:
    """(G,) nibbles -> (G, 4) bool keep flags, through a 16-entry table of keep bits."""
    bits = _lookup(_KEEP_BITS, nib)
    return ((bits.unsqueeze(-1) >> torch.arange(4, dtype=torch.uint8, device=nib.device)) & 1).bool()


_KEEP_BITS = torch.tensor([(1 << (b & 3)) | (1 << (b >> 2)) if (b & 3) < (b >> 2) else 0 for b in range(16)],
                          dtype=torch.uint8)


def mask_nm(w: torch.Tensor, n: int = 2, m: int = 4, method: str = "magnitude", **kwargs) -> torch.Tensor:
    """N:M mask keeping the ``n`` largest-magnitude entries of every ``m``
    consecutive entries along the last (input) dimension.

    Keeping the ``n`` largest magnitudes of each group maximizes the kept
    total magnitude, group by group, so the mask is optimal among N:M masks.
    Ties go to the lower column index (deterministic on every device).

    Args:
        w: ``(R, C)`` floating weight, ``C % m == 0``. Any device.
        n, m: keep ``n`` of every ``m``.
        method: ``"magnitude"`` (this function); other methods live in
            :mod:`sparse24.masks` and are dispatched from here.
    Returns:
        ``(R, C)`` bool mask on ``w``'s device.
    Example:
        >>> mask = mask_nm(torch.randn(8, 16), 2, 4)
        >>> int(mask.sum())
        64
    """
    if method != "magnitude":
        from . import masks  # the other mask methods build on this module
        return masks.mask_nm_method(w, n, m, method, **kwargs)
    if kwargs:
        raise TypeError(f"unexpected arguments for method='magnitude': {sorted(kwargs)}")
    _check_nm(n, m)
    _check_weight(w, m)
    if n == 2 and m == 4:
        return _nibble_mask(_nibbles24(w)).view(w.shape)
    keys = _magnitude_keys(w).view(-1, m)
    # A stable descending sort keeps the lower column first among equal keys.
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    mask = torch.zeros_like(keys, dtype=torch.bool)
    mask.scatter_(-1, order[:, :n], True)
    return mask.view(w.shape)


def is_nm(w: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True if every group of ``m`` consecutive entries along the last
    dimension of ``w`` (any shape with at least 1 dim, last dim divisible by m)
    has at most ``n`` non-zeros."""
    _check_nm(n, m)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() == 0:
        raise ValueError("w must have at least 1 dimension, got a 0-d tensor")
    if w.shape[-1] % m != 0:
        raise ValueError(f"last dimension ({w.shape[-1]}) must be divisible by m={m}")
    return bool(((w != 0).reshape(-1, m).sum(-1) <= n).all())


# --- packing -----------------------------------------------------------------

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # one nibble per group, 8 groups per word


def _pack_meta(nib: torch.Tensor) -> torch.Tensor:
    """(R, G) int32 nibbles (slot_lo | slot_hi << 2) -> (ceil(G/8), R) int32 words."""
    R, G = nib.shape
    pad = (-G) % 8
    if pad:
        nib = torch.nn.functional.pad(nib, (0, pad))
    # explicit word count: a -1 would be ambiguous for R == 0 rows
    words = (nib.view(R, (G + pad) // 8, 8) << _SHIFTS.to(nib.device)).sum(-1, dtype=torch.int32)
    return words.t().contiguous()


def _unpack_slots(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """(W, R) int32 words -> (R, groups, 2) int64 slots.

    Shifts out whole nibbles and maps them through a 16-row table: half the
    shifts of unpacking 2-bit fields, and the int64 index comes out of one
    gather (to_dense of 4096x4096 fp32: 0.16 s vs 0.20 s, loaded 2-core x86).
    """
    R = meta.shape[1]
    shifts = _SHIFTS.to(meta.device)
    nib = ((meta.t().unsqueeze(-1) >> shifts) & 15).reshape(R, 8 * meta.shape[0])[:, :groups]  # (R, groups) int32
    return _NIB_SLOTS.to(meta.device).index_select(0, nib.reshape(-1)).view(R, groups, 2)


_NIB_SLOTS = torch.tensor([[b & 3, b >> 2] for b in range(16)], dtype=torch.int64)


class Sparse24Tensor:
    """A 2:4-sparse matrix stored compressed: kept values plus 2-bit slots.

    Plain tensors only (``values``, ``meta``, optional ``scale``), so it can
    live in a state dict. See the module docstring for the bit layout.

    Attributes:
        values: ``(R, C // 2)`` kept values (``dtype``, or int8 if ``scale``).
        meta: ``(ceil(C / 32), R)`` int32 packed slots.
        scale: ``None`` or ``(R,)`` float32 dequantization scales.
        shape: logical ``(R, C)``.
        dtype: logical dtype of the dense matrix.

    The constructor checks shapes, dtypes and devices, and with ``check=True``
    (the default) also runs :meth:`validate` on the metadata.
    """

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, shape, dtype: torch.dtype | None = None,
                 scale: torch.Tensor | None = None, *, check: bool = True):
        if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2:
            raise ValueError(f"shape must be a logical (R, C) pair, got {shape!r}")
        R, C = (int(s) for s in shape)
        if C % 4 != 0 or R < 0 or C < 0:
            raise ValueError(f"logical shape must be (R, C) with C divisible by 4, got {(R, C)}")
        if not isinstance(values, torch.Tensor) or not isinstance(meta, torch.Tensor):
            raise TypeError("values and meta must be tensors")
        if scale is not None and not isinstance(scale, torch.Tensor):
            raise TypeError(f"scale must be a tensor or None, got {type(scale).__name__}")
        if tuple(values.shape) != (R, C // 2):
            raise ValueError(f"values must have shape {(R, C // 2)} for logical shape {(R, C)}, got {tuple(values.shape)}")
        if meta.dtype != torch.int32 or tuple(meta.shape) != ((C + 31) // 32, R):
            raise ValueError(f"meta must be int32 of shape {((C + 31) // 32, R)}, got {meta.dtype} {tuple(meta.shape)}")
        if meta.device != values.device or (scale is not None and scale.device != values.device):
            raise ValueError("values, meta and scale must be on one device")
        if scale is None:
            if values.dtype not in FLOAT_DTYPES:
                raise TypeError(f"unquantized values must be floating point, got {values.dtype}")
            dtype = values.dtype if dtype is None else dtype
            if dtype != values.dtype:
                raise TypeError(f"dtype {dtype} does not match values' dtype {values.dtype}")
        else:
            if values.dtype != torch.int8:
                raise TypeError(f"quantized values must be int8, got {values.dtype}")
            if scale.dtype != torch.float32 or tuple(scale.shape) != (R,):
                raise ValueError(f"scale must be float32 of shape {(R,)}, got {scale.dtype} {tuple(scale.shape)}")
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"quantized tensors need a floating logical dtype, got {dtype}")
        self.values, self.meta, self.scale = values, meta, scale
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
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes of values + 2-bit indices (R * C/2 indices of 2 bits, rounded
        up to whole bytes), without the int32 padding of ``meta``. Scales are
        reported by :attr:`scale_nbytes`."""
        R, C = self.shape
        return self.values.numel() * self.values.element_size() + (R * C + 7) // 8

    @property
    def scale_nbytes(self) -> int:
        return 0 if self.scale is None else self.scale.numel() * self.scale.element_size()

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense matrix in the stored element type (int8 when quantized)."""
        return self.shape.numel() * self.values.element_size()

    def __repr__(self) -> str:
        q = ", quantized=int8" if self.scale is not None else ""
        return f"Sparse24Tensor(shape={tuple(self.shape)}, dtype={self.dtype}{q}, device={self.device})"

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Sparse24Tensor":
        """Move to ``device`` and/or cast the (unquantized) values to ``dtype``."""
        values = self.values.to(device)
        if dtype is not None and dtype != self.dtype:
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"cannot cast a Sparse24Tensor to {dtype}")
            if self.scale is None:
                values = values.to(dtype)
        scale = None if self.scale is None else self.scale.to(device)
        return Sparse24Tensor(values, self.meta.to(device), self.shape, dtype or self.dtype, scale, check=False)

    def slots(self) -> torch.Tensor:
        """``(R, C // 4, 2)`` int64 slot (0..3) of each kept value."""
        return _unpack_slots(self.meta, self.shape[1] // 4)

    def dequantized_values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(R, C // 2)`` kept values in ``dtype`` (default: the logical dtype)."""
        dtype = dtype or self.dtype
        if self.scale is None:
            return self.values.to(dtype)
        return (self.values.float() * self.scale[:, None]).to(dtype)

    def to_dense(self, rows: slice | None = None) -> torch.Tensor:
        """Decompress to the dense ``(R, C)`` matrix (or ``rows`` of it), zeros elsewhere."""
        R, C = self.shape
        if rows is not None and not isinstance(rows, slice):
            raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
        meta, vals = self.meta, self.dequantized_values()
        if rows is not None:
            meta, vals = meta[:, rows], vals[rows]
        r = vals.shape[0]
        out = torch.zeros(r, C // 4, 4, dtype=self.dtype, device=self.device)
        out.scatter_(-1, _unpack_slots(meta, C // 4), vals.view(r, C // 4, 2))
        return out.view(r, C)

    def validate(self) -> "Sparse24Tensor":
        """Check the metadata is well formed; raise ValueError naming the
        first bad row/group. Returns self."""
        R, C = self.shape
        slots = self.slots()
        bad = slots[..., 0] >= slots[..., 1]  # duplicate or unordered slots
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            lo, hi = slots[r, g].tolist()
            raise ValueError(f"corrupt metadata at row {r}, group {g} (columns {4 * g}..{4 * g + 3}): "
                             f"kept values claim slots {lo} and {hi}; need two distinct slots in increasing order")
        if C % 32:
            used = 2 * ((C // 2) % 16)  # bits of the last word that belong to real groups
            tail = self.meta[-1] >> used
            if bool((tail != 0).any()):
                r = int((tail != 0).nonzero()[0])
                raise ValueError(f"corrupt metadata at row {r}: padding bits past column {C} are not zero")
        if self.scale is not None and not bool(torch.isfinite(self.scale).all()):
            raise ValueError("corrupt scales: non-finite values")
        return self

    # -- state dict helpers --
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{"values": (R, C/2), "meta": (ceil(C/32), R)}`` plus ``"scale": (R,)`` when
        quantized: the plain tensors to store (the same objects, not copies)."""
        d = {"values": self.values, "meta": self.meta}
        if self.scale is not None:
            d["scale"] = self.scale
        return d


def compress(w: torch.Tensor, mask: torch.Tensor | None = None, **kwargs) -> Sparse24Tensor:
    """Compress a weight to the 2:4 format.

    Args:
        w: ``(R, C)`` floating weight, ``C % 4 == 0``, any device.
        mask: optional ``(R, C)`` bool mask with at most 2 True per group of
            4 along the last dim; default: the 2:4 magnitude mask.
        quantize: ``None`` or ``"int8"`` (see :mod:`sparse24.quant`).
    Returns:
        :class:`Sparse24Tensor` with ``to_dense() == w * mask`` exactly.
    Example:
        >>> p = compress(torch.randn(16, 32))
        >>> p.values.shape, p.meta.shape
        (torch.Size([16, 16]), torch.Size([1, 16]))
    """
    quantize = kwargs.pop("quantize", None)
    if kwargs:
        raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
    _check_weight(w, 4)
    R, C = w.shape
    w4 = w.detach().contiguous().view(-1, 4)
    if mask is None:
        nib = _nibbles24(w)
    else:
        nib = _mask_nibbles24(mask, w)
        # Zero the dropped columns: a short group's filler slots then hold zeros.
        w4 = torch.where(mask.contiguous().view(-1, 4), w4, torch.zeros((), dtype=w.dtype, device=w.device))
    slots = torch.stack([nib & 3, nib >> 2], dim=-1).long()
    values = w4.gather(-1, slots).view(R, C // 2)
    meta = _pack_meta(nib.view(R, C // 4).int())
    p = Sparse24Tensor(values, meta, (R, C), w.dtype, check=False)
    if quantize is not None:
        from .quant import quantize_values  # INT8 lives in its own module
        p = quantize_values(p, quantize)
    return p


def check_mask(mask: torch.Tensor, w: torch.Tensor) -> None:
    """Raise a clear error unless ``mask`` is a bool tensor shaped and placed like ``w``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != w.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match weight shape {tuple(w.shape)}")
    if mask.device != w.device:
        raise ValueError(f"mask is on {mask.device} but weight is on {w.device}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")


def _mask_nibbles24(mask: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Check a 2:4 mask for ``w``; return its (R*C/4,) uint8 group nibbles.

    One table lookup of the 4 kept flags both packs the slots and finds groups
    keeping more than 2 (ValueError naming the first row/group).
    """
    check_mask(mask, w)
    k = mask.contiguous().view(-1, 4).view(torch.uint8)
    nib = _lookup(_NIB_FROM_KEEP, k[:, 0] | k[:, 1] << 1 | k[:, 2] << 2 | k[:, 3] << 3)
    bad = nib == _BAD
    if bool(bad.any()):
        r, g = divmod(int(bad.nonzero()[0]), w.shape[1] // 4)
        kept = int(mask[r, 4 * g:4 * g + 4].sum())
        raise ValueError(f"mask is not 2:4: row {r}, group {g} (columns {4 * g}..{4 * g + 3}) keeps {kept} of 4")
    return nib


def _check_mask24(mask: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Check a 2:4 mask for ``w``; return it contiguous."""
    _mask_nibbles24(mask, w)
    return mask.contiguous()


# --- decode layout (version 1) -------------------------------------------------
#
# The decode-path kernels (kernels/sparse24_decode.py, M <= 16) spend their
# instruction budget on decoding, so the weight is stored for them in the
# order their threads consume it, with the slots re-encoded so that each
# byte-permute selector costs one multiply-add (measured with the general
# kernel and layout v1: 0.37-0.41 SASS warp-instructions per byte; with this
# layout and the decode kernel: docs/kernels.md). Same information, still
# 4 bits per group; exact round trip to and from Sparse24Tensor.
#
# An (R, C) weight is cut into atoms of 16 rows x 64 dense columns: row tile
# t = r // 16, atom a = c // 64. Rows are zero-padded to a multiple of 128
# (NT = 8 * ceil(R / 128) row tiles, so a program's 2, 4 or 8 tiles never run
# past the end), columns to whole atoms (KA = ceil(C / 64)). Inside an atom,
# the group at row 8*b + i (b in 0..1, i in 0..7) and dense columns
# 16*q + 4*j .. 16*q + 4*j + 3 (q in 0..3, j in 0..3) belongs to lane
# l = 4*i + j and is that lane's group number g = 2*q + b. (This is the
# mma.m16n8k16 A-fragment ownership once the kernel permutes the 16 columns
# of each chunk: lane 4*i + j holds rows i, i + 8 and one whole group of each.)
#
# * ``meta``: int32 (NT, 32, KM), KM = KA rounded up to a multiple of 16:
#   word meta[t, l, a] holds lane l's 8 groups of atom a, group g in bits
#   4g .. 4g+3, as a keep mask with bit order (slot 0, slot 1, slot 3, slot 2):
#   bit 4g+0 set when slot 0 is kept, 4g+1 slot 1, 4g+2 slot 3, 4g+3 slot 2.
#   Exactly two bits per real group; padding groups and atoms are 0. (Slots 3
#   and 2 are swapped so that both byte-permute selectors are one multiply-add
#   of a 2-bit field.) A lane's words of consecutive atoms are contiguous, so a
#   thread loads its own K-tile's words as one vector.
# * ``values`` for 16-bit weights (float16/bfloat16): (KA, 2, NT, 32, 8), the
#   weight's dtype: values[a, q // 2, t, l, 4*(q % 2) + 2*b + v] is lane l's
#   group (q, b) value v (0: lower slot, 1: higher slot). A lane's 8 values of
#   one half-atom are 16 contiguous bytes, a warp's 512 bytes are contiguous and
#   so are consecutive row tiles of one half-atom.
# * ``values`` for INT8 weights: uint8 (KA, NT, 32, 16), sign-magnitude bytes
#   (bit 7 sign, bits 0-6 |value|, |value| <= 127):
#   values[a, t, l, 4*q + 2*v + b]; with ``scale`` (R,) float32 as in layout v1.
#   (Sign-magnitude lets one AND turn a byte into the exact float16 value
#   value * 2**-24, a subnormal; the kernel multiplies by 2**24 in the epilogue.)
# * padding rows, columns and atoms: values 0, keep mask 0 (they decode to zeros).

DECODE_LAYOUT_VERSION = 1
_DEC_ROWS, _DEC_COLS, _DEC_ROW_ALIGN, _DEC_META_ALIGN = 16, 64, 128, 16
_DEC_CODE_BIT = (0, 1, 3, 2)  # slot -> bit of the group's 4-bit keep mask


def _decode_dims(R: int, C: int) -> tuple[int, int, int]:
    """``(NT, KA, KM)``: padded row tiles, atoms, and atoms of meta storage."""
    NT = -(-R // _DEC_ROW_ALIGN) * (_DEC_ROW_ALIGN // _DEC_ROWS)
    KA = -(-C // _DEC_COLS)
    return NT, KA, -(-KA // _DEC_META_ALIGN) * _DEC_META_ALIGN


def _dec_pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, cols - x.shape[1], 0, rows - x.shape[0]))


class DecodePacked:
    """A compressed 2:4 weight in decode layout version 1 (see the comment
    block above this class in ``sparse24/format.py``): what the decode-path
    kernels (M <= 16) read.

    Attributes:
        values: 16-bit weights: ``(KA, 2, NT, 32, 8)`` float16/bfloat16;
            INT8 weights: ``(KA, NT, 32, 16)`` uint8 sign-magnitude bytes.
        meta: ``(NT, 32, KM)`` int32 keep masks (8 groups per word).
        scale: ``None`` or ``(R,)`` float32 dequantization scales (INT8).
        shape: logical ``(R, C)``; ``NT = 8 * ceil(R / 128)``,
            ``KA = ceil(C / 64)``, ``KM = 16 * ceil(KA / 16)``.
        dtype: logical dtype of the dense matrix.
        version: :data:`DECODE_LAYOUT_VERSION`.

    Build one with :func:`pack_decode`; :meth:`to_sparse24` is its exact inverse.
    """

    version = DECODE_LAYOUT_VERSION

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, shape, dtype: torch.dtype,
                 scale: torch.Tensor | None = None, *, check: bool = True):
        R, C = (int(s) for s in shape)
        if C % 4 or R < 0 or C < 0:
            raise ValueError(f"logical shape must be (R, C) with C divisible by 4, got {(R, C)}")
        NT, KA, KM = _decode_dims(R, C)
        want = (KA, NT, 32, 16) if scale is not None else (KA, 2, NT, 32, 8)
        vdt = (torch.uint8,) if scale is not None else (torch.float16, torch.bfloat16)
        if values.dtype not in vdt or tuple(values.shape) != want:
            raise ValueError(f"values must be {' or '.join(map(str, vdt))} of shape {want} for logical shape "
                             f"{(R, C)}, got {values.dtype} {tuple(values.shape)}")
        if meta.dtype != torch.int32 or tuple(meta.shape) != (NT, 32, KM):
            raise ValueError(f"meta must be int32 of shape {(NT, 32, KM)}, got {meta.dtype} {tuple(meta.shape)}")
        if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (R,)):
            raise ValueError(f"scale must be float32 of shape {(R,)}, got {scale.dtype} {tuple(scale.shape)}")
        if meta.device != values.device or (scale is not None and scale.device != values.device):
            raise ValueError("values, meta and scale must be on one device")
        if not (values.is_contiguous() and meta.is_contiguous()):
            raise ValueError("values and meta must be contiguous")
        self.values, self.meta, self.scale = values, meta, scale
        self.shape, self.dtype = torch.Size((R, C)), dtype
        if check:
            self.validate()

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Stored bytes of values + meta (padding included)."""
        return self.values.numel() * self.values.element_size() + self.meta.numel() * 4

    def __repr__(self) -> str:
        q = ", quantized=int8" if self.scale is not None else ""
        return f"DecodePacked(shape={tuple(self.shape)}, dtype={self.dtype}{q}, version={self.version}, " \
               f"device={self.device})"

    def to(self, device) -> "DecodePacked":
        scale = None if self.scale is None else self.scale.to(device)
        return DecodePacked(self.values.to(device), self.meta.to(device), self.shape, self.dtype, scale, check=False)

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes (Rp, 16 KA) int64, values (Rp, 16 KA, 2), meta padding atoms)`` in
        logical order (group columns), row and column padding included."""
        NT, KA, KM = _decode_dims(*self.shape)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.device)
        codes = ((self.meta[..., :KA].unsqueeze(-1) >> shifts) & 15).long()   # (t, l, a, g = 2q + b)
        codes = codes.view(NT, 8, 4, KA, 4, 2).permute(0, 5, 1, 3, 4, 2)     # (t, b, i, a, q, j)
        if self.scale is None:
            v = self.values.view(KA, 2, NT, 8, 4, 2, 2, 2)                   # (a, h, t, i, j, qq, b, v)
            v = v.permute(2, 6, 3, 0, 1, 5, 4, 7)                            # (t, b, i, a, h, qq, j, v)
        else:
            v = self.values.view(KA, NT, 8, 4, 4, 2, 2)                      # (a, t, i, j, q, v, b)
            v = v.permute(1, 6, 2, 0, 4, 3, 5)                               # (t, b, i, a, q, j, v)
        return codes.reshape(NT * 16, KA * 16), v.reshape(NT * 16, KA * 16, 2), self.meta[..., KA:]

    def slots(self) -> torch.Tensor:
        """``(R, C // 4, 2)`` int64 slot (0..3) of each kept value (lower slot first)."""
        R, C = self.shape
        codes = self._unpacked()[0][:R, :C // 4]
        return _DEC_SLOTS_OF_CODE.to(self.device).index_select(0, codes.reshape(-1)).view(R, C // 4, 2)

    def validate(self) -> "DecodePacked":
        """Raise ValueError naming the first bad row/group unless every real
        group keeps exactly two slots and all padding is zero. Returns self."""
        R, C = self.shape
        codes, vals, meta_pad = self._unpacked()
        real = codes[:R, :C // 4]
        bad = _DEC_SLOTS_OF_CODE.to(self.device)[real.reshape(-1), 0].view(real.shape) < 0
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"corrupt decode metadata at row {r}, group {g} (columns {4 * g}..{4 * g + 3}): keep mask "
                             f"{int(real[r, g]):#06b} does not keep exactly two slots")
        pad = torch.ones_like(codes, dtype=torch.bool)
        pad[:R, :C // 4] = False
        if bool((codes[pad] != 0).any()) or bool((vals[pad] != 0).any()) or bool((meta_pad != 0).any()):
            raise ValueError(f"corrupt decode layout: padding past the logical shape {(R, C)} is not zero")
        if self.scale is not None and not bool(torch.isfinite(self.scale).all()):
            raise ValueError("corrupt scales: non-finite values")
        return self

    def to_sparse24(self) -> Sparse24Tensor:
        """The same weight in layout v1 (exact inverse of :func:`pack_decode`)."""
        R, C = self.shape
        slots = self.slots()
        vals = self._unpacked()[1][:R, :C // 4]
        if self.scale is not None:
            mag = (vals & 0x7F).to(torch.int16)
            vals = torch.where(vals >= 0x80, -mag, mag).to(torch.int8)
        meta = _pack_meta((slots[..., 0] | slots[..., 1] << 2).int())
        return Sparse24Tensor(vals.reshape(R, C // 2).contiguous(), meta, (R, C), self.dtype, self.scale, check=False)

    def to_dense(self) -> torch.Tensor:
        """Decompress to the dense ``(R, C)`` matrix in ``dtype`` (dequantized when INT8)."""
        return self.to_sparse24().to_dense()


# code (4-bit keep mask in bit order slot 0, 1, 3, 2) -> (lower slot, higher slot), -1 if not exactly two kept
_DEC_SLOTS_OF_CODE = torch.tensor(
    [[s[0], s[1]] if len(s := [k for k in range(4) if code >> _DEC_CODE_BIT[k] & 1]) == 2 else [-1, -1]
     for code in range(16)], dtype=torch.int64)


def pack_decode(p: Sparse24Tensor) -> DecodePacked:
    """Re-order and re-encode a compressed weight for the decode-path kernels.

    Args:
        p: :class:`Sparse24Tensor` ``(R, C)`` with float16/bfloat16 values, or
            INT8 values with scales (see :mod:`sparse24.quant`). Any device.
    Returns:
        :class:`DecodePacked` (decode layout version 1) on p's device;
        ``pack_decode(p).to_sparse24()`` equals ``p`` exactly.
    Raises:
        TypeError: float32/float64 values (cast with ``p.to(dtype=torch.float16)``).
        ValueError: an INT8 value of -128 (sign-magnitude bytes hold [-127, 127]).
    Example:
        >>> d = pack_decode(compress(torch.randn(40, 100).half()))
        >>> d.values.shape, d.meta.shape
        (torch.Size([2, 2, 8, 32, 8]), torch.Size([8, 32, 16]))
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"pack_decode needs a Sparse24Tensor, got {type(p).__name__}")
    if p.scale is None and p.values.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the decode layout holds float16, bfloat16 or INT8 values, got {p.values.dtype}; "
                        f"cast first, e.g. p.to(dtype=torch.float16)")
    R, C = p.shape
    NT, KA, KM = _decode_dims(R, C)
    Rp, Gp = NT * _DEC_ROWS, KA * _DEC_COLS // 4
    slots = p.slots()                                                          # (R, C/4, 2)
    bits = torch.tensor(_DEC_CODE_BIT, device=p.device)
    codes = (1 << bits[slots[..., 0]]) | (1 << bits[slots[..., 1]])
    codes = _dec_pad(codes.unsqueeze(-1), Rp, Gp).squeeze(-1)                  # (Rp, Gp)
    codes = codes.view(NT, 2, 8, KA, 4, 4).permute(0, 2, 5, 3, 4, 1)           # (t, i, j, a, q, b)
    shifts = torch.arange(0, 32, 4, device=p.device)
    words = (codes.reshape(NT, 32, KA, 8) << shifts).sum(-1)                   # int64 < 2**32
    words = torch.nn.functional.pad(words, (0, KM - KA))
    meta = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()
    vals = p.values.view(R, C // 4, 2)
    if p.scale is not None:
        v16 = vals.to(torch.int16)
        if bool((v16 == -128).any()):
            raise ValueError("INT8 values must lie in [-127, 127] (sign-magnitude bytes); -128 found")
        vals = (v16.abs() | torch.where(v16 < 0, 0x80, 0).to(torch.int16)).to(torch.uint8)
    vals = _dec_pad(vals, Rp, Gp)                                              # (Rp, Gp, 2)
    if p.scale is None:
        v = vals.view(NT, 2, 8, KA, 2, 2, 4, 2).permute(3, 4, 0, 2, 6, 5, 1, 7)  # (a, h, t, i, j, qq, b, v)
        values = v.reshape(KA, 2, NT, 32, 8).contiguous()
    else:
        v = vals.view(NT, 2, 8, KA, 4, 4, 2).permute(3, 0, 2, 5, 4, 6, 1)       # (a, t, i, j, q, v, b)
        values = v.reshape(KA, NT, 32, 16).contiguous()
    return DecodePacked(values, meta, (R, C), p.dtype, p.scale, check=False)

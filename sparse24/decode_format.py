"""The decode layout (version 1): a compressed 2:4 weight re-ordered for the
decode-path Triton kernels (``kernels/sparse24_decode.py``) and its slots
re-encoded as keep masks, still 4 bits per group; an exact round trip to and
from :class:`sparse24.format.Sparse24Tensor` (layout v1, the interchange
format: state dicts and checkpoints always hold v1). The layout is defined in
the comment block below, once.
"""
from __future__ import annotations

import torch

from ._checks import check_bool, row_chunks
from .format import Sparse24Tensor, _pack_meta, check_group_size

__all__ = ["DecodePacked", "pack_decode", "decode_dims", "DECODE_LAYOUT_VERSION"]


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
# * ``values`` for INT4 weights (layout v1's offset-binary 4-bit codes u):
#   uint8 (KA, NT, 32, 8), a lane's 16 codes of one atom as two 32-bit words
#   w_h (h = q // 2, little-endian bytes 4h .. 4h+3): nibble n of w_h (bits
#   4n .. 4n+3) holds group (q = 2h + qq, b) value v at n = 2*qq + b + 4*v. So
#   one AND of (w_h >> 4k) with 0x000F000F puts group k's two codes in the low
#   bits of the word's two 16-bit halves, where one OR with a magic exponent
#   makes them float16 1024 + u (bfloat16 128 + u).
#   ``scale`` and ``zero`` as in layout v1 ((R, ceil(C / group_size)), the same
#   tensors: a module's buffers do not change with its layout); the kernel clamps
#   padding rows to row R - 1 (never stored) and masks groups past C.
# * ``meta`` of INT8 and INT4 weights: int32 (NT, 32, 2 * KM): words [..., :KM] the keep
#   masks above, words [..., KM:] the same groups as ``mma.sp`` metadata for the sparse
#   tensor-core kernel (kernels/sparse24_sp.py): word meta[t, l, KM + a] of lane
#   l = 4*g + q holds the 16-column chunk q of atom a for rows g (bits 0-15) and g + 8
#   (bits 16-31), group j of the chunk in bits 4j .. 4j+3 as its two kept slots, the
#   lower in the low two bits (padding groups: 0b0100, slots 0 and 1 of zero values).
#   That is the m16n8k32 metadata operand (PTX ISA; NVIDIA CuTe's ELayout for
#   SM80_SPARSE_16x8x32) of the lanes of sparsity selector 0 (chunks 0, 1 of the atom,
#   lanes q = 0, 1) and 1 (chunks 2, 3) (kernels/sparse24_sp.py).
#   0.125 B per weight more (0.0625x of dense fp16); 16-bit weights do not carry them (their byte-permute
#   decode kernel fits the instruction budget; a layer stays within 0.60x of dense).
# * padding rows, columns and atoms: values 0, keep mask 0 (they decode to zeros),
#   mma.sp words of padding atoms 0.
#
# Bytes per weight of the INT4 decode layout: 0.25 values + 0.125 keep masks + 0.125 mma.sp
# words + 2 (3 asymmetric) / group_size scales, plus the padding (layout v1: 0.375 + scales).

DECODE_LAYOUT_VERSION = 1
_DEC_ROWS, _DEC_COLS, _DEC_ROW_ALIGN, _DEC_META_ALIGN = 16, 64, 128, 16
_DEC_CODE_BIT = (0, 1, 3, 2)  # slot -> bit of the group's 4-bit keep mask


def decode_dims(R: int, C: int) -> tuple[int, int, int]:
    """``(NT, KA, KM)``: padded row tiles, atoms, and atoms of meta storage.

    Args:
        R, C: the logical ``(R, C)`` shape of the weight.
    Returns:
        ``NT = 8 * ceil(R / 128)``, ``KA = ceil(C / 64)``, ``KM = 16 * ceil(KA / 16)`` (see :class:`DecodePacked`).
    """
    NT = -(-R // _DEC_ROW_ALIGN) * (_DEC_ROW_ALIGN // _DEC_ROWS)
    KA = -(-C // _DEC_COLS)
    return NT, KA, -(-KA // _DEC_META_ALIGN) * _DEC_META_ALIGN


def _dec_pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` (r, c, ...) zero-padded to (rows, cols, ...) (not F.pad: torch 2.7 refuses it on empty inputs)."""
    out = x.new_zeros(rows, cols, *x.shape[2:])
    out[:x.shape[0], :x.shape[1]] = x
    return out


class DecodePacked:
    """A compressed 2:4 weight in decode layout version 1 (see the comment
    block above this class in ``sparse24/decode_format.py``): what the decode-path
    kernels (M <= 16) read.

    Attributes:
        values: 16-bit weights: ``(KA, 2, NT, 32, 8)`` float16/bfloat16;
            INT8 weights: ``(KA, NT, 32, 16)`` uint8 sign-magnitude bytes;
            INT4 weights: ``(KA, NT, 32, 8)`` uint8, two 4-bit codes per byte.
        meta: ``(NT, 32, KM)`` int32 keep masks (8 groups per word); INT8 and INT4:
            ``(NT, 32, 2 KM)``, the keep masks then the same groups' ``mma.sp`` words.
        scale: ``None``; ``(R,)`` float32 (INT8); ``(R, ceil(C / group_size))`` float16 (INT4).
        zero: ``None``, or INT4 ``(R, ceil(C / group_size))`` uint8 zero points (asymmetric).
        group_size: INT4 quantization group along K (32, 64, 128), else None.
        shape: logical ``(R, C)``; ``NT = 8 * ceil(R / 128)``,
            ``KA = ceil(C / 64)``, ``KM = 16 * ceil(KA / 16)``.
        dtype: logical dtype of the dense matrix.
        version: :data:`DECODE_LAYOUT_VERSION`.

    values and meta must be contiguous and start at 4-byte aligned addresses
    (the kernel reads 32-bit words). Build one with :func:`pack_decode`;
    :meth:`to_sparse24` is its exact inverse.

    Args:
        values, meta, shape, dtype, scale, zero, group_size: the attributes above.
        check: also check the alignment and validate the bytes (:meth:`validate`; default True).
            False skips both (tensors made here, or FakeTensors under tracing); shapes, dtypes,
            devices and contiguity are checked either way.
    """

    version = DECODE_LAYOUT_VERSION

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, shape, dtype: torch.dtype,
                 scale: torch.Tensor | None = None, *, zero: torch.Tensor | None = None,
                 group_size: int | None = None, check: bool = True):
        R, C = (int(s) for s in shape)
        if C % 4 or R < 0 or C < 0:
            raise ValueError(f"logical shape must be (R, C) with C divisible by 4, got {(R, C)}")
        NT, KA, KM = decode_dims(R, C)
        int4 = group_size is not None
        if int4:
            check_group_size(group_size)
            if scale is None:
                raise ValueError("INT4 weights need scales")
        elif zero is not None:
            raise ValueError("zero points belong to INT4 weights: pass group_size too")
        want = (KA, NT, 32, 8) if int4 else (KA, NT, 32, 16) if scale is not None else (KA, 2, NT, 32, 8)
        vdt = (torch.uint8,) if scale is not None else (torch.float16, torch.bfloat16)
        if values.dtype not in vdt or tuple(values.shape) != want:
            raise ValueError(f"values must be {' or '.join(map(str, vdt))} of shape {want} for logical shape "
                             f"{(R, C)}, got {values.dtype} {tuple(values.shape)}")
        if scale is None and dtype != values.dtype:   # (to_dense / to_sparse24 refused it later)
            raise ValueError(f"dtype {dtype} does not match the 16-bit values' {values.dtype}")
        mshape = (NT, 32, KM * (1 if scale is None else 2))   # INT8 / INT4: keep masks + mma.sp words
        if meta.dtype != torch.int32 or tuple(meta.shape) != mshape:
            raise ValueError(f"meta must be int32 of shape {mshape}, got {meta.dtype} {tuple(meta.shape)}")
        if int4:
            gshape = (R, -(-C // group_size))
            if scale.dtype != torch.float16 or tuple(scale.shape) != gshape:
                raise ValueError(f"INT4 scale must be float16 of shape {gshape} (group_size {group_size}), got "
                                 f"{scale.dtype} {tuple(scale.shape)}")
            if zero is not None and (zero.dtype != torch.uint8 or tuple(zero.shape) != gshape):
                raise ValueError(f"INT4 zero points must be uint8 of shape {gshape}, got {zero.dtype} "
                                 f"{tuple(zero.shape)}")
        elif scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (R,)):
            raise ValueError(f"scale must be float32 of shape {(R,)}, got {scale.dtype} {tuple(scale.shape)}")
        if any(t is not None and t.device != values.device for t in (meta, scale, zero)):
            raise ValueError("values, meta, scale and zero must be on one device")
        if not (values.is_contiguous() and meta.is_contiguous()):
            raise ValueError("values and meta must be contiguous")
        if int4 and not (scale.is_contiguous() and (zero is None or zero.is_contiguous())):
            raise ValueError("INT4 scale and zero points must be contiguous")
        if check:  # (check=False: made here from fresh tensors, or FakeTensors under tracing)
            check_word_aligned(values, meta)
        self.values, self.meta, self.scale, self.zero = values, meta, scale, zero
        self.group_size = int(group_size) if int4 else None
        self.shape, self.dtype = torch.Size((R, C)), dtype
        if check:
            self.validate()

    @classmethod
    def empty(cls, R: int, C: int, dtype: torch.dtype = torch.float16, int8: bool = False,
              device="cpu", *, group_size: int | None = None, symmetric: bool = True) -> "DecodePacked":
        """An uninitialized (R, C) weight of this layout: right shapes, dtypes and
        alignment, storage never written or checked. Only for what reads shapes
        (ahead-of-time compiles, host-side benchmarks with the launch stubbed).

        Args:
            R, C: the logical shape (ints >= 0, ``C`` divisible by 4).
            dtype: the 16-bit values' dtype (float16 or bfloat16; unused when quantized).
            int8: a bool: an INT8 weight (logical dtype float32).
            device: where every tensor is allocated.
            group_size: an INT4 weight of that group size (32, 64 or 128; not with ``int8``).
            symmetric: INT4 only: False adds zero points.
        """
        int8, symmetric = check_bool(int8, "int8"), check_bool(symmetric, "symmetric")
        if group_size is not None:
            check_group_size(group_size)   # (0 divided by zero, -1 made a negative dimension)
            if int8:
                raise ValueError("int8=True and group_size (INT4) exclude each other")
        for name, v in (("R", R), ("C", C)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        NT, KA, KM = decode_dims(R, C)
        zero = None
        if group_size is not None:
            gshape = (R, -(-C // group_size))
            values = torch.empty(KA, NT, 32, 8, dtype=torch.uint8, device=device)
            scale = torch.empty(gshape, dtype=torch.float16, device=device)
            zero = None if symmetric else torch.empty(gshape, dtype=torch.uint8, device=device)
        elif int8:
            values, scale = torch.empty(KA, NT, 32, 16, dtype=torch.uint8, device=device), \
                torch.empty(R, dtype=torch.float32, device=device)   # (not torch's default dtype)
        else:
            values, scale = torch.empty(KA, 2, NT, 32, 8, dtype=dtype, device=device), None
        meta = torch.empty(NT, 32, KM * (1 if scale is None else 2), dtype=torch.int32, device=device)
        return cls(values, meta, (R, C), torch.float32 if int8 else dtype, scale, zero=zero, group_size=group_size,
                   check=False)

    @property
    def device(self) -> torch.device:
        """The device of every tensor it holds (``values``, ``meta``, ``scale``, ``zero``)."""
        return self.values.device

    @property
    def quantized(self) -> str | None:
        """``None``, ``"int8"`` or ``"int4"``."""
        return None if self.scale is None else "int4" if self.group_size is not None else "int8"

    @property
    def nbytes(self) -> int:
        """Stored bytes of values + meta (padding included)."""
        return self.values.numel() * self.values.element_size() + self.meta.numel() * 4

    def __repr__(self) -> str:
        q = f", quantized={self.quantized}" if self.scale is not None else ""
        if self.group_size is not None:
            q += f", group_size={self.group_size}, {'asymmetric' if self.zero is not None else 'symmetric'}"
        return f"DecodePacked(shape={tuple(self.shape)}, dtype={self.dtype}{q}, version={self.version}, " \
               f"device={self.device})"

    def to(self, device) -> "DecodePacked":
        """A copy of this weight with every tensor moved to ``device`` (same layout, shapes and dtypes).
        There is no dtype cast (``torch.Tensor.to(dtype)``): a dtype is a TypeError, as the layout fixes
        its tensors' dtypes; cast the :meth:`to_sparse24` result and pack that."""
        if isinstance(device, torch.dtype):   # it reached .to(device) and cast the int32 meta
            raise TypeError(f"DecodePacked.to takes a device, not a dtype ({device}): the layout fixes its "
                            "tensors' dtypes; use to_sparse24().to(dtype=...) and pack_decode that")
        if device is not None and not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"DecodePacked.to: device must be a torch.device, str or int, got {type(device).__name__}")
        scale, zero = (None if t is None else t.to(device) for t in (self.scale, self.zero))
        return DecodePacked(self.values.to(device), self.meta.to(device), self.shape, self.dtype, scale, zero=zero,
                            group_size=self.group_size, check=False)

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes (Rp, 16 KA) int64, values (Rp, 16 KA, 2), meta padding atoms)`` in
        logical order (group columns), row and column padding included (INT4: the 4-bit codes)."""
        NT, KA, KM = decode_dims(*self.shape)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.device)
        codes = ((self.meta[..., :KA].unsqueeze(-1) >> shifts) & 15).long()   # (t, l, a, g = 2q + b)
        codes = codes.view(NT, 8, 4, KA, 4, 2).permute(0, 5, 1, 3, 4, 2)     # (t, b, i, a, q, j)
        if self.group_size is not None:
            nib = torch.stack((self.values & 15, self.values >> 4), dim=-1)  # (a, t, l, byte, nibble)
            v = nib.view(KA, NT, 8, 4, 2, 2, 2, 2)                           # (a, t, i, j, h, v, qq, b)
            v = v.permute(1, 7, 2, 0, 4, 6, 3, 5)                            # (t, b, i, a, h, qq, j, v)
        elif self.scale is None:
            v = self.values.view(KA, 2, NT, 8, 4, 2, 2, 2)                   # (a, h, t, i, j, qq, b, v)
            v = v.permute(2, 6, 3, 0, 1, 5, 4, 7)                            # (t, b, i, a, h, qq, j, v)
        else:
            v = self.values.view(KA, NT, 8, 4, 4, 2, 2)                      # (a, t, i, j, q, v, b)
            v = v.permute(1, 6, 2, 0, 4, 3, 5)                               # (t, b, i, a, q, j, v)
        return codes.reshape(NT * 16, KA * 16), v.reshape(NT * 16, KA * 16, 2), self.meta[..., KA:KM]

    def slots(self, rows: slice | None = None) -> torch.Tensor:
        """``(R, C // 4, 2)`` int64 slot (0..3) of each kept value (lower slot first), or of ``rows``
        only (as :meth:`Sparse24Tensor.slots`)."""
        R, C = self.shape
        codes = self._unpacked()[0][:R, :C // 4]
        return _slots_of_codes(codes if rows is None else codes[rows])

    def validate(self) -> "DecodePacked":
        """Raise ValueError naming the first bad row/group unless every real
        group keeps exactly two slots and all padding is zero (INT4: and every
        zero point is 0..15, every scale finite). Returns self."""
        R, C = self.shape
        codes, vals, meta_pad = self._unpacked()
        real = codes[:R, :C // 4]
        slots = _slots_of_codes(real)
        bad = slots[..., 0] < 0
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"corrupt decode metadata at row {r}, group {g} (columns {4 * g}..{4 * g + 3}): keep mask "
                             f"{int(real[r, g]):#06b} does not keep exactly two slots")
        pad = torch.ones_like(codes, dtype=torch.bool)
        pad[:R, :C // 4] = False
        if bool((codes[pad] != 0).any()) or bool((vals[pad] != 0).any()) or bool((meta_pad != 0).any()):
            raise ValueError(f"corrupt decode layout: padding past the logical shape {(R, C)} is not zero")
        if self.scale is not None:
            KM = decode_dims(R, C)[2]
            want = _sp_words(slots, R, C)
            if not torch.equal(self.meta[..., KM:], want):
                t, l, a = (int(i) for i in (self.meta[..., KM:] != want).nonzero()[0])
                raise ValueError(f"corrupt mma.sp metadata (row tile {t}, lane {l}, atom {a}): it does not hold the "
                                 f"kept slots of the keep masks")
        if self.scale is not None and not bool(torch.isfinite(self.scale).all()):
            raise ValueError("corrupt scales: non-finite values")
        if self.zero is not None and bool((self.zero > 15).any()):
            r, k = (int(i) for i in (self.zero > 15).nonzero()[0])
            raise ValueError(f"corrupt INT4 zero points at row {r}, group {k}: {int(self.zero[r, k])} is not in 0..15")
        return self

    def to_sparse24(self) -> Sparse24Tensor:
        """The same logical ``(R, C)`` weight as a :class:`Sparse24Tensor` in layout v1 (``values``
        ``(R, C // 2)``, or ``(R, C // 4)`` bytes when INT4; exact inverse of :func:`pack_decode`)."""
        R, C = self.shape
        slots = self.slots()
        vals = self._unpacked()[1][:R, :C // 4]
        if self.group_size is not None:
            vals = (vals[..., 0] | vals[..., 1] << 4).to(torch.uint8)                    # (R, C / 4) bytes
        elif self.scale is not None:
            mag = (vals & 0x7F).to(torch.int16)
            vals = torch.where(vals >= 0x80, -mag, mag).to(torch.int8)
        meta = _pack_meta((slots[..., 0] | slots[..., 1] << 2).int())
        return Sparse24Tensor(vals.reshape(R, C // (4 if self.group_size else 2)).contiguous(), meta, (R, C),
                              self.dtype, self.scale, zero=self.zero,
                              group_size=self.group_size, check=False)

    def to_dense(self, rows: slice | None = None) -> torch.Tensor:
        """Decompress to the dense ``(R, C)`` matrix in ``dtype`` (dequantized when INT8/INT4),
        or only ``rows`` of it (a step-1 slice): then only the 128-row blocks that
        hold them are re-ordered, never the whole weight."""
        if rows is None:
            return self.to_sparse24().to_dense()
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"rows must be a slice with step 1 or None, got {rows!r}")
        R, C = self.shape
        NT = decode_dims(R, C)[0]
        r0, r1, _ = rows.indices(R)
        r1 = max(r0, r1)
        t0 = r0 // _DEC_ROW_ALIGN * (_DEC_ROW_ALIGN // _DEC_ROWS)
        t1 = min(NT, -(-r1 // _DEC_ROW_ALIGN) * (_DEC_ROW_ALIGN // _DEC_ROWS))
        if t1 <= t0:
            return torch.zeros(0, C, dtype=self.dtype, device=self.device)
        b0, b1 = t0 * _DEC_ROWS, min(R, t1 * _DEC_ROWS)  # whole blocks of 128 rows (the last one real rows)
        scale, zero = self.scale, self.zero
        if self.group_size is not None:
            values, scale, zero = self.values[:, t0:t1], scale[b0:b1], None if zero is None else zero[b0:b1]
        elif self.scale is None:
            values = self.values[:, :, t0:t1]
        else:
            values, scale = self.values[:, t0:t1], self.scale[b0:b1]
        block = DecodePacked(values.contiguous(), self.meta[t0:t1].contiguous(), (b1 - b0, C), self.dtype, scale,
                             zero=zero, group_size=self.group_size, check=False)
        return block.to_sparse24().to_dense()[r0 - b0:r1 - b0]


def check_word_aligned(values: torch.Tensor, meta: torch.Tensor) -> None:
    """Raise ValueError unless ``values`` and ``meta`` start at 4-byte aligned
    addresses: the decode kernel reads both as 32-bit words (a contiguous view
    at an odd storage offset faults on a GPU; a copy is aligned)."""
    for name, t in (("values", values), ("meta", meta)):
        if t.data_ptr() % 4:
            raise ValueError(f"decode layout {name} must start at a 4-byte aligned address (data_ptr() % 4 == 0): "
                             f"the kernel reads them as 32-bit words; got a view at byte offset "
                             f"{t.storage_offset() * t.element_size()} of its storage; pass {name}.clone()")


def _slots_of_code(device) -> torch.Tensor:
    """``(16, 2)`` int64: code (4-bit keep mask, bit order slot 0, 1, 3, 2) -> (lower slot,
    higher slot), ``(-1, -1)`` unless exactly two are kept. Built from factory calls, not
    kept as a module-level tensor: the registered op's backward calls this under tracing."""
    codes = torch.arange(16, device=device)
    kept = torch.stack([(codes >> bit) & 1 for bit in _DEC_CODE_BIT], dim=1).bool()   # (16, slot)
    slot = torch.arange(4, device=device)
    lo = torch.where(kept, slot, 4).amin(1)
    hi = torch.where(kept, slot, -1).amax(1)
    return torch.where((kept.sum(1) == 2)[:, None], torch.stack((lo, hi), dim=1), -1)


def _slots_of_codes(codes: torch.Tensor) -> torch.Tensor:
    """``(..., 2)`` slots of the keep-mask codes ``codes`` (``(-1, -1)`` where a code does not keep two)."""
    return _slots_of_code(codes.device).index_select(0, codes.reshape(-1)).view(*codes.shape, 2)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words below 2**32 -> the int32 of the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _with_sp_words(values: torch.Tensor, meta: torch.Tensor, shape, dtype: torch.dtype, scale: torch.Tensor,
                   zero: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """The ``(NT, 32, 2 KM)`` meta of an INT8 / INT4 decode layout from its ``(NT, 32, KM)`` keep masks
    alone: such layouts held no ``mma.sp`` words before 2026-12-02 (modules pickled whole then)."""
    full = torch.cat([meta, torch.zeros_like(meta)], -1)
    p = DecodePacked(values, full, shape, dtype, scale, zero=zero, group_size=group_size, check=False)
    full[..., meta.shape[-1]:] = _sp_words(p.slots(), *p.shape)
    return full


def _sp_words(slots: torch.Tensor, R: int, C: int) -> torch.Tensor:
    """``(NT, 32, KM)`` int32 ``mma.sp`` metadata words (layout comment above) of the kept
    ``slots`` ``(R, C // 4, 2)`` (lower slot first)."""
    NT, KA, KM = decode_dims(R, C)
    idx = slots[..., 0] | slots[..., 1] << 2                                    # (R, C/4) nibbles
    pad = torch.full((NT * _DEC_ROWS, KA * _DEC_COLS // 4), 0b0100, dtype=torch.int64, device=slots.device)
    pad[:R, :C // 4] = idx
    nib = pad.view(NT, 2, 8, KA, 4, 4).permute(0, 2, 4, 3, 1, 5)                # (t, g, q, a, b, j)
    shifts = 16 * torch.arange(2, device=slots.device)[:, None] + 4 * torch.arange(4, device=slots.device)
    words = (nib << shifts).sum((-1, -2)).reshape(NT, 32, KA)                   # lane 4g + q
    out = torch.zeros(NT, 32, KM, dtype=torch.int64, device=slots.device)
    out[..., :KA] = words
    return _int32(out)


def pack_decode(p: Sparse24Tensor) -> DecodePacked:
    """Re-order and re-encode a compressed weight for the decode-path kernels.

    Args:
        p: :class:`Sparse24Tensor` ``(R, C)`` with float16/bfloat16 values, or
            INT8 or INT4 values with scales (see :mod:`sparse24.quant`). Any device.
    Returns:
        :class:`DecodePacked` (decode layout version 1) on p's device;
        ``pack_decode(p).to_sparse24()`` equals ``p`` exactly.
    Raises:
        TypeError: float32/float64 values (cast with ``p.to(dtype=torch.float16)``).
        ValueError: an INT8 value of -128 (sign-magnitude bytes hold [-127, 127]).
    Example:
        >>> d = pack_decode(sparse24.compress(torch.randn(40, 100).half()))
        >>> d.values.shape, d.meta.shape
        (torch.Size([2, 2, 8, 32, 8]), torch.Size([8, 32, 16]))
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"pack_decode needs a Sparse24Tensor, got {type(p).__name__}")
    if p.scale is None and p.values.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the decode layout holds float16, bfloat16, INT8 or INT4 values, got {p.values.dtype}; "
                        f"cast first, e.g. p.to(dtype=torch.float16)")
    R, C = p.shape
    if p.group_size is not None:   # the same scale and zero-point tensors as layout v1's (made contiguous
        scale, zero = p.scale.contiguous(), None if p.zero is None else p.zero.contiguous()   # only where not)
    else:
        scale, zero = p.scale, None
    chunks = row_chunks(R, C, p.device, _DEC_ROW_ALIGN)
    values, meta = _pack_rows(p) if len(chunks) <= 1 else _pack_blocks(p, chunks)
    return DecodePacked(values, meta, (R, C), p.dtype, scale, zero=zero, group_size=p.group_size, check=False)


def _pack_blocks(p: Sparse24Tensor, chunks: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_pack_rows` a block of 128-row tiles at a time (``chunks``: row slices starting at multiples of
    128), written into the whole layout: a row tile owns its values and words. Whole, the int64 slots and
    codes peaked at 6.3x the weight's dense bf16 bytes (32x an INT4 layer's stored bytes)."""
    R, C = p.shape
    NT = decode_dims(R, C)[0]
    tdim = 2 if p.scale is None else 1   # values' row-tile dimension
    values = meta = None
    for rows in chunks:
        part = Sparse24Tensor(p.values[rows], p.meta[:, rows], (rows.stop - rows.start, C), p.dtype,
                              None if p.scale is None else p.scale[rows],
                              zero=None if p.zero is None else p.zero[rows], group_size=p.group_size, check=False)
        v, m = _pack_rows(part)
        if meta is None:
            meta = m.new_empty(NT, *m.shape[1:])
            values = v.new_empty(v.shape[:tdim] + (NT,) + v.shape[tdim + 1:])
        t0 = rows.start // _DEC_ROWS
        meta[t0:t0 + m.shape[0]] = m
        values.narrow(tdim, t0, m.shape[0]).copy_(v)
    return values, meta


def _pack_rows(p: Sparse24Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, meta)`` of :func:`pack_decode` for rows of a weight (a whole number of 128-row blocks,
    or the last rows)."""
    R, C = p.shape
    NT, KA, KM = decode_dims(R, C)
    Rp, Gp = NT * _DEC_ROWS, KA * _DEC_COLS // 4
    slots = p.slots()                                                          # (R, C/4, 2)
    bits = torch.tensor(_DEC_CODE_BIT, device=p.device)
    codes = (1 << bits[slots[..., 0]]) | (1 << bits[slots[..., 1]])
    codes = _dec_pad(codes.unsqueeze(-1), Rp, Gp).squeeze(-1)                  # (Rp, Gp)
    codes = codes.view(NT, 2, 8, KA, 4, 4).permute(0, 2, 5, 3, 4, 1)           # (t, i, j, a, q, b)
    shifts = torch.arange(0, 32, 4, device=p.device)
    words = (codes.reshape(NT, 32, KA, 8) << shifts).sum(-1)                   # int64 < 2**32
    words = _dec_pad(words.movedim(-1, 0), KM, words.shape[0]).movedim(0, -1)  # atoms padded to KM
    meta = _int32(words).contiguous()
    if p.scale is not None:  # INT8 / INT4: the mma.sp words after the keep masks
        meta = torch.cat((meta, _sp_words(slots, R, C)), dim=-1).contiguous()
    if p.group_size is not None:
        return _pack_int4(p, NT, KA, Rp, Gp), meta
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
    return values, meta


def _pack_int4(p: Sparse24Tensor, NT: int, KA: int, Rp: int, Gp: int) -> torch.Tensor:
    """The decode-layout values of an INT4 weight (:func:`pack_decode`)."""
    R, C = p.shape
    codes = _dec_pad(torch.stack((p.values & 15, p.values >> 4), dim=-1), Rp, Gp)     # (Rp, Gp, 2) codes u
    nib = codes.view(NT, 2, 8, KA, 2, 2, 4, 2).permute(3, 0, 2, 6, 4, 7, 5, 1)       # (a, t, i, j, h, v, qq, b)
    nib = nib.reshape(KA, NT, 32, 2, 8)                                              # nibble n = 4v + 2qq + b
    return (nib[..., 0::2] | nib[..., 1::2] << 4).reshape(KA, NT, 32, 8).contiguous()

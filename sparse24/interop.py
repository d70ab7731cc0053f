"""Interop with torch's own 2:4 path (``torch.sparse.SparseSemiStructuredTensor``).

Where cuSPARSELt / CUTLASS sparse tensor cores beat our Triton kernel (large
batches on Ampere/Hopper), export the weight; import torch's tensors back to
store, inspect or run them anywhere.

Layouts: torch's CUTLASS layout for float16/bfloat16 keeps the kept values in
exactly our order (two per group of 4, lower slot first) and the same nibble
per group (``slot_lo | slot_hi << 2``), packed 4 groups per int16 and then
permuted ("reordered") for the tensor cores. So :func:`to_cutlass_layout` and
:func:`from_cutlass_layout` are a repack of the metadata bits plus torch's
own permutation, pure torch, any device; they are tested on CPU against
torch's reference conversions in ``torch.sparse._semi_structured_conversions``.

The two formats differ only in a group with fewer than two non-zeros, which
must still name two slots. torch's encoder looks at the non-zero pattern
alone and fills such a group from slots 2 and 3 (``[0, 0, x, 0]`` -> slots
(2, 3), values (x, 0); ``[x, 0, 0, 0]`` -> (0, 2); all zero -> (2, 3)); ours
fills the lowest unused slots (``sparse24.format``). The export therefore
re-picks the slots of every group from its non-zeros, so its bits equal
``sparse_semi_structured_from_dense_cutlass(p.to_dense())`` for every group;
the import reads either encoding and re-picks ours, so both round trips keep
the metadata and the values (up to the sign of a zero: see the import).

torch's float32 CUTLASS layout is 1:2 (one of each pair), which a 2:4 weight
does not satisfy in general, so float32 weights are exported as float16/bfloat16.
"""
from __future__ import annotations

import torch

from .format import Sparse24Tensor, _pack_nibbles, _unpack_nibbles, compress

__all__ = ["to_semi_structured", "from_semi_structured", "to_cutlass_layout", "from_cutlass_layout"]

_HALF = (torch.float16, torch.bfloat16)
BACKENDS = ("cutlass", "cusparselt")


def _meta_offsets(rows: int, meta_cols: int, device) -> torch.Tensor:
    # torch's own implementation of CUTLASS's metadata permutation (int16 meta).
    from torch.sparse._semi_structured_conversions import _calculate_meta_reordering_scatter_offsets
    return _calculate_meta_reordering_scatter_offsets(rows, meta_cols, torch.int16, device)


_ZERO = 2  # source code of a slot that gets a +0.0 (0: the stored lower value, 1: the upper)


def _refill_table(fill_from: tuple[int, ...], keep_zero_bits: bool) -> torch.Tensor:
    """64-entry uint8 table re-picking the two slots of a group from its non-zeros.

    Key: ``nibble | nz_lo << 4 | nz_hi << 5`` (the group's stored slots and
    whether each stored value is non-zero). Entry: ``nibble' | src0 << 4 |
    src1 << 6``: the new slots (the non-zero ones, then the lowest free ones
    of ``fill_from``) and, for each, which stored value moves there (0, 1) or
    ``_ZERO``. With ``keep_zero_bits`` a chosen slot that held a stored zero
    keeps it (its sign bit too), as torch's encoder gathers from the dense
    matrix; otherwise filler slots get +0.0, as ``compress`` writes them.
    Keys whose nibble is not two ordered distinct slots map to themselves, so
    :meth:`Sparse24Tensor.validate` still reports them.
    """
    table = torch.empty(64, dtype=torch.uint8, device="cpu")  # built at import: not on a default device
    for key in range(64):
        lo, hi, nz_lo, nz_hi = key & 3, (key >> 2) & 3, (key >> 4) & 1, key >> 5
        if lo >= hi:
            table[key] = (key & 15) | 1 << 6
            continue
        nonzero = [s for s, nz in ((lo, nz_lo), (hi, nz_hi)) if nz]
        slots = sorted(nonzero + [s for s in fill_from if s not in nonzero][:2 - len(nonzero)])
        src = [(0 if s == lo else 1) if s in nonzero or (keep_zero_bits and s in (lo, hi)) else _ZERO for s in slots]
        table[key] = slots[0] | slots[1] << 2 | src[0] << 4 | src[1] << 6
    return table


# torch's encoder fills short groups from slots 2, 3 (values as in the dense matrix);
# ours from the lowest free slots, with +0.0 fillers (the format's convention).
_TO_TORCH = _refill_table((2, 3), keep_zero_bits=True)
_TO_OURS = _refill_table((0, 1, 2, 3), keep_zero_bits=False)


def _refill(nib: torch.Tensor, vals: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-pick the slots of groups through ``table`` (see :func:`_refill_table`).

    Args: nib ``(N,)`` integer nibbles; vals ``(N, 2)`` stored values.
    Returns: ``(N,)`` int64 new nibbles and ``(N, 2)`` values in ``vals.dtype``.
    """
    nz = (vals != 0).to(torch.int64)  # -0.0 counts as zero, as in torch's ``dense != 0``
    entry = torch.take(table.to(nib.device), nib.to(torch.int64) | nz[:, 0] << 4 | nz[:, 1] << 5).to(torch.int64)
    src = torch.stack([(entry >> 4) & 3, entry >> 6], dim=-1)
    padded = torch.cat([vals, vals.new_zeros(vals.shape[0], 1)], dim=-1)  # index _ZERO = +0.0
    return entry & 15, padded.gather(-1, src)


def _refill_short_groups_(vals: torch.Tensor, words: torch.Tensor, per_word: int, table: torch.Tensor) -> None:
    """Re-pick, in place, the slots of the groups holding fewer than two non-zeros.

    Only those groups can differ between the two encodings, and they are few
    (3.9% of the groups of a 2d_greedy-pruned randn 4096x4096 weight, none of a
    magnitude-pruned one without exact zeros): working on them alone keeps the
    repack cheap (4096x4096 fp16 with 2d_greedy, 1 thread of a loaded 2-core
    AMD EPYC: export 0.088 s, import 0.132 s, vs 0.052 s / 0.110 s for a plain
    repack that left those groups as stored).

    Args:
        vals: ``(R * G, 2)`` values of every group, row-major; updated.
        words: ``(R, G / per_word)`` int64 words holding ``per_word`` nibbles
            (group ``per_word * j + i`` of a row at bits ``4i .. 4i+3`` of word
            ``j``); updated.
    """
    nz = vals != 0
    short = (~(nz[:, 0] & nz[:, 1])).nonzero().squeeze(1)
    if short.numel() == 0:
        return
    flat = words.view(-1)
    word, shift = short // per_word, 4 * (short % per_word)  # G % per_word == 0: words never span two rows
    old = (flat[word] >> shift) & 15
    new, new_vals = _refill(old, vals[short], table)
    vals[short] = new_vals
    # Groups sharing a word change disjoint bits, so their xor-deltas add up.
    flat ^= torch.zeros_like(flat).index_add_(0, word, (old ^ new) << shift)


def _export_dtype(p: Sparse24Tensor, dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or p.dtype
    if dtype not in _HALF:
        raise TypeError(f"torch's 2:4 layout needs float16 or bfloat16 values, got {dtype}"
                        + ("; its float32 layout is 1:2, not 2:4: pass dtype=torch.float16 or torch.bfloat16"
                           if dtype == torch.float32 else ""))
    return dtype


def to_cutlass_layout(p: Sparse24Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack a 2:4 weight into torch's CUTLASS layout (no dense matrix is built).

    Args:
        p: :class:`Sparse24Tensor` ``(R, C)`` with ``R % 32 == 0`` and
            ``C % 64 == 0`` (torch's minimum tile); INT8 weights are exported
            dequantized. Any device.
        dtype: float16 or bfloat16 (default: ``p.dtype``).
    Returns:
        ``(packed, meta)``: ``(R, C/2)`` values in ``dtype`` and ``(R, C/16)``
        int16 reordered metadata, bit for bit what
        ``sparse_semi_structured_from_dense_cutlass(p.to_dense().to(dtype))``
        produces, also for groups with fewer than two non-zeros (their slots
        are re-picked as torch's encoder picks them, see the module docstring).
        New tensors: ``packed`` never shares memory with ``p.values``.
    Example:
        >>> packed, meta = to_cutlass_layout(sparse24.compress(torch.randn(32, 64).half()))
        >>> packed.shape, meta.shape, meta.dtype
        (torch.Size([32, 32]), torch.Size([32, 4]), torch.int16)
    """
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"expected a Sparse24Tensor, got {type(p).__name__}")
    dtype = _export_dtype(p, dtype)
    R, C = p.shape
    if R % 32 or C % 64 or R == 0:
        raise ValueError(f"torch's 2:4 tensors need rows a positive multiple of 32 and columns a multiple of 64 "
                         f"(for {dtype}), got shape {(R, C)}; pad the weight first")
    words = p.meta.t().to(torch.int64)                       # (R, C/32): 8 nibbles each
    halves = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=-1).reshape(R, C // 16)
    # in the logical dtype first, as p.to_dense().to(dtype) rounds (a copy, contiguous: p.values stay as they are)
    vals = p.dequantized_values().to(dtype).clone(memory_format=torch.contiguous_format)
    _refill_short_groups_(vals.view(-1, 2), halves, 4, _TO_TORCH)
    halves = halves - ((halves >> 15) << 16)                 # as signed 16-bit values
    meta = torch.empty(R * (C // 16), dtype=torch.int16, device=p.device)
    meta.scatter_(0, _meta_offsets(R, C // 16, p.device), halves.to(torch.int16).reshape(-1))
    return vals, meta.view(R, C // 16)


def from_cutlass_layout(packed: torch.Tensor, meta: torch.Tensor) -> Sparse24Tensor:
    """Inverse of :func:`to_cutlass_layout`: read torch's CUTLASS layout.

    Any valid encoding of a group with fewer than two non-zeros is accepted
    (torch's, which fills from slots 2 and 3, ours, or another); such groups
    are stored in our convention (the non-zeros, then zeros in the lowest
    unused slots), so the result is bit for bit
    ``compress(dense, mask=dense != 0)`` of the decoded matrix. Round trips:
    ``to_cutlass_layout(from_cutlass_layout(packed, meta))`` gives torch's
    metadata back exactly and its values up to the sign of a filler zero
    (torch copies a -0.0, e.g. from ``w * mask``, into filler slots ours do
    not store; ours are +0.0). ``from_cutlass_layout(*to_cutlass_layout(p))``
    gives ``p``'s bits back whenever ``p`` stores no zero outside that
    convention (true of ``compress(w)`` and ``compress(w, mask)`` when the
    kept entries are non-zero, and no -0.0); its ``to_dense()`` always equals
    ``p``'s (as numbers: a stored -0.0 may come back +0.0).

    Args:
        packed: ``(R, C/2)`` float16/bfloat16 kept values; meta: ``(R, C/16)``
            int16 reordered metadata (torch's CUTLASS layout), ``R % 32 == 0``,
            ``C % 64 == 0``.
    Returns:
        :class:`Sparse24Tensor` ``(R, C)`` whose ``to_dense()`` equals
        ``sparse_semi_structured_to_dense_cutlass(packed, meta)``.
    Raises:
        TypeError / ValueError: not tensors, a float32 (1:2) layout, shapes
        that do not match, or metadata naming one slot twice in a group.
    Example:
        >>> from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass
        >>> dense = sparse24.compress(torch.randn(32, 64).half()).to_dense()
        >>> q = from_cutlass_layout(*sparse_semi_structured_from_dense_cutlass(dense))
        >>> torch.equal(q.to_dense(), dense)
        True
    """
    if not isinstance(packed, torch.Tensor) or not isinstance(meta, torch.Tensor):
        raise TypeError("packed and meta must be tensors")
    if packed.dtype not in _HALF:
        raise TypeError(f"only float16/bfloat16 CUTLASS layouts are supported (float32's is 1:2; int8's, with int32 "
                        f"metadata, is not read), got {packed.dtype}")
    if packed.dim() != 2 or meta.dtype != torch.int16 or tuple(meta.shape) != (packed.shape[0], packed.shape[1] // 8) \
            or packed.shape[1] % 8:
        raise ValueError(f"need packed (R, C/2) and int16 meta (R, C/16), got packed {tuple(packed.shape)} and "
                         f"meta {meta.dtype} {tuple(meta.shape)}")
    R, C = packed.shape[0], 2 * packed.shape[1]
    if R % 32 or C % 64 or R == 0:
        raise ValueError(f"torch's 2:4 tensors have rows a positive multiple of 32 and columns a multiple of 64, "
                         f"got packed {tuple(packed.shape)} (dense {(R, C)})")
    halves = torch.gather(meta.reshape(-1), 0, _meta_offsets(R, C // 16, meta.device)).view(R, C // 16)
    halves = halves.to(torch.int64) & 0xFFFF
    pairs = halves.view(R, -1, 2)                             # C % 64 == 0: whole 32-column words
    words = pairs[..., 0] | (pairs[..., 1] << 16)
    vals = packed.clone(memory_format=torch.contiguous_format)
    _refill_short_groups_(vals.view(-1, 2), words, 8, _TO_OURS)
    words = words - ((words >> 31) << 32)                     # as signed 32-bit values
    return Sparse24Tensor(vals, words.to(torch.int32).t().contiguous(), (R, C))


# --- cuSPARSELt's sm_90 16-bit buffer, as predicted ---------------------------------------------
#
# cuSPARSELt's compressed layout is opaque by contract. torchao's sm_90 sparsify kernel writes it for
# cuSPARSELt's 16-bit products (reverse-engineered there); its index arithmetic gives: the kept values
# (R, C/2) in plain row-major order (two per group, lower slot first: layout v1's values), then R*C/8
# bytes of metadata, one 4-bit field per group (slot_lo | slot_hi << 2: layout v1's nibble) at
# :func:`_sm90_meta_fields`. Export and import use it only on a device where
# :func:`cusparselt_layout_known` found torch._cslt_compress writing exactly that (checked once per
# device); scripts/gpu_sparse_mm.py --layout reports the layout and the product on it.


def _sm90_meta_fields(R: int, C: int, device=None) -> torch.Tensor:
    """(R, C/4) int64: the 4-bit field (byte * 2, +1 for the high nibble) holding group G of row n.
    Row n = 64 band + 16 rb + rr, group G = 8 chunk + g: byte 8C band + 256 chunk + 64 rb + 8 (rr % 8)
    + 4 ((g // 2) % 2) + 2 (g % 2) + g // 4, high nibble for rr >= 8 (rows r, r + 8 share a byte).
    R % 64 == 0, C % 32 == 0."""
    n = torch.arange(R, device=device)[:, None]
    G = torch.arange(C // 4, device=device)[None, :]
    rr, g = n % 16, G % 8
    byte = (n // 64) * 8 * C + (G // 8) * 256 + (n % 64) // 16 * 64 + 8 * (rr % 8) + 4 * ((g // 2) % 2) \
        + 2 * (g % 2) + g // 4
    return 2 * byte + (rr >= 8).long()


def _sm90_shape(R: int, C: int) -> bool:
    """Whether :func:`_cusparselt_sm90_buffer` builds an ``(R, C)`` weight (positive multiples of 64)."""
    return R > 0 and C > 0 and R % 64 == 0 and C % 64 == 0


def _check_sm90_shape(R: int, C: int) -> None:
    if not _sm90_shape(R, C):
        raise ValueError(f"cuSPARSELt's sm_90 layout is built here for rows and columns positive multiples of 64, "
                         f"got {(R, C)}; pad the weight first")


def _cusparselt_sm90_buffer(p: Sparse24Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The 1-D buffer ``torch._cslt_compress(p.to_dense())`` is predicted to return on sm_90
    (float16/bfloat16, ``R*C*9/16`` elements), built without a dense copy, on p's device.
    Unconfirmed (see above)."""
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"expected a Sparse24Tensor, got {type(p).__name__}")
    dtype = _export_dtype(p, dtype)
    R, C = p.shape
    _check_sm90_shape(R, C)
    nib = ((p.meta.t().to(torch.int64).unsqueeze(-1) >> torch.arange(0, 32, 4, device=p.device)) & 15)
    fields = torch.empty(R * C // 4, dtype=torch.uint8, device=p.device)
    fields.scatter_(0, _sm90_meta_fields(R, C, p.device).reshape(-1), nib.reshape(-1).to(torch.uint8))
    return torch.cat([p.dequantized_values().to(dtype).reshape(-1), _pack_nibbles(fields.view(1, -1)).view(-1).view(dtype)])


def _from_cusparselt_sm90_buffer(buf: torch.Tensor, shape: tuple[int, int]) -> Sparse24Tensor:
    """Inverse of :func:`_cusparselt_sm90_buffer`: the layout-v1 weight of logical ``shape``; groups
    with fewer than two non-zeros stored as ``compress(dense, mask=dense != 0)`` stores them (as
    :func:`from_cutlass_layout` does)."""
    R, C = shape
    _check_sm90_shape(R, C)
    if buf.dim() != 1 or buf.dtype not in _HALF or buf.numel() != R * C * 9 // 16:
        raise ValueError(f"expected a 1-D float16/bfloat16 buffer of {R * C * 9 // 16} elements for {(R, C)}, got "
                         f"{buf.dtype} {tuple(buf.shape)}")
    vals = buf[:R * C // 2].view(R, C // 2).clone()
    fields = _unpack_nibbles(buf[R * C // 2:].contiguous().view(torch.uint8).view(1, -1)).view(-1).to(torch.int64)
    nib = fields[_sm90_meta_fields(R, C, buf.device).reshape(-1)].view(R, C // 32, 8)
    words = (nib << torch.arange(0, 32, 4, device=buf.device)).sum(-1)
    _refill_short_groups_(vals.view(-1, 2), words, 8, _TO_OURS)   # groups of < 2 non-zeros: our slots
    words = words - ((words >> 31) << 32)                     # as signed 32-bit values
    return Sparse24Tensor(vals, words.to(torch.int32).t().contiguous(), (R, C))


_LAYOUT_KNOWN: dict = {}


def cusparselt_layout_known(device, cslt_compress=None) -> bool:
    """Whether cuSPARSELt on ``device`` stores a 16-bit 2:4 weight exactly as
    :func:`_cusparselt_sm90_buffer` predicts, so that export and import need no dense copy: a
    128 x 128 probe per 16-bit dtype, compressed by ``cslt_compress`` (default
    ``torch._cslt_compress``) and compared byte for byte, once per device and compressor. False off
    CUDA devices of compute capability 9.x (with the default) and wherever the probe raises."""
    device = torch.device(device)
    if cslt_compress is None:
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
            return False
        cslt_compress = torch._cslt_compress
    key = (device, cslt_compress)
    if key not in _LAYOUT_KNOWN:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            ok = True
            for dtype in _HALF:   # random values: every group keeps two non-zeros, one encoding only
                probe = compress(torch.randn(128, 128, generator=gen, device=device).to(dtype))
                ok &= torch.equal(cslt_compress(probe.to_dense()).view(torch.int16),
                                  _cusparselt_sm90_buffer(probe).view(torch.int16))
        except Exception:  # noqa: BLE001 (a library or GPU that refuses the probe: keep the dense copy)
            ok = False
        _LAYOUT_KNOWN[key] = ok
    return _LAYOUT_KNOWN[key]


def to_semi_structured(p: Sparse24Tensor, backend: str | None = None, dtype: torch.dtype | None = None):
    """Export a 2:4 weight as a ``torch.sparse.SparseSemiStructuredTensor`` (CUDA).

    Use it where torch's sparse tensor-core matmuls are faster than our
    kernel, e.g. ``F.linear(x, to_semi_structured(p))`` at large batch.

    Args:
        p: :class:`Sparse24Tensor` ``(N, K)`` on a CUDA device, ``N % 32 == 0``,
            ``K % 64 == 0`` (INT8 weights are exported dequantized).
        backend: ``"cutlass"`` (repacked directly, no dense copy; torch's
            CUTLASS 2:4 kernels run on compute capability 8.x only) or
            ``"cusparselt"`` (its layout is opaque: compressed by
            ``torch._cslt_compress`` from a transient dense copy, except on a
            device where :func:`cusparselt_layout_known`, for shapes in
            multiples of 64: built from ours directly); default:
            CUTLASS on 8.x GPUs, cuSPARSELt on the others (Hopper).
        dtype: float16 or bfloat16 (default: ``p.dtype``).
    Returns:
        A ``SparseSemiStructuredTensorCUTLASS`` / ``...CUSPARSELT`` whose
        ``to_dense()`` equals ``p.to_dense()`` (in ``dtype``).
    Raises:
        ValueError: p on CPU (torch's 2:4 tensors are CUDA-only; the layout
        functions above work anywhere), bad shape or backend, CUTLASS on a
        GPU that is not 8.x.
        TypeError: not a Sparse24Tensor, or a dtype torch cannot store 2:4.
    Example:
        Not run as a test: needs a CUDA GPU.

        >>> t = to_semi_structured(sparse24.compress(torch.randn(64, 128, device="cuda").half()))  # doctest: +SKIP
        >>> y = torch.nn.functional.linear(torch.randn(8, 128, device="cuda").half(), t)  # doctest: +SKIP
    """
    from torch.sparse import (SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT,
                              SparseSemiStructuredTensorCUTLASS)

    if backend not in BACKENDS + (None,):
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if not isinstance(p, Sparse24Tensor):
        raise TypeError(f"expected a Sparse24Tensor, got {type(p).__name__}")
    if p.device.type != "cuda":
        raise ValueError(f"torch's SparseSemiStructuredTensor is CUDA-only, but the weight is on {p.device}; move it "
                         f"with p.to('cuda') (to_cutlass_layout converts the layout on any device)")
    backend = backend_for(torch.cuda.get_device_capability(p.device), backend)
    if backend == "cutlass":
        packed, meta = to_cutlass_layout(p, dtype)
        return SparseSemiStructuredTensorCUTLASS(p.shape, packed=packed, meta=meta, packed_t=None, meta_t=None,
                                                 compressed_swizzled_bitmask=None)
    dtype = _export_dtype(p, dtype)
    if _sm90_shape(*p.shape) and cusparselt_layout_known(p.device):
        # this device's cuSPARSELt stores what _cusparselt_sm90_buffer builds: no dense copy, no compress
        return SparseSemiStructuredTensorCUSPARSELT(
            p.shape, packed=_cusparselt_sm90_buffer(p, dtype), meta=None, packed_t=None, meta_t=None,
            compressed_swizzled_bitmask=None, fuse_transpose_cusparselt=SparseSemiStructuredTensor._FUSE_TRANSPOSE,
            alg_id_cusparselt=SparseSemiStructuredTensor._DEFAULT_ALG_ID, requires_grad=False)
    return SparseSemiStructuredTensorCUSPARSELT.from_dense(p.to_dense().to(dtype))


def backend_for(capability: tuple[int, int], backend: str | None = None) -> str:
    """The torch 2:4 backend for a GPU of compute ``capability``: ``backend`` checked, or
    the default (CUTLASS on 8.x, cuSPARSELt elsewhere). torch's CUTLASS 2:4 matmul runs on
    8.x alone: on an H200 (9.0, torch 2.11) it raised "Supported only on GPUs with compute
    capability 8.x" at the first product, so it is refused here, at conversion."""
    if backend is None:
        return "cutlass" if capability[0] == 8 else "cusparselt"
    if backend == "cutlass" and capability[0] != 8:
        raise ValueError(f"torch's CUTLASS 2:4 kernels run on compute capability 8.x only, this GPU is "
                         f"{capability[0]}.{capability[1]}: use backend='cusparselt' (the default there)")
    return backend


def from_semi_structured(t) -> Sparse24Tensor:
    """Import a ``torch.sparse.SparseSemiStructuredTensor`` as a :class:`Sparse24Tensor`.

    CUTLASS tensors are repacked directly (any device); cuSPARSELt tensors
    (opaque layout) go through ``t.to_dense()`` on their CUDA device, except
    where :func:`cusparselt_layout_known` (shapes in multiples of 64): read
    directly.

    Args:
        t: a 2-D float16/bfloat16 ``SparseSemiStructuredTensor`` ``(N, K)``.
    Returns:
        :class:`Sparse24Tensor` on t's device with ``to_dense() == t.to_dense()``.
    """
    from torch.sparse import (SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT,
                              SparseSemiStructuredTensorCUTLASS)

    if not isinstance(t, SparseSemiStructuredTensor):
        raise TypeError(f"expected a torch.sparse.SparseSemiStructuredTensor, got {type(t).__name__}")
    if isinstance(t, SparseSemiStructuredTensorCUTLASS) and t.packed is not None and t.meta is not None \
            and t.meta.dim() == 2:
        return from_cutlass_layout(t.packed, t.meta)
    if isinstance(t, SparseSemiStructuredTensorCUTLASS) and t.packed is None:
        # (torch's own to_dense() then fails on an assertion)
        raise ValueError("this SparseSemiStructuredTensor holds no packed data (a transposed view built without "
                         "packed_t?): import the untransposed tensor")
    if t.dtype not in _HALF:
        raise TypeError(f"only float16/bfloat16 semi-structured tensors are 2:4, got {t.dtype}")
    packed = getattr(t, "packed", None)
    if isinstance(t, SparseSemiStructuredTensorCUSPARSELT) and packed is not None and packed.dim() == 1 \
            and _sm90_shape(*t.shape) and cusparselt_layout_known(packed.device):
        return _from_cusparselt_sm90_buffer(packed, tuple(t.shape))   # this device's layout is known
    dense = t.to_dense()
    return compress(dense, mask=dense != 0)

"""SparseGPT (Frantar & Alistarh 2023): N:M masks with the kept weights
reconstructed to compensate the pruned ones, from the layer's input Hessian;
optionally joint with GPTQ-style INT4 quantization of the kept weights in the
same sweep (the SparseGPT paper's joint sparsification + quantization)."""
from __future__ import annotations

import torch

from .._checks import check_mask, check_nm, check_weight
from ..format import Sparse24Tensor, _pack_nibbles, check_group_size, compress, int4_quantize
from .reconstruct import PERCDAMP, _refit, damped_hessian, to_weight_dtype

__all__ = ["sparsegpt_prune"]


def sparsegpt_prune(w: torch.Tensor, hessian: torch.Tensor | None = None, n: int = 2, m: int = 4,
                    blocksize: int | None = None, percdamp: float = PERCDAMP,
                    refit: bool = False, shrink: float = 0.0, quantize: str | None = None,
                    group_size: int | None = None, symmetric: bool | None = None, mask: torch.Tensor | None = None):
    """One-shot N:M pruning with OBS weight reconstruction (SparseGPT, Frantar & Alistarh 2023),
    optionally joint with GPTQ INT4 quantization of the kept weights.

    Minimizes ``||X W^T - X W'^T||`` over N:M ``W'`` approximately: columns are
    processed left to right in blocks; at the start of each group of ``m``
    columns the ``n`` kept entries per row are the largest
    ``w^2 / [H^-1]_jj^2`` (``[H^-1]`` the upper Cholesky factor of the inverse
    Hessian restricted to the columns not yet processed; ties go to the lower
    column, as in :func:`sparse24.format.mask_nm`), and the error of
    each pruned column is compensated on the later columns.

    ``quantize="int4"`` (2:4 only) also rounds every kept weight onto the INT4
    grid of :mod:`sparse24.format` in the same sweep and compensates that error
    too (the SparseGPT paper's joint sparsification + quantization, GPTQ's
    update). When the sweep enters a quantization group (``group_size``
    columns) it fixes the group's grid (scale, and zero point when asymmetric,
    the rule of :func:`sparse24.format.quantize_values`) from the current,
    already updated weights at the positions the OBS saliency would keep now;
    the masks are still chosen every ``m`` columns from the weights updated by
    then (choosing them all at the group's entry measured worse: a 128-column
    group lost more to the stale masks than it gained from an exact grid), and
    each kept column is rounded to nearest on its group's grid.

    Args:
        w: ``(R, C)`` float weight (not modified), ``C % m == 0``.
        hessian: ``(C, C)`` ``X^T X`` of the layer's inputs (any positive
            scale), e.g. ``calibrate(model, batches, hessian=True)[name].hessian``.
        n, m: keep ``n`` of every ``m``.
        blocksize: columns per lazy-update block (a multiple of ``m``; with
            ``quantize``, also a multiple or a divisor of ``group_size``). Default
            None: the largest multiple of ``m`` up to 128 (``m`` itself if larger),
            so any ``m`` works: 128 for 2:4, 126 for 2:6. The result depends on it
            only through rounding (the lazy updates are exact), the speed more.
        percdamp: damping added to the diagonal, as a fraction of its mean.
        refit: then replace the kept weights by the exact least-squares
            solution for the chosen mask (:func:`reconstruct_weight`): the
            sweep's updates only look rightwards, so they are not the best
            weights for the final mask; costs one ``C/2``-sized Cholesky
            solve per row. Not with ``quantize`` (the refit weights would be off the grid).
        shrink: in [0, 1]: prune with ``(1 - shrink) H + shrink diag(H)``,
            the measured correlations between inputs partly trusted (see
            :func:`sparse24.masks.reconstruct.damped_hessian`; 0: SparseGPT).
        quantize: ``None`` or ``"int4"``.
        group_size: INT4 group along C: 32, 64 or 128 (default 128).
        symmetric: INT4: False adds per-group zero points (default True).
        mask: optional ``(R, C)`` bool mask keeping at most ``n`` of every ``m``
            to use instead of choosing one (the sweep then only compensates, and
            quantizes: GPTQ on a fixed 2:4 mask, e.g. after frozen-mask training).
    Returns:
        ``quantize=None``: ``(new_w, mask)``: ``(R, C)`` reconstructed weight in
        ``w``'s dtype, zero where ``mask`` is False, and the ``(R, C)`` bool N:M mask.
        ``quantize="int4"``: an INT4 :class:`~sparse24.format.Sparse24Tensor`
        (logical dtype ``w``'s: codes ``(R, C/4)`` uint8, float16 scales and
        (asymmetric) uint8 zero points ``(R, ceil(C / group_size))``, the
        mask's slots); ``to_dense()`` is the quantized 2:4 weight.
    Raises:
        ValueError: among others, a reconstructed weight past ``w``'s dtype's range (the
            compensation can push a float16 weight past 65504: inf is not stored silently).
    Example:
        >>> x = torch.randn(256, 16); w = torch.randn(8, 16)
        >>> new_w, mask = sparsegpt_prune(w, x.T @ x)
        >>> bool((new_w[~mask] == 0).all())
        True
        >>> x = torch.randn(512, 256); p = sparsegpt_prune(torch.randn(8, 256), x.T @ x, quantize="int4")
        >>> p.quantized, tuple(p.scale.shape)
        ('int4', (8, 2))
    """
    check_nm(n, m)
    check_weight(w, m)
    R, C = w.shape
    if hessian is None:
        raise ValueError("method='sparsegpt' needs hessian=: the (in_features, in_features) matrix X^T X of the "
                         "layer's inputs, e.g. sparse24.calibrate(model, batches, hessian=True)[name].hessian")
    if blocksize is None:
        blocksize = m * max(1, 128 // m)
    if not isinstance(blocksize, int) or blocksize < m or blocksize % m:
        raise ValueError(f"blocksize must be a positive multiple of m={m}, got {blocksize!r}")
    if not isinstance(refit, bool):
        raise TypeError(f"refit must be True or False, got {refit!r}")
    gs = _check_quantize(quantize, group_size, symmetric, n, m, blocksize, refit)
    if mask is not None:
        check_mask(mask, w)
        if bool((mask.reshape(R, C // m, m).sum(-1) > n).any()):
            raise ValueError(f"mask keeps more than {n} of some group of {m} columns: it is not {n}:{m}")
    symmetric = symmetric is not False
    if not bool(torch.isfinite(w).all()):  # NaN/inf would spread through the updates into every weight
        raise ValueError("weight contains NaN or inf: SparseGPT cannot reconstruct it")

    dev, wdt = w.device, (torch.float64 if w.dtype == torch.float64 else torch.float32)
    H, dead = damped_hessian(hessian, C, percdamp, dev, shrink)
    # row-major whatever w's layout: the lazy-update products below round by the layout they run in,
    # so a column-major (transposed-view) copy of the same values gave other bits
    W = w.detach().to(wdt).clone(memory_format=torch.contiguous_format)
    W[:, dead] = 0
    # Upper Cholesky factor U of H^-1 (H^-1 = U^T U), in fp64, without forming H^-1:
    # with J the reversal, J H J = L L^T gives U = J L^-1 J. One factorization and
    # one triangular solve, where cholesky_inverse + cholesky cost 3x as long (1.15 s
    # for cholesky_inverse alone at K=1024, 2-core CPU).
    # Each C x C temporary is freed as soon as the next exists (peak: the caller's Hessian + 3
    # fp64 copies, was + 5.2; a 70B model's down_proj Hessian is 0.9 GiB): the damped H is kept
    # only for refit, the solve writes over its identity right-hand side.
    L = H.flip(0, 1)
    if not refit:
        del H
    L, info = torch.linalg.cholesky_ex(L)
    if int(info):
        raise ValueError("hessian is not positive semi-definite (Cholesky failed even after damping): pass "
                         "X^T X of the layer's inputs, e.g. calibrate(..., hessian=True)[name].hessian")
    Hinv = torch.eye(C, dtype=L.dtype, device=dev)
    torch.linalg.solve_triangular(L, Hinv, upper=False, out=Hinv)
    del L
    Hinv = Hinv.to(wdt).flip(0, 1)
    diag = torch.diag(Hinv)
    fixed = mask is not None
    prune = ~mask.to(dev) if fixed else torch.zeros(R, C, dtype=torch.bool, device=dev)
    if gs:
        grid = _Grid(R, C, gs, symmetric, dev, w.dtype)
    for i1 in range(0, C, blocksize):
        i2 = min(i1 + blocksize, C)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        d = diag[i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if gs and c % gs == 0:  # entering a quantization group: fix its grid
                g1 = min(c + gs, C)
                # a group reaching past this block starts at the block's start, where W is up to date
                cur = W1[:, i:i + g1 - c] if g1 <= i2 else W[:, c:g1]
                # from the weights the masks would keep now; the masks themselves are chosen below,
                # every m columns as without quantization, from the weights updated by then
                kept = ~prune[:, c:g1] if fixed else ~_drop(cur, diag[c:g1], n, m)
                grid.fix(c // gs, cur, kept)
            if not fixed and i % m == 0 and n < m:  # choose this group's mask from the updated weights
                prune[:, c:c + m] = _drop(W1[:, i:i + m], d[i:i + m], n, m)
            q = grid.round(c, W1[:, i], prune[:, c]) if gs else W1[:, i].masked_fill(prune[:, c], 0)
            err = (W1[:, i] - q) / d[i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)  # column i itself becomes q (pruned -> 0)
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    mask = ~prune
    if gs:
        return grid.tensor(mask, w.dtype)
    if refit:  # the same damped Hessian, already checked and built
        return _refit(w, mask, H, dead), mask
    W[prune] = 0  # exact zeros (the update leaves rounding residue there)
    return to_weight_dtype(W, w.dtype, "SparseGPT's reconstructed weight"), mask


def _drop(cur: torch.Tensor, d: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``(R, k)`` current weights of ``k / m`` consecutive groups and their ``(k,)`` inverse-Hessian
    Cholesky diagonal -> ``(R, k)`` bool, True at the ``m - n`` lowest OBS saliencies ``w^2 / d^2`` per group;
    among equal saliencies the lower column keeps (format.mask_nm's rule: a stable descending sort,
    where topk's order among ties is unspecified and differs by backend)."""
    R, k = cur.shape
    score = (cur ** 2 / d ** 2).view(R, k // m, m)
    drop = torch.sort(score, dim=2, descending=True, stable=True).indices[:, :, n:]
    return torch.zeros(R, k // m, m, dtype=torch.bool, device=cur.device).scatter_(2, drop, True).view(R, k)


class _Grid:
    """The INT4 grid the joint sweep builds group by group: codes of every column, scales, zero points."""

    def __init__(self, R: int, C: int, group_size: int, symmetric: bool, device, dtype: torch.dtype = torch.float32):
        groups = -(-C // group_size)
        # (the weight's dtype: bfloat16 weights get scales bfloat16 holds, float16 weights grids inside
        # float16's range, as quantize_values makes them)
        self.gs, self.shape, self.dtype = group_size, (R, C), dtype
        self.codes = torch.zeros(R, C, dtype=torch.uint8, device=device)
        self.scale = torch.empty(R, groups, dtype=torch.float16, device=device)
        self.zero = None if symmetric else torch.empty(R, groups, dtype=torch.uint8, device=device)

    def fix(self, k: int, cur: torch.Tensor, kept: torch.Tensor) -> None:
        """Fix group ``k``'s grid from its ``(R, width)`` current weights at the ``kept`` (bool, same
        shape) positions (quantize_values' rule; zeros stand in for the missing ones of a group
        keeping fewer than 2 of 4, as the format stores them)."""
        R = cur.shape[0]
        v = torch.where(kept, cur, 0).view(R, kept.shape[1] // 4, 4).gather(2, _slots(kept)).flatten(1)
        _, self.scale[:, k:k + 1], zero = int4_quantize(v, self.gs, self.zero is None,
                                                        bf16_scales=self.dtype == torch.bfloat16,
                                                        fp16_weights=self.dtype == torch.float16)
        if zero is not None:
            self.zero[:, k:k + 1] = zero

    def round(self, c: int, col: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
        """Round column ``c``'s ``(R,)`` weights to nearest on its group's grid, the ``pruned`` rows
        to 0 (their code the zero point); record the codes; return the grid values (``col``'s dtype)."""
        k = c // self.gs
        zero = None if self.zero is None else self.zero[:, k:k + 1]
        codes, scale, _ = int4_quantize(col[:, None], self.gs, zero is None, self.scale[:, k:k + 1], zero)
        z = torch.full_like(codes[:, 0], 8) if zero is None else zero[:, 0]
        self.codes[:, c] = codes = torch.where(pruned, z, codes[:, 0])
        return (codes.to(col.dtype) - z.to(col.dtype)) * scale[:, 0].to(col.dtype)

    def tensor(self, mask: torch.Tensor, dtype: torch.dtype) -> Sparse24Tensor:
        """The INT4 :class:`Sparse24Tensor` of the kept codes under the 2:4 ``mask``."""
        R, C = self.shape
        meta = compress(mask.to(torch.float16), mask).meta  # the slots of the mask (the values are not used)
        values = _pack_nibbles(self.codes.view(R, C // 4, 4).gather(2, _slots(mask)).view(R, C // 2))
        return Sparse24Tensor(values, meta, (R, C), dtype, self.scale, zero=self.zero, group_size=self.gs)


def _slots(kept: torch.Tensor) -> torch.Tensor:
    """``(R, k)`` bool, at most 2 of every 4 -> ``(R, k / 4, 2)`` the slots the format stores: the
    kept ones, a group keeping fewer filled with its lowest free slots (a stable sort of ~kept), in
    increasing order as the metadata holds them (a group keeping slot 2 alone is (0, 2), not (2, 0):
    its kept code went to slot 0, a pruned position)."""
    R = kept.shape[0]
    # explicit widths: -1 cannot be inferred for a weight of 0 rows
    return torch.sort((~kept).view(R, kept.shape[1] // 4, 4).to(torch.uint8), dim=2,
                      stable=True).indices[:, :, :2].sort(dim=2).values


def _check_quantize(quantize, group_size, symmetric, n: int, m: int, blocksize: int, refit: bool) -> int:
    """Check the joint quantization options; return the INT4 group size, or 0 without quantization."""
    if quantize is None:
        if group_size is not None or symmetric is not None:
            raise TypeError("group_size= and symmetric= only apply with quantize='int4'")
        return 0
    if quantize != "int4":
        raise ValueError(f"SparseGPT quantizes jointly to 'int4' only (quantize=None: no quantization), "
                         f"got quantize={quantize!r}")
    if (n, m) != (2, 4):
        raise ValueError(f"quantize='int4' stores 2:4 weights: n, m must be 2, 4, got {n}, {m}")
    if refit:
        raise ValueError("refit=True re-solves the kept weights off the INT4 grid: not with quantize='int4'")
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be True or False, got {symmetric!r}")
    gs = check_group_size(128 if group_size is None else group_size)
    if blocksize % gs and gs % blocksize:
        raise ValueError(f"with quantize='int4', blocksize ({blocksize}) must be a multiple or a divisor of "
                         f"group_size ({gs})")
    return gs

"""SparseGPT (Frantar & Alistarh 2023): N:M masks with the kept weights
reconstructed to compensate the pruned ones, from the layer's input Hessian."""
from __future__ import annotations

import torch

from .._checks import check_nm, check_weight
from .reconstruct import PERCDAMP, _refit, damped_hessian

__all__ = ["sparsegpt_prune"]


def sparsegpt_prune(w: torch.Tensor, hessian: torch.Tensor | None = None, n: int = 2, m: int = 4,
                    blocksize: int = 128, percdamp: float = PERCDAMP,
                    refit: bool = False, shrink: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot N:M pruning with OBS weight reconstruction (SparseGPT, Frantar & Alistarh 2023).

    Minimizes ``||X W^T - X W'^T||`` over N:M ``W'`` approximately: columns are
    processed left to right in blocks; at the start of each group of ``m``
    columns the ``n`` kept entries per row are the largest
    ``w^2 / [H^-1]_jj^2`` (``[H^-1]`` the upper Cholesky factor of the inverse
    Hessian restricted to the columns not yet processed), and the error of
    each pruned column is compensated on the later columns.

    Args:
        w: ``(R, C)`` float weight (not modified), ``C % m == 0``.
        hessian: ``(C, C)`` ``X^T X`` of the layer's inputs (any positive
            scale), e.g. ``calibrate(model, batches, hessian=True)[name].hessian``.
        n, m: keep ``n`` of every ``m``.
        blocksize: columns per lazy-update block (a multiple of ``m``).
        percdamp: damping added to the diagonal, as a fraction of its mean.
        refit: then replace the kept weights by the exact least-squares
            solution for the chosen mask (:func:`reconstruct_weight`): the
            sweep's updates only look rightwards, so they are not the best
            weights for the final mask; costs one ``C/2``-sized Cholesky
            solve per row.
        shrink: in [0, 1]: prune with ``(1 - shrink) H + shrink diag(H)``,
            the measured correlations between inputs partly trusted (see
            :func:`sparse24.masks.reconstruct.damped_hessian`; 0: SparseGPT).
    Returns:
        ``(new_w, mask)``: ``(R, C)`` reconstructed weight in ``w``'s dtype,
        zero where ``mask`` is False, and the ``(R, C)`` bool N:M mask.
    Example:
        >>> x = torch.randn(256, 16); w = torch.randn(8, 16)
        >>> new_w, mask = sparsegpt_prune(w, x.T @ x)
        >>> bool((new_w[~mask] == 0).all())
        True
    """
    check_nm(n, m)
    check_weight(w, m)
    R, C = w.shape
    if hessian is None:
        raise ValueError("method='sparsegpt' needs hessian=: the (in_features, in_features) matrix X^T X of the "
                         "layer's inputs, e.g. sparse24.calibrate(model, batches, hessian=True)[name].hessian")
    if not isinstance(blocksize, int) or blocksize < m or blocksize % m:
        raise ValueError(f"blocksize must be a positive multiple of m={m}, got {blocksize!r}")
    if not isinstance(refit, bool):
        raise TypeError(f"refit must be True or False, got {refit!r}")
    if not bool(torch.isfinite(w).all()):  # NaN/inf would spread through the updates into every weight
        raise ValueError("weight contains NaN or inf: SparseGPT cannot reconstruct it")

    dev, wdt = w.device, (torch.float64 if w.dtype == torch.float64 else torch.float32)
    H, dead = damped_hessian(hessian, C, percdamp, dev, shrink)
    W = w.detach().to(wdt).clone()
    W[:, dead] = 0
    # Upper Cholesky factor U of H^-1 (H^-1 = U^T U), in fp64, without forming H^-1:
    # with J the reversal, J H J = L L^T gives U = J L^-1 J. One factorization and
    # one triangular solve, where cholesky_inverse + cholesky cost 3x as long (1.15 s
    # for cholesky_inverse alone at K=1024, 2-core CPU).
    L, info = torch.linalg.cholesky_ex(H.flip(0, 1))
    if int(info):
        raise ValueError("hessian is not positive semi-definite (Cholesky failed even after damping): pass "
                         "X^T X of the layer's inputs, e.g. calibrate(..., hessian=True)[name].hessian")
    eye = torch.eye(C, dtype=H.dtype, device=dev)
    Hinv = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1).to(wdt)
    prune = torch.zeros(R, C, dtype=torch.bool, device=dev)
    for i1 in range(0, C, blocksize):
        i2 = min(i1 + blocksize, C)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        d = torch.diag(Hinv1)
        for i in range(i2 - i1):
            if i % m == 0 and n < m:  # choose this group's mask from the updated weights
                score = W1[:, i:i + m] ** 2 / d[i:i + m] ** 2
                drop = torch.topk(score, m - n, dim=1, largest=False).indices
                prune[:, i1 + i:i1 + i + m].scatter_(1, drop, True)
            err = W1[:, i].masked_fill(~prune[:, i1 + i], 0) / d[i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)  # column i itself becomes q (pruned -> 0)
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    mask = ~prune
    if refit:  # the same damped Hessian, already checked and built
        return _refit(w, mask, H, dead), mask
    W[prune] = 0  # exact zeros (the update leaves rounding residue there)
    return W.to(w.dtype), mask

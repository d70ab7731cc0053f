"""Exact least-squares reconstruction of the kept weights for a fixed mask.

SparseGPT chooses the mask and updates the weights in one left-to-right sweep:
each column's update only sees the columns to its right, so its final weights
are not the best ones for its final mask. For a fixed mask the best weights
have a closed form, row by row: with ``S`` the kept columns of a row and
``H = X^T X`` the layer's input Hessian,

    argmin_{w: w_j = 0 off S} ||X w - X w0||^2   ->   w_S = H_SS^-1 (H w0)_S

(a ``|S| x |S|`` Cholesky solve per row). On all-MiniLM-L6-v2 with every Linear
2:4 this alone moves SparseGPT's mean embedding cosine from 0.887 to 0.920 with
the same masks (``scripts/eval_minilm.py``).
"""
from __future__ import annotations

import math

import torch

from .._checks import check_mask

# SparseGPT's damping, as a fraction of the Hessian's mean diagonal: the default of every fit here
PERCDAMP = 0.01
# The damping of the recommended one shot (prune_layerwise_ fit to a teacher; the CLI's layerwise): on
# all-MiniLM-L6-v2 calibrated on 512 code lines it lifted held-out code 0.949 -> 0.952 and the training
# files' docstrings 0.895 -> 0.905; in domain (1024 docstrings) 0.941 -> 0.942 (docs/recipes.md)
LAYERWISE_PERCDAMP = 0.1

__all__ = ["reconstruct_weight", "LAYERWISE_PERCDAMP"]


def reconstruct_weight(w: torch.Tensor, mask: torch.Tensor, hessian: torch.Tensor, percdamp: float = PERCDAMP,
                       rows_per_chunk: int = 64, shrink: float = 0.0) -> torch.Tensor:
    """The weights that best reproduce ``w``'s outputs on the calibration inputs with ``mask`` fixed.

    Solves, for every row ``r`` independently (fp64), ``min ||X (v - w_r)||^2``
    over ``v`` with ``v_j = 0`` where ``mask[r, j]`` is False, with ``X^T X``
    = ``hessian`` plus ``percdamp`` x its mean diagonal on the diagonal (as
    SparseGPT damps it, so both solve the same regularised problem), after
    shrinking its off-diagonal part by ``shrink`` (see :func:`damped_hessian`).

    Args:
        w: ``(R, C)`` float weight to reproduce (the dense weight; not modified).
        mask: ``(R, C)`` bool mask (any pattern; rows may keep different counts).
        hessian: ``(C, C)`` ``X^T X`` of the layer's inputs (any positive scale),
            e.g. ``calibrate(model, batches, hessian=True)[name].hessian``.
        percdamp: diagonal damping as a fraction of the mean diagonal (> 0).
        rows_per_chunk: rows solved together (memory ``rows x kept^2`` fp64).
        shrink: in [0, 1]: the Hessian is ``(1 - shrink) H + shrink diag(H)``
            (0: as measured; see :func:`damped_hessian`).
    Returns:
        ``(R, C)`` tensor in ``w``'s dtype, exactly zero where ``mask`` is False.
    Raises:
        ValueError: among others, a solution past ``w``'s dtype's range (float16's 65504).
    Example:
        >>> x = torch.randn(256, 16, dtype=torch.float64); w = torch.randn(8, 16, dtype=torch.float64)
        >>> mask = sparse24.mask_nm(w)
        >>> v = reconstruct_weight(w, mask, x.T @ x, percdamp=1e-9)
        >>> bool(((x @ v.T - x @ w.T).norm() <= (x @ (w * mask).T - x @ w.T).norm()))
        True
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError("w must be a 2-D floating-point tensor (out_features, in_features)")
    check_mask(mask, w)
    if isinstance(rows_per_chunk, bool) or not isinstance(rows_per_chunk, int) or rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be an int >= 1, got {rows_per_chunk!r}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight contains NaN or inf: nothing to reconstruct")
    H, dead = damped_hessian(hessian, w.shape[1], percdamp, w.device, shrink)
    return _refit(w, mask, H, dead, rows_per_chunk)


def damped_hessian(hessian: torch.Tensor, C: int, percdamp: float, device,
                   shrink: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a layer's ``(C, C)`` Hessian and return ``(H, dead)``: an fp64 copy on ``device``, its
    off-diagonal part scaled by ``1 - shrink`` (``(1 - shrink) H + shrink diag(H)``), the
    never-firing inputs (``dead``, ``(C,)`` bool: zero diagonal) given the live inputs' mean
    diagonal, and ``percdamp`` x the mean diagonal added (SparseGPT's damping, shared with
    :func:`sparsegpt_prune`; SparseGPT's code gives dead inputs a unit diagonal before averaging, which
    makes the damping depend on the activations' scale).

    Shrinking trusts each input's measured variance but only part of the measured correlations
    between inputs, which a few hundred samples of one domain tie to that domain: the fits then
    lean less on directions the calibration text happened to leave out (``shrink=1`` keeps no
    correlation: SparseGPT's mask becomes Wanda's and the kept weights stay as they are). Measured on
    all-MiniLM-L6-v2 calibrated on code, ``shrink=0.5`` lowered the recommended one shot (0.897 -> 0.888,
    docs/recipes.md): an option to measure, off by default."""
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (C, C):
        got = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"hessian must be a ({C}, {C}) tensor for a weight with {C} input columns, got {got}")
    if not hessian.is_floating_point() or not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian must be finite floating point")
    if isinstance(percdamp, bool) or not (isinstance(percdamp, (int, float)) and 0 < percdamp < math.inf):
        raise ValueError(f"percdamp must be a finite number > 0, got {percdamp!r}")
    if isinstance(shrink, bool) or not (isinstance(shrink, (int, float)) and 0 <= shrink <= 1):
        raise ValueError(f"shrink must be a number in [0, 1], got {shrink!r}")
    H = hessian.detach().to(device=device, dtype=torch.float64).clone()
    if shrink:
        d = H.diagonal().clone()
        H.mul_(1 - shrink).diagonal().copy_(d)
    if bool((torch.diag(H) == 0).all()):  # no inputs at all: every weight would be zeroed
        raise ValueError("hessian is all zero (no calibration inputs reached this layer)")
    return H, damp_(H, percdamp)


def damp_(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Damp a ``(C, C)`` fp64 Hessian in place; return its dead inputs ``(C,)`` (zero diagonal). A dead
    input gets the live inputs' mean diagonal (its weight is zeroed, so only the mean below sees it),
    then ``percdamp`` x the mean diagonal is added: the same relative damping at any scale of ``H``."""
    dead = torch.diag(H) == 0  # inputs that never fire: their weights do not matter
    live = torch.diag(H)[~dead]
    H[dead, dead] = float(live.mean()) if live.numel() else 1.0
    H.diagonal().add_(percdamp * float(torch.diag(H).mean()))
    return dead


def to_weight_dtype(x: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``x`` (a float32/float64 fit from a finite weight) cast to the weight's ``dtype``; ValueError naming
    ``what`` if the cast is not finite: a fit may reach past a 16-bit dtype's range (float16's 65504),
    and the cast would store inf silently."""
    out = x.to(dtype)
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{what} does not fit {dtype}: {int(bad.sum())} value(s) are inf/NaN after the cast, the "
                         f"first at index {first} (computed in {x.dtype}: {float(x[first]):.6g}; {dtype} ends at "
                         f"{torch.finfo(dtype).max:.6g}): scale the weight down, raise percdamp, or keep the layer "
                         "in float32")
    return out


def _refit(w: torch.Tensor, mask: torch.Tensor, H: torch.Tensor, dead: torch.Tensor,
           rows_per_chunk: int = 64) -> torch.Tensor:
    """:func:`reconstruct_weight` on a checked weight and mask with ``(H, dead)`` from :func:`damped_hessian`."""
    R, C = w.shape
    dev = w.device
    w0 = w.detach().to(torch.float64).masked_fill(dead, 0)  # a dead input's weight is kept 0
    keep = mask & ~dead
    rhs = w0 @ H  # row r: (H w0_r)^T, H symmetric
    out = torch.zeros(R, C, dtype=torch.float64, device=dev)
    counts = keep.sum(1)
    k = int(counts.max()) if R else 0
    if k == 0:
        return out.to(w.dtype)
    # Each row's kept columns first (stable: in column order), padded to k with a dummy index whose
    # row and column of the small system are replaced by the identity and whose right side is 0.
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :k]
    valid = torch.arange(k, device=dev) < counts[:, None]
    for a in range(0, R, rows_per_chunk):
        idx, ok = order[a:a + rows_per_chunk], valid[a:a + rows_per_chunk]
        pair = ok[:, :, None] & ok[:, None, :]
        A = torch.where(pair, H[idx[:, :, None], idx[:, None, :]], torch.diag_embed(torch.ones_like(ok, dtype=H.dtype)))
        b = torch.where(ok, torch.gather(rhs[a:a + rows_per_chunk], 1, idx), 0.0)
        L, info = torch.linalg.cholesky_ex(A)
        if bool(info.any()):
            raise ValueError("hessian is not positive semi-definite (Cholesky failed even after damping): pass "
                             "X^T X of the layer's inputs, e.g. calibrate(..., hessian=True)[name].hessian")
        sol = torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)
        out[a:a + rows_per_chunk].scatter_(1, idx, torch.where(ok, sol, 0.0))
    # zero off keep: padded indices are non-kept columns and get 0
    return to_weight_dtype(out, w.dtype, "the reconstructed weight")

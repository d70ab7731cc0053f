"""Joint SparseGPT + GPTQ INT4 (sparsegpt_prune(..., quantize="int4")) against an fp64 reference
written out plainly here: column by column OBS updates with an explicitly kept inverse Hessian."""
import copy

import pytest
import torch
from torch import nn

from sparse24.format import compress, mask_nm
from sparse24.masks import mask_nm as masks_mask_nm
from sparse24.masks import prune_layerwise_, prune_nm, sparsegpt_prune


def _hessian(C: int, seed: int = 0, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Correlated inputs ``(rows, C)`` fp64 and their ``X^T X``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, C, generator=g, dtype=torch.float64) @ (
        torch.eye(C, dtype=torch.float64) + 0.3 * torch.randn(C, C, generator=g, dtype=torch.float64))
    return x, x.T @ x


def _grid(kept: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's grid from its ``(R, k)`` kept weights (fp64): float16 scale, zero point (float)."""
    if symmetric:
        amax = kept.abs().amax(1)
        s = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).clamp(min=2.0 ** -24).half().double()
        return s, torch.full_like(s, 8.0)
    lo, hi = kept.amin(1).clamp(max=0), kept.amax(1).clamp(min=0)
    s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).clamp(min=2.0 ** -24).half().double()
    return s, torch.round(-lo / s).clamp(0, 15)


def _reference(w: torch.Tensor, H: torch.Tensor, gs: int, symmetric: bool, percdamp: float = 0.01):
    """fp64 joint 2:4 pruning + INT4 GPTQ, one column at a time: (mask, codes at kept positions (R, C), scale, zero)."""
    R, C = w.shape
    H = H.double() + percdamp * H.diagonal().mean() * torch.eye(C, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)  # of the columns not yet processed (rows/columns of done ones become 0)
    W = w.double().clone()
    mask = torch.zeros(R, C, dtype=torch.bool)
    codes = torch.zeros(R, C, dtype=torch.long)
    groups = -(-C // gs)
    scale, zero = torch.zeros(R, groups, dtype=torch.float64), torch.zeros(R, groups, dtype=torch.float64)
    lo = 1 if symmetric else 0

    def saliency(cols):  # OBS: w^2 / [H^-1]_jj with H^-1 of the columns from j on
        d = torch.stack([torch.linalg.inv(H[j:, j:])[0, 0] for j in cols])
        return W[:, cols] ** 2 / d

    for c in range(C):
        if c % gs == 0:  # the grid, from the weights the saliency would keep now
            cols = list(range(c, min(c + gs, C)))
            sal = saliency(cols).view(R, -1, 4)
            keep = torch.zeros_like(sal, dtype=torch.bool).scatter_(2, sal.topk(2, dim=2).indices, True)
            kept = W[:, cols].view(R, -1, 4)[keep].view(R, -1)
            scale[:, c // gs], zero[:, c // gs] = _grid(kept, symmetric)
        if c % 4 == 0:  # this group of 4's mask, from the weights as updated now
            sal = saliency(list(range(c, c + 4)))
            mask[:, c:c + 4].scatter_(1, sal.topk(2, dim=1).indices, True)
        s, z = scale[:, c // gs], zero[:, c // gs]
        u = (torch.round(W[:, c] / s) + z).clamp(lo, 15)
        codes[:, c] = u.long()
        q = torch.where(mask[:, c], (u - z) * s, 0.0)
        err = W[:, c] - q
        W -= torch.outer(err / Hinv[c, c], Hinv[c])  # the OBS update of every later column
        W[:, c] = q
        Hinv = Hinv - torch.outer(Hinv[:, c], Hinv[c]) / Hinv[c, c]  # column c eliminated
    return mask, codes, scale, zero


def _mask_of(p) -> torch.Tensor:
    R, C = p.shape
    m = torch.zeros(R, C // 4, 4, dtype=torch.bool)
    return m.scatter_(2, p.slots(), True).view(R, C)


@pytest.mark.parametrize("R,C,gs,symmetric,blocksize", [
    pytest.param(5, 64, 32, True, 128, id="R5-C64-g32-sym"),
    pytest.param(6, 96, 64, False, 128, id="R6-C96-g64-asym-short-group"),
    pytest.param(3, 100, 32, True, 8, id="R3-C100-g32-sym-blocks8"),
    pytest.param(4, 160, 128, False, 32, id="R4-C160-g128-asym-group-over-blocks"),
])
def test_joint_matches_fp64_reference(R, C, gs, symmetric, blocksize):
    g = torch.Generator().manual_seed(R * C)
    w = torch.randn(R, C, generator=g, dtype=torch.float64)
    _, H = _hessian(C)
    mask, codes, scale, zero = _reference(w, H, gs, symmetric)
    p = sparsegpt_prune(w, H, quantize="int4", group_size=gs, symmetric=symmetric, blocksize=blocksize)
    assert p.quantized == "int4" and p.group_size == gs and p.dtype == torch.float64
    assert torch.equal(_mask_of(p), mask)
    assert torch.equal(p.int4_codes().long(), codes[mask].view(R, C // 2))
    assert torch.equal(p.scale.double(), scale)
    if symmetric:
        assert p.zero is None
    else:
        assert torch.equal(p.zero.double(), zero)
    # the stored weight is the grid's: (u - z) * s at the kept positions, 0 elsewhere
    dense = torch.where(mask, (codes - zero.repeat_interleave(gs, 1)[:, :C]) * scale.repeat_interleave(gs, 1)[:, :C],
                        0.0)
    assert torch.equal(p.to_dense(), dense)


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_hessian_is_magnitude_plus_rtn(gs, symmetric, dtype):
    """(bfloat16: both grids' scales are the ones bfloat16 holds, test_int4.py; its ties of equal
    magnitude in a group may break either way, so RTN takes the joint's mask)"""
    w = torch.randn(12, 200, generator=torch.Generator().manual_seed(gs)).to(dtype)
    p = sparsegpt_prune(w, torch.eye(200), quantize="int4", group_size=gs, symmetric=symmetric)
    if dtype == torch.float32:
        assert torch.equal(_mask_of(p), mask_nm(w))
    r = compress(w, _mask_of(p), quantize="int4", group_size=gs, symmetric=symmetric)
    assert torch.equal(p.values, r.values) and torch.equal(p.meta, r.meta) and torch.equal(p.scale, r.scale)
    assert (p.zero is None) == symmetric and (symmetric or torch.equal(p.zero, r.zero))
    assert p.dtype == dtype and (dtype != torch.bfloat16 or torch.equal(p.scale.bfloat16().half(), p.scale))


@pytest.mark.parametrize("gs", [32, 128])
def test_joint_output_error_below_rtn(gs):
    x, H = _hessian(256, seed=1, rows=1024)
    x, H = x.float(), H.float()
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))

    def err(q):
        return float((x @ (q - w).T).norm())
    joint = sparsegpt_prune(w, H, quantize="int4", group_size=gs).to_dense()
    rtn = compress(w, quantize="int4", group_size=gs).to_dense()
    w24, mask = sparsegpt_prune(w, H)
    then_rtn = compress(w24, mask, quantize="int4", group_size=gs).to_dense()
    assert err(joint) < 0.85 * err(rtn)
    assert err(joint) < err(then_rtn)  # compensating the rounding too beats rounding SparseGPT's weights


def test_codes_on_the_grid_and_fixed_mask():
    _, H = _hessian(128, seed=3)
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mask = mask_nm(w)
    mask[0, :4] = False  # a group keeping none: stored with zero values in its filler slots
    for r, slot in ((1, 1), (2, 2), (3, 3)):  # one kept: its code went to slot 0 (a pruned position)
        mask[r, :4] = torch.arange(4) == slot
    w0 = w.clone()
    for symmetric in (True, False):
        p = sparsegpt_prune(w, H, quantize="int4", group_size=32, symmetric=symmetric, mask=mask)
        assert torch.equal(w, w0)
        p.validate()
        u = p.int4_codes().long()
        assert int(u.min()) >= (1 if symmetric else 0) and int(u.max()) <= 15
        assert torch.equal(_mask_of(p) | ~mask, torch.ones_like(mask))  # the given mask's slots
        d = p.to_dense()
        assert bool((d[~mask] == 0).all())
        # every kept weight is (u - z) * s of its group, exactly
        z = 8.0 if symmetric else p.zero.double().repeat_interleave(16, 1)
        want = (u.double() - z) * p.scale.double().repeat_interleave(16, 1)
        assert torch.equal(p.dequantized_values(torch.float64), want)


def test_prune_nm_and_layerwise_carry_the_int4_tensor():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    x, H = _hessian(64)
    r = prune_nm(w, method="sparsegpt", hessian=H.float(), quantize="int4", group_size=32)
    assert r.packed is not None and torch.equal(r.weight, r.packed.to_dense())
    assert torch.equal(r.mask, _mask_of(r.packed))
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    teacher = copy.deepcopy(net)
    res = prune_layerwise_(net, [x[:128].float(), x[128:256].float()], quantize="int4", group_size=32,
                           teacher=teacher, progress=False)
    for fqn, rr in res.items():
        assert rr.packed.quantized == "int4"
        assert torch.equal(net.get_submodule(fqn).weight.detach(), rr.packed.to_dense())


@pytest.mark.parametrize("kwargs,err,msg", [
    ({"quantize": "int8"}, ValueError, "'int4' only"),
    ({"quantize": "int4", "group_size": 48}, ValueError, "group_size must be one of"),
    ({"quantize": "int4", "n": 1}, ValueError, "2:4 weights"),
    ({"quantize": "int4", "refit": True}, ValueError, "refit"),
    ({"quantize": "int4", "group_size": 64, "blocksize": 96}, ValueError, "multiple or a divisor"),
    ({"quantize": "int4", "symmetric": 1}, TypeError, "symmetric"),
    ({"group_size": 128}, TypeError, "only apply with quantize"),
    ({"quantize": "int4", "mask": torch.ones(4, 64, dtype=torch.bool)}, ValueError, "more than 2"),
])
def test_bad_input(kwargs, err, msg):
    w = torch.randn(4, 64)
    w0 = w.clone()
    with pytest.raises(err, match=msg):
        sparsegpt_prune(w, torch.eye(64), **kwargs)
    assert torch.equal(w, w0)


def test_bad_input_prune_nm_and_mask_nm():
    with pytest.raises(ValueError, match="SparseGPT's joint quantization"):
        prune_nm(torch.randn(4, 64), method="magnitude", quantize="int4")
    with pytest.raises(ValueError, match="returns a mask only"):
        masks_mask_nm(torch.randn(4, 64), method="sparsegpt", hessian=torch.eye(64), quantize="int4")


@pytest.mark.parametrize("symmetric", [True, False])
def test_float16_grids_of_the_joint_sweep_stay_inside_float16(symmetric):
    """The joint sweep builds each group's grid by quantize_values' rule: for a float16 weight
    reaching 65504 that includes ending inside float16's range (its grid reached 65520: inf once
    dequantized to float16). With an identity Hessian it is magnitude + round to nearest."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).half()
    w[:, 0], w[2, 5] = 65504.0, -65504.0
    p = sparsegpt_prune(w, torch.eye(64), quantize="int4", group_size=32, symmetric=symmetric)
    r = compress(w, _mask_of(p), quantize="int4", group_size=32, symmetric=symmetric)
    assert torch.equal(p.scale, r.scale) and (symmetric or torch.equal(p.zero, r.zero))
    assert torch.isfinite(p.to_dense()).all()

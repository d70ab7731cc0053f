"""Sparse24Linear and sparsify_ on a CUDA GPU (the kernel behind backend="auto"),
against the same model with its dense weights multiplied by the mask, in fp64.
Run by scripts/gpu_check.sh; not part of the CPU suite (CI has no GPU)."""
import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24.ops.linear24 import op

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import (EPS, UNDERFLOW, assert_matches_reference, assert_within_bound,  # noqa: E402
                      dequantized_reference, error_bound, tolerance)

# SPARSE24_GPU_TESTS_DEVICE=cpu dry-runs this file's logic on the reference backend.
DEV = torch.device(os.environ.get("SPARSE24_GPU_TESTS_DEVICE", "cuda"))
if DEV.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("these tests need a CUDA GPU; the CPU suite is tests/")


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128)).to(DEV, dtype)


def _masked_dense(model):
    """fp64 copy of a dense model with every Linear weight times its 2:4 magnitude mask."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for layer in (ref[0], ref[2]):
            layer.weight.mul_(sparse24.mask_nm(layer.weight))
    return ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_sparsified_model_matches_masked_dense(dtype, mode):
    model = _mlp(dtype)
    x = torch.randn(3, 7, 256, device=DEV, dtype=dtype)
    dense = _masked_dense(model)
    ref = dense(x.double())
    sparse24.sparsify_(model, mode=mode)
    out = model(x)
    assert out.dtype == dtype and out.device == x.device
    # Two layers: layer 1's error bound, carried through GELU (slope <= 1.13) and its own
    # rounding (to dtype, and a few fp32 ulps of erf), is the input error of layer 2's.
    l1, l2 = dense[0], dense[2]
    z1 = F.linear(x.double(), l1.weight, l1.bias)
    h = F.gelu(z1)
    dh = 1.13 * error_bound(x, l1.weight, l1.bias, dtype)
    h_err = dh + (EPS[dtype] + 8 * EPS[torch.float32]) * (h.abs() + dh) + UNDERFLOW[dtype]
    assert_within_bound(out, ref, error_bound(h, l2.weight, l2.bias, dtype, x_err=h_err))


def test_masked_training_keeps_pruned_weights_zero_on_cuda():
    model = _mlp(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sparse24.sparsify_(model)
    x, y = torch.randn(64, 256, device=DEV), torch.randn(64, 128, device=DEV)
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for layer in (model[0], model[2]):
        assert bool((layer.weight[~layer.mask] == 0).all())
        assert sparse24.is_nm(layer.weight.detach())


def test_compressed_input_gradients_on_cuda():
    model = _mlp(torch.float32)
    ref = _masked_dense(model)
    sparse24.sparsify_(model, mode="compressed")
    x = torch.randn(5, 256, device=DEV, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    model(x).sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **tolerance(torch.float32, 512))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_compressed_layers_hold_the_decode_layout_on_cuda(quantize):
    """On CUDA a compressed float16/INT8 layer holds the decode layout (the decode kernel at
    M <= 16); outputs match the fp64 reference at decode and larger M; checkpoints stay layout v1."""
    torch.manual_seed(0)
    layer = sparse24.Sparse24Linear.from_linear(nn.Linear(256, 192).half(), mode="compressed", quantize=quantize)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    # INT8: q * scale exactly (fp64), as the kernels apply the fp32 scale; to_dense() rounds it to
    # the layer's float16, ~2**-12 off per weight, which an H200 run caught (3 of 192 outputs at M = 1)
    dense = layer.sparse_tensor().to_dense().double() if quantize is None else \
        dequantized_reference(layer, layer.sparse_tensor().kept_mask())
    bias = layer.bias.detach().double()
    layer.to(DEV)
    assert layer.layout == ("decode" if DEV.type == "cuda" else "v1")
    for M in (1, 7, 16, 40, 300):
        x = torch.randn(M, 256, device=DEV).half()
        with torch.no_grad():
            y = layer(x)
        # from UNPACK_MIN_M rows the unpack route: INT8's q * scale rounded once to x's float16, as
        # the reference backend (the CPU dry run) does at every M
        ref = dense.half().double() if quantize == "int8" and (M >= op.UNPACK_MIN_M or DEV.type != "cuda") else dense
        assert_matches_reference(y.cpu(), x.cpu(), ref, bias)
    assert all(torch.equal(v.cpu(), state[k]) for k, v in layer.state_dict().items())

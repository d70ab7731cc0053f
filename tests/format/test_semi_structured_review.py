"""A layer holding torch's own 2:4 tensor (``linear.weight = nn.Parameter(to_sparse_semi_structured(w))``,
torch's recipe) given to sparsify_ / from_linear: a ValueError naming the layer and the way out, before
anything changes; the way out it names (``weight.to_dense()``) keeps the exact pattern. The tensor is
built on CPU from torch's own reference conversion (its matmuls would need CUDA)."""
import warnings

import pytest
import torch
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUTLASS
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import sparse24

from conftest import top2_mask


def semi_structured_model():
    """``(model, float64 reference of layer 0's weight)``: layer 0 holds torch's CUTLASS tensor."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False).half()
    dense = (lin.weight.detach() * top2_mask(lin.weight)).half()
    dense[0, :4] = torch.tensor([0.0, 0.0, 0.5, 0.0])  # a group with one non-zero: its slots are torch's own pick
    packed, meta = sparse_semi_structured_from_dense_cutlass(dense)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "prototype" notice
        t = SparseSemiStructuredTensorCUTLASS(dense.shape, packed=packed, meta=meta, packed_t=None, meta_t=None,
                                              compressed_swizzled_bitmask=None)
    lin.weight = nn.Parameter(t, requires_grad=False)
    return nn.Sequential(lin, nn.ReLU(), nn.Linear(64, 64).half()), dense.double()


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_sparsify_refuses_a_semi_structured_weight_naming_the_layer_and_the_way_out(mode):
    model, _ = semi_structured_model()
    layers, weights = list(model), [m.weight for m in model if isinstance(m, nn.Linear)]
    with pytest.raises(ValueError, match=r"layer '0': the Linear's weight is torch's own 2:4 format "
                                         r"\(SparseSemiStructuredTensorCUTLASS\)") as err:
        sparse24.sparsify_(model, mode=mode)
    assert "to_dense()" in str(err.value) and "sparse24.from_semi_structured(linear.weight)" in str(err.value)
    assert list(model) == layers and all(type(m) is not sparse24.Sparse24Linear for m in model)
    assert [m.weight for m in model if isinstance(m, nn.Linear)] == weights  # the same objects: nothing changed


def test_from_linear_refuses_a_semi_structured_weight():
    model, _ = semi_structured_model()
    with pytest.raises(ValueError, match=r"torch's own 2:4 format .*to_dense\(\)"):
        sparse24.Sparse24Linear.from_linear(model[0])


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_the_way_out_the_error_names_keeps_the_exact_pattern(mode):
    model, ref = semi_structured_model()
    model[0].weight = nn.Parameter(model[0].weight.to_dense())
    sparse24.sparsify_(model, mode=mode, skip_output_head=False)
    assert isinstance(model[0], sparse24.Sparse24Linear)
    assert torch.equal(model[0].dense_weight().double(), ref)
    from_torch = sparse24.from_semi_structured(semi_structured_model()[0][0].weight)
    assert torch.equal(from_torch.to_dense().double(), ref)  # the other way out it names

"""compress_(packed=...): the joint SparseGPT + GPTQ INT4 grid from prune_layerwise_ stored as it is
(re-rounding the dequantized weight would move it), refused when it does not fit; nothing changes on error."""
import pytest
import torch
from torch import nn

import sparse24
from conftest import assert_model_unchanged, model_snapshot


def _pruned(gen):
    net = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    batches = [torch.randn(16, 64, generator=gen) @ torch.randn(64, 64, generator=gen) for _ in range(2)]
    results = sparse24.prune_layerwise_(net, batches, method="sparsegpt", quantize="int4", group_size=32,
                                        symmetric=False, progress=False)
    sparse24.sparsify_(net)
    return net, results, batches


def test_packed_grid_is_stored_exactly(gen):
    net, results, batches = _pruned(gen)
    with torch.no_grad():
        before = net(batches[0])
    # a second rounding of the dequantized weight lands on another grid somewhere (why packed= exists)
    again = {f: sparse24.compress(r.packed.to_dense(), quantize="int4", group_size=32, symmetric=False)
             for f, r in results.items()}
    assert any(not torch.equal(again[f].to_dense(), r.packed.to_dense()) for f, r in results.items())
    sparse24.compress_(net, quantize="int4", group_size=32, symmetric=False, packed=results)
    for fqn, r in results.items():
        layer = net.get_submodule(fqn)
        assert torch.equal(layer.values, r.packed.values) and torch.equal(layer.scale, r.packed.scale)
        assert torch.equal(layer.zero, r.packed.zero)
        assert torch.equal(layer.dense_weight().double(), r.packed.to_dense().double())
    with torch.no_grad():
        torch.testing.assert_close(net(batches[0]), before, rtol=0, atol=0)


def test_packed_that_does_not_fit_changes_nothing(gen):
    net, results, _ = _pruned(gen)
    snap = model_snapshot(net)
    with pytest.raises(ValueError, match=r"is quantize=int4, group_size=32, symmetric=False, compress_ was asked for quantize=int4, group_size=64"):
        sparse24.compress_(net, quantize="int4", group_size=64, symmetric=False, packed=results)
    assert_model_unchanged(net, snap)
    with pytest.raises(ValueError, match=r"packed\['9'\]: no masked 2:4 layer"):
        sparse24.compress_(net, quantize="int4", group_size=32, symmetric=False, packed={"9": results["0"]})
    assert_model_unchanged(net, snap)
    with torch.no_grad():
        net[0].weight.mul_(2)
    snap = model_snapshot(net)
    with pytest.raises(ValueError, match=r"packed\['0'\] does not dequantize to the layer's masked weight"):
        sparse24.compress_(net, quantize="int4", group_size=32, symmetric=False, packed=results)
    assert_model_unchanged(net, snap)
    with pytest.raises(TypeError, match="needs a Sparse24Tensor"):
        sparse24.compress_(net, quantize="int4", group_size=32, symmetric=False, packed={"0": torch.zeros(1)})

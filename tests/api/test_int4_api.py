"""sparsify_ / compress_ with quantize="int4": the report's bytes counted with the scales, outputs against
the fp64 dense weight dequantized from the stored codes, settings checked first, all or nothing."""
import pytest
import torch
from torch import nn

import sparse24

from conftest import assert_matches_reference, assert_model_unchanged, int4_dequantized_reference, model_snapshot, \
    top2_mask


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(160, 64), nn.GELU(), nn.Linear(64, 96))


@pytest.mark.parametrize("group_size, symmetric", [(32, True), (64, False), (128, True)])
def test_sparsify_int4_report_bytes_and_outputs(group_size, symmetric):
    model = net()
    masks = {i: top2_mask(model[i].weight.detach()) for i in (0, 2)}
    report = sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=group_size,
                                symmetric=symmetric, skip_output_head=False)
    assert f"quantize='int4', group_size={group_size}, symmetric={symmetric}" in str(report)
    for r in report.swapped:
        m = model.get_submodule(r.fqn)
        R, C = r.shape
        groups = R * -(-C // group_size)
        # values C/4 + slots C/8 bytes per row, an fp16 scale (+ a uint8 zero point) per group
        assert r.compressed_bytes == r.memory_bytes == R * C // 4 + R * C // 8 + groups * (2 if symmetric else 3)
        ref = int4_dequantized_reference(m, masks[int(r.fqn)])
        x = torch.randn(4, C)
        with torch.no_grad():
            assert_matches_reference(m(x), x, ref.float(), m.bias.detach())


def test_compress_int4_checks_first_and_changes_nothing():
    model = net()
    sparse24.sparsify_(model, skip_output_head=False)
    snap = model_snapshot(model)
    for kwargs, err, msg in (({"quantize": "int4", "group_size": 16}, ValueError, "INT4 group_size must be one of"),
                             ({"quantize": "int8", "symmetric": False}, ValueError, "apply to quantize='int4'"),
                             ({"quantize": "int4", "symmetric": 0}, TypeError, "symmetric must be a bool")):
        with pytest.raises(err, match=msg):
            sparse24.compress_(model, **kwargs)
        assert_model_unchanged(model, snap)
    with torch.no_grad():
        model[2].weight[0, model[2].mask[0].nonzero()[0, 0]] = float("inf")
    snap = model_snapshot(model)
    with pytest.raises(ValueError, match=r"compress_: layer '2': weight has 1 non-finite value.*nothing was changed"):
        sparse24.compress_(model, quantize="int4")
    assert_model_unchanged(model, snap)
    with torch.no_grad():
        model[2].weight.nan_to_num_(posinf=1.0)
    report = sparse24.compress_(model, quantize="int4", group_size=64)
    assert "quantize='int4', group_size=64, symmetric=True" in str(report)
    assert [m.quantize for m in model if isinstance(m, sparse24.Sparse24Linear)] == ["int4", "int4"]
    with pytest.raises(ValueError, match="layer '0' is already compressed with quantize=int4, group_size=64, "
                                         "symmetric=True; decompress_ first"):
        sparse24.compress_(model, quantize="int4", group_size=32)
    sparse24.decompress_(model)  # back to masked: the dequantized weights
    assert [m.mode for m in model if isinstance(m, sparse24.Sparse24Linear)] == ["masked", "masked"]

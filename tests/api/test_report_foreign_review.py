"""``sparsify_``'s report names the weight matrices it leaves alone even where they are no Parameter
(review "foreign", round 8): torch's ``quantize_dynamic`` Linear (the weight packed in an opaque object)
and a GPTQ / AWQ-style ``QuantLinear`` holding its codes as an int32 ``qweight`` buffer. Integer
buffers that are no weights (position ids) give no line."""
import warnings

import torch
from torch import nn

import sparse24


class QuantLinear(nn.Module):
    """GPTQ's layout: 4-bit codes packed 8 to an int32 along the input, a scale per group and output."""

    def __init__(self, inp: int, out: int, group: int = 32):
        super().__init__()
        self.register_buffer("qweight", torch.randint(-2**31, 2**31 - 1, (inp // 8, out), dtype=torch.int32))
        self.register_buffer("scales", torch.rand(inp // group, out).half())
        self.register_buffer("bias", torch.zeros(out).half())


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(32, 64)
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0))   # (1, 16) int64: no weight


def test_quantize_dynamic_layers_are_reported_as_not_handled():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (torch.ao.quantization is deprecated)
        model = torch.ao.quantization.quantize_dynamic(base, {nn.Linear}, dtype=torch.qint8)
    x = torch.randn(3, 64)
    y = model(x)
    report = sparse24.sparsify_(model)
    assert [(r.fqn, r.shape, r.dtype, r.action) for r in report.layers] == \
        [("0", (64, 64), torch.qint8, "skipped"), ("2", (48, 64), torch.qint8, "skipped")]
    assert all("quantized by torch.ao.quantization" in r.reason for r in report.layers)
    assert "0 layer(s) changed, 2 skipped" in str(report)
    assert torch.equal(model(x), y)   # left alone


def test_a_quantized_weight_held_in_a_buffer_is_reported_and_position_ids_are_not():
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": Embeddings(), "q": QuantLinear(64, 96), "fc": nn.Linear(64, 64)})
    report = sparse24.sparsify_(model, skip_output_head=False)
    lines = {r.fqn: r for r in report.layers}
    assert set(lines) == {"emb.tok", "q", "fc"}
    assert lines["q"].action == "skipped" and lines["q"].shape == (8, 96) and lines["q"].dtype == torch.int32
    assert "'qweight'" in lines["q"].reason and "quantized or packed by another tool" in lines["q"].reason
    assert lines["fc"].action != "skipped"

"""Size figures (review of byte and parameter accounting): the report's held bytes include an INT4
layer's bfloat16 scale copy; its nominal 2:4 bytes count the 2-bit indices as Sparse24Tensor does."""
import torch
from torch import nn

import sparse24
from sparse24 import Sparse24Linear
from sparse24.nn import compressed_nbytes, memory_nbytes


def test_held_bytes_include_the_bf16_scale_copy():
    torch.manual_seed(0)
    layer = Sparse24Linear.from_linear(nn.Linear(256, 64).bfloat16(), mode="compressed", quantize="int4",
                                       group_size=32).to_layout("decode")
    copy = layer._scale_bf16[2]
    held = sum(t.numel() * t.element_size() for t in (layer.values, layer.meta, layer.scale, copy))
    assert memory_nbytes(layer) == held


def test_nominal_bytes_round_the_indices_up_as_the_tensor_does():
    """R * C % 8 == 4: 13.5 index bytes; the report floored them (13), Sparse24Tensor.nbytes rounds up (14)."""
    torch.manual_seed(0)
    for R, C in ((3, 4), (4, 12), (5, 4), (64, 128)):
        p = sparse24.compress(torch.randn(R, C))
        assert compressed_nbytes(R, C, 4) == p.nbytes, (R, C)

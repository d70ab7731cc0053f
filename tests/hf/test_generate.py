"""model.generate of a sparsified model decodes the tokens of an independent float64 reference model holding
the masked (for INT8 / INT4: dequantized) weights: greedy over left-padded prompts, beam search, sampling."""
import pytest
import torch

import sparse24

from hf_models import masked_reference, tiny_llama


def _prompts():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (3, 8), generator=gen)
    mask = torch.ones_like(ids)
    for row, n in enumerate((8, 5, 3)):          # left padding: 0, 3 and 5 pad tokens
        ids[row, :8 - n], mask[row, :8 - n] = 0, 0
    return ids, mask


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_generate_matches_a_float64_masked_reference(quantize):
    dense = tiny_llama()
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", quantize=quantize,
                       **({"group_size": 32} if quantize == "int4" else {}))
    ref = masked_reference(dense, model)
    ids, mask = _prompts()
    for kw in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}, {"do_sample": True, "top_k": 0}):
        out = []
        for m in (model, ref):
            torch.manual_seed(0)                    # (sampling: the same draws for both)
            out.append(m.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **kw))
        assert torch.equal(out[0], out[1]), kw

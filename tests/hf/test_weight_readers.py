"""Parents that read a child Linear's ``.weight`` in their forward (T5's feed-forward casts to
``self.wo.weight.dtype``): a compressed layer has no ``weight``, so ``sparsify_(mode="compressed")``
and the CLI's ``prune`` wrote T5 models that could not run (AttributeError). Such children stay in
masked mode, found from the parent's forward source; models whose forwards read no child weight
are compressed whole."""
import copy

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

import sparse24
from sparse24 import Sparse24Linear

from hf_models import VOCAB, tiny_gpt2, tiny_llama, tokens


def _modes(model):
    return {n: m.mode for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


@pytest.mark.parametrize("gated", [False, True])
def test_t5_compressed_runs_with_wo_kept_masked(gated):
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, feed_forward_proj="gated-gelu" if gated else "relu")
    dense = T5ForConditionalGeneration(cfg).eval()
    masked, compressed = copy.deepcopy(dense), copy.deepcopy(dense)
    sparse24.sparsify_(masked)
    report = sparse24.sparsify_(compressed, mode="compressed")
    modes = _modes(compressed)
    wo = [n for n in modes if n.endswith("DenseReluDense.wo")]
    assert wo and all(modes[n] == "masked" for n in wo)
    assert all(mode == "compressed" for n, mode in modes.items() if n not in wo)
    notes = {r.fqn: r.reason for r in report.layers}
    assert all("reads self.wo.weight" in notes[n] for n in wo), notes
    ids, dec = tokens(), tokens(1, (2, 5))
    with torch.no_grad():
        out = compressed(input_ids=ids, decoder_input_ids=dec).logits
        ref = masked(input_ids=ids, decoder_input_ids=dec).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class _CastsToProj(nn.Module):
    """A head that casts to its projection's dtype (as many vision-language heads do)."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.proj(x.to(self.proj.weight.dtype)))


def test_a_custom_parent_reading_a_child_weight_keeps_that_child_masked():
    model = nn.Sequential(_CastsToProj(), nn.ReLU(), nn.Linear(64, 64))
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False)
    assert _modes(model) == {"0.proj": "masked", "0.out": "compressed", "2": "compressed"}
    model(torch.randn(3, 64))


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2,
                                   lambda: BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                                                num_attention_heads=4, intermediate_size=128))])
def test_models_whose_forwards_read_no_child_weight_compress_whole(build):
    model = build()
    sparse24.sparsify_(model, mode="compressed")
    assert set(_modes(model).values()) == {"compressed"}

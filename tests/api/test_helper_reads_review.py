"""Review findings on model families whose forward reads a child Linear's ``.weight`` in a helper method
it calls (WavLM's attention hands q/k/v/out_proj.weight to ``F.multi_head_attention_forward`` from
``torch_multi_head_self_attention``; Reformer's LSH attention in ``_query_per_attn_head``): only
``forward``'s source was scanned, so compressed models could not run and a masked layer's in-place
rewrite was used unmasked. Against an independent reference: a float64 deep copy of the dense model
with each pruned layer's weight times an independent 2:4 magnitude mask."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24 import Sparse24Linear

from conftest import masked_copy, top2_mask

transformers = pytest.importorskip("transformers")


def modes(model):
    return {n: m.mode for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def tiny_wavlm():
    torch.manual_seed(0)
    cfg = transformers.WavLMConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=36, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                   num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)
    return transformers.WavLMForCTC(cfg).eval()


ATT = "wavlm.encoder.layers.0.attention"
PROJ = [f"{ATT}.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_wavlm_compressed_runs_with_the_helper_read_projections_kept_masked(quantize):
    dense = tiny_wavlm()
    x = torch.randn(1, 400, generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(dense)
    report = sparse24.sparsify_(model, mode="compressed", quantize=quantize)
    got = modes(model)
    assert all(got[n] == "masked" for n in PROJ), got
    assert all(mode == "compressed" for n, mode in got.items() if n not in PROJ), got
    why = {r.fqn: r.reason for r in report.layers}
    assert all("WavLMAttention.torch_multi_head_self_attention reads self." in why[n] for n in PROJ), why
    with torch.no_grad():
        out = model(input_values=x).logits
    if quantize is None:   # (INT8 values: only that it runs)
        with torch.no_grad():
            ref = masked_copy(dense, got)(input_values=x.double()).logits
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_wavlm_masked_rezeroes_a_helper_read_weight_written_in_place():
    dense = tiny_wavlm()
    x = torch.randn(1, 400, generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model)
    q = model.get_submodule(f"{ATT}.q_proj")
    new = torch.randn(q.weight.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q.weight.copy_(new)   # a re-init torch sees: the next forward must use it masked
        out = model(input_values=x).logits
    assert not q.weight[~q.mask].any()
    ref = masked_copy(dense, modes(model))
    with torch.no_grad():   # the new weight under the layer's mask (the dense weight's magnitude mask)
        mask = top2_mask(dense.get_submodule(f"{ATT}.q_proj").weight)
        ref.get_submodule(f"{ATT}.q_proj").weight.copy_((new * mask).double())
        want = ref(input_values=x.double()).logits
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_wavlm_wanda_keeps_the_uncalibrated_helper_read_projections_dense():
    dense = tiny_wavlm()
    batches = [{"input_values": torch.randn(1, 400, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    stats = sparse24.calibrate(dense, batches)
    model = copy.deepcopy(dense)
    report = sparse24.sparsify_(model, method="wanda", calibration=stats, mode="compressed")
    why = {r.fqn: r.reason for r in report.skipped}
    assert all("torch_multi_head_self_attention" in why.get(n, "") for n in PROJ), why
    with torch.no_grad():
        model(**batches[0])


class _HelperReads(nn.Module):
    """A forward that hands its projection's weight to F.linear from a helper; ``reset_parameters``
    and ``_init_weights`` read ``fc.weight`` to fill it, which is no forward read."""

    def __init__(self):
        super().__init__()
        self.proj, self.fc = nn.Linear(64, 64), nn.Linear(64, 64)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.fc.weight, std=0.1)

    def _init_weights(self):
        self.fc.weight.data.zero_()

    def _project(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)

    def forward(self, x):
        return self.fc(self._project(x))


class _Subclass(_HelperReads):   # the helper is on a base class
    pass


@pytest.mark.parametrize("cls", [_HelperReads, _Subclass])
def test_a_helper_read_keeps_its_layer_masked_and_init_reads_do_not(cls):
    torch.manual_seed(0)
    dense = nn.Sequential(cls(), nn.ReLU(), nn.Linear(64, 64))
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False)
    assert modes(model) == {"0.proj": "masked", "0.fc": "compressed", "2": "compressed"}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), masked_copy(dense, ["0.proj", "0.fc", "2"])(x.double()),
                                   rtol=1e-5, atol=1e-5)


def test_reformer_lsh_attention_compressed_generates():
    torch.manual_seed(0)
    cfg = transformers.ReformerConfig(vocab_size=64, hidden_size=64, num_attention_heads=2, attention_head_size=32,
                                      feed_forward_size=128, attn_layers=["local", "lsh"], axial_pos_embds=False,
                                      max_position_embeddings=64, local_attn_chunk_length=8, lsh_attn_chunk_length=8,
                                      num_buckets=4, num_hashes=1, is_decoder=True, pad_token_id=0, eos_token_id=2)
    dense = transformers.ReformerModelWithLMHead(cfg).eval()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed")
    lsh = "reformer.encoder.layers.1.attention.self_attention"
    got = modes(model)
    assert got[f"{lsh}.query_key"] == got[f"{lsh}.value"] == "masked", got
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    ref = masked_copy(dense, got)
    with torch.no_grad():   # the cached path (past_buckets_states) calls _query_per_attn_head
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, want)

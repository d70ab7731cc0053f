"""Review findings on calibrate / prune_layerwise_ across model families:

- ``nn.TransformerEncoder`` in eval mode called with ``src_key_padding_mask`` hands its layers a nested
  tensor (the real tokens of each sequence): calibrate and prune_layerwise_ crashed reading its shape.
  Reference: each sequence run alone, unpadded, its layers' inputs summed by hand in float64.
- prune_layerwise_ pruned a tied output head, and with it the token embedding (the same Parameter),
  while sparsify_ keeps it dense. Reference: a deep copy of the embedding taken before the call."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24.masks import calibrate, prune_layerwise_

D, FF = 16, 32
LENGTHS = (8, 5, 3)


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2).eval()


def padded_batch():
    src = torch.randn(len(LENGTHS), max(LENGTHS), D, generator=torch.Generator().manual_seed(1))
    pad = torch.arange(max(LENGTHS))[None, :] >= torch.tensor(LENGTHS)[:, None]   # True at padding
    return {"src": src, "src_key_padding_mask": pad}


LINEARS = [f"layers.{i}.{n}" for i in range(2) for n in ("linear1", "linear2")]


def reference_sums(enc, batch):
    """{layer: (rows, sum x^2, sum x^T x)} in float64 over the real tokens: each sequence run alone, unpadded."""
    inputs = {n: [] for n in LINEARS}
    hooks = [enc.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0].detach()))
             for n in LINEARS]
    with torch.no_grad():
        for i, L in enumerate(LENGTHS):
            enc(batch["src"][i:i + 1, :L])
    for h in hooks:
        h.remove()
    out = {}
    for n, xs in inputs.items():
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
        out[n] = (x.shape[0], (x * x).sum(0), x.T @ x)
    return out


def test_torch_gives_the_layers_a_nested_input():   # (the premise: else the tests below test nothing)
    enc, seen = encoder(), []
    h = enc.layers[0].linear1.register_forward_pre_hook(lambda m, a: seen.append(a[0].is_nested))
    with torch.no_grad():
        enc(**padded_batch())
    h.remove()
    assert seen == [True]


@pytest.mark.parametrize("token_mask", [None, lambda b: ~b["src_key_padding_mask"]], ids=["no mask", "pad mask"])
def test_calibrate_a_padded_encoder_counts_the_real_tokens(token_mask):
    enc, batch = encoder(), padded_batch()
    ref = reference_sums(copy.deepcopy(enc), batch)
    stats = calibrate(enc, [batch], hessian=True, token_mask=token_mask)
    assert set(LINEARS) <= set(stats)
    for n in LINEARS:
        rows, sq, xtx = ref[n]
        assert stats[n].count == rows == sum(LENGTHS)
        torch.testing.assert_close(stats[n].sq_sum, sq, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stats[n].xtx, xtx, rtol=1e-4, atol=1e-4)


def test_calibrate_a_token_mask_that_drops_real_tokens_of_a_nested_input_is_refused():
    enc, batch = encoder(), padded_batch()

    def first_tokens_only(b):   # fewer tokens than the encoder kept: cannot be applied to its nested input
        keep = ~b["src_key_padding_mask"]
        keep[:, 2:] = False
        return keep
    with pytest.raises(ValueError, match=r"layers\.0\.linear1.*nested"):
        calibrate(enc, [batch], token_mask=first_tokens_only)


@pytest.mark.parametrize("token_mask", [None, lambda b: ~b["src_key_padding_mask"]], ids=["no mask", "pad mask"])
def test_prune_layerwise_a_padded_encoder_equals_the_unpadded_sequences(token_mask):
    enc, batch = encoder(), padded_batch()
    ref = copy.deepcopy(enc)
    one_by_one = [batch["src"][i:i + 1, :L] for i, L in enumerate(LENGTHS)]   # no padding: no nested tensor
    filt = lambda m, n: n in LINEARS   # noqa: E731  (out_proj is read directly, never called)
    prune_layerwise_(ref, one_by_one, method="wanda", filter_fn=filt, progress=False)
    prune_layerwise_(enc, [batch], method="wanda", filter_fn=filt, token_mask=token_mask, progress=False)
    for n in LINEARS:
        w, w_ref = enc.get_submodule(n).weight, ref.get_submodule(n).weight
        assert torch.equal(w != 0, w_ref != 0), n
        assert torch.equal(w, w_ref), n


# --- prune_layerwise_ leaves a tied output head (and the embedding) dense -----------------------------

class TinyLM(nn.Module):
    """Embedding -> two Linears -> a head tied to the embedding (no transformers needed)."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, 64), nn.Linear(64, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.fc2(torch.relu(self.fc1(self.embed(ids)))))


def lm_batches():
    return [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]


@pytest.mark.parametrize("method", ["sparsegpt", "wanda", "magnitude"])
def test_prune_layerwise_leaves_a_tied_head_and_its_embedding_alone(method):
    torch.manual_seed(0)
    model = TinyLM()
    emb = copy.deepcopy(model.embed.weight)
    results = prune_layerwise_(model, lm_batches(), method=method, progress=False)
    assert sorted(results) == ["fc1", "fc2"]
    assert torch.equal(model.embed.weight, emb)
    assert model.head.weight is model.embed.weight
    assert all((model.get_submodule(n).weight != 0).float().mean() == 0.5 for n in ("fc1", "fc2"))


def test_prune_layerwise_keeps_an_untied_output_head_dense_unless_filter_fn_picks_it():
    torch.manual_seed(0)
    model = TinyLM()
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())   # untied: still the output head
    head = copy.deepcopy(model.head.weight)
    assert sorted(prune_layerwise_(model, lm_batches(), method="magnitude", progress=False)) == ["fc1", "fc2"]
    assert torch.equal(model.head.weight, head)
    # a filter_fn chooses the layers itself (as sparsify_'s skip_output_head=False would prune the head)
    out = prune_layerwise_(model, lm_batches(), method="magnitude", filter_fn=lambda m, n: n == "head",
                           progress=False)
    assert list(out) == ["head"] and (model.head.weight != 0).float().mean() == 0.5


def test_prune_layerwise_refuses_a_tied_layer_a_filter_fn_picks():
    torch.manual_seed(0)
    model = TinyLM()
    emb = copy.deepcopy(model.embed.weight)
    with pytest.raises(ValueError, match=r"'head'.*embed\.weight.*tied"):
        prune_layerwise_(model, lm_batches(), method="magnitude", filter_fn=lambda m, n: True, progress=False)
    assert torch.equal(model.embed.weight, emb)


def test_prune_layerwise_then_sparsify_whisper_leaves_the_tied_embedding_alone():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.WhisperConfig(vocab_size=99, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=4, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_source_positions=20, max_target_positions=20, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = T.WhisperForConditionalGeneration(cfg).eval()
    emb = copy.deepcopy(model.model.decoder.embed_tokens.weight)
    batch = {"input_features": torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(1)),
             "decoder_input_ids": torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2)),
             "use_cache": False}
    results = prune_layerwise_(model, [batch], method="sparsegpt", progress=False)
    assert "proj_out" not in results and results
    assert torch.equal(model.model.decoder.embed_tokens.weight, emb)
    report = sparse24.sparsify_(model)
    assert "proj_out" in {r.fqn for r in report.skipped}
    assert torch.equal(model.model.decoder.embed_tokens.weight, emb)

"""sparse24.evaluate against independent computations: each sentence embedded alone (no padding) and
averaged in fp64, cosines from fp64 vectors, cross-entropy summed position by position."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24 import bits_per_char, embedding_fidelity, mean_pool, sentence_embeddings


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)
    return BertModel(cfg, add_pooling_layer=False).eval()


def padded(lengths, seed=0):
    """A dict batch of sentences of the given lengths, padded with id 0 and its attention mask."""
    gen = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 50, (n,), generator=gen)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def alone(model, batch):
    """fp64 mean of each sentence's token vectors, the sentence run alone without padding."""
    out = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        n = int(mask.sum())
        with torch.no_grad():
            h = model(input_ids=ids[None, :n]).last_hidden_state[0].double()
        out.append(h.mean(0))
    return torch.stack(out)


def test_mean_pooling_over_the_attention_mask_matches_each_sentence_alone():
    model = tiny_bert()
    batches = [padded([5, 9, 2]), padded([7, 7, 3, 1], seed=1)]
    emb = sentence_embeddings(model, batches)                      # dict batches: their attention mask
    ref = torch.cat([F.normalize(alone(model, b), dim=-1) for b in batches])
    assert emb.shape == (7, 32) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.double(), ref, rtol=0, atol=1e-5)
    raw = sentence_embeddings(model, batches, normalize=False)
    torch.testing.assert_close(raw.double(), torch.cat([alone(model, b) for b in batches]), rtol=0, atol=1e-5)
    # the same through a tuple batch with an explicit token mask; without it padding counts and changes the result
    tup = [(b["input_ids"], b["attention_mask"]) for b in batches]
    torch.testing.assert_close(sentence_embeddings(model, tup, token_mask=lambda b: b[1]), emb, rtol=0, atol=0)
    assert not torch.allclose(sentence_embeddings(model, tup), emb, atol=1e-3)


def test_mean_pool_is_differentiable_and_matches_a_loop_over_kept_tokens():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    ref = torch.stack([h[i, :int(mask[i].sum())].mean(0) for i in range(3)])  # kept tokens lead each row
    torch.testing.assert_close(mean_pool(h, mask, normalize=False), ref, rtol=0, atol=1e-15)
    torch.testing.assert_close(mean_pool(h, mask.bool()), ref / ref.norm(dim=-1, keepdim=True), rtol=0, atol=1e-15)
    torch.testing.assert_close(mean_pool(h, None, normalize=False), h.mean(1))
    mean_pool(h, mask).sum().backward()                     # what a training step needs
    assert h.grad is not None and (h.grad[0, 3:] == 0).all() and (h.grad[0, :3] != 0).any()
    with pytest.raises(ValueError, match=r"token mask has shape \(3, 4\)"):
        mean_pool(h, mask[:, :4])
    with pytest.raises(ValueError, match=r"\(B, L, D\)"):
        mean_pool(h[0], mask[0])


def test_pooled_output_is_taken_as_is_and_fidelity_is_the_mean_cosine():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
    pruned = copy.deepcopy(dense)
    with torch.no_grad():
        pruned[0].weight.mul_((torch.rand_like(pruned[0].weight) > 0.5).float())
    batches = [torch.randn(5, 8), torch.randn(3, 8)]
    e = sentence_embeddings(dense, batches)
    torch.testing.assert_close(e, F.normalize(torch.cat([dense(b) for b in batches]).detach(), dim=-1))
    x = torch.cat(batches).double()
    with torch.no_grad():
        expected = F.cosine_similarity(copy.deepcopy(pruned).double()(x), copy.deepcopy(dense).double()(x),
                                       dim=-1).mean().item()
    got = embedding_fidelity(pruned, batches, dense)
    assert abs(got - expected) < 1e-6 and got < 0.999
    assert embedding_fidelity(pruned, batches, e) == got             # precomputed reference embeddings
    assert embedding_fidelity(dense, batches, dense) == pytest.approx(1.0, abs=1e-6)


def test_bits_per_char_matches_position_by_position_cross_entropy():
    torch.manual_seed(0)
    V, ctx = 7, 5

    class Bigram(nn.Module):  # (B, L) ids -> (B, L, V) logits; a Dropout to check the eval mode
        def __init__(self):
            super().__init__()
            self.table, self.drop = nn.Embedding(V, V), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.table(x))

    model = Bigram().train()
    ids = torch.randint(0, V, (60,), dtype=torch.uint8)
    got = bits_per_char(model, ids, ctx, windows=6, batch_size=4)
    assert model.training and model.drop.training                     # flags restored
    logp = model.table.weight.detach().double().log_softmax(-1)
    starts = [i * (60 - ctx - 1) // 5 for i in range(6)]           # evenly spaced, first and last included
    nll = [-logp[int(ids[s + j]), int(ids[s + j + 1])] for s in starts for j in range(ctx)]
    assert got == pytest.approx(float(sum(nll)) / len(nll) / math.log(2), rel=1e-6)
    # a Hugging Face causal LM returns its logits in an output object (an AttributeError before)
    from hf_models import tiny_llama
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return CausalLMOutputWithPast(logits=self.inner(x))
    assert bits_per_char(Wrapped(model), ids, ctx, windows=6, batch_size=4) == got
    llama = tiny_llama()
    ids = torch.randint(3, 96, (40,))
    with torch.no_grad():
        want = F.cross_entropy(llama(ids[None, :-1]).logits[0], ids[1:]) / math.log(2)
    assert bits_per_char(llama, torch.cat((ids, ids[:1])), ctx=39, windows=1) == pytest.approx(float(want), rel=1e-5)


def test_bad_inputs_name_the_problem():
    model = tiny_bert()
    b, b2 = padded([3, 4]), padded([2, 5])
    with pytest.raises(ValueError, match=r"batch 1: the token mask has shape \(2, 2\)"):
        sentence_embeddings(model, [b, b2], token_mask=lambda x: x["attention_mask"][:, :2] if x is b2 else
                            x["attention_mask"])
    with pytest.raises(ValueError, match="batches is empty"):
        sentence_embeddings(model, [])
    with pytest.raises(TypeError, match="token_mask must be callable"):
        sentence_embeddings(model, [b], token_mask=b["attention_mask"])
    class Text(nn.Module):
        def forward(self, x):
            return "no tensor"
    with pytest.raises(TypeError, match="cannot read embeddings from a model output of type str"):
        sentence_embeddings(Text(), [b["input_ids"]])
    with pytest.raises(ValueError, match="reference embeddings have shape"):
        embedding_fidelity(model, [b], torch.zeros(3, 32))
    with pytest.raises(TypeError, match="batches must be re-iterable"):  # ("batches is empty" before)
        embedding_fidelity(model, (x for x in [b]), tiny_bert())
    lm = nn.Embedding(4, 4)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        bits_per_char(lm, torch.rand(30), ctx=4, windows=2)
    with pytest.raises(ValueError, match="windows must be an int >= 1"):
        bits_per_char(lm, torch.zeros(30, dtype=torch.long), ctx=4, windows=0)
    with pytest.raises(ValueError, match="need at least 6"):
        bits_per_char(lm, torch.zeros(5, dtype=torch.long), ctx=4, windows=1)

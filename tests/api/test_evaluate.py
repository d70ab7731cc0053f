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


def test_bits_per_char_reaches_the_last_window_of_a_text_past_2_to_the_24():
    # enwik8-sized texts: a float32 linspace rounded the last start one past the end (a short window)
    class Uniform(nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape, 8)
    ctx = 16
    ids = torch.zeros(2 ** 24 + 3 + ctx + 1, dtype=torch.uint8)
    assert bits_per_char(Uniform(), ids, ctx=ctx, windows=4) == pytest.approx(3.0)


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
    with pytest.raises(ValueError, match="batches is empty"):  # a generator is fine now: batches are read once
        embedding_fidelity(model, (x for x in []), tiny_bert())
    lm = nn.Embedding(4, 4)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        bits_per_char(lm, torch.rand(30), ctx=4, windows=2)
    with pytest.raises(ValueError, match="windows must be an int >= 1"):
        bits_per_char(lm, torch.zeros(30, dtype=torch.long), ctx=4, windows=0)
    with pytest.raises(ValueError, match="need at least 6"):
        bits_per_char(lm, torch.zeros(5, dtype=torch.long), ctx=4, windows=1)


class CharLM(nn.Module):
    """(B, ctx) ids -> (B, ctx, V) logits in the module's dtype."""

    def __init__(self, V=101):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, 32), nn.Linear(32, V)

    def forward(self, x):
        return self.out(self.emb(x)) * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bits_per_char_of_a_half_precision_model_is_the_fp64_cross_entropy_of_its_logits(dtype):
    """The loss was summed in the logits' dtype: bf16 came out 0.05 bits/char low, and fp16 inf (64 windows x
    256 positions x ~4.6 nats > fp16's 65504)."""
    torch.manual_seed(0)
    V, ctx, windows = 101, 256, 64
    model = CharLM(V).to(dtype)
    ids = torch.randint(0, V, (100_000,))
    got = bits_per_char(model, ids, ctx=ctx, windows=windows)
    starts = torch.linspace(0, ids.numel() - ctx - 1, windows).long()
    win = ids[starts[:, None] + torch.arange(ctx + 1)]
    with torch.no_grad():
        logits = model(win[:, :-1]).double()                 # the same logits, summed in fp64
    want = float(F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum")) / win[:, 1:].numel()
    # fp32 log-softmax (a few round-offs a term) summed pairwise over 16384 terms (log2 = 14 round-offs):
    # within 17 fp32 round-offs (1e-6); in bf16 the error was 7e-3, in fp16 inf
    assert got == pytest.approx(want / math.log(2), rel=1e-6)


def test_fidelity_pairs_each_sentence_with_itself_over_a_shuffled_data_loader():
    """The model ran over the batches, then the reference ran over them again: a DataLoader(shuffle=True)
    yields another order the second time, so different sentences were compared (0.25 against itself)."""
    from torch.utils.data import DataLoader
    torch.manual_seed(0)
    a, b = nn.Embedding(50, 8), nn.Embedding(50, 8)                # (B, L) ids -> (B, L, 8) token vectors
    ids = torch.randint(1, 50, (64, 6))
    shuffled = DataLoader(ids, batch_size=16, shuffle=True)
    assert embedding_fidelity(a, shuffled, a) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        want = F.cosine_similarity(a.weight.double()[ids].mean(1), b.weight.double()[ids].mean(1), dim=-1).mean()
    assert embedding_fidelity(a, shuffled, b) == pytest.approx(float(want), abs=1e-6)
    assert embedding_fidelity(a, [ids], b) == pytest.approx(float(want), abs=1e-6)
    # one pass over the batches: a generator is enough now
    assert embedding_fidelity(a, (x for x in ids.split(16)), b) == pytest.approx(float(want), abs=1e-6)


def test_fp16_pooling_gives_zero_for_an_empty_sentence_and_does_not_overflow():
    """Pooled in fp16, clamp(min=1e-9) underflowed to 0 (an all-padding sentence gave 0/0 = NaN) and a long
    sentence's token sum overflowed to inf; both poisoned embedding_fidelity."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randint(-8, 9, (3, 5, 4), generator=gen).half()     # small integers: exact fp32 sums
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 1, 1]])
    m = mask.double()[..., None]
    ref = (h.double() * m).sum(1) / m.sum(1).clamp(min=1)           # an empty sentence: 0
    got = mean_pool(h, mask, normalize=False)
    assert got.dtype == torch.float16 and torch.equal(got, ref.half()) and (got[1] == 0).all()
    unit = mean_pool(h, mask)
    assert unit.dtype == torch.float16 and (unit[1] == 0).all()
    torch.testing.assert_close(unit[[0, 2]].double(), F.normalize(ref[[0, 2]], dim=-1), rtol=2 ** -11, atol=0)
    long = torch.full((1, 512, 4), 200.0, dtype=torch.float16)     # sum 102400 > fp16's max 65504
    assert torch.equal(mean_pool(long, torch.ones(1, 512), normalize=False), torch.full((1, 4), 200.0).half())
    assert torch.equal(mean_pool(long, None, normalize=False), torch.full((1, 4), 200.0).half())
    hg = h.clone().requires_grad_()                                 # still differentiable
    mean_pool(hg, mask).float().sum().backward()
    assert hg.grad.dtype == torch.float16 and hg.grad.isfinite().all() and (hg.grad[1] == 0).all()
    # through sentence_embeddings / embedding_fidelity with an fp16 encoder
    enc = nn.Embedding(10, 4).half()
    with torch.no_grad():
        enc.weight[3] = 200.0
    ids = torch.tensor([[1, 2, 0] + [3] * 509, [0] * 512])            # a long sentence and an empty one
    e = sentence_embeddings(enc, [ids], token_mask=lambda b: b != 0)
    w = enc.weight.detach().double()
    want = F.normalize(w[ids[0, :2]].sum(0) + 509 * w[3], dim=0)
    torch.testing.assert_close(e[0].double(), want, rtol=0, atol=1e-6)
    assert (e[1] == 0).all()
    assert embedding_fidelity(enc, [ids], enc, token_mask=lambda b: b != 0) == pytest.approx(0.5, abs=1e-6)


def test_bits_per_char_names_the_logits_shape_it_needs():
    class NextChar(nn.Module):  # (B, ctx) -> (B, vocab): a next-character model such as the demo's CharMLP
        def forward(self, x):
            return torch.zeros(x.shape[0], 8)

    class SeqFirst(nn.Module):  # (ctx, B, vocab)
        def forward(self, x):
            return torch.zeros(x.shape[1], x.shape[0], 8)
    ids = torch.randint(0, 8, (200,))
    with pytest.raises(ValueError, match=r"logits of shape \(4, 8\) .* expected \(4, 16, vocab\)"):
        bits_per_char(NextChar(), ids, ctx=16, windows=4)
    with pytest.raises(ValueError, match=r"logits of shape \(16, 4, 8\) .* expected \(4, 16, vocab\)"):
        bits_per_char(SeqFirst(), ids, ctx=16, windows=4)

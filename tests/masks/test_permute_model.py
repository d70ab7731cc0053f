"""Model-wide channel permutations: the groups that can absorb a permutation
(found by structure, proven by running), outputs equal to the original model's
in float64, calibrated importance against independent formulas, statistics
permuted like a fresh calibration, and bad groups refused with nothing changed."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24.masks import (PermutationGroup, calibrate, check_group, find_permutation_groups, group_importance,
                            mask_nm, permute_model_)


class PostLNLayer(nn.Module):
    """A BERT layer (post-LN): separate q/k/v, attention output, GELU MLP."""

    def __init__(self, d=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out, self.ln1 = nn.Linear(d, d), nn.LayerNorm(d)
        self.ffn_in, self.ffn_out, self.ln2 = nn.Linear(d, ffn), nn.Linear(ffn, d), nn.LayerNorm(d)

    def forward(self, h):
        B, L, D = h.shape
        split = lambda t: t.view(B, L, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)))
        h = self.ln1(h + self.attn_out(a.transpose(1, 2).reshape(B, L, D)))
        return self.ln2(h + self.ffn_out(F.gelu(self.ffn_in(h))))


class GatedMLP(nn.Module):
    def __init__(self, d=16, f=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PreLNLM(nn.Module):
    """A pre-LN char LM as scripts/eval_charlm.py builds it: fused qkv, residual stream from
    the embeddings to the head."""

    def __init__(self, vocab=11, d=16, heads=2, ctx=8):
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(ctx, d))
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        with torch.no_grad():  # LayerNorms as trained: a permutation that forgets them must show
            for ln in (self.ln1, self.ln2, self.ln):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        B, T, D = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(self.ln(h))


def residual_group(d=16):
    return PermutationGroup(["qkv", "fc1", "head"], ["proj", "fc2"],
                            [("emb.weight", 1), ("pos", 1), ("ln1.weight", 0), ("ln1.bias", 0), ("ln2.weight", 0),
                             ("ln2.bias", 0), ("ln.weight", 0), ("ln.bias", 0)], name="residual")


def test_found_groups_mlp_gated_and_attention_heads():
    torch.manual_seed(0)
    layer = PostLNLayer()
    found = {g.consumers[0]: g for g in find_permutation_groups(layer, torch.randn(2, 5, 32), heads=4)}
    assert set(found) == {"ffn_out", "attn_out"}  # q/k/v/ffn_in read the residual stream: nothing to absorb it
    assert found["ffn_out"].producers == ["ffn_in"] and found["ffn_out"].block is None
    assert found["attn_out"].producers == ["value"] and found["attn_out"].block == 8  # inside a head only
    assert find_permutation_groups(layer, torch.randn(2, 5, 32)) == [found["ffn_out"]]  # no heads: no attention
    gated = find_permutation_groups(GatedMLP(), torch.randn(3, 16))
    assert [(g.consumers, sorted(g.producers)) for g in gated] == [(["down"], ["gate", "up"])]


def test_check_group_can_fail():
    torch.manual_seed(1)
    lm, x = PreLNLM(), torch.randint(0, 11, (2, 8))
    assert check_group(lm, residual_group(), x)
    no_ln = residual_group()
    no_ln.params = [p for p in no_ln.params if not p[0].startswith("ln1")]
    assert not check_group(lm, no_ln, x)  # the LayerNorm's weight must move with the stream
    across_heads = PermutationGroup(["proj"], [("qkv", 32)], name="v->proj")
    assert not check_group(lm, across_heads, x) and check_group(lm, PermutationGroup(["proj"], [("qkv", 32)], block=8), x)


@pytest.mark.parametrize("score", ["magnitude", "wanda", "sparsegpt"])
def test_permuted_model_equals_the_original_in_float64(score):
    torch.manual_seed(2)
    lm = PreLNLM().double()
    x = torch.randint(0, 11, (4, 8))
    ref = lm(x)
    batches = [torch.randint(0, 11, (8, 8)) for _ in range(3)]
    stats = calibrate(lm, batches, hessian=True)
    groups = [residual_group(), PermutationGroup(["proj"], [("qkv", 32)], block=8, name="attn"),
              PermutationGroup(["fc2"], ["fc1"], name="mlp")]
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    gains = permute_model_(lm, groups, score=score, calibration=stats, example=x, max_iters=40)
    torch.testing.assert_close(lm(x), ref, rtol=1e-12, atol=1e-12)
    assert set(gains) == {"residual", "attn", "mlp"} and all(g >= 0 for g in gains.values())
    assert any(not torch.equal(before[k], v) for k, v in lm.state_dict().items())  # something really moved
    # the statistics were permuted exactly as a fresh calibration of the permuted model gives them
    redo = calibrate(lm, batches, hessian=True)
    for fqn in ("qkv", "fc1", "head", "proj", "fc2"):
        torch.testing.assert_close(stats[fqn].sq_sum, redo[fqn].sq_sum)
        torch.testing.assert_close(stats[fqn].xtx, redo[fqn].xtx)


def test_importance_scores_match_their_formulas():
    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double()
    stats = calibrate(mlp, [torch.randn(64, 8, dtype=torch.float64)], hessian=True)
    g = PermutationGroup(["2"], ["0"])
    w, s = mlp[2].weight.detach(), stats["2"]
    x2 = s.sq_sum / s.count
    torch.testing.assert_close(group_importance(mlp, g, "wanda", stats), w ** 2 * x2)
    H = s.xtx / s.count
    H = H + 0.01 * H.diagonal().mean() * torch.eye(16, dtype=H.dtype)
    torch.testing.assert_close(group_importance(mlp, g, "sparsegpt", stats), w ** 2 / torch.linalg.inv(H).diagonal())
    torch.testing.assert_close(group_importance(mlp, g, "magnitude"), w.abs())


def test_permutation_keeps_more_importance_in_the_mask():
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    g = PermutationGroup(["2"], ["0"], name="mlp")
    kept = lambda w: float((w.abs() * mask_nm(w, 2, 4)).sum())  # noqa: E731
    before = kept(mlp[2].weight.detach())
    gains = permute_model_(mlp, [g], max_iters=60)
    after = kept(mlp[2].weight.detach())
    assert after > before and gains["mlp"] == pytest.approx(after / before - 1, rel=1e-5)


def test_a_group_that_is_not_exact_is_refused_and_nothing_changes():
    torch.manual_seed(5)
    lm, x = PreLNLM(), torch.randint(0, 11, (2, 8))
    stats = calibrate(lm, [x], hessian=True)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    qkv_stats = stats["qkv"].sq_sum.clone()
    bad = residual_group()
    bad.params = bad.params[:2]  # LayerNorms left out
    with pytest.raises(ValueError, match="differ"):
        permute_model_(lm, [bad], score="wanda", calibration=stats, example=x, max_iters=50)
    assert all(torch.equal(state[k], v) for k, v in lm.state_dict().items())
    assert torch.equal(stats["qkv"].sq_sum, qkv_stats)
    with pytest.raises(ValueError, match="is not an nn.Linear"):
        permute_model_(lm, [PermutationGroup(["nope"], ["proj"])])
    with pytest.raises(ValueError, match="cannot hold"):
        permute_model_(lm, [PermutationGroup(["proj"], ["qkv"])])  # 48 rows for 16 channels: give the slice
    with pytest.raises(ValueError, match="needs calibration"):
        permute_model_(lm, [PermutationGroup(["fc2"], ["fc1"])], score="sparsegpt")
    with pytest.raises(ValueError, match="block"):
        permute_model_(lm, [PermutationGroup(["fc2"], ["fc1"], block=5)])
    assert all(torch.equal(state[k], v) for k, v in lm.state_dict().items())


def _llama_example(length, seed=0):
    return {"input_ids": torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed)),
            "use_cache": False}


def test_a_one_token_example_is_refused():
    # attention over one key is 1 and RoPE at position 0 the identity: query rows permuted with key columns
    # passed the proof (16 "exact" groups on a tiny Llama, 8 real; the permuted model's logits then had
    # cosine 0.48 to the original's on 32 tokens)
    from hf_models import tiny_llama
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    one = _llama_example(1)
    with pytest.raises(ValueError, match="has 1 position"):
        find_permutation_groups(model, one, heads=4)
    groups = find_permutation_groups(model, _llama_example(16), heads=4)
    assert groups and not any(p.endswith(("q_proj", "k_proj")) for g in groups for p in g.producers)
    with pytest.raises(ValueError, match="has 1 position"):
        permute_model_(model, groups, example=one, max_iters=20)
    with pytest.raises(ValueError, match="has 1 position"):
        check_group(model, groups[0], one)
    with pytest.raises(ValueError, match="has 1 position"):
        find_permutation_groups(model, {"inputs_embeds": torch.randn(1, 1, 64)}, heads=4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_exact_groups_pass_the_output_check_in_16_bit():
    # the check's 1e-4 was under one float16 rounding step: exact groups were refused in 10 of 10 seeds
    # (bfloat16: 8 of 10)
    from hf_models import tiny_llama
    example = _llama_example(16)
    for seed in range(2):
        groups = find_permutation_groups(tiny_llama(seed), example, heads=4)  # proved in float64
        for dtype in (torch.float16, torch.bfloat16):
            model = tiny_llama(seed).to(dtype)
            with torch.no_grad():
                before = model(**example).logits.double()
            permute_model_(model, groups, example=example, max_iters=30, seed=seed)
            with torch.no_grad():
                after = model(**example).logits.double()
            tol = 8 * torch.finfo(dtype).eps * float(before.abs().max())
            assert float((after - before).abs().max()) <= tol


def test_nan_importance_is_refused():
    # one NaN made every swap's score NaN: the search ran out its time limit and returned the identity
    from sparse24.masks import search_permutation
    w = torch.randn(4, 16)
    w[0, 3] = float("nan")
    with pytest.raises(ValueError, match="contains NaN or inf"):
        search_permutation(w, max_iters=50)


def test_a_tied_parameter_listed_under_both_names_is_permuted_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
            self.s = nn.Parameter(torch.rand(16, dtype=torch.float64) + 0.5)
            self.s2 = self.s   # the same Parameter under a second name

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) * self.s)

    torch.manual_seed(6)
    model, x = Tied(), torch.randn(5, 8, dtype=torch.float64)
    ref = model(x)
    both = PermutationGroup(["b"], ["a"], [("s", 0), ("s2", 0)], name="g")
    assert check_group(model, both, x)   # was False: s was permuted twice
    permute_model_(model, [both], max_iters=30)
    torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)


def test_train_mode_models_and_the_caller_s_statistics():
    # the output check ran a train-mode model with dropout on (refused as "not exact"); a refused call
    # left the caller's own LayerStats objects permuted; xtx_teacher was not permuted
    torch.manual_seed(7)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16)).double().train()
    x = torch.randn(6, 16, dtype=torch.float64)
    groups = find_permutation_groups(mlp, x)
    teacher = copy.deepcopy(mlp)
    stats = calibrate(mlp, [x], hessian=True, teacher=teacher)
    held = stats["3"]
    permute_model_(mlp, groups, score="sparsegpt", calibration=stats, example=x, max_iters=30)
    assert mlp.training and mlp[2].training   # modes restored
    fresh = calibrate(mlp, [x], hessian=True, teacher=teacher)
    torch.testing.assert_close(stats["3"].xtx_teacher, fresh["3"].xtx_teacher, rtol=1e-12, atol=1e-12)
    # a refused call puts back the very objects the caller holds, with their tensors
    stats = calibrate(mlp, [x], hessian=True)
    held, sq = stats["3"], stats["3"].sq_sum.clone()
    bad = PermutationGroup(["3"], [], name="no producer")   # the consumer's columns alone: not exact
    with pytest.raises(ValueError, match="differ"):
        permute_model_(mlp, [bad], score="wanda", calibration=stats, example=x, max_iters=30)
    assert stats["3"] is held and torch.equal(held.sq_sum, sq)

"""Scale review: work that must grow linearly with the model (prune_state_dict's byte count, the candidate
groups of find_permutation_groups), a Hugging Face KV cache in the outputs of the permutation proofs, and the
2-D mask methods in row bands (bounded temporaries, the identical mask)."""
import copy

import pytest
import torch
from torch import nn

from sparse24.masks import PermutationGroup, check_group, find_permutation_groups, mask_nm, permute_model_, prune_nm
from sparse24.masks import nm, two_d
from sparse24.masks import permute_model as pm
from sparse24.tools.prune import prune_state_dict


# --- prune_state_dict: bytes_after per layer, linear time ------------------------------------------------

def test_prune_state_dict_bytes_after_by_hand():
    g = torch.Generator().manual_seed(0)
    sd = {"fc.weight": torch.randn(8, 32, generator=g), "fc.bias": torch.randn(8, generator=g),
          "h.weight": torch.randn(8, 64, generator=g).half(),
          # nn.TransformerEncoderLayer's linear1 stays masked: weight + bool mask
          "enc.layers.0.self_attn.in_proj_weight": torch.randn(96, 32, generator=g),
          "enc.layers.0.linear1.weight": torch.randn(16, 32, generator=g)}
    _, rep = prune_state_dict(sd, min_features=0, exclude="nothing^", progress=False)
    got = {r["name"]: (r["action"], r["bytes_before"], r["bytes_after"]) for r in rep}
    assert got == {"fc.weight": ("compressed", 8 * 32 * 4, 8 * 16 * 4 + 1 * 8 * 4),      # values fp32 + meta int32
                   "h.weight": ("compressed", 8 * 64 * 2, 8 * 32 * 2 + 2 * 8 * 4),       # values fp16 + meta
                   "enc.layers.0.linear1.weight": ("masked", 16 * 32 * 4, 16 * 32 * 4 + 16 * 32)}
    _, rep = prune_state_dict(sd, quantize="int8", min_features=0, exclude="nothing^", progress=False)
    assert rep[0]["bytes_after"] == 8 * 16 + 8 * 4 + 8 * 4    # int8 values, meta, fp32 scale
    _, rep = prune_state_dict({"h.weight": sd["h.weight"]}, quantize="int4", group_size=32, symmetric=False,
                              min_features=0, progress=False)
    assert rep[0]["bytes_after"] == 8 * 16 + 2 * 8 * 4 + 8 * 2 * 2 + 8 * 2 + 4   # values, meta, scale, zero, group_size
    _, rep = prune_state_dict({"weight": sd["fc.weight"], "bias": sd["fc.bias"]}, min_features=0, progress=False)
    assert rep[0]["bytes_after"] == 8 * 16 * 4 + 1 * 8 * 4    # a bare Linear's state dict (prefix "")


class _Key(str):
    """A state-dict key that counts how often it is scanned with startswith."""
    scans = 0

    def startswith(self, *args):
        _Key.scans += 1
        return str.startswith(self, *args)


def test_prune_state_dict_does_not_rescan_its_output_per_layer():
    # bytes_after summed every entry written so far for each layer: O(layers^2) (16000 layers: 122 s)
    n = 300
    sd = {}
    for i in range(n):
        sd[_Key(f"layers.{i}.weight")] = torch.ones(4, 4)
        sd[_Key(f"layers.{i}.bias")] = torch.ones(4)
    _Key.scans = 0
    out, rep = prune_state_dict(sd, min_features=0, progress=False)
    assert len(rep) == n and all(r["action"] == "compressed" for r in rep)
    assert _Key.scans <= 4 * n, f"{_Key.scans} key scans for {n} layers (quadratic)"


# --- find_permutation_groups / permute_model_ with a Hugging Face KV cache in the outputs ---------------------

def _llama(seed=0):
    """A tiny LlamaForCausalLM, its config at the defaults (use_cache=True) but for the sizes."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=64, max_position_embeddings=64)).eval()


def _names(groups):
    return [(g.consumers, sorted(p if isinstance(p, str) else tuple(p) for p in g.producers), g.block) for g in groups]


def test_groups_are_proved_with_the_decoder_s_default_use_cache():
    # outputs held a DynamicCache that compared unequal (object identity): no group was ever proved exact
    model = _llama()
    assert model.config.use_cache
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    without = find_permutation_groups(model, {"input_ids": ids, "use_cache": False}, heads=4)
    found = find_permutation_groups(model, {"input_ids": ids}, heads=4)
    assert _names(found) == _names(without) == [
        (["model.layers.0.self_attn.o_proj"], ["model.layers.0.self_attn.v_proj"], 8),
        (["model.layers.0.mlp.down_proj"], ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], None),
        (["model.layers.1.self_attn.o_proj"], ["model.layers.1.self_attn.v_proj"], 8),
        (["model.layers.1.mlp.down_proj"], ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"], None)]
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        expect = ref(input_ids=ids).logits
    permute_model_(model, found, example={"input_ids": ids}, max_iters=20)   # was refused: "outputs differ"
    with torch.no_grad():
        got = model.double()(input_ids=ids).logits
    torch.testing.assert_close(got, expect, rtol=1e-9, atol=1e-9)


def test_a_group_that_is_not_exact_is_still_refused_with_a_cache():
    model = _llama(1)
    ids = {"input_ids": torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))}
    across_heads = PermutationGroup(["model.layers.0.self_attn.o_proj"], ["model.layers.0.self_attn.v_proj"])
    assert not check_group(model, across_heads, ids)
    assert check_group(model, PermutationGroup(across_heads.consumers, across_heads.producers, block=8), ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="differ"):
        permute_model_(model, [across_heads], example=ids, max_iters=20)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_outputs_equal_ignores_only_caches():
    from transformers import DynamicCache
    a, b = torch.ones(3), torch.ones(3)
    assert pm._outputs_equal({"logits": a, "past_key_values": DynamicCache()}, {"logits": b, "past_key_values":
                                                                                  DynamicCache()})
    assert not pm._outputs_equal({"logits": a, "past_key_values": DynamicCache()},
                                 {"logits": b + 1, "past_key_values": DynamicCache()})   # the logits still count
    assert not pm._outputs_equal((a, DynamicCache()), (a, None))
    assert not pm._outputs_equal((a, object()), (a, object()))   # an unknown object: not proved equal


# --- find_permutation_groups: candidates within one block of a stack --------------------------------------------

def _count_tests(monkeypatch):
    calls = [0]
    orig = pm._Float64Copy.exact

    def counting(self, g, seed=0):
        calls[0] += 1
        return orig(self, g, seed)
    monkeypatch.setattr(pm._Float64Copy, "exact", counting)
    return calls


def test_stacked_blocks_are_not_paired_with_every_other_block(monkeypatch):
    # every block's linear2 was a candidate producer for every block's linear1 (same grandparent 'layers'):
    # O(L^2) candidates, each tested by a whole-model forward
    calls = _count_tests(monkeypatch)
    tests = {}
    for L in (2, 4, 6):
        torch.manual_seed(0)
        enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), L,
                                    enable_nested_tensor=False).eval()
        calls[0] = 0
        groups = find_permutation_groups(enc, torch.randn(2, 5, 16))
        tests[L] = calls[0]
        assert _names(groups) == [([f"layers.{i}.linear2"], [f"layers.{i}.linear1"], None) for i in range(L)]
    assert tests[6] - tests[4] == tests[4] - tests[2], tests   # a constant number of tests per block


class _Deep(nn.Module):
    """A plain deep MLP as a Sequential of (Linear, ReLU) blocks, below the root (a Tanh item between two):
    each block's Linear reads the previous block's rows through elementwise ops only, so the pairs across
    neighbouring blocks are exact."""

    def __init__(self):
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]
        self.net = nn.Sequential(blocks[0], nn.Tanh(), *blocks[1:])

    def forward(self, x):
        return self.net(x)


def test_pairs_across_neighbouring_items_are_still_found():
    torch.manual_seed(0)
    groups = find_permutation_groups(_Deep(), torch.randn(6, 8))
    assert _names(groups) == [(["net.2.0"], ["net.0.0"], None), (["net.3.0"], ["net.2.0"], None),
                              (["net.4.0"], ["net.3.0"], None)]


# --- 2-D methods in row bands -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["2d_greedy", "2d_optimal"])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_2d_masks_in_row_bands_are_identical(monkeypatch, method, kind):
    # the 2-D methods ran on the whole weight (6.5-8.7x a bf16 weight's bytes at peak)
    g = torch.Generator().manual_seed(3)
    whole_fn = {"2d_greedy": two_d.mask_2d_greedy, "2d_optimal": two_d.mask_2d_optimal}[method]
    for R, C, chunk in [(20, 8, 64), (28, 32, 64), (12, 8, 8 * 40)]:   # bands of 8, 4 (at least m), 40 rows
        if kind == "random":
            w = torch.randn(R, C, generator=g)
        else:   # ties everywhere, some infinities and zeros
            w = torch.randint(-2, 3, (R, C), generator=g).float()
            w[0, 1] = float("inf")
            w[R - 1, 2] = -float("inf")
        w = w.to(torch.bfloat16)
        expect = whole_fn(w.clone(), 2, 4)   # the whole-tensor mask
        seen = []

        def spy(t, n, m):
            seen.append(t.shape[0])
            return whole_fn(t, n, m)
        monkeypatch.setattr(nm, "_CHUNK", chunk)
        monkeypatch.setattr(nm, "mask_2d_greedy" if method == "2d_greedy" else "mask_2d_optimal", spy)
        before = w.clone()
        got = mask_nm(w, 2, 4, method=method)
        res = prune_nm(w, 2, 4, method=method)
        assert torch.equal(got, expect) and torch.equal(res.mask, expect) and torch.equal(w, before)
        band = max(4, chunk // C // 4 * 4)
        assert seen and max(seen) <= band and all(s % 4 == 0 for s in seen) and sum(seen) == 2 * R, (seen, band)
        assert torch.equal(res.weight, w.masked_fill(~expect, 0))
        monkeypatch.undo()

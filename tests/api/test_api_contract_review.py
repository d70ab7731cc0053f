"""The public API's contract (review "api", round 8): numbers, seeds, flags and calibration dicts are
checked before anything runs, with errors naming the argument; ``Sparse24Tensor.to(dtype)`` works as
``torch.Tensor.to(dtype)`` does; the documented parameters are documented."""
import copy
import inspect

import numpy as np
import pytest
import torch
from torch import nn

import sparse24
import sparse24.learn.learned_masks as learned_masks_module
from sparse24 import (DecodePacked, LearnableMask, Sparse24Linear, calibrate, learn_masks, mean_pool,
                      prune_layerwise_, sentence_embeddings, sparsify_, token_noise)
from sparse24.learn import distill_
from sparse24.masks import (PermutationGroup, check_group, find_permutation_groups, group_importance,
                            permute_model_)
from sparse24.nn import compressed_nbytes

NAN, INF = float("nan"), float("inf")


def mlp(seed=0, d=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))


def state_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, state, kinds=None):
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items()) \
        and (kinds is None or [type(m) for m in model.modules()] == kinds)


# --- F1: weight_decay / hidden_weight / betas -------------------------------------------------------------

@pytest.mark.parametrize("bad", [-50.0, NAN, INF, "0.1", True])
def test_learn_masks_refuses_a_bad_weight_decay_before_anything_changes(bad):
    model, data = mlp(), [torch.randn(8, 32) for _ in range(2)]
    state, kinds = state_of(model), [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
        learn_masks(model, data, 2, train_weights=True, weight_lr=1e-2, weight_decay=bad, min_features=8,
                    progress=False)
    assert unchanged(model, state, kinds)


def test_learn_masks_and_distill_refuse_bad_hidden_weight_and_distill_bad_weight_decay():
    model, data = mlp(), [torch.randn(8, 32) for _ in range(2)]
    state, kinds = state_of(model), [type(m) for m in model.modules()]
    for bad in (INF, NAN, -1.0):
        with pytest.raises(ValueError, match="hidden_weight must be a finite number >= 0"):
            learn_masks(model, data, 2, hidden=["0"], hidden_weight=bad, min_features=8, progress=False)
    assert unchanged(model, state, kinds)
    student = copy.deepcopy(model)
    sparsify_(student, min_features=8)
    s_state = state_of(student)
    for bad in (INF, NAN, "0.1"):
        with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
            distill_(student, data, 2, teacher=model, weight_decay=bad, progress=False)
        with pytest.raises(ValueError, match="hidden_weight must be a finite number >= 0"):
            distill_(student, data, 2, teacher=model, hidden=["0"], hidden_weight=bad, progress=False)
    assert unchanged(student, s_state)
    assert not student[0]._forward_hooks and not model[0]._forward_hooks


@pytest.mark.parametrize("bad", [0.9, (0.9,), (0.9, 1.5), (0.9, NAN), ("0.9", 0.999)])
def test_learn_masks_refuses_bad_betas_before_pruning(bad, monkeypatch):
    pruned = []
    monkeypatch.setattr(learned_masks_module, "sparsify_", lambda *a, **k: pruned.append(1))
    with pytest.raises(ValueError, match=r"betas must be \(beta1, beta2\)"):
        learn_masks(mlp(), [torch.randn(8, 32)], 2, betas=bad, min_features=8, progress=False)
    assert not pruned


# --- F2: seeds ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, "0", 1.5, True, 2**64])
def test_learn_masks_checks_seed_before_the_prior_prunes_anything(bad, monkeypatch):
    pruned = []
    monkeypatch.setattr(learned_masks_module, "sparsify_", lambda *a, **k: pruned.append(1))
    model = mlp()
    state = state_of(model)
    with pytest.raises(ValueError, match="seed must be an int"):
        learn_masks(model, [torch.randn(8, 32)], 2, seed=bad, min_features=8, progress=False)
    assert not pruned and unchanged(model, state)


def test_token_noise_and_check_group_check_seed_and_take_numpy_ints():
    ids = [torch.randint(0, 10, (2, 5))]
    group = PermutationGroup(["2"], ["0"])
    for bad in (None, "0", 1.5, True):
        with pytest.raises(ValueError, match="seed must be an int"):
            token_noise(ids, vocab=10, seed=bad)
        with pytest.raises(ValueError, match="seed must be an int"):
            check_group(mlp(), group, torch.randn(4, 32), seed=bad)
    # a numpy int is an int: the same copies as the Python int (torch's manual_seed refused np.int64)
    a, b = token_noise(ids, vocab=10, seed=3), token_noise(ids, vocab=10, seed=np.int64(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert check_group(mlp(), group, torch.randn(4, 32), seed=np.int64(1)) is True


# --- F3: calibration= of permute_model_ / group_importance ---------------------------------------------------

def test_permute_model_and_group_importance_refuse_calibration_that_is_not_a_dict_of_layer_stats():
    model, data = mlp(), [torch.randn(16, 32)]
    stats = calibrate(model, data)
    norms = {k: v.act_norm for k, v in stats.items()}
    group = PermutationGroup(["2"], ["0"], name="g")
    state = state_of(model)
    cases = [(norms, r"calibration\['0'\] must be a LayerStats"),
             (stats["2"], "calibration must be a dict"),
             (list(stats.values()), "calibration must be a dict")]
    for calib, msg in cases:
        for score in ("wanda", "magnitude"):
            with pytest.raises(TypeError, match=msg):
                permute_model_(model, [group], score=score, calibration=calib, max_iters=5)
            with pytest.raises(TypeError, match=msg):
                group_importance(model, group, score, calib)
    assert unchanged(model, state)
    assert all(torch.equal(stats[k].act_norm, norms[k]) for k in stats)
    # the right type still works; Wanda's score against a float64 reference
    w = model[2].weight.detach().double()
    with torch.no_grad():
        act = torch.relu(model[0](data[0])).double().pow(2).mean(0).sqrt()   # RMS of the consumer's inputs
    ref = (w.abs() * act) ** 2
    torch.testing.assert_close(group_importance(model, group, "wanda", stats), ref, rtol=1e-12, atol=0)


# --- F4: Sparse24Tensor.to(dtype) / DecodePacked.to(dtype) ----------------------------------------------------

def two_four_weight(R=8, C=64):
    """A float32 weight that is 2:4 already (two zeros per group), so compress keeps it exactly."""
    torch.manual_seed(0)
    w = torch.randn(R, C)
    keep = torch.rand(R, C // 4, 4).argsort(-1)[..., :2]
    mask = torch.zeros(R, C // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).view(R, C)
    return w * mask


def test_sparse24_tensor_to_dtype_positional_casts_the_values_as_torch_tensor_to_does():
    w = two_four_weight()
    p = sparse24.compress(w)
    for q in (p.to(torch.bfloat16), p.to("cpu", torch.bfloat16), p.to(torch.device("cpu"), torch.bfloat16)):
        assert q.dtype == torch.bfloat16 and q.meta.dtype == torch.int32
        assert torch.equal(q.to_dense(), w.to(torch.bfloat16))   # the idiom: w.to(torch.bfloat16)
    p8 = sparse24.compress(w, quantize="int8")
    q8 = p8.to(torch.bfloat16)   # quantized: only the logical dtype changes
    assert q8.dtype == torch.bfloat16 and torch.equal(q8.values, p8.values) and torch.equal(q8.meta, p8.meta)
    with pytest.raises(TypeError, match="two dtypes"):
        p.to(torch.bfloat16, torch.float16)
    with pytest.raises(TypeError, match="device must be"):
        p.to(torch.zeros(1))


def test_decode_packed_to_refuses_a_dtype_naming_it():
    d = sparse24.pack_decode(sparse24.compress(two_four_weight().half()))
    with pytest.raises(TypeError, match="not a dtype"):
        d.to(torch.float32)
    moved = d.to("cpu")
    assert torch.equal(moved.values, d.values) and torch.equal(moved.meta, d.meta)


# --- F5: flags ---------------------------------------------------------------------------------------------

def test_flags_are_bools_not_truthy_values():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 8)
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match="normalize must be a bool"):
            mean_pool(h, normalize=bad)
    torch.testing.assert_close(mean_pool(h, normalize=np.False_).double(), h.double().mean(1))
    enc = nn.Embedding(10, 4)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        sentence_embeddings(enc, [torch.tensor([[1, 2]])], normalize="False")
    model, data = mlp(), [torch.randn(4, 32)]
    with pytest.raises(TypeError, match="hessian must be a bool"):
        calibrate(model, data, hessian="False")
    with pytest.raises(TypeError, match="stop_early must be a bool"):
        calibrate(model, data, stop_early=0)
    state = state_of(model)
    with pytest.raises(TypeError, match="rollback must be a bool"):
        prune_layerwise_(model, data, method="magnitude", rollback="False")
    assert unchanged(model, state)
    with pytest.raises(TypeError, match="hard must be a bool"):
        LearnableMask((4, 16)).sample(hard="False")
    layer = Sparse24Linear.from_linear(nn.Linear(64, 16))
    with pytest.raises(TypeError, match="release must be a bool"):
        layer.to_dense_module(release="no")
    with pytest.raises(TypeError, match="int8 must be a bool"):
        DecodePacked.empty(16, 64, int8="False")
    with pytest.raises(ValueError, match="quantized must be"):
        compressed_nbytes(16, 64, 2, quantized="False")
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        permute_model_(model, [], progress="False")


# --- F6: LearnableMask.sample(noise=) ---------------------------------------------------------------------

def test_learnable_mask_sample_refuses_non_finite_or_negative_noise():
    lm = LearnableMask((4, 16))
    for bad in (NAN, INF, -1.0, "1"):
        with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
            lm.sample(noise=bad)
    s = lm.sample(noise=0.5, generator=torch.Generator().manual_seed(0))
    assert bool(((s >= 0) & (s <= 1)).all())
    torch.testing.assert_close(s.double().view(-1, 4).sum(-1), torch.full((16,), 2.0, dtype=torch.float64))


# --- F7: small checks and documented parameters ----------------------------------------------------------

def test_small_checks_name_the_problem():
    for g in (0, -1, 48):
        with pytest.raises(ValueError, match="group_size"):
            DecodePacked.empty(16, 64, group_size=g)
    with pytest.raises(ValueError, match="exclude each other"):
        DecodePacked.empty(16, 64, int8=True, group_size=32)
    with pytest.raises(ValueError, match="out_features must be an int >= 0"):
        compressed_nbytes(-16, 64, 2)
    with pytest.raises(ValueError, match="out_features must be an int >= 0"):
        compressed_nbytes(16.5, 64, 2)
    with pytest.raises(ValueError, match="in_features must be divisible by 4"):
        compressed_nbytes(16, 66, 2)
    # the count itself, by hand: 16 x 64 bf16, 2 of 4 kept, 2-bit indices
    assert compressed_nbytes(16, 64, 2) == 16 * 32 * 2 + 16 * 64 // 8
    layer = Sparse24Linear.from_linear(nn.Linear(64, 16))
    with pytest.raises(ValueError, match="torch.int32"):
        layer.add_to_kept_(torch.ones(16, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="heads must be a positive int"):
        find_permutation_groups(mlp(), torch.randn(4, 32), heads=True)


def documented(obj, name):
    doc = inspect.getdoc(obj) or ""
    return any(f"{name}{end}" in doc for end in (":", "``", ",", " ")) or f"``{name}``" in doc


def test_the_listed_parameters_and_hooks_are_documented():
    from sparse24 import hf, lora
    from sparse24.decode_format import decode_dims
    cases = [(DecodePacked, ["check"]), (DecodePacked.empty, ["int8", "device", "group_size", "symmetric"]),
             (check_group, ["seed", "example"]), (group_importance, ["calibration", "score", "group"]),
             (decode_dims, ["R", "C"]), (compressed_nbytes, ["out_features", "in_features", "element_size"]),
             (hf.check_blocks, ["headers", "folder", "path"]),
             (hf.Sparse24Config, ["layers", "mode", "quantization", "format_version"])]
    for obj, names in cases:
        doc = inspect.getdoc(obj) or ""
        assert "Args:" in doc, obj
        for name in names:
            assert documented(obj, name), (obj, name)
    for obj in (lora.Sparse24LoraLinear.update_layer, lora.Sparse24LoraLinear.lora_variants,
                hf.Sparse24Quantizer.is_serializable, hf.Sparse24Quantizer.is_trainable,
                hf.Sparse24Quantizer.is_qat_trainable, hf.Sparse24Quantizer.is_compileable):
        assert (inspect.getdoc(obj) or "").strip(), obj
    assert "a layer entry's unknown mode" in inspect.getdoc(hf.Sparse24Config)


# --- regressions of the checks above (a second review) ------------------------------------------------------

def test_betas_and_weight_decay_take_what_adamw_takes():
    """The first betas check refused a numpy array, Hydra's ListConfig (a Sequence) and 0-d tensors, and the
    weight_decay check a 0-d tensor: AdamW takes them all."""
    from collections.abc import Sequence

    class ListConfigLike(Sequence):   # what Hydra / OmegaConf hand a training script
        def __init__(self, items):
            self.items = list(items)

        def __getitem__(self, i):
            return self.items[i]

        def __len__(self):
            return len(self.items)

    for betas in (np.array([0.9, 0.999]), ListConfigLike([0.9, 0.999]), (torch.tensor(0.9), torch.tensor(0.999)),
                  [np.float32(0.5), 0.999], (0, 0.99)):
        got = learned_masks_module._check_betas(betas)
        assert got == tuple(float(b) for b in betas) and all(type(b) is float for b in got)
    assert sparse24._checks.check_nonnegative(torch.tensor(0.25), "weight_decay") == 0.25
    for bad in (torch.tensor([0.1, 0.2]), torch.tensor(True), "0.1"):
        with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
            sparse24._checks.check_nonnegative(bad, "weight_decay")


def test_decode_packed_to_none_is_a_copy_on_the_same_device():
    packed = sparse24.pack_decode(sparse24.compress(two_four_weight(16, 64).half()))
    moved = packed.to(None)
    assert moved is not packed and torch.equal(moved.to_sparse24().to_dense(), packed.to_sparse24().to_dense())


def test_compressed_nbytes_takes_int4_defaults_and_numpy_ints():
    """INT4's None defaults (128, symmetric) as compress takes them; the first check refused symmetric=None
    (before it, zero points were counted) and numpy sizes."""
    p = sparse24.compress(two_four_weight(64, 128).half(), quantize="int4")
    held = p.nbytes + p.scale_nbytes   # values + indices + scales
    assert compressed_nbytes(64, 128, 2, "int4", None, None) == held
    assert compressed_nbytes(np.int64(64), np.int64(128), np.int64(2), "int4") == held


def test_an_unreadable_shard_is_not_called_missing(tmp_path, monkeypatch):
    """safetensors says "No such file or directory" of a file it may not read; Python's open names it."""
    import sparse24._checks as checks
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")

    def denied(path, mode="r"):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(checks, "open", denied, raising=False)
    with pytest.raises(ValueError, match="cannot read .*model.safetensors: .*Permission denied"):
        checks.safetensors_headers([f])

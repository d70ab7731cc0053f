"""LoRA inits and variants on 2:4 bases, against PEFT on a dense twin and a deep copy taken before the call:
the orthogonal init (advised by sparse24's own refusal of PiSSA & co.) works on compressed bases exactly as
PEFT's on a dense base, EVA works too, and a refused variant (DoRA & co.) or base-rewriting init changes
nothing, not even the dense targets PEFT meets before the first 2:4 layer."""
import copy
import warnings

import pytest
import torch
from peft import EvaConfig, LoraConfig, get_peft_model, initialize_lora_eva_weights

import sparse24
from sparse24 import Sparse24Linear

from hf_models import tiny_llama, tokens

KINDS = {"masked": {"mode": "masked"}, "compressed": {"mode": "compressed"},
         "int8": {"mode": "compressed", "quantize": "int8"}, "int4": {"mode": "compressed", "quantize": "int4"}}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sparse_and_twin(kind, dtype=torch.float32, **sparsify_kw):
    """A 2:4 tiny llama and its dense twin: plain nn.Linear layers holding each 2:4 layer's dense weight."""
    dense = tiny_llama().to(dtype)
    sparse = copy.deepcopy(dense)
    sparse24.sparsify_(sparse, **KINDS[kind], **sparsify_kw)
    with torch.no_grad():
        for name, m in sparse.named_modules():
            if isinstance(m, Sparse24Linear):
                dense.get_submodule(name).weight.copy_(m.dense_weight())
    return sparse, dense


def adapters(model, adapter):
    """{layer name: (A, B, A.requires_grad)} of one adapter."""
    return {n: (m.lora_A[adapter].weight.detach(), m.lora_B[adapter].weight.detach(),
                m.lora_A[adapter].weight.requires_grad)
            for n, m in model.named_modules() if hasattr(m, "lora_A") and adapter in m.lora_A}


def assert_same_adapters(got, ref):
    assert got.keys() == ref.keys() and got
    for n, (a, b, grad) in got.items():
        ra, rb, rgrad = ref[n]
        assert a.dtype == ra.dtype and b.dtype == rb.dtype, n
        assert torch.equal(a, ra) and torch.equal(b, rb), n
        assert grad == rgrad, n


def snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()},
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def assert_unchanged(model, before):
    types, state = snapshot(model)
    assert types == before[0]
    assert state.keys() == before[1].keys()
    assert all(torch.equal(state[k], v) for k, v in before[1].items())


@pytest.mark.parametrize("kind,dtype", [("masked", torch.float32), ("compressed", torch.float32),
                                        ("compressed", torch.bfloat16), ("int8", torch.float32),
                                        ("int4", torch.bfloat16)])
def test_orthogonal_init_on_a_2of4_base_equals_peft_on_a_dense_twin(kind, dtype):
    """Was: AttributeError (PEFT read base.weight, absent in compressed mode) from get_peft_model."""
    sparse, dense = sparse_and_twin(kind, dtype)
    cfg = dict(r=4, target_modules=["q_proj", "up_proj", "down_proj"], init_lora_weights="orthogonal")
    torch.manual_seed(7)
    ref = get_peft_model(dense, LoraConfig(**cfg))
    torch.manual_seed(7)
    base = {k: v.clone() for k, v in sparse.state_dict().items()}
    pm = get_peft_model(sparse, LoraConfig(**cfg))
    got = adapters(pm, "default")
    assert_same_adapters(got, adapters(ref, "default"))
    assert not all(torch.equal(b, torch.zeros_like(b)) for _, b, _ in got.values())   # really the orthogonal init
    after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
             for k, v in pm.state_dict().items() if "lora_" not in k}
    assert after.keys() == base.keys() and all(torch.equal(after[k], v) for k, v in base.items())


@pytest.mark.parametrize("kind", ["compressed", "int4"])
def test_orthogonal_init_as_a_second_adapter_equals_peft_on_a_dense_twin(kind):
    """Was: AttributeError from add_adapter, with q_proj.lora_A['orth'] left behind."""
    sparse, dense = sparse_and_twin(kind)
    targets = ["q_proj", "v_proj"]
    pms = []
    for model in (dense, sparse):
        torch.manual_seed(3)
        pm = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
        pm.add_adapter("orth", LoraConfig(r=6, target_modules=targets, init_lora_weights="orthogonal"))
        pms.append(pm)
    ref, pm = pms
    assert_same_adapters(adapters(pm, "orth"), adapters(ref, "orth"))   # inactive: requires_grad False as PEFT's
    assert_same_adapters(adapters(pm, "default"), adapters(ref, "default"))
    pm.set_adapter("orth")
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_orthogonal_init_with_an_odd_rank_is_refused_before_the_layer_changes():
    sparse, _ = sparse_and_twin("compressed")
    pm = get_peft_model(sparse, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = snapshot(pm)
    with pytest.raises(ValueError, match="rank to be even, got 3"):
        pm.add_adapter("orth", LoraConfig(r=3, target_modules=["q_proj", "v_proj"], init_lora_weights="orthogonal"))
    assert_unchanged(pm, before)
    assert list(pm.peft_config) == ["default"]


@pytest.mark.parametrize("kind", ["compressed", "int4"])
def test_eva_init_on_a_2of4_base_equals_peft_on_a_dense_twin(kind):
    """'eva' is the other init the refusal advises: it reads activations, not the base weight."""
    sparse, dense = sparse_and_twin(kind)
    ids = tokens(shape=(4, 16))
    batches = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in (0, 2)] * 2
    cfg = dict(r=4, target_modules=["q_proj"], init_lora_weights="eva", eva_config=EvaConfig(rho=1.0, tau=0.9))
    got = []
    for model in (dense, sparse):
        pm = get_peft_model(model, LoraConfig(**cfg), low_cpu_mem_usage=True)   # PEFT's advice for EVA
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            initialize_lora_eva_weights(pm, batches, show_progress_bar=False)
        got.append(adapters(pm, "default"))
    ref, got = got
    assert got.keys() == ref.keys() and got
    for n, (a, b, _) in got.items():
        torch.testing.assert_close(a.abs(), ref[n][0].abs(), atol=1e-4, rtol=1e-4)   # SVD directions: up to sign
        assert torch.equal(b, torch.zeros_like(b))


def mixed_model():
    """Attention dense, MLPs 2:4: PEFT meets dense targets (layer 0's attention) before the first 2:4 one."""
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", filter_fn=lambda mod, name: ".mlp." in name)
    return model


REFUSED = {"use_dora": dict(use_dora=True), "alora_invocation_tokens": dict(alora_invocation_tokens=[5, 6])}


@pytest.mark.parametrize("targets", [ALL, "all-linear"], ids=["named", "all-linear"])
@pytest.mark.parametrize("variant", REFUSED)
def test_a_refused_variant_leaves_the_model_unchanged(variant, targets):
    """Was: PEFT's bare 'Invalid or unsupported variant combination', raised after layer 0's q/k/v/o_proj
    had been swapped for DoRA layers in the user's model."""
    model = mixed_model()
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = LoraConfig(r=4, target_modules=targets, **REFUSED[variant])
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.mlp\.gate_proj' is a 2:4.*{variant}"):
        get_peft_model(model, cfg)
    assert_unchanged(model, before)


def test_a_refused_variant_as_a_second_adapter_leaves_the_peft_model_unchanged():
    model = mixed_model()
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=ALL))
    before = snapshot(pm)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj' is a 2:4.*use_dora"):
        pm.add_adapter("dora", LoraConfig(r=4, target_modules=ALL, use_dora=True))
    assert_unchanged(pm, before)
    assert list(pm.peft_config) == ["default"]


def test_a_refused_base_rewriting_init_leaves_the_dense_targets_unchanged():
    """PiSSA on layer 0's dense attention rewrote its weights before the 2:4 MLP refused it."""
    model = mixed_model()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj'.*init_lora_weights='pissa' rewrites"):
        get_peft_model(model, LoraConfig(r=4, target_modules=ALL, init_lora_weights="pissa"))
    assert_unchanged(model, before)


def test_a_variant_on_the_dense_targets_alone_still_works():
    """The refusal is for 2:4 targets only: DoRA on the dense attention of a model with 2:4 MLPs is PEFT's."""
    model = mixed_model()
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert pm.base_model.model.model.layers[1].self_attn.q_proj.use_dora["default"]

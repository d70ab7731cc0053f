"""Review findings on model families with a checkpoint conversion mapping in transformers (ViT, Llava,
Dinov2, ...: their Hub checkpoints hold older tensor names, renamed on load and back on save), and on MoE
routers stored as nn.Linear."""
import copy

import pytest
import torch
from safetensors import safe_open
from transformers import (CLIPVisionConfig, Dinov2Config, Dinov2Model, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, MixtralConfig, MixtralForCausalLM, SwitchTransformersConfig,
                          SwitchTransformersForConditionalGeneration, ViTConfig, ViTForImageClassification)

import sparse24
from sparse24 import Sparse24Linear
from sparse24.tools.cli import main

from conftest import masked_copy

VIS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
           patch_size=8)


def tiny_vit():
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(**VIS, num_labels=40)).eval()


def tiny_llava():
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=CLIPVisionConfig(**VIS), text_config=text,
                                                     image_token_index=5)).eval()


def tiny_dinov2_swiglu():
    # the SwiGLU MLP: transformers fuses gate_proj/up_proj into one stored weights_in tensor on save
    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                                    patch_size=8, use_swiglu_ffn=True, mlp_ratio=2)).eval()


def inputs(model):
    if isinstance(model, LlavaForConditionalGeneration):
        return {"input_ids": torch.randint(8, 128, (1, 8), generator=torch.Generator().manual_seed(0))}
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


def out(model, x):
    with torch.no_grad():
        return model(**x)[0]


def stored_keys(folder):
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("build, mode", [(tiny_vit, "masked"), (tiny_llava, "compressed"),
                                         (tiny_dinov2_swiglu, "compressed")], ids=["vit", "llava", "dinov2-swiglu"])
def test_save_pretrained_of_a_mapped_family_loads_back(tmp_path, build, mode):
    """save_pretrained renamed the tensors back to the family's older checkpoint names (Dinov2-SwiGLU: fused
    gate/up into one tensor) after sparse24 had listed the in-memory names: the folder was refused ("the
    checkpoint holds 2:4 entries for ... which the sparse24 section does not list")."""
    model = build()
    dense = copy.deepcopy(model)
    x = inputs(model)
    swapped = [r.fqn for r in sparse24.sparsify_(model, mode=mode).swapped]
    model.save_pretrained(tmp_path)
    assert {f"{fqn}.values" if mode == "compressed" else f"{fqn}.mask" for fqn in swapped} <= stored_keys(tmp_path)
    again = sparse24.from_pretrained(type(model), tmp_path).eval()
    sd, sd2 = model.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert torch.equal(out(again, x), out(model, x))
    torch.testing.assert_close(out(again, x).double(), out(masked_copy(dense, swapped), x),
                               rtol=1e-4, atol=1e-4)
    again.save_pretrained(tmp_path / "again")  # loaded from the model's own names: saved in them again
    assert stored_keys(tmp_path / "again") == stored_keys(tmp_path)


def test_save_pretrained_of_an_unmapped_family_keeps_its_names(tmp_path):
    """Families without a conversion mapping (Llama) save exactly the model's state dict keys, markers added."""
    from hf_models import tiny_llama

    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    swapped = {k.rpartition(".")[0] for k in model.state_dict() if k.endswith(".values")}
    assert stored_keys(tmp_path) == set(model.state_dict()) | {f"{f}.weight" for f in swapped}
    assert not hasattr(model, "_weight_conversions")  # (transformers' own save path, untouched)


def test_prune_cli_takes_a_hub_format_vit_folder(capsys, tmp_path):
    """`prune FOLDER` compared the in-memory names with the stored (older) keys: "the checkpoint has no weight
    for layer(s) vit.layers.0.attention.k_proj.weight" for a plain dense ViT folder."""
    dense = tiny_vit()
    dense.save_pretrained(tmp_path / "dense")
    assert "vit.encoder.layer.0.attention.attention.query.weight" in stored_keys(tmp_path / "dense")
    rc = main(["prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse")])
    _, err = capsys.readouterr()
    assert rc == 0, err
    keys = stored_keys(tmp_path / "sparse")
    assert "vit.layers.0.attention.q_proj.values" in keys and "vit.embeddings.cls_token" in keys
    assert not any("encoder.layer." in k for k in keys)  # written in the model's own names throughout
    got = sparse24.from_pretrained(ViTForImageClassification, tmp_path / "sparse").eval()
    ref = copy.deepcopy(dense)
    swapped = [r.fqn for r in sparse24.sparsify_(ref, mode="compressed").swapped]
    assert swapped == [fqn for fqn, m in got.named_modules() if isinstance(m, Sparse24Linear)]
    x = inputs(dense)
    assert torch.equal(out(got, x), out(ref, x))
    torch.testing.assert_close(out(got, x).double(), out(masked_copy(dense, swapped), x), rtol=1e-4, atol=1e-4)


def test_prune_cli_refuses_a_fused_stored_layer(capsys, tmp_path):
    """Dinov2-SwiGLU stores gate/up fused (mlp.weights_in): a layer to prune that transformers builds by
    splitting a stored tensor is refused in one line naming the family and the Python route."""
    tiny_dinov2_swiglu().save_pretrained(tmp_path / "dense")
    capsys.readouterr()  # (transformers' save bar)
    rc = main(["prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse")])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "Dinov2Model" in lines[0] and "weights_in" in lines[0] and "save_pretrained" in lines[0], lines[0]
    assert not (tmp_path / "sparse").exists()


def tiny_switch():
    torch.manual_seed(0)
    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=128, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_experts=32, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)).eval()


def test_moe_routers_stored_as_linear_stay_dense():
    """A router (hidden -> experts nn.Linear) was pruned, sending most tokens to other experts; routers that are
    custom modules (Mixtral) were left dense."""
    model = tiny_switch()
    routers = [fqn for fqn, _ in model.named_modules() if fqn.endswith("router.classifier")]
    assert len(routers) == 2
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    before = [model.get_submodule(f)(h).argmax(-1) for f in routers]
    report = sparse24.sparsify_(model)
    kept = {r.fqn: r.reason for r in report.skipped}
    for fqn in routers:
        assert isinstance(model.get_submodule(fqn), torch.nn.Linear)
        assert kept[fqn].startswith("MoE router"), kept[fqn]
    assert all(torch.equal(b, model.get_submodule(f)(h).argmax(-1)) for b, f in zip(before, routers))
    assert any(".mlp.experts." in r.fqn for r in report.swapped)  # the experts themselves are pruned
    # explicitly asked for: sparsify_ of the router's parent module (no model config there) prunes it
    parent = model.get_submodule(routers[0].rpartition(".")[0])
    assert [r.fqn for r in sparse24.sparsify_(parent).swapped] == ["classifier"]


def test_layers_as_wide_as_the_experts_count_only_in_moe_models():
    """Mixtral's routers are custom modules (no change); a dense model's Linear layers are never taken for
    routers; the rule reads the experts count from the config only."""
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=32))
    report = sparse24.sparsify_(mixtral)
    assert not any(r.reason.startswith("MoE router") for r in report.skipped)
    assert mixtral.config.num_local_experts == 32 and mixtral.model.layers[0].self_attn.k_proj.out_features == 32
    assert "model.layers.0.self_attn.k_proj" in [r.fqn for r in report.swapped]  # as wide by chance: pruned
    from hf_models import tiny_llama
    llama = tiny_llama()
    llama.config.num_experts = None  # (present but unset in some configs)
    report = sparse24.sparsify_(llama)
    assert len(report.swapped) == 14 and not any(r.reason.startswith("MoE router") for r in report.skipped)


def test_recipes_leave_moe_routers_dense_as_sparsify_does():
    """GradualPruner and SR-STE select layers by sparsify_'s rules: a router stored as a Linear was still
    theirs to prune after sparsify_ had learned to keep it."""
    from sparse24.recipes import SRSTE, GradualPruner

    for make in (lambda m: GradualPruner(m, end_step=10, frequency=1), lambda m: SRSTE(m)):
        model = tiny_switch()
        recipe = make(model)
        names = set(recipe.masks) if hasattr(recipe, "masks") else {f for f, _ in recipe.layers}
        routers = {fqn for fqn, _ in model.named_modules() if fqn.endswith("router.classifier")}
        assert routers and not (routers & names) and any(".mlp.experts." in n for n in names), sorted(names)[:4]


def test_a_gate_proj_as_wide_as_the_experts_count_is_no_router():
    """Qwen3-Next's shared expert has a gate_proj of 512 outputs beside 512 experts (its real config): a
    substring match of 'gate' kept it dense as a router, found by review. Routers are whole names."""
    import transformers

    cfg = transformers.Qwen3NextConfig(num_hidden_layers=1, vocab_size=256)   # real widths, on the meta device
    assert cfg.num_experts == cfg.shared_expert_intermediate_size
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(cfg)
    report = sparse24.sparsify_(model, mode="compressed")
    assert not [r.fqn for r in report.skipped if r.reason.startswith("MoE router")]
    assert "model.layers.0.mlp.shared_expert.gate_proj" in [r.fqn for r in report.swapped]


def test_a_folder_stored_under_the_hub_names_by_an_earlier_sparse24_says_so(tmp_path):
    """sparse24 before 2026-12-05 saved a ViT's 2:4 tensors under the family's Hub names and listed them under
    the model's: the refusal named neither cause nor version."""
    from safetensors.torch import load_file, save_file

    model = tiny_vit()
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    old = "vit.encoder.layer.0.attention.attention.key."
    sd = {k.replace("vit.layers.0.attention.k_proj.", old): v for k, v in load_file(path).items()}
    assert f"{old}values" in sd
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"entries for 'vit\.encoder\.layer\.0\.attention\.attention\.key'.*"
                                         r"before 2026-12-05.*sparsify the dense model again"):
        sparse24.from_pretrained(type(model), tmp_path)

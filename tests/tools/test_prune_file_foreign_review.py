"""``prune FILE`` of checkpoints made by other tools (review "foreign" and "trust", round 8): an MoE state
dict keeps its routers dense (as ``sparsify_`` does) and loads into the printed call; float8 weights
(quantized elsewhere) are listed with their reason; a ``torch.nn.utils.prune`` state dict is refused naming
its ``weight_orig`` / ``weight_mask`` pairs; tied names whose safetensors copies would dwarf the input are
refused. References are plain torch: float64 weights masked here (top-2 |w| of 4)."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

import sparse24
from sparse24.tools.cli import main
from sparse24.tools.prune import prune_state_dict

safetensors_torch = pytest.importorskip("safetensors.torch")


def mask24(w: torch.Tensor) -> torch.Tensor:
    """The magnitude 2:4 mask, in plain torch: the two largest |w| of each group of 4 along a row."""
    g = w.detach().double().abs().reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(2, dim=-1).indices, True)
    return keep.reshape(w.shape)


def _prune(capsys, src, out, *extra) -> tuple[str, str]:
    """Run ``prune`` (exit 0); its output and the printed ``sparsify_`` call."""
    assert main(["prune", str(src), "--out", str(out), "--no-progress", *extra]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "load it with:" in ln)
    return text, line.split("load it with: ")[1].split("; model.load_state_dict")[0]


def test_an_moe_state_dict_keeps_its_routers_dense_and_loads_into_the_printed_call(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=40, num_experts_per_tok=2)
    torch.manual_seed(0)
    dense = transformers.Qwen2MoeForCausalLM(cfg).eval()
    safetensors_torch.save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, tmp_path / "moe.safetensors")
    text, call = _prune(capsys, tmp_path / "moe.safetensors", tmp_path / "moe-2of4.safetensors")
    sd = safetensors_torch.load_file(tmp_path / "moe-2of4.safetensors")
    for i in range(2):   # the routers (40 experts x 64) are stored as they were, and the report says why
        router = f"model.layers.{i}.mlp.gate"
        assert torch.equal(sd[router + ".weight"], dense.state_dict()[router + ".weight"])
        assert not any(k.startswith(router + ".") and k != router + ".weight" for k in sd)
        assert any(router + ".weight" in ln and "MoE router" in ln for ln in text.splitlines())
    torch.manual_seed(1)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    eval(call, {"sparse24": sparse24, "model": model})
    model.load_state_dict(sd)   # strict: the printed call takes the file
    pruned = [k[:-len(".meta")] for k in sd if k.endswith(".meta")]
    assert len(pruned) == 2 * 7   # q, k, v, o and the shared expert's gate/up/down projections
    ref = copy.deepcopy(dense).double()
    ref.set_experts_implementation("eager")   # (torch's grouped matmul takes no float64)
    with torch.no_grad():
        for fqn in pruned:
            w = ref.get_submodule(fqn).weight
            w.mul_(mask24(w))
        ids = torch.randint(0, 96, (2, 9))
        y, y_ref = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-4)


def test_a_gate_layer_without_experts_is_pruned_as_any_layer():
    # a dense model's `gate` Linear (D-FINE's gating layer): no experts, no router
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    new, report = prune_state_dict({"decoder.gate.weight": w, "decoder.fc.weight": torch.randn(64, 64)})
    assert [r["action"] for r in report] == ["compressed", "compressed"]
    assert "decoder.gate.values" in new


def test_float8_weights_are_listed_with_their_reason_and_kept_as_stored(tmp_path, capsys):
    torch.manual_seed(0)
    sd = {}
    for n in ("q_proj", "o_proj"):
        sd[f"layers.0.attn.{n}.weight"] = (torch.randn(128, 128) * 20).to(torch.float8_e4m3fn)
        sd[f"layers.0.attn.{n}.weight_scale_inv"] = torch.full((1, 1), 0.001)
    up = torch.randn(128, 64).bfloat16()
    sd["layers.0.mlp.up_proj.weight"] = up
    safetensors_torch.save_file(sd, tmp_path / "fp8.safetensors")
    text, _ = _prune(capsys, tmp_path / "fp8.safetensors", tmp_path / "out.safetensors")
    for n in ("q_proj", "o_proj"):
        line = next(ln for ln in text.splitlines() if f"layers.0.attn.{n}.weight " in ln)
        assert "kept dense (stored as float8_e4m3fn" in line and f"layers.0.attn.{n}.weight_scale_inv" in line
    assert "1 of the checkpoint's 3 2-D float weight tensors pruned" in text
    out = safetensors_torch.load_file(tmp_path / "out.safetensors")
    for n in ("q_proj", "o_proj"):   # bit for bit
        assert torch.equal(out[f"layers.0.attn.{n}.weight"].view(torch.uint8), sd[f"layers.0.attn.{n}.weight"].view(torch.uint8))
    m = mask24(up)
    kept = (up.double().abs() * m).sum() / up.double().abs().sum()
    line = next(ln for ln in text.splitlines() if "layers.0.mlp.up_proj.weight " in ln)
    assert f"{100 * kept.item():.1f}%" in line and "compressed" in line


def test_a_file_of_float8_weights_only_says_so_in_its_refusal(tmp_path, capsys):
    sd = {"gate.weight": torch.randn(40, 64).bfloat16(), "experts.0.w1.weight": torch.randn(64, 64).to(torch.float8_e4m3fn),
          "experts.0.w1.weight_scale_inv": torch.ones(1, 1)}
    safetensors_torch.save_file(sd, tmp_path / "fp8.safetensors")
    assert main(["prune", str(tmp_path / "fp8.safetensors"), "--out", str(tmp_path / "o.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "2 2-D float weight(s), none eligible" in err
    assert "experts.0.w1.weight: stored as float8_e4m3fn" in err and "gate.weight: MoE router" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_torch_nn_utils_prune_state_dict_is_refused_naming_its_pairs(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    for i in (0, 2):
        torch_prune.custom_from_mask(model[i], "weight", mask24(model[i].weight))
    torch.save(model.state_dict(), tmp_path / "tp.pt")
    assert main(["prune", str(tmp_path / "tp.pt"), "--out", str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert "0.weight_orig + 0.weight_mask" in err and "2.weight_orig + 2.weight_mask" in err
    assert "torch.nn.utils.prune.remove(module, 'weight')" in err
    assert not (tmp_path / "o.pt").exists()
    with pytest.raises(ValueError, match="saved with torch.nn.utils.prune"):
        prune_state_dict(model.state_dict())


def test_tied_names_whose_safetensors_copies_dwarf_the_input_are_refused(tmp_path, capsys):
    torch.manual_seed(0)
    t = torch.randn(256, 64)
    sd = {f"layers.{i}.proj.weight": t for i in range(40)}
    sd["fc.weight"] = torch.randn(64, 64)
    torch.save(sd, tmp_path / "tied.pt")
    size = (tmp_path / "tied.pt").stat().st_size
    assert main(["prune", str(tmp_path / "tied.pt"), "--out", str(tmp_path / "o.safetensors"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "40 names share the memory of 1 tensor(s)" in err and "write a .pt file" in err
    assert not (tmp_path / "o.safetensors").exists()
    # a .pt keeps one copy: no larger than the input, the tie kept, the untied layer pruned
    text, _ = _prune(capsys, tmp_path / "tied.pt", tmp_path / "o.pt")
    assert (tmp_path / "o.pt").stat().st_size <= size
    out = torch.load(tmp_path / "o.pt")
    assert out["layers.0.proj.weight"].untyped_storage().data_ptr() == out["layers.39.proj.weight"].untyped_storage().data_ptr()
    assert torch.equal(out["layers.7.proj.weight"], t) and "fc.values" in out
    assert "and 36 more (tied weights)" in text   # the reason names 3 of the 39 others


def test_an_embedding_tied_under_a_few_names_is_written_to_safetensors(tmp_path, capsys):
    """T5 v1.0 ties its embedding under 4 names (the copies 1.6x its file): the first copy limit (the input's
    size) refused such ordinary files; only a blow-up (over 8x) is refused."""
    torch.manual_seed(0)
    emb = torch.randn(512, 64)
    sd = {n: emb for n in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                           "lm_head.weight")}
    sd["encoder.block.0.fc.weight"] = torch.randn(64, 64)
    torch.save(sd, tmp_path / "t5.pt")
    _prune(capsys, tmp_path / "t5.pt", tmp_path / "o.safetensors")
    out = safetensors_torch.load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(out[n], emb) for n in ("shared.weight", "encoder.embed_tokens.weight",
                                                 "decoder.embed_tokens.weight", "lm_head.weight"))
    assert "encoder.block.0.fc.values" in out

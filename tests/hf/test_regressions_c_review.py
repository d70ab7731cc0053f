"""Regressions of the sixth round's fixes, found by reviewing them: the resize guard against a class's own
resize_token_embeddings and a LoRA-wrapped head, the config copy of nested sub-configs, the report's
parametrizations lookup, DecodePacked.slots(rows) in the reference backward."""
import copy

import pytest
import torch
from torch import nn

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import naive

T = pytest.importorskip("transformers")


def test_resize_refused_before_a_class_override_changes_anything():
    # MobileBERT's own resize_token_embeddings resizes cls.predictions.dense, then calls super(): a guard on
    # PreTrainedModel alone refused after that, leaving a model whose forward failed
    cfg = T.MobileBertConfig(vocab_size=64, hidden_size=64, embedding_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2, intra_bottleneck_size=32, true_hidden_size=32,
                             tie_word_embeddings=False, num_feedforward_networks=1)
    torch.manual_seed(0)
    model = T.MobileBertForMaskedLM(cfg).eval()
    sparse24.sparsify_(model, filter_fn=lambda m, fqn: fqn == "cls.predictions.decoder", skip_output_head=False,
                       min_features=0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match="cls.predictions.decoder is a 2:4 layer"):
        model.resize_token_embeddings(80)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_resize_refused_with_a_lora_wrapped_24_head():
    peft = pytest.importorskip("peft")
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg)
    sparse24.sparsify_(model, skip_output_head=False, min_features=0)
    pm = peft.get_peft_model(model, peft.LoraConfig(target_modules=["lm_head", "q_proj"], r=4))
    with pytest.raises(TypeError, match="lm_head is a 2:4 layer"):
        pm.resize_token_embeddings(80)
    assert model.get_input_embeddings().num_embeddings == 64 and model.config.vocab_size == 64
    assert pm.resize_token_embeddings(64) is model.get_input_embeddings()   # (its size kept: passes)


def test_own_config_keeps_nested_sub_configs_attached():
    # a model's modules hold its sub-configs at every depth (Qwen2.5-Omni's thinker_config.text_config): the
    # copy made when the sparse24 section is written must reach them all, or they keep the shared originals
    tc = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, rope_scaling={"type": "default", "mrope_section": [2, 2, 4], "rope_type": "default"})
    cfg = T.Qwen2_5OmniConfig(thinker_config=dict(
        text_config=tc, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                                           fullatt_block_indexes=[0]),
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32)),
        enable_audio_output=False)
    torch.manual_seed(0)
    student = T.Qwen2_5OmniForConditionalGeneration(cfg)
    sparse24.sparsify_(student, min_features=0)
    assert student.config is not cfg

    def configs(c, out):
        out.add(id(c))
        for v in vars(c).values():
            if isinstance(v, T.PretrainedConfig) and id(v) not in out:
                configs(v, out)
        return out

    mine, shared = configs(student.config, set()), configs(cfg, set())
    held = {id(v) for m in student.modules() for v in vars(m).values() if isinstance(v, T.PretrainedConfig)}
    assert held <= mine and not held & shared


def test_report_survives_a_module_attribute_named_parametrizations():
    class Adapter(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Parameter(torch.randn(8, 8))
            self.parametrizations = "none"   # a user's attribute, not torch's ModuleDict

        def forward(self, x):
            return x @ self.proj

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Adapter())
    report = sparse24.sparsify_(model, skip_output_head=False, min_features=0)
    assert any(r.fqn == "3" and r.reason.startswith("not handled: Adapter") for r in report.skipped)


def test_reference_backward_takes_a_decode_layout_weight():
    torch.manual_seed(0)
    w = torch.randn(256, 64, dtype=torch.float16)
    p = sparse24.compress(w)
    x, gy = torch.randn(3, 64, dtype=torch.float16), torch.randn(3, 256, dtype=torch.float16)
    want = naive.linear_backward_reference(gy, x, p, False, True, False)[1]
    assert torch.equal(naive.linear_backward_reference(gy, x, pack_decode(p), False, True, False)[1], want)
    assert torch.equal(pack_decode(p).slots(slice(10, 20)), p.slots(slice(10, 20)))


@pytest.mark.filterwarnings("error::torch.jit.TracerWarning")
def test_jit_trace_names_a_wrong_input_width_without_tracer_warnings():
    from sparse24 import Sparse24Linear
    layer = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed").eval()
    with torch.no_grad():
        torch.jit.trace(layer, torch.randn(3, 64))
        with pytest.raises(ValueError, match="x has 48 features but the weight expects 64"):
            torch.jit.trace(layer, torch.randn(2, 48))

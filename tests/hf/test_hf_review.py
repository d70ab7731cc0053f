"""Review findings on loading Hugging Face folders: a 2:4 layer's missing bias, ALBERT / Funnel layer counts,
a stale shard index, ignore_mismatched_sizes, an INT4 section that contradicts its stored entries, a section
key naming a method."""
import copy
import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AlbertConfig, AlbertModel, AutoConfig, BertConfig, BertForSequenceClassification, BertModel,
                          FunnelConfig, FunnelModel, LlamaConfig, LlamaForCausalLM)

import sparse24
from sparse24.hf import check_blocks
from sparse24.tools.hf_folder import prune_folder

from conftest import EPS, UNDERFLOW
from hf_models import VOCAB, masked_reference, tiny_llama, tokens


def tiny_bert(cls=BertModel, **kw):
    torch.manual_seed(0)
    return cls(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, **kw)).eval()


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_a_24_layer_whose_bias_the_checkpoint_lacks_is_refused(tmp_path, mode):
    """The bias was left out of the "lacks" check, and transformers' init never reaches a Sparse24Linear:
    the layer loaded uninitialized memory (or was refused as non-finite)."""
    model = tiny_bert()
    sparse24.sparsify_(model, mode=mode)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["encoder.layer.0.output.dense.bias"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lacks encoder\.layer\.0\.output\.dense\.bias for the 2:4 {mode} layer"):
        sparse24.from_pretrained(BertModel, tmp_path)


@pytest.mark.parametrize("cls, config", [
    (AlbertModel, AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=4,
                               num_attention_heads=4, intermediate_size=128)),
    (FunnelModel, FunnelConfig(vocab_size=VOCAB, block_sizes=[2, 2], d_model=64, n_head=4, d_head=16, d_inner=128)),
], ids=["albert", "funnel"])
def test_albert_and_funnel_folders_load_and_prune(tmp_path, cls, config):
    """ALBERT runs one shared layer group num_hidden_layers times and Funnel's num_hidden_layers is
    sum(block_sizes): both hold fewer numbered layers than num_hidden_layers, and were refused."""
    torch.manual_seed(0)
    dense = cls(config).eval()
    dense.save_pretrained(tmp_path / "dense")
    assert same_state(sparse24.from_pretrained(cls, tmp_path / "dense"), dense)
    sparse = copy.deepcopy(dense)
    sparse24.sparsify_(sparse, mode="compressed")
    sparse.save_pretrained(tmp_path / "sparse")
    assert same_state(sparse24.from_pretrained(cls, tmp_path / "sparse"), sparse)
    prune_folder(tmp_path / "dense", tmp_path / "pruned")
    assert same_state(sparse24.from_pretrained(cls, tmp_path / "pruned"), sparse)


def test_absurd_layer_counts_are_still_refused():
    """The guard bounds the meta build: within max(4x, +256) of the checkpoint's layers passes."""
    config = LlamaConfig(num_hidden_layers=2)
    headers = {f"model.layers.{i}.mlp.up_proj.weight": ("F32", (8, 8), "model.safetensors") for i in range(2)}
    check_blocks(config, headers, "f")
    config.num_hidden_layers = 258
    check_blocks(config, headers, "f")
    config.num_hidden_layers = 259
    with pytest.raises(ValueError, match=r"f/config\.json: num_hidden_layers=259, but the checkpoint holds 2 "
                                         r"\(model\.layers\.0 to model\.layers\.1\)"):
        check_blocks(config, headers, "f")


def test_a_stale_shard_index_beside_model_safetensors_is_ignored(tmp_path):
    """save_pretrained sharded, then unsharded into the same folder, leaves the old index: transformers
    reads model.safetensors, sparse24 read the index (and its deleted shards)."""
    ids = tokens()
    first = tiny_llama()
    sparse24.sparsify_(first, mode="compressed")
    first.save_pretrained(tmp_path / "sparse", max_shard_size="30KB")
    model = tiny_llama(1)
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path / "sparse")
    assert (tmp_path / "sparse" / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "sparse"), ids), logits(model, ids))

    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="30KB")
    tiny_llama(1).save_pretrained(tmp_path / "dense")
    prune_folder(tmp_path / "dense", tmp_path / "pruned")
    assert not (tmp_path / "pruned" / "model.safetensors.index.json").exists()
    assert torch.equal(logits(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "pruned"), ids), logits(model, ids))


def test_ignore_mismatched_sizes_for_a_new_head(tmp_path):
    """transformers' fine-tuning call (a new head through config=, ignore_mismatched_sizes=True) was refused
    on the classifier's shape; a mismatched 2:4 layer and an oversized mismatch stay refused."""
    model = tiny_bert(BertForSequenceClassification)
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    new = AutoConfig.from_pretrained(tmp_path, num_labels=5)
    with pytest.raises(ValueError, match=r"describes 'classifier\.weight' as \(5, 64\), but .* holds"):
        sparse24.from_pretrained(BertForSequenceClassification, tmp_path, config=new)
    loaded = sparse24.from_pretrained(BertForSequenceClassification, tmp_path, config=new, ignore_mismatched_sizes=True)
    assert loaded.classifier.weight.shape == (5, 64)
    saved, back = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(saved[k], back[k]) for k in saved if not k.startswith("classifier."))

    wider = AutoConfig.from_pretrained(tmp_path, intermediate_size=256)  # every 2:4 layer of the MLPs changes shape
    with pytest.raises(ValueError, match=r"'bert\.encoder\.layer\.0\.intermediate\.dense\.values' has shape"):
        sparse24.from_pretrained(BertForSequenceClassification, tmp_path, config=wider, ignore_mismatched_sizes=True)
    huge = AutoConfig.from_pretrained(tmp_path, vocab_size=2 ** 19)  # counted as lacking: past the element bound
    with pytest.raises(ValueError, match=r"elements the checkpoint does not hold"):
        sparse24.from_pretrained(BertForSequenceClassification, tmp_path, config=huge, ignore_mismatched_sizes=True)


def test_an_int4_layer_listed_symmetric_whose_zero_points_are_stored_is_refused(tmp_path):
    """transformers dropped the stored zero points as UNEXPECTED: the logits were silently wrong."""
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=32, symmetric=False)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for entry in cfg["quantization_config"]["layers"].values():
        entry["symmetric"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors: 'model\.layers\.0\.\w+\.\w+_proj\.zero' is stored, but "
                                         r"the 2:4 compressed INT4 layer .* has no such entry.*'symmetric'"):
        sparse24.from_pretrained(LlamaForCausalLM, tmp_path)


@pytest.mark.parametrize("key", ["to_dict", "_private"])
def test_a_section_key_naming_a_method_or_private_field_is_refused(tmp_path, key):
    """setattr of every extra section field replaced Sparse24Config.to_dict with an int: transformers then
    failed with "'int' object is not callable", naming neither the file nor the field."""
    model = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"][key] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config\.json: sparse24 section: field '{key}'"):
        sparse24.from_pretrained(LlamaForCausalLM, tmp_path)


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_a_device_map_offloading_24_layers_to_disk_is_refused_before_loading(tmp_path, mode):
    """device_map="auto" with max_memory leaving no room: accelerate sends layers to disk, whose
    tensors stay on meta; the checks then failed with a bare meta-tensor error (masked) or called the
    file corrupt (compressed), after the whole load. Refused up front, naming the layers; with room
    (the whole model on the CPU) the same call loads the same logits."""
    from transformers import LlamaForCausalLM
    model = tiny_llama()
    sparse24.sparsify_(model, mode=mode)
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"device_map sends 2:4 layer\(s\) model\.layers\..* to disk"):
        sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "m", device_map="auto", max_memory={"cpu": "40KB"},
                                 offload_folder=str(tmp_path / "offload"))
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "m", device_map="auto").eval()
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def llama_lm(tie=False, seed=0):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kw", [{}, {"mode": "compressed"}, {"mode": "compressed", "quantize": "int8"}],
                         ids=["masked", "compressed", "int8"])
def test_resize_token_embeddings_with_a_24_head_is_refused_before_anything_changes(tmp_path, kw):
    """transformers resized the input embedding, then failed on the 2:4 head (no nn.Linear): embedding 100
    rows, head and config.vocab_size 96, and the folder it saved no longer loaded. Refused up front; the
    refusal survives deepcopy and save/load, and its advice (dense head, resize, prune again) works."""
    model = llama_lm()
    sparse24.sparsify_(model, skip_output_head=False, **kw)
    before = copy.deepcopy(model)
    for m in (model, before):
        with pytest.raises(TypeError, match=r"lm_head is a 2:4 layer.*to_dense_module\(\).*sparsify_"):
            m.resize_token_embeddings(100)
    assert same_state(model, before) and model.config.vocab_size == VOCAB
    assert model.get_input_embeddings().num_embeddings == VOCAB
    model.save_pretrained(tmp_path / "m")
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "m")
    with pytest.raises(TypeError, match=r"lm_head is a 2:4 layer"):
        loaded.resize_token_embeddings(100)
    assert same_state(loaded, before)
    # the advice: a dense head, resize, prune again
    model.set_output_embeddings(model.get_output_embeddings().to_dense_module())
    model.resize_token_embeddings(100)
    sparse24.sparsify_(model, skip_output_head=False, **kw)
    assert isinstance(model.lm_head, sparse24.Sparse24Linear) and model.lm_head.out_features == 100
    model.save_pretrained(tmp_path / "r")
    ids = tokens()
    assert torch.equal(logits(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "r"), ids), logits(model, ids))


@pytest.mark.parametrize("kw", [{}, {"mode": "compressed"}], ids=["masked", "compressed"])
def test_resize_token_embeddings_keeping_a_24_heads_size_passes(kw):
    """Fine-tuning scripts call resize_token_embeddings(len(tokenizer)) unconditionally: a call that keeps the
    size (or names none, or pads to it) changes nothing and returns the input embedding, also on a shallow
    copy (the guard sits on transformers' class, not on one model)."""
    model = llama_lm()
    sparse24.sparsify_(model, skip_output_head=False, **kw)
    before = copy.deepcopy(model)
    for m in (model, copy.copy(model)):
        for args in ((VOCAB,), (), (None,), (VOCAB - 10, VOCAB // 2)):
            assert m.resize_token_embeddings(*args) is m.get_input_embeddings()
    assert same_state(model, before) and model.config.vocab_size == VOCAB
    with pytest.raises(TypeError, match=r"lm_head is a 2:4 layer"):
        model.resize_token_embeddings(VOCAB - 10, 64)   # (padded to 128)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_with_a_dense_head_still_resizes(tie):
    """The guard sits on every 2:4 transformers model: a dense head (tied or not) resizes as before, and the
    old tokens' logits stay those of the model before the resize."""
    model = llama_lm(tie)
    assert model.config.tie_word_embeddings is tie
    sparse24.sparsify_(model, mode="compressed")
    assert not isinstance(model.lm_head, sparse24.Sparse24Linear)
    resized = copy.deepcopy(model)
    resized.resize_token_embeddings(100)
    assert resized.get_input_embeddings().num_embeddings == resized.lm_head.out_features == 100
    assert resized.config.vocab_size == 100 and model.config.vocab_size == model.lm_head.out_features == VOCAB
    assert (resized.lm_head.weight is resized.get_input_embeddings().weight) is tie
    ids = tokens()
    assert torch.equal(logits(resized, ids)[..., :VOCAB], logits(model, ids))
    gc.disable()  # no reference cycle: `del` frees the model (GPU memory) at once
    try:
        gone = weakref.ref(resized)
        del resized
        assert gone() is None
    finally:
        gc.enable()


INT4 = {"group_size": 32}  # (K = 64 and 160: groups of 128 would not divide them)


@pytest.mark.parametrize("mode, quantize", [("masked", None), ("compressed", None), ("compressed", "int8"),
                                           ("compressed", "int4")], ids=["masked", "16-bit", "int8", "int4"])
def test_half_and_float_of_a_loaded_24_model(tmp_path, mode, quantize):
    """transformers' loader marks a model it quantized (model.is_quantized) and then refuses .half() / .float():
    a loaded 2:4 model refused them, while the same model in memory casts right. Loaded, it casts as the
    in-memory one does (bit for bit), matches the float64 reference, and still saves its sparse24 section."""
    dense = tiny_llama()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode=mode, quantize=quantize, **(INT4 if quantize == "int4" else {}))
    model.save_pretrained(tmp_path / "m")
    loaded = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "m")
    loaded.save_pretrained(tmp_path / "again")  # the section, and the tensors, as they were
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == \
        json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert same_state(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "again"), model)
    ids = tokens()
    ref = logits(masked_reference(dense, model), ids)
    for m in (loaded, model):
        m.float()
    got = logits(loaded, ids)
    assert got.dtype == torch.float32 and torch.equal(got, logits(model, ids))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for m in (loaded, model):
        m.half()
    got = logits(loaded, ids)
    assert got.dtype == torch.float16 and torch.equal(got, logits(model, ids))
    # fp16 whole-model logits: measured worst |error| 4.6e-4 (|logits| <= 0.57); the unpruned model is 0.22 away
    torch.testing.assert_close(got.double(), ref, rtol=2 * EPS[torch.float16], atol=4 * EPS[torch.float16])
    for m in (loaded, model):
        m.float()  # back: as the model in memory (fp16-rounded float weights)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize("quantize", [None, "int8", "int4"], ids=["16-bit", "int8", "int4"])
def test_dequantize_honours_an_explicit_dtype(tmp_path, quantize):
    """model.dequantize(dtype=torch.float16) gave float32 layers without a word. Without a dtype the layers
    keep theirs (transformers fills in config.dtype: float32 for a loaded model, which .half() leaves)."""
    dense = tiny_llama()
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed", quantize=quantize, **(INT4 if quantize == "int4" else {}))
    ref = masked_reference(dense, model)
    layers = [fqn for fqn, m in model.named_modules() if isinstance(m, sparse24.Sparse24Linear)]
    model.save_pretrained(tmp_path)
    twin = sparse24.from_pretrained(LlamaForCausalLM, tmp_path).half()
    assert twin.config.dtype == torch.float32  # stale
    model.dequantize(dtype=torch.float16)
    twin.dequantize()
    for fqn in layers:
        for m in (model, twin):
            w = m.get_submodule(fqn).weight
            assert type(m.get_submodule(fqn)) is torch.nn.Linear and w.dtype == torch.float16, fqn
            # one rounding to fp16 of the fp64 value (two for INT8 / INT4: values * scale in fp32 first)
            torch.testing.assert_close(w.double(), ref.get_submodule(fqn).weight, rtol=2 * EPS[torch.float16],
                                       atol=UNDERFLOW[torch.float16])
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")


def test_a_model_sharing_its_config_object_stays_dense_on_disk(tmp_path):
    """Two models built from one config object (a teacher and a student) share it: sparsify_ of one wrote its
    sparse24 section into the other's config too, which then saved a dense folder that did not load."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    sparse24.sparsify_(student, mode="compressed")
    assert getattr(teacher.config, "quantization_config", None) is None
    assert all(m.config is student.config for m in student.modules() if "config" in vars(m))
    teacher.save_pretrained(tmp_path / "t")
    student.save_pretrained(tmp_path / "s")
    ids = tokens()
    assert torch.equal(logits(LlamaForCausalLM.from_pretrained(tmp_path / "t"), ids), logits(teacher, ids))
    assert torch.equal(logits(sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "s"), ids), logits(student, ids))

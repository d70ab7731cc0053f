"""Review findings on loading Hugging Face folders: a 2:4 layer's missing bias, ALBERT / Funnel layer counts,
a stale shard index, ignore_mismatched_sizes, an INT4 section that contradicts its stored entries, a section
key naming a method."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AlbertConfig, AlbertModel, AutoConfig, BertConfig, BertForSequenceClassification, BertModel,
                          FunnelConfig, FunnelModel, LlamaConfig, LlamaForCausalLM)

import sparse24
from sparse24.hf import check_blocks
from sparse24.tools.hf_folder import prune_folder

from hf_models import VOCAB, tiny_llama, tokens


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

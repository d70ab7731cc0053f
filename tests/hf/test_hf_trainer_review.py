"""Review findings on Trainer workflows: a pruned MLM head in a folder loaded as a task model, and
a sharded checkpoint resumed shard by shard (``load_sharded_checkpoint``: one non-strict
``load_state_dict`` per shard)."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, Trainer,
                          TrainerState, TrainingArguments)
from transformers.trainer_utils import load_sharded_checkpoint

import sparse24
from sparse24 import Sparse24Linear
from sparse24.hf import register

from hf_models import VOCAB, tiny_llama, tokens

HEAD = "cls.predictions.transform.dense"


def tiny_bert(cls=BertModel, seed=0):
    torch.manual_seed(seed)
    return cls(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128)).eval()


def layers_24(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


# --- a task model from a folder whose 2:4 section lists a head it lacks ----------------------

@pytest.fixture(params=["masked", "compressed"])
def mlm_folder(request, tmp_path):
    mlm = tiny_bert(BertForMaskedLM)
    sparse24.sparsify_(mlm, mode=request.param)
    assert isinstance(mlm.get_submodule(HEAD), Sparse24Linear)
    mlm.save_pretrained(tmp_path)
    return mlm, tmp_path


@pytest.mark.parametrize("cls, prefix", [(BertForSequenceClassification, "bert."), (BertModel, "")])
@pytest.mark.parametrize("loader", ["sparse24", "transformers"])
def test_a_task_model_loads_an_mlm_folder_dropping_the_pruned_head(mlm_folder, cls, prefix, loader):
    """The section lists the MLM head's 2:4 layer; a model without that head refused the folder
    ("... does not have"), where transformers drops an unused head's entries."""
    mlm, folder = mlm_folder
    register()
    with pytest.warns(UserWarning, match=rf"'{HEAD}'.*{cls.__name__}"):
        model = sparse24.from_pretrained(cls, folder) if loader == "sparse24" else cls.from_pretrained(folder)
    saved = {n: m for n, m in layers_24(mlm).items() if not n.startswith("cls.")}
    loaded = layers_24(model)
    assert sorted(loaded) == sorted(prefix + n[len("bert."):] for n in saved)
    for name, layer in saved.items():
        got = loaded[prefix + name[len("bert."):]]
        assert got.mode == layer.mode
        assert same_state(got, layer), name  # the saved entries, bit for bit
    assert not any(n.startswith("cls.") for n in model.config.quantization_config.layers)
    ids = tokens()
    with torch.no_grad():
        base = model if prefix == "" else model.bert
        assert torch.equal(base(ids).last_hidden_state, mlm.bert(ids).last_hidden_state)


@pytest.mark.parametrize("missing", ["bert.encoder.layer.5.output.dense", "encoder.layer.5.output.dense"])
@pytest.mark.parametrize("cls", [BertForSequenceClassification, BertModel])
def test_a_listed_layer_under_the_base_model_that_does_not_exist_is_still_refused(mlm_folder, cls, missing):
    _, folder = mlm_folder
    config = json.loads((folder / "config.json").read_text())
    layers = config["quantization_config"]["layers"]
    layers[missing] = layers["bert.encoder.layer.0.output.dense"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"lists 2:4 layer '{missing}', which {cls.__name__} .* does not have"):
        sparse24.from_pretrained(cls, folder)


# --- a sharded checkpoint loaded shard by shard ----------------------------------------------

def _trained(build, mode):
    """A sparsified model and a copy standing for it after training: other values, the same masks."""
    dense = build()
    fresh = copy.deepcopy(dense)
    sparse24.sparsify_(fresh, mode=mode)
    trained = copy.deepcopy(fresh)
    with torch.no_grad():
        for m in layers_24(trained).values():
            (m.weight if mode == "masked" else m.values).mul_(1.5)
            if m.bias is not None:
                m.bias.add_(0.25)
    return fresh, trained


def _split_layers(folder, model):
    """The 2:4 layers whose entries (the compressed marker left aside) lie in several shards."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    split = []
    for name, m in layers_24(model).items():
        files = {index[f"{name}.{k}"] for k in m.state_dict()}
        if len(files) > 1:
            split.append(name)
    return split


BUILDS = {"llama": tiny_llama, "bert": tiny_bert}
SHARD = "12KB"  # small enough that shard boundaries fall inside layers of every kind tested


@pytest.mark.parametrize("build", ["llama", "bert"])
@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_a_sharded_checkpoint_loads_shard_by_shard(tmp_path, build, mode):
    """Each shard holds part of some layers' entries (and the compressed markers were all in the last
    shard): every non-strict per-shard load was refused ("incomplete 2:4 entries", "got a dense
    checkpoint")."""
    fresh, trained = _trained(BUILDS[build], mode)
    trained.save_pretrained(tmp_path, max_shard_size=SHARD)
    assert _split_layers(tmp_path, trained)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    if mode == "compressed":  # each marker beside its layer's entries
        for name in layers_24(trained):
            at = shards.index(index[f"{name}.meta"])
            assert index[f"{name}.weight"] in shards[at:at + 2]
    for order in (shards, shards[::-1]):  # (load_sharded_checkpoint's order is a set's)
        model = copy.deepcopy(fresh)
        for shard in order:
            model.load_state_dict(load_file(tmp_path / shard), strict=False)
        assert same_state(model, trained)
    model = copy.deepcopy(fresh)
    load_sharded_checkpoint(model, tmp_path, strict=False)
    assert same_state(model, trained)
    ids = tokens()
    with torch.no_grad():
        out = model(ids)
        ref = trained(ids)
    key = "logits" if build == "llama" else "last_hidden_state"
    assert torch.equal(out[key], ref[key])


def test_a_strict_load_still_refuses_part_of_a_layer(tmp_path):
    fresh, trained = _trained(tiny_llama, "masked")
    trained.save_pretrained(tmp_path, max_shard_size=SHARD)
    name = _split_layers(tmp_path, trained)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = load_file(tmp_path / index[f"{name}.mask"])
    model = copy.deepcopy(fresh)
    with pytest.raises(RuntimeError, match=rf"{name}: incomplete 2:4 entries"):
        model.load_state_dict(shard)
    assert same_state(model, fresh)


def test_a_split_layer_whose_masks_differ_is_refused_whole(tmp_path):
    """A part is taken only when the layer stays valid with its other entries: a checkpoint whose
    masks are not this model's cannot load shard by shard. Each refused call copies nothing."""
    _, trained = _trained(tiny_llama, "masked")
    trained.save_pretrained(tmp_path, max_shard_size=SHARD)
    name = _split_layers(tmp_path, trained)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    other = tiny_llama(seed=1)
    sparse24.sparsify_(other)
    assert not torch.equal(other.get_submodule(name).mask, trained.get_submodule(name).mask)
    for entry in ("weight", "mask"):
        model = copy.deepcopy(other)
        with pytest.raises(RuntimeError, match=rf"{name}: incomplete 2:4 entries: got \['{entry}'\].*"
                                               "not a valid 2:4 layer"):
            model.load_state_dict(load_file(tmp_path / index[f"{name}.{entry}"]), strict=False)
        assert same_state(model, other)


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_trainer_resumes_a_sharded_checkpoint(tmp_path, mode):
    fresh, trained = _trained(tiny_llama, mode)
    trained.save_pretrained(tmp_path / "checkpoint-1", max_shard_size=SHARD)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=0.0, weight_decay=0.0)
    TrainerState(train_batch_size=2, logging_steps=args.logging_steps, eval_steps=args.eval_steps,
                 save_steps=args.save_steps).save_to_json(str(tmp_path / "checkpoint-1" / "trainer_state.json"))
    ids = tokens(shape=(2, 8))
    data = [{"input_ids": r, "labels": r} for r in ids]
    model = copy.deepcopy(fresh)
    Trainer(model, args, train_dataset=data).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert same_state(model, trained)  # learning rate 0: the checkpoint's weights, untouched by the step


def _quantized(quantize, symmetric):
    """A compressed quantized model and a copy standing for it after training: other values and
    scales (and zero points), the same masks."""
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    sparse24.sparsify_(fresh, mode="compressed", quantize=quantize, symmetric=symmetric, skip_output_head=False)
    trained = copy.deepcopy(fresh)
    with torch.no_grad():
        for m in layers_24(trained).values():
            m.values.copy_(-m.values)
            m.scale.mul_(1.5)
            m.bias.add_(0.25)
            if getattr(m, "zero", None) is not None:
                m.zero.copy_(15 - m.zero)
    return fresh, trained


@pytest.mark.parametrize("quantize,symmetric", [("int8", None), ("int4", True), ("int4", False)])
def test_a_quantized_layer_split_anywhere_loads_part_by_part(quantize, symmetric):
    """A shard boundary may fall between any two of a quantized layer's entries: right after its
    ``meta`` the first part (values + meta) has no scale, and was refused as "this layer is
    INT4-quantized but the checkpoint has no scale: it is not INT4"."""
    fresh, trained = _quantized(quantize, symmetric)
    sd = trained.state_dict()
    keys = [k for k in sd if k.startswith("0.")]
    for cut in range(1, len(keys)):
        parts = [{k: sd[k] for k in keys[:cut]}, {k: sd[k] for k in keys[cut:]}]
        for order in (parts, parts[::-1]):
            model = copy.deepcopy(fresh)
            model.load_state_dict({k: v for k, v in sd.items() if not k.startswith("0.")}, strict=False)
            for part in order:
                model.load_state_dict(part, strict=False)
            assert same_state(model, trained), (keys[:cut], keys[cut:])
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(model(x), trained(x))


def test_a_quantized_part_that_does_not_fit_is_refused():
    """The part is checked with the layer's own other entries: INT4 codes beside an INT8 layer's
    scale are not a valid layer, and an unquantized part (floating values) is told apart."""
    fresh, trained = _quantized("int8", None)
    model = copy.deepcopy(fresh)
    part = {"0.values": trained[0].values.float(), "0.meta": trained[0].meta}
    with pytest.raises(RuntimeError, match="0: incomplete 2:4 entries.*not a valid 2:4 layer.*int8"):
        model.load_state_dict(part, strict=False)
    assert same_state(model, fresh)

"""Review finding: the one-byte ``<layer>.weight`` marker ``save_pretrained`` writes beside each
compressed layer's entries was reported as an unexpected key wherever a saved folder's tensors went
through ``load_state_dict``: Trainer's resume and ``load_best_model_at_end`` warned "There were
unexpected keys in the checkpoint model loaded" listing every compressed layer (the load itself was
right), and a strict ``model.load_state_dict(load_file(folder / "model.safetensors"))`` was refused.
A compressed layer now takes its own marker; a dense ``weight`` given to it is still refused."""
import copy
import logging
import re

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import sparse24
from sparse24 import Sparse24Linear

from conftest import top2_mask
from hf_models import masked_reference, tiny_llama, tokens

QUANTIZE = [None, "int8", "int4"]


def layers_24(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def build(quantize, seed=0):
    """A tiny Llama sparsified compressed (16-bit values when unquantized) and the dense model before it."""
    dense = tiny_llama(seed)
    if quantize is None:
        dense = dense.to(torch.bfloat16)
    model = copy.deepcopy(dense)
    sparse24.sparsify_(model, mode="compressed", quantize=quantize)
    return dense, model


@pytest.fixture(params=QUANTIZE, ids=["16bit", "int8", "int4"])
def saved(request, tmp_path):
    """(quantize, dense original, sparsified original, the folder's tensors)."""
    dense, model = build(request.param)
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    markers = [f"{n}.weight" for n in layers_24(model)]
    assert markers and all(sd[k].dtype == torch.uint8 and sd[k].shape == (1,) for k in markers)  # what is tested
    return request.param, dense, model, sd


def assert_loaded(twin, quantize, dense, model):
    """``twin`` holds ``model``'s state bit for bit and computes what the fp64 reference of ``dense`` does."""
    assert same_state(twin.state_dict(), model.state_dict())
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
        if quantize is None:  # the kept bf16 weights, exactly: W * (independent top-2 mask)
            for name, m in layers_24(twin).items():
                w = dense.get_submodule(name).weight.double()
                assert torch.equal(m.dense_weight().double(), torch.where(top2_mask(w), w, 0)), name
        else:  # the dequantized stored values placed by the independent mask
            ref = masked_reference(dense, twin)(ids).logits
            torch.testing.assert_close(twin(ids).logits.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_strict_load_of_a_saved_folders_tensors_takes_the_markers(saved):
    """It was refused: "Unexpected key(s) in state_dict: 'model.layers.0.mlp.down_proj.weight', ..."."""
    quantize, dense, model, sd = saved
    _, twin = build(quantize, seed=1)  # other weights and masks: the load must replace them
    assert not same_state(twin.state_dict(), model.state_dict())
    report = twin.load_state_dict(sd)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_loaded(twin, quantize, dense, model)


def test_a_non_strict_load_reports_no_marker_as_unexpected(saved):
    """What Trainer's resume and load_best_model_at_end do (load_state_dict(sd, False)), then warn about."""
    quantize, dense, model, sd = saved
    _, twin = build(quantize, seed=1)
    report = twin.load_state_dict(sd, strict=False)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_loaded(twin, quantize, dense, model)


@pytest.mark.parametrize("parent", ["lone layer", "plain parent", "guarded model"])
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_each_loading_path_takes_the_marker(parent, quantize):
    """A lone layer (its own strict check), a parent without sparse24's whole-model hook (torch's own
    report) and a sparsify_'d model (the hook's strict check)."""
    lin = nn.Linear(64, 32)
    src = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed", quantize=quantize)
    dst = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed", quantize=quantize)
    p = "" if parent == "lone layer" else "0."
    if parent == "lone layer":
        model = dst
    elif parent == "plain parent":
        model = nn.Sequential(dst)
    else:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), copy.deepcopy(lin))
        sparse24.sparsify_(model, mode="compressed", quantize=quantize, skip_output_head=False)
        dst = model[2]
        p = "2."
    marker = torch.zeros(1, dtype=torch.uint8)  # as sparse24.hf saves it
    sd = {**model.state_dict(), **{p + k: v for k, v in src.state_dict().items()}, p + "weight": marker}
    for strict in (True, False):
        report = model.load_state_dict(sd, strict=strict)
        assert report.unexpected_keys == [] and report.missing_keys == [], strict
        assert same_state(dst.state_dict(), src.state_dict())
    # only the marker, strict: the layer's entries are missing, not "a dense checkpoint"
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\) in state_dict: .*['\"]{re.escape(p)}values") as e:
        model.load_state_dict({k: v for k, v in sd.items() if not k.startswith(p)} | {p + "weight": sd[p + "weight"]})
    assert "dense checkpoint" not in str(e.value) and "Unexpected" not in str(e.value)


@pytest.mark.parametrize("weight", ["dense", "float marker", "two bytes"])
@pytest.mark.parametrize("parent", ["lone layer", "plain parent", "guarded model"])
def test_a_weight_that_is_not_a_marker_is_still_refused(parent, weight):
    model = layer = Sparse24Linear.from_linear(nn.Linear(64, 32), mode="compressed", quantize="int8")
    p = ""
    if parent == "plain parent":
        model, p = nn.Sequential(layer), "0."
    elif parent == "guarded model":
        model = nn.Sequential(nn.Linear(64, 32))
        sparse24.sparsify_(model, mode="compressed", quantize="int8", skip_output_head=False)
        layer, p = model[0], "0."
    before = state(model)
    bad = {"dense": torch.randn(32, 64), "float marker": torch.zeros(1),
           "two bytes": torch.zeros(2, dtype=torch.uint8)}[weight]
    sd = {**state(model), p + "weight": bad}
    with pytest.raises(RuntimeError, match=rf"Unexpected key\(s\) in state_dict: ['\"]{re.escape(p)}weight['\"]"):
        model.load_state_dict(sd)
    assert same_state(before, state(model))
    assert model.load_state_dict(sd, strict=False).unexpected_keys == [p + "weight"]
    with pytest.raises(RuntimeError, match=rf"got a dense checkpoint \('{p}weight' without a 2:4 mask\)"):
        model.load_state_dict({p + "weight": torch.randn(32, 64), p + "bias": torch.zeros(32)})
    assert same_state(before, state(model))


class _Data(torch.utils.data.Dataset):
    x = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_trainer_resume_and_load_best_model_do_not_warn_about_markers(tmp_path):
    """They warned "There were unexpected keys in the checkpoint model loaded: [...q_proj.weight, ...]"."""
    def trainer(steps, seed):
        model = tiny_llama(seed).train()
        sparse24.sparsify_(model, mode="compressed", trainable_values=True)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                                 save_steps=1, use_cpu=True, report_to="none", disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=_Data())

    first = trainer(1, 0)
    first.train()
    saved = state(first.model)
    messages = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, handler, level = hf_logging.get_logger("transformers.trainer"), Catch(), hf_logging.get_verbosity()
    logger.addHandler(handler)
    hf_logging.set_verbosity_warning()
    try:
        resumed = trainer(1, 1)  # max_steps reached: the resume loads the checkpoint and stops
        resumed.train(resume_from_checkpoint=True)
        assert same_state(state(resumed.model), saved)
        best = trainer(1, 2)
        best.state.best_model_checkpoint = str(tmp_path / "checkpoint-1")
        best._load_best_model()
        assert same_state(state(best.model), saved)
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(level)
    assert not [m for m in messages if "unexpected keys" in m or "missing keys" in m], messages

"""Fuzzing (scripts/fuzz.py): a short deterministic run of every target, the oracle
shown to fail where it must, and each finding's reproducing input as a regular test."""
import importlib.util
import io
import json
import random
from pathlib import Path

import pytest
import torch

import sparse24

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", SCRIPTS / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Inputs per target in CI: a fixed count (not a time budget), so every run tries the same inputs;
# about 40 s of CPU in all on a 2-core x86 (the HF target builds a transformers model per input).
CI_INPUTS = {"state-pt": 250, "state-safetensors": 300, "tuned-config": 300, "hf-folder": 50, "cli": 60}


@pytest.mark.parametrize("target", list(CI_INPUTS))
def test_short_fuzz_run_finds_nothing(fuzz, target, tmp_path):
    threads = torch.get_num_threads()
    try:
        r = fuzz.fuzz(target, seconds=600, seed=0, failures=tmp_path, max_inputs=CI_INPUTS[target])
    finally:
        torch.set_num_threads(threads)
    assert r["tried"] == CI_INPUTS[target]
    assert not r["failures"], "\n".join(why[:300] for _, why in r["failures"][:5])
    assert len(r["outcomes"]) >= 5  # the mutations reach several distinct checks, not one


def test_the_oracle_catches_what_it_must(fuzz):
    t = fuzz.PtTarget()
    assert fuzz.run_one(t, t.seed) == "loaded: same model"
    # after a refused load: a layer holding neither its old tensors nor the file's is a failure;
    # one that took all of the file's is torch's per-module loading, reported as such
    ref = fuzz.snapshot(t.model)
    sd = {k: v.clone() for k, v in t.valid_sd.items()}
    sd["0.values"] *= 2
    assert fuzz.partial_load(t.model, ref, sd) is None
    t.model[0].values.data.copy_(sd["0.values"])
    assert fuzz.partial_load(t.model, ref, sd) == "per module"
    t.model[0].values.data.add_(1)
    assert "0.bias, 0.values, 0.meta hold neither" in fuzz.partial_load(t.model, ref, sd)
    # an allocation above the bound is a failure, not an outcome
    class Greedy:
        bound_fixed = 16 * fuzz.MiB

        def run(self, data):
            torch.empty(2 ** 30, dtype=torch.uint8)
            return "done"
    with pytest.raises(fuzz.Failure, match="allocation above the bound"):
        fuzz.run_one(Greedy(), b"x")


def test_mutators_are_deterministic(fuzz):
    t = fuzz.TunedConfigTarget()
    a = [t.mutate(random.Random("s"), [t.seed]) for _ in range(3)]
    b = [t.mutate(random.Random("s"), [t.seed]) for _ in range(3)]
    assert a == b and any(x != t.seed for x in a)


# --- findings, each with its reproducing input --------------------------------------------

def _fuzz_model(fuzz):
    m = fuzz.tiny_model()
    return m, {k: v.clone() for k, v in m.state_dict().items()}


def test_finding_mask_bytes_other_than_0_1(fuzz):
    """A bool mask stored as a byte other than 0/1 (one flipped byte of a torch.save file) raised
    IndexError from a table lookup; torch reads such a byte as True, and so does the check now."""
    model, sd = _fuzz_model(fuzz)
    raw = sd["4.mask"].clone().view(torch.uint8)
    raw.view(-1)[raw.view(-1).nonzero()[0]] = 76  # a kept entry stored as byte 76
    sd["4.mask"] = raw.view(torch.bool)
    buf = io.BytesIO()
    torch.save(sd, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model.load_state_dict(loaded)  # the same mask as torch reads it: loads
    assert torch.equal(model[4].mask, sd["4.mask"].clone().view(torch.uint8).clamp(max=1).view(torch.bool))
    model[4].validate()
    bad = loaded["4.mask"].clone().view(torch.uint8)
    bad.view(-1)[:4] = torch.tensor([1, 76, 1, 0], dtype=torch.uint8)  # 3 kept of 4
    with pytest.raises(ValueError, match="row 0, group 0 .* keeps 3 of 4"):
        sparse24.compress(torch.randn(16, 32), mask=bad.view(torch.bool))


@pytest.mark.parametrize("bias", ["shape", "missing", "not a tensor"])
def test_finding_layer_loads_all_its_entries_or_none(fuzz, bias):
    """A compressed layer took new values and meta while torch refused (or missed) its bias:
    new values beside the old bias. Now the layer refuses its entries as a whole."""
    model, sd = _fuzz_model(fuzz)
    before = {k: v.clone() for k, v in model[0].state_dict().items()}
    sd["0.values"] = sd["0.values"] * 2
    if bias == "shape":
        sd["0.bias"] = torch.zeros(())
    elif bias == "missing":
        del sd["0.bias"]
    else:
        sd["0.bias"] = [1, 2]
    with pytest.raises(RuntimeError, match="0: .*'0.bias'"):
        model.load_state_dict(sd)
    for k, v in model[0].state_dict().items():
        assert torch.equal(v, before[k]), k
    if bias == "missing":  # as a 2:4 set missing its meta, also with strict=False
        with pytest.raises(RuntimeError, match="a layer loads all its entries or none"):
            model.load_state_dict(sd, strict=False)
        assert torch.equal(model[0].values, before["values"])


@pytest.fixture(scope="module")
def hf_target(fuzz):
    pytest.importorskip("transformers")
    return fuzz.HFFolderTarget()


def test_finding_safetensors_header_errors_name_the_file(fuzz, hf_target):
    """A corrupt safetensors header raised safetensors' own SafetensorError, naming no file."""
    config, weights = hf_target.unpack(hf_target.seed)
    truncated = weights[:8] + weights[8:40]  # the header cut short
    with pytest.raises(ValueError, match=r"cannot read the weights file .*model\.safetensors"):
        _load_folder(hf_target, config, truncated)


def test_finding_section_layers_not_an_object(hf_target):
    """"layers": 2147483648 in the sparse24 section raised AttributeError ('int' has no 'items')."""
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    cfg["quantization_config"]["layers"] = 2147483648
    with pytest.raises(ValueError, match="'layers' must map layer names to entries"):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)
    cfg["quantization_config"]["layers"] = {}
    cfg["quantization_config"]["format_version"] = True
    with pytest.raises(ValueError, match="format True"):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)


def _load_folder(target, config: bytes, weights: bytes):
    folder = target.dir / "test-case"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(weights)
    return sparse24.from_pretrained(target.cls, folder)


def test_finding_values_stored_in_another_dtype(hf_target):
    """q_proj.values (an INT8 layer) stored as float8 in model.safetensors loaded as INT8 values:
    transformers cast them to the layer's dtype. Now the stored dtypes are checked first."""
    from safetensors.torch import load, save
    config, weights = hf_target.unpack(hf_target.seed)
    sd = load(weights)
    key = "model.layers.0.self_attn.q_proj.values"
    for dtype in (torch.float8_e4m3fn, torch.float32, torch.int16):
        bad = dict(sd, **{key: sd[key].to(dtype)})
        with pytest.raises(ValueError, match=rf"model\.safetensors: '{key}' is stored as .*; the 2:4 compressed INT8 "
                                             r"layer needs I8"):
            _load_folder(hf_target, config, save(bad))
    key = "model.layers.0.mlp.up_proj.meta"  # int32 metadata stored as int64: refused, not cast
    with pytest.raises(ValueError, match=rf"'{key}' is stored as I64; .* needs I32"):
        _load_folder(hf_target, config, save(dict(sd, **{key: sd[key].long()})))
    # a float layer's values in another float width are cast as load_state_dict casts them: loads
    key = "model.layers.0.mlp.up_proj.values"
    model = _load_folder(hf_target, config, save(dict(sd, **{key: sd[key].double()})))
    assert torch.equal(model.model.layers[0].mlp.up_proj.values, sd[key])


def test_finding_layer_entry_without_quantize(hf_target):
    """A layer entry of the sparse24 section without "quantize" raised KeyError."""
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    del cfg["quantization_config"]["layers"]["model.layers.0.mlp.up_proj"]["quantize"]
    with pytest.raises(ValueError, match="layer 'model.layers.0.mlp.up_proj' has an unreadable entry"):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)

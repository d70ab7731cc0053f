"""Fuzzing (scripts/fuzz.py): a short deterministic run of every target, the oracle
shown to fail where it must, and each finding's reproducing input as a regular test."""
import io
import json
import random

import pytest
import torch

import sparse24

from conftest import load_script



@pytest.fixture(scope="module")
def fuzz():
    return load_script("fuzz")


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
    assert "0.values, 0.bias, 0.meta hold neither" in fuzz.partial_load(t.model, ref, sd)
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
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors as a safetensors file"):
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


def test_finding_dtype_transformers_cannot_load(hf_target):
    """A tensor stored as float8 FNUZ in model.safetensors of a config.json without "dtype" (2026-12-05,
    seed 7373): transformers, inferring the dtype from the weights' headers, raised "Cannot load
    safetensors of unknown dtype F8_E4M3FNUZ", naming no file. Now a dtype its loader has no torch
    dtype for is refused first, naming the file and the entry, with or without "dtype" in the config
    (with it, transformers would cast such a tensor); a dtype it reads (float8 e4m3) still loads, cast."""
    from safetensors.torch import load, save
    config, weights = hf_target.unpack(hf_target.seed)
    no_dtype = json.loads(config)
    del no_dtype["dtype"]
    sd = load(weights)
    key = "model.norm.weight"
    for cfg in (json.dumps(no_dtype).encode(), config):
        for dtype, name in ((torch.float8_e4m3fnuz, "F8_E4M3FNUZ"), (torch.complex64, "C64")):
            with pytest.raises(ValueError, match=rf"model\.safetensors: '{key}' is stored as {name}, which "
                                                 r"transformers cannot load \(it reads BOOL, "):
                _load_folder(hf_target, cfg, save(dict(sd, **{key: sd[key].to(dtype)})))
    model = _load_folder(hf_target, config, save(dict(sd, **{key: sd[key].to(torch.float8_e4m3fn)})))
    assert torch.equal(model.model.norm.weight, sd[key].to(torch.float8_e4m3fn).to(sd[key].dtype))


def test_oracle_a_config_dtype_casts_float_entries_only(fuzz, hf_target):
    """A config.json whose "dtype" is float16 (2026-12-05, seed 8484): transformers builds the model in
    fp16 and casts every float tensor, the 2:4 layers' kept values and masked weights too, as
    ``from_pretrained(..., dtype=)`` does (tests/hf); INT8 / INT4 values, metadata and scales stay as
    stored. The oracle took that cast for a wrong tensor; now it loads as "another model", and a
    masked weight changed after the cast is still caught."""
    from safetensors.torch import load, save
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    cfg["dtype"] = "float16"
    half = json.dumps(cfg).encode()
    assert fuzz.run_one(hf_target, hf_target.pack(half, weights)) == "loaded: another model"
    model = _load_folder(hf_target, half, weights)
    sd = load(weights)
    v_proj, q_proj = model.model.layers[0].self_attn.v_proj, model.model.layers[0].self_attn.q_proj
    assert torch.equal(v_proj.weight, sd["model.layers.0.self_attn.v_proj.weight"].half())
    assert torch.equal(q_proj.values, sd["model.layers.0.self_attn.q_proj.values"])   # INT8: as stored
    assert q_proj.scale.dtype == torch.float32
    with pytest.MonkeyPatch.context() as mp:   # the oracle still sees a weight that is not the file's
        real = sparse24.from_pretrained

        def changed(*a, **k):
            m = real(*a, **k)
            with torch.no_grad():
                w = m.model.layers[0].self_attn.v_proj.weight
                w[w != 0] += 1
            return m
        mp.setattr(sparse24, "from_pretrained", changed)
        with pytest.raises(fuzz.Failure, match="v_proj.weight is not the file's tensor"):
            fuzz.run_one(hf_target, hf_target.pack(half, weights))


def test_finding_layer_entry_without_quantize(hf_target):
    """A layer entry of the sparse24 section without "quantize" raised KeyError."""
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    del cfg["quantization_config"]["layers"]["model.layers.0.mlp.up_proj"]["quantize"]
    with pytest.raises(ValueError, match="layer 'model.layers.0.mlp.up_proj' has an unreadable entry"):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)


# --- findings of the strict oracle (issue 26's last gaps) ------------------------------------------

def _zip_size_set(data: bytes, member: str, size: int) -> bytes:
    """``data`` (a torch.save archive) with ``member``'s uncompressed size in the central directory set."""
    import struct
    i = data.index(b"PK\x01\x02" + data[data.index(b"PK\x01\x02") + 4:][:0])  # the first central entry
    while True:
        n = struct.unpack("<H", data[i + 28:i + 30])[0]
        if data[i + 46:i + 46 + n] == member.encode():
            return data[:i + 24] + struct.pack("<I", size) + data[i + 28:]
        i = data.index(b"PK\x01\x02", i + 4)


def test_finding_torch_load_allocates_what_a_corrupt_zip_names(fuzz, tmp_path, capsys):
    """One changed size field in a 12 KiB torch.save file made torch.load ask for 4 GiB (torch
    allocates the record size the zip directory names before reading it). The archive is now
    checked first, within the file's size, and the error names the file and the record."""
    from sparse24.tools.checkpoint import CheckpointError, load_torch_file
    from sparse24.tools.cli import main
    t = fuzz.PtTarget()
    bad = _zip_size_set(t.seed, "archive/data/6", 2 ** 32 - 1)
    with pytest.raises(CheckpointError, match=r"x\.pt as a torch checkpoint: corrupt archive: record "
                                              r"'archive/data/6' claims 4294967295 bytes"):
        load_torch_file(io.BytesIO(bad), "x.pt")
    assert fuzz.run_one(t, bad).startswith("refused by sparse24's reader: corrupt archive")  # within the bound
    (tmp_path / "bad.pt").write_bytes(bad)
    assert main(["prune", str(tmp_path / "bad.pt"), "--out", str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.pt as a torch checkpoint: corrupt archive: record 'archive/data/6'" in err[0]
    assert not (tmp_path / "o.pt").exists()
    # a stride-0 view of one element stands for any number of elements: refused, as any clone of it
    # would allocate past the file's size
    buf = io.BytesIO()
    torch.save({"w": torch.ones(1).expand(10 ** 6)}, buf)
    with pytest.raises(CheckpointError, match="'w' views 1000000 elements of a 4-byte storage"):
        load_torch_file(io.BytesIO(buf.getvalue()), "x.pt")
    assert torch.equal(load_torch_file(io.BytesIO(t.seed), "x.pt")["0.values"], t.valid_sd["0.values"])


def test_finding_load_state_dict_is_all_or_nothing(fuzz):
    """A refused 2:4 entry (or a size mismatch, or a missing key in a strict load) left the other
    modules holding the file's entries: torch copies module by module. Now nothing is loaded."""
    model, sd = _fuzz_model(fuzz)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = {k: (v * 2 if v.is_floating_point() else v) for k, v in sd.items()}  # valid, other values
    cases = {"a 2:4 layer's mask": dict(changed, **{"4.mask": torch.ones_like(sd["4.mask"])}),
             "a LayerNorm's shape": dict(changed, **{"3.weight": torch.ones(7)}),
             "a non-tensor": dict(changed, **{"3.bias": "x"}),
             "a missing key": {k: v for k, v in changed.items() if k != "3.bias"},
             "an unexpected key": dict(changed, extra=torch.ones(1))}
    for why, bad in cases.items():
        with pytest.raises(RuntimeError, match="load_state_dict copied nothing"):
            model.load_state_dict(bad)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), (why, k)
    # strict=False: missing and unexpected keys are allowed, as torch allows them
    model.load_state_dict(cases["a missing key"], strict=False)
    assert torch.equal(model[3].weight, changed["3.weight"]) and torch.equal(model[3].bias, before["3.bias"])
    model.load_state_dict(sd)
    # a layer with no entries at all, strict=False: loads the rest (an INT8 layer refused it as "not INT8")
    partial = {k: v for k, v in changed.items() if not k.startswith("2.")}
    assert sorted(model.load_state_dict(partial, strict=False).missing_keys) == ["2.bias", "2.meta", "2.scale",
                                                                                 "2.values"]
    assert torch.equal(model[0].values, changed["0.values"]) and torch.equal(model[2].values, before["2.values"])


def test_whole_model_check_nested_and_once(fuzz, monkeypatch):
    """The hook covers the sparsified model where a parent's load reaches it, and each layer's
    entries are checked once per load (the layer skips what the hook checked on the same tensors)."""
    from sparse24.nn import state
    model, sd = _fuzz_model(fuzz)
    outer = torch.nn.Sequential(torch.nn.Linear(4, 4), model)  # sparsify_ was given the inner model
    osd = {k: v.clone() for k, v in outer.state_dict().items()}
    before = {k: v.clone() for k, v in outer.state_dict().items()}
    calls = []
    real = state.check_state
    monkeypatch.setattr(state, "check_state", lambda layer, d, p: (calls.append(p), real(layer, d, p)))
    outer.load_state_dict(osd)
    assert sorted(calls) == ["1.0.", "1.2.", "1.4.", "1.6."]
    bad = dict(osd, **{"1.3.weight": osd["1.3.weight"] + 1, "1.4.mask": torch.ones_like(osd["1.4.mask"])})
    with pytest.raises(RuntimeError, match="1.4: mask is not 2:4"):
        outer.load_state_dict(bad)
    for k, v in outer.state_dict().items():  # the inner model unchanged (outer "0" loads first: torch's order)
        if k.startswith("1."):
            assert torch.equal(v, before[k]), k
    # a submodule's own load: its layers check their entries themselves, all or nothing per layer
    with pytest.raises(RuntimeError, match="mask is not 2:4"):
        model[4].load_state_dict({"weight": sd["4.weight"], "mask": torch.ones_like(sd["4.mask"]), "bias": sd["4.bias"]})


def test_finding_float8_entries(fuzz):
    """float8 values (a safetensors header's dtype changed to F8_E4M3) raised torch's "isfinite not
    implemented for Float8_e4m3fn", naming no entry. The finiteness check widens them first."""
    from safetensors.torch import load, save
    t = fuzz.SafetensorsTarget()
    sd = load(t.seed)
    sd["0.values"] = sd["0.values"].to(torch.float8_e4m3fn)
    sd["4.weight"] = torch.full_like(sd["4.weight"], float("nan")).to(torch.float8_e4m3fn)
    assert "non-finite" in fuzz.run_one(t, save(sd))
    with pytest.raises(RuntimeError, match="'4.weight' has 512 non-finite"):
        t.model.load_state_dict(sd)


def test_finding_float8_int4_scales(fuzz, tmp_path):
    """An INT4 layer's scales stored as float8 (2026-12-05, seed 3535): the positivity check ran
    before the dtype check and raised torch's "le_cpu not implemented for 'Float8_e4m3fn'",
    naming no entry, in load_state_dict and as a traceback in `sparse24 inspect`."""
    from safetensors.torch import load, save
    t = fuzz.SafetensorsTarget()
    sd = load(t.seed)
    sd["6.scale"] = sd["6.scale"].to(torch.float8_e4m3fn)
    assert fuzz.run_one(t, save(sd)).startswith("refused: RuntimeError: N: INTN scale must be floatN of shape")
    with pytest.raises(RuntimeError, match=r"6: INT4 scale must be float16 of shape \(8, 1\) \(group_size 32\), "
                                           r"got torch.float8_e4m3fn"):
        t.model.load_state_dict(sd)
    torch.save(sd, tmp_path / "f8.pt")
    from sparse24.tools.inspect_checkpoint import inspect_tensors
    rows = {r["layer"]: r for r in inspect_tensors(torch.load(tmp_path / "f8.pt"))}
    assert "INT4 scale must be float16" in rows["6"]["problem"] and rows["0"]["valid"]
    # inspect's own finiteness check of a masked layer's weight (torch has no float8 isfinite either)
    sd = load(t.seed)
    w = sd["4.weight"].clone()
    w[tuple(sd["4.mask"].bool().nonzero()[0].tolist())] = float("nan")   # at a kept place: the mask check passes
    sd["4.weight"] = w.to(torch.float8_e4m3fn)
    rows = {r["layer"]: r for r in inspect_tensors(sd)}
    assert rows["4"]["problem"].startswith("weight has 1 non-finite value(s)")


def test_finding_complex_or_nonfinite_bias(fuzz):
    """A 2:4 layer's bias stored as complex (2026-12-05, the mutators' wider dtypes) loaded its real
    part under torch's warning, and a NaN bias loaded without a word: both now refused, the model
    unchanged."""
    t = fuzz.PtTarget()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    for bias, message in ((t.valid_sd["0.bias"].to(torch.complex64), r"'0.bias' must be real, got torch.complex64"),
                          (torch.full_like(t.valid_sd["0.bias"], float("nan")), r"'0.bias' has 32 non-finite")):
        with pytest.raises(RuntimeError, match=message):
            t.model.load_state_dict(dict(t.valid_sd, **{"0.bias": bias}))
        assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 10 ** 6, r"config\.json: num_hidden_layers=1000000, but the checkpoint holds 1 "
                                   r"\(model\.layers\.0 to model\.layers\.0\)"),
    ("hidden_size", 2 ** 20, r"config\.json describes 'model\.embed_tokens\.weight' as \(64, 1048576\), but "
                             r".*model\.safetensors holds"),
    ("num_attention_heads", 0, r"config\.json: transformers cannot read it \(ZeroDivisionError"),
    ("num_attention_heads", None, r"model\.safetensors: 'model\.layers\.0\.self_attn\.\w_proj\.values' has shape "
                                  r"\(32, \d+\); the 2:4 compressed (INT4 )?layer config\.json describes"),
    ("quantization_config", {"layers": {}}, r"config\.json: quantization_config must be an object with a "
                                            r"'quant_method' string"),
    ("quantization_config", None, r"config\.json: the checkpoint holds 2:4 entries \(model\.layers\.0\..*\) but "
                                  r"quantization_config is missing"),
])
def test_finding_config_json_checked_against_the_checkpoint(hf_target, field, value, message):
    """transformers raised KeyError / ZeroDivisionError / its own errors naming no file on corrupt
    config.json values, and built whatever model the config described (1M layers: 9 s) before the
    weights were seen. Now config.json is read, and the model it describes checked against the
    safetensors headers, before transformers builds anything; the error names config.json."""
    import time
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    if value is None:
        cfg.pop(field)
    else:
        cfg[field] = value
    t0 = time.process_time()
    with pytest.raises(ValueError, match=message):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)
    assert time.process_time() - t0 < 1.0


def test_config_checked_with_subfolder_and_config_object(hf_target):
    """``subfolder=`` and a config object given as ``config=`` went straight to transformers (no check
    of config.json against the checkpoint): the same checks now run on the subfolder's files and on
    the given config, which the error names; files check_folder does not read (a variant) are left to
    transformers."""
    import transformers
    config, weights = hf_target.unpack(hf_target.seed)
    bad = json.dumps(dict(json.loads(config), num_hidden_layers=10 ** 6)).encode()
    folder = hf_target.dir / "sub-case"
    (folder / "inner").mkdir(parents=True, exist_ok=True)
    (folder / "inner" / "config.json").write_bytes(bad)
    (folder / "inner" / "model.safetensors").write_bytes(weights)
    with pytest.raises(ValueError, match=r"inner/config\.json: num_hidden_layers=1000000"):
        sparse24.from_pretrained(hf_target.cls, folder, subfolder="inner")
    (folder / "inner" / "config.json").write_bytes(config)
    loaded = sparse24.from_pretrained(hf_target.cls, folder, subfolder="inner")  # a good subfolder loads
    assert any(isinstance(m, sparse24.Sparse24Linear) for m in loaded.modules())
    given = transformers.LlamaConfig.from_pretrained(folder / "inner")
    given.num_hidden_layers = 10 ** 6
    with pytest.raises(ValueError, match=r"the config given to from_pretrained: num_hidden_layers=1000000"):
        sparse24.from_pretrained(hf_target.cls, folder / "inner", config=given)
    given.num_hidden_layers, given.hidden_size = 1, 2 ** 20
    with pytest.raises(ValueError, match=r"the config given to from_pretrained describes 'model\.embed_tokens"):
        sparse24.from_pretrained(hf_target.cls, folder / "inner", config=given)
    # a variant's files are transformers' to find: no model.fp16.safetensors here, its own error
    with pytest.raises(OSError, match="fp16"):
        sparse24.from_pretrained(hf_target.cls, folder / "inner", variant="fp16")


def test_finding_config_json_in_the_cli(tmp_path, capsys):
    """The CLI's folder path read config.json with AutoConfig and built the model on the meta device:
    1M layers took seconds, a bad value raised transformers' own error types."""
    transformers = pytest.importorskip("transformers")
    from sparse24.tools.cli import main
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    capsys.readouterr()  # save_pretrained's own progress bar, when an earlier test left transformers' bars on
    path = tmp_path / "src" / "config.json"
    good = json.loads(path.read_text())
    for field, value, needle in [("num_hidden_layers", 10 ** 6, "config.json: num_hidden_layers=1000000"),
                                 ("num_attention_heads", 0, "config.json: transformers cannot read it")]:
        path.write_text(json.dumps(dict(good, **{field: value})))
        assert main(["prune", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
        assert not (tmp_path / "out").exists()


def test_finding_section_missing_a_stored_layer(hf_target):
    """A sparse24 section without one of the checkpoint's 2:4 layers: transformers found its marker
    the wrong shape and raised "ignore_mismatched_sizes", naming no file (found by the long run)."""
    config, weights = hf_target.unpack(hf_target.seed)
    cfg = json.loads(config)
    del cfg["quantization_config"]["layers"]["model.layers.0.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"config\.json: the checkpoint holds 2:4 entries for "
                                         r"'model\.layers\.0\.mlp\.down_proj', which the sparse24 section does not"):
        _load_folder(hf_target, json.dumps(cfg).encode(), weights)


def test_finding_unexpected_keys_as_torch_finds_them(fuzz):
    """"3.weight.values" (a LayerNorm's weight name followed by more) was not seen as unexpected by
    the whole-model check, which let torch load the other modules first (found by the long run).
    The check's missing/unexpected keys are compared with torch's own report on random key sets."""
    import copy
    from torch import nn
    from sparse24.nn import state
    model, sd = _fuzz_model(fuzz)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="load_state_dict copied nothing.*\n.*Unexpected key.*'3.weight.values'"):
        model.load_state_dict(dict({k: v * 2 if v.is_floating_point() else v for k, v in sd.items()},
                                   **{"3.weight.values": torch.ones(1)}))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    class Extra(nn.Module):  # a module with extra state
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def get_extra_state(self):
            return 1

        def set_extra_state(self, s):
            pass
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)), nn.ReLU(), Extra())
    plain.register_module("none", None)
    rng, compared = random.Random(0), 0
    for _ in range(300):
        d = dict(plain.state_dict())
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(list(d) + ["x"])
            d.pop(k, None) if rng.random() < 0.5 else None
            d[rng.choice([k + ".values", k + "x", "1." + k, k.rpartition(".")[0], "none.w", "2.w", "_extra_state",
                          "1._extra_state", "1.1", "3._extra_state", "3.lin._extra_state"])] = torch.zeros(1)
        try:
            torch_says = copy.deepcopy(plain).load_state_dict(d, strict=False)
        except RuntimeError:  # a size mismatch: not about keys
            continue
        missing, unexpected = state._incompatible_keys(plain, d, "")
        assert (sorted(missing), sorted(unexpected)) == (sorted(torch_says.missing_keys),
                                                         sorted(torch_says.unexpected_keys)), sorted(d)
        compared += 1
    assert compared > 200


def test_finding_a_key_that_is_no_string(fuzz):
    """A pickled state dict whose key is ``False`` made the whole-model check raise AttributeError
    ('bool' object has no attribute 'startswith'; seed 1010; torch's own loader raises it too, strict
    or not): now a clear error naming the key, and nothing loaded."""
    model, sd = _fuzz_model(fuzz)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {**{k: v * 2 if v.is_floating_point() else v for k, v in sd.items()}, False: torch.ones(1)}
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="load_state_dict copied nothing.*\n.*keys must be strings .*, got False"):
            model.load_state_dict(bad, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert fuzz.names_a_field("state_dict keys must be strings (module paths), got False", {False})


def test_json_mutations_leave_the_value_table_alone(fuzz):
    """A list taken from the mutators' value table and then edited changed the table itself, until a
    list inside itself made every later dump raise "Circular reference detected" (seed 1010)."""
    table = json.dumps(fuzz._JSON_VALUES[:10]) + repr(fuzz._JSON_VALUES[10:])
    rng = random.Random(3)
    for _ in range(3000):
        json.dumps(fuzz.mutate_json(rng, {"a": [1, {"b": []}], "c": {}}))
    assert json.dumps(fuzz._JSON_VALUES[:10]) + repr(fuzz._JSON_VALUES[10:]) == table

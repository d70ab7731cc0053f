"""Tuned-config files: schema, lookup order, fallbacks, writing, the CLI without a GPU."""
import dataclasses
import itertools
import json
import warnings

import pytest
import torch

from sparse24.tools import tuning
from sparse24.tools.cli import main
from sparse24.ops import config_store
from sparse24.ops.config_store import DeviceInfo
from sparse24.ops.linear24.op import faster_backend
from sparse24.tools.tuning import KernelConfig

GPU, FAMILY_GPU, OTHER_GPU = "Fake GPU H1 80GB", "Fake GPU H2", "Fake GPU A1"
CFG_A = KernelConfig(16, 32, 256, 8, 1, 2, 3)
CFG_B = KernelConfig(16, 64, 128, 8, 2, 4, 4)
CFG_C = KernelConfig(64, 128, 64, 8, 1, 8, 3)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Empty user and shipped folders; fresh caches and warning memory."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(config_store, "shipped_config_dir", lambda: shipped)
    monkeypatch.delenv("SPARSE24_CONFIG_DIR", raising=False)
    monkeypatch.delenv("SPARSE24_AUTOTUNE", raising=False)
    monkeypatch.setattr(config_store, "_WARNED", set())
    tuning.clear_cache()
    yield shipped
    tuning.clear_cache()


def _entry(cfg, us=5.0):
    return {"config": cfg, "kernel_us": us, "dense_us": 2 * us}


def test_shipped_config_files_are_valid():
    # The real shipped folder (the fixture only redirects the lookup).
    real = tuning.Path(__file__).resolve().parents[2] / "autotune_configs"
    assert real.is_dir()
    assert tuning.validate_dir(real) == []


def test_validate_dir_rejects_bad_files(tmp_path):
    good = tuning.write_entries(tmp_path, GPU, (9, 0), {(16, 64, 64, "float16"): _entry(CFG_A)})
    assert tuning.validate_dir(tmp_path) == []
    data = json.loads(good.read_text())
    cases = {
        "json": "{not json",
        "schema": json.dumps(dict(data, schema=1)),
        "config": json.dumps(dict(data, default=dict(data["default"], BLOCK_K=48))),
        "key": json.dumps(dict(data, entries={"3,64,64,float16": data["entries"]["16,64,64,float16"]})),
        "timing": json.dumps(dict(data, entries={"16,64,64,float16": dict(data["entries"]["16,64,64,float16"],
                                                                          kernel_us=-1)})),
    }
    expected = {"json": "JSONDecodeError", "schema": "schema 1 is not supported (this sparse24 reads schema 2); re-tune",
                "config": "BLOCK_K=48", "key": "keys must be 'M_BUCKET,N,K,DTYPE'", "timing": "kernel_us must be"}
    # what passed before and failed a forward pass (or read wrong): a 16-bit decode entry of the sparse
    # kernel's two tiles per warp at 16 rows (the byte-permute kernel refuses it at every launch), a
    # pipeline no GPU's shared memory holds, booleans read as 1, infinite timings, a key that is a
    # second spelling of another, a K no layer has
    entry = data["entries"]["16,64,64,float16"]
    two_tiles = KernelConfig(16, 64, 128, 1, 1, 2, 1, kernel="decode").to_json()
    huge = KernelConfig(256, 256, 512, 1, 1, 8, 8).to_json()
    more = {
        "two tiles": ({"1,64,256,float16": dict(entry, config=two_tiles)}, "runs the byte-permute kernel"),
        "two tiles fp32 x": ({"1,64,256,int8-float32": dict(entry, config=two_tiles)}, "num_warps == block_n // 16"),
        "shared memory": ({"16,64,64,float16": dict(entry, config=huge)}, "more than any GPU gives a program"),
        "bool timing": ({"16,64,64,float16": dict(entry, kernel_us=True)}, "kernel_us must be a positive finite"),
        "inf timing": ({"16,64,64,float16": dict(entry, dense_us=float("inf"))}, "dense_us must be a positive finite"),
        "bool split": ({"16,64,64,float16": dict(entry, config=dict(entry["config"], SPLIT_K=True))}, "SPLIT_K=True"),
        "leading zero": ({"016,64,64,float16": entry}, "keys must be 'M_BUCKET,N,K,DTYPE'"),
        "odd K": ({"16,64,66,float16": entry}, "K a multiple of 4"),
    }
    cases.update({name: json.dumps(dict(data, entries=entries)) for name, (entries, _) in more.items()})
    expected.update({name: needle for name, (_, needle) in more.items()})
    cases["bool cc"] = json.dumps(dict(data, compute_capability=[True, 0]))
    expected["bool cc"] = "compute_capability must be [major, minor]"
    for name, text in cases.items():
        good.write_text(text)
        (problem,) = tuning.validate_dir(tmp_path)
        assert problem[0] == good and expected[name] in problem[1], (name, problem)
    # the sparse tensor-core kernel's entries keep their two or four tiles per warp
    sp = KernelConfig(16, 64, 128, 1, 1, 2, 1, kernel="decode").to_json()
    good.write_text(json.dumps(dict(data, entries={"1,64,256,int8-float16": dict(entry, config=sp)})))
    assert tuning.validate_dir(tmp_path) == []
    good.write_text(json.dumps(data))
    moved = tmp_path / "wrong_folder" / good.name
    moved.parent.mkdir()
    good.replace(moved)
    (problem,) = tuning.validate_dir(tmp_path)
    assert "belongs in folder 'Fake_GPU_H1_80GB'" in problem[1]


def test_config_validation_messages():
    with pytest.raises(ValueError, match="bad kernel config BLOCK_N=24: must be a power of two in \\[16, 256\\]"):
        KernelConfig(16, 24, 64).validate()
    with pytest.raises(ValueError, match="bad kernel config num_warps=3"):
        KernelConfig(16, 32, 64, num_warps=3).validate()
    with pytest.raises(ValueError, match="must have exactly the keys"):
        KernelConfig.from_json({"BLOCK_M": 16})
    assert KernelConfig.from_json(CFG_B.to_json()) == CFG_B


def test_buckets_dtype_keys_and_candidates():
    assert [tuning.m_bucket(m) for m in (1, 3, 16, 17, 4096, 10**6)] == [1, 4, 16, 32, 4096, 4096]
    assert tuning.dtype_key(torch.float16) == "float16"
    assert tuning.dtype_key(torch.bfloat16, int8_weights=True) == "int8-bfloat16"
    with pytest.raises(TypeError, match="no kernel configs for activations of dtype torch.float64"):
        tuning.dtype_key(torch.float64)
    for M in (1, 16, 32, 128, 4096):
        cands = tuning.candidate_configs(M, 4096, 4096)
        assert 10 <= len(cands) <= 40 and len(set(cands)) == len(cands)
        assert all(c.block_m == 16 for c in cands) == (M <= 16)
    # split-K only where N-blocks alone leave the GPU's SMs idle
    few = {c.split_k for c in tuning.candidate_configs(1, 1024, 4096)}
    many = {c.split_k for c in tuning.candidate_configs(1, 65536, 4096)}
    assert few > {1} and many == {1}


def _write(folder, gpu, cc, entries):
    return tuning.write_entries(folder, gpu, cc, entries)


def test_lookup_order(isolated, tmp_path, monkeypatch):
    shipped = isolated
    own = _write(shipped, GPU, (9, 0), {(16, 4096, 4096, "float16"): _entry(CFG_A),
                                        (64, 4096, 4096, "float16"): _entry(CFG_C),
                                        (256, 4096, 4096, "float16"): _entry(CFG_C)})
    _write(shipped, FAMILY_GPU, (9, 0), {(1, 11008, 4096, "float16"): _entry(CFG_B)})
    _write(shipped, OTHER_GPU, (8, 0), {(1, 4096, 11008, "float16"): _entry(CFG_B)})

    def look(M, N=4096, K=4096, dtype="float16"):
        return tuning.lookup(M, N, K, dtype, GPU, (9, 0))

    assert (look(16).kind, look(16).config) == ("exact", CFG_A)
    assert look(9).kind == "exact"                                  # 9 -> bucket 16
    assert (look(4).kind, look(4).config) == ("nearest", CFG_A)     # 4 is nearest to 16
    assert (look(32).kind, look(32).config) == ("nearest", CFG_A)   # tie 16 / 64: the smaller M
    assert look(4096).config == CFG_C and "M=256" in look(4096).source
    assert (look(1, 11008).kind, look(1, 11008).config) == ("family", CFG_B)
    # another family's entry is never used; this GPU's file default is, where its grid keeps the SMs
    # as busy as the built-in's: 8 x 32 programs at 512 rows, not 32 at one row (the built-in: 256)
    default = json.loads(own.read_text())["default"]
    assert look(512, 4096, 11008).kind == "file-default"
    assert look(512, 4096, 11008).config == KernelConfig.from_json(default) == CFG_C  # wins 2 of 3 entries
    assert (look(1, 4096, 11008).kind, look(1, 4096, 11008).config) == (
        "builtin", tuning.builtin_config(1, 4096, 11008))
    # ... for the dtype keys it won an entry of: none of bfloat16 here, so the built-in serves them
    assert (look(16, dtype="bfloat16").kind, look(16, dtype="bfloat16").config) == (
        "builtin", tuning.builtin_config(16, 4096, 4096, dtype="bfloat16"))
    # an entry of another config for bfloat16 (tuned, but the default never won it) changes nothing
    _write(shipped, GPU, (9, 0), {(16, 4096, 4096, "bfloat16"): _entry(CFG_B)})
    assert json.loads(own.read_text())["default"] == default
    assert (look(512, 4096, 11008, "bfloat16").kind, look(512, 4096, 11008, "bfloat16").config) == (
        "builtin", tuning.builtin_config(512, 4096, 11008, dtype="bfloat16"))
    # a GPU without any file: built-in
    unknown = tuning.lookup(16, 4096, 4096, "float16", "Fake GPU Z", (7, 5))
    assert (unknown.kind, unknown.config) == ("builtin", tuning.builtin_config(16))
    # the user folder comes first
    user = tmp_path / "user"
    _write(user, GPU, (9, 0), {(16, 4096, 4096, "float16"): _entry(CFG_B)})
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(user))
    assert look(16).config == CFG_B and str(user) in look(16).source
    assert look(64).config == CFG_C  # still found in the shipped file
    # the side-by-side timings travel with the entries (dense_us / kernel_us)
    monkeypatch.setattr(config_store, "device_info", lambda device=None: DeviceInfo(GPU, (9, 0)))
    tuning.clear_cache()
    assert tuning.measured_timings(16, 4096, 4096, "float16") == {"kernel_us": 5.0, "dense_us": 10.0}
    assert tuning.measured_timings(1, 11008, 4096, "float16") == {}  # only a family entry: not measured here


def test_a_file_default_serves_only_where_it_fills_the_sms(isolated):
    """The H200 file's default (the 4096 x 4096 winner: 64-row tiles, split 8) would give a fp16
    1024 x 4096 layer 128 programs and a 768 x 3072 one 96 on 132 SMs (kernel_static_check.py
    --occupancy said "NOT met"), and a 3072 x 768 one 8 splits of 3 K-tiles; there the built-in
    default serves."""
    won = KernelConfig(16, 64, 256, 1, 8, 4, 1, kernel="decode")
    _write(isolated, GPU, (9, 0), {(1, 4096, 4096, "float16"): _entry(won), (16, 4096, 4096, "float16"): _entry(won)})

    def look(N, K):
        return tuning.lookup(1, N, K, "float16", GPU, (9, 0), 132, layout="decode")
    for N, K in ((1024, 4096), (768, 3072)):
        assert (look(N, K).kind, look(N, K).config) == ("builtin", tuning.builtin_config(1, N, K, 132, "decode"))
        c = look(N, K).config
        assert -(-N // c.block_n) * c.split_k >= 132
    # 3072 x 768: 384 programs, but 8 splits of 3 K-tiles (5 splits without work)
    assert (look(3072, 768).kind, look(3072, 768).config) == ("builtin", tuning.builtin_config(1, 3072, 768, 132,
                                                                                               "decode"))
    assert (look(8192, 8192).kind, look(8192, 8192).config) == ("file-default", won)   # 128 x 8 programs
    assert (look(11008, 4096).kind, look(11008, 4096).config) == ("file-default", won)


def test_decode_entries_serve_their_side_of_16_rows(isolated, tmp_path):
    """A decode-kernel entry tuned at M <= 16 is not taken as the nearest for 17-64 rows (there
    the INT8 / INT4 route runs 32 rows per program, the built-in default) nor the reverse;
    a file whose decode entry the kernel cannot run at its bucket is refused when read."""
    d16 = KernelConfig(16, 128, 256, 1, 8, 2, 1, kernel="decode")
    d32 = KernelConfig(32, 128, 256, 1, 8, 2, 1, kernel="decode")
    _write(isolated, GPU, (9, 0), {(16, 4096, 4096, "int8-float16"): _entry(d16)})

    def look(M):
        return tuning.lookup(M, 4096, 4096, "int8-float16", GPU, (9, 0), layout="decode")

    assert (look(4).kind, look(4).config) == ("nearest", d16)
    assert (look(32).kind, look(32).config) == ("builtin", tuning.builtin_config(32, 4096, 4096, layout="decode",
                                                                                 dtype="int8-float16"))
    assert look(32).config.block_m == 32
    assert tuning.validate_dir(isolated) == []
    good = _write(tmp_path, GPU, (9, 0), {(64, 4096, 4096, "int4-bfloat16"): _entry(d32),
                                          (32, 4096, 4096, "bfloat16"): _entry(d32)})   # 16-bit weights too
    assert tuning.validate_dir(tmp_path) == []
    data = json.loads(good.read_text())
    entry = data["entries"]["64,4096,4096,int4-bfloat16"]
    for key in ("16,4096,4096,int8-float16",     # 32 rows at decode sizes
                "16,4096,4096,float16",          # (16-bit weights: the byte-permute kernel there)
                "32,4096,4096,float32",          # fp32 x: the byte-permute kernel takes 16
                "128,4096,4096,int8-float16"):   # past the route (and the split-K workspace)
        good.write_text(json.dumps(dict(data, entries={key: entry})))
        (problem,) = tuning.validate_dir(tmp_path)
        assert "BLOCK_M 32 in a decode entry" in problem[1] and key in problem[1], problem
        with pytest.raises(ValueError, match="32 rows per program only"):
            _write(tmp_path / "w", GPU, (9, 0), {tuple(int(v) if v.isdigit() else v for v in key.split(",")): _entry(d32)})


@pytest.mark.parametrize("content", ["{broken", json.dumps({"schema": 1, "kernel": "sparse24_matmul"}),
                                     json.dumps([1, 2]), "[" * 100000 + "]" * 100000],
                         ids=["corrupt", "schema-invalid", "not-an-object", "too-deep"])  # too-deep: RecursionError
def test_bad_file_warns_once_and_falls_back(isolated, content):
    path = isolated / tuning.gpu_file_name(GPU) / "sparse24_matmul.json"
    path.parent.mkdir()
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choices = [(M, tuning.lookup(M, 4096, 4096, "float16", GPU, (9, 0))) for M in (1, 16, 256)]
        tuning.clear_cache()  # re-reading the file does not warn again
        choices.append((1, tuning.lookup(1, 4096, 4096, "float16", GPU, (9, 0))))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and str(path) in msgs[0] and "ignoring tuned-config file" in msgs[0]
    assert all(c.kind == "builtin" and c.config == tuning.builtin_config(M) for M, c in choices)


def test_auto_picks_the_reference_only_where_measured_faster(isolated, monkeypatch):
    # timings are optional in a file: an entry with only one of them (a KeyError once, inside
    # linear(backend="auto")) keeps the kernel
    _write(isolated, GPU, (9, 0), {(32, 64, 64, "float16"): {"config": CFG_A, "reference_us": 3.0},
                                   (64, 64, 64, "float16"): {"config": CFG_A, "kernel_us": 3.0},
                                   (128, 64, 64, "float16"): {"config": CFG_A, "kernel_us": 3.0, "reference_us": 2.0},
                                   (256, 64, 64, "float16"): {"config": CFG_A, "kernel_us": 2.0, "reference_us": 3.0}})
    monkeypatch.setattr(config_store, "device_info", lambda device=None: DeviceInfo(GPU, (9, 0)))
    picks = [faster_backend(tuning.measured_timings(M, 64, 64, "float16")) for M in (32, 64, 128, 256)]
    assert picks == ["triton", "triton", "reference", "triton"]
    # unmeasured: the decode kernel up to 64 rows of a decode-layout weight, then the reference
    assert [faster_backend({}, "decode", M) for M in (17, 64, 65)] == ["triton", "triton", "reference"]
    assert faster_backend({}, "v1", 4096) == "triton"


def test_write_entries_merges_and_keeps_corrupt_file(isolated, capsys):
    p1 = _write(isolated, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG_A)})
    p2 = _write(isolated, GPU, (9, 0), {(2, 64, 64, "float16"): _entry(CFG_B), (1, 64, 64, "float16"): _entry(CFG_B)})
    assert p1 == p2
    data = json.loads(p2.read_text())
    assert set(data["entries"]) == {"1,64,64,float16", "2,64,64,float16"}
    assert data["entries"]["1,64,64,float16"]["config"] == CFG_B.to_json()  # new measurement replaces old
    assert data["gpu"] == GPU and data["compute_capability"] == [9, 0] and data["schema"] == 2
    p2.write_text("garbage")
    _write(isolated, GPU, (9, 0), {(4, 64, 64, "float16"): _entry(CFG_A)})
    assert (p2.parent / "sparse24_matmul.json.corrupt").read_text() == "garbage"
    assert list(json.loads(p2.read_text())["entries"]) == ["4,64,64,float16"]
    assert "was unreadable" in capsys.readouterr().err


def test_get_config_on_cpu_and_describe(isolated, monkeypatch):
    monkeypatch.setenv("SPARSE24_AUTOTUNE", "1")  # has no effect without CUDA
    assert tuning.get_config(3, 40, 64, "float16", torch.device("cpu")) == tuning.builtin_config(3, 40, 64)
    text = tuning.describe_config_source("cpu")
    assert "device cpu" in text and "interpreter" in text
    _write(isolated, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG_A)})
    monkeypatch.setattr(config_store, "device_info", lambda device=None: DeviceInfo(GPU, (9, 0)))
    text = tuning.describe_config_source()
    assert f"tuned file for this GPU: {isolated}" in text and "1 entries" in text
    monkeypatch.setattr(config_store, "device_info", lambda device=None: DeviceInfo(FAMILY_GPU, (9, 0)))
    text = tuning.describe_config_source()
    assert "no tuned file for 'Fake GPU H2'" in text and "same family (sm_90)" in text


def test_autotune_cli_without_gpu(capsys, isolated):
    assert not torch.cuda.is_available()
    assert main(["autotune", "--shapes", "standard", "--m", "1,16"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU found" in err and "nothing was tuned or written" in err
    assert list(isolated.iterdir()) == []
    assert main(["autotune", "--shapes", "nope"]) == 2
    assert "unknown shape 'nope'" in capsys.readouterr().err
    assert main(["autotune", "--dtype", "int4"]) == 2
    assert "unknown --dtype" in capsys.readouterr().err
    assert main(["autotune", "--m", "0,4"]) == 2
    assert "--m needs positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("argv,reason", [
    (["--m", "x"], "--m needs comma-separated integers, got 'x'"),  # as bench says it
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--rep-ms", "z"], "invalid float value: 'z'"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--warmup-ms", "-5"], "--warmup-ms must be >= 0"),
    (["--rep-ms", "nan"], "--rep-ms > 0"),
])
def test_autotune_bad_arguments_are_one_line_errors(capsys, isolated, argv, reason):
    # docs/cli.md: errors print one line and exit 2 for bad input, like every other command
    assert main(["autotune", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("sparse24 autotune: error: ") and reason in err


def test_autotune_refuses_a_file_as_config_folder_before_tuning(capsys, isolated, tmp_path, monkeypatch):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    assert main(["autotune", "--out-dir", str(f)]) == 2  # 2 (bad input), not 1 (no GPU): checked first
    assert "is a file" in capsys.readouterr().err
    tuning.clear_cache()
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(f))
    assert f"{f} (a file, not a folder)" in tuning.describe_config_source("cpu")


def test_select_fastest_rejects_failing_and_wrong_configs(capsys):
    """The tuner's selection on real interpreter runs, with a fake clock: a
    config that raises and one that computes a wrong result are never chosen."""
    import sparse24
    from sparse24.ops.linear24 import linear_triton

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 64, generator=g), torch.randn(3, 64, generator=g)
    p = sparse24.compress(w)
    ref = torch.nn.functional.linear(x.double(), (w * sparse24.mask_nm(w)).double())
    good, faster_but_wrong, fastest_but_fails, slow = (KernelConfig(16, 32, 32), KernelConfig(16, 16, 32),
                                                       KernelConfig(16, 64, 64), KernelConfig(32, 32, 64))
    wrong_p = sparse24.compress(w.flip(1))  # a different weight: what a mis-decoding config would compute

    clock = {good: 2.0, faster_but_wrong: 1.0, fastest_but_fails: 0.5, slow: 3.0}
    launched, timed = [], []

    def launch(cfg):
        launched.append(cfg)
        if cfg == fastest_but_fails:
            raise RuntimeError("out of resources: shared memory")
        return linear_triton(x, wrong_p if cfg == faster_but_wrong else p, config=cfg)

    def time(cfg):  # a fake clock
        timed.append(cfg)
        return clock[cfg]

    configs = [slow, faster_but_wrong, fastest_but_fails, good]
    record = []
    cfg, t, rejected = tuning._select_fastest(
        configs, launch, lambda y: float((y.double() - ref).norm() / ref.norm()), time,
        max_err=tuning._MAX_REL_ERR["float32"], label="test", record=record)
    assert (cfg, t) == (good, 2.0)
    # every candidate is recorded, timed or not (autotune --timings writes them)
    assert [(c, us, status.split(":")[0]) for c, us, status in record] == [
        (slow, 3.0, "ok"), (faster_but_wrong, None, "wrong result"), (fastest_but_fails, None, "failed"),
        (good, 2.0, "ok")]
    assert timed == [slow, good]  # only correct configs are timed
    assert len(rejected) == 2 and "RuntimeError: out of resources" in rejected[1]
    assert "WRONG RESULT from" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no candidate config ran correctly for test"):
        tuning._select_fastest([fastest_but_fails], launch, lambda y: 0.0, time, 1e-5, "test")


def test_prefill_entries_serve_the_prefill_route(isolated, tmp_path):
    """Past 16 rows a decode-layout weight runs the prefill kernel (INT8 / INT4 with 16-bit x: past
    SP_MAX_M), so that is the space the tuner times there (16-bit weights at 17-64 rows: with the
    sparse tensor-core kernel's); a tuned prefill entry is found exactly or
    as the nearest M (one of at most 64 rows per program at 17-64 rows), never by the decode kernel's
    lookup, and never made the file's default; without one, the prefill kernel's model default. A
    prefill entry where the route does not run the prefill kernel, or one it cannot run, is refused."""
    from sparse24.ops.config_space import split_factors
    from sparse24.ops.linear24.prefill import prefill_config, prefill_configs
    space = [dataclasses.replace(c, split_k=s) for c in prefill_configs(128) for s in split_factors(128, 4096, 4096, c)]
    assert tuning.candidate_configs(128, 4096, 4096, 132, "decode", "float16") == space
    assert tuning.candidate_configs(128, 4096, 4096, 132, "decode", "int8-float16") == space
    from sparse24.kernels.sparse24_prefill import natural_tile
    # the wide tile's 16 programs split up to 16 (Triton >= 3.6; before, 128 x 128's 32 up to 8)
    assert {c.split_k for c in space} == {1, 2, 4, 8} | ({16} if natural_tile(128, 256) else set())
    assert {c.split_k for c in tuning.candidate_configs(2048, 4096, 4096, 132, "decode", "float16")} == {1}
    sp = tuning.candidate_configs(32, 4096, 4096, 132, "decode", "int8-float16")
    assert sp and all(c.kernel == "decode" and c.block_m == 32 for c in sp)   # the sparse tensor-core route
    # 16-bit weights at 17-64 rows: the prefill kernel's space and the sparse kernel's 32 rows, timed side by side
    both = tuning.candidate_configs(32, 4096, 4096, 132, "decode", "float16")
    assert {(c.kernel, c.block_m if c.kernel == "decode" else None) for c in both} == {("prefill", None),
                                                                                      ("decode", 32)}
    wide = KernelConfig(256, 128, 64, 8, 1, 8, 2, kernel="prefill")
    small = KernelConfig(64, 128, 128, 8, 1, 8, 2, kernel="prefill")
    d16 = KernelConfig(16, 128, 256, 1, 8, 8, 1, kernel="decode")   # (one 16-row tile per warp: 16-bit weights)
    path = _write(isolated, GPU, (9, 0), {(2048, 4096, 4096, "float16"): _entry(wide),
                                          (512, 4096, 4096, "float16"): _entry(wide),
                                          (16, 4096, 4096, "float16"): _entry(d16)})
    assert KernelConfig.from_json(json.loads(path.read_text())["default"]) == d16

    def look(M, kernel="prefill", dtype="float16", N=4096):
        return tuning.lookup(M, N, 4096, dtype, GPU, (9, 0), layout="decode", kernel=kernel)
    assert (look(2048).kind, look(2048).config) == ("exact", wide)
    assert (look(4096).kind, look(4096).config) == ("nearest", wide)
    assert look(40).kind == "builtin"                    # 256 rows per program is not the space at 40 rows
    assert look(40).config == prefill_config(40, 4096, 4096, 132, "float16")
    assert look(2048, kernel=None).config.kernel == "decode"
    assert look(300, dtype="int8-bfloat16", N=8192).config == prefill_config(300, 8192, 4096, 132, "int8-bfloat16")
    assert look(300, dtype="float32").config == prefill_config(300, 4096, 4096, 132, "float16")
    # at 17-64 rows the prefill kernel serves fp32 x and 16-bit weights (INT8 / INT4 with 16-bit x run the
    # sparse tensor-core kernel there)
    _write(isolated, GPU, (9, 0), {(64, 4096, 4096, "float32"): _entry(small),
                                   (64, 4096, 4096, "bfloat16"): _entry(small)})
    for dt in ("float32", "bfloat16"):
        assert (look(40, dtype=dt).kind, look(40, dtype=dt).config) == ("exact", small)  # 40 -> 64
        assert (look(100, dtype=dt).kind, look(100, dtype=dt).config) == ("nearest", small)
    for key, cfg, match in (((16, 4096, 4096, "float16"), small, "prefill entry at M bucket 16"),
                            ((64, 4096, 4096, "int8-float16"), small, "prefill entry at M bucket 64"),
                            ((64, 4096, 4096, "int4-bfloat16"), small, "prefill entry at M bucket 64"),
                            ((256, 4096, 4096, "float16"), KernelConfig(128, 64, 64, 8, 1, 8, 2, kernel="prefill"),
                             "bad prefill config")):
        with pytest.raises(ValueError, match=match):
            _write(tmp_path / "w", GPU, (9, 0), {key: _entry(cfg)})


def test_a_wide_prefill_entry_needs_a_triton_that_runs_it(isolated, tmp_path, monkeypatch):
    """128 x 256 (two 128-row halves of W) runs only where 128-row tiles are in x's own order
    (Triton >= 3.6): a tuned file holding it is refused on an older Triton, not launched."""
    import sparse24.kernels.sparse24_prefill as kernel
    wide = KernelConfig(128, 256, 64, 8, 1, 8, 2, kernel="prefill")
    key = (2048, 4096, 4096, "float16")
    if kernel.natural_tile(128, 256):
        _write(isolated, GPU, (9, 0), {key: _entry(wide)})
        assert tuning.lookup(2048, 4096, 4096, "float16", GPU, (9, 0), layout="decode", kernel="prefill").config == wide
    monkeypatch.setattr(kernel, "natural_tile", lambda bm, bn: False)
    with pytest.raises(ValueError, match="needs Triton >= 3.6"):
        _write(tmp_path / "w", GPU, (9, 0), {key: _entry(wide)})


def test_launch_config_runs_each_kernel_of_the_space(gen):
    """What the tuner times for a config: the prefill kernel for a prefill config, the decode
    kernel for a decode one (Triton's interpreter here), both against fp64."""
    import sparse24
    from sparse24.decode_format import pack_decode
    from conftest import assert_matches_reference
    w = torch.randn(72, 128, generator=gen).half()
    p = sparse24.compress(w)
    d = pack_decode(p)
    x = torch.randn(20, 128, generator=gen).half()
    for cfg in (KernelConfig(32, 64, 128, 8, 1, 4, 2, kernel="prefill"), KernelConfig(16, 64, 128, 1, 1, 4, 1, kernel="decode")):
        assert_matches_reference(tuning.launch_config(x, d, cfg), x, p.to_dense().float())


@pytest.mark.parametrize("dtype", ["int4-float16", "int8-bfloat16", "float16"])
def test_tuning_inputs_hold_the_key_s_weight_kind(dtype):
    """Every dtype key the CLI accepts builds its own inputs: INT4 keys an INT4 weight (a KeyError
    before, for ``--dtype int4-*`` and for SPARSE24_AUTOTUNE=1 on an INT4 layer), INT8 keys an INT8
    one, in the decode layout; x in the key's activation dtype; the dense twin is the weight the
    tuner's fp64 reference multiplies, and a config of the key's space computes it (interpreter)."""
    from conftest import assert_matches_reference
    x, d, dense = tuning._tuning_inputs(20, 64, 256, dtype, "cpu", layout="decode")
    act = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype.rsplit("-", 1)[-1]]
    assert x.dtype == act and dense.dtype == act and dense.shape == (64, 256)
    assert d.quantized == (dtype.split("-")[0] if "-" in dtype else None)
    if d.quantized == "int4":
        assert d.group_size == 128 and d.zero is None
    assert dtype.rsplit("-", 1)[-1] in tuning._MAX_REL_ERR
    if act == torch.float16:   # (bfloat16 has no numpy type: the interpreter cannot run it)
        cfg = tuning.candidate_configs(20, 64, 256, 132, "decode", dtype)[0]
        y = tuning.launch_config(x, d, cfg)
        exact = d.to_sparse24().to(dtype=torch.float32).to_dense().double() if d.quantized else dense.double()
        assert_matches_reference(y, x, exact if cfg.kernel == "decode" else dense.double())


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "int4-asym"])
def test_the_tuner_s_weight_copies_are_whole(quantize):
    """The tuner times each config on ~15 copies of the weight (kept out of L2): an INT4 copy was
    rebuilt without its group size and zero points, which refused it as an INT8 weight and ended
    every INT4 tuning run (``autotune --dtype int4-*``, SPARSE24_AUTOTUNE=1) at its first key."""
    import sparse24
    from sparse24.decode_format import pack_decode
    kw = {"int4": dict(quantize="int4", group_size=64), "int4-asym": dict(quantize="int4", group_size=32,
                                                                          symmetric=False)}.get(quantize)
    w = torch.randn(72, 256, generator=torch.Generator().manual_seed(0))
    p = sparse24.compress(w.half()) if quantize is None else sparse24.compress(w, **(kw or {"quantize": quantize}))
    for weight in (p, pack_decode(p)):
        c = tuning._clone_weight(weight)
        assert type(c) is type(weight) and c.shape == weight.shape and c.dtype == weight.dtype
        assert c.group_size == weight.group_size
        for name in ("values", "meta", "scale", "zero"):
            a, b = getattr(weight, name), getattr(c, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
        assert torch.equal(c.to_dense() if hasattr(c, "to_dense") else c.to_sparse24().to_dense(),
                           weight.to_dense() if hasattr(weight, "to_dense") else weight.to_sparse24().to_dense())


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as the tuner's driver code sees it on an sm_90 GPU named GPU; nothing compiles."""
    fake_sm90(monkeypatch)


def fake_sm90(monkeypatch, name: str = GPU):
    """:func:`fake_gpu`'s patches (shared with test_tuning_review.py)."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(
        multi_processor_count=132, name=name, major=9, minor=0))
    monkeypatch.setattr(config_store, "_DEVICES", {})   # (the fake GPU's device query is forgotten after)
    monkeypatch.setattr(tuning, "_precompile", lambda tasks, jobs, device: 0)


def test_autotune_skip_tuned_goes_on_where_a_run_stopped(tmp_path, monkeypatch, capsys, fake_gpu):
    """``--skip-tuned`` leaves out the keys this GPU's file holds (a GPU run's tuning step cut
    short by its time limit goes on next time); without it every key is timed again. The GPU is
    faked: only the key bookkeeping is under test."""
    from types import SimpleNamespace
    timed = []
    dec = KernelConfig(16, 64, 256, 1, 4, 4, 1, kernel="decode")
    monkeypatch.setattr(tuning, "tune_key", lambda *key, **kw: timed.append(key[:4]) or SimpleNamespace(
        entry={"config": dec, "kernel_us": 1.0, "dense_us": 2.0}))
    out = tmp_path / "configs"
    tuning.write_entries(out, GPU, (9, 0), {(1, 4096, 4096, "float16"): {"config": dec, "kernel_us": 1.0,
                                                                          "dense_us": 2.0}})
    assert tuning.tuned_keys(out, GPU) == {(1, 4096, 4096, "float16")}
    shapes = [("x", 4096, 4096)]
    assert tuning.autotune(shapes, [1, 16], ["float16"], out, skip_tuned=True) == 0
    assert timed == [(16, 4096, 4096, "float16")] and "1 of 2 keys already tuned" in capsys.readouterr().err
    assert tuning.tuned_keys(out, GPU) == {(1, 4096, 4096, "float16"), (16, 4096, 4096, "float16")}
    timed.clear()
    assert tuning.autotune(shapes, [1, 16], ["float16"], out, skip_tuned=True) == 0 and timed == []
    assert tuning.autotune(shapes, [1, 16], ["float16"], out) == 0
    assert timed == [(1, 4096, 4096, "float16"), (16, 4096, 4096, "float16")]
    assert tuning.tuned_keys(tmp_path / "none", GPU) == set()


def test_autotune_writes_every_candidates_time(isolated, tmp_path, monkeypatch, capsys, fake_gpu):
    """``autotune --timings CSV``: the rows tune_key records for each key (every candidate, timed or
    rejected, and those of a key that found no working config) are appended under one header."""
    import csv
    from types import SimpleNamespace
    dec = KernelConfig(16, 64, 256, 1, 4, 4, 1, kernel="decode")

    def fake_tune_key(M, N, K, dtype, device, timings, **kw):
        timings.append(dict(m=M, n=N, k=K, dtype=dtype, kernel="_sparse24_decode", config="{}",
                            kernel_us="" if M == 16 else 1.5, dense_us="", status="failed" if M == 16 else "ok"))
        if M == 16:
            raise RuntimeError("no candidate config ran correctly")
        return SimpleNamespace(entry={"config": dec, "kernel_us": 1.5, "dense_us": 2.0})
    monkeypatch.setattr(tuning, "tune_key", fake_tune_key)
    out, log = tmp_path / "configs", tmp_path / "timings.csv"
    for _ in range(2):   # a second run appends under the same header
        assert tuning.autotune([("x", 4096, 4096)], [1, 16], ["int8-float16"], out, timings_csv=log) == 1
    rows = list(csv.DictReader(log.open()))
    assert list(rows[0]) == list(tuning.TIMING_COLUMNS) and len(rows) == 4
    assert [(r["gpu"], r["m"], r["status"], r["kernel_us"]) for r in rows[:2]] == [
        (GPU, "1", "ok", "1.5"), (GPU, "16", "failed", "")]
    # the CLI checks the path before any GPU work
    bad = tmp_path / "no-such-folder" / "t.csv"
    assert main(["autotune", "--timings", str(bad)]) == 2
    assert "--timings" in capsys.readouterr().err
    assert main(["autotune", "--timings", str(tmp_path)]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["autotune", "--no-skip-tuned", "--timings", str(log)]) == 1   # parsed; then no GPU


def test_timing_rows_name_each_candidates_kernel():
    """tune_key's rows for ``--timings`` (built from _select_fastest's record; tune_key itself needs a
    GPU): the config in its file form, the kernel the launch runs for this weight and x, the time or
    nothing for a rejected candidate, dense's time on every row."""
    import sparse24
    from sparse24.decode_format import pack_decode
    g = torch.Generator().manual_seed(0)
    p8 = pack_decode(sparse24.compress(torch.randn(64, 128, generator=g), quantize="int8"))
    p16 = pack_decode(sparse24.compress(torch.randn(64, 128, generator=g).half()))
    x = torch.randn(1, 128, generator=g).half()
    sp = KernelConfig(16, 64, 128, 1, 2, 2, 1, kernel="decode")
    pre = KernelConfig(32, 64, 64, 8, 1, 4, 3, kernel="prefill")
    rows = tuning.timing_rows((1, 64, 128, "int8-float16"), x, p8, [(sp, 3.25, "ok"), (pre, None, "failed: X")], 9.5)
    assert [(r["kernel"], r["kernel_us"], r["dense_us"], r["status"]) for r in rows] == [
        ("_sparse24_sp", 3.25, 9.5, "ok"), ("_sparse24_prefill", "", 9.5, "failed: X")]
    assert KernelConfig.from_json(json.loads(rows[0]["config"])) == sp and rows[0]["m"] == 1
    byte_permute = KernelConfig(16, 64, 128, 1, 2, 4, 1, kernel="decode")
    assert tuning.timing_rows((1, 64, 128, "float16"), x, p16, [(byte_permute, 2.0, "ok")], None)[0]["kernel"] \
        == "_sparse24_decode"
    assert set(rows[0]) | {"gpu"} == set(tuning.TIMING_COLUMNS)


def test_precompile_variants_are_the_kernels_the_timing_launches():
    """The tuner compiles each distinct kernel variant once, in parallel, before timing: two tasks
    with the same _compile_variant key must launch the same kernel with the same constexprs (else
    the second compiles, one by one, while timing), here through kernel_call on CPU tensors, the
    path the compile workers take. INT8 at M = 1 and 16 are two variants of the sparse kernel."""
    from sparse24.ops.linear24.launch import _Plan, kernel_call, target_dtype
    seen = {}
    for dtype, (N, K), M in itertools.product(("float16", "int8-float16", "int4-float16"), ((64, 512), (64, 768)),
                                             (1, 4, 16, 32, 128)):
        x, p, _ = tuning._tuning_inputs(M, N, K, dtype, "cpu", layout="decode")
        for cfg in tuning.candidate_configs(M, N, K, 132, "decode", dtype):
            target = torch.empty(M, N, dtype=target_dtype(cfg, cfg.split_k, x.dtype))
            kernel, _, _, kwargs = kernel_call(x, p, None, target, cfg, cfg.split_k)
            launch = (kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, sorted(kwargs.items()))
            key = tuning._compile_variant(M, N, K, dtype, cfg)
            assert seen.setdefault(key, launch) == launch, (key, M)
            # the timed launch (launch.run's plan) takes the variant the workers compiled
            plan = _Plan((x.device, x.dtype, p.values.dtype, p.values.dim(), None if p.scale is None else p.scale.dtype,
                          None, N, K, tuning.m_bucket(M), False, False, cfg, p.group_size or 0, p.zero is not None), cfg)
            assert dict(plan.constexprs, **plan.options) == kwargs, (dtype, M, cfg)
    sp = KernelConfig(16, 64, 128, 1, 2, 2, 1, kernel="decode")
    assert tuning._compile_variant(1, 4096, 4096, "int8-float16", sp) != tuning._compile_variant(
        16, 4096, 4096, "int8-float16", sp)


def test_timings_report_ranks_the_default(tmp_path, capsys):
    """scripts/timings_report.py on an autotune --timings file (written by append_timings): per key the
    fastest candidate, the built-in default's time and rank, the best per tile shape, and how far the
    defaults are from the best over all keys; a file of other columns is refused."""
    from conftest import load_script
    default = tuning.builtin_config(1, 4096, 4096, 132, "decode", "int8-float16")
    small = KernelConfig(16, 64, 64, 1, 8, 2, 1, kernel="decode")
    wide = KernelConfig(16, 128, 256, 1, 8, 2, 1, kernel="decode")
    rows = [dict(m=1, n=4096, k=4096, dtype="int8-float16", kernel="_sparse24_sp",
                 config=json.dumps(c.to_json()), kernel_us=us, dense_us=16.0, status=st)
            for c, us, st in ((wide, 15.0, "ok"), (default, 10.0, "ok"), (small, 8.0, "ok"),
                              (KernelConfig(16, 128, 512, 1, 8, 2, 1, kernel="decode"), "", "failed: X"))]
    log = tmp_path / "t.csv"
    tuning.append_timings(log, "GPU X", rows)
    assert load_script("timings_report").main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "GPU X M=1 4096x4096 int8-float16: 3 of 4 candidates timed, dense 16.0 us" in out
    assert "best          8.0 us  2t x 64" in out and "(2.00x dense)" in out
    assert "default      10.0 us  1t x 256   rank 2 of 3, 1.25x the best" in out
    assert "defaults timed at 1 keys: median 1.25x, worst 1.25x the best candidate" in out
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    assert load_script("timings_report").main([str(tmp_path / "bad.csv")]) == 2
    assert "not an autotune --timings file" in capsys.readouterr().err


def test_a_gpu_without_sparse_tensor_cores_tunes_the_kernel_its_layers_run(monkeypatch):
    """On a GPU without sparse tensor cores (compute capability < 8.0) INT8 / INT4 layers with 16-bit x
    run the byte-permute decode kernel to 16 rows: the tuner times that kernel's space there (the
    float32-x twin key's: one 16-row tile per warp), and at 17-64 rows, where those layers take the
    prefill kernel's untuned config, it says so instead of timing a kernel they never run."""
    for dt in ("int8-float16", "int4-bfloat16"):
        sparse = tuning.tuning_space(1, 4096, 4096, dt, "cpu")
        assert sparse == tuning.candidate_configs(1, 4096, 4096, 132, "decode", dt)
        # 16-row tiles per warp: one (INT8 only), two or four
        assert {c.block_n // (16 * c.num_warps) for c in sparse} == ({1, 2, 4} if dt.startswith("int8") else {2, 4})
        monkeypatch.setattr(tuning, "sparse_tensor_cores", lambda device: False)
        twin = dt.split("-")[0] + "-float32"
        assert tuning.fp32_twin(dt) == twin and tuning.fp32_twin("bfloat16") == "float32"
        space = tuning.tuning_space(1, 4096, 4096, dt, "cpu")
        assert space == tuning.candidate_configs(1, 4096, 4096, 132, "decode", twin)
        assert space and all(c.block_m == 16 and c.num_warps == c.block_n // 16 for c in space)
        with pytest.raises(RuntimeError, match="without sparse tensor cores.*prefill kernel's untuned config"):
            tuning.tuning_space(32, 4096, 4096, dt, "cpu")
        # 16-bit weights at 17-64 rows: the prefill kernel's space alone; past 64 rows: the same space either way
        both = tuning.candidate_configs(32, 4096, 4096, 132, "decode", "float16")
        assert tuning.tuning_space(32, 4096, 4096, "float16", "cpu") == [c for c in both if c.kernel == "prefill"]
        assert any(c.kernel == "decode" for c in both)
        assert tuning.tuning_space(128, 4096, 4096, dt, "cpu") == tuning.candidate_configs(
            128, 4096, 4096, 132, "decode", dt)
        monkeypatch.undo()

"""scripts/triton_prebuild.py with this machine's Triton: what ``build`` compiles from ``collect``'s
records is exactly what the JIT then looks up (warming the same variants compiles nothing more),
the slimmed cache still loads, and a relocated copy is found where a stale one is not."""
import json
import os
import shutil

import pytest

from conftest import load_script

mod = load_script("triton_prebuild")
KEY = (1, 128, 256, "float16")


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A fresh Triton cache folder for the JIT."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    yield cache


def _files(cache):
    return sorted(str(f.relative_to(cache)) for f in cache.rglob("*") if f.is_file())


def test_build_writes_what_the_jit_looks_up(tmp_path, cache_env):
    variants = mod.tuning_variants([KEY])[:2]
    assert len(variants) == 2
    specs = []
    mod.warm(variants, record=specs)       # records only: nothing compiled
    assert len(set(specs)) == 2 and all(json.loads(s)["name"].startswith("sparse24.kernels.") for s in specs)
    assert not cache_env.exists() or not list(cache_env.iterdir())
    built = tmp_path / "built"
    done, errors = mod.build(specs, built)
    assert (done, errors) == (2, [])
    files = sorted(f.suffix for f in built.rglob("*") if f.is_file())
    assert files == [".cubin"] * 2 + [".json"] * 4          # slimmed: cubin, metadata, group file
    assert os.environ["TRITON_CACHE_DIR"] == str(cache_env)  # restored after the build

    # a copy elsewhere, relocated: the JIT finds both kernels and compiles nothing
    shutil.copytree(built, cache_env)
    shutil.rmtree(built)                 # (so only the relocated paths can be found)
    assert mod.relocate(cache_env) == 2
    before = _files(cache_env)
    mod.warm(variants)                     # (a fresh fake device: the JIT looks on disk)
    assert _files(cache_env) == before     # a compile would have written its IR files (.ptx, ...) again


def test_a_stale_copy_is_a_miss_not_an_error(tmp_path, cache_env):
    variants = mod.tuning_variants([KEY])[:1]
    specs = []
    mod.warm(variants, record=specs)
    built = tmp_path / "built"
    mod.build(specs, built)
    shutil.copytree(built, cache_env)   # not relocated: its group file names the old place
    shutil.rmtree(built)
    before = _files(cache_env)
    mod.warm(variants)                  # compiles again (Triton finds no files), no error
    after = _files(cache_env)
    assert after != before and any(f.endswith(".ptx") for f in after)   # the miss shows, as the test above counts


def test_cli_collect_then_relocate(tmp_path, capsys):
    out = tmp_path / "specs.jsonl"
    assert mod.main(["collect", "--m", "1", "--dtype", "int8-float16", "--shapes", "128,256", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    n = int(capsys.readouterr().out.split()[0])
    assert len(lines) == n > 1 and len(set(lines)) == n   # one record per distinct variant
    assert {json.loads(s)["name"].rsplit(".", 1)[1] for s in lines} == {"_sparse24_sp"}   # INT8 at M = 1
    assert mod.main(["relocate", str(tmp_path / "empty")]) == 0 and capsys.readouterr().out.startswith("0 compiled")


def test_gpu_check_records_every_variant_the_jit_is_asked_for(tmp_path):
    """scripts/jit_record/sitecustomize.py (first on PYTHONPATH in gpu_check.sh): with SPARSE24_JIT_SPECS
    set, a process appends each variant's specialization, in the form ``build`` compiles, and the
    variant still compiles; without it, nothing is written."""
    import subprocess
    import sys
    root = mod.ROOT
    code = ("import sys; sys.path.insert(0, 'scripts'); import triton_prebuild as t; "
            "t.warm(t.tuning_variants([(1, 128, 256, 'float16')])[:1])")
    for record in (True, False):
        specs = tmp_path / f"specs-{record}"
        specs.mkdir()
        env = {**os.environ, "PYTHONPATH": f"{root / 'scripts' / 'jit_record'}:{os.environ.get('PYTHONPATH', '')}",
               "TRITON_CACHE_DIR": str(tmp_path / f"cache-{record}")}
        if record:
            env["SPARSE24_JIT_SPECS"] = str(specs)
        r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        lines = [ln for f in specs.iterdir() for ln in f.read_text().splitlines()]
        assert any((tmp_path / f"cache-{record}").rglob("*.cubin"))   # compiled all the same
        if record:
            assert len(lines) == 1 and json.loads(lines[0])["name"] == "sparse24.kernels.sparse24_decode._sparse24_decode"
            done, errors = mod.build(lines, tmp_path / "rebuilt")    # the form build takes
            assert (done, errors) == (1, [])
        else:
            assert lines == []


def test_probe_variants_are_what_the_probe_launches_on_the_h200():
    """``collect --probe-ms --ksweep`` (scripts/prebuild_sm90.sh): the prefill probe's launch of ours
    at 4096 rows takes the untuned config and, where the H200 file has a tuned prefill entry (read
    here from the JSON itself), that entry too; past the sparse route's rows its 32-row config; the
    K-sweep's launches are all there (one tile at seven K, GROUP_M 1 / 32 at one, a 256-row tile
    split 1 / 2 / 4)."""
    import pathlib

    from sparse24.ops.config_space import KernelConfig
    from sparse24.ops.linear24.prefill import prefill_config, prefill_pair
    probe = load_script("gpu_probe")
    entries = json.loads((pathlib.Path(mod.ROOT) / "autotune_configs" / "NVIDIA_H200" / "sparse24_matmul.json")
                         .read_text())["entries"]
    c = entries["4096,4096,4096,float16"]["config"]
    tuned = KernelConfig(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], c["SPLIT_K"], c["num_warps"],
                         c["num_stages"], kernel=c["KERNEL"])
    assert "4096,4096,11008,float16" not in entries
    jobs = probe.prefill_jobs([4096], shapes=((4096, 4096), (4096, 11008)))
    # per point: the untuned config (prefill_us), the tuned entry where the file has one (tuned_us), the 32-row one
    assert [(M, N, K, key) for M, N, K, key, _ in jobs] == [(4096, 4096, 4096, "float16")] * 3 + \
        [(4096, 4096, 11008, "float16")] * 2
    assert jobs[0][4] == prefill_config(4096, 4096, 4096, pair=prefill_pair("float16")) != tuned
    assert jobs[1][4] == tuned
    assert jobs[3][4] == prefill_config(4096, 4096, 11008, pair=prefill_pair("float16")) != tuned
    assert jobs[2][4] == jobs[4][4] and (jobs[2][4].block_m, jobs[2][4].split_k) == (32, 1)   # the 32-row config
    ksweep = [(M, N, K, "float16", cfg) for N, K, M, cfg in probe.ksweep_jobs()]
    assert mod.probe_variants((), ksweep=True) == ksweep and len(ksweep) == 12
    assert mod.probe_variants((4096,), ksweep=True) == probe.prefill_jobs([4096]) + ksweep


def test_tuner_variant_key_separates_what_the_jit_compiles_apart():
    """``tuning.distinct_variants`` (the tuner's parallel compile, ``collect``) keeps one launch per
    ``_compile_variant`` key, so two launches with one key must record one specialization (two keys
    may still share one: the key is finer than some kernels need). The decode layout passes ints
    derived from K: at K = 1088 its atom count K / 64 = 17 is not divisible by 16 where at K = 1024
    it is (as 11008 against 4096), so the JIT compiles the same config twice (the key once counted
    them as one, and the tuner then compiled 4096x11008's kernels one by one while timing)."""
    from sparse24.tools import tuning
    tasks = [(M, N, K, dtype, cfg) for dtype in ("float16", "int8-float16") for N in (64, 72) for M in (1, 16)
             for cfg in tuning.candidate_configs(M, N, 1024, 132, "decode", dtype)[:2] for K in (1024, 1088)]
    specs, by_task = {}, {}
    for task in tasks:
        record = []
        mod.warm([task], record=record)
        assert len(record) == 1
        specs.setdefault(tuning._compile_variant(*task), set()).add(record[0])
        by_task[task] = record[0]
    assert all(len(s) == 1 for s in specs.values())               # one key, one kernel
    for M, N, K, dtype, cfg in tasks[::2]:                        # K = 1024 beside 1088, same config
        assert by_task[(M, N, K, dtype, cfg)] != by_task[(M, N, 1088, dtype, cfg)]
        assert tuning._compile_variant(M, N, K, dtype, cfg) != tuning._compile_variant(M, N, 1088, dtype, cfg)


def test_prebuild_script_commands_parse():
    """scripts/prebuild_sm90.sh (step 0 of a GPU session): valid bash, and each of its
    triton_prebuild.py command lines parses (a typo there would cost the session its ~13 minutes)."""
    import shlex
    import subprocess
    script = mod.ROOT / "scripts" / "prebuild_sm90.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = [ln.split("scripts/triton_prebuild.py", 1)[1] for ln in script.read_text().splitlines()
             if "scripts/triton_prebuild.py" in ln and not ln.lstrip().startswith("#")]
    cmds = [shlex.split(ln.replace('"$SPECS/', '"SPECS/').replace('"$CACHE"', "CACHE")) for ln in lines]
    assert [c[0] for c in cmds] == ["collect"] * 3 + ["build"]
    parsed = [mod.parser().parse_args(c) for c in cmds]
    assert parsed[2].ksweep and parsed[2].no_tuning and parsed[2].probe_ms == "32,64,128,4096"

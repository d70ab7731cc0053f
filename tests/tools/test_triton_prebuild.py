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

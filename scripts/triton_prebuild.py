"""Compile, without a GPU, the Triton kernel variants a GPU session's autotune will ask for, into
a Triton cache that scripts/gpu_check.sh uses when it finds one (``.triton-sm90/`` at the root,
carried to the device machine: ``run(carry=[".triton-sm90"])``), so the device's minutes go to
timing rather than compiling.

Triton finds a compiled kernel on disk by a hash of its own files (the wheel's, and libtriton's
build for that Python), the kernel's source, module and specialization, the options, the ptxas
version and the target. So the cache must be built by the GPU image's Triton: 3.6.0 on Python 3.12
(the cp312 wheel from PyPI installs here: ``python3.12 -m venv``, ``pip install triton==3.6.0
numpy``). Two steps, as torch is not needed for the second:

1. ``collect`` (Triton 3.6, torch and this package, any Python): every candidate config the tuner
   times for the keys goes through the JIT's own argument binding, under a driver that reports an
   sm_90 GPU and launches nothing; a hook records the specialization the JIT would compile and
   skips the compile (``specs.jsonl``).
2. ``build`` (Triton 3.6 on Python 3.12, numpy; no torch): each specialization is compiled through
   the JIT's ``preload``, keyed as the JIT keys it, into ``--cache``; only the cubin and metadata
   are kept (the group files rewritten to list those), so the folder stays small to carry.

    /tmp/v360/bin/python scripts/triton_prebuild.py collect --m 1,16 --dtype int8-float16 --out specs.jsonl
    /tmp/v312/bin/python scripts/triton_prebuild.py build specs.jsonl --cache .triton-sm90
    python scripts/triton_prebuild.py relocate .triton-sm90   # where it was copied to (gpu_check.sh)

``collect --probe-ms 32,64 --ksweep`` adds the kernel variants scripts/gpu_probe.py launches
(``--no-tuning``: those alone). scripts/prebuild_sm90.sh does all of it for the next GPU calls in one
command, the two environments included.

That ``build`` writes what the JIT then looks up is tested here with one Triton
(tests/tools/test_triton_prebuild.py: no compile after a build). Whether the GPU image's Triton is
the same build is known only when a GPU session runs with the folder: gpu_check.sh prints the
cache's kernels before and after; every miss just compiles as before.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class CompileOnlyDriver:
    """Triton's active driver, faked: a CUDA target of ``arch`` (90: H100/H200), stream 0, and a
    device number of its own, so the JIT's in-memory kernels of other drivers are not its own (it
    asks its hooks and its disk cache afresh). The JIT binds and specializes arguments and compiles
    for it; nothing is launched (warmup)."""

    _devices = itertools.count(1000)

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)
        self.device = next(self._devices)

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


@contextlib.contextmanager
def fake_driver(arch: int = 90):
    """:class:`CompileOnlyDriver` as Triton's active driver inside the block (the previous one after)."""
    from triton.runtime import driver
    attr = "_active" if hasattr(driver, "_active") else "active"   # (Triton 3.4 keeps it as .active)
    old = getattr(driver, attr)
    driver.set_active(CompileOnlyDriver(arch))
    try:
        yield
    finally:
        setattr(driver, attr, old)


# --- collect (torch and this package) ------------------------------------------------------------

def tuning_variants(keys, num_sms: int = 132) -> list[tuple]:
    """One ``(M, N, K, dtype, config)`` per distinct compiled variant among the candidate configs
    the tuner times for ``keys`` ``[(M, N, K, dtype), ...]`` on a GPU with sparse tensor cores and
    ``num_sms`` SMs (the tuner's own de-duplication, ``tuning.distinct_variants``)."""
    from sparse24.ops.config_space import candidate_configs
    from sparse24.tools.tuning import distinct_variants, runtime_layout
    return distinct_variants([(M, N, K, dtype, cfg) for M, N, K, dtype in keys
                              for cfg in candidate_configs(M, N, K, num_sms, runtime_layout(dtype), dtype)])


def warm(variants, arch: int = 90, record: list | None = None) -> None:
    """Put each variant through the JIT as the tuner's compile step does (``tuning.compile_variants``,
    on CPU tensors, whose pointers are 16-byte aligned as CUDA's) under :func:`fake_driver`:
    compiled into Triton's cache (``TRITON_CACHE_DIR``), or, given ``record``, only its
    specialization data appended there (JSON strings; nothing compiled). Raises on a failure."""
    import torch
    import triton

    from sparse24.tools.tuning import compile_variants

    def hook(**kw):
        record.append(kw["compile"]["specialization_data"])
        return True   # skip the compile

    old = triton.knobs.runtime.jit_cache_hook
    if record is not None:
        triton.knobs.runtime.jit_cache_hook = hook
    try:
        with fake_driver(arch):
            errors = compile_variants(variants, torch.device("cpu"), sparse_cores=True)
    finally:
        triton.knobs.runtime.jit_cache_hook = old
    if errors:
        raise RuntimeError(f"{len(errors)} variants failed, e.g. {errors[0]}")


def probe_variants(probe_ms=(), ksweep: bool = False) -> list[tuple]:
    """The variants of ours scripts/gpu_probe.py launches, ``(M, N, K, dtype, config)``: its prefill
    step's at the rows ``probe_ms`` (fp16 weights, as on an H200: ``gpu_probe.prefill_jobs``) and,
    with ``ksweep``, the K-sweep's (``gpu_probe.ksweep_jobs``). Triton's own dense GEMM, which the
    probe defines in the script it runs, compiles on the GPU. Every launch, not one per
    ``tuning.distinct_variants`` key: the recorded specializations are made distinct instead."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_probe
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    jobs = gpu_probe.prefill_jobs(probe_ms) if probe_ms else []
    if ksweep:
        jobs += [(M, N, K, "float16", cfg) for N, K, M, cfg in gpu_probe.ksweep_jobs()]
    return jobs


# --- build (Triton and numpy only) ---------------------------------------------------------------

@contextlib.contextmanager
def _kernels_importable():
    """``sparse24.kernels`` importable, without torch where the package is not installed: a stub
    package holding this tree's kernels/ under the module names gpu_check.sh's layout gives them
    (Triton's key of a kernel includes its module's name)."""
    try:
        importlib.import_module("sparse24.kernels")
        yield
        return
    except ImportError:
        pass
    site = Path(tempfile.mkdtemp(prefix="sparse24-stub-"))
    (site / "sparse24").mkdir()
    (site / "sparse24" / "__init__.py").write_text("")
    (site / "sparse24" / "kernels").symlink_to(ROOT / "kernels")
    sys.path.insert(0, str(site))
    try:
        yield
    finally:
        sys.path.remove(str(site))
        shutil.rmtree(site, ignore_errors=True)


def _jit_function(full_name: str):
    """The JITFunction whose Python function is ``module.qualname``."""
    from triton.runtime.jit import JITFunction
    module, qualname = full_name.rsplit(".", 1)
    for obj in vars(importlib.import_module(module)).values():
        if isinstance(obj, JITFunction) and obj.fn.__qualname__ == qualname:
            return obj
    raise LookupError(f"no triton.jit function {qualname} in {module}")


def _groups(cache: Path):
    return sorted(cache.glob("*/__grp__*.json"))


def _slim(cache: Path) -> None:
    """Keep each compiled kernel's cubin and metadata only: the IR files go and the group file lists
    just those two (Triton reads every file a group lists when it loads the kernel)."""
    for grp in _groups(cache):
        data = json.loads(grp.read_text())
        keep = {name: path for name, path in data["child_paths"].items() if name.endswith((".cubin", ".json"))}
        for name, path in data["child_paths"].items():
            if name not in keep:
                Path(path).unlink(missing_ok=True)
        data["child_paths"] = keep
        grp.write_text(json.dumps(data))


def relocate(cache: Path) -> int:
    """Point ``cache``'s group files at where the folder is now (Triton keeps absolute paths there,
    and counts a kernel whose files it cannot find as missing); returns the kernels in it."""
    cache = cache.resolve()
    for grp in _groups(cache):
        data = json.loads(grp.read_text())
        data["child_paths"] = {name: str(grp.parent / Path(path).name) for name, path in data["child_paths"].items()}
        grp.write_text(json.dumps(data))
    return len(_groups(cache))


def build(spec_lines: list[str], cache: Path, arch: int = 90, slim: bool = True) -> tuple[int, list[str]]:
    """Compile every specialization (``collect``'s lines) into the Triton cache folder ``cache``;
    returns (compiled, errors). Run with the GPU image's Triton and Python (module docstring)."""
    cache.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(cache.resolve())
    done, errors = 0, []
    try:
        with _kernels_importable():
            for line in spec_lines:
                spec = json.loads(line)
                spec["options"].pop("extern_libs", None)   # the collecting Triton's paths: this one's (same files)
                try:
                    with fake_driver(arch):
                        _jit_function(spec["name"]).preload(json.dumps(spec))
                    done += 1
                except Exception as e:  # noqa: BLE001 (reported; the GPU's JIT compiles what is missing)
                    errors.append(f"{spec['name']}: {type(e).__name__}: {str(e)[:200]}")
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old
    if slim:
        _slim(cache)
    return done, errors


def parser() -> argparse.ArgumentParser:
    """The command line: ``collect``, ``warm``, ``build``, ``relocate``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("collect", "record the variants the tuner would compile (needs torch)"),
                       ("warm", "compile them through the JIT into TRITON_CACHE_DIR (needs torch)")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--m", default="1,16", help="M buckets, comma-separated")
        c.add_argument("--dtype", default="float16,int8-float16", help="dtype keys, comma-separated")
        c.add_argument("--shapes", nargs="+", default=["standard"])
        c.add_argument("--probe-ms", default="", help="also gpu_probe.py's prefill launches at these rows "
                       "(fp16 weights, its three shapes, as on an H200), comma-separated")
        c.add_argument("--ksweep", action="store_true", help="also gpu_probe.py's K-sweep launches")
        c.add_argument("--no-tuning", action="store_true", help="not the tuner's candidates (only --probe-ms, --ksweep)")
        if name == "collect":
            c.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("build", help="compile recorded variants into a Triton cache (the GPU image's Triton)")
    b.add_argument("specs", type=Path)
    b.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("relocate", help="point a copied cache's group files at its place")
    r.add_argument("cache", type=Path)
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "relocate":
        print(f"{relocate(a.cache)} compiled kernels in {a.cache}")
        return 0
    import triton
    if triton.__version__ != "3.6.0":
        print(f"triton_prebuild: note: Triton {triton.__version__} here; the GPU image's is 3.6.0, whose JIT "
              f"keys kernels by its own files", file=sys.stderr)
    t0 = time.time()
    if a.cmd in ("collect", "warm"):
        from sparse24.tools.shapes import parse_shapes
        keys = [(int(m), n, k, dt) for dt in a.dtype.split(",") for _, n, k in parse_shapes(a.shapes)
                for m in a.m.split(",")]
        variants = ([] if a.no_tuning else tuning_variants(keys)) + probe_variants(
            tuple(int(m) for m in a.probe_ms.split(",") if m), a.ksweep)
        specs = [] if a.cmd == "collect" else None
        warm(variants, record=specs)
        if a.cmd == "collect":
            a.out.write_text("".join(s + "\n" for s in dict.fromkeys(specs)))
        print(f"{len(variants)} kernel variants for {len(keys)} keys ({time.time() - t0:.0f} s)")
        return 0
    done, errors = build(a.specs.read_text().splitlines(), a.cache)
    size = sum(f.stat().st_size for f in a.cache.rglob("*") if f.is_file())
    print(f"{done} compiled into {a.cache} ({size / 2**20:.1f} MiB, {time.time() - t0:.0f} s); {len(errors)} failed"
          + (f", e.g. {errors[0]}" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

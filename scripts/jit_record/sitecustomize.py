"""Put first on PYTHONPATH by scripts/gpu_check.sh: with ``SPARSE24_JIT_SPECS`` set to a folder, every
Python process appends the specialization of each kernel variant Triton's JIT is asked to compile (or
to load from its disk cache) to ``<folder>/<pid>.jsonl``, then lets it compile as usual. The lines are
what ``scripts/triton_prebuild.py build`` compiles into the cache a later session carries to the GPU:
every step's variants, the tests' too, as that GPU's JIT asked for them."""
import os

if os.environ.get("SPARSE24_JIT_SPECS"):
    try:
        from triton import knobs

        def _record(**kw):
            try:
                with open(os.path.join(os.environ["SPARSE24_JIT_SPECS"], f"{os.getpid()}.jsonl"), "a") as f:
                    f.write(kw["compile"]["specialization_data"] + "\n")
            except Exception:  # noqa: BLE001 (never in the way of a compile)
                pass
            # None: the JIT goes on to compile (or load) the variant

        knobs.runtime.jit_cache_hook = _record
    except Exception:  # noqa: BLE001 (a recording aid: never in the way of the run)
        pass

"""Triton JIT kernels (installed as ``sparse24.kernels``). Triton only: no torch.nn, no policy."""
import sys as _sys

if __name__ == "kernels":
    # Imported under the top-level name: the checkout's root is on sys.path (``python -m`` run from
    # it puts the working directory first), so this folder shadows the PyPI package ``kernels``
    # (Hugging Face's, which transformers >= 5.25 imports). Hand the name over to that package
    # when one is installed; the import system returns what sys.modules holds after this runs.
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec
    from os import getcwd as _getcwd
    from os.path import dirname as _dirname, realpath as _realpath

    _root = _dirname(_dirname(_realpath(__file__)))   # real paths: a symlinked alias of the root is the root
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _realpath(p or _getcwd()) != _root])
    if _spec is not None and _spec.origin is not None and _spec.loader is not None \
            and _realpath(_spec.origin) != _realpath(__file__):   # not a bare folder, not this one again
        _module = _module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        try:
            _spec.loader.exec_module(_module)
        except BaseException:
            del _sys.modules["kernels"]
            raise

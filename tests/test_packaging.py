"""The wheel holds every package of the source tree: pyproject.toml lists packages by hand (kernels/
and autotune_configs/ are installed under sparse24), so a new sub-package must be listed there too."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()  # (the same regex reads it on every supported Python)
    listed = set(ast.literal_eval(re.search(r"^packages = (\[.*?\])", text, re.M | re.S).group(1)))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sparse24").rglob("__init__.py")}
    found |= {"sparse24.kernels", "sparse24.autotune_configs"}
    assert listed == found, (sorted(found - listed), sorted(listed - found))
    assert '"sparse24.kernels" = "kernels"' in text and '"sparse24.autotune_configs" = "autotune_configs"' in text



def _import_kernels(cwd, extra_path=None) -> list[str]:
    """``import kernels`` as ``python -c`` run in ``cwd`` (which that puts first on sys.path),
    with ``extra_path`` after it: ``kernels.__file__``, its ``CUDAProperties`` and the name of
    sparse24's decode kernel module."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = str(extra_path) + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import kernels, sparse24.kernels.sparse24_decode as d; "
            "print(kernels.__file__); print(getattr(kernels, 'CUDAProperties', None)); print(d.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.split("\n") if out.returncode == 0 else ["failed: " + out.stderr[-300:]]


def test_the_checkout_does_not_shadow_another_kernels_package(tmp_path):
    """From the checkout's root the top-level folder kernels/ would shadow the PyPI package
    ``kernels`` (Hugging Face's, which transformers >= 5.25 imports: ``from kernels import
    CUDAProperties`` failed in every test that imported transformers). Imported under that
    name it hands the name over to the installed package; sparse24.kernels is unaffected; with
    no other package installed, the name stays on the folder (also with a symlinked alias of the
    root on the path, which must not find the folder again as "another" package)."""
    (tmp_path / "fake" / "kernels").mkdir(parents=True)
    (tmp_path / "fake" / "kernels" / "__init__.py").write_text("CUDAProperties = 'the other kernels'\n")
    path, attr, decode = _import_kernels(ROOT, tmp_path / "fake")[:3]
    assert (path, attr, decode) == (str(tmp_path / "fake" / "kernels" / "__init__.py"), "the other kernels",
                                    "sparse24.kernels.sparse24_decode")
    # Without the fake: the installed ``kernels`` (transformers >= 5.25 brings it), as seen from
    # elsewhere, if there is one; else this folder.
    (tmp_path / "elsewhere").mkdir()
    installed = _import_kernels(tmp_path / "elsewhere")[0]
    path = _import_kernels(ROOT)[0]
    assert path == (installed if not installed.startswith("failed") else str(ROOT / "kernels" / "__init__.py"))
    # the root on the path a second time, through a symlink: still this folder (or the installed one), once
    (tmp_path / "alias").symlink_to(ROOT, target_is_directory=True)
    assert _import_kernels(ROOT, tmp_path / "alias")[0] == path


_NO_TRITON = """
import sys
from importlib.machinery import PathFinder
class NoTriton(PathFinder):  # as where the dependency marker skips Triton (macOS, Windows)
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "triton" else PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [NoTriton if f is PathFinder else f for f in sys.meta_path]
"""


def test_without_triton_the_tuned_files_read_and_the_triton_backend_says_why(tmp_path):
    """Without Triton the shipped tuned files still read (a prefill entry's Triton-version check
    imported the kernel module: ModuleNotFoundError from describe_config_source, validate_dir and
    ``sparse24 info``), and backend='triton' names the missing package."""
    import subprocess
    import sys

    code = _NO_TRITON + (
        "import torch, sparse24, sparse24.ops.config_store as cs\n"
        "from sparse24.format import compress\n"
        "from sparse24 import linear\n"
        "print(cs.describe_config_source('cpu'))\n"
        "print('problems', cs.validate_dir(cs.shipped_config_dir()))\n"
        "w = torch.randn(8, 8); p = compress(w, sparse24.masks.mask_nm(w))\n"
        "try:\n    linear(torch.randn(2, 8), p, backend='triton')\n"
        "except RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "problems []" in out.stdout and "NVIDIA_H200" in "".join(p.name for p in (ROOT / "autotune_configs").iterdir())
    assert "refused: backend='triton' needs the triton package" in out.stdout, out.stdout


def test_license_and_version_are_single_sourced():
    """The Apache-2.0 text ships (license-files), the version is written once (_version.py), and the
    source distribution leaves out the test suite, which needs the whole checkout."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text and 'license-files = ["LICENSE"]' in text
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert 'dynamic = ["version"]' in text and re.search(r'^version = "', text, re.M) is None
    assert 'attr = "sparse24._version.__version__"' in text
    assert "prune tests" in (ROOT / "MANIFEST.in").read_text().splitlines()

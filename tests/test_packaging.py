"""The wheel holds every package of the source tree: pyproject.toml lists packages by hand (kernels/
and autotune_configs/ are installed under sparse24), so a new sub-package must be listed there too."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
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

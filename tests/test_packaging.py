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

"""The README's and docs' python examples run as written."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_examples_run(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    if page.name == "README.md":
        assert blocks, "README has no python block"
    for code in blocks:
        exec(compile(code, str(page), "exec"), {})


def test_readme_names_the_ci_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && python3 -m pytest -q" in ci
    assert "bash scripts/setup.sh && python -m pytest -q" in (ROOT / "README.md").read_text()

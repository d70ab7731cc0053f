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


def test_ci_runs_the_readme_test_command():
    command = ("python3 -m venv .venv && . .venv/bin/activate && bash scripts/setup.sh "
               "&& python -m pytest -q -n auto")
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command}\n" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{command}\n" in ci
    assert "export TRITON_CACHE_DIR=$(mktemp -d)" in ci  # a fresh machine: no compiled kernels

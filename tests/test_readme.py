"""The README's quickstart code runs as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python block"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_names_the_ci_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    cmd = "bash scripts/setup.sh && python3 -m pytest -q"
    assert cmd in ci
    assert "bash scripts/setup.sh && python -m pytest -q" in README.read_text()

"""The ``Example:`` sections of the package's docstrings run as doctests and print what they show.

One test per module that has examples. Each docstring runs with the module's globals plus ``torch``
and ``sparse24``, after ``torch.manual_seed(0)``, with ELLIPSIS and NORMALIZE_WHITESPACE. An example
that cannot run here (a CUDA GPU, a model folder on disk, a placeholder ``model``) is marked
``# doctest: +SKIP`` in its docstring, with the reason in the text.
"""
import doctest
import importlib
import pathlib
import re

import pytest
import torch

import sparse24

PACKAGE = pathlib.Path(sparse24.__file__).resolve().parent
PROMPT = re.compile(r"^\s*>>> ", re.M)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Found from the source text (no import at collection time); a module without a ">>>" has nothing to run.
MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if PROMPT.search(p.read_text(encoding="utf-8")))


def test_the_package_has_examples():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    globs = {**vars(mod), "torch": torch, "sparse24": sparse24}
    tests = [t for t in doctest.DocTestFinder().find(mod, name, globs=globs) if t.examples]
    # Every ">>>" of the file is in a docstring doctest finds (not e.g. on a function whose
    # decorator hides its module): an example nobody runs is not silently skipped.
    in_source = len(PROMPT.findall(pathlib.Path(mod.__file__).read_text(encoding="utf-8")))
    in_tests = sum(len(PROMPT.findall(t.docstring)) for t in tests)
    assert in_tests == in_source, f"{name}: {in_source} '>>>' lines in the file, {in_tests} in its doctests"
    failed = []
    for t in tests:
        torch.manual_seed(0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out = []
        runner.run(t, out=out.append)
        if runner.failures:
            failed.append("".join(out))
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)

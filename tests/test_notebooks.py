"""Both notebooks run top to bottom on CPU (small settings, no network), as a user would run them."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["throughput_curves.ipynb", "prune_retrain_compress.ipynb"])
def test_notebook_runs(name, monkeypatch):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs
    monkeypatch.setenv("SPARSE24_NB_STEPS", "15")  # tiny training runs; the kernel inherits the environment
    monkeypatch.setenv("SPARSE24_NB_EVAL", "2000")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if name == "throughput_curves.ipynb":
        assert "measurements from" in text and "byte ceiling 1.78x" in text
        assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    else:
        assert "pruned weights still exactly zero: True" in text and "same outputs: True" in text

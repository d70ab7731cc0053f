"""Review fixes: the demo's evaluate_bpc (low-precision models, the model's own context length), the two
notebooks (a model with another context; CPU runs that differ only in thread count) and eval_charlm's
--steps 1 (the gradual 2:4 row could not reach its final prune)."""
import contextlib
import csv
import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse24.tools.demo import CharMLP, evaluate_bpc, load_corpus

from conftest import load_script

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _code_cells(name: str) -> list[str]:
    nb = json.loads((NOTEBOOKS / name).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _bpc_float64(model, ids, n_chars, ctx):
    """The same logits scored in float64: the characters evaluate_bpc scores (ids[ctx:ctx + n_chars])."""
    starts = torch.arange(0, min(n_chars, ids.numel() - ctx))
    win = ids[starts[:, None] + torch.arange(ctx + 1)].long()
    total = 0.0
    with torch.no_grad():
        for a in range(0, len(starts), 4096):  # the same chunks (a model's logits may depend on the batch)
            w = win[a:a + 4096]
            total += F.cross_entropy(model(w[:, :ctx]).double(), w[:, ctx], reduction="sum").item()
    return total / len(starts) / math.log(2)


# --- 1. evaluate_bpc sums the loss in at least fp32 --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_evaluate_bpc_of_a_low_precision_model_matches_its_logits_scored_in_float64(dtype):
    # a chunk's summed loss (~19,000 for 4096 chars of an untrained model) is a bf16 scalar of spacing 128
    torch.manual_seed(0)
    _, val, _ = load_corpus(max_files=16)
    model = CharMLP().to(dtype).eval()
    got = evaluate_bpc(model, val, 8192)
    ref = _bpc_float64(model, val, 8192, 32)
    assert abs(got - ref) < 1e-5, (got, ref)


# --- 3. the model's context length ------------------------------------------------------------

def test_evaluate_bpc_defaults_ctx_to_the_models_own():
    torch.manual_seed(0)
    _, val, _ = load_corpus(max_files=16)
    model = CharMLP(ctx=16)
    got = evaluate_bpc(model, val, 1000)  # was ctx=32 whatever the model: a shape error in fc1
    assert got == evaluate_bpc(model, val, 1000, 16)
    assert got == pytest.approx(_bpc_float64(model, val, 1000, 16), abs=1e-5)


def test_evaluate_bpc_without_a_ctx_attribute_still_defaults_to_32():
    class Last(nn.Module):  # any context length works: predicts from the last character only
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(101, 101)

        def forward(self, x):
            self.seen = x.shape[1]
            return self.emb(x[:, -1])

    _, val, _ = load_corpus(max_files=16)
    model = Last()
    assert evaluate_bpc(model, val, 100) == pytest.approx(_bpc_float64(model, val, 100, 32), abs=1e-6)
    assert model.seen == 32


def test_prune_retrain_compress_notebook_runs_with_another_context_length(monkeypatch):
    # the notebook run as a user who changed the model to CharMLP(ctx=16): scoring, the dense control and the
    # compressed-state-dict check all follow the model's context (each crashed on a (B, 32) input before)
    monkeypatch.setenv("SPARSE24_NB_STEPS", "3")
    monkeypatch.setenv("SPARSE24_NB_EVAL", "500")
    torch.set_num_threads(1)
    code = _code_cells("prune_retrain_compress.ipynb")
    assert sum(c.count("model = CharMLP()") for c in code) == 1  # the one knob the test turns
    g, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        for c in code:
            exec(c.replace("model = CharMLP()", "model = CharMLP(ctx=16)"), g)
    assert g["model"].ctx == g["control"].ctx == g["fresh"].ctx == 16
    assert "same outputs: True" in out.getvalue()
    assert all(math.isfinite(v) for v in g["results"].values())


# --- 2. throughput_curves.ipynb keeps CPU runs with different thread counts apart ---------------

def test_throughput_notebook_table_keeps_cpu_runs_with_different_thread_counts_apart(tmp_path, monkeypatch):
    from sparse24.tools import bench

    torch.set_num_threads(1)
    s = bench.BenchSettings(torch.device("cpu"), [("64x128", 64, 128)], [1, 8], [torch.float32],
                            ["dense", "sparse24-reference"], repeats=2)
    one = bench.write_csv(bench.run_bench(s, progress=False), tmp_path / "cpu-1t" / "bench.csv")
    # the same CPU measured with 2 threads: the same rows, threads 2 and other speedups
    with open(one, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["threads"] = "2"
        if r["provider"] != "dense":
            r["speedup_vs_dense"] = repr(float(r["speedup_vs_dense"]) * 3)
    (tmp_path / "cpu-2t").mkdir()
    with open(tmp_path / "cpu-2t" / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    monkeypatch.setenv("SPARSE24_RESULTS", str(tmp_path))

    code = _code_cells("throughput_curves.ipynb")
    g, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        for c in code[:3]:  # find the CSVs, read them, print the device summary and the speedup table
            exec(c, g)
    text = out.getvalue()
    summary = next(line for line in text.splitlines() if "measurements from" in line)
    assert "1 thread" in summary and "2 threads" in summary, summary  # two machines named, not one
    expected = {(r["threads"], r["M"]): r["speedup_vs_dense"] for r in g["rows"] if r["provider"] != "dense"}
    assert len(expected) == 4
    table = [line for line in text.splitlines() if "/ float32 / 64x128" in line]
    assert len(table) == 4, text  # was 2: the 2-thread run's figures overwrote the 1-thread run's
    for line in table:
        threads = "2" if "2 threads" in line else "1"
        M, value = int(line.split()[-2]), float(line.split()[-1])
        assert value == pytest.approx(expected[(threads, M)], abs=1e-3)


# --- 4. eval_charlm.py --steps 1 ------------------------------------------------------------

@pytest.fixture
def eval_charlm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))  # its sibling modules
    return load_script("eval_charlm")


def test_eval_charlm_gradual_schedule_prunes_for_the_last_time_within_the_run(eval_charlm):
    E = eval_charlm
    for steps in range(2, 300):
        s = E._gradual_schedule(steps)
        assert 0 <= s["start_step"] < s["end_step"] <= steps - 1, (steps, s)  # train calls after_step(0..steps-1)
    with pytest.raises(ValueError, match="at least 2"):
        E._gradual_schedule(1)


def test_eval_charlm_refuses_steps_1_before_training(eval_charlm, capsys, monkeypatch):
    E = eval_charlm

    def started(*a, **k):
        raise AssertionError("main went on to the training runs")

    monkeypatch.setattr(E, "load_corpus", started)
    with pytest.raises(SystemExit) as e:
        E.main(["--steps", "1", "--out", "/nonexistent/never-written"])
    assert e.value.code == 2
    assert "--steps" in capsys.readouterr().err

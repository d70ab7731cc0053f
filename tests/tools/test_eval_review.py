"""Review fixes outside sparse24.evaluate: the demo's evaluate_bpc (which characters it scores, and a clear
error when there are none), a bench CSV saved with a UTF-8 BOM, and scripts/timings_report.py's checks."""
import json
import math

import pytest
import torch
from torch import nn

from sparse24.tools import bench, plot, tuning
from sparse24.tools.demo import evaluate_bpc


class Bigram(nn.Module):
    """(B, ctx) ids -> (B, V) next-character logits read from the last character only."""

    def __init__(self, V=11):
        super().__init__()
        self.table = nn.Embedding(V, V)

    def forward(self, x):
        return self.table(x[:, -1])


def test_evaluate_bpc_scores_the_first_n_chars_after_the_context_up_to_the_last_one():
    """It stopped one short: the last held-out character was never scored (ids of ctx + 2 scored 1 of 2)."""
    torch.manual_seed(0)
    model, ctx = Bigram(), 4
    ids = torch.randint(0, 11, (ctx + 6,), dtype=torch.uint8)
    logp = model.table.weight.detach().double().log_softmax(-1)

    def hand(chars):  # fp64 bits/char predicting ids[t] from ids[t - 1], t in chars
        return -sum(float(logp[int(ids[t - 1]), int(ids[t])]) for t in chars) / len(chars) / math.log(2)
    assert evaluate_bpc(model, ids, n_chars=100, ctx=ctx) == pytest.approx(hand(range(ctx, ctx + 6)), rel=1e-6)
    assert evaluate_bpc(model, ids, n_chars=3, ctx=ctx) == pytest.approx(hand(range(ctx, ctx + 3)), rel=1e-6)
    assert evaluate_bpc(model, ids[:ctx + 1], n_chars=5, ctx=ctx) == pytest.approx(hand([ctx]), rel=1e-6)


def test_evaluate_bpc_refuses_nothing_to_score():
    """Both gave a bare ZeroDivisionError."""
    ids = torch.randint(0, 11, (100,))
    with pytest.raises(ValueError, match="n_chars must be an int >= 1, got 0"):
        evaluate_bpc(Bigram(), ids, n_chars=0, ctx=4)
    with pytest.raises(ValueError, match=r"ids holds 4 characters: predicting one from the ctx = 4 before it "
                                         r"needs at least 5"):
        evaluate_bpc(Bigram(), ids[:4], n_chars=10, ctx=4)


def test_read_rows_accepts_a_csv_saved_with_a_utf8_bom(tmp_path):
    """Excel's 'CSV UTF-8' starts the file with a BOM: the first column read as '\\ufeffschema' and the
    file was called 'not a sparse24 bench CSV'."""
    s = bench.BenchSettings(torch.device("cpu"), [("64x128", 64, 128)], [1, 5], [torch.float32], ["dense"],
                            repeats=2)
    plain = bench.write_csv(bench.run_bench(s, progress=False), tmp_path / "plain.csv")
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert plot.read_rows([bom]) == plot.read_rows([plain])


def _timings(path, kernel_us=10.0, dense_us=16.0, config=None):
    cfg = tuning.builtin_config(1, 4096, 4096, 132, "decode", "float16")
    tuning.append_timings(path, "GPU X", [dict(m=1, n=4096, k=4096, dtype="float16", kernel="k",
                                               config=config or json.dumps(cfg.to_json()), kernel_us=kernel_us,
                                               dense_us=dense_us, status="ok")])
    return path


@pytest.mark.parametrize("column, value", [("kernel_us", "nan"), ("kernel_us", "inf"), ("dense_us", "nan"),
                                           ("kernel_us", "0"), ("kernel_us", "-3"), ("dense_us", "fast")])
def test_timings_report_refuses_impossible_timings(tmp_path, capsys, column, value):
    """A nan kernel_us was reported as 'nanx the best'."""
    from conftest import load_script
    path = _timings(tmp_path / "t.csv", **{column: value})
    assert load_script("timings_report").main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} line 2: {column} must be a positive finite number of microseconds (or empty), " \
           f"got {value!r}" in err


def test_timings_report_names_the_file_of_a_malformed_config(tmp_path, capsys):
    from conftest import load_script
    for bad, why in (("{not json", "is not JSON"), ("[1]", "a config must have exactly the keys")):
        path = _timings(tmp_path / f"{len(bad)}.csv", config=bad)
        assert load_script("timings_report").main([str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path} line 2: config {bad!r}" in err and why in err

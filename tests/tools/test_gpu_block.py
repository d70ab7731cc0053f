"""scripts/gpu_block.py (run by scripts/gpu_check.sh on a GPU) in its CPU smoke mode:
every variant, mode and phase runs and lands in block.csv / block.md, so the GPU
script cannot rot between GPU sessions."""
import csv

from conftest import load_script



def test_gpu_block_smoke(tmp_path):
    mod = load_script("gpu_block")
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "block.csv")))
    got = {(r["mode"], r["variant"], r["phase"]) for r in rows}
    variants = ("dense", "2:4 fp16", "2:4 int8")
    assert got == {(m, v, p) for m in ("eager", "compiled") for v in variants
                   for p in ("decode B=1", "decode B=3", "prefill T=20")} | {("eager", v, "decode B=32") for v in variants}
    for r in rows:
        assert float(r["tokens_per_s"]) > 0 and float(r["speedup_vs_dense"]) > 0
        assert float(r["max_abs_diff_vs_eager"]) < 1e-2          # compiled computes what eager does
        if r["mode"] == "eager":                                 # the dispatcher count of one call
            assert int(r["aten_ops_per_call"]) >= 7
    assert (tmp_path / "block.md").read_text().count("\n| ") == len(rows) + 1

"""scripts/gpu_probe.py's prefill step times what its rows name: ``prefill_us`` the untuned config
of ``prefill_config`` (the tile ``triton_dense_us`` runs), ``tuned_us`` the GPU's tuned entry of
``tuned_config``; and the sm_90 prebuild (``prefill_jobs``) compiles those. Run 4's ``prefill_us``
ran ``run_prefill`` without a config, which takes the H200 file's tuned entry: another tile than its
label and than the Triton GEMM it was compared with."""
import csv
import json
from pathlib import Path

import torch

from conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_times_the_configs_its_row_names(tmp_path, monkeypatch):
    """On CPU (--smoke, Triton's interpreter), with a stand-in tuned entry unlike the untuned
    config: every launch of the prefill kernel and of Triton's own GEMM is recorded with the
    config it got, and each row's two prefill launches (``prefill_us``, then ``tuned_us``) and its
    Triton GEMM must be the configs its ``prefill_config`` / ``tuned_config`` columns name."""
    from sparse24.ops.config_space import KernelConfig
    probe = load_script("gpu_probe")
    tuned = KernelConfig(kernel="prefill", block_m=32, block_n=128, block_k=64, num_warps=8, num_stages=2)
    assert all(probe.prefill_configs("fp16", 256, 256, m)[0] != tuned for m in (64, 80))
    monkeypatch.setattr(probe, "tuned_prefill_config", lambda weight, N, K, M, dev: tuned)
    prefills, denses = [], []
    real_prefill, real_dense = probe.launch.run_prefill, probe._triton_dense

    def run_prefill(x, values, meta, scale, bias, N, config=None, zero=None, group_size=0):
        prefills.append(config)
        return real_prefill(x, values, meta, scale, bias, N, config, zero, group_size)

    def triton_dense(x, w, cfg, kernels):
        denses.append(cfg)
        return real_dense(x, w, cfg, kernels)
    monkeypatch.setattr(probe.launch, "run_prefill", run_prefill)
    monkeypatch.setattr(probe, "_triton_dense", triton_dense)
    assert probe.main(["--smoke", "--only", "prefill", "--weights", "fp16", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "probe_prefill.csv")))
    assert [r["M"] for r in rows] == ["64", "80"]

    def name(cfg):
        return "None (the GPU's default)" if cfg is None else probe.config_name(cfg)
    # per row on CPU: one call of each timed path (_bench calls once); the Triton GEMM checked, then timed
    assert [name(c) for c in prefills] == [c for r in rows for c in (r["prefill_config"], r["tuned_config"])]
    assert [name(c) for c in denses] == [r["prefill_config"] for r in rows for _ in range(2)]
    assert all(r["tuned_config"] == probe.config_name(tuned) and float(r["tuned_us"]) > 0 for r in rows)
    assert all(float(r["prefill_us"]) > 0 and float(r["triton_dense_us"]) > 0 for r in rows)


def test_prefill_without_a_tuned_entry_leaves_the_tuned_columns_empty(tmp_path):
    """CPU has no tuned file: ``tuned_config`` empty, ``tuned_us`` NaN, nothing else lost."""
    probe = load_script("gpu_probe")
    assert probe.tuned_prefill_config("fp16", 256, 256, 80, torch.device("cpu")) is None
    assert probe.main(["--smoke", "--only", "prefill", "--weights", "fp16", "--ms", "80", "--out",
                       str(tmp_path)]) == 0
    (row,) = csv.DictReader(open(tmp_path / "probe_prefill.csv"))
    assert row["tuned_config"] == "" and row["tuned_us"] == "nan" and float(row["prefill_us"]) > 0


def test_prebuild_compiles_the_untuned_and_the_tuned_config_of_each_point():
    """``prefill_jobs`` (scripts/triton_prebuild.py collect --probe-ms): per point the untuned
    config ``prefill_us`` runs, the H200 file's tuned prefill entry ``tuned_us`` runs where the file
    has one for the point (exact at 4096 rows, nearest at 128; read here from the JSON), then the
    sparse tensor-core kernel's; no tuned entry at 4096x11008."""
    from sparse24.ops.config_space import KernelConfig
    probe = load_script("gpu_probe")
    entries = json.loads((ROOT / "autotune_configs/NVIDIA_H200/sparse24_matmul.json").read_text())["entries"]
    c = entries["4096,4096,4096,float16"]["config"]
    tuned = KernelConfig(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], c["SPLIT_K"], c["num_warps"],
                         c["num_stages"], kernel=c["KERNEL"])
    assert "4096,4096,11008,float16" not in entries
    jobs = probe.prefill_jobs([128, 4096], shapes=((4096, 4096), (4096, 11008)))
    by_point = {}
    for M, N, K, key, cfg in jobs:
        by_point.setdefault((N, K, M), []).append(cfg)
    for (N, K, M), cfgs in by_point.items():
        untuned, sp = probe.prefill_configs("fp16", N, K, M)
        assert cfgs[0] == untuned and cfgs[-1] == sp
        assert cfgs[1:-1] == ([tuned] if K == 4096 else []), (N, K, M)

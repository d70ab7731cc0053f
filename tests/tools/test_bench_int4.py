"""The bench's INT4 providers and the plot's INT4 byte ceiling: bytes as stored with the scales, results
checked against the INT4 weight's own dequantized form (the Triton INT4 provider interpreted here too)."""
import io

import pytest
import torch

from sparse24.tools import plot
from sparse24.tools.bench import BenchSettings, run_bench

CPU = torch.device("cpu")


def test_int4_rows_bytes_and_results():
    N, K = 64, 320  # 320 columns: 3 scale groups of 128, the last short
    s = BenchSettings(CPU, [("64x320", N, K)], [1, 3], [torch.float32],
                      ["dense", "sparse24-int4-reference", "sparse24-int4-auto", "sparse24-int4-triton"], repeats=2)
    log = io.StringIO()
    rows = run_bench(s, progress=False, log=log)
    assert [(r["M"], r["provider"]) for r in rows] == [(m, p) for m in (1, 3)
                                                      for p in ("dense", "sparse24-int4-reference")]
    # values K/4 + 2-bit slots K/8 bytes per row + an fp16 scale per row and group of 128 columns
    int4 = [r for r in rows if r["provider"] == "sparse24-int4-reference"]
    assert all(r["weight_bytes"] == N * K // 4 + N * K // 8 + 2 * N * 3 for r in int4)
    assert all(float(r["rel_err"]) < 1e-5 for r in rows)  # vs the dequantized weight: the right product
    notes = log.getvalue()
    assert "sparse24-int4-auto (float32): skipped, on CPU backend='auto' is the reference backend" in notes
    assert "sparse24-int4-triton (float32): skipped for 64x320: on CPU the kernel runs in Triton's interpreter" in notes


def test_int4_triton_rows_on_a_small_weight():
    """The INT4 decode kernel (interpreted on CPU) through the bench, checked against the dequantized weight."""
    s = BenchSettings(CPU, [("32x128", 32, 128)], [1], [torch.float32], ["dense", "sparse24-int4-triton"], repeats=1)
    rows = run_bench(s, progress=False, log=io.StringIO())
    assert [r["provider"] for r in rows] == ["dense", "sparse24-int4-triton"]
    assert float(rows[1]["rel_err"]) < 1e-5 and rows[1]["weight_bytes"] == 32 * 128 // 4 + 32 * 128 // 8 + 2 * 32


def test_int4_byte_ceiling():
    # fp16 bytes per weight / (values 1/4 + slots 1/8 + fp16 scale per 128 columns) = 2 / 0.390625
    assert plot.byte_ceiling("sparse24-int4-reference", "float16") == pytest.approx(5.12)
    assert plot.byte_ceiling("sparse24-int4-auto", "float32") == pytest.approx(10.24)
    fig = plot.figure([{**r, "device_type": "cpu", "device": "x", "threads": 1, "dtype": "float16", "shape": "s",
                        "N": 8, "K": 128, "weight_bytes": 1, "median_ms": 1, "tflops": 1, "gbps": 1}
                       for r in ({"M": m, "provider": p, "speedup_vs_dense": v}
                                 for p, v in (("dense", 1.0), ("sparse24-int4-reference", 3.0)) for m in (1, 4))])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("byte ceiling 5.12x (int4 2:4 vs float16" in t for t in texts)

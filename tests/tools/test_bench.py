"""sparse24.tools.bench (measurement, CSV rows) and sparse24.tools.plot (reading CSVs, drawing)."""
import csv
import io

import pytest
import torch

from sparse24.tools import bench, plot
from sparse24.tools.bench import BenchSettings, run_bench, write_csv

CPU = torch.device("cpu")
TINY = [("64x128", 64, 128)]


def _rows(providers, ms=(1, 5), shapes=TINY, dtype=torch.float32, log=None):
    s = BenchSettings(CPU, list(shapes), list(ms), [dtype], list(providers), repeats=2)
    return run_bench(s, progress=False, log=log or io.StringIO())


def test_rows_hold_consistent_figures():
    provs = ["dense", "sparse24-reference", "sparse24-int8-reference", "sparse24-triton"]
    rows = _rows(provs)
    assert [(r["M"], r["provider"]) for r in rows] == [(m, p) for m in (1, 5) for p in provs]
    N, K = 64, 128
    # bytes as stored, from the format's definition: values + 2 bits per kept value (+ fp32 row scales)
    want_bytes = {"dense": N * K * 4, "sparse24-reference": N * K // 2 * 4 + N * K // 8,
                  "sparse24-triton": N * K // 2 * 4 + N * K // 8,
                  "sparse24-int8-reference": N * K // 2 + N * K // 8 + 4 * N}
    for r in rows:
        assert set(r) == set(bench.COLUMNS)
        assert r["schema"] == bench.SCHEMA and r["device_type"] == "cpu" and r["dtype"] == "float32"
        assert r["weight_bytes"] == want_bytes[r["provider"]]
        t = float(r["median_ms"]) * 1e-3
        assert t > 0
        M = r["M"]
        assert float(r["tflops"]) == pytest.approx(2 * M * N * K / t / 1e12, rel=1e-4)
        io_bytes = r["weight_bytes"] + 4 * M * (N + K)
        assert float(r["gbps"]) == pytest.approx(io_bytes / t / 1e9, rel=1e-4)
        assert float(r["rel_err"]) < 1e-5  # every provider computed the right product
    by = {(r["M"], r["provider"]): float(r["median_ms"]) for r in rows}
    for r in rows:
        want = by[(r["M"], "dense")] / by[(r["M"], r["provider"])]
        assert float(r["speedup_vs_dense"]) == pytest.approx(want, rel=1e-3)


def test_wrong_result_is_flagged(monkeypatch):
    # A provider that computes the wrong product must not pass silently.
    monkeypatch.setattr(bench, "linear", lambda x, p, backend: torch.zeros(x.shape[0], p.shape[0]))
    log = io.StringIO()
    rows = _rows(["dense", "sparse24-reference"], ms=(3,), log=log)
    bad = [r for r in rows if r["provider"] == "sparse24-reference"]
    assert float(bad[0]["rel_err"]) == pytest.approx(1.0)
    assert "WARNING: sparse24-reference 64x128 M=3: relative error" in log.getvalue()


def test_failing_provider_is_skipped_not_fatal(monkeypatch):
    def broken(x, p, backend):
        raise RuntimeError("no kernel image\nfor this device")
    monkeypatch.setattr(bench, "linear", broken)
    log = io.StringIO()
    rows = _rows(["dense", "sparse24-reference"], ms=(2,), log=log)
    assert [r["provider"] for r in rows] == ["dense"]
    assert "note: sparse24-reference 64x128 M=2: the call failed (no kernel image for this device); skipped" \
        in log.getvalue()
    monkeypatch.setattr(bench.F, "linear", lambda *a: broken(None, None, None))
    with pytest.raises(RuntimeError, match="no kernel image"):  # no baseline, no speedups: stop
        _rows(["dense"], ms=(2,))


def test_provider_planning_on_cpu():
    assert "CUDA only" in bench.provider_status("torch-semi-structured", CPU, torch.float16)
    assert "bfloat16" in bench.provider_status("sparse24-triton", CPU, torch.bfloat16)
    assert bench.provider_status("sparse24-reference", CPU, torch.bfloat16) == ""
    with pytest.raises(ValueError, match="unknown provider 'cusparse'"):
        bench.provider_status("cusparse", CPU, torch.float16)
    big = [("bert-base:768x768", 768, 768)] + TINY
    s = BenchSettings(CPU, big, [1], [torch.float32], ["sparse24-triton", "sparse24-reference"], 1)
    jobs, notes = bench.plan_providers(s, explicit=False)
    # dense is always measured first (speedups need it); the interpreter only gets the tiny weight
    assert [(j[1], j[4]) for j in jobs] == [("bert-base:768x768", "dense"), ("64x128", "dense"),
                                            ("64x128", "sparse24-triton"), ("bert-base:768x768", "sparse24-reference"),
                                            ("64x128", "sparse24-reference")]
    assert any("Triton's interpreter" in n and "bert-base:768x768" in n for n in notes)
    jobs, _ = bench.plan_providers(s, explicit=True)
    assert ("bert-base:768x768", "sparse24-triton") in [(j[1], j[4]) for j in jobs]


def test_default_settings_and_device_naming():
    cpu, cuda = bench.default_settings(CPU), bench.default_settings(torch.device("cuda"), quick=True)
    assert cpu["shapes"] == ["bert-base"] and cpu["dtypes"] == ["float32"]
    assert cuda["shapes"] == ["standard"] and cuda["dtypes"] == ["float16"] and 1 in cuda["ms"]
    assert bench.device_slug({"device_type": "cpu", "device": "AMD EPYC 7B13 64-Core Processor"}) == \
        "cpu-amd-epyc-7b13-64-core-processor"
    from sparse24.tools.tuning import gpu_file_name  # same folder names as the tuned-config files
    name = "NVIDIA H100 80GB HBM3"
    assert bench.device_slug({"device_type": "cuda", "device": name}) == gpu_file_name(name) == "NVIDIA_H100_80GB_HBM3"


def test_progress_bar_is_tqdm_on_stderr_and_can_be_turned_off(capsys):
    s = BenchSettings(CPU, TINY, [1, 5], [torch.float32], ["dense", "sparse24-reference"], repeats=2)
    run_bench(s, progress=True, log=io.StringIO())
    err = capsys.readouterr().err
    assert "bench: 100%" in err and "4/4" in err and "64x128 M=5" in err  # 2 providers x 2 M, last point named
    run_bench(s, progress=False, log=io.StringIO())
    run_bench(s, log=io.StringIO())  # default: only on a terminal (pytest's stderr is not one)
    assert capsys.readouterr().err == ""


def test_csv_round_trip_and_plot(tmp_path):
    rows = _rows(["dense", "sparse24-reference"])
    a = write_csv(rows, tmp_path / "a" / "bench.csv")
    other = [{**r, "device": "Other CPU"} for r in rows]  # a second machine, overlaid
    b = write_csv(other, tmp_path / "b.csv")
    back = plot.read_rows([a, b])
    assert len(back) == 2 * len(rows)
    assert back[0]["M"] == 1 and isinstance(back[0]["speedup_vs_dense"], float)
    png = plot.plot_csv([a, b], tmp_path / "fig" / "both.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from matplotlib.image import imread
    two_shapes = plot.plot_rows(rows + [{**r, "shape": "x", "N": 32} for r in rows], tmp_path / "two.png")
    assert imread(two_shapes).shape[0] > 1.5 * imread(png).shape[0]  # one row of panels per shape


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_read_rows_rejects_foreign_csvs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such CSV file"):
        plot.read_rows([tmp_path / "missing.csv"])
    foreign = _write(tmp_path / "f.csv", ["a", "b"], [[1, 2]])
    with pytest.raises(ValueError, match="is not a sparse24 bench CSV"):
        plot.read_rows([foreign])
    good = write_csv(_rows(["dense"], ms=(1,)), tmp_path / "g.csv")
    text = good.read_text().replace(bench.SCHEMA, "sparse24-bench/0")
    old = tmp_path / "old.csv"
    old.write_text(text)
    with pytest.raises(ValueError, match=r"schema 'sparse24-bench/0'.*re-run"):
        plot.read_rows([good, old])
    cols = [c for c in bench.COLUMNS if c != "gbps"]
    with open(good) as f:
        r = next(csv.DictReader(f))
    short = _write(tmp_path / "s.csv", cols, [[r[c] for c in cols]])
    with pytest.raises(ValueError, match=r"missing columns \['gbps'\]"):
        plot.read_rows([short])
    empty = _write(tmp_path / "e.csv", bench.COLUMNS, [])
    with pytest.raises(ValueError, match="no measurements"):
        plot.read_rows([empty])


def test_byte_ceilings():
    # dense bytes per element / stored bytes per dense element (values/2 + 2-bit index/2)
    assert plot.byte_ceiling("sparse24-triton", "float16") == pytest.approx(2 / 1.125)
    assert plot.byte_ceiling("torch-semi-structured", "bfloat16") == pytest.approx(2 / 1.125)
    assert plot.byte_ceiling("sparse24-int8-triton", "float16") == pytest.approx(3.2)
    assert plot.byte_ceiling("sparse24-reference", "float32") == pytest.approx(4 / 2.125)
    assert plot.byte_ceiling("dense", "float16") is None


@pytest.mark.parametrize("column, value, message", [
    ("tflops", "nan", "tflops must be a positive number, got 'nan'"),  # was drawn as a gap, exit 0
    ("speedup_vs_dense", "inf", "speedup_vs_dense must be a positive number"),  # was a matplotlib log-scale error
    ("M", "0", "M must be a positive integer, got '0'"),  # was drawn off a log axis, exit 0
    ("median_ms", "-1", "median_ms must be a positive number"),
    ("M", "1.5", "M must be a positive integer, got '1.5'"),
])
def test_read_rows_rejects_impossible_figures(tmp_path, column, value, message):
    rows = _rows(["dense"], ms=(1,))
    path = write_csv([{**rows[0], column: value}], tmp_path / "b.csv")
    with pytest.raises(ValueError, match=f"line 2: {message}"):
        plot.read_rows([path])


def test_read_rows_rejects_shifted_rows_and_duplicate_points(tmp_path):
    rows = _rows(["dense"], ms=(1, 2))
    good = write_csv(rows, tmp_path / "g.csv")
    lines = good.read_text().splitlines()
    extra = tmp_path / "x.csv"  # a cell too many: was read with the extra cell dropped
    extra.write_text("\n".join([lines[0], lines[1] + ",1", lines[2]]) + "\n")
    with pytest.raises(ValueError, match="x.csv line 2: the number of cells differs from the header's 20"):
        plot.read_rows([extra])
    # the same file named twice is read once; another run of the same device would draw
    # one zigzag line through two measurements per M
    assert len(plot.read_rows([good, tmp_path / "." / "g.csv"])) == 2
    again = write_csv(rows, tmp_path / "again.csv")
    with pytest.raises(ValueError, match=r"again.csv line 2: dense float32 64x128 M=1 on .* is already in .*g.csv"):
        plot.read_rows([good, again])


def test_failed_writes_leave_previous_files(tmp_path, monkeypatch):
    rows = _rows(["dense"], ms=(1,))
    path = write_csv(rows, tmp_path / "b.csv")
    before = path.read_bytes()
    with pytest.raises(ValueError):  # fails after the header was written
        write_csv(rows + [{**rows[0], "unknown": 1}], path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["b.csv"]
    png = plot.plot_rows(rows, tmp_path / "p.png")
    before = png.read_bytes()
    from matplotlib.figure import Figure

    def half(self, fname, **kw):
        open(fname, "wb").write(b"\x89PNG half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", half)
    with pytest.raises(OSError, match="No space"):
        plot.plot_rows(rows, png)
    assert png.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["b.csv", "p.png"]


def _synthetic(speedups: dict, dtype="float32"):
    """Bench rows with given speedups per provider at M = 1, 16, 128 (GFLOP/s scaled alike)."""
    rows = []
    for prov, sps in speedups.items():
        for M, sp in zip((1, 16, 128), sps):
            rows.append({"schema": bench.SCHEMA, "device_type": "cpu", "device": "X", "threads": 1, "dtype": dtype,
                         "shape": "s", "N": 64, "K": 64, "M": M, "provider": prov, "weight_bytes": 1,
                         "median_ms": 1.0, "tflops": 1e-3 * sp * M, "gbps": 1.0, "speedup_vs_dense": sp})
    return rows


def test_plot_axes_follow_the_data_and_the_legend_stays_outside():
    # a CPU: 0.04-0.6x measured, byte ceilings 1.88x and 6.4x (int8 vs fp32)
    fig = plot.figure(_synthetic({"dense": [1, 1, 1], "sparse24-reference": [0.04, 0.25, 0.6],
                                  "sparse24-int8-reference": [0.03, 0.2, 0.55]}))
    ax_t, ax_s = fig.axes[:2]
    assert ax_s.get_yscale() == "log" and ax_t.get_yscale() == "log"  # 0.03 .. 1: a wide range
    lo, hi = ax_s.get_ylim()
    assert lo < 0.03 and 1.88 < hi < 6.4  # the near ceiling is shown, the far one does not set the axis
    assert [round(l.get_ydata()[0], 2) for l in ax_s.lines if l.get_linestyle() == "--"] == [1.88]
    notes = [t.get_text() for t in ax_s.texts]
    assert any("far above" in t and "6.40x" in t for t in notes) and any("1.88x" in t for t in notes)
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1  # below the panels
    # a GPU-like range (0.8-1.6x, ceiling 1.78x): linear from zero, the ceiling drawn as a line
    fig = plot.figure(_synthetic({"dense": [1, 1, 1], "sparse24-triton": [1.6, 1.3, 0.8]}, "float16"))
    ax_s = fig.axes[1]
    assert ax_s.get_yscale() == "linear" and ax_s.get_ylim()[0] == 0 and ax_s.get_ylim()[1] > 1.78
    assert not any("far above" in t.get_text() for t in ax_s.texts)


def test_plot_tells_dtypes_apart():
    # one provider in two dtypes was drawn twice in the same colour, line and marker
    rows = _synthetic({"dense": [1, 1, 1], "sparse24-reference": [0.2, 0.3, 0.4]}, "float32") + \
        _synthetic({"dense": [1, 1, 1], "sparse24-reference": [0.3, 0.4, 0.5]}, "float16")
    fig = plot.figure(rows)
    lines = [l for l in fig.axes[0].lines if l.get_label().startswith("dense")]
    assert sorted(l.get_label() for l in lines) == ["dense float16", "dense float32"]
    looks = {(l.get_color(), l.get_linestyle(), l.get_marker()) for l in fig.axes[0].lines}
    assert len(looks) == len(fig.axes[0].lines) == 4

"""Review of the tuned-config files (sparse24.tools.tuning, sparse24.ops.config_store) and of the
plot's ceiling notes: concurrent writers, entries an older Triton cannot run, files a merge must not
overwrite, CPU files, BOMs and duplicate keys, an unwritable --out-dir, notes kept inside their panel."""
import json
import multiprocessing
import os
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch

from sparse24.ops import config_store
from sparse24.tools import tuning
from sparse24.tools.cli import main
from sparse24.tools.tuning import KernelConfig

from test_tuning import fake_sm90, isolated  # noqa: F401  (isolated: autouse fixture)

GPU = "Fake GPU H1 80GB"
CFG = KernelConfig(16, 64, 128, 8, 1, 4, 3)
DEC = KernelConfig(16, 64, 256, 1, 8, 4, 1, kernel="decode")
WIDE = KernelConfig(128, 256, 64, 8, 1, 8, 2, kernel="prefill")   # BLOCK_N 256: Triton >= 3.6 only


@pytest.fixture
def fake_gpu(monkeypatch):
    """test_tuning's fake sm_90 GPU; tuning a key only records it (returns the keys timed)."""
    fake_sm90(monkeypatch, GPU)
    timed = []
    monkeypatch.setattr(tuning, "tune_key", lambda *key, **kw: timed.append(key[:4]) or SimpleNamespace(
        entry={"config": DEC, "kernel_us": 1.0, "dense_us": 2.0}))
    return timed


def _entry(cfg, us=5.0):
    return {"config": cfg, "kernel_us": us, "dense_us": 2 * us}


def _file(folder, gpu=GPU):
    return folder / tuning.gpu_file_name(gpu) / "sparse24_matmul.json"


# --- 1. concurrent writers --------------------------------------------------------------------

def _writer(folder, wid, n, barrier, errors):
    torch.set_num_threads(1)
    barrier.wait()   # every process imported and ready: the writes overlap
    for i in range(n):
        key = (16, 64 * (wid * 100 + i + 1), 4096, "float32")
        try:
            tuning.write_entries(folder, GPU, (9, 0), {key: _entry(CFG)})
        except Exception as e:   # reported to the test, which fails on it
            errors.put(f"writer {wid}: {type(e).__name__}: {e}")


def test_concurrent_writers_keep_every_entry(tmp_path):
    """One autotune per GPU of a node, all merging into one per-model file: every entry survives,
    no writer fails, and nothing is left but the file and its lock (no temp, no '.corrupt')."""
    ctx = multiprocessing.get_context("spawn")
    W, n = 3, 8
    barrier, errors = ctx.Barrier(W), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, n, barrier, errors)) for w in range(W)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * W
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
    path = _file(tmp_path)
    assert len(json.loads(path.read_text())["entries"]) == W * n
    assert sorted(p.name for p in path.parent.iterdir()) == ["sparse24_matmul.json", "sparse24_matmul.json.lock"]


def test_corrupt_copies_are_never_overwritten(tmp_path, capsys):
    """A file that is not JSON is moved aside; a second one later does not replace the first copy."""
    path = tuning.write_entries(tmp_path, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG)})
    kept = []
    for text in ("garbage one", "garbage two"):
        path.write_text(text)
        tuning.write_entries(tmp_path, GPU, (9, 0), {(2, 64, 64, "float16"): _entry(CFG)})
        kept.append(text)
    copies = sorted(p for p in path.parent.iterdir() if ".corrupt" in p.name)
    assert sorted(p.read_text() for p in copies) == kept
    assert "was unreadable" in capsys.readouterr().err


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tuning.write_entries(tmp_path, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG)})
    before = path.read_bytes()

    def fail(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)   # (Path.replace calls it too)
    with pytest.raises(OSError, match="No space left"):
        tuning.write_entries(tmp_path, GPU, (9, 0), {(2, 64, 64, "float16"): _entry(CFG)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["sparse24_matmul.json", "sparse24_matmul.json.lock"]
    assert path.stat().st_mode & 0o444 == 0o444   # readable as before (a temp file is made 0600)


# --- 2. entries this Triton cannot run; files a merge must not overwrite -------------------------

def test_an_entry_this_triton_cannot_run_is_skipped_not_the_file(isolated, monkeypatch):
    """A file tuned with Triton >= 3.6 holding one BLOCK_N-256 prefill entry, read where Triton
    runs no such tile: that entry is skipped with one warning naming it, the others are used, and
    a merge keeps it verbatim (the newer Triton still wants it)."""
    import sparse24.kernels.sparse24_prefill as kernel
    wide_key = (4096, 5120, 5120, "float16")
    entries = {(1, 5120, 5120, "float16"): _entry(DEC), wide_key: _entry(WIDE, 400.0)}
    if kernel.natural_tile(128, 256):
        path = tuning.write_entries(isolated, GPU, (9, 0), entries)
    else:   # (an older Triton here: the file as a newer one wrote it)
        path = _file(isolated)
        path.parent.mkdir()
        data = {"schema": 2, "kernel": "sparse24_matmul", "gpu": GPU, "compute_capability": [9, 0],
                "triton": "3.6.0", "torch": "2.11.0", "default": DEC.to_json(),
                "entries": {",".join(map(str, k)): dict(e, config=e["config"].to_json()) for k, e in entries.items()}}
        path.write_text(json.dumps(data))
    wide_json = json.loads(path.read_text())["entries"]["4096,5120,5120,float16"]
    monkeypatch.setattr(kernel, "natural_tile", lambda bm, bn: False)
    tuning.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuning.lookup(1, 5120, 5120, "float16", GPU, (9, 0), layout="decode").kind == "exact"
        wide = tuning.lookup(4096, 5120, 5120, "float16", GPU, (9, 0), layout="decode", kernel="prefill")
        tuning.clear_cache()   # read again: no second warning
        tuning.lookup(1, 5120, 5120, "float16", GPU, (9, 0), layout="decode")
    assert wide.config != WIDE and wide.kind == "builtin"
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "'4096,5120,5120,float16'" in msgs[0] and "needs Triton >= 3.6" in msgs[0], msgs
    assert tuning.validate_dir(isolated) == []   # the file is valid; one entry does not run here
    # a merge from this environment keeps every entry, the one it cannot run verbatim
    tuning.write_entries(isolated, GPU, (9, 0), {(16, 5120, 5120, "float16"): _entry(DEC)})
    after = json.loads(path.read_text())["entries"]
    assert set(after) == {"1,5120,5120,float16", "16,5120,5120,float16", "4096,5120,5120,float16"}
    assert after["4096,5120,5120,float16"] == wide_json
    assert not [p for p in path.parent.iterdir() if ".corrupt" in p.name]
    # a new entry this Triton cannot run is still refused (the tuner never times one)
    with pytest.raises(ValueError, match="needs Triton >= 3.6"):
        tuning.write_entries(isolated, GPU, (9, 0), {(2048, 5120, 5120, "float16"): _entry(WIDE)})


@pytest.mark.parametrize("change", ["newer schema", "bad entry", "duplicate key"])
def test_a_file_that_parses_but_fails_validation_is_not_overwritten(tmp_path, change, capsys, fake_gpu):
    path = tuning.write_entries(tmp_path, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG)})
    data = json.loads(path.read_text())
    if change == "newer schema":
        text = json.dumps(dict(data, schema=3, extra_field=1))
    elif change == "bad entry":
        text = json.dumps(dict(data, entries={"3,64,64,float16": data["entries"]["1,64,64,float16"]}))
    else:
        one = json.dumps(data["entries"]["1,64,64,float16"])
        text = json.dumps(dict(data, entries={})).replace('"entries": {}', f'"entries": {{"1,64,64,float16": {one}, '
                                                                           f'"1,64,64,float16": {one}}}')
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        tuning.write_entries(tmp_path, GPU, (9, 0), {(2, 64, 64, "float16"): _entry(CFG)})
    assert str(path) in str(err.value) and "nothing was written" in str(err.value)
    assert path.read_text() == text and not [p for p in path.parent.iterdir() if ".corrupt" in p.name]
    # autotune says so before it tunes anything (exit 2: bad input)
    assert tuning.autotune([("x", 64, 64)], [1], ["float16"], tmp_path) == 2
    assert fake_gpu == [] and path.read_text() == text
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sparse24 autotune: error: ") and str(path) in err[0]


# --- 3. CPU files, BOMs, duplicate keys -----------------------------------------------------------

def test_a_cpu_file_serves_cpu_tensors_and_is_described(tmp_path, monkeypatch):
    """A file whose gpu is "cpu" is the CPU device's own file (the interpreter runs its entries):
    the docstrings and describe_config_source say so."""
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    cfg = KernelConfig(16, 32, 64, 4, 1, 2, 2)
    path = tuning.write_entries(tmp_path, "cpu", (0, 0), {(4, 64, 128, "float32"): _entry(cfg)})
    assert config_store.get_choice(3, 64, 128, "float32", "cpu").kind == "exact"
    text = tuning.describe_config_source("cpu")
    assert str(path) in text and "1 entries" in text
    assert '"cpu"' in config_store.get_choice.__doc__
    monkeypatch.delenv("SPARSE24_CONFIG_DIR")
    tuning.clear_cache()
    assert "built-in" in tuning.describe_config_source("cpu")


def test_a_file_saved_with_a_bom_is_read(isolated):
    path = tuning.write_entries(isolated, GPU, (9, 0), {(16, 64, 64, "float16"): _entry(CFG)})
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())   # a Windows editor's "UTF-8 with BOM"
    tuning.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.lookup(16, 64, 64, "float16", GPU, (9, 0)).kind == "exact"
    assert tuning.validate_dir(isolated) == [] and tuning.tuned_keys(isolated, GPU) == {(16, 64, 64, "float16")}
    tuning.write_entries(isolated, GPU, (9, 0), {(1, 64, 64, "float16"): _entry(CFG)})   # merged, not set aside
    assert len(json.loads(path.read_text())["entries"]) == 2


def test_a_key_written_twice_is_refused(isolated):
    path = tuning.write_entries(isolated, GPU, (9, 0), {(16, 64, 64, "float16"): _entry(CFG)})
    data = json.loads(path.read_text())
    slow = json.dumps(dict(data["entries"]["16,64,64,float16"], kernel_us=99.0))
    text = json.dumps(data)
    path.write_text(text[:-2] + f', "16,64,64,float16": {slow}' + text[-2:])   # the same entry again, last
    assert text[-2:] == "}}"
    tuning.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = tuning.lookup(16, 64, 64, "float16", GPU, (9, 0))
    assert choice.kind == "builtin"
    (msg,) = [str(w.message) for w in caught]
    assert str(path) in msg and "'16,64,64,float16'" in msg and "twice" in msg
    (problem,) = tuning.validate_dir(isolated)
    assert "'16,64,64,float16'" in problem[1]


# --- 4. an unwritable --out-dir is found before tuning ---------------------------------------------

def test_autotune_checks_out_dir_is_writable_before_tuning(tmp_path, capsys, monkeypatch, fake_gpu):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    ro = tmp_path / "read-only"
    ro.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):   # read-only for everyone (root writes through chmod 555)
        if str(dir).startswith(str(ro)):
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    for out in (ro, ro / "new" / "configs", blocker / "configs"):
        assert tuning.autotune([("x", 64, 64)], [1], ["float16"], out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sparse24 autotune: error: ") and "cannot write" in err[0], err
        assert fake_gpu == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "read-only", "shipped"] and not list(ro.iterdir())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # checked before the GPU, as bench does
    assert main(["autotune", "--out-dir", str(ro)]) == 2
    assert "cannot write" in capsys.readouterr().err
    ok = tmp_path / "ok"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tuning.autotune([("x", 64, 64)], [1], ["float16"], ok) == 0 and fake_gpu == [(1, 64, 64, "float16")]


# --- 5. the plot's ceiling notes stay inside their panel ---------------------------------------------

# r3's CSV (bench --dtype float32,float16, 5 providers, CPU): dtype, M, provider, tflops, speedup
_R3 = """float32 1 dense 0.00607624 1|float32 1 sparse24-triton 5.26851e-08 8.6707e-06
float32 1 sparse24-reference 8.70061e-05 0.014319|float32 1 sparse24-int8-triton 5.44545e-08 8.9619e-06
float32 1 sparse24-int4-reference 6.04345e-06 0.0009946|float32 8 dense 0.0318422 1
float32 8 sparse24-triton 7.2833e-07 2.2873e-05|float32 8 sparse24-reference 6.58085e-05 0.0020667
float32 8 sparse24-int8-triton 6.7856e-07 2.131e-05|float32 8 sparse24-int4-reference 0.000365537 0.01148
float16 1 dense 0.00433744 1|float16 1 sparse24-triton 6.38812e-08 1.4728e-05
float16 1 sparse24-reference 8.84072e-05 0.020382|float16 1 sparse24-int8-triton 5.66833e-08 1.3068e-05
float16 1 sparse24-int4-reference 3.18547e-06 0.00073441|float16 8 dense 0.00868378 1
float16 8 sparse24-triton 4.77611e-07 5.5e-05|float16 8 sparse24-reference 0.000559236 0.0644
float16 8 sparse24-int8-triton 4.93446e-07 5.6824e-05|float16 8 sparse24-int4-reference 2.50411e-05 0.0028837"""


def _rows(table, device_type="cpu"):
    rows = []
    for item in table.replace("\n", "|").split("|"):
        dtype, M, provider, tflops, speedup = item.split()
        rows.append(dict(device_type=device_type, device="AMD EPYC" if device_type == "cpu" else "NVIDIA H200",
                         threads="1", dtype=dtype, shape="64x128", N=64, K=128, M=int(M), provider=provider,
                         weight_bytes=1, median_ms=1.0, tflops=float(tflops), gbps=1.0,
                         speedup_vs_dense=float(speedup)))
    return rows


# a GPU's fp16 / bf16 sweep: three ceilings at 1.78x (fp16 and bf16 2:4 on one line), INT8's 3.2x near
_GPU = """float16 1 dense 1 1|float16 1 sparse24-triton 1 1.5|float16 1 sparse24-int8-triton 1 2.4
float16 64 dense 1 1|float16 64 sparse24-triton 1 1.1|float16 64 sparse24-int8-triton 1 1.3
bfloat16 1 dense 1 1|bfloat16 1 sparse24-triton 1 1.45|bfloat16 64 dense 1 1|bfloat16 64 sparse24-triton 1 1.0"""
# a CPU at 0.03-0.6x: 1.88x near, INT8's 6.4x vs fp32 far above
_FAR = """float32 1 dense 1 1|float32 1 sparse24-reference 1 0.04|float32 1 sparse24-int8-reference 1 0.03
float32 64 dense 1 1|float32 64 sparse24-reference 1 0.6|float32 64 sparse24-int8-reference 1 0.5"""


@pytest.mark.parametrize("table,device_type", [(_R3, "cpu"), (_GPU, "cuda"), (_FAR, "cpu")],
                         ids=["r3-cpu", "gpu", "far"])
def test_ceiling_notes_stay_inside_their_panel_and_apart(table, device_type):
    """Every byte ceiling is a line on the axis (labelled; lines too close for a label each share
    one) or named in the note at the top, when the axis stops below it; no note leaves the
    speedup panel (r3's ran across the other panel) or covers another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from sparse24.tools.plot import byte_ceiling, figure
    rows = _rows(table, device_type)
    fig = figure(rows)
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax_t, ax_s = fig.axes[:2]
    panel = ax_s.get_window_extent(r)
    notes = [t for t in ax_s.texts if "ceiling" in t.get_text()]
    boxes = [t.get_window_extent(r) for t in notes]
    for t, b in zip(notes, boxes):
        assert panel.x0 <= b.x0 and b.x1 <= panel.x1 and panel.y0 <= b.y0 and b.y1 <= panel.y1 + 1, \
            (t.get_text(), b, panel)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), [t.get_text() for t in notes]
    assert ax_t.get_window_extent(r).x1 < panel.x0
    top = ax_s.get_ylim()[1]
    lines = {round(line.get_ydata()[0], 2) for line in ax_s.lines if line.get_linestyle() == "--"}
    far = " ".join(t.get_text() for t in notes if t.get_text().startswith("far above")).replace("\n", " ")
    text = " ".join(t.get_text() for t in notes).replace("\n", " ")
    for c in {round(byte_ceiling(row["provider"], row["dtype"]), 2) for row in rows if row["provider"] != "dense"}:
        assert (c in lines and c < top) != (f"{c:.2f}x" in far and c > top), (c, top, lines, far)
        assert f"{c:.2f}x" in text
    assert bool(far) == (table == _FAR)

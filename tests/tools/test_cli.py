"""The command line: every subcommand, its outputs, and one-line errors with non-zero exits."""
import csv
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24.tools.cli import main

from conftest import load_script


@pytest.fixture(autouse=True)
def keep_threads():
    # bench --threads and demo --threads set torch's global thread count; restore it for other tests
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(err, *needles):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and ": error: " in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


# --- info / bench / plot -----------------------------------------------------------------

def test_info(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0
    assert f"sparse24 {sparse24.__version__} | torch {torch.__version__}" in out
    for needle in ("backends:", "reference", "torch semi-structured", "int8 weights", "tuned kernel configs:"):
        assert needle in out
    if not torch.cuda.is_available():  # this machine: say why each GPU path is not there
        assert "GPU: none" in out and "interpreter only" in out and "need CUDA" in out
        assert "not a CUDA device" in out  # from sparse24.tools.tuning.describe_config_source


def test_bench_writes_csv_png_and_env(capsys, tmp_path):
    rc, out, err = run(capsys, "bench", "--device", "cpu", "--shapes", "64,128", "--m", "1,3", "--repeats", "2",
                       "--threads", "1", "--out", str(tmp_path))
    assert rc == 0, err
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    provs = {r["provider"] for r in rows}
    # a tiny weight: the Triton interpreter is timed too; torch's semi-structured path needs CUDA
    assert {"dense", "sparse24-reference", "sparse24-triton", "sparse24-int8-reference"} <= provs
    assert "torch-semi-structured" not in provs and "CUDA only" in err
    assert sorted({int(r["M"]) for r in rows}) == [1, 3] and {r["threads"] for r in rows} == {"1"}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    env = (tmp_path / "bench.txt").read_text()
    assert "load average" in env and "1 torch threads" in env
    assert "speedup vs dense" in out and f"CSV:  {tmp_path / 'bench.csv'}" in out
    assert "100%|" not in err  # no progress bar when stderr is no terminal (--progress forces one)

    png = tmp_path / "again.png"
    rc, out, _ = run(capsys, "plot", str(tmp_path / "bench.csv"), str(tmp_path / "bench.csv"), "--out", str(png),
                     "--title", "two runs")
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG" and str(png) in out


@pytest.mark.parametrize("argv, code, needles", [
    (["bench", "--shapes", "llama-9b"], 2, ["unknown shape 'llama-9b'", "llama-7b"]),
    (["bench", "--shapes", "64,130"], 2, ["divisible by 4"]),
    (["bench", "--m", "1,0"], 2, ["--m needs positive integers"]),
    (["bench", "--m", "1,x"], 2, ["--m needs comma-separated integers"]),
    (["bench", "--dtype", "float8"], 2, ["unknown --dtype float8"]),
    (["bench", "--providers", "dense,cusparse"], 2, ["unknown provider cusparse"]),
    (["bench", "--device", "tpu"], 2, ["--device must be cpu or cuda"]),
    (["bench", "--repeats", "0"], 2, ["--repeats must be >= 1"]),
    # empty lists were taken as "the defaults": a full sweep instead of an error
    (["bench", "--m", ""], 2, ["--m needs positive integers, got ''"]),
    (["bench", "--dtype", ""], 2, ["unknown --dtype ''"]),
    (["bench", "--providers", ""], 2, ["unknown provider ''"]),
    (["bench", "--threads", "100000"], 2, ["--threads must be between 1 and", "logical CPUs"]),  # was exit 139
    # too big for memory: was an allocator traceback, or a torch overflow paragraph, mid-sweep
    (["bench", "--shapes", "4096,4096", "--m", "100000000"], 2, ["needs over", "GiB", "smaller --m"]),
    (["bench", "--shapes", "64,128", "--m", "99999999999999999999"], 2, ["needs over", "GiB"]),
    # CPU: a dense-only CSV with exit 0 for providers that never ran
    (["bench", "--providers", "sparse24-auto,torch-semi-structured"], 1, ["none of the named providers runs here",
                                                                         "CUDA only"]),
    (["plot", "missing.csv", "--out", "x.png"], 2, ["no such CSV file: missing.csv"]),
    (["plot", "a.csv", "--out", "x.jpg"], 2, ["--out must name a .png"]),
    (["plot", "a.csv"], 2, ["--out", "required"]),
    (["prune", "missing.pt", "--out", "x.pt"], 2, ["no such checkpoint file: missing.pt"]),
    (["prune", "a.pt", "--out", "b.pt", "--method", "wanda"], 2,
     ["--method wanda runs calibration text through the model", "needs a Hugging Face model folder"]),
    (["prune", "a.pt", "--out", "b.pt", "--method", "wanda", "--calibration-ids", "c.pt"], 2,
     ["takes a Hugging Face model folder"]),
    (["prune", "a.pt", "--out", "b.pt", "--method", "layerwise", "--calibration-ids", "c.pt"], 2,
     ["takes --method wanda or sparsegpt, not layerwise"]),
    (["prune", "a.pt", "--out", "b.pt", "--method", "wanda", "--calibration-ids", "c.pt", "--noise", "2"], 2,
     ["give it without --calibration, --permute and --noise"]),
    (["prune", "a.pt", "--out", "b.pt", "--min-features", "x"], 2, ["invalid int value: 'x'"]),
    (["prune", "a.pt", "--out", "."], 2, ["--out .: is a folder"]),  # was a torch.save traceback
    (["frobnicate"], 2, ["invalid choice: 'frobnicate'"]),
    ([], 2, ["required"]),
])
def test_user_errors_are_one_line(capsys, tmp_path, monkeypatch, argv, code, needles):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *argv)
    assert rc == code
    assert_one_line_error(err, *needles)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cuda_without_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine must say the same
    rc, _, err = run(capsys, "bench", "--device", "cuda", "--out", str(tmp_path / "x"))
    assert rc == 1
    assert_one_line_error(err, "--device cuda: no CUDA GPU is visible", "use --device cpu")
    assert not (tmp_path / "x").exists()


def _tiny_bench(capsys, out, *extra):
    return run(capsys, "bench", "--shapes", "64,128", "--m", "1", "--repeats", "1", "--threads", "1",
               "--providers", "dense,sparse24-reference", "--out", str(out), *extra)


def test_bench_failure_keeps_previous_results(capsys, tmp_path, monkeypatch):
    rc, _, err = _tiny_bench(capsys, tmp_path)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_disk(rows, path, title=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("sparse24.tools.plot.plot_rows", no_disk)
    rc, _, err = _tiny_bench(capsys, tmp_path, "--m", "1,2")
    assert rc == 2
    assert_one_line_error(err.splitlines()[-1], "No space left on device")
    # not a new CSV beside the old plot: the previous run's files, whole, and no temporaries; what the
    # failed run measured stays in bench.partial.csv
    partial = tmp_path / "bench.partial.csv"
    assert sorted({int(r["M"]) for r in csv.DictReader(partial.open())}) == [1, 2]
    partial.unlink()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_bench_stopped_early_keeps_its_rows(capsys, tmp_path, monkeypatch):
    """A sweep stopped after its first point (a GPU job's time limit) leaves that point's rows in
    bench.partial.csv; a finished sweep leaves none."""
    from sparse24.tools import bench
    measure, points = bench._measure_point, []

    def stop_at_the_second(*a, **kw):
        if points:
            raise KeyboardInterrupt
        points.append(1)
        return measure(*a, **kw)
    monkeypatch.setattr(bench, "_measure_point", stop_at_the_second)
    rc, _, err = _tiny_bench(capsys, tmp_path, "--m", "1,2")
    assert rc == 130 and "interrupted" in err
    rows = list(csv.DictReader((tmp_path / "bench.partial.csv").open()))
    assert rows and {r["M"] for r in rows} == {"1"} and {"dense", "sparse24-reference"} <= {r["provider"] for r in rows}
    assert not (tmp_path / "bench.csv").exists()
    monkeypatch.setattr(bench, "_measure_point", measure)
    rc, _, err = _tiny_bench(capsys, tmp_path, "--m", "1,2")
    assert rc == 0, err
    assert not (tmp_path / "bench.partial.csv").exists() and (tmp_path / "bench.csv").exists()


def test_bench_checks_its_outputs_before_the_sweep(capsys, tmp_path):
    (tmp_path / "bench.txt").mkdir()
    rc, _, err = _tiny_bench(capsys, tmp_path)
    assert rc == 2
    assert_one_line_error(err.splitlines()[-1], "cannot write bench.csv, bench.txt, bench.partial.csv, bench.png there")
    assert "bench [" not in err  # nothing measured
    assert [p.name for p in tmp_path.iterdir()] == ["bench.txt"]


def test_bench_repeated_values_are_measured_once(capsys, tmp_path):
    rc, _, err = _tiny_bench(capsys, tmp_path, "--m", "1,1", "--dtype", "float32,float32", "--no-plot")
    assert rc == 0, err
    with open(tmp_path / "bench.csv") as f:
        assert [(r["M"], r["provider"]) for r in csv.DictReader(f)] == [("1", "dense"), ("1", "sparse24-reference")]


def test_out_of_memory_is_one_line(capsys, tmp_path, monkeypatch):
    from sparse24.tools import bench

    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 40000000000000 bytes.")
    monkeypatch.setattr(bench, "run_bench", oom)
    rc, _, err = _tiny_bench(capsys, tmp_path)
    assert rc == 1
    assert_one_line_error(err.splitlines()[-1], "out of memory", "can't allocate memory", "smaller --m")
    def bug(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(bench, "run_bench", bug)
    with pytest.raises(RuntimeError, match="a bug"):  # other RuntimeErrors are bugs: their traceback stays
        main(["bench", "--shapes", "64,128", "--m", "1", "--out", str(tmp_path)])


def test_plot_out_is_a_folder(capsys, tmp_path):
    (tmp_path / "x.png").mkdir()
    rc, _, err = run(capsys, "plot", "a.csv", "--out", str(tmp_path / "x.png"))
    assert rc == 2
    assert_one_line_error(err, "is a folder")
    (tmp_path / "afile").write_text("")   # a file where the output's folder must be ("[Errno 17] File exists")
    csv_path = Path(__file__).resolve().parents[2] / "results" / "cpu-amd-epyc" / "bench.csv"
    rc, _, err = run(capsys, "plot", str(csv_path), "--out", str(tmp_path / "afile" / "x.png"))
    assert rc == 2
    assert_one_line_error(err, f"{tmp_path / 'afile'} is a file, not a folder")


def test_info_lists_invalid_tuned_files(capsys, tmp_path, monkeypatch):
    import warnings
    from sparse24.tools import tuning
    bad = tmp_path / "Some_GPU" / "sparse24_matmul.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    tuning.clear_cache()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rc, out, err = run(capsys, "info")
    finally:
        tuning.clear_cache()
    assert rc == 0 and err == ""
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]  # was a 2-line warning, source included
    assert f"problem in {bad}: JSONDecodeError" in out


def test_plot_refuses_other_schema(capsys, tmp_path):
    from sparse24.tools import bench
    rows = bench.run_bench(bench.BenchSettings(torch.device("cpu"), [("64x128", 64, 128)], [1], [torch.float32],
                                               ["dense"], 1), progress=False)
    old = tmp_path / "old.csv"
    bench.write_csv([{**r, "schema": "sparse24-bench/0", "sparse24": "0.0.1"} for r in rows], old)
    rc, _, err = run(capsys, "plot", str(old), "--out", str(tmp_path / "p.png"))
    assert rc == 2
    assert_one_line_error(err, "schema 'sparse24-bench/0' (sparse24 0.0.1)", "re-run")
    assert not (tmp_path / "p.png").exists()


def test_python_m_entry_point(tmp_path):
    # the real process: exit status and a single stderr line, no traceback
    r = subprocess.run([sys.executable, "-m", "sparse24", "plot", str(tmp_path / "none.csv"), "--out",
                        str(tmp_path / "p.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"sparse24 plot: error: no such CSV file: {tmp_path / 'none.csv'}"


# --- autotune ----------------------------------------------------------------------------

def test_autotune_is_forwarded(capsys, monkeypatch):
    rc, _, err = run(capsys, "autotune", "--shapes", "nope")
    assert rc == 2 and "unknown shape 'nope'" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run(capsys, "autotune", "--shapes", "64,128", "--m", "1")
    assert rc == 1 and "no CUDA GPU" in err


# --- prune -------------------------------------------------------------------------------

def _topk_mask(w):
    """Independent 2:4 magnitude mask: the two largest |w| of each group of 4 (no ties in randn)."""
    g = w.abs().reshape(-1, 4)
    return torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True).view(w.shape)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.small = nn.Linear(64, 8)  # < min_features: stays dense
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 96, dropout=0.0, batch_first=True), 1)

    def forward(self, ids):
        h = self.enc(F.gelu(self.fc2(F.gelu(self.fc1(self.embed(ids))))))
        return self.small(h)


def _masked_reference(sd, quantize=False):
    """The dense model with every pruned weight multiplied by the independent mask
    (and, for INT8, rounded to per-row int8 steps as sparse24's format defines)."""
    ref = Net().eval()
    new = {}
    for k, v in sd.items():
        if k in ("fc1.weight", "fc2.weight", "enc.layers.0.linear1.weight", "enc.layers.0.linear2.weight",
                 "enc.layers.0.self_attn.out_proj.weight"):
            v = v * _topk_mask(v)
            if quantize and k.startswith("fc"):
                scale = v.abs().amax(1, keepdim=True) / 127
                v = torch.round(v / scale) * scale
        new[k] = v
    ref.load_state_dict(new)
    return ref


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_prune_checkpoint_loads_into_compressed_model(capsys, tmp_path, quantize):
    torch.manual_seed(0)
    dense = Net()
    sd = dense.state_dict()
    ck = tmp_path / "dense.pt"
    torch.save({"state_dict": sd}, ck)
    out = tmp_path / "sub" / "sparse.pt"
    rc, text, err = run(capsys, "prune", str(ck), "--out", str(out), *(["--quantize", quantize] if quantize else []))
    assert rc == 0, err
    pruned = torch.load(out, weights_only=True)
    # naming convention: compressed layers as Sparse24Linear holds them
    assert {"fc1.values", "fc1.meta", "fc2.values", "fc2.meta"} <= set(pruned)
    assert ("fc1.scale" in pruned) == (quantize == "int8") and "fc1.weight" not in pruned
    assert pruned["fc1.values"].shape == (128, 32) and pruned["fc1.meta"].shape == (2, 128)
    # layers whose parent reads .weight directly stay masked (weight + mask), as sparsify_ keeps them
    for name in ("enc.layers.0.linear1", "enc.layers.0.self_attn.out_proj"):
        assert pruned[name + ".mask"].dtype == torch.bool and name + ".values" not in pruned
    assert torch.equal(pruned["embed.weight"], sd["embed.weight"])  # embedding table kept
    assert torch.equal(pruned["small.weight"], sd["small.weight"])  # too small
    assert "(state dict under 'state_dict')" in text and "embedding table" in text and "too small" in text

    model = Net()
    sparse24.sparsify_(model, mode="compressed", quantize=quantize)
    model.load_state_dict(pruned)  # strict: every key matches
    model.eval()
    ids = torch.randint(0, 50, (3, 7))
    ref = _masked_reference(sd, quantize == "int8")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-5)
        # and the pruning changed the function (the reference is not the dense model)
        assert (dense.eval()(ids) - ref(ids)).abs().max() > 1e-3
    assert out.stat().st_size < ck.stat().st_size


def test_prune_errors(capsys, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a checkpoint")
    rc, _, err = run(capsys, "prune", str(bad), "--out", str(tmp_path / "o.pt"))
    assert rc == 2
    assert_one_line_error(err, f"cannot read {bad} as a torch checkpoint")
    ck = tmp_path / "tiny.pt"
    torch.save(nn.Linear(8, 8).state_dict(), ck)
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(ck))
    assert rc == 2
    assert_one_line_error(err, "--out must differ from the input checkpoint")
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(tmp_path / "o.pt"))
    assert rc == 1
    assert_one_line_error(err, "no weight could be pruned")
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(tmp_path / "o.pt"), "--min-features", "-1")
    assert rc == 2
    assert_one_line_error(err, "--min-features must be >= 0")
    torch.save({"a": 1}, tmp_path / "obj.pt")
    rc, _, err = run(capsys, "prune", str(tmp_path / "obj.pt"), "--out", str(tmp_path / "o.pt"))
    assert rc == 2
    assert_one_line_error(err, "is not a state dict")
    assert not (tmp_path / "o.pt").exists()


def test_prune_bad_inputs_and_outputs(capsys, tmp_path, monkeypatch):
    ck = tmp_path / "lin.pt"
    torch.save(nn.Linear(64, 64).state_dict(), ck)
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(tmp_path))  # was a torch.save traceback
    assert rc == 2
    assert_one_line_error(err, "is a folder")
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(ck / "x.pt"))  # was "[Errno 17] File exists"
    assert rc == 2
    assert_one_line_error(err, "is a file, not a folder")
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(tmp_path / "new") + "/")  # wrote a file named "new"
    assert rc == 2 and not (tmp_path / "new").exists()
    assert_one_line_error(err, "is a folder; name the file to write")
    # a failed write leaves an existing output whole
    out = tmp_path / "o.pt"
    out.write_bytes(b"previous")

    def no_disk(obj, f, *a, **k):
        f.write(b"half")  # (prune saves through a file object: no temp name in the archive)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", no_disk)
    rc, _, err = run(capsys, "prune", str(ck), "--out", str(out))
    assert rc == 2 and "No space left on device" in err
    assert out.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["lin.pt", "o.pt"]
    monkeypatch.undo()

    import argparse
    torch.save({"state_dict": {"fc.weight": torch.randn(64, 64)}, "extra": argparse.Namespace()}, tmp_path / "obj.pt")
    rc, _, err = run(capsys, "prune", str(tmp_path / "obj.pt"), "--out", str(out))
    assert rc == 2  # was torch's paragraph cut at 200 characters, terminal escapes included
    assert_one_line_error(err, "holds objects other than tensors", "Namespace", "save model.state_dict() alone")

    class Payload:  # what a malicious checkpoint holds: a call unpickling would make
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)
    torch.save({"fc.weight": torch.randn(64, 64), "x": Payload()}, tmp_path / "evil.pt")
    rc, _, err = run(capsys, "prune", str(tmp_path / "evil.pt"), "--out", str(out))
    assert rc == 2 and not (tmp_path / "ran").exists()
    # said plainly, whole, and never torch's advice to load it with weights_only=False
    assert_one_line_error(err, "system)", "needs unrestricted unpickling, which can run arbitrary code",
                          "sparse24 refuses to do that", "save model.state_dict() alone")
    assert "weights_only" not in err
    (tmp_path / "empty.pt").write_bytes(b"")
    rc, _, err = run(capsys, "prune", str(tmp_path / "empty.pt"), "--out", str(out))
    assert rc == 2
    assert_one_line_error(err, "(empty file)")  # was "...checkpoint: " and nothing
    torch.save({"fc.weight": torch.randn(64, 64).to_sparse(), "g.weight": torch.randn(64, 64, device="meta")},
               tmp_path / "sparse.pt")
    rc, _, err = run(capsys, "prune", str(tmp_path / "sparse.pt"), "--out", str(out))
    assert rc == 1  # was a NotImplementedError traceback (a sparse tensor has no storage)
    assert_one_line_error(err, "no weight could be pruned")
    assert out.read_bytes() == b"previous"


def test_prune_does_not_overwrite_existing_entries():
    from sparse24.tools.cli import prune_state_dict
    values = torch.randn(3)
    new, report = prune_state_dict({"fc.weight": torch.randn(64, 64), "fc.values": values,
                                    "ok.weight": torch.randn(64, 64)})
    assert new["fc.values"] is values and "fc.meta" not in new  # fc.values was silently replaced
    assert [r["action"] for r in report] == ["kept dense", "compressed"]
    assert "already has fc.values" in report[0]["reason"]


def test_demo_reports_the_characters_it_scored(capsys, tmp_path, monkeypatch):
    from sparse24.tools import demo
    real = demo.load_corpus

    def small(max_files=None):
        tr, val, info = real(max_files=16)
        return tr, val[:500], {**info, "heldout_chars": 500}
    monkeypatch.setattr(demo, "load_corpus", small)
    rc, out, err = run(capsys, "demo", "--quick", "--steps", "1", "--eval-chars", "100000", "--no-control",
                       "--no-bench", "--threads", "1", "--out", str(tmp_path), "--progress")
    assert rc == 0, err
    with open(tmp_path / "results.csv") as f:  # was 100000: more than the 500 held-out characters exist
        assert {r["eval_chars"] for r in csv.DictReader(f)} == {str(500 - 32)}
    assert "scoring the first 468)" in out


def test_prune_skips_tied_weights():
    from sparse24.tools.cli import prune_state_dict
    w = torch.randn(64, 64)
    new, report = prune_state_dict({"dec.weight": w, "head.weight": w, "fc.weight": torch.randn(64, 64)})
    assert torch.equal(new["dec.weight"], w) and torch.equal(new["head.weight"], w)
    assert [r["action"] for r in report] == ["kept dense", "kept dense", "compressed"]
    assert "tied" in report[0]["reason"] and "head.weight" in report[0]["reason"]


def test_prune_finds_the_same_output_head_in_every_run(tmp_path):
    """The output head of a state dict (as many rows as the embedding table, the last 2-D weight) was
    taken from a set's order, which Python's string hashing changes per process: the same command kept
    'to_logits.weight' dense under PYTHONHASHSEED=3 and compressed it under 0-2 (and 4-7)."""
    g = torch.Generator().manual_seed(0)
    torch.save({"tok_emb.weight": torch.randn(96, 64, generator=g), "blocks.0.fc1.weight": torch.randn(128, 64, generator=g),
                "blocks.0.fc2.weight": torch.randn(64, 128, generator=g), "to_logits.weight": torch.randn(96, 64, generator=g)},
               tmp_path / "custom.pt")
    code = ("import sys, torch; from sparse24.tools.prune import prune_state_dict; "
            "_, rows = prune_state_dict(torch.load(sys.argv[1])); "
            "print([(r['name'], r['action']) for r in rows if r['name'] == 'to_logits.weight'])")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "custom.pt")], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"})
            for seed in range(4)]
    outs = {run.communicate(timeout=120)[0].strip() for run in runs}
    assert outs == {"[('to_logits.weight', 'kept dense')]"}, outs


def test_demo_thread_choice():
    from sparse24.tools.demo import _pick_threads
    n, note = _pick_threads("auto")
    assert 1 <= n <= max(1, torch.get_num_threads()) and (note.startswith("probe: 1 thread") or note == "one available")
    assert _pick_threads("1") == (1, "as asked")
    for bad in ("0", "many"):
        with pytest.raises(ValueError, match="--threads must be a positive integer or 'auto'"):
            _pick_threads(bad)
    with pytest.raises(ValueError, match="logical CPUs"):  # 100000 crashed the process
        _pick_threads(str(os.cpu_count() + 1))


# --- demo --------------------------------------------------------------------------------

def test_demo_tiny(capsys, tmp_path):
    rc, out, err = run(capsys, "demo", "--quick", "--steps", "4", "--eval-chars", "600", "--no-control",
                       "--threads", "1", "--out", str(tmp_path), "--progress")
    assert rc == 0, err
    with open(tmp_path / "results.csv") as f:
        res = {r["model"]: float(r["bpc"]) for r in csv.DictReader(f)}
    assert len(res) == 5 and all(0 < v < 8 for v in res.values())
    # swapping in the compressed weights does not change the model's function
    assert res["2:4 compressed + swapped (fp32 values)"] == pytest.approx(res["2:4 retrained, frozen mask"], abs=1e-4)
    for f in ("results.md", "bench.csv", "bench.png", "dense.pt", "sparse24.pt", "sparse24-int8.pt"):
        assert (tmp_path / f).is_file(), f
    assert (tmp_path / "sparse24.pt").stat().st_size < 0.6 * (tmp_path / "dense.pt").stat().st_size
    assert f"results: {tmp_path / 'results.md'}" in out and "bench.png" in out
    assert "| dense |" in (tmp_path / "results.md").read_text()
    assert "dense training: 100%" in err and "4/4" in err and "bench: 100%" in err  # --progress: tqdm bars


GPU_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def _gpu_check_commands() -> dict[str, list[str]]:
    """The steps of scripts/gpu_check.sh that run sparse24 or a script, variables filled in."""
    import re
    import shlex
    text = GPU_CHECK.read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^([A-Z_]+)=([^$\s]+)$", text, re.M))
    # NAME=${NAME:-default}: the default (what a plain `bash scripts/gpu_check.sh` runs)
    variables.update(re.findall(r"^([A-Z_]+)=\$\{[A-Z_]+:-([^}]*)\}", text, re.M))
    cmds = {}
    for line in text.splitlines():
        line = line.strip()   # (a step inside an if: ksweep)
        if not line.startswith("step "):
            continue
        for name, value in variables.items():   # "$NAME" and $NAME (not $NAMEMORE)
            line = re.sub(r'"?\$' + name + r'(?![A-Za-z0-9_])"?', lambda _: value, line)
        words = shlex.split(line.replace('"$RES/"', "RES").replace('"$RES/', '"RES/'))
        if "sparse24" in words:
            cmds[words[1]] = words[words.index("sparse24") + 1:]
        elif any(w.endswith(".py") for w in words):
            script = next(w for w in words if w.endswith(".py"))
            cmds[words[1]] = [script] + words[words.index(script) + 1:]
    return cmds


def _script_main(path: str):
    """``main`` of ``scripts/...py`` (a path as gpu_check.sh writes it)."""
    return load_script(Path(path).relative_to("scripts").with_suffix("").as_posix()).main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks argument parsing by the no-GPU exit")
def test_gpu_check_script_commands_are_valid(capsys, tmp_path):
    # The GPU script runs where device time is scarce: its arguments must parse here. Bad
    # arguments exit 2 before the GPU check; valid ones reach it and exit 1 on this machine.
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)]).returncode == 0
    cmds = _gpu_check_commands()
    assert set(cmds) == {"l2", "probe", "sparse_mm", "ksweep", "autotune", "bench", "user_view", "block"}
    assert cmds["autotune"][cmds["autotune"].index("--m") + 1] == "1,16"   # the defaults were filled in
    assert cmds["autotune"][cmds["autotune"].index("--timings") + 1] == "RES/autotune-timings.csv"
    assert "--skip-tuned" in cmds["autotune"]
    for name in cmds:
        cmds[name] = [str(tmp_path) if a == "RES" else a.replace("RES/", f"{tmp_path}/", 1) if a.startswith("RES/")
                      else a for a in cmds[name]]
    for name in ("autotune", "bench"):
        assert main(cmds[name]) == 1, (name, cmds[name])
        assert "no CUDA GPU" in capsys.readouterr().err
    assert main(cmds["bench"] + ["--m", "0"]) == 2  # the same command with a bad argument is caught
    for name in ("l2", "probe", "sparse_mm", "ksweep", "user_view", "block"):
        script, *argv = cmds[name]
        assert _script_main(script)(argv) == 1 and "no CUDA GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the script up to its no-GPU exit")
def test_gpu_check_imports_this_tree_as_installed():
    """gpu_check.sh imports this tree through a symlinked installed layout (sparse24.kernels,
    sparse24.autotune_configs); its `python -m` steps must not pick up the tree's own
    sparse24/ from the working directory (the first GPU run lost every step so). The
    script checks that before it looks for a GPU: here it gets that far and no further."""
    r = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, cwd=GPU_CHECK.parents[1],
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 1 and "no CUDA GPU visible" in r.stderr, r.stderr
    assert "does not import" not in r.stderr


def test_gpu_l2_bandwidth_kernel_sums_on_cpu():
    """The L2 probe's kernel (scripts/gpu_l2_bandwidth.py --smoke, Triton's interpreter): each
    program's sum of the blocks it reads equals torch's, so the GPU figure counts bytes it read."""
    r = subprocess.run([sys.executable, "scripts/gpu_l2_bandwidth.py", "--smoke"], capture_output=True, text=True,
                       cwd=GPU_CHECK.parents[1])
    assert r.returncode == 0 and "sums match" in r.stdout, r.stderr


def test_gpu_probe_runs_every_step_on_cpu(tmp_path, capsys):
    """The probe step's code, run small on CPU (Triton's interpreter; cuSPARSELt is CUDA-only
    and reported, not fatal): the unpack bit-exact, a CSV row per weight kind, each timed on the
    sparse tensor-core route too, past 64 rows with its 32-row config (a failing path is reported as
    NaN, so the check can fail)."""
    assert _script_main("scripts/gpu_probe.py")(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "host us/call Sparse24Linear" in out and out.count("unpack bit-exact True") == 3
    rows = list(csv.DictReader(open(tmp_path / "probe_prefill.csv")))
    assert [(r["weight"], r["M"]) for r in rows] == [(w, m) for w in ("fp16", "int8", "int4") for m in ("64", "80")]
    assert float(rows[0]["triton_dense_us"]) > 0
    # 64 rows: the sparse tensor-core route; 80: its 32-row config forced; every weight kind, checked
    assert all(float(r["sp_us"]) > 0 for r in rows)
    errs = [float(e) for e in re.findall(r"sparse tensor cores max \|diff\| / max \|ref\| (\S+)", out)]
    assert len(errs) == 6 and max(errs) < 2e-3 and "sparse tensor cores failed" not in out   # fp16 output rounding


def test_gpu_probe_ksweep_checks_ours_then_times_one_tile_per_k(tmp_path, capsys):
    """The K-sweep (why K = 11008 ran 2.5x Triton's GEMM; does split-K gain) on CPU, small: a row
    per K, one per GROUP_M at the swept K and one per split factor, ours checked against fp32
    before timing (a config of the wrong kernel variant once gave garbage there: the error column
    catches that), the KM column as the layout pads it."""
    assert _script_main("scripts/gpu_probe.py")(["--smoke", "--only", "ksweep", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "probe_ksweep.csv")))
    assert [(r["K"], r["config"][-7:]) for r in rows] == [
        ("128", "_SK1_G8"), ("192", "_SK1_G1"), ("192", "_SK1_G8"), ("256", "_SK1_G8"), ("256", "_SK2_G8")]
    assert all(r["KM"] == "16" for r in rows)   # 2 to 4 atoms, padded to 16
    assert all(float(r[c]) > 0 for r in rows for c in ("dense_us", "ours_us", "triton_dense_us"))
    assert max(float(r["max_rel_err"]) for r in rows) < 2e-3 and "failed" not in capsys.readouterr().out
    jobs = _script_main("scripts/gpu_probe.py").__globals__["ksweep_jobs"]()   # the GPU's: 7 K, 2 GROUP_M, 3 splits
    assert len(jobs) == 12 and {c.kernel for *_, c in jobs} == {"prefill"}
    assert [(n, k, m, c.split_k) for n, k, m, c in jobs[-3:]] == [(4096, 4096, 256, s) for s in (1, 2, 4)]


def test_gpu_probe_times_the_kept_handle_with_both_pointer_forms(monkeypatch):
    """The probe's before/after of passing pointers as ints: the launch the plan makes is
    recorded, then replayed with the ints and with the tensors they came from (the call's own
    output replaced by one buffer in both), scalars untouched. (On CPU: a stand-in plan.)"""
    import types
    probe = _script_main("scripts/gpu_probe.py").__globals__
    x, values, meta = torch.randn(1, 64), torch.randn(8, 32), torch.zeros(8, 4, dtype=torch.int32)
    ws = torch.zeros(16)
    replayed = []

    class Handle:
        function, packed_metadata = object(), object()

        def run(self, *args):
            replayed.append(args)
    plan = types.SimpleNamespace(compiled=Handle(), N=8, extra=(ws,))

    def fake_run(x_, v_, m_, s_, b_, N):   # what the plan's __call__ passes to its kept handle
        out = torch.empty(1, N)
        plan.compiled.run(1, 2, 1, 7, None, None, None, None, None, x_.data_ptr(), v_.data_ptr(), m_.data_ptr(),
                          out.data_ptr(), ws.data_ptr(), 1, 8, 64, 16, True)
    monkeypatch.setattr(probe["launch"], "run", fake_run)
    lines = probe["_pointer_args"]([plan], (x, values, meta), torch.device("cpu"), 3)
    assert len(lines) == 2 and "as ints" in lines[0] and "as tensors" in lines[1]
    ints, tensors = replayed[5], replayed[-1]          # (5 warm-up calls each, then the timed ones)
    assert ints[:9] == tensors[:9] == (1, 2, 1, 7, None, None, None, None, None)
    assert ints[9:12] == (x.data_ptr(), values.data_ptr(), meta.data_ptr()) and ints[13] == ws.data_ptr()
    assert tensors[9] is x and tensors[10] is values and tensors[11] is meta and tensors[13] is ws
    assert isinstance(tensors[12], torch.Tensor) and tensors[12].data_ptr() == ints[12]   # one output buffer
    assert ints[14:] == tensors[14:] == (1, 8, 64, 16, True)


def test_gpu_user_view_runs_every_step_on_cpu(tmp_path, capsys):
    """The user-view step's code, run small on CPU (the GPU run must not fail on a bug)."""
    argv = ["--device", "cpu", "--d", "64", "--ff", "128", "--blocks", "2", "--tokens", "2", "--calls", "2",
            "--repeats", "1", "--backend", "aot_eager", "--mode", "default", "--out", str(tmp_path)]
    assert _script_main("scripts/gpu_user_view.py")(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "user_view.csv")))
    assert [(r["what"], r["variant"]) for r in rows] == [
        ("eager layer", v) for v in ("dense nn.Linear", "2:4 fp16", "2:4 int8")] + [
        ("compiled decode", v) for v in ("dense", "2:4 fp16", "2:4 int8")]
    decode = [r for r in rows if r["what"] == "compiled decode"]
    assert all(r["graph_breaks"] == "0" and float(r["max_abs_diff_vs_eager"]) == 0.0 for r in decode)
    assert "tok/s" in capsys.readouterr().out


def test_bench_no_plot_removes_an_earlier_runs_plot(capsys, tmp_path):
    # an earlier sweep's bench.png stayed beside the new CSV, plotting other shapes
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    rc, _, err = run(capsys, "bench", "--device", "cpu", "--shapes", "16,32", "--m", "1", "--repeats", "1",
                     "--threads", "1", "--providers", "dense", "--no-plot", "--out", str(tmp_path))
    assert rc == 0, err
    assert (tmp_path / "bench.csv").exists() and not (tmp_path / "bench.png").exists()


def test_which_write_errors_name_out(tmp_path):
    # an OSError on --out, inside it, on a folder above it or on its temporary names beside it is --out's
    from sparse24.tools.prune import _concerns
    out = tmp_path / "a" / "out"
    for name in (out, out / "model.safetensors", tmp_path / "a", tmp_path / "a" / ".out.123.partial",
                 tmp_path / "a" / ".out.tmp"):
        assert _concerns(str(name), out), name
    for name in (None, "", tmp_path / "b" / "out", tmp_path / "a" / "other"):
        assert not _concerns(name and str(name), out), name


def test_prune_state_dict_compresses_a_transformer_decoder_feed_forward():
    """A decoder layer holds self_attn.in_proj_weight as an encoder layer does, but has no fast path reading
    linear1/linear2: the file compresses them, as sparsify_ does, and loads into the compressed model (it was
    refused: missing linear1.values / meta)."""
    from sparse24.tools.prune import prune_state_dict

    def make():
        return nn.TransformerDecoder(nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2).eval()

    torch.manual_seed(0)
    dense = make()
    sd = dense.state_dict()
    pruned, _ = prune_state_dict(sd, progress=False)
    assert {"layers.0.linear1.values", "layers.1.linear2.meta"} <= set(pruned)
    model = make()
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False)
    model.load_state_dict(pruned)
    ref = {k: v * _topk_mask(v) if k.endswith(("linear1.weight", "linear2.weight", "out_proj.weight")) else v
           for k, v in sd.items()}
    reference = make().double()
    reference.load_state_dict(ref)
    x, mem = torch.randn(2, 5, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x, mem).double(), reference(x.double(), mem.double()), atol=1e-5, rtol=1e-5)

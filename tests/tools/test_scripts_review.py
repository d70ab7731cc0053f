"""Review fixes in hand-run scripts: bench_core's memory figure, eval_int4's chain options,
select_minilm_options' variants, checkpoint_size's --dim, bench_masks' table header, and the
argparse errors of bench_masks, example_prune_retrain and eval_minilm_calibration."""
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def scripts_on_path(monkeypatch):
    """``scripts/`` importable (the scripts import their siblings), ``sys.path`` restored after."""
    monkeypatch.syspath_prepend(str(SCRIPTS))


# --- bench_core: the reference backend's memory figure ----------------------------------------------------

def _growths(capsys) -> list[float]:
    return [int(v) / 2**20 for v in capsys.readouterr().out.split()]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_bench_core_memory_sees_a_call_that_decompresses_the_whole_weight(monkeypatch, capsys):
    """ru_maxrss, already raised by the setup and a warm-up call, read ~0 MiB even for a linear that builds
    the whole dense weight on every call: the figure could not show the chunking it is quoted for."""
    bc = load_script("bench_core")
    monkeypatch.setattr(sparse24, "linear", lambda x, p, bias=None: F.linear(x, p.to_dense(), bias))
    bc._rss_child(2048, 8192)  # a 64 MiB dense fp32 temporary per call
    growths = _growths(capsys)
    assert growths[-1] > 48, growths  # the repeated call (was 0.0)
    assert len(growths) == 2 and growths[0] > 48, growths  # and the first


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_bench_core_memory_of_the_chunked_linear_stays_below_the_dense_weight(capsys):
    bc = load_script("bench_core")
    bc._rss_child(2048, 8192)
    first, repeated = _growths(capsys)
    assert 0 <= first < 32 and 0 <= repeated < 32, (first, repeated)  # chunks of 4 MiB, not the 64 MiB weight


def test_bench_core_memory_unavailable_without_proc_never_prints_zero(monkeypatch, capsys, tmp_path):
    bc = load_script("bench_core")
    monkeypatch.setattr(bc, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"), raising=False)
    monkeypatch.setattr(bc, "_STATUS", str(tmp_path / "missing" / "status"), raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="unavailable\n"))
    bc._rss_child(64, 64)
    assert capsys.readouterr().out == "unavailable\n"
    bc.bench_memory(64, 64)
    out = capsys.readouterr().out
    assert "peak RSS growth unavailable" in out and "0.0 MiB" not in out


def test_bench_core_memory_child_honours_threads(monkeypatch, capsys):
    """The child process ran with torch's default thread count whatever --threads said."""
    bc = load_script("bench_core")
    seen = []
    real = sparse24.linear
    monkeypatch.setattr(sparse24, "linear", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])

    def run_here(cmd, **kwargs):  # the child's code, run in this process (sparse24.linear patched)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(cmd[-1], {})
        return subprocess.CompletedProcess(cmd, 0, stdout=out.getvalue())
    monkeypatch.setattr(subprocess, "run", run_here)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "bench_core", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        bc.bench_memory(64, 64, threads=1)
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 1]
    assert "peak RSS growth of a first call" in capsys.readouterr().out


# --- eval_int4 minilm --part chain: the options given reach the chain -----------------------------------

class _Stop(Exception):
    pass


@pytest.fixture
def chain(monkeypatch, scripts_on_path, tmp_path):
    """eval_int4.main for ``minilm --part chain`` without running it: returns eval_minilm.py's parsed
    arguments and the INT4 group sizes used, stopping at the first quantization."""
    import eval_minilm
    ei = load_script("eval_int4")
    seen = {"groups": []}

    def context(margs):
        seen["margs"] = margs
        return {"held": [], "manual": [], "calib": [], "batch": margs.batch}

    def quantize(model, how, group_size=128, **kw):
        seen["groups"].append(group_size)
        raise _Stop
    monkeypatch.setattr(eval_minilm, "context", context)
    monkeypatch.setattr(eval_minilm, "_worker", lambda ctx: (None, {}))
    monkeypatch.setattr(eval_minilm, "chain", lambda ctx, enc, evals, rows: (nn.Linear(4, 4), None))
    monkeypatch.setattr(ei, "quantize_on_masks_", quantize)

    def run(*argv):
        with pytest.raises(_Stop):
            ei.main(["minilm", "--part", "chain", "--out", str(tmp_path), *argv])
        return seen["margs"], seen["groups"]
    return run


def test_eval_int4_chain_passes_its_sizes_to_eval_minilm(chain, scripts_on_path):
    """--calib/--eval-sentences/--steps/--batch/--lr were dropped: the chain ran eval_minilm.py's defaults."""
    import eval_minilm
    margs, groups = chain("--calib", "64", "--eval-sentences", "48", "--steps", "10", "--batch", "8",
                          "--lr", "1e-3", "--groups", "64")
    defaults = eval_minilm.parser().parse_args([])
    assert (margs.calib_sentences, margs.eval_sentences, margs.distill_steps, margs.batch, margs.distill_lr) == \
        (64, 48, 10, 8, 1e-3)
    assert margs.learn_steps == defaults.learn_steps and not margs.quick
    assert groups == [64]  # was a hard-coded 128


def test_eval_int4_chain_keeps_eval_minilms_defaults_when_not_given(chain, scripts_on_path):
    import eval_minilm
    margs, groups = chain()
    assert vars(margs) == vars(eval_minilm.parser().parse_args([]))
    assert groups == [128]


@pytest.mark.parametrize("option", ["--calib", "--eval-sentences", "--steps"])
def test_eval_int4_chain_refuses_sizes_that_quick_overrides(option, capsys, monkeypatch, scripts_on_path):
    import eval_minilm
    monkeypatch.setattr(eval_minilm, "context", lambda margs: pytest.fail("the chain started"))
    ei = load_script("eval_int4")
    with pytest.raises(SystemExit) as e:
        ei.main(["minilm", "--part", "chain", "--quick", option, "16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "--quick" in err


@pytest.mark.parametrize("part, option", [("oneshot", ["--steps", "10"]), ("oneshot", ["--lr", "0.1"]),
                                          ("oneshot", ["--quick"]), ("qat", ["--groups", "64"]),
                                          ("distill", ["--quick"]), ("qat", ["--qat-steps", "5"])])
def test_eval_int4_parts_refuse_options_they_would_ignore(part, option, capsys):
    ei = load_script("eval_int4")
    ei.minilm = lambda args, argv: pytest.fail("the part started")
    with pytest.raises(SystemExit):
        ei.main(["minilm", "--part", part, *option])
    assert f"{option[0]}: not used by --part {part}" in capsys.readouterr().err


def test_eval_int4_other_parts_keep_their_defaults():
    ei = load_script("eval_int4")
    seen = {}
    ei.minilm = lambda args, argv: seen.update(vars(args))
    ei.main(["minilm", "--part", "oneshot"])
    assert {k: seen[k] for k in ei.MINILM_DEFAULTS} == ei.MINILM_DEFAULTS


# --- select_minilm_options: every variant a JSON object, checked before any heavy work --------------------

@pytest.fixture
def select(monkeypatch, scripts_on_path):
    """The script as a module, any model load failing the test (the script once loaded the model and
    computed the permutation on import, before looking at its arguments)."""
    import minilm_common

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(minilm_common, "Encoder", no_model)
    return load_script("select_minilm_options")


def test_select_help_and_no_variant_before_loading_the_model(select, capsys):
    with pytest.raises(SystemExit) as e:
        select.main(["--help"])
    assert e.value.code == 0 and "JSON" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        select.main([])
    assert e.value.code == 2


@pytest.mark.parametrize("spec, why", [("percdamp=0.1", "is not JSON"), ("{percdamp: 0.1}", "is not JSON"),
                                       ('[{"percdamp": 0.1}]', "is not a JSON object"), ("0.1", "not a JSON object")])
def test_select_refuses_a_variant_that_is_not_a_json_object(select, capsys, spec, why):
    """A variant not starting with '{' ran the default options under its label."""
    with pytest.raises(SystemExit) as e:
        select.main(['{}', spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert repr(spec) in err and why in err and "usage:" in err


def test_select_runs_each_variant_with_its_options(select, monkeypatch):
    runs = []
    monkeypatch.setattr(select, "load", lambda: None)
    monkeypatch.setattr(select, "run", lambda label, **opts: runs.append((label, opts)))
    select.main(['{}', ' {"percdamp": 0.1}', '{"token_noise": [1, 0.1, 1999]}'])
    assert runs == [("{}", {}), (' {"percdamp": 0.1}', {"percdamp": 0.1}),
                    ('{"token_noise": [1, 0.1, 1999]}', {"token_noise_": [1, 0.1, 1999]})]


# --- checkpoint_size: every Linear 2:4 --------------------------------------------------------------------

@pytest.mark.parametrize("dim", ["130", "16"])
def test_checkpoint_size_refuses_a_dim_sparsify_keeps_dense(dim, monkeypatch, capsys):
    """--dim 130: sparsify_ kept the 130-wide Linear dense and its fp16 weight was counted as 2:4."""
    cs = load_script("checkpoint_size")
    monkeypatch.setattr(sys, "argv", ["checkpoint_size.py", "--dim", dim, "--blocks", "1"])
    with pytest.raises(SystemExit) as e:
        cs.main()
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "--dim must be a multiple of 4" in err.err and "compressed" not in err.out


def test_checkpoint_size_prepare_refuses_a_layer_left_dense():
    cs = load_script("checkpoint_size")
    model = cs.build(16, 1, seed=0)  # 16 input features: below min_features
    with pytest.raises(ValueError, match=r"layers left dense.*0 \("):
        cs.prepare(model, "compressed")


def test_checkpoint_size_every_layer_compressed(monkeypatch, capsys):
    cs = load_script("checkpoint_size")
    monkeypatch.setattr(sys, "argv", ["checkpoint_size.py", "--dim", "32", "--blocks", "1"])
    cs.main()
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    assert rows["compressed"].endswith("bias, meta, values") and rows["int8"].endswith("bias, meta, scale, values")


# --- bench_masks ------------------------------------------------------------------------------------------

def test_bench_masks_permutation_column_is_a_time_budget(capsys):
    """The column said 'steps budget' but holds search_permutation's time_limit in seconds."""
    bm = load_script("bench_masks")
    bm.bench_permutation(1, 0.05, [])
    head = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| seed"))
    assert head.endswith("| time budget (s) |") and "steps" not in head
    committed = (SCRIPTS.parent / "results" / "cpu-amd-epyc" / "bench_masks.md").read_text()
    assert "steps budget" not in committed and "| gap closed | time budget (s) |" in committed


@pytest.mark.parametrize("option", ["--seeds", "--repeats"])
def test_bench_masks_refuses_zero_seeds_or_repeats(option, monkeypatch, capsys):
    """--seeds 0 ended in a StatisticsError (the mean of no gains)."""
    bm = load_script("bench_masks")
    monkeypatch.setattr(bm, "bench_permutation", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        bm.main([option, "0"])
    assert e.value.code == 2 and f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


# --- example_prune_retrain, eval_minilm_calibration -------------------------------------------------------

def test_example_prune_retrain_refuses_zero_steps(monkeypatch, capsys):
    """--steps 0: ZeroDivisionError in the cosine schedule's lambda."""
    ex = load_script("example_prune_retrain")
    monkeypatch.setattr(ex, "load_text", lambda: pytest.fail("ran"))
    monkeypatch.setattr(sys, "argv", ["example_prune_retrain.py", "--steps", "0"])
    with pytest.raises(SystemExit) as e:
        ex.main()
    assert e.value.code == 2 and "--steps must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("noise", ["2", "2,0.3,1", "a,0.3", "2,1.5", "-1,0.3"])
def test_eval_minilm_calibration_refuses_a_bad_noise(noise, monkeypatch, capsys, scripts_on_path):
    """--noise 2 ended in a bare 'not enough values to unpack' ValueError."""
    ev = load_script("eval_minilm_calibration")
    monkeypatch.setattr(ev, "texts", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        ev.main([f"--noise={noise}"])  # "=": argparse reads "-1,0.3" alone as an option
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--noise {noise!r}" in err and "COPIES,P" in err


def test_eval_minilm_calibration_noise_parsed(scripts_on_path):
    ev = load_script("eval_minilm_calibration")
    assert ev.parse_noise("2,0.3") == (2, 0.3) and ev.parse_noise("0,1") == (0, 1.0)

"""The GPU session's planned calls (scripts/gpu_plan.sh N, each scripts/gpu_check.sh with its
settings) fit one device call: gpu_check.sh's dry run prints every step and its limit as if the
preamble (layout and CUDA checks, env.txt, the cache's relocation: ~5 Python start-ups inside the
same budget) took its charge and each step ran to its limit and past timeout's 10 s grace, so a
plan whose steps are cut or skipped there could be cut on the GPU (the plan's wrapped command lines
once lost every setting; a dry run that started the clock at the first step once passed a plan
whose last step, the block, would have lost 20 s on the GPU)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 570
PLANS = {"1": ["probe", "sparse_mm", "tests", "autotune", "block"], "2": ["ksweep", "autotune"], "3": ["bench"]}
PREAMBLE = 20   # at least: gpu_check.sh's ~5 Python start-ups before its first step (~15-20 s)


def dry(*argv, **env):
    out = subprocess.run(["bash", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPU_CHECK_DRY": "1", **env})
    return out.returncode, out.stdout + out.stderr


def steps(text):
    return [(m[1], int(m[2])) for m in re.finditer(r"^step (\S+) (\d+)$", text, re.M)]


def preamble(text):
    """The seconds the dry run charged for the preamble before its first step."""
    (charged,) = re.findall(r"^preamble (\d+)$", text, re.M)
    return int(charged)


@pytest.mark.parametrize("call", PLANS)
def test_each_planned_call_runs_every_step_in_full_within_the_budget(call):
    script = (ROOT / "scripts/gpu_plan.sh").read_text()
    block = script.split(f"    {call})", 1)[1].split(";;", 1)[0]
    asked = {k.removeprefix("T_").lower(): int(v) for k, v in re.findall(r"\b(T_[A-Z_]+)=(\d+)", block)}
    rc, out = dry("scripts/gpu_plan.sh", call)
    assert rc == 0, out
    got = steps(out)
    assert [name for name, _ in got] == PLANS[call], out
    assert preamble(out) >= PREAMBLE
    for name, limit in got:  # nothing trimmed by the budget
        assert limit == asked[{"sparse_mm": "sparse_mm", "autotune": "tune"}.get(name, name)], (name, limit, asked)
    # (the guard keeps 15 s beside the 10 s grace)
    assert preamble(out) + sum(limit + 10 for _, limit in got) <= BUDGET - 5


def test_call_1_gives_the_block_step_more_than_it_ever_took():
    """The block step is call 1's last, measured at 69 s (run 2) and 79 s (run 4): its limit leaves at
    least 10 s over the longest (and 90 s at least), with the preamble charged, so its compiled INT8
    rows (the regression the call re-tunes for) are not cut."""
    took = [int(re.search(r"=== block: exit \d+ after (\d+) s", f.read_text())[1])
            for f in sorted((ROOT / "results/NVIDIA_H200").glob("block*.log"))]
    assert len(took) >= 2 and max(took) >= 79
    rc, out = dry("scripts/gpu_plan.sh", "1")
    (block,) = [limit for name, limit in steps(out) if name == "block"]
    assert block >= max(90, max(took) + 10), (block, took)


def test_the_budget_cuts_the_last_steps_of_a_long_run():
    rc, out = dry("scripts/gpu_check.sh")  # the defaults: every step runs, the last ones cut to fit
    got = steps(out)
    assert [n for n, _ in got] == ["l2", "probe", "tests", "autotune", "bench", "user_view", "block"], out
    assert rc == 0 and preamble(out) + sum(limit + 10 for _, limit in got) <= BUDGET - 5
    rc, out = dry("scripts/gpu_check.sh", GPU_CHECK_BUDGET="320")
    assert rc == 1 and [n for n, _ in steps(out)] == ["l2", "probe", "tests", "autotune"]
    assert "bench: skipped" in out and "FAILED steps: bench(no time left) user_view(no time left)" in out


def test_the_plan_refuses_an_unknown_call():
    rc, out = dry("scripts/gpu_plan.sh", "4")
    assert rc == 2 and "usage: bash scripts/gpu_plan.sh 1|2|3" in out


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_report_now_names_failures_at_once_and_lists_every_passed_test(tmp_path, workers):
    (tmp_path / "test_x.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    assert False\n")
    passed = tmp_path / "passed.txt"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p",
                          "report_now", *workers, str(tmp_path / "test_x.py")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "GPU_TESTS_PASSED": str(passed),
                                                      "PYTHONPATH": str(ROOT / "scripts/gpu_tests")})
    assert out.returncode == 1 and "!!! FAILED test_x.py::test_b (call)" in out.stderr
    assert passed.read_text() == "test_x.py::test_a\n"   # once, under xdist too

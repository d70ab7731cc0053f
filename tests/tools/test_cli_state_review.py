"""Review fix: the CLI's main() run in-process (a notebook, a driver script) gives back the process state its
commands set for their run, on every exit path: torch's thread count after ``bench --threads N`` (also when the
sweep then fails), and after ``demo`` the thread count and torch's global random state (the demo seeds it with
``--seed``); numpy's and Python's random states stay untouched. The demo also trains inside the caller's
``torch.inference_mode()`` / ``torch.no_grad()`` (it makes every tensor it trains itself)."""
import contextlib
import random

import numpy as np
import pytest
import torch

from sparse24.tools import demo
from sparse24.tools.cli import main

BENCH = ["bench", "--device", "cpu", "--quick", "--threads", "1", "--shapes", "64,128", "--m", "1",
         "--providers", "dense,sparse24-reference", "--no-plot", "--repeats", "1", "--no-progress"]
DEMO = ["demo", "--quick", "--steps", "2", "--eval-chars", "50", "--threads", "1", "--no-bench", "--no-control",
        "--seed", "0", "--no-progress"]


@contextlib.contextmanager
def threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)   # (torch takes more threads than CPUs: 2 differs from --threads 1 on any machine)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_draws():
    """The next draws of torch's, numpy's and Python's global generators (they consume them)."""
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def seed_all(s):
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


@pytest.mark.parametrize("fails", [False, True])
def test_bench_gives_the_thread_count_back(tmp_path, capsys, fails):
    out = tmp_path / "bench"
    if fails:   # --out names a file: refused after --threads took effect
        out.write_text("")
    with threads(2):
        rc = main(BENCH + ["--out", str(out)])
        assert torch.get_num_threads() == 2
    capsys.readouterr()
    assert rc == (2 if fails else 0)


@pytest.mark.parametrize("fails", [False, True])
def test_demo_gives_the_thread_count_and_random_states_back(tmp_path, capsys, monkeypatch, fails):
    seed_all(1234)
    expected = random_draws()   # plain torch / numpy / random: what a seeded user draws next
    if fails:   # a failure after the seeding and the first training run
        def boom(*a, **k):
            raise ValueError("boom")
        monkeypatch.setattr(demo, "evaluate_bpc", boom)
    with threads(2):
        seed_all(1234)
        rc = main(DEMO + ["--out", str(tmp_path / "demo")])
        assert torch.get_num_threads() == 2
        assert random_draws() == expected
    err = capsys.readouterr().err
    assert rc == (2 if fails else 0), err
    assert ("boom" in err) == fails


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_demo_trains_inside_the_callers_grad_mode(tmp_path, capsys, mode):
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        rc = main(DEMO + ["--out", str(tmp_path / "demo")])
        assert not torch.is_grad_enabled() and torch.is_inference_mode_enabled() == (mode == "inference_mode")
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "demo" / "results.md").is_file()

"""scripts/fsdp_finetune.py under torchrun (2 CPU processes, gloo): its distributed checkpoint and
its exported compressed folder hold the same trained 2:4 model."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

import sparse24
from sparse24 import Sparse24Linear


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from fsdp_finetune import tiny_config  # noqa: E402


def _torchrun(out: Path) -> subprocess.CompletedProcess:
    # --standalone: torchrun binds a free port on this machine itself (no race for one picked in advance)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts" / "fsdp_finetune.py"), "--tiny", "--device", "cpu", "--steps", "2", "--lr", "1e-2",
           "--memory", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_torchrun_finetune_then_export(tmp_path):
    out = tmp_path / "a"
    run = _torchrun(out)
    if run.returncode != 0 and "Signal 6 (SIGABRT)" in run.stderr:
        # Twice in full-suite runs under load (2026-12-03, 2026-12-04; never alone in 40 runs, 8 at a
        # time included) a rank died by SIGABRT after training; not diagnosed (stderr was cut). One
        # more run, with what the first printed kept in the warnings; a Python error fails at once.
        warnings.warn("fsdp_finetune.py rank aborted (SIGABRT), rerun once:\n" + run.stderr[-6000:])
        out = tmp_path / "b"
        run = _torchrun(out)
    if run.returncode != 0:
        pytest.fail(f"torchrun exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-8000:]}")
    assert "step 1: loss" in run.stdout
    assert all(f"rank {r}/2: parameters" in run.stdout for r in (0, 1)) and "peak while training" in run.stdout

    torch.manual_seed(0)
    before = AutoModelForCausalLM.from_config(tiny_config())
    model = AutoModelForCausalLM.from_config(tiny_config())
    sparse24.sparsify_(model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=out / "dcp", no_dist=True)
    model.load_state_dict(sd)
    exported = sparse24.from_pretrained(type(model), out / "hf")
    layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)]
    assert len(layers) == 14
    for fqn, m in layers:
        e = exported.get_submodule(fqn)
        assert e.mode == "compressed"
        assert torch.equal(e.dense_weight(), m.dense_weight()), fqn
        assert not torch.equal(m.dense_weight(), torch.where(m.mask, before.get_submodule(fqn).weight, 0))  # trained
        assert int((m.weight.reshape(-1, 4) != 0).sum(1).max()) <= 2

"""What the CUDA test files share: the device, the activation dtypes, a seeded
generator fixture and the CPU suite's reference check (tests/conftest.py)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import assert_matches_reference  # noqa: E402,F401

if not torch.cuda.is_available():
    raise RuntimeError("these tests need a CUDA GPU; the CPU suite is tests/")

DEV = torch.device("cuda")
ACT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(1234)

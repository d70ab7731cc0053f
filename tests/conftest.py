"""Shared test helpers: the one per-dtype tolerance table, and the independent reference."""
import math

import pytest
import torch
import torch.nn.functional as F

# Unit round-off per dtype.
EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def tolerance(dtype: torch.dtype, K: int) -> dict:
    """Tolerances for a K-term linear output in ``dtype`` vs fp64, inputs with O(1) entries.

    Every path accumulates in fp32 (fp64 for fp64) and rounds once to ``dtype``:
    rtol = 2 * eps(dtype) covers that rounding; atol = 16 * eps(acc) * sqrt(K)
    covers accumulation (measured worst case 6.6 * eps32 * sqrt(K) for torch's
    CPU fp32 matmul, K = 16..4096). One wrong kept value moves an output by
    O(1), far outside (bf16, K = 128: about 0.09 at |y| ~ 11).
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return {"rtol": 2 * EPS[dtype], "atol": 16 * EPS[acc] * math.sqrt(max(K, 1))}


def reference_linear(x: torch.Tensor, w_dense: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear in fp64 on the (masked) dense weight: the independent reference."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), w_dense.double(), b)


def assert_matches_reference(out, x, w_dense, bias=None, dtype=None):
    ref = reference_linear(x, w_dense, bias)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype or out.dtype, x.shape[-1]))


def top2_mask(w):
    """Independent 2:4 magnitude mask: argsort each group of 4, keep the top 2."""
    g = w.detach().double().abs().reshape(-1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(1, g.argsort(dim=1, descending=True)[:, :2], True)
    return keep.view(w.shape)


def dequantized_reference(layer, mask):
    """Dense weight from the stored int8 values and fp32 scales, placed at ``mask`` (row-major)."""
    R, C = mask.shape
    ref = torch.zeros(R, C, dtype=torch.float64)
    ref[mask] = (layer.values.double() * layer.scale.double()[:, None]).flatten()
    return ref


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_terminal_summary(terminalreporter, config):
    # Tests run in a random order (pytest-randomly): print the seed even under -q, so a
    # failing order can be replayed.
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(f"test order: pytest-randomly seed {seed} "
                                    f"(replay it: python -m pytest -q --randomly-seed={seed})")

"""Shared test helpers: the one per-dtype tolerance table, the independent reference, and the snapshot a
failed whole-model call is compared with."""
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


def model_snapshot(model, optimizer=None) -> dict:
    """Everything a failed whole-model call must leave as it was: the module objects and their types,
    the parameter and buffer objects, ``requires_grad``, every value and gradient (clones), the optimizer's
    groups and state."""
    snap = {"modules": [(n, m, type(m)) for n, m in model.named_modules()],
            "params": [(n, p, p.requires_grad, p.detach().clone(), None if p.grad is None else p.grad.clone())
                       for n, p in model.named_parameters()],
            "buffers": [(n, b, b.clone()) for n, b in model.named_buffers()],
            "state": {k: v.clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        snap["groups"] = [list(g["params"]) for g in optimizer.param_groups]
        snap["opt_state"] = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                             for p, s in optimizer.state.items()}
    return snap


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a refused NaN weight must stay)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(a, b)


def assert_model_unchanged(model, snap, optimizer=None) -> None:
    assert [(n, m, type(m)) for n, m in model.named_modules()] == snap["modules"]
    params = list(model.named_parameters())
    assert [(n, p, p.requires_grad) for n, p in params] == [s[:3] for s in snap["params"]]
    assert all(_same(p, s[3]) for (_, p), s in zip(params, snap["params"]))
    assert all((p.grad is None) == (s[4] is None) and (p.grad is None or _same(p.grad, s[4]))
               for (_, p), s in zip(params, snap["params"]))
    buffers = list(model.named_buffers())
    assert [(n, b) for n, b in buffers] == [s[:2] for s in snap["buffers"]]
    assert all(_same(b, s[2]) for (_, b), s in zip(buffers, snap["buffers"]))
    state = model.state_dict()
    assert state.keys() == snap["state"].keys() and all(_same(state[k], v) for k, v in snap["state"].items())
    if optimizer is not None:
        assert [list(g["params"]) for g in optimizer.param_groups] == snap["groups"]
        assert optimizer.state.keys() == snap["opt_state"].keys()
        for p, s in snap["opt_state"].items():
            assert optimizer.state[p].keys() == s.keys()
            assert all(_same(optimizer.state[p][k], v) if isinstance(v, torch.Tensor) else optimizer.state[p][k] == v
                       for k, v in s.items())


def fail_on_call(monkeypatch, owner, name, k):
    """Make ``owner.name`` raise on its k-th call (0-based)."""
    real = getattr(owner, name)
    calls = []

    def wrapper(*a, **kw):
        calls.append(1)
        if len(calls) == k + 1:
            raise RuntimeError(f"injected failure at call {k}")
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, wrapper)


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

"""Shared test helpers: the one per-dtype error-bound table, the independent reference, and the snapshot a
failed whole-model call is compared with."""
import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N runs N workers side by side: torch's default of a thread per core in each
    # oversubscribes the cores and OpenMP's spin-waits stall (a CLI test: 5 s alone, 52 s at -n 2 on
    # 2 cores). One thread per worker, and for the subprocesses the tests start (CLI, torchrun).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# Unit round-off u per dtype (round to nearest: |fl(a) - a| <= u |a| in the normal range).
EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# Half the smallest subnormal: the absolute error of one rounding near zero.
UNDERFLOW = {torch.float64: 2.0 ** -1075, torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25,
             torch.bfloat16: 2.0 ** -134}
# Roundings a kernel may add to a K-term dot besides its K accumulation steps: the
# product itself (a non-FMA order, e.g. the interpreter's numpy matmul), up to 32
# split-K partial sums (KernelConfig caps SPLIT_K at 32), the bias, the INT8 scale.
EXTRA_ROUNDINGS = 35
# The widest K-tile of any kernel (BLOCK_K <= 512): a tile of consecutive columns
# then spans at most two 512-column blocks.
TILE = 512


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package); ``name`` may
    name a subfolder (``"gpu_tests/test_cuda"``)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype every path accumulates a ``dtype`` output in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error of n chained roundings."""
    assert n * u < 1, (n, u)
    return n * u / (1 - n * u)


def error_bound(x: torch.Tensor, w_dense: torch.Tensor, bias=None, dtype=None, x_err=None) -> torch.Tensor:
    """Elementwise bound on ``|out - reference_linear(x, w_dense, bias)|`` for a
    kernel computing ``out = x @ w_dense^T + bias`` as the 2:4 kernels do.

    x: ``(..., K)``, w_dense: ``(N, K)``, bias: ``(N,)`` or None; ``dtype``: the
    output's (default x's); ``x_err``: optional ``(..., K)`` bound on an error
    already in x (a previous layer's), propagated through ``|w|``.
    Returns ``(..., N)`` float64.

    The arithmetic bounded: exact operands (x in its dtype, weights exact in the
    dot's operand dtype) multiplied and summed in the accumulator (fp32; fp64
    for fp64): split-K cuts K into contiguous ranges; each range is one chain
    carried across its K-tiles (<= 512 consecutive columns) in ascending order
    (a compiled fp32 ``tl.dot``: one FMA per k), any order inside a tile
    (tensor cores, the interpreter's numpy matmul); the parts added in any
    order, then bias, INT8 scale, and one rounding to ``dtype`` (the
    activations' dtype: it is also the dot's operand dtype). Every accumulator
    rounding has relative error < ``u'``:

    * fp32 (and fp64) outputs: ``u' = u(acc)``. Their dots are IEEE FMA
      chains on CUDA cores (``input_precision="ieee"``; TF32 is off unless the
      user turns it on), rounded to nearest;
    * fp16/bf16 outputs: ``u' = 2 u(acc) = 2**-23``. Their dots run on tensor
      cores, which may accumulate with round-toward-zero (measured on
      V100/T4/A100 by Fasi et al. 2021; unknown for Hopper): RZ's error per
      rounding is < 2**-23, so the same bound covers it. (A probabilistic
      sqrt(K) bound would not: it needs unbiased errors, and RZ errors all
      point toward zero, adding up linearly while the partial sums keep a sign.)

    The error is a sum over roundings of ``delta_i * v_i`` (v_i the value
    rounded), each carried by at most ``n = K + EXTRA_ROUNDINGS`` factors
    ``(1 + delta)``. Two bounds on it, the smaller is taken:

    * any order (Higham, Accuracy and Stability, eq. 3.5):
      ``gamma_n(u') * A``, with ``A = sum_k |x_k| |w_k| + |b|``;
    * the order above: the K chain roundings round partial sums
      ``S_t - S_a + (part of one tile)``, S the prefix sums in ascending k, so
      ``|v_i| <= R = 2 P + 4 A_T`` (P: the largest ``|S|`` at 512-column block
      boundaries, A_T: the largest ``sum |x_k||w_k|`` over one block); the 35
      other roundings see at most ``A``. Error
      ``<= (1 + gamma_n)^2 u' (K (R + gamma_n A) + 35 A)``. For random signs
      R grows like sqrt(K) where A grows like K: at K = 11008, ~4x tighter.

    Both grow with K and with sums of |x_k||w_k|, never with |y|: cancellation
    in y does not shrink the error of its partial sums. Then rounding to
    ``dtype`` adds ``u(dtype) |acc|`` (nothing when dtype is the accumulator),
    the fp64 reference its own ``gamma_n(2**-53) A``; each rounding may lose
    half a subnormal near zero. Checked against an exact simulation of the FMA
    chain (to nearest and toward zero) at K = 4096 and 11008 in
    tests/kernels/test_error_bound.py, which also shows one moved weight slot
    or flipped sign/exponent byte fails it there.
    """
    dtype = dtype or x.dtype
    acc = accumulator(dtype)
    K = x.shape[-1]
    n = K + EXTRA_ROUNDINGS
    xs, wd = x.detach().double(), w_dense.detach().double()
    xa, wa = xs.abs() if x_err is None else xs.abs() + x_err.double(), wd.abs()
    ref = reference_linear(x, w_dense, bias).abs()
    s, P, A, A_T = (torch.zeros_like(ref) for _ in range(4))
    for k0 in range(0, K, TILE):  # per 512-column block: prefix sum, its abs sum
        s += xs[..., k0:k0 + TILE] @ wd[:, k0:k0 + TILE].T
        a = xa[..., k0:k0 + TILE] @ wa[:, k0:k0 + TILE].T
        P, A, A_T = torch.maximum(P, s.abs()), A + a, torch.maximum(A_T, a)
    A = A + (0.0 if bias is None else bias.detach().double().abs())
    prop = 0.0 if x_err is None else x_err.double() @ wa.T   # |w| |dx|: the input error carried through
    u, g64 = (EPS[acc] if dtype == acc else 2 * EPS[acc]), gamma(n, EPS[torch.float64])
    g = gamma(n, u)
    R = 2 * (P + prop + g64 * A) + 4 * A_T
    acc_err = torch.minimum(g * A, (1 + g) ** 2 * u * (K * (R + g * A) + EXTRA_ROUNDINGS * A)) + 2 * n * UNDERFLOW[acc]
    u_out = 0.0 if dtype == acc else EPS[dtype]
    return (1 + u_out) * (acc_err + g64 * A + prop) + u_out * ref + UNDERFLOW[dtype]


def within_bound(out, ref, bound) -> torch.Tensor:
    """Elementwise ``|out - ref| <= bound`` (NaN fails)."""
    return (out.double() - ref).abs() <= bound


def assert_within_bound(out, ref, bound) -> None:
    ok = within_bound(out, ref, bound)
    if not bool(ok.all()):
        err = (out.double() - ref).abs()
        i = int(torch.where(ok, torch.zeros_like(err), (err / bound).nan_to_num(math.inf)).argmax())
        raise AssertionError(f"{int((~ok).sum())} of {ok.numel()} outputs exceed the error bound; worst: "
                             f"|out - ref| = {float(err.flatten()[i]):.3g} > bound {float(bound.flatten()[i]):.3g} "
                             f"(ref {float(ref.flatten()[i]):.6g})")


def tolerance(dtype: torch.dtype, K: int) -> dict:
    """Scalar tolerances for a K-term output in ``dtype`` vs fp64 where no
    operands are at hand (gradients, model outputs), inputs with O(1) entries:
    rtol = 2 * eps(dtype), atol = 16 * eps(acc) * sqrt(K) (measured worst case
    6.6 * eps32 * sqrt(K) for torch's CPU fp32 matmul, K = 16..4096). Kernel
    outputs are checked with :func:`error_bound` instead: compiled kernels sum
    in other orders than torch's CPU matmul (an fp32 FMA chain exceeds this
    atol for ~10% of outputs at K = 4096).
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return {"rtol": 2 * EPS[dtype], "atol": 16 * EPS[acc] * math.sqrt(max(K, 1))}


def reference_linear(x: torch.Tensor, w_dense: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear in fp64 on the (masked) dense weight: the independent reference."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), w_dense.double(), b)


def matches_reference(out, x, w_dense, bias=None, dtype=None) -> bool:
    """Whether every output is within :func:`error_bound` of the fp64 reference."""
    ref = reference_linear(x, w_dense, bias)
    return out.shape == ref.shape and bool(within_bound(out, ref, error_bound(x, w_dense, bias, dtype or out.dtype))
                                           .all())


def assert_matches_reference(out, x, w_dense, bias=None, dtype=None):
    """Assert ``out`` (``(..., N)``, from x ``(..., K)``) is within :func:`error_bound`
    of F.linear in fp64 on the dense weight ``w_dense`` ``(N, K)``."""
    ref = reference_linear(x, w_dense, bias)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert_within_bound(out, ref, error_bound(x, w_dense, bias, dtype or out.dtype))


def int32_words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int32 words holding 16-bit fields ``lo`` (bits 0-15) and ``hi`` (bits 16-31): the register
    pairs the kernels' inline PTX takes, for their helpers run in the interpreter."""
    w = (lo.long() & 0xFFFF) | (hi.long() & 0xFFFF) << 16
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def top2_mask(w):
    """Independent 2:4 magnitude mask: argsort each group of 4, keep the top 2."""
    g = w.detach().double().abs().reshape(-1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(1, g.argsort(dim=1, descending=True)[:, :2], True)
    return keep.view(w.shape)


def masked_copy(dense, names):
    """float64 copy of ``dense`` with every layer in ``names`` holding W * top2_mask(W)."""
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for fqn in names:
            w = ref.get_submodule(fqn).weight
            w.mul_(top2_mask(w))
    return ref


def dequantized_reference(layer, mask):
    """Dense weight from the stored int8 values and fp32 scales, placed at ``mask`` (row-major)."""
    R, C = mask.shape
    ref = torch.zeros(R, C, dtype=torch.float64)
    ref[mask] = (layer.values.double() * layer.scale.double()[:, None]).flatten()
    return ref


def int4_dequantized_reference(layer, mask):
    """Dense fp64 weight of an INT4 layer from its stored bytes as the format defines them
    (byte g of a row: kept value 2g in bits 0-3, 2g+1 in bits 4-7; value j in quantization
    group j // (group_size / 2); ``(u - zero) * scale``, zero 8 when symmetric), placed at
    ``mask`` (row-major; exactly 2 kept per group of 4)."""
    R, C = mask.shape
    v = layer.values.long()
    codes = torch.stack((v & 15, v >> 4), dim=-1).reshape(R, C // 2).double()
    group = torch.arange(C // 2) // (int(layer.group_size) // 2)
    scale = layer.scale.double()[:, group]
    zero = 8.0 if layer.zero is None else layer.zero.double()[:, group]
    ref = torch.zeros(R, C, dtype=torch.float64)
    ref[mask] = ((codes - zero) * scale).flatten()
    return ref


def assert_export_keeps_op_and_buffers(net, x, layers, names) -> dict:
    """``torch.export`` of ``net``: each 2:4 layer one ``sparse24::linear`` call (no dense ``aten.linear``),
    the compressed ``names`` of ``layers`` kept as they are, the same outputs; returns the exported state."""
    ep = torch.export.export(net, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sparse24.linear.default) == len(layers)
    assert "aten.linear.default" not in {str(t) for t in targets}  # no decompressed dense weight
    state = {**ep.state_dict, **ep.constants}
    for i in layers:
        for name in names:
            assert torch.equal(state[f"{i}.{name}"], getattr(net[i], name))
    torch.testing.assert_close(ep.module()(x), net(x), rtol=0, atol=0)
    return state


def state(module) -> dict:
    """A copy of ``module``'s state dict (values cloned), for :func:`assert_unchanged`."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_unchanged(module, before: dict) -> None:
    """``module``'s state dict has exactly the keys and values of ``before`` (:func:`state`)."""
    after = module.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


def model_snapshot(model, optimizer=None) -> dict:
    """Everything a failed whole-model call must leave as it was: the module objects and their types,
    the parameter and buffer objects, ``requires_grad``, every value and gradient (clones), the optimizer's
    groups and state."""
    snap = {"modules": [(n, m, type(m)) for n, m in model.named_modules()],
            "params": [(n, p, p.requires_grad, p.detach().clone(), None if p.grad is None else p.grad.clone())
                       for n, p in model.named_parameters()],
            "buffers": [(n, b, b.clone()) for n, b in model.named_buffers()],
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "hooks": _hooks(model)}
    if optimizer is not None:
        snap["groups"] = [list(g["params"]) for g in optimizer.param_groups]
        snap["opt_state"] = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                             for p, s in optimizer.state.items()}
    return snap


def _hooks(model) -> list:
    """Every module's forward pre-hooks, forward hooks and backward hooks (the callables, by handle id)."""
    return [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(m._backward_hooks))
            for n, m in model.named_modules()]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a refused NaN weight must stay)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(a, b)


def assert_model_unchanged(model, snap, optimizer=None) -> None:
    assert [(n, m, type(m)) for n, m in model.named_modules()] == snap["modules"]
    assert _hooks(model) == snap["hooks"]
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
                                    f"(replay it: python -m pytest -q -n auto --randomly-seed={seed})")

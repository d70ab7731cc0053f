"""kernels/interpreter.py: a ``range`` over runtime bounds works in every
supported Triton x numpy pair, and a launch leaves Triton as it found it."""
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

from sparse24.kernels import interpreter
from sparse24.kernels.interpreter import InterpretedKernel


def _sum_rows(x_ptr, out_ptr, start, stop, BLOCK: tl.constexpr):
    # start and stop are runtime scalars: range() calls tl.tensor.__index__,
    # which Triton 3.3-3.6 with numpy >= 2.4 broke (our K loop does the same).
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(start, stop):
        acc += tl.load(x_ptr + r * BLOCK + cols)
    tl.store(out_ptr + cols, acc)


@pytest.mark.parametrize("forced", [False, True], ids=["as-installed", "index-fix-forced"])
def test_range_over_runtime_bounds_and_no_trace(forced, monkeypatch, gen):
    # "forced" runs the Triton < 3.7 workaround on whatever Triton is installed, so CI on a
    # newer Triton still checks that it computes right and is undone.
    if forced:
        monkeypatch.setattr(interpreter, "_NEEDS_INDEX_FIX", True)
    patch_fn = triton_interpreter._patch_lang_tensor
    tensor_attrs = dict(vars(tl.core.tensor))
    x = torch.randn(6, 16, generator=gen)
    out = torch.empty(16)
    InterpretedKernel(_sum_rows)[(1,)](x, out, 1, 5, BLOCK=16)
    torch.testing.assert_close(out, x[1:5].sum(0))
    assert triton_interpreter._patch_lang_tensor is patch_fn
    assert dict(vars(tl.core.tensor)) == tensor_attrs


def _total(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # tl.sum is itself a JIT function: the launch routes it through the interpreter
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, BLOCK)), axis=0))


def test_a_kernel_calling_a_jit_reduction(gen):
    """A kernel calling ``tl.sum`` (a JIT function of triton.language) runs, twice: the interpreted
    helpers are looked up by identity (hashing a JITFunction walks its globals, and failed on
    the interpreter's patched reduction), and the names Triton's rewrite of the helper reads
    are there for every launch, not only the first (scripts/gpu_l2_bandwidth.py's kernel sums
    this way); triton.language is left as it was."""
    x = torch.randn(32, generator=gen)
    out = torch.empty(1)
    standard = dict(vars(tl.standard))
    for _ in range(2):   # the second launch reuses the helper Triton rewrote for the first
        InterpretedKernel(_total)[(1,)](x, out, BLOCK=32)
        torch.testing.assert_close(out, x.sum().reshape(1))
        assert dict(vars(tl.standard)) == standard   # the names the rewrite adds are gone again

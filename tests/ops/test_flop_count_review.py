"""torch.utils.flop_counter.FlopCounterMode counts a 2:4 layer as the dense ``nn.Linear`` of its shape
(``2 * M * N * K``, forward and backward) in every mode and state: the registered op
``sparse24::linear`` (run whenever autograd is on and something requires grad, and on the meta device)
once counted 0. The reference is FlopCounterMode over a plain ``nn.Linear``."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import sparse24
from sparse24 import Sparse24Linear

K, N = 64, 32
LEADING = (2, 3)   # M = 6 rows in two leading dims: the formula multiplies all of them

KINDS = {
    "masked": dict(mode="masked"),
    "compressed": dict(mode="compressed"),
    "int8": dict(mode="compressed", quantize="int8"),
    "int4": dict(mode="compressed", quantize="int4", group_size=32),
    "trainable": dict(mode="compressed", trainable_values=True),
}
TRAINS_WEIGHT = {"masked", "trainable"}


def _count(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def _layers(kind, gen, bias=True):
    """(the 2:4 layer, the dense nn.Linear reference of its shape, its weight's trainability alike)."""
    dense = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(N, K, generator=gen))
    net = nn.Sequential(copy.deepcopy(dense))
    sparse24.sparsify_(net, skip_output_head=False, min_features=1, **KINDS[kind])
    assert isinstance(net[0], Sparse24Linear)
    dense.weight.requires_grad_(kind in TRAINS_WEIGHT)
    return net[0], dense


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_forward_counts_as_dense(kind, grad, bias, gen):
    layer, dense = _layers(kind, gen, bias)
    # with grad on, an x that requires grad sends even a frozen layer without bias through the op
    x = torch.randn(*LEADING, K, generator=gen).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        ref = _count(lambda: dense(x))
        got = _count(lambda: layer(x))
    assert ref == 2 * 6 * N * K   # the reference counts what it should
    assert got == ref, f"{kind}: FlopCounterMode counted {got} FLOPs, the dense nn.Linear {ref}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_meta_device_forward_counts_as_dense(kind, gen):
    """Counting a model too large to run: on the meta device (grad on, the default)."""
    layer, dense = _layers(kind, gen)
    layer, dense = layer.to("meta"), dense.to("meta")
    x = torch.randn(*LEADING, K, device="meta")
    ref = _count(lambda: dense(x))
    got = _count(lambda: layer(x))
    assert ref == 2 * 6 * N * K
    assert got == ref, f"{kind} on meta: FlopCounterMode counted {got} FLOPs, the dense nn.Linear {ref}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_forward_backward_counts_as_dense(kind, gen):
    """x's gradient always, the weight's where it trains (masked, trainable values): 2 * M * N * K each."""
    layer, dense = _layers(kind, gen)
    x = torch.randn(*LEADING, K, generator=gen)
    ref = _count(lambda: dense(x.clone().requires_grad_()).sum().backward())
    got = _count(lambda: layer(x.clone().requires_grad_()).sum().backward())
    assert ref == (3 if kind in TRAINS_WEIGHT else 2) * 2 * 6 * N * K
    assert got == ref, f"{kind}: forward + backward counted {got} FLOPs, the dense nn.Linear {ref}"


def test_compressed_mlp_total_counts_as_dense(gen):
    """A whole model, as one would count it: eval(), grad on (the default)."""
    dense = nn.Sequential(nn.Linear(K, 128), nn.ReLU(), nn.Linear(128, K)).eval()
    sparse = copy.deepcopy(dense)
    sparse24.sparsify_(sparse, mode="compressed", skip_output_head=False)
    assert sum(isinstance(m, Sparse24Linear) for m in sparse.modules()) == 2
    x = torch.randn(5, K, generator=gen)
    ref = _count(lambda: dense(x))
    assert ref == 2 * 5 * (K * 128 + 128 * K)
    assert _count(lambda: sparse(x)) == ref



def _prints_dense_counts(code: str, times: int) -> None:
    """Run ``code`` in a fresh process (imports in their order): it prints ``times`` counts of a 3 x 64 input
    through a 32 x 64 weight, each the dense-equivalent 2 * M * N * K."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(2 * 3 * 32 * 64)] * times, out.stdout + out.stderr

def test_formula_registers_after_a_later_import_and_a_reload():
    """``import sparse24`` imports neither flop_counter nor triton; flop_counter imported afterwards
    still counts the op, and so does a reload of the op's module (a new op, registered once)."""
    code = (
        "import importlib, sys, torch\n"
        "import sparse24\n"
        "assert 'torch.utils.flop_counter' not in sys.modules and 'triton' not in sys.modules\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "from sparse24.ops.linear24 import op\n"
        "p = sparse24.compress(torch.randn(32, 64))\n"
        "def count():\n"
        "    x = torch.randn(3, 64, requires_grad=True)\n"
        "    with FlopCounterMode(display=False) as fc:\n"
        "        op.forward(x, p.values, p.meta, None, None, p.dtype, 32)\n"
        "    return fc.get_total_flops()\n"
        "print(count())\n"
        "importlib.reload(op)\n"
        "importlib.reload(op)\n"
        "print(count())\n"
    )
    _prints_dense_counts(code, 2)


def test_formula_registers_after_a_first_import_that_failed():
    """The hook removed itself at the first import: one that failed (a broken triton import raising) left
    the formula unregistered for the import that then succeeded (0 FLOPs), and a reload of flop_counter
    (a new registry) went without it."""
    code = (
        "import importlib.abc, sys, torch\n"
        "class FailOnce(importlib.abc.MetaPathFinder):\n"
        "    done = False\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch.utils.module_tracker' and not self.done:\n"
        "            self.done = True\n"
        "            raise RuntimeError('simulated')\n"
        "import sparse24\n"
        "sys.meta_path.insert(0, FailOnce())\n"
        "try:\n"
        "    import torch.utils.flop_counter\n"
        "except RuntimeError:\n"
        "    pass\n"
        "import importlib, torch.utils.flop_counter as flop_counter\n"
        "p = sparse24.compress(torch.randn(32, 64))\n"
        "for again in range(2):\n"
        "    with flop_counter.FlopCounterMode(display=False) as fc:\n"
        "        sparse24.linear(torch.randn(3, 64, requires_grad=True), p)\n"
        "    print(fc.get_total_flops())\n"
        "    flop_counter = importlib.reload(flop_counter)\n"   # (a new registry)
    )
    _prints_dense_counts(code, 2)


def test_the_kernel_path_without_gradients_counts_as_dense():
    """No gradients and the Triton kernel (what "auto" runs at M <= 16 on a GPU; here the interpreter): the
    launch is no aten op, so FlopCounterMode counted 0; under a dispatch mode the call goes through the op."""
    p = sparse24.compress(torch.randn(32, 64, dtype=torch.float16))
    x = torch.randn(3, 64, dtype=torch.float16)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        y = sparse24.linear(x, p, backend="triton")
    assert fc.get_total_flops() == 2 * 3 * 32 * 64
    torch.testing.assert_close(y.double(), x.double() @ p.to_dense().double().T, atol=2e-2, rtol=2e-2)


def test_formula_survives_a_reload_of_flop_counter_imported_before_sparse24():
    """flop_counter imported first: the formula was registered once and no hook installed, so a reload of
    flop_counter (a new registry) counted 0."""
    code = (
        "import importlib, torch\n"
        "import torch.utils.flop_counter as flop_counter\n"
        "import sparse24\n"
        "p = sparse24.compress(torch.randn(32, 64))\n"
        "for again in range(2):\n"
        "    with flop_counter.FlopCounterMode(display=False) as fc:\n"
        "        sparse24.linear(torch.randn(3, 64, requires_grad=True), p)\n"
        "    print(fc.get_total_flops())\n"
        "    flop_counter = importlib.reload(flop_counter)\n"
    )
    _prints_dense_counts(code, 2)

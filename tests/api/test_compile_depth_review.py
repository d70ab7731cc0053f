"""torch.compile over what sparse24 does outside a layer's own forward, found wanting by review: the
pre-hook that re-zeroes directly read masked weights (skipped under compile: a compiled model used a
weight written in place unmasked), the forward that settles a layer unfrozen in the decode layout to
layout v1 (skipped under compile: the compiled step failed), and the process-wide optimizer hooks
(traced by Dynamo: every compiled optimizer step in the process broke into several graphs). References
are plain torch in float64 with an independent 2:4 mask; graphs are counted with Dynamo's counters
(aot_eager traces the backward as Inductor does, in a fraction of the time)."""
import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import sparse24
from sparse24 import Sparse24Linear

from conftest import tolerance, top2_mask


def _counts() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Parent(nn.Module):
    """Reads ``self.out.weight`` itself (as torch's multi-head attention reads ``out_proj.weight``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return F.linear(torch.relu(self.fc(x)), self.out.weight, self.out.bias)


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


def _sparsified(build, train: bool):
    """(dense model, its sparsified copy), the copy reading a masked weight directly."""
    torch.manual_seed(0)
    dense = build().train(train)
    model = copy.deepcopy(dense)
    report = sparse24.sparsify_(model, skip_output_head=False)
    assert any(" reads " in r.reason for r in report.layers), "the model must read a masked weight itself"
    return dense, model


def _write_in_place(dense, model) -> nn.Module:
    """Overwrite every masked weight of ``model`` in place under no_grad (a user's re-init); returns the
    plain-torch float64 reference: ``dense`` holding new weight * top2_mask(dense weight)."""
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, Sparse24Linear):
                new = torch.randn_like(m.weight) / m.in_features ** 0.5   # init's scale: O(1) outputs
                m.weight.copy_(new)
                ref.get_submodule(n).weight.copy_(new.double() * top2_mask(dense.get_submodule(n).weight))
    return ref


@pytest.mark.parametrize("build", [Parent, _encoder], ids=["parent", "encoder"])
@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_a_compiled_model_masks_a_directly_read_weight_written_in_place(build, train):
    """The parent's pre-hook skipped its check under torch.compile: after an in-place write the
    compiled model multiplied by the unmasked weight (rel err 1.2), silently and on every later call.
    Now the write is in the graph: no break (fullgraph=True), no recompile after the write."""
    dense, model = _sparsified(build, train)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 7, 32)
    with torch.set_grad_enabled(train):
        compiled(x)   # compiled before the write
    graphs = _counts()[0]
    ref = _write_in_place(dense, model)
    with torch.set_grad_enabled(train):
        y = compiled(x)
    y_ref = ref(x.double())
    torch.testing.assert_close(y.detach().double(), y_ref.detach(), rtol=0, atol=1e-5)
    assert _counts() == (graphs, 0)
    if train:
        g = torch.randn_like(y)
        (y * g).sum().backward()
        (y_ref * g.double()).sum().backward()
        for n, m in model.named_modules():
            if isinstance(m, Sparse24Linear):
                want = ref.get_submodule(n).weight.grad * top2_mask(dense.get_submodule(n).weight)
                torch.testing.assert_close(m.weight.grad.double(), want, rtol=0, atol=1e-5)


def test_inductor_masks_a_directly_read_weight_written_in_place():
    """The same through Inductor, which writes the masked weight in its generated kernel."""
    dense, model = _sparsified(Parent, False)
    compiled = torch.compile(model, backend="inductor")
    x = torch.randn(3, 32)
    with torch.no_grad():
        compiled(x)
        ref = _write_in_place(dense, model)
        y = compiled(x)
    torch.testing.assert_close(y.double(), ref(x.double()), rtol=0, atol=1e-5)


def test_a_compiled_model_built_under_inference_mode_runs_outside_it():
    """Inference tensors cannot be written outside inference mode: the compiled hook leaves them alone, as
    the eager one does (Dynamo cannot ask ``is_inference()`` without a graph break)."""
    torch.manual_seed(0)
    with torch.inference_mode():
        dense = Parent()
        model = copy.deepcopy(dense)
        sparse24.sparsify_(model, skip_output_head=False)
    x = torch.randn(3, 32)
    with torch.no_grad():
        y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    ref = copy.deepcopy(dense).double()
    with torch.inference_mode():
        for name in ("fc", "out"):
            w = ref.get_submodule(name).weight
            w.mul_(top2_mask(w))
        y_ref = ref(x.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)
    assert _counts()[1] == 0


def _unfrozen_decode_layer():
    """(layer, its bfloat16 dense weight): a bfloat16 compressed layer in the decode layout (what every frozen
    16-bit layer holds on an NVIDIA GPU; ``to_layout`` gives it on CPU) unfrozen with requires_grad_(True)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).bfloat16()
    layer = Sparse24Linear.from_linear(copy.deepcopy(lin), mode="compressed")
    layer.to_layout("decode")
    layer.requires_grad_(True)
    return layer, lin


def test_compiled_training_settles_an_unfrozen_decode_layout_layer_to_layout_v1():
    """Eager forward settled such a layer to layout v1 (in the same Parameter); the compiled forward skipped
    that, and the op's backward refused the decode layout: BackendCompilerFailed at the first call. Now it
    settles outside the graph once (a graph break on that call only) and trains as eager does."""
    layer, lin = _unfrozen_decode_layer()
    values = layer.values
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)   # holds the values Parameter from before
    compiled = torch.compile(nn.Sequential(layer), backend="aot_eager")
    w = lin.weight.detach().double()
    mask = top2_mask(lin.weight)
    for M in (5, 5, 3):
        x = torch.randn(M, 64, dtype=torch.bfloat16)
        g = torch.randn(M, 32, dtype=torch.bfloat16)
        layer.zero_grad()
        y = compiled(x)
        (y * g).float().sum().backward()
        y_ref = F.linear(x.double(), w * mask, lin.bias.double())
        torch.testing.assert_close(y.double(), y_ref, **tolerance(torch.bfloat16, 64))
        # dL/dW = g^T x, at the kept positions, row by row as layout v1 holds them
        grad_ref = (g.double().t() @ x.double())[mask].view(32, 32)
        torch.testing.assert_close(layer.values.grad.double(), grad_ref, **tolerance(torch.bfloat16, M))
    assert layer.layout == "v1" and layer.values is values and opt.param_groups[0]["params"][0] is values
    breaks = sum(counters["graph_break"].values())
    counters.clear()
    compiled(torch.randn(5, 64, dtype=torch.bfloat16)).float().sum().backward()
    assert _counts() == (0, 0) and breaks > 0   # the break was the first call's only


def test_fullgraph_says_how_to_compile_an_unfrozen_decode_layout_layer():
    """fullgraph=True cannot settle the layout inside the graph: Dynamo's error names the remedy."""
    layer, _ = _unfrozen_decode_layer()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"to_layout\('v1'\)"):
        torch.compile(nn.Sequential(layer), backend="aot_eager", fullgraph=True)(torch.randn(4, 64, dtype=torch.bfloat16))
    layer.to_layout("v1")
    torch._dynamo.reset()
    torch.compile(nn.Sequential(layer), backend="aot_eager", fullgraph=True)(torch.randn(4, 64, dtype=torch.bfloat16))


def test_sparse24_optimizer_hooks_leave_compiled_optimizer_steps_whole():
    """sparse24's step hooks run for every optimizer in the process; Dynamo traced them and broke on their
    weak dictionaries: once any masked layer existed, torch.compile(opt.step) of any optimizer, a dense
    model's too, compiled into several graphs with a graph break per parameter. Now they run eagerly
    around the compiled step, and still re-zero what the step moved."""
    torch.manual_seed(0)
    unrelated = nn.Sequential(nn.Linear(32, 32))
    sparse24.sparsify_(unrelated, skip_output_head=False)   # a masked layer alive elsewhere in the process
    dense = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    dense(torch.randn(4, 32)).sum().backward()
    step = torch.compile(opt.step, backend="eager")
    step()
    step()
    assert _counts() == (1, 0) and unrelated[0].mode == "masked"

    # the masked model's own SGD: a write into pruned positions, then compiled steps re-zero them
    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(nn.Linear(32, 32))
    w0 = model[0].weight.detach().double().clone()
    mask = top2_mask(model[0].weight)
    sparse24.sparsify_(model, skip_output_head=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = torch.compile(opt.step, backend="eager")
    x = torch.randn(4, 32, dtype=torch.float64)
    model.double()
    model(x).sum().backward()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    step()
    # SGD on (w0 * mask + 1) with the gradient x.sum(0) at kept positions, then pruned positions zero
    want = (w0 * mask + 1 - 0.5 * x.sum(0).expand(32, 32) * mask) * mask
    torch.testing.assert_close(model[0].weight.detach(), want, rtol=0, atol=1e-12)
    assert _counts() == (1, 0)

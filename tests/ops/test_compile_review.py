"""Deployment paths found wanting by review: compiled training recompiling per batch shape, masked
layers breaking the graph under no_grad / with frozen weights, torch.jit.trace of a masked model.
Graphs are counted with Dynamo's own counter against the dense model's, on CPU (aot_eager traces the
op's backward as Inductor does, in a fraction of the time)."""
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import sparse24


def _dense():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _graphs(model, xs, train: bool) -> tuple[int, int]:
    """(graphs compiled, graph breaks) of ``model`` compiled with dynamic shapes over the inputs."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True, backend="aot_eager")
    for x in xs:
        if train:
            compiled(x).pow(2).mean().backward()
        else:
            with torch.no_grad():
                compiled(x)
    out = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return out


def test_compiled_training_through_a_compressed_layer_does_not_recompile_per_shape():
    """The op's backward took the rows as ``Size.numel()``, which made them a constant while traced:
    every new batch or sequence length compiled again (the recompile limit then ran the rest eagerly)."""
    xs = [torch.randn(2, M, 64) for M in (2, 3, 5, 7, 9, 11)]
    dense = _graphs(_dense(), xs, train=True)
    m = _dense()
    sparse24.sparsify_(m, skip_output_head=False)
    sparse24.compress_(m, trainable_values=True)
    assert _graphs(m, xs, train=True)[0] <= dense[0], dense


@pytest.mark.parametrize("frozen", [False, True])
def test_masked_layers_compile_without_graph_breaks(frozen):
    """Under no_grad (serving masked mode) or with frozen weights the masked forward asked torch.func
    whether the weight is wrapped, which Dynamo cannot trace: a graph break per layer, and
    fullgraph=True failed."""
    m = _dense()
    sparse24.sparsify_(m, skip_output_head=False)
    if frozen:
        m.requires_grad_(False)
    xs = [torch.randn(M, 64) for M in (3, 5, 9)]
    graphs, breaks = _graphs(m, xs, train=False)
    assert breaks == 0 and graphs <= _graphs(_dense(), xs, train=False)[0]
    torch._dynamo.reset()
    full = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 64, dtype=torch.float64)
    with torch.no_grad():
        y = full(x.float())
    ref = x
    for layer in m:
        ref = nn.functional.linear(ref, layer.dense_weight().double(), layer.bias.double()) \
            if isinstance(layer, sparse24.Sparse24Linear) else layer(ref)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_jit_trace_of_a_masked_model_passes_its_check_and_keeps_the_mask():
    """torch.jit.trace records with gradients on (the where(mask, w, 0) path) and checks by running
    again under no_grad (the plain F.linear path): 'Graphs differed across invocations'. Traced, the
    masked forward keeps the masking, so the traced module stays right after a write to the weight."""
    m = _dense()
    sparse24.sparsify_(m, skip_output_head=False)
    x = torch.randn(3, 64)
    traced = torch.jit.trace(m, (x,))
    with torch.no_grad():
        m[0].weight.add_(1.0)   # pruned positions now non-zero: the traced graph must mask them
        masked = nn.functional.linear(x.double(), torch.where(m[0].mask, m[0].weight, 0).double(),
                                      m[0].bias.double())
        ref = nn.functional.linear(torch.relu(masked), torch.where(m[2].mask, m[2].weight, 0).double(),
                                   m[2].bias.double())
    torch.testing.assert_close(traced(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_make_fx_of_a_compressed_layer_keeps_torch_func_and_autocast():
    """make_fx sets fx's tracing flag too, with real tensors: a compressed layer took the symbolic
    trace's direct op call, skipping forward()'s torch.func routing and autocast cast (jvp / grad
    failed inside torch, autocast traced float32 where eager gives bfloat16)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import grad, jvp

    torch.manual_seed(0)
    layer = sparse24.Sparse24Linear.from_linear(nn.Linear(16, 8), mode="compressed")
    x, t = torch.randn(3, 16), torch.randn(3, 16)
    w, b = layer.dense_weight().double(), layer.bias.double()

    def under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)

    cases = [(lambda x, t: jvp(layer, (x,), (t,))[1], (x, t), t.double() @ w.T),
             (lambda x: grad(lambda x: layer(x).sum())(x), (x,), w.sum(0).expand(3, 16)),
             (under_autocast, (x,), x.double() @ w.T + b)]
    for fn, args, ref in cases:
        out = make_fx(fn)(*args)(*args)
        assert out.dtype == fn(*args).dtype
        tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)

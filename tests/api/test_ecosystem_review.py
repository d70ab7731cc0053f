"""Review fixes where sparse24 meets torch's own machinery: masked layers whose weight the parent reads
directly (nn.MultiheadAttention.out_proj, nn.TransformerEncoderLayer's fast path) stay masked after a
user's in-place write; learn_masks leaves such layers alone on an already sparsified model too;
compress_ / densify_ refuse reparametrized layers; lazy modules are reported, not a crash; Parameters
tied through one storage are seen as tied."""
import copy
import io
import pickle

import pytest
import torch
from conftest import assert_model_unchanged, model_snapshot
from torch import nn
from torch.nn.utils import parametrize, prune

import sparse24
from sparse24 import Sparse24Linear
from sparse24.api import swap
from sparse24.masks.kept_dense import _shared_weights

D = 32


def _is_ours(hook) -> bool:
    return type(hook).__name__ == "_MaskDirectReads"  # (sparse24.api.walk's)


def masked_reference(model: nn.Module) -> nn.Module:
    """float64 copy of ``model`` with every Sparse24Linear replaced by an nn.Linear holding
    where(mask, weight, 0) of its weight as it is now (hooks of sparse24 dropped)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        for k in [k for k, h in m._forward_pre_hooks.items() if _is_ours(h)]:
            del m._forward_pre_hooks[k]
        for name, c in list(m._modules.items()):
            if isinstance(c, Sparse24Linear):
                dense = nn.Linear(c.in_features, c.out_features, bias=c.bias is not None)
                with torch.no_grad():
                    dense.weight.copy_(torch.where(c.mask, c.weight, 0))
                    if c.bias is not None:
                        dense.bias.copy_(c.bias)
                m._modules[name] = dense
    return ref.double()


def ours(model) -> dict:
    """module name -> the paths of its _MaskDirectReads hooks (one entry per hook)."""
    return {n: [h.paths for h in m._forward_pre_hooks.values() if _is_ours(h)]
            for n, m in model.named_modules()
            if any(_is_ours(h) for h in m._forward_pre_hooks.values())}


def pruned_nonzero(layer: Sparse24Linear) -> int:
    return int((layer.weight.detach()[~layer.mask] != 0).sum())


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.fc = nn.MultiheadAttention(D, 4, batch_first=True), nn.Linear(D, D)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def reinit(m):
    if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2:
        nn.init.xavier_uniform_(m.weight)


# --- 1. a parent reading a masked child's weight directly sees it masked after an in-place write ----------

def _write_apply(model, dense):
    model.apply(reinit)


def _write_vector(model, dense):
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(dense.parameters()), model.parameters())


def _write_copy(model, dense):
    with torch.no_grad():
        model.attn.out_proj.weight.copy_(dense.attn.out_proj.weight)


@pytest.mark.parametrize("write", [_write_apply, _write_vector, _write_copy], ids=["apply-init", "vector", "copy"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_multihead_attention_out_proj_stays_masked_after_an_inplace_write(write, grad):
    torch.manual_seed(0)
    model = Attn()
    dense = copy.deepcopy(model)
    sparse24.sparsify_(model, skip_output_head=False)
    write(model, dense)
    assert pruned_nonzero(model.attn.out_proj) > 0  # the write did put pruned entries back
    ref = masked_reference(model)
    x = torch.randn(2, 5, D)
    with torch.set_grad_enabled(grad):
        out = model(x)
    torch.testing.assert_close(out.double(), ref(x.double()), rtol=1e-5, atol=1e-5)
    assert pruned_nonzero(model.attn.out_proj) == 0


def _encoder_layer():
    return nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)


@pytest.mark.parametrize("wrap", ["sequential", "encoder", "layer"])
def test_encoder_layer_fast_path_reads_masked_weights_after_an_inplace_write(wrap, monkeypatch):
    # The check sits above the layer where something above it is called: torch turns the fused
    # fast path off when any module inside the layer has a hook
    torch.manual_seed(0)
    build = {"sequential": lambda: nn.Sequential(_encoder_layer()),
             "encoder": lambda: nn.TransformerEncoder(_encoder_layer(), 2, enable_nested_tensor=False),
             "layer": _encoder_layer}[wrap]
    model = build().eval()
    sparse24.sparsify_(model, skip_output_head=False)
    layers = [m for m in model.modules() if isinstance(m, Sparse24Linear)]
    assert len(layers) == (6 if wrap == "encoder" else 3)
    with torch.no_grad():
        for m in layers:
            m.weight.copy_(torch.randn_like(m.weight) * 0.1)
    ref = masked_reference(model)
    calls = []
    real = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out.double(), ref(x.double()), rtol=1e-5, atol=1e-5)
    assert all(pruned_nonzero(m) == 0 for m in layers)
    # the fused path still runs, except for a bare layer (no module above it to hold the check)
    assert len(calls) == {"sequential": 1, "encoder": 2, "layer": 0}[wrap]


def test_one_hook_per_parent_kept_by_repeated_calls_and_removed_by_densify():
    torch.manual_seed(0)
    model = Attn()
    sparse24.sparsify_(model, skip_output_head=False, filter_fn=lambda m, fqn: fqn != "attn.out_proj")
    assert ours(model) == {}  # out_proj not masked: nothing to check
    sparse24.sparsify_(model, skip_output_head=False)
    assert ours(model) == {"attn": [("out_proj",)]}
    user = model.attn.register_forward_pre_hook(lambda *a: None)
    sparse24.sparsify_(model, skip_output_head=False)
    sparse24.compress_(model)  # out_proj stays masked, fc compressed
    sparse24.decompress_(model)
    assert ours(model) == {"attn": [("out_proj",)]} and len(model.attn._forward_pre_hooks) == 2
    sparse24.densify_(model)
    assert ours(model) == {} and len(model.attn._forward_pre_hooks) == 1
    user.remove()
    assert not model.attn._forward_pre_hooks


def test_hook_is_undone_with_a_failed_sparsify(monkeypatch):
    torch.manual_seed(0)
    model = Attn()
    snap = model_snapshot(model)

    def fail(m):
        raise RuntimeError("injected")
    monkeypatch.setattr(swap, "_after_change", fail)
    with pytest.raises(RuntimeError, match="injected"):
        sparse24.sparsify_(model, skip_output_head=False)
    assert_model_unchanged(model, snap)
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_hook_survives_deepcopy_and_pickle(how):
    torch.manual_seed(0)
    model = Attn()
    sparse24.sparsify_(model, skip_output_head=False)
    if how == "deepcopy":
        other = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf, pickle_module=pickle)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    assert ours(other) == {"attn": [("out_proj",)]}
    other.apply(reinit)
    ref = masked_reference(other)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(other(x).double(), ref(x.double()), rtol=1e-5, atol=1e-5)
    assert pruned_nonzero(model.attn.out_proj) == 0  # (the original untouched by the copy's writes)


def test_hook_never_writes_tensors_substituted_by_functional_call():
    torch.manual_seed(0)
    model = Attn()
    sparse24.sparsify_(model, skip_output_head=False)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["attn.out_proj.weight"].normal_()  # dense values at the pruned positions
    given = {k: v.clone() for k, v in params.items()}
    x = torch.randn(2, 5, D)
    torch.func.functional_call(model, params, (x,))
    torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
    assert all(torch.equal(params[k], given[k]) for k in params)


# --- 2. learn_masks on a sparsified model leaves directly read layers as they are ---------------------------

def test_learn_masks_on_a_sparsified_model_leaves_out_proj_alone():
    torch.manual_seed(0)
    teacher = Attn().eval()
    model = copy.deepcopy(teacher)
    sparse24.sparsify_(model, skip_output_head=False)
    mask = model.attn.out_proj.mask.clone()
    seen = []
    report = sparse24.learn_masks(model, [torch.randn(2, 5, D) for _ in range(2)], steps=2, teacher=teacher,
                                  check_batches=0,
                                  callback=lambda step, loss: seen.append(type(model.attn.out_proj)))
    assert "attn.out_proj" in report.not_learned and "reads" in report.not_learned["attn.out_proj"]
    assert "fc" in report.layers
    assert seen == [Sparse24Linear, Sparse24Linear]  # never a stand-in MultiheadAttention would read dense
    assert torch.equal(model.attn.out_proj.mask, mask) and pruned_nonzero(model.attn.out_proj) == 0


# --- 3. compress_ / densify_ refuse reparametrized layers ----------------------------------------------------

class _Scale(nn.Module):
    def forward(self, X):
        return X * 1.5

    def right_inverse(self, X):
        return X / 1.5


REPARAMETRIZE = {
    "parametrize": lambda m: parametrize.register_parametrization(m, "weight", _Scale()),
    "prune": lambda m: prune.l1_unstructured(m, "weight", 0.3),
    "weight_norm": lambda m: torch.nn.utils.weight_norm(m),
    "bias-parametrize": lambda m: parametrize.register_parametrization(m, "bias", _Scale()),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("how", list(REPARAMETRIZE))
@pytest.mark.parametrize("call", ["compress_", "densify_"])
def test_reparametrized_layer_refused_by_name(call, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    sparse24.sparsify_(model, skip_output_head=False)
    REPARAMETRIZE[how](model[2])
    if how.startswith("bias") and call == "compress_":  # a bias stays as it is in compressed mode
        sparse24.compress_(model)
        assert model[0].mode == model[2].mode == "compressed"
        return
    snap = model_snapshot(model)
    name = "'bias'" if how.startswith("bias") else "'weight'"
    with pytest.raises(ValueError, match=rf"{call}: layer '2': its {name} is reparametrized .*remove it first"):
        getattr(sparse24, call)(model)
    assert_model_unchanged(model, snap)
    assert model[0].mode == "masked"



@pytest.mark.parametrize("names", [["bias"], ["weight"], ["weight", "bias"]])
def test_sparsify_names_what_is_parametrized(names):
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    for n in names:
        parametrize.register_parametrization(model[0], n, _Scale())
    report = sparse24.sparsify_(model, skip_output_head=False)
    why = {r.fqn: r.reason for r in report.skipped}
    assert why["0"].startswith(f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} parametrized"), why
    assert not any("parametrizations" in fqn for fqn in why), why   # (no second line for torch's own module)


def test_parametrized_matrices_of_other_modules_are_reported_not_handled():
    # wav2vec2/HuBERT's positional conv carries weight_norm: its matrix is in the ParametrizationList
    from torch.nn.utils import parametrizations

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.conv, self.lin = nn.Embedding(64, D), nn.Conv1d(D, D, 3), nn.Linear(D, D)

        def forward(self, x):
            return self.lin(self.emb(x))

    model = M()
    parametrizations.weight_norm(model.conv, dim=2)
    parametrizations.orthogonal(model.emb)
    why = {r.fqn: r.reason for r in sparse24.sparsify_(model, skip_output_head=False).skipped}
    assert why["conv"].startswith("not handled: ParametrizedConv1d: a convolution") and \
        why["emb"].startswith("not handled: ParametrizedEmbedding: a lookup table"), why

# --- 4. lazy modules are reported, not a crash --------------------------------------------------------------

@pytest.mark.parametrize("lazy", [lambda: nn.LazyLinear(D), lambda: nn.LazyConv1d(8, 3)], ids=["Linear", "Conv1d"])
def test_unmaterialized_lazy_module_is_skipped_with_the_reason(lazy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), lazy())
    report = sparse24.sparsify_(model, skip_output_head=False)
    lines = {r.fqn: r for r in report.layers}
    assert lines["3"].action == "skipped"
    assert "lazy, not materialized: run a forward pass first" in lines["3"].reason
    assert {r.fqn for r in report.swapped} == {"0", "2"}
    assert "lazy" in str(report)


def test_lazy_linear_is_swapped_once_materialized():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.LazyLinear(D))
    sparse24.sparsify_(model, skip_output_head=False)
    model(torch.randn(2, D))  # LazyLinear becomes an nn.Linear
    assert [r.fqn for r in sparse24.sparsify_(model, skip_output_head=False).swapped] == ["1"]


# --- 5. Parameters over one storage are tied ----------------------------------------------------------------

class LM(nn.Module):
    def __init__(self, vocab=128):
        super().__init__()
        self.emb, self.body = nn.Embedding(vocab, D), nn.Linear(D, D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t):
        return self.head(torch.relu(self.body(self.emb(t))))


def test_head_tied_through_storage_is_skipped_and_the_embedding_kept():
    torch.manual_seed(0)
    buf = io.BytesIO()
    torch.save(LM().state_dict(), buf)
    buf.seek(0)
    with torch.device("meta"):
        model = LM()
    model.load_state_dict(torch.load(buf), assign=True)
    assert model.head.weight is not model.emb.weight  # two Parameters, one storage
    emb = model.emb.weight.detach().clone()
    report = sparse24.sparsify_(model, skip_output_head=False)
    head = next(r for r in report.layers if r.fqn == "head")
    assert head.action == "skipped" and "shared with emb.weight (tied)" in head.reason
    assert torch.equal(model.emb.weight, emb)
    assert [r.fqn for r in report.swapped] == ["body"]


def test_shared_weights_groups_overlapping_bytes_only():
    flat = torch.randn(4 * D * D)
    model = nn.Sequential(*(nn.Linear(D, D) for _ in range(4)))
    model[0].weight = nn.Parameter(flat[: D * D].view(D, D))
    model[1].weight = nn.Parameter(flat[D * D // 2: 3 * D * D // 2].view(D, D))  # overlaps 0's bytes
    model[2].weight = nn.Parameter(flat[2 * D * D: 3 * D * D].view(D, D))        # the same storage, apart
    model[3].weight = nn.Parameter(flat[3 * D * D:].view(D, D))
    shared = _shared_weights(model)
    assert shared == {id(model[i].weight): ["0.weight", "1.weight"] for i in (0, 1)}
    ref = [model[i].weight.detach().clone() for i in range(4)]
    report = sparse24.sparsify_(model, skip_output_head=False, min_features=1)
    assert [r.fqn for r in report.swapped] == ["2", "3"]
    assert all("shared with" in r.reason for r in report.skipped if r.fqn in ("0", "1"))
    assert torch.equal(model[0].weight, ref[0]) and torch.equal(model[1].weight, ref[1])
    assert all(torch.equal(model[i].weight, torch.where(model[i].mask, ref[i], 0)) for i in (2, 3))

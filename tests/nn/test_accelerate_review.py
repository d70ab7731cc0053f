"""Review findings (round 9, "amp") on Hugging Face Accelerate: its big-model loaders filling a meta-built
sparsified model (tensors set directly, no load_state_dict), SRSTE given the optimizer accelerator.prepare
returns, and INT8 / INT4 scales a loader's dtype= casts. References: fp64 masked products (an independent
top-2 mask, dequantized stored values), plain torch loops, the checkpoint files themselves."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as P
from accelerate import Accelerator, init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

import sparse24

from conftest import (assert_matches_reference, assert_model_unchanged, dequantized_reference, fail_on_call,
                      int4_dequantized_reference, model_snapshot, top2_mask)
from hf_models import masked_reference, tiny_llama, tokens


def build():
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


@pytest.fixture
def dense():
    torch.manual_seed(0)
    return build()


def empty_sparsified(**kw):
    with init_empty_weights():
        m = build()
    sparse24.sparsify_(m, min_features=0, skip_output_head=False, **kw)
    assert m[0].pending and m[0].weight.is_meta if not kw else m[0].pending
    return m


def save(tmp_path, model, name):
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata={"format": "pt"})
    return str(path)


def assert_layers_match(m, x, weights):
    """Each 2:4 layer of ``m`` (layers 0 and 2), fed the previous one's output, within the error bound of the
    fp64 product with ``weights[i]`` (dense ``(out, in)``)."""
    h = x
    for i in (0, 2):
        out = m[i](h)
        assert_matches_reference(out, h, weights[i], m[i].bias)
        h = F.gelu(out) if i == 0 else out


def masked(dense):
    """``{i: fp64 weight of dense[i] times its independent top-2 mask}``."""
    return {i: dense[i].weight.detach().double() * top2_mask(dense[i].weight) for i in (0, 2)}


def load(loader, model, path, **kw):
    if loader == "load_checkpoint_and_dispatch":
        return load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"}, **kw)
    load_checkpoint_in_model(model, path, device_map={"": "cpu"}, **kw)
    return model


# --- F1: accelerate's loaders set tensors directly; a pending layer takes them -------------------------

@pytest.mark.parametrize("loader", ["load_checkpoint_and_dispatch", "load_checkpoint_in_model"])
@pytest.mark.parametrize("checkpoint", ["dense", "masked"])
def test_accelerate_loaders_fill_a_meta_built_masked_model(tmp_path, dense, loader, checkpoint):
    source = copy.deepcopy(dense)
    if checkpoint == "masked":
        sparse24.sparsify_(source, min_features=0, skip_output_head=False)
    m = load(loader, empty_sparsified(), save(tmp_path, source, checkpoint))
    x = torch.randn(4, 64)
    if loader == "load_checkpoint_in_model":   # no move: a forward refuses, naming the call that takes them
        with pytest.raises(RuntimeError, match=r"finish_loading\(\)"):
            m(x)
        assert m[0].pending
        for layer in (m[0], m[2]):
            layer.finish_loading()
    for i in (0, 2):
        mask = top2_mask(dense[i].weight)
        assert not m[i].pending and torch.equal(m[i].mask, mask)
        assert torch.equal(m[i].weight, torch.where(mask, dense[i].weight, 0))  # the pruned weights are 0
    assert_layers_match(m, x, masked(dense))


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_accelerate_loads_a_compressed_checkpoint_into_a_meta_built_model(tmp_path, dense, quantize):
    source = copy.deepcopy(dense)
    sparse24.sparsify_(source, min_features=0, skip_output_head=False, mode="compressed", quantize=quantize)
    path = save(tmp_path, source, "compressed")
    m = load_checkpoint_and_dispatch(empty_sparsified(mode="compressed", quantize=quantize), path,
                                     device_map={"": "cpu"})
    stored = load_file(path)
    assert m.state_dict().keys() == stored.keys()
    for k, v in m.state_dict().items():   # the file's tensors, as they are
        assert v.dtype == stored[k].dtype and torch.equal(v, stored[k]), k
    assert not m[0].pending and not m[2].pending
    weights = {i: dense[i].weight.double() * top2_mask(dense[i].weight) if quantize is None else
               (dequantized_reference if quantize == "int8" else int4_dequantized_reference)(m[i], top2_mask(dense[i].weight))
               for i in (0, 2)}
    assert_layers_match(m, torch.randn(4, 64), weights)


def test_a_saved_hugging_face_folder_loads_with_load_checkpoint_and_dispatch(tmp_path):
    dense = tiny_llama()
    source = copy.deepcopy(dense)
    sparse24.sparsify_(source, mode="compressed", quantize="int8")
    source.save_pretrained(tmp_path)
    with init_empty_weights():
        m = type(dense)(dense.config)
    sparse24.sparsify_(m, mode="compressed", quantize="int8")
    m = load_checkpoint_and_dispatch(m, str(tmp_path), device_map={"": "cpu"}).eval()
    ids = tokens()
    with torch.no_grad():
        out = m(ids).logits.double()
        ref = masked_reference(dense, m)(ids).logits
    assert torch.allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_dense_checkpoint_cannot_fill_compressed_layers_and_says_why(tmp_path, dense, quantize):
    path = save(tmp_path, dense, "dense")
    m = empty_sparsified(mode="compressed", quantize=quantize)
    with pytest.raises(RuntimeError, match=r"Sparse24Linear\(in_features=64, out_features=128\).*'values', 'meta'"
                                           r".*not loaded.*load_state_dict"):
        load_checkpoint_and_dispatch(m, path, device_map={"": "cpu"})   # (its model.to(): torch's bare meta error)
    assert m[0].pending
    m = empty_sparsified(mode="compressed", quantize=quantize)
    load_checkpoint_in_model(m, path, device_map={"": "cpu"})
    with pytest.raises(RuntimeError, match=r"'values', 'meta'.*not loaded.*cannot run"):
        m(torch.randn(2, 64))


def test_to_empty_layers_wait_for_finish_loading(tmp_path, dense):
    source = copy.deepcopy(dense)
    sparse24.sparsify_(source, min_features=0, skip_output_head=False)
    path = save(tmp_path, source, "masked")
    x = torch.randn(4, 64)
    with torch.device("meta"):
        m = build()
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    m.to_empty(device="cpu")   # real memory, no weights: must not pass for loaded
    with pytest.raises(RuntimeError, match="uninitialized memory.*finish_loading"):
        m(x)
    with pytest.raises(RuntimeError, match="uninitialized memory"):
        copy.deepcopy(m)(x)
    load_checkpoint_in_model(m, path, device_map={"": "cpu"})
    with pytest.raises(RuntimeError, match="finish_loading"):
        m(x)
    for i in (0, 2):
        assert m[i].finish_loading() is m[i] and not m[i].pending
    assert_layers_match(m, x, masked(dense))


def test_corrupt_tensors_set_by_a_loader_are_refused_and_nothing_changes(dense):
    m = empty_sparsified()
    source = copy.deepcopy(dense)
    sparse24.sparsify_(source, min_features=0, skip_output_head=False)
    entries = {k: v.detach().clone() for k, v in source.state_dict().items()}
    entries["0.weight"] = dense[0].weight.detach().clone()   # dense beside a 2:4 mask
    for k, v in entries.items():
        set_module_tensor_to_device(m, k, "cpu", value=v)
    snap = model_snapshot(m)
    with pytest.raises(ValueError, match=r"Sparse24Linear\(in_features=64, out_features=128\).*non-zero where"):
        m[0].finish_loading()
    with pytest.raises(ValueError, match=r"Sparse24Linear\(in_features=64, out_features=128\).*non-zero where"):
        m.to(torch.float32)   # a move takes them too (dispatch_model's)
    assert m[0].pending
    assert_model_unchanged(m, snap)


def test_a_dense_weight_set_directly_into_a_square_conv1d_layer_is_refused(tmp_path):
    torch.manual_seed(0)
    dense = nn.Sequential(Conv1D(64, 64))
    path = save(tmp_path, dense, "conv1d")
    with init_empty_weights():
        m = nn.Sequential(Conv1D(64, 64))
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    with pytest.raises(RuntimeError, match=r"replaced a Hugging Face Conv1D.*transpose.*load_state_dict"):
        load_checkpoint_and_dispatch(m, path, device_map={"": "cpu"})
    assert m[0].pending and m[0].mask.is_meta


def test_compress_after_an_accelerate_load_compresses_the_loaded_weights(tmp_path, dense):
    m = empty_sparsified()
    load_checkpoint_in_model(m, save(tmp_path, dense, "dense"), device_map={"": "cpu"})
    sparse24.compress_(m)   # no forward in between: the loaded weights, not placeholders
    assert not m[0].pending and m[0].mode == "compressed"
    assert_layers_match(m, torch.randn(4, 64), masked(dense))


# --- F2: SRSTE given accelerate's (or HF Trainer's) AcceleratedOptimizer -------------------------------

@pytest.fixture
def accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_srste_with_the_optimizer_accelerate_prepared_matches_a_plain_loop(accelerate_state):
    k, decay, steps = 2, 0.5, 2
    X, Y = torch.randn(k * steps, 4, 64), torch.randn(k * steps, 4, 64)

    def fresh():
        torch.manual_seed(0)
        return build()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = fresh()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not hasattr(opt, "_optimizer_step_pre_hooks")   # accelerate's wrapper: no hook table of its own
    srste = sparse24.SRSTE(model, decay=decay, optimizer=opt, min_features=0)
    for i in range(k * steps):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(X[i]), Y[i]))
            opt.step()
            opt.zero_grad()

    # SR-STE by hand: the masked forward with a straight-through gradient, the decay added once per step
    ref = fresh()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(k * steps):
        ws = [ref[j].weight for j in (0, 2)]
        masks = [top2_mask(w) for w in ws]
        ste = [w + (torch.where(mk, w, 0) - w).detach() for w, mk in zip(ws, masks)]
        out = F.linear(F.gelu(F.linear(X[i], ste[0], ref[0].bias)), ste[1], ref[2].bias)
        (F.mse_loss(out, Y[i]) / k).backward()
        if (i + 1) % k == 0:
            with torch.no_grad():
                for w, mk in zip(ws, masks):
                    w.grad.add_(decay * w * ~mk)
            ref_opt.step()
            ref_opt.zero_grad()
    for j in (0, 2):
        assert torch.equal(model[j].parametrizations.weight.original, ref[j].weight)
    srste.finalize()


def test_srste_refuses_an_optimizer_without_step_hooks_before_changing_anything():
    class Hookless(torch.optim.Optimizer):   # an Optimizer subclass skipping Optimizer.__init__, wrapping nothing
        def __init__(self, params):
            self.param_groups = [{"params": list(params)}]
    torch.manual_seed(0)
    model = build()
    snap = model_snapshot(model)
    with pytest.raises(TypeError, match="SRSTE: the optimizer \\(Hookless\\) has no step hooks"):
        sparse24.SRSTE(model, optimizer=Hookless(model.parameters()), min_features=0)
    assert_model_unchanged(model, snap)
    assert not any(P.is_parametrized(model[i]) for i in (0, 2))


def test_srste_removes_its_step_hook_when_a_layer_fails(monkeypatch):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = model_snapshot(model, opt)
    fail_on_call(monkeypatch, P, "register_parametrization", 1)
    with pytest.raises(RuntimeError, match="injected"):
        sparse24.SRSTE(model, optimizer=opt, min_features=0)
    assert_model_unchanged(model, snap, opt)
    assert not opt._optimizer_step_pre_hooks


# --- F3: INT8 / INT4 scales cast by a loader's dtype= ----------------------------------------------------

@pytest.mark.parametrize("quantize, stored", [("int8", torch.float32), ("int4", torch.float16)])
def test_scales_a_loader_cast_are_refused_at_forward_naming_the_layer(tmp_path, dense, quantize, stored):
    source = copy.deepcopy(dense)
    sparse24.sparsify_(source, min_features=0, skip_output_head=False, mode="compressed", quantize=quantize)
    path = save(tmp_path, source, quantize)
    m = copy.deepcopy(source)
    m = load_checkpoint_and_dispatch(m, path, device_map={"": "cpu"}, dtype=torch.bfloat16)
    assert m[0].scale.dtype == torch.bfloat16   # accelerate's cast (sparse24's own .to() keeps them)
    with pytest.raises(ValueError, match=rf"Sparse24Linear\(in_features=64, out_features=128\)'s {quantize.upper()} "
                                         rf"scales are torch.bfloat16, not {stored}.*dtype="):
        m(torch.randn(2, 64, dtype=torch.bfloat16))
    # without dtype= the scales stay as stored (and model.to(bfloat16) after keeps them)
    m = load_checkpoint_and_dispatch(copy.deepcopy(source), path, device_map={"": "cpu"})
    assert m[0].scale.dtype == stored and m.to(torch.bfloat16)[0].scale.dtype == stored
    m.float()
    x = torch.randn(2, 64)
    mask = top2_mask(dense[0].weight)
    w = dequantized_reference(m[0], mask) if quantize == "int8" else int4_dequantized_reference(m[0], mask)
    assert_matches_reference(m[0](x), x, w, m[0].bias)


def test_a_directly_read_pending_weight_is_refused_then_masked_after_finish_loading(tmp_path):
    """MultiheadAttention reads its ``out_proj.weight`` itself (never calling out_proj): after
    load_checkpoint_in_model alone (no move) it multiplied by the dense weight the loader set, silently.
    The parent's check refuses as the layer's own forward does; after finish_loading the mask applies."""
    torch.manual_seed(0)
    dense = nn.MultiheadAttention(64, 4, batch_first=True)
    with init_empty_weights():
        m = nn.MultiheadAttention(64, 4, batch_first=True)
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    assert m.out_proj.pending
    load_checkpoint_in_model(m, save(tmp_path, dense, "mha"), device_map={"": "cpu"})
    x = torch.randn(2, 5, 64)
    with pytest.raises(RuntimeError, match=r"finish_loading\(\)"):
        m(x, x, x, need_weights=False)
    m.out_proj.finish_loading()
    got = m(x, x, x, need_weights=False)[0]
    w = dense.out_proj.weight.detach().double() * top2_mask(dense.out_proj.weight)
    ref = copy.deepcopy(dense).double()
    with torch.no_grad():
        ref.out_proj.weight.copy_(w)
        want = ref(*(x.double(),) * 3, need_weights=False)[0]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert not m.out_proj.pending


@pytest.mark.parametrize("given", ["state_dict", "parameters"])
def test_functional_call_on_a_pending_model_changes_neither_the_callers_tensors_nor_the_model(dense, given):
    """torch.func.functional_call swaps the caller's tensors in for one call: a pending layer once took them
    as loaded there, pruned them in place (the caller's dense model too) and stayed half loaded (a meta
    weight beside a real mask, which no load_state_dict then took). It refuses, and the documented load
    still works afterwards."""
    m = empty_sparsified()
    tensors = dense.state_dict() if given == "state_dict" else dict(dense.named_parameters())
    before = {k: v.detach().clone() for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match=r"finish_loading\(\)"):
        torch.func.functional_call(m, tensors, (torch.randn(2, 64),))
    for k, v in tensors.items():
        assert torch.equal(v, before[k]), k
    assert m[0].pending and m[0].weight.is_meta and m[0].mask.is_meta
    m.load_state_dict(dense.state_dict(), assign=True)
    x = torch.randn(4, 64)
    assert_layers_match(m, x, masked(dense))

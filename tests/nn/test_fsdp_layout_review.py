"""Compressed Sparse24Linear layers sharded by FSDP2 (``fully_shard``), on 2 CPU processes over gloo:
the layout FSDP shards stays (to_layout refuses to change it; forward never settles FSDP's gathered
values into the decode layout), a layer sharded in the decode layout says at the first call that
cannot work (state dicts, loads) to call ``to_layout("v1")`` before fully_shard, and the calls that
need the whole weight refuse sharded compressed layers clearly, changing nothing.

One spawn runs every scenario (each rank records its results, rank 0 returns both ranks'); the
tests below check them. References: float64 dense weights taken before sharding."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sparse24

from conftest import assert_matches_reference, dequantized_reference, top2_mask
from distributed import NO_INTEGER_FSDP2, fsdp2_shards_integer_parameters, spawn

WORLD = 2
R, C = 32, 64   # 16 rows per rank


def _try(f):
    try:
        v = f()
        # (plain values only: results travel to rank 0 pickled; a module or DTensor is named instead)
        return ("ok", v if type(v) in (torch.Tensor, bool, type(None)) else type(v).__name__)
    except Exception as e:  # recorded; the tests below say which call raised what
        return ("err", type(e).__name__, str(e))


def _full_state(model) -> dict:
    """The state dict with every DTensor gathered (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _model(dtype, quantize):
    """(model, fp64 reference weight, bias, input): one compressed layer, the same on every rank."""
    torch.manual_seed(0)
    lin = nn.Linear(C, R).to(dtype)
    mask = top2_mask(lin.weight)
    w, b = lin.weight.detach().double().clone(), lin.bias.detach().double().clone()
    model = nn.Sequential(lin)
    sparse24.sparsify_(model, mode="compressed", quantize=quantize, min_features=1, skip_output_head=False)
    # (INT8: the dequantized weight as the dot's operands hold it, in the layer's dtype)
    w64 = dequantized_reference(model[0], mask).to(dtype).double() if quantize else torch.where(mask, w, 0)
    return model, w64, b, torch.randn(4, C).to(dtype)


def _shard(model, mesh):
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _forward(model, x):
    with torch.no_grad():
        return model(x).clone()


def _to_layout_decode(mesh) -> dict:
    """to_layout("decode") on a sharded INT8 layer (layout v1)."""
    model, w64, b, x = _model(torch.float32, "int8")
    layer, before = model[0], _full_state(model)
    _shard(model, mesh)
    out = {"ref": (x, w64, b), "call": _try(lambda: layer.to_layout("decode"))}
    out["layout"], out["pref"] = layer.layout, layer.__dict__.get("_layout_pref")
    out["values"] = (type(layer.values).__name__, tuple(layer.values.shape), layer.values.dtype)
    out["forward"] = [_try(lambda: _forward(model, x)) for _ in range(2)]
    out["state"] = _try(lambda: _same(_full_state(model), before))
    return out


def _forward_settling(mesh) -> dict:
    """A sharded INT8 layer whose preference is the decode layout (what a frozen INT8 layer wants on an
    NVIDIA GPU): inside FSDP's forward (values gathered, a plain tensor) its settling, as
    _compressed_forward runs it for CUDA values, must leave FSDP's parameter as it is."""
    model, w64, b, x = _model(torch.float32, "int8")
    layer, before = model[0], _full_state(model)
    layer.__dict__["_layout_pref"] = "decode"   # as to_layout("decode") leaves it, the layout not yet changed
    _shard(model, mesh)
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append(
        (isinstance(m.values, DTensor), m._wanted_layout(), m._settle_layout(keep_values=True), m.layout)))
    out = {"ref": (x, w64, b), "forward": [_try(lambda: _forward(model, x)) for _ in range(2)]}
    out["seen"], out["layout"] = seen, layer.layout
    out["state"] = _try(lambda: _same(_full_state(model), before))
    return out


def _decode_then_shard(mesh, folder) -> dict:
    """fp16 INT8 in the decode layout (a GPU's default for it), then fully_shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    model, w64, b, x = _model(torch.float16, "int8")
    layer, v1_state = model[0], _full_state(model)
    layer.to_layout("decode")
    y = _forward(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _shard(model, mesh)
    out = {"ref": (x, w64, b), "y": y, "warnings": [str(w.message) for w in caught]}
    held = [layer.values, layer.values.to_local().clone(), layer.meta, layer.meta.clone()]
    out["forward"] = _try(lambda: _forward(model, x))
    out["state_dict"] = _try(lambda: model.state_dict())
    out["get_model_state_dict"] = _try(lambda: get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True)))
    out["dcp.save"] = _try(lambda: dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder}/decode"))
    out["load_state_dict"] = _try(lambda: model.load_state_dict(v1_state))
    out["set_model_state_dict"] = _try(lambda: set_model_state_dict(
        model, v1_state, options=StateDictOptions(full_state_dict=True)))
    out["to_layout('v1')"] = _try(lambda: layer.to_layout("v1"))
    out["half()"] = _try(lambda: layer.half())
    out["layout"] = layer.layout
    out["unchanged"] = layer.values is held[0] and torch.equal(layer.values.to_local(), held[1]) \
        and layer.meta is held[2] and torch.equal(layer.meta, held[3])
    out["forward after"] = _try(lambda: _forward(model, x))
    out["v1 state"] = v1_state
    return out


def _v1_then_shard(mesh, folder) -> dict:
    """The advice: to_layout("v1") before fully_shard; the state dicts and a checkpoint then work."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    model, w64, b, x = _model(torch.float16, "int8")
    layer, v1_state = model[0], _full_state(model)
    layer.to_layout("decode").to_layout("v1")
    _shard(model, mesh)
    out = {"ref": (x, w64, b), "forward": _try(lambda: _forward(model, x))}
    out["full"] = _try(lambda: _same(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
                                     v1_state))
    out["dcp.save"] = _try(lambda: dcp.save(get_model_state_dict(model), checkpoint_id=f"{folder}/v1") and None)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(C, R)).half()
    sparse24.sparsify_(other, mode="compressed", quantize="int8", min_features=1, skip_output_head=False)
    other[0].to_layout("v1")   # (v1 already on CPU: the advice as a script for a GPU would run it)
    _shard(other, mesh)

    def load():
        sd = get_model_state_dict(other)
        dcp.load(sd, checkpoint_id=f"{folder}/v1")
        set_model_state_dict(other, sd)
        return _forward(other, x)
    out["loaded"] = _try(load)
    return out


def _dense_calls(mesh, quantize) -> dict:
    """The calls that need the whole weight, on a sharded compressed layer (layout v1)."""
    model, w64, b, x = _model(torch.float32, quantize)
    layer, before = model[0], _full_state(model)
    _shard(model, mesh)
    calls = {"densify_": lambda: sparse24.densify_(model), "decompress_": lambda: sparse24.decompress_(model),
             "dense_weight": lambda: layer.dense_weight(), "to_dense_module": lambda: layer.to_dense_module(),
             "add_to_kept_": lambda: layer.add_to_kept_(torch.ones(R, C)), "to_masked": lambda: layer.to_masked()}
    out = {"ref": (x, w64, b)}
    for name, f in calls.items():
        r = _try(f)
        out[name] = (r if r[0] == "err" else ("ok",), model[0] is layer, layer.mode,
                     _try(lambda: _same(_full_state(model), before)), _try(lambda: _forward(model, x)))
    return out


def _decode_beside_v1(mesh) -> dict:
    """A layer sharded in the decode layout beside a layout-v1 one: a load (strict or not) bringing both
    layers' entries is refused before any module copies (the layer's own refusal came after torch had
    copied the layers before it: a non-strict load left layer 0 holding the checkpoint)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(C, C), nn.Linear(C, R)).half()
        sparse24.sparsify_(model, mode="compressed", quantize="int8", min_features=1, skip_output_head=False)
        return model
    source = build(0).state_dict()
    model = build(1)
    model[1].to_layout("decode")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (model[0], model[1], model):
            fully_shard(m, mesh=mesh)
    before = _full_state(model[0])
    out = {}
    for strict in (True, False):
        out[strict] = _try(lambda: set_model_state_dict(model, source, options=StateDictOptions(
            full_state_dict=True, strict=strict)))
        out[strict, "unchanged"] = _same(_full_state(model[0]), before)
    return out


def _worker(rank, folder):
    mesh = init_device_mesh("cpu", (WORLD,))
    if not fsdp2_shards_integer_parameters(mesh):   # torch < 2.13: the INT8 scenarios cannot be sharded at all
        model = _model(torch.float32, "int8")[0]
        out = {"no int8": _try(lambda: _shard(model, mesh)), "dense None": _dense_calls(mesh, None)}
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, out)
        return gathered
    out = {"beside": _decode_beside_v1(mesh), "to_layout": _to_layout_decode(mesh), "settle": _forward_settling(mesh),
           "decode": _decode_then_shard(mesh, folder), "v1": _v1_then_shard(mesh, folder),
           **{f"dense {q}": _dense_calls(mesh, q) for q in (None, "int8")}}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, out)
    return gathered


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_worker, WORLD, str(tmp_path_factory.mktemp("fsdp_layout")), timeout=120)


def _int8(ranks):
    """Skip where this torch's FSDP2 cannot shard INT8 layers (every scenario here but one)."""
    if "no int8" in ranks[0]:
        pytest.skip(NO_INTEGER_FSDP2)


def test_int8_sharding_fails_loudly_on_older_torch(ranks):
    """torch 2.9-2.11: fully_shard of an INT8 layer raises torch's own error (never a layer half sharded)."""
    if "no int8" not in ranks[0]:
        pytest.skip("this torch's FSDP2 shards integer Parameters")
    for r in ranks:
        status, kind, msg = r["no int8"]
        assert status == "err" and kind == "RuntimeError" and "floating point dtype" in msg, r["no int8"]


def _matches(result, ref, dtype):
    assert result[0] == "ok", result
    x, w64, b = ref
    assert_matches_reference(result[1], x, w64, b, dtype)


def test_to_layout_decode_refused_on_sharded_layer(ranks):
    _int8(ranks)
    for got in (r["to_layout"] for r in ranks):
        assert got["call"][0] == "err", got["call"]   # it was accepted, and left the layer broken
        status, kind, msg = got["call"]
        assert kind == "RuntimeError" and "sharded" in msg and "nothing was changed" in msg, msg
        assert got["layout"] == "v1" and got["pref"] is None
        assert got["values"] == ("DTensor", (R, C // 2), torch.int8)   # FSDP's parameter, layout v1 as sharded
        for y in got["forward"]:
            _matches(y, got["ref"], torch.float32)
        assert got["state"] == ("ok", True)


def test_sharded_layer_never_settles_to_decode_in_forward(ranks):
    _int8(ranks)
    for got in (r["settle"] for r in ranks):
        # inside FSDP's forward the values are gathered (plain), and the layer still wants layout v1
        assert got["seen"] == [(False, "v1", False, "v1")] * 2, got["seen"]
        for y in got["forward"]:
            _matches(y, got["ref"], torch.float32)
        assert got["layout"] == "v1" and got["state"] == ("ok", True)


def test_decode_layout_sharded_refuses_state_dicts_clearly(ranks):
    _int8(ranks)
    for got in (r["decode"] for r in ranks):
        assert any(f"Sparse24Linear(in_features={C}, out_features={R})" in w and "to_layout('v1')" in w
                   and "fully_shard" in w for w in got["warnings"]), got["warnings"]
        assert got["forward"][0] == "ok" and torch.equal(got["forward"][1], got["y"])   # forward works, exact
        _matches(got["forward"], got["ref"], torch.float16)
        for call in ("state_dict", "get_model_state_dict", "dcp.save", "load_state_dict", "set_model_state_dict"):
            status, kind, msg = got[call]
            # (a strict load's whole-model check lists the layer's own entries without its path: named by shape)
            loads = ("load_state_dict", "set_model_state_dict")
            who = f"Sparse24Linear(in_features={C}, out_features={R})" if call in loads else "layer '0'"
            assert status == "err" and (who in msg or "layer '0'" in msg) and "to_layout('v1')" in msg \
                and "before fully_shard" in msg and "nothing was changed" in msg, (call, msg)
        for call in ("to_layout('v1')", "half()"):
            status, kind, msg = got[call]
            assert status == "err" and kind == "RuntimeError" and "to_layout('v1')" in msg \
                and "nothing was changed" in msg, (call, msg)
        assert got["layout"] == "decode" and got["unchanged"]
        assert got["forward after"][0] == "ok" and torch.equal(got["forward after"][1], got["y"])


def test_v1_before_fully_shard_saves(ranks):
    _int8(ranks)
    for got in (r["v1"] for r in ranks):
        _matches(got["forward"], got["ref"], torch.float16)
        assert got["full"] == ("ok", True) and got["dcp.save"] == ("ok", None)
        _matches(got["loaded"], got["ref"], torch.float16)
        assert torch.equal(got["loaded"][1], got["forward"][1])


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_sharded_compressed_layers_refuse_dense_calls(ranks, quantize):
    if quantize:
        _int8(ranks)
    for got in (r[f"dense {quantize}"] for r in ranks):
        for name in ("densify_", "decompress_", "dense_weight", "to_dense_module", "add_to_kept_", "to_masked"):
            call, same_layer, mode, state, y = got[name]
            assert call[0] == "err" and call[1] == "RuntimeError", (name, call)
            assert f"Sparse24Linear(in_features={C}, out_features={R})'s values are sharded" in call[2] \
                and "nothing was changed" in call[2], (name, call)
            assert same_layer and mode == "compressed" and state == ("ok", True), name
            _matches(y, got["ref"], torch.float32)


def test_a_load_beside_a_decode_sharded_layer_is_refused_before_any_copy(ranks):
    _int8(ranks)
    for got in (r["beside"] for r in ranks):
        for strict in (True, False):
            assert got[strict][0] == "err" and "layer '1'" in got[strict][2] \
                and "to_layout('v1')" in got[strict][2], got[strict]
            assert got[strict, "unchanged"], strict   # layer 0 had taken the checkpoint (strict=False)

"""Review round 5, messages: a tokenizer's output (BatchEncoding, a Mapping but no dict) as a batch,
one batch passed as ``batches``, warnings attributed to the user's line, learn_masks on Conv1D (GPT-2),
distill_'s ``parameters=`` / ``hidden=`` checks, and TQDM_DISABLE."""
import copy
import io
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BatchEncoding, BertConfig, BertForMaskedLM, BertForSequenceClassification, LlamaConfig, \
    LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

import sparse24
from sparse24 import Sparse24Linear
from sparse24._progress import progress_enabled
from sparse24.masks.calibrate import _to_device
from sparse24.ops import config_store

from hf_models import VOCAB, tiny_gpt2, tiny_llama, tokens


def _llama1(seed=0):
    """A one-layer tiny Llama: the slower whole-model calls stay fast."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _encoding(seed=0, pad=0):
    """What ``tokenizer(texts, return_tensors="pt", padding=True)`` returns: a BatchEncoding; the
    last ``pad`` positions of the second row are padding."""
    ids = tokens(seed, (2, 8))
    mask = torch.ones_like(ids)
    if pad:
        mask[1, -pad:] = 0
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


# ---- 1. a tokenizer's output (BatchEncoding: a Mapping, not a dict) as a batch ----

def test_batchencoding_is_no_dict_but_a_mapping():
    enc = _encoding()
    assert not isinstance(enc, dict)   # what the old isinstance(b, dict) dispatch missed
    moved = _to_device(enc, "cpu")
    assert type(moved) is BatchEncoding and moved.keys() == enc.keys() and moved.data is not enc.data


def test_calibrate_takes_a_batchencoding():
    model, enc = tiny_llama(), _encoding()
    stats = sparse24.calibrate(model, [enc], hessian=True, progress=False)
    # independent reference: the first layer's input, caught by a hook on a plain model(**dict) call
    seen = []
    h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        model(**dict(enc))
    h.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1]).double()
    s = stats["model.layers.0.mlp.down_proj"]
    assert s.count == x.shape[0]
    torch.testing.assert_close(s.xtx, x.T @ x, rtol=1e-9, atol=1e-9)


def test_prune_layerwise_and_distill_take_a_batchencoding():
    enc = _encoding()
    a, b = _llama1(), _llama1()
    ra = sparse24.prune_layerwise_(a, [enc], progress=False)
    rb = sparse24.prune_layerwise_(b, [dict(enc)], progress=False)
    assert ra.keys() == rb.keys()
    for fqn in ra:
        assert torch.equal(a.get_submodule(fqn).weight, b.get_submodule(fqn).weight), fqn
    la = sparse24.distill_(a, [enc], 2, teacher=_llama1(), progress=False).losses
    lb = sparse24.distill_(b, [dict(enc)], 2, teacher=_llama1(), progress=False).losses
    assert la == lb and all(v > 0 for v in la)


def test_learn_masks_takes_a_batchencoding():
    model = tiny_llama()
    rep = sparse24.learn_masks(model, [_encoding()], 2, check_batches=1, min_features=0, progress=False)
    assert rep.layers


def test_sentence_embeddings_use_a_batchencodings_attention_mask():
    model, enc = tiny_llama().model, _encoding(pad=3)
    got = sparse24.sentence_embeddings(model, [enc])
    # reference: float64 mean over the kept tokens of the model's own output
    with torch.no_grad():
        h = model(**dict(enc)).last_hidden_state.double()
    m = enc["attention_mask"].double().unsqueeze(-1)
    ref = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert sparse24.embedding_fidelity(model, [enc], tiny_llama().model) == pytest.approx(1.0, abs=1e-5)


def test_permutations_take_a_batchencoding():
    model = _llama1()
    enc = BatchEncoding({**_encoding(), "use_cache": False})
    groups = sparse24.find_permutation_groups(model, enc, heads=4)
    assert groups   # (a test proving nothing would pass with none)
    assert groups == sparse24.find_permutation_groups(model, dict(enc), heads=4)
    before = copy.deepcopy(model).double()
    sparse24.permute_model_(model, groups, example=enc, max_iters=5)
    with torch.no_grad():   # permuting leaves the function unchanged
        torch.testing.assert_close(model.double()(**dict(enc)).logits, before(**dict(enc)).logits,
                                   rtol=1e-9, atol=1e-9)


# ---- 2. one batch passed as ``batches`` ----

def _one_batch_calls():
    dense = tiny_llama(1)
    return {
        "calibrate": lambda m, b: sparse24.calibrate(m, b, progress=False),
        "prune_layerwise_": lambda m, b: sparse24.prune_layerwise_(m, b, progress=False),
        "distill_": lambda m, b: sparse24.distill_(m, b, 1, teacher=dense, progress=False),
        "learn_masks": lambda m, b: sparse24.learn_masks(m, b, 1, progress=False),
        "sentence_embeddings": lambda m, b: sparse24.sentence_embeddings(m.model, b),
        "embedding_fidelity": lambda m, b: sparse24.embedding_fidelity(m.model, b, dense.model),
    }


@pytest.mark.parametrize("call", list(_one_batch_calls()))
@pytest.mark.parametrize("kind", ["dict", "BatchEncoding", "str", "tensor"])
def test_one_batch_as_batches_is_refused(call, kind):
    enc = _encoding()
    batch = {"dict": dict(enc), "BatchEncoding": enc, "str": "a sentence", "tensor": enc["input_ids"]}[kind]
    model = tiny_llama()
    before = _state(model)
    with pytest.raises(TypeError, match=r"batches is a single batch .*pass a list of batches, e\.g\. \[batch\]"):
        _one_batch_calls()[call](model, batch)
    _assert_unchanged(model, before)


def test_one_shot_iterators_stay_welcome():
    batches = [tokens(i, (2, 6)) for i in range(3)]
    model = tiny_llama()
    listed = sparse24.calibrate(model, batches, progress=False)
    streamed = sparse24.calibrate(model, (b for b in batches), progress=False)   # nothing consumed by the check
    assert listed.keys() == streamed.keys()
    for fqn, s in listed.items():
        assert streamed[fqn].count == s.count == 36 and torch.equal(streamed[fqn].sq_sum, s.sq_sum), fqn
    e_list = sparse24.sentence_embeddings(model.model, batches)
    assert torch.equal(sparse24.sentence_embeddings(model.model, iter(batches)), e_list) and len(e_list) == 6
    rep = sparse24.distill_(tiny_llama(), iter(batches), 3, teacher=tiny_llama(1), progress=False)
    assert len(rep.losses) == 3


def test_non_iterable_batches_are_refused():
    model = tiny_llama()
    with pytest.raises(TypeError, match="batches must be an iterable of batches"):
        sparse24.calibrate(model, None, progress=False)


# ---- 3. warnings attributed to the user's line ----

def test_head_warning_points_at_the_callers_line(tmp_path):
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=128)
    torch.manual_seed(0)
    m = BertForMaskedLM(cfg).eval()
    sparse24.sparsify_(m, mode="compressed", min_features=0)
    m.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        sparse24.from_pretrained(BertForSequenceClassification, tmp_path)
    mine = [w for w in ws if "in a head" in str(w.message)]
    assert mine and all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    (tmp_path / "cpu").mkdir()
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    config_store.clear_cache()
    yield tmp_path / "cpu" / f"{config_store.KERNEL}.json"
    monkeypatch.delenv("SPARSE24_CONFIG_DIR")
    config_store.clear_cache()


def test_bad_config_file_warning_points_at_the_callers_line(config_dir):
    config_dir.write_text("{not json")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        choice = config_store.lookup(1, 64, 64, "float32", "cpu", None)
    assert choice.kind == "builtin"
    mine = [w for w in ws if "ignoring tuned-config file" in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__, [(w.filename, w.lineno) for w in mine]


def test_skipped_entries_warning_points_at_the_callers_line(config_dir, monkeypatch):
    config_dir.write_text(json.dumps({}))
    # (an entry the installed Triton cannot run: validate_file's verdict, stood in for here)
    monkeypatch.setattr(config_store, "validate_file", lambda data: {
        "gpu": "another GPU", "entries": {}, "skipped": {(1, 64, 64, "float32"): (None, "needs a newer Triton")}})
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        config_store.lookup(1, 64, 64, "float32", "cpu", None)
    mine = [w for w in ws if "skipping 1 entries" in str(w.message) and str(config_dir) in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__, [(w.filename, w.lineno) for w in mine]


# ---- 4. learn_masks on GPT-2's Conv1D layers ----

def test_learn_masks_on_conv1d_keeps_the_dense_weights_transposed():
    model, ids = tiny_gpt2(), tokens(0, (2, 8))
    dense = {fqn: m.weight.detach().double().t().clone() for fqn, m in model.named_modules()
             if isinstance(m, Conv1D)}   # (out, in), float64, copied before the call
    rep = sparse24.learn_masks(model, [ids], 3, check_batches=1, min_features=0, progress=False)
    assert set(rep.layers) == set(dense)   # every Conv1D learned (no "no dense weight" refusal)
    for fqn, w in dense.items():
        sp = model.get_submodule(fqn)
        assert isinstance(sp, Sparse24Linear) and sp.mode == "masked"
        assert sp.mask.view(-1, 4).sum(-1).eq(2).all(), fqn
        # the kept weights are the dense ones (train_weights=False), in the Linear (out, in) orientation
        assert torch.equal(sp.weight.double(), torch.where(sp.mask, w, 0)), fqn


def test_learn_masks_on_conv1d_failing_leaves_the_model_as_it_was():
    model = tiny_gpt2()
    before = _state(model)

    def stop(step, loss):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sparse24.learn_masks(model, [tokens(0, (2, 8))], 3, min_features=0, callback=stop, progress=False)
    assert not any(isinstance(m, Sparse24Linear) for m in model.modules())
    _assert_unchanged(model, before)


# ---- 5. distill_'s parameters= and hidden= ----

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize("what,match", [
    ("module", r"parameters.* a Linear module: pass module\.parameters\(\)"),
    ("sequential slice", r"parameters.* a Sequential module: pass module\.parameters\(\)"),
    ("param groups", r"parameters\[0\] is a dict .*param group"),
    ("a number", r"parameters\[1\] is a float, not a torch\.Tensor"),
])
def test_distill_parameters_are_checked(what, match):
    m = _mlp()
    before = _state(m)
    given = {"module": lambda: m[0], "sequential slice": lambda: m[0:3],
             "param groups": lambda: [{"params": list(m[0].parameters()), "lr": 1e-4}],
             "a number": lambda: [m[0].weight, 1.0]}[what]()
    with pytest.raises(TypeError, match=match):
        sparse24.distill_(m, [torch.randn(4, 64)], 1, teacher=_mlp(), parameters=given, progress=False)
    _assert_unchanged(m, before)


def test_distill_hidden_takes_module_names():
    m = _mlp()
    before = _state(m)
    with pytest.raises(TypeError, match=r"hidden takes module names .*got a Linear"):
        sparse24.distill_(m, [torch.randn(4, 64)], 1, teacher=_mlp(), hidden=[m[0]], progress=False)
    _assert_unchanged(m, before)


# ---- 6. TQDM_DISABLE ----

class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("value,drawn", [("1", False), ("True", False), ("yes", False), ("0", False),
                                         ("false", False), ("", True)])
def test_tqdm_disable_switches_the_default_off(monkeypatch, value, drawn):
    monkeypatch.setenv("TQDM_DISABLE", value)
    assert progress_enabled(None, _Terminal()) is drawn   # (as tqdm reads it, at its import: any non-empty value)
    assert progress_enabled(True, _Terminal()) is True   # an explicit request still draws


def test_tqdm_disable_silences_a_bar_on_a_terminal(monkeypatch):
    from sparse24._progress import progress_bar
    out = _Terminal()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    for _ in progress_bar(range(3), desc="probe", file=out):
        pass
    assert "probe" not in out.getvalue()
    monkeypatch.delenv("TQDM_DISABLE")
    for _ in progress_bar(range(3), desc="probe", file=out):
        pass
    assert "probe" in out.getvalue()


def test_token_noise_and_blockwise_refuse_one_batch():
    """token_noise and block-by-block pruning take batches too: one dict given alone was iterated as
    its keys (token_noise: 'batch 0 has no input_ids'-style errors; blockwise: 'batch 0 must be a tensor')."""
    from sparse24.masks import token_noise
    from sparse24.tools.blockwise import _check_batches

    one = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    for call in (lambda: token_noise(one, vocab=10), lambda: _check_batches(one)):
        with pytest.raises(TypeError, match="single batch"):
            call()
    assert len(token_noise([one], copies=1, vocab=10)) == 2


def test_what_the_mapping_change_must_leave_alone():
    """Regressions of the BatchEncoding change, found by review: a map-style Dataset (no __iter__) is
    an iterable of batches; a Mapping that is not a dict or UserDict (a TensorDict) is one positional
    argument as before; a ParameterList is a list of parameters; a BatchEncoding moved by device=
    keeps its attribute access for token_mask; any 0/1 integer dtype is a token mask."""
    from collections.abc import Mapping

    from sparse24._checks import refuse_single_batch
    from sparse24.learn.distill import _check_parameters

    class Batches(torch.utils.data.Dataset):   # map-style: __getitem__ and __len__ only
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    class OneArg(Mapping):   # a TensorDict-like batch: the model takes it whole
        def __init__(self, **kw):
            self.d = kw

        def __getitem__(self, k):
            return self.d[k]

        def __iter__(self):
            return iter(self.d)

        def __len__(self):
            return len(self.d)

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

        def forward(self, td):
            return self.net(td["obs"])

    torch.manual_seed(0)
    xs = [torch.randn(8, 64) for _ in range(2)]
    refuse_single_batch(Batches(xs))
    stats = sparse24.calibrate(Policy(), [OneArg(obs=x) for x in xs])
    assert set(stats) == {"net.0", "net.2"}   # (model(**batch) would have failed: forward() takes td)
    plist = nn.ParameterList([nn.Parameter(torch.ones(2))])
    assert _check_parameters(plist) == list(plist)
    enc = BatchEncoding({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 0]])})
    from sparse24.masks.calibrate import _to_device, _token_rows
    moved = _to_device(enc, "cpu")
    assert isinstance(moved, BatchEncoding) and moved.attention_mask is not None and enc.data is not moved.data
    assert _token_rows(torch.tensor([1, 0], dtype=torch.int8)).dtype == torch.bool

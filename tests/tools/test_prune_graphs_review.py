"""``prune FILE`` for graphs a raw state dict does not show (review "graphs", round 8): the T5 family's
feed-forward reads ``wo.weight`` (sparsify_ keeps ``wo`` masked, so the file must too), and a tie that
``safetensors.torch.save_model`` stored once (the printed call keeps the pair dense, so the file must
hold both names dense). Each file is loaded with the call the command prints, and the model's outputs
are compared with a float64 plain-torch copy whose pruned weights are masked here (top-2 |w| of 4)."""

import pytest
import torch
from torch import nn

import sparse24
from sparse24.tools.cli import main

from conftest import masked_copy

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")


def _prune(capsys, src, out, *extra) -> str:
    """Run ``prune``; the printed ``sparsify_`` call (the part of the "load it with" line before the load)."""
    assert main(["prune", str(src), "--out", str(out), *extra]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "load it with:" in ln)
    return line.split("load it with: ")[1].split("; model.load_state_dict")[0]


@pytest.mark.parametrize("family, gated, wo_masked", [("T5", False, True), ("T5", True, True),
                                                     ("LongT5", False, True), ("LongT5", True, False)])
def test_a_t5_family_state_dict_loads_into_the_printed_call(tmp_path, capsys, family, gated, wo_masked):
    # wo_masked: whether the feed-forward's forward reads self.wo.weight (LongT5's gated one does not)
    config, cls = (getattr(transformers, f"{family}{n}") for n in ("Config", "ForConditionalGeneration"))
    cfg = config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4,
                 decoder_start_token_id=0, feed_forward_proj="gated-gelu" if gated else "relu")
    torch.manual_seed(0)
    dense = cls(cfg).eval()
    torch.save(dense.state_dict(), tmp_path / "t5.pt")
    call = _prune(capsys, tmp_path / "t5.pt", tmp_path / "t5-2of4.pt")
    sd = torch.load(tmp_path / "t5-2of4.pt")
    wo = {k.rpartition(".")[0] for k in sd if ".DenseReluDense.wo." in k}
    assert len(wo) == 2   # encoder and decoder
    assert all((k + ".mask" in sd) == wo_masked and (k + ".values" in sd) != wo_masked for k in wo)
    torch.manual_seed(1)
    model = cls(cfg).eval()
    eval(call, {"sparse24": sparse24, "model": model})
    model.load_state_dict(sd)
    pruned = [k[:-len(".meta")] for k in sd if k.endswith(".meta")] + [k[:-len(".mask")] for k in sd
                                                                         if k.endswith(".mask")]
    assert len(pruned) == (18 if gated else 16)
    ids, dec = torch.randint(1, 128, (2, 7)), torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        y = model(input_ids=ids, decoder_input_ids=dec).logits
        y_ref = masked_copy(dense, pruned)(input_ids=ids, decoder_input_ids=dec).logits
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-4)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1, self.f2 = nn.Linear(64, 64), nn.Linear(64, 64, bias=False)
        self.f2.weight = self.f1.weight
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        return self.out(self.f2(torch.relu(self.f1(x))))


def test_a_tie_safetensors_save_model_stored_once_stays_dense_and_loads_strictly(tmp_path, capsys):
    torch.manual_seed(0)
    dense = _Tied().eval()
    safetensors_torch.save_model(dense, str(tmp_path / "tied.safetensors"))
    assert "f2.weight" not in safetensors_torch.load_file(tmp_path / "tied.safetensors")   # one copy stored
    call = _prune(capsys, tmp_path / "tied.safetensors", tmp_path / "tied-2of4.safetensors")
    sd = safetensors_torch.load_file(tmp_path / "tied-2of4.safetensors")
    assert torch.equal(sd["f1.weight"], dense.f1.weight) and torch.equal(sd["f2.weight"], dense.f1.weight)
    torch.manual_seed(1)
    model = _Tied().eval()
    eval(call, {"sparse24": sparse24, "model": model})
    model.load_state_dict(sd)   # strict
    assert model.f2.weight is model.f1.weight and type(model.f1) is nn.Linear
    x = torch.randn(5, 64)
    with torch.no_grad():
        y, y_ref = model(x), masked_copy(dense, ["out"])(x.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)


def test_compressed_entries_for_a_layer_kept_masked_say_what_to_do():
    # a layer compress_ keeps masked (its parent reads .weight) cannot take values + meta: the error must not
    # only say "compress_ this model before loading", which changes nothing for it
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            return x @ self.fc.weight.t()
    torch.manual_seed(0)
    model = Reads()
    sparse24.sparsify_(model, mode="compressed", skip_output_head=False)
    assert model.fc.mode == "masked"
    entries = sparse24.Sparse24Linear.from_linear(nn.Linear(64, 64)).to_compressed().state_dict()
    with pytest.raises(RuntimeError, match="compress_ keeps this layer masked") as e:
        model.load_state_dict({"fc." + k: v for k, v in entries.items()})
    assert "prune this model itself" in str(e.value)

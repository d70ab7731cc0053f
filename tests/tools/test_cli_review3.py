"""prune, third review: each test failed before its fix (a layer missing from the checkpoint pruned from
random init, subfolders dropped and other-format weights copied, the default --exclude on folders,
--exclude on weight names, --out checked late, the state-dict loading recipe, parents left behind, --noise
past the embedding, line splitting, the block-by-block count)."""
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (AlbertConfig, AlbertForMaskedLM, AlbertForSequenceClassification, LlamaConfig,
                          LlamaForCausalLM, RemBertConfig, RemBertForSequenceClassification)

import sparse24
import sparse24.tools.prune_calibrated as prune_calibrated
from sparse24.tools.prune_calibrated import read_samples
from hf_models import VOCAB, tiny_llama, tokens
from test_cli import assert_one_line_error, run
from test_cli_calibrated import _folder, _tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _row(out: str, name: str) -> str:
    return next(li.strip() for li in out.splitlines() if li.strip().startswith(name + " "))


def _summary(out: str) -> tuple[int, int]:
    line = next(li for li in out.splitlines() if "2-D float weight tensors pruned" in li)
    n, total = re.search(r"(\d+) of the checkpoint's (\d+) 2-D", line).groups()
    return int(n), int(total)


# 1 ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["wanda", "layerwise"])
def test_calibrated_prune_refuses_a_layer_missing_from_the_checkpoint(capsys, tmp_path, method):
    # from_pretrained gave the missing layer transformers' random init, which was pruned and written, exit 0
    folder, _ = _folder(tmp_path, "llama")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--method", method,
                     "--calibration", str(tmp_path / "calib.txt"), "--samples", "3", "--no-progress")
    assert rc == 2, err
    assert_one_line_error(err, "the checkpoint has no weight for layer(s) model.layers.1.mlp.down_proj")
    assert not (tmp_path / "o").exists()


# 2 ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--method", "wanda", "--samples", "3"]])
def test_output_keeps_subfolders_and_leaves_out_other_weight_formats(capsys, tmp_path, extra):
    folder, _ = _folder(tmp_path, "bert")
    if extra:
        extra = extra + ["--calibration", str(tmp_path / "calib.txt")]
    (folder / "modules.json").write_text('[{"idx":1,"name":"1","path":"1_Pooling",'
                                         '"type":"sentence_transformers.models.Pooling"}]')
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    torch.save({"x": torch.ones(3)}, folder / "pytorch_model.bin")
    for name in ("tf_model.h5", "flax_model.msgpack", "rust_model.ot"):
        (folder / name).write_bytes(b"dense weights")
    capsys.readouterr()
    rc, out, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--no-progress", *extra)
    assert rc == 0, err
    o = tmp_path / "o"
    assert (o / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (o / "modules.json").exists() and (o / "tokenizer.json").exists()
    assert not any((o / n).exists() for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack",
                                                "rust_model.ot"))
    assert "not copied (the dense weights in other formats): flax_model.msgpack, pytorch_model.bin, " \
           "rust_model.ot, tf_model.h5" in out


def test_out_inside_the_source_folder_is_not_copied_into_itself(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense")
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "dense" / "pruned"),
                     "--no-progress")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "dense" / "pruned").iterdir()) == ["config.json",
                                                                                "generation_config.json",
                                                                                "model.safetensors"]


# 3 ---------------------------------------------------------------------------------------------------------

def test_folders_take_no_default_exclude(capsys, tmp_path):
    # 'emb|wte|wpe' only ever matched nn.Linear layers in a model (sparsify_ never prunes nn.Embedding):
    # RemBERT (every layer under 'rembert.') got nothing pruned, ALBERT's embedding projection stayed dense
    torch.manual_seed(0)
    rembert = RemBertForSequenceClassification(RemBertConfig(
        vocab_size=VOCAB, input_embedding_size=32, output_embedding_size=32, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)).eval()
    albert = AlbertForMaskedLM(AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=64)).eval()
    for name, model in (("rembert", rembert), ("albert", albert)):
        model.save_pretrained(tmp_path / name)
        expected = len(sparse24.sparsify_(model, mode="compressed").changed)
        capsys.readouterr()
        rc, out, err = run(capsys, "prune", str(tmp_path / name), "--out", str(tmp_path / f"{name}-2of4"),
                           "--no-progress")
        assert rc == 0, err
        assert _summary(out)[0] == expected
    rc, out, err = run(capsys, "prune", str(tmp_path / "albert"), "--out", str(tmp_path / "excl"), "--no-progress",
                       "--exclude", "mapping_in")
    assert rc == 0, err
    row = _row(out, "albert.encoder.embedding_hidden_mapping_in.weight")
    assert "kept dense (name matches --exclude 'mapping_in')" in row and "filter_fn" not in out


# 4 ---------------------------------------------------------------------------------------------------------

def test_exclude_matches_the_weight_name(capsys, tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "dense")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    name = "model.layers.0.mlp.down_proj.weight"
    for src, out_path in ((tmp_path / "sd.pt", tmp_path / "o.pt"), (tmp_path / "dense", tmp_path / "o")):
        capsys.readouterr()
        rc, out, err = run(capsys, "prune", str(src), "--out", str(out_path), "--no-progress",
                           "--exclude", re.escape(name))
        assert rc == 0, err
        assert "kept dense" in _row(out, name), (src, _row(out, name))
        assert "kept dense" not in _row(out, "model.layers.1.mlp.down_proj.weight")


# 5 ---------------------------------------------------------------------------------------------------------

def test_an_unwritable_out_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    folder, _ = _folder(tmp_path, "llama")
    ran = []
    monkeypatch.setattr(prune_calibrated, "prune_calibrated", lambda *a, **k: ran.append(1))
    torch.save(tiny_llama().state_dict(), tmp_path / "sd.pt")
    capsys.readouterr()
    for src, extra in ((folder, ["--method", "layerwise", "--calibration", str(tmp_path / "calib.txt")]),
                       (folder, []), (tmp_path / "sd.pt", [])):
        rc, _, err = run(capsys, "prune", str(src), "--out", "/proc/sparse24_out/pruned", "--no-progress", *extra)
        assert rc == 2, err
        assert_one_line_error(err, "--out /proc/sparse24_out/pruned: cannot write in /proc")
    assert not ran


# 6 ---------------------------------------------------------------------------------------------------------

class _Tail(nn.Module):  # two vocabulary-wide Linears: the head is the last (sparsify_'s rule)
    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head, self.aux = nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100), \
            nn.Linear(64, 100)


class _Decoder(nn.Module):  # the vocabulary-wide Linear is not the last 2-D weight
    def __init__(self):
        super().__init__()
        self.emb, self.decoder, self.fc = nn.Embedding(100, 64), nn.Linear(64, 100), nn.Linear(100, 64)


class _Bytes(nn.Module):  # an embedding named like no default --exclude: named with --exclude
    def __init__(self):
        super().__init__()
        self.tok, self.up, self.down, self.out = nn.Embedding(256, 64), nn.Linear(64, 256), nn.Linear(256, 64), \
            nn.Linear(64, 256)


def _albert():
    return AlbertForSequenceClassification(AlbertConfig(
        vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64)).eval()


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("make, extra, suffix", [
    (_albert, [], ".pt"), (_llama, ["--min-features", "48"], ".pt"), (_llama, ["--quantize", "int8"], ".safetensors"),
    (_Tail, [], ".pt"), (_Decoder, [], ".pt"), (_Bytes, ["--exclude", "tok"], ".pt")])
def test_the_printed_recipe_loads_the_state_dict(capsys, tmp_path, make, extra, suffix):
    import safetensors.torch
    torch.manual_seed(0)
    model = make()
    torch.save(model.state_dict(), tmp_path / "dense.pt")
    out_path = tmp_path / f"sparse{suffix}"
    capsys.readouterr()
    rc, out, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(out_path), "--no-progress", *extra)
    assert rc == 0, err
    recipe = next(li for li in out.splitlines() if "load it with:" in li).split("load it with:", 1)[1].strip()
    torch.manual_seed(1)
    shell = make()
    # literally as printed, the file named where it says "..."
    exec(recipe.replace("(...)", f"({str(out_path)!r})"), {"sparse24": sparse24, "torch": torch, "model": shell,
                                                           "safetensors": safetensors})
    if make is _Decoder:  # the head sparsify_ picks stays dense
        assert "output head" in _row(out, "decoder.weight")
    if make is _Tail:
        assert "output head" in _row(out, "aux.weight") and "kept dense" not in _row(out, "head.weight")


# 7 ---------------------------------------------------------------------------------------------------------

def test_a_failed_state_dict_write_removes_the_folders_it_made(capsys, tmp_path, monkeypatch):
    torch.save(tiny_llama().state_dict(), tmp_path / "sd.pt")

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(a[1]))
    monkeypatch.setattr(torch, "save", full)
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "sd.pt"), "--out", str(tmp_path / "new" / "dir" / "o.pt"))
    assert rc == 2
    assert_one_line_error(err, "--out", "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd.pt"]


# 8 ---------------------------------------------------------------------------------------------------------

def test_noise_draws_only_tokens_the_model_embeds(capsys, tmp_path, monkeypatch):
    seen = []
    real = prune_calibrated.token_noise

    def spy(batches, copies, p, vocab, keep):
        seen.append(vocab)
        return real(batches, copies, p, vocab=vocab, keep=keep)
    monkeypatch.setattr(prune_calibrated, "token_noise", spy)
    tok = _tokenizer()
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok) - 8, hidden_size=64, intermediate_size=160,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)).eval()
    small.save_pretrained(tmp_path / "small")
    tok.save_pretrained(tmp_path / "small")
    # only text whose tokens the model embeds: the noise is what went past the table
    ids = [t for t in range(4, len(tok) - 8)]
    (tmp_path / "calib.txt").write_text(" ".join(tok.convert_ids_to_tokens(ids[:12])) + "\n")
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "small"), "--out", str(tmp_path / "o"), "--method", "wanda",
                     "--calibration", str(tmp_path / "calib.txt"), "--noise", "3", "--no-progress")
    assert rc == 0, err
    assert seen == [len(tok) - 8]


# 9 ---------------------------------------------------------------------------------------------------------

def test_one_sample_per_line_splits_at_newlines_only(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("first\x0cwith a form feed\r\nsecond \u2028 line\nthird\x1cgroup\x85sep\n\n".encode())
    assert read_samples(p, 128) == ["first\x0cwith a form feed", "second \u2028 line", "third\x1cgroup\x85sep"]
    assert read_samples(p, 2) == ["first\x0cwith a form feed", "second \u2028 line"]


# 10 --------------------------------------------------------------------------------------------------------

def test_block_by_block_summary_counts_every_stored_weight(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense")
    torch.save(tokens(shape=(2, 9)), tmp_path / "ids.pt")
    weights = load_file(tmp_path / "dense" / "model.safetensors")
    stored = sum(k.endswith(".weight") and v.dim() == 2 for k, v in weights.items())
    capsys.readouterr()
    rc, out, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "o"), "--method", "wanda",
                       "--calibration-ids", str(tmp_path / "ids.pt"), "--no-progress")
    assert rc == 0, err
    assert _summary(out) == (stored - 2, stored)
    assert "kept dense" in _row(out, "model.embed_tokens.weight") and "kept dense" in _row(out, "lm_head.weight")


def test_calibration_text_past_the_embedding_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    # the reviewer's case: the text itself holds ids past the table (an IndexError traceback mid-calibration)
    tok = _tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok) - 8, hidden_size=64, intermediate_size=160,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
                     ).save_pretrained(tmp_path / "small")
    tok.save_pretrained(tmp_path / "small")
    (tmp_path / "calib.txt").write_text(" ".join(tok.convert_ids_to_tokens(list(range(4, len(tok))))) + "\n")
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", None)  # refused before the model is loaded
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "small"), "--out", str(tmp_path / "o"), "--method", "wanda",
                     "--calibration", str(tmp_path / "calib.txt"), "--noise", "3", "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"gives token id {len(tok) - 1}", f"embedding has {len(tok) - 8} rows")
    assert not (tmp_path / "o").exists()


def test_options_a_path_does_not_read_are_refused(capsys, tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    torch.save(tokens(shape=(2, 9)), tmp_path / "ids.pt")
    calib = str(tmp_path / "calib.txt")
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    o = str(tmp_path / "o")
    for argv, needle in [
            (["--samples", "4"], "--samples is for the calibrated methods"),
            (["--seq-len", "8"], "--seq-len is for the calibrated methods"),
            (["--permute-iters", "5"], "--permute-iters is for the calibrated methods"),
            (["--batch-size", "2"], "--batch-size is for block-by-block pruning"),
            (["--method", "wanda", "--calibration", calib, "--batch-size", "2"], "--batch-size is for block-by-block"),
            (["--method", "wanda", "--calibration-ids", str(tmp_path / "ids.pt"), "--samples", "4"],
             "give it without --samples (options of")]:
        rc, _, err = run(capsys, "prune", str(folder), "--out", o, *argv)
        assert rc == 2, (argv, err)
        assert_one_line_error(err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_sigterm_during_a_folder_prune_leaves_no_partial_folder(tmp_path, monkeypatch):
    """A batch scheduler's time limit sends SIGTERM: the hidden .NAME.PID.partial folder stayed behind.
    SIGTERM now unwinds like Ctrl-C (exit 143) where no other handler is installed, and the handler
    is put back after."""
    import os
    import signal

    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse24.tools import hf_folder
    from sparse24.tools.cli import main
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "dense")
    monkeypatch.setattr(hf_folder, "copy_rest", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)   # (as in a plain `python -m sparse24`)
    try:
        assert main(["prune", str(tmp_path / "dense"), "--out", str(tmp_path / "out")]) == 143
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_an_unknown_option_points_to_its_commands_help(capsys):
    from sparse24.tools.cli import main
    assert main(["bench", "--bogus"]) == 2
    assert "see 'python -m sparse24 bench --help'" in capsys.readouterr().err

"""prune --method wanda|sparsegpt|layerwise on a Hugging Face folder with its own tokenizer: the result
equals the library's calls on the same model and tokens; bad inputs are one line, exit 2, nothing written."""
import copy

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, BertConfig, BertModel, PreTrainedTokenizerFast

import sparse24
from sparse24.masks import prune_layerwise_
from sparse24.tools.prune_calibrated import read_samples
from hf_models import VOCAB, tiny_gpt2, tiny_llama
from test_cli import assert_one_line_error, run

TEXTS = [f"line {i}: the quick brown fox jumps over the lazy dog while {i % 7} cats watch the {i % 3} river"
         for i in range(24)]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained here (offline), as transformers loads one from a folder."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(vocab_size=VOCAB,
                                                             special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def tiny_bert(seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    return BertModel(cfg).eval()  # with a pooler: a Linear reading one vector per sequence


def _folder(tmp_path, arch: str, tokenizer: bool = True):
    dense = tiny_llama() if arch == "llama" else tiny_bert() if arch == "bert" else tiny_gpt2()
    folder = tmp_path / arch
    dense.save_pretrained(folder)
    if tokenizer:
        _tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text("\n".join(TEXTS[:10]) + "\n\n" + "\n".join(TEXTS[10:]) + "\n")
    return folder, type(dense)


def _library(cls, folder, method: str, permute: bool, samples: int, noise: int | None = None):
    """What a user writes in Python: the same model, tokens and steps, no CLI code. ``noise``:
    noisy copies of each sample (default: 2 for layerwise, the recommended recipe; else 0)."""
    model = cls.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    extra = {"use_cache": False} if cls is not BertModel else {}
    batches = [{**tok(t, return_tensors="pt"), **extra} for t in TEXTS[:samples]]
    noise = (2 if method == "layerwise" else 0) if noise is None else noise
    calib = sparse24.token_noise(batches, noise, 0.3, vocab=len(tok), keep=tok.all_special_ids)
    def chosen(mod, fqn):  # sparsify_'s default choice: every Linear but the output head
        return fqn != "lm_head"
    stats = sparse24.calibrate(model, calib, hessian=method != "wanda")
    if permute:
        example = max(batches, key=lambda b: b["input_ids"].shape[-1])  # the CLI proves groups on the longest
        groups = sparse24.find_permutation_groups(model, example, heads=4)
        assert groups  # the test must exercise a permutation
        sparse24.permute_model_(model, groups, score="wanda" if method == "wanda" else "sparsegpt", calibration=stats,
                                example=example, max_iters=200, time_limit=3600)
    if method == "layerwise":
        dense = copy.deepcopy(model)
        prune_layerwise_(model, calib, method="sparsegpt", refit=True, teacher=dense, filter_fn=chosen,
                         percdamp=0.1)  # the recommended damping (docs/recipes.md)
        sparse24.sparsify_(model, mode="compressed")
    else:
        sparse24.sparsify_(model, mode="compressed", method=method, calibration=stats,
                           **({"refit": True} if method == "sparsegpt" else {}))
    return model, batches


@pytest.mark.parametrize("arch, method, permute, noise", [
    ("llama", "layerwise", True, None), ("bert", "layerwise", True, None), ("bert", "layerwise", False, 0),
    ("llama", "sparsegpt", False, None), ("bert", "wanda", True, 1)])
def test_calibrated_prune_equals_the_library(capsys, tmp_path, arch, method, permute, noise):
    folder, cls = _folder(tmp_path, arch)
    capsys.readouterr()
    rc, out, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "sparse"), "--method", method,
                       "--calibration", str(tmp_path / "calib.txt"), "--samples", "12", *(["--permute"] * permute),
                       *([] if noise is None else ["--noise", str(noise)]))
    assert rc == 0, err
    assert err == ""  # no bars (stderr is no terminal), transformers' own ones included
    assert f"12 calibration samples from {tmp_path / 'calib.txt'}" in out
    copies = (2 if method == "layerwise" else 0) if noise is None else noise
    assert (f"each with {copies} noisy cop" in out) == (copies > 0)
    assert f"at most {64 if arch == 'bert' else 512} each" in out  # --seq-len capped at the model's positions
    got = sparse24.from_pretrained(cls, tmp_path / "sparse")
    want, batches = _library(cls, folder, method, permute, 12, noise)
    sd, ref = got.state_dict(), want.state_dict()
    assert sd.keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in sd.items())
    layers = [m for m in got.modules() if isinstance(m, sparse24.Sparse24Linear)]
    assert len(layers) == (14 if arch == "llama" else 13) and all(m.mode == "compressed" for m in layers)
    with torch.no_grad():
        y, y_ref = got(**batches[0]), want(**batches[0])
    assert torch.equal(y[0], y_ref[0])
    # the dense model's outputs differ (it was pruned) and the tokenizer came along
    dense = cls.from_pretrained(folder).eval()
    with torch.no_grad():
        assert not torch.equal(dense(**batches[0])[0], y[0])
    assert (tmp_path / "sparse" / "tokenizer.json").is_file()


def test_calibration_text_from_a_folder_is_one_sample_per_file(tmp_path):
    (tmp_path / "c").mkdir()
    for i, name in enumerate(["b.txt", "a.txt", "c.md"]):
        (tmp_path / "c" / name).write_text(f"sample {i}\nsecond line {i}\n")
    (tmp_path / "c" / "empty.txt").write_text("\n")
    assert read_samples(tmp_path / "c", 10) == ["sample 1\nsecond line 1", "sample 0\nsecond line 0",
                                                "sample 2\nsecond line 2"]  # name order, empty file skipped
    assert read_samples(tmp_path / "c", 1) == ["sample 1\nsecond line 1"]
    (tmp_path / "lines.txt").write_text("a\n\n  \nb\nc\n")
    assert read_samples(tmp_path / "lines.txt", 2) == ["a", "b"]


def test_calibrated_prune_errors(capsys, tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    calib = str(tmp_path / "calib.txt")
    save_file(tiny_llama().state_dict(), tmp_path / "dense.safetensors")
    bare = tmp_path / "no-tokenizer"
    tiny_llama().save_pretrained(bare)
    gpt2, _ = _folder(tmp_path, "gpt2")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("\n \n")
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    o = str(tmp_path / "o")
    for argv, needles in [
        (["prune", str(tmp_path / "dense.safetensors"), "--out", str(tmp_path / "o.pt"), "--method", "sparsegpt",
          "--calibration", calib], ["needs a Hugging Face model folder", "a bare state dict", "--method magnitude"]),
        (["prune", str(folder), "--out", o, "--method", "layerwise"], ["needs --calibration TEXT"]),
        (["prune", str(folder), "--out", o, "--calibration", calib], ["--calibration is for the calibrated methods"]),
        (["prune", str(folder), "--out", o, "--permute"], ["--permute is for the calibrated methods"]),
        (["prune", str(folder), "--out", o, "--noise", "2"], ["--noise is for the calibrated methods"]),
        (["prune", str(folder), "--out", o, "--method", "layerwise", "--calibration", calib, "--noise", "-1"],
         ["--noise must be >= 0"]),
        (["prune", str(folder), "--out", o, "--method", "layerwise", "--calibration", calib, "--noise-p", "1.5"],
         ["--noise-p must be in [0, 1]"]),
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", calib, "--samples", "0"],
         ["--samples must be >= 1"]),
        # options the run would ignore (it wrote the folder as if they were absent, exit 0)
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", calib, "--permute-iters", "5"],
         ["--permute-iters goes with --permute"]),
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", calib, "--noise-p", "0.9"],
         ["--noise-p goes with noisy copies"]),
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", str(tmp_path / "none.txt")],
         ["no such file or folder"]),
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", str(tmp_path / "blank.txt")],
         ["no text in it"]),
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", str(tmp_path / "latin1.txt")],
         ["latin1.txt is not UTF-8 text"]),
        (["prune", str(bare), "--out", o, "--method", "sparsegpt", "--calibration", calib],
         ["has no tokenizer that transformers.AutoTokenizer loads", "tokenizer.save_pretrained"]),
        (["prune", str(gpt2), "--out", o, "--method", "sparsegpt", "--calibration", calib],
         ["transformers Conv1D layers", "--method magnitude"]),
        # one token proves nothing about attention (a one-token first line made 16 groups "exact", 8 real)
        (["prune", str(folder), "--out", o, "--method", "wanda", "--calibration", calib, "--permute", "--seq-len", "1"],
         ["has 1 position(s)", "at least 2 tokens"]),
    ]:
        rc, _, err = run(capsys, *argv)
        assert rc == 2, (argv, err)
        assert_one_line_error(err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no partial folder

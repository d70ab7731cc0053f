"""Folders and files from someone else (review round 8, "trust"): a folder's own code never runs (its
config, its tokenizer, or an Auto class's model, even on a "y" at transformers' prompt), links out of the
folder are not copied into the output, a pickle of shared lists is refused at once, the calibrated path
bounds what a config makes transformers allocate, every stored shape and the shard index's metadata
are checked before any work, ``architectures`` names a model class or nothing, and names read from a
file cannot send a terminal control sequences."""
import builtins
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import sparse24
from hf_models import tiny_llama
from sparse24.tools.checkpoint import CheckpointError, load_torch_file
from test_cli import assert_one_line_error, run as _run
from test_cli_calibrated import TEXTS, _tokenizer


def run(capsys, *argv):
    capsys.readouterr()   # (save_pretrained's progress bar)
    return _run(capsys, *argv)


@pytest.fixture
def answer_yes(monkeypatch):
    """transformers' "Do you wish to run the custom code? [y/N]" answered "y"; the prompts asked are listed."""
    asked = []

    def yes(prompt=""):
        asked.append(prompt)
        return "y"
    monkeypatch.setattr(builtins, "input", yes)
    return asked


def _marker_code(marker: Path, body: str) -> str:
    """A module of the folder's own code: running it writes ``marker``."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n{body}"


def _config_code_folder(tmp_path) -> tuple[Path, Path]:
    """A tiny Llama folder whose config is the folder's own code (a model type transformers lacks)."""
    folder, marker = tmp_path / "remote", tmp_path / "PWNED"
    tiny_llama().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evilllama", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "configuration_evil.py").write_text(_marker_code(
        marker, "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evilllama'\n"))
    return folder, marker


# --- 1. sparse24.from_pretrained never runs a folder's code unless told trust_remote_code=True ---------

@pytest.mark.parametrize("kwargs", [{"trust_remote_code": False}, {}])
def test_from_pretrained_runs_no_config_code_of_the_folder(tmp_path, answer_yes, kwargs):
    """check_folder read the config through AutoConfig without trust_remote_code=False: transformers asked
    on stdin and ran configuration_evil.py on "y", where transformers itself refuses at once."""
    folder, marker = _config_code_folder(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json: its auto_map names the folder's own code for AutoConfig "
                                         r"\('configuration_evil\.EvilConfig'\).*trust_remote_code=True"):
        sparse24.from_pretrained(transformers.AutoModelForCausalLM, folder, **kwargs)
    assert not marker.exists() and answer_yes == []


def test_from_pretrained_runs_no_model_code_of_the_folder(tmp_path, answer_yes):
    """A config transformers knows (ViT) whose auto_map gives AutoModelForCausalLM the folder's own class:
    check_folder's meta build (AutoModelForCausalLM.from_config) asked and imported modeling_evil.py."""
    folder, marker = tmp_path / "vit", tmp_path / "PWNED"
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=8)
    transformers.ViTModel(cfg).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "modeling_evil.py").write_text(_marker_code(
        marker, "from transformers import ViTModel\nclass EvilModel(ViTModel):\n    pass\n"))
    with pytest.raises(ValueError, match=r"auto_map names the folder's own code for AutoModelForCausalLM"):
        sparse24.from_pretrained(transformers.AutoModelForCausalLM, folder, trust_remote_code=False)
    assert not marker.exists() and answer_yes == []


def test_an_auto_map_beside_transformers_own_class_still_loads(tmp_path, answer_yes):
    """A Llama folder whose auto_map also names code (Hub folders from before transformers had the family):
    transformers uses its own classes without asking, and so does sparse24 (not refused)."""
    folder, marker = tmp_path / "llama", tmp_path / "PWNED"
    dense = tiny_llama()
    dense.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (folder / "config.json").write_text(json.dumps(data))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (folder / name).write_text(_marker_code(marker, ""))
    loaded = sparse24.from_pretrained(transformers.AutoModelForCausalLM, folder)
    assert type(loaded) is transformers.LlamaForCausalLM
    ref = dense.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    assert not marker.exists() and answer_yes == []


# --- 2. the command line never runs a folder's code ------------------------------------------------------

def test_prune_refuses_a_folder_whose_config_is_its_code(capsys, tmp_path, answer_yes):
    folder, marker = _config_code_folder(tmp_path)
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{folder / 'config.json'}: its auto_map names the folder's own code for AutoConfig",
                          "the command line never runs it")
    assert not marker.exists() and answer_yes == [] and not (tmp_path / "out").exists()


def test_calibrated_prune_refuses_a_tokenizer_that_is_folder_code(capsys, tmp_path, answer_yes):
    """prune --method wanda loaded the tokenizer through AutoTokenizer without trust_remote_code=False: on "y"
    the folder's tokenization_evil.py ran and the prune finished (exit 0)."""
    folder, marker = tmp_path / "remtok", tmp_path / "PWNED"
    tiny_llama().save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTokenizerFast",
               auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizerFast"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    (folder / "tokenization_evil.py").write_text(_marker_code(
        marker, "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizerFast(PreTrainedTokenizerFast):"
                "\n    pass\n"))
    (tmp_path / "calib.txt").write_text("\n".join(TEXTS) + "\n")
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--method", "wanda",
                     "--calibration", str(tmp_path / "calib.txt"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{folder}: its tokenizer is the folder's own code", "never runs")
    assert not marker.exists() and answer_yes == [] and not (tmp_path / "out").exists()


# --- 3. links out of the folder are not copied into the output ------------------------------------------

def test_links_out_of_the_folder_fifos_and_devices_are_not_copied(capsys, tmp_path):
    """README.md -> a secret outside, a folder link to a folder outside, a link to a device, a FIFO, and a link
    to --out's parent were copied (the secret, a whole tree, reading the device; the output into itself).
    Links inside the folder still are, as the files they point to."""
    outside = tmp_path / "outside"
    (outside / "tree").mkdir(parents=True)
    (outside / "secret.txt").write_text("AWS_SECRET=hunter2")
    (outside / "tree" / "passwd").write_text("root:x:0:0")
    src, out = tmp_path / "src" / "model", tmp_path / "o" / "out"
    out.parent.mkdir()
    dense = tiny_llama()
    dense.save_pretrained(src)
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "extra").mkdir()
    (src / "extra" / "tok.json").write_text('{"inside": 1}')
    os.symlink(outside / "secret.txt", src / "README.md")
    os.symlink(outside / "tree", src / "1_Pooling" / "etc")
    os.symlink("/dev/null", src / "1_Pooling" / "zero")
    os.mkfifo(src / "pipe")
    os.symlink(out.parent, src / "x")
    os.symlink("extra/tok.json", src / "tokenizer.json")   # inside: copied as a file
    os.symlink("../extra", src / "1_Pooling" / "more")     # a folder inside: copied as a folder
    rc, printed, err = run(capsys, "prune", str(src), "--out", str(out), "--no-progress")
    assert rc == 0, err
    assert "not copied (links out of the folder, FIFOs, devices): 1_Pooling/etc, 1_Pooling/zero, README.md, " \
        "pipe, x" in printed
    listing = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert listing == ["1_Pooling", "1_Pooling/config.json", "1_Pooling/more", "1_Pooling/more/tok.json",
                       "config.json", "extra", "extra/tok.json", "generation_config.json", "model.safetensors",
                       "tokenizer.json"]
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert (out / "tokenizer.json").read_text() == (out / "1_Pooling" / "more" / "tok.json").read_text() \
        == '{"inside": 1}'
    assert sorted(os.listdir(out.parent)) == ["out"]
    from sparse24.tools.hf_folder import links_left_out
    assert links_left_out(src) == ["1_Pooling/etc", "1_Pooling/zero", "README.md", "pipe", "x"]
    loaded = sparse24.from_pretrained(transformers.LlamaForCausalLM, out)
    w = dense.model.layers[0].mlp.up_proj.weight.detach().double()
    g = w.abs().reshape(-1, 4)
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True).view(w.shape)
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.dense_weight().double(), w * mask)


# --- 4. a pickle holding one list under many paths ---------------------------------------------------------

class _TooSlow(BaseException):
    """Raised by SIGALRM (a BaseException: the command line's error handling does not take it)."""


@pytest.fixture
def within_seconds():
    """Fail (_TooSlow) a block still running after the given seconds."""
    def handler(signum, frame):
        raise _TooSlow
    previous = signal.signal(signal.SIGALRM, handler)

    def start(seconds):
        signal.alarm(seconds)
    yield start
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_shared_lists_are_read_in_linear_time(capsys, tmp_path, within_seconds):
    """``L(i+1) = [L(i)] * 30``, 8 levels (a 2 KB file): the overlapping-view check followed all 30**8
    paths (about 33 hours) in prune, inspect and --calibration-ids."""
    obj = [torch.zeros(4)]
    for _ in range(8):
        obj = [obj] * 30
    path = tmp_path / "refs.pt"
    torch.save({"w": obj}, path)
    assert path.stat().st_size < 4096
    within_seconds(20)
    rc, _, err = run(capsys, "inspect", str(path))
    assert rc == 2
    assert_one_line_error(err, "is not a state dict")


def test_an_overlapping_view_nested_deep_is_refused(tmp_path):
    """The check stopped 8 levels down: a stride-0 view deeper was not looked at."""
    obj = {"w": torch.zeros(1).expand(1000)}
    for _ in range(12):
        obj = [obj]
    torch.save(obj, tmp_path / "deep.pt")
    with pytest.raises(CheckpointError, match=r"views 1000 elements of a 4-byte storage"):
        load_torch_file(tmp_path / "deep.pt")


# --- 5. the calibrated path bounds what the config makes transformers allocate ---------------------------------

def test_calibrated_prune_refuses_a_config_far_larger_than_its_checkpoint(capsys, tmp_path):
    """No embedding or head stored, vocab_size 200,000 in config.json: transformers allocated and randomly
    initialized 25.6M elements for a 340 KB checkpoint (20M vocab: 10 GB), which sparse24.from_pretrained
    refuses (at most 2^24 beyond the checkpoint's)."""
    folder = tmp_path / "bigvocab"
    tiny_llama().save_pretrained(folder)
    sd = load_file(folder / "model.safetensors")
    del sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 200_000
    (folder / "config.json").write_text(json.dumps(cfg))
    _tokenizer().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text("\n".join(TEXTS) + "\n")
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--method", "wanda",
                     "--calibration", str(tmp_path / "calib.txt"), "--no-progress")
    assert rc == 2
    stored = sum(t.numel() for t in sd.values())
    with torch.device("meta"):   # the tensors transformers would allocate: the model's, less those stored
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    held = {id(t): t.numel() for t in [*model.parameters(), *model.buffers()]}
    lacking = sum(held.values()) - stored
    assert lacking > 2 * 200_000 * 64
    assert_one_line_error(err, f"{folder / 'config.json'} describes a model with {lacking:,} elements the "
                               f"checkpoint does not hold (it holds {stored:,})")
    assert not (tmp_path / "out").exists()


def test_out_of_memory_names_no_option_the_command_lacks(capsys, tmp_path, monkeypatch):
    """The out-of-memory line advised "use smaller --m / --shapes" for every command; prune has neither."""
    from sparse24.tools import prune

    def oom(*a, **k):
        raise MemoryError("can't allocate memory")
    monkeypatch.setattr(prune, "_load_state_dict", oom)
    torch.save({"a.weight": torch.randn(8, 8)}, tmp_path / "a.pt")
    rc, _, err = run(capsys, "prune", str(tmp_path / "a.pt"), "--out", str(tmp_path / "b.pt"))
    assert rc == 1
    assert_one_line_error(err, "sparse24 prune: error: out of memory (can't allocate memory)")
    assert "--m" not in err and "--shapes" not in err


# --- 6. every stored shape is checked, and a layer's error names its tensor and file --------------------------

def _edited_folder(tmp_path, edit) -> Path:
    folder = tmp_path / "src"
    tiny_llama().save_pretrained(folder)
    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_prune_folder_checks_every_stored_shape(capsys, tmp_path):
    """model.norm.weight stored as (4096,) where config.json says (64,): exit 0, and the output did not load."""
    folder = _edited_folder(tmp_path, lambda sd: sd.update({"model.norm.weight": torch.ones(4096)}))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{folder / 'config.json'} describes 'model.norm.weight' as (64,), but "
                               f"{folder / 'model.safetensors'} holds 'model.norm.weight' as (4096,)")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_layer_weight_it_cannot_prune_is_named_with_its_file(capsys, tmp_path):
    """An int8 layer weight: "weight must be floating point, got torch.int8", naming no tensor, no file."""
    key = "model.layers.1.mlp.up_proj.weight"
    folder = _edited_folder(tmp_path, lambda sd: sd.update({key: torch.ones(160, 64, dtype=torch.int8)}))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{folder / 'model.safetensors'}: '{key}': weight must be floating point")
    assert sorted(os.listdir(tmp_path)) == ["src"]


# --- 7. the shard index's metadata -------------------------------------------------------------------------------

@pytest.mark.parametrize("metadata", ["x", [1, 2], 7, None])
def test_a_shard_index_metadata_that_is_no_object_is_refused(capsys, tmp_path, metadata):
    """An AttributeError traceback after all the pruning (config.json naming no dtype), or a sharded output
    without its index (null)."""
    folder = tmp_path / "src"
    tiny_llama().save_pretrained(folder, max_shard_size="100KB")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"] = metadata
    index.write_text(json.dumps(data))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{index}: 'metadata' must be an object, got {json.dumps(metadata)}")
    assert sorted(os.listdir(tmp_path)) == ["src"]


# --- 8. architectures names a transformers model class, or the folder is refused ---------------------------------

@pytest.mark.parametrize("archs", [[123], "LlamaForCausalLM", ["PreTrainedModel"], ["AutoModelForCausalLM"],
                                   ["LlamaConfig"], ["set_seed"], ["Trainer"]])
def test_architectures_must_name_a_model_class(capsys, tmp_path, monkeypatch, archs):
    """Any attribute of the transformers module was called with the config (set_seed, Trainer, pipeline, ...);
    [123] failed naming no file, ["PreTrainedModel"] gave "no layer to prune" (exit 1)."""
    called = []
    monkeypatch.setattr(transformers, "set_seed", lambda *a, **k: called.append(a))
    folder = tmp_path / "src"
    tiny_llama().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = archs
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"{folder / 'config.json'} names no model class transformers knows (architectures="
                               f"{archs!r})")
    assert called == [] and sorted(os.listdir(tmp_path)) == ["src"]


# --- 9. names are the file's text: no control sequence reaches the terminal -------------------------------------

def test_inspect_escapes_names_holding_control_characters(capsys, tmp_path):
    """A layer named "0\\x1b[2K\\r\\x1b[32mall layers fine..." erased its own row's verdict on a terminal and
    printed a fake one; ESC[8m hid the rest."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    sparse24.sparsify_(model, mode="compressed", min_features=0)
    sd = dict(model.state_dict())
    sd["0.meta"] = torch.full_like(sd["0.meta"], -1)   # a broken layer: inspect must say it fails
    evil = "0\x1b[2K\r\x1b[32mall layers fine\x1b[0m\x1b[8m"
    save_file({k.replace("0.", evil + ".", 1): v.contiguous() for k, v in sd.items()}, tmp_path / "e.safetensors")
    rc, out, err = run(capsys, "inspect", str(tmp_path / "e.safetensors"))
    assert rc == 1, err
    assert "\x1b" not in out + err and "\r" not in out + err
    row = next(line for line in out.splitlines() if "compressed" in line and "INVALID" in line)
    assert row.lstrip().startswith(r"0\x1b[2K\r\x1b[32mall layers fine\x1b[0m\x1b[8m  compressed")


def test_prune_escapes_names_holding_control_characters(capsys, tmp_path):
    """prune's table printed a file's tensor names raw: control sequences in one ran on the terminal."""
    torch.manual_seed(0)
    evil = "0\x1b[2K\r\x1b[32mfine\x1b[0m\x1b[8m"
    sd = {f"{evil}.weight": torch.randn(64, 64), f"{evil}.bias": torch.randn(64)}
    save_file(sd, tmp_path / "e.safetensors")
    rc, out, err = run(capsys, "prune", str(tmp_path / "e.safetensors"), "--out", str(tmp_path / "p.safetensors"),
                       "--min-features", "0", "--no-progress")
    assert rc == 0, err
    assert "\x1b" not in out + err and "\r" not in out + err
    assert any(line.lstrip().startswith(r"0\x1b[2K\r\x1b[32mfine\x1b[0m\x1b[8m.weight") for line in out.splitlines())

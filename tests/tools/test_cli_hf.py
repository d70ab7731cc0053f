"""prune with safetensors files and Hugging Face model folders; the program named as invoked."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel, LlamaForCausalLM

import sparse24
from hf_models import tiny_gpt2, tiny_llama, tokens
from test_cli import assert_one_line_error, run


def test_out_safetensors_writes_safetensors(capsys, tmp_path):
    dense = tiny_llama()
    save_file(dense.state_dict(), tmp_path / "dense.safetensors")  # safetensors in, too
    rc, out, err = run(capsys, "prune", str(tmp_path / "dense.safetensors"), "--out", str(tmp_path / "s.safetensors"))
    assert rc == 0, err
    sd = load_file(tmp_path / "s.safetensors")  # was "header too large": a torch zip under that name
    assert "model.layers.0.mlp.up_proj.values" in sd and "model.layers.0.mlp.up_proj.weight" not in sd
    assert "lm_head.weight" in sd and "lm_head.values" not in sd  # the output head stays dense
    assert "output head" in out and "safetensors.torch.load_file" in out
    model = tiny_llama(seed=1)
    sparse24.sparsify_(model, mode="compressed")
    model.load_state_dict(sd)  # strict
    ref = tiny_llama()
    sparse24.sparsify_(ref, mode="compressed")
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, ref(tokens()).logits)
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense.safetensors"), "--out", str(tmp_path / "h.safetensors"),
                     "--prune-head")
    assert rc == 0 and "lm_head.values" in load_file(tmp_path / "h.safetensors")


@pytest.mark.parametrize("arch, quantize", [("llama", "int8"), ("gpt2", None)])
def test_prune_a_sharded_model_folder(capsys, tmp_path, arch, quantize):
    dense = tiny_llama() if arch == "llama" else tiny_gpt2()
    dense.save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    (tmp_path / "dense" / "tokenizer.json").write_text("{}")  # other files come along
    shards = sorted(p.name for p in (tmp_path / "dense").glob("model-*.safetensors"))
    assert len(shards) > 2
    rc, out, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse"),
                       *(["--quantize", quantize] if quantize else []))
    assert rc == 0, err
    got = tmp_path / "sparse"
    assert sorted(p.name for p in got.glob("model-*.safetensors")) == shards and (got / "tokenizer.json").exists()
    index = json.loads((got / "model.safetensors.index.json").read_text())["weight_map"]
    assert all((got / f).exists() for f in index.values())
    cls = type(dense)
    loaded = sparse24.from_pretrained(cls, got)
    expected = cls.from_pretrained(tmp_path / "dense")
    sparse24.sparsify_(expected, mode="compressed", quantize=quantize)  # the same plan as sparsify_ in Python
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(v, expected.state_dict()[k]) for k, v in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(tokens()).logits, expected(tokens()).logits)
    assert "Hugging Face folder" in out and "sparse24.from_pretrained" in out


def test_prune_folder_errors(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "full"))
    assert rc == 2 and "exists and is not an empty folder" in err
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "sparse"))
    assert rc == 0
    rc, _, err = run(capsys, "prune", str(tmp_path / "sparse"), "--out", str(tmp_path / "again"))
    assert rc == 2 and "already quantized or compressed (sparse24); prune its dense original" in err
    (tmp_path / "dense" / "model.safetensors").unlink()
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "has no model.safetensors" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_truncated_shard_is_one_line_and_writes_nothing(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    shard = sorted((tmp_path / "dense").glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])  # a download cut short
    capsys.readouterr()  # transformers' own "Writing model shards" bar
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "o"))
    assert rc == 2
    assert_one_line_error(err, f"cannot read {shard} as a safetensors file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]  # no output, no partial folder


def test_shard_names_outside_the_folder_are_refused(capsys, tmp_path):
    """A shard index naming '../victim/model.safetensors' (or an absolute path) had prune rewrite that
    file in place, outside --out, and exit 0; transformers refuses such names when it loads."""
    tiny_llama().save_pretrained(tmp_path / "victim")
    victim = tmp_path / "victim" / "model.safetensors"
    before = victim.read_bytes()
    capsys.readouterr()  # transformers' own "Writing model shards" bar
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((tmp_path / "victim" / "config.json").read_text())
    names = list(load_file(victim))
    for shard in ("../victim/model.safetensors", str(victim)):
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}))
        for argv in (["prune", str(src), "--out", str(tmp_path / "o")], ["inspect", str(src)]):
            rc, _, err = run(capsys, *argv)
            assert rc == 2, (argv, err)
            assert_one_line_error(err, "model.safetensors.index.json", "is not a plain file name inside the folder")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": []}))
    for argv in (["prune", str(src), "--out", str(tmp_path / "o")], ["inspect", str(src)]):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and "'weight_map' must be an object" in err, (argv, err)
    assert victim.read_bytes() == before and not (tmp_path / "o").exists()


def test_folder_prune_refuses_a_bad_exclude_and_an_empty_plan(capsys, tmp_path):
    # an invalid --exclude gave re.error's traceback on a folder (one line on a state dict); pruning
    # nothing wrote a dense folder whose config.json named it sparse24 (a state dict: exit 1, nothing)
    tiny_llama().save_pretrained(tmp_path / "dense")
    torch.save(tokens(shape=(4, 9)), tmp_path / "ids.pt")
    capsys.readouterr()
    o = str(tmp_path / "o")
    for argv, code, needle in [
            (["--exclude", "("], 2, "--exclude '(' is not a regular expression"),
            (["--exclude", "(", "--method", "wanda", "--calibration-ids", str(tmp_path / "ids.pt")], 2,
             "--exclude '(' is not a regular expression"),
            (["--min-features", "100000"], 1, "no layer to prune"),
            (["--exclude", "."], 1, "no layer to prune"),
            (["--exclude", ".", "--method", "wanda", "--calibration-ids", str(tmp_path / "ids.pt")], 2,
             "no layer to prune")]:
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", o, *argv)
        assert rc == code, (argv, err)
        assert_one_line_error(err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "ids.pt"]


def test_a_late_failure_leaves_no_folder_behind(capsys, tmp_path):
    # the shards are read one by one: a layer whose weight is in none of them fails after the output's
    # folders were made; --out a/b/out left a/b behind (the partial folder itself was removed)
    tiny_llama().save_pretrained(tmp_path / "dense")
    weights = load_file(tmp_path / "dense" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "a" / "b" / "out"))
    assert rc != 0 and "model.layers.1.mlp.up_proj" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def _summary(out: str) -> tuple[int, int]:
    line = next(li for li in out.splitlines() if "2-D float weight tensors pruned" in li)
    n, total = re.search(r"(\d+) of the checkpoint's (\d+) 2-D", line).groups()
    return int(n), int(total)


def test_file_and_folder_summaries_count_the_same_weights(capsys, tmp_path):
    dense = tiny_llama()
    dense.save_pretrained(tmp_path / "dense")
    save_file(dense.state_dict(), tmp_path / "dense.safetensors")
    rc, folder_out, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    rc, file_out, err = run(capsys, "prune", str(tmp_path / "dense.safetensors"), "--out", str(tmp_path / "o.pt"))
    assert rc == 0, err
    # independent count: every 2-D float tensor named *.weight in the checkpoint; the pruned ones are the Linears
    stored = {k for k, v in load_file(tmp_path / "dense" / "model.safetensors").items()
              if k.endswith(".weight") and v.dim() == 2}
    linears = {f"{n}.weight" for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert _summary(folder_out) == _summary(file_out) == (len(linears), len(stored)) == (14, 16)
    rows = [dict(re.findall(r"^  ((?:model|lm_head)\S+) (.*?(?:kept dense|compressed))", o, re.M))
            for o in (folder_out, file_out)]
    assert rows[0] == rows[1] and set(rows[0]) == stored  # same weights, shapes, kept |w|, bytes and actions


def test_prune_progress_bar(capsys, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    save_file(tiny_llama().state_dict(), tmp_path / "dense.safetensors")
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / "a"), "--progress")
    shards = len(list((tmp_path / "dense").glob("model-*.safetensors")))
    assert rc == 0 and "prune: 100%" in err and f"{shards}/{shards} [" in err and "shard/s" in err
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense.safetensors"), "--out", str(tmp_path / "a.pt"), "--progress")
    n = len(tiny_llama().state_dict())
    assert rc == 0 and "prune: 100%" in err and f"{n}/{n} [" in err
    for argv in (["--no-progress"], []):  # off, and off by default where stderr is no terminal
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(tmp_path / f"b{len(argv)}"), *argv)
        assert rc == 0 and err == ""


def test_usage_names_the_program_as_invoked(tmp_path):
    script = Path(sys.executable).with_name("sparse24")  # the console script pip installed beside python
    for argv, prog in [([str(script)], "sparse24"), ([sys.executable, "-m", "sparse24"], "python -m sparse24")]:
        r = subprocess.run([*argv, "prune", "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: {prog} prune"), (argv, r.stdout[:200], r.stderr)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("path", ["magnitude", "wanda", "block-by-block"])
def test_a_folder_whose_config_names_no_dtype_loads_in_its_dtype_after_pruning(capsys, tmp_path, path, quantize):
    """transformers' default dtype="auto" takes a dtype config.json does not name from the first floating
    tensor of the checkpoint: in the pruned folder a quantized layer's scale, so a bf16 model loaded as
    float32 (INT8) or float16 (INT4). The output config now names the dtype the dense folder loads as."""
    from test_cli_calibrated import _folder
    folder, cls = _folder(tmp_path, "llama")
    cls.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dtype"]  # an older Hub config
    (folder / "config.json").write_text(json.dumps(cfg))
    dense = cls.from_pretrained(folder)  # the reference: what the dense folder loads as
    assert dense.dtype == torch.bfloat16
    torch.save(tokens(shape=(2, 9)), tmp_path / "ids.pt")
    argv = {"magnitude": ["--prune-head"],  # (lm_head.scale: the first floating tensor stored)
            "wanda": ["--method", "wanda", "--calibration", str(tmp_path / "calib.txt"), "--samples", "2"],
            "block-by-block": ["--method", "wanda", "--calibration-ids", str(tmp_path / "ids.pt")]}[path]
    capsys.readouterr()
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "o"), "--quantize", quantize,
                     "--no-progress", *argv)
    assert rc == 0, err
    loaded = sparse24.from_pretrained(cls, tmp_path / "o")
    assert loaded.dtype == torch.bfloat16
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "bfloat16"
    emb = loaded.model.embed_tokens.weight
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, dense.model.embed_tokens.weight)

"""Review findings on block-by-block pruning: models beyond Llama (scaled embeddings, per-layer attention
masks and rotary embeddings), the memory script, a late missing tensor, and the one-process DCP recipe."""
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import sparse24
from sparse24 import compress
from sparse24.masks import prune_layerwise_
import sparse24.tools.blockwise as bw
from sparse24.tools.blockwise import prune_folder_blockwise

from conftest import load_script
from hf_models import tiny_llama, tokens

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# The sliding window (4) is shorter than the sequences (12): a sliding layer's mask is not a full one.
MODELS = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, head_dim=16)),  # embeddings scaled by sqrt(64)
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, head_dim=16, sliding_window=4)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"])),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=4,
        layer_types=["full_attention", "sliding_attention"])),
    "gpt-oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(  # experts are no nn.Linear: attention pruned only
        **{**SMALL, "intermediate_size": 64}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # a Llama whose Hub folders keep EXAONE's older names (transformer.h.*.attn.attention.*), renamed on load
    "exaone": lambda: T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model("exaone", **SMALL)),
}
BATCHES = [torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(s)) for s in range(2)]


def _stored(folder):
    return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_blockwise_equals_in_memory_beyond_llama(tmp_path, name):
    """Gemma scales its embeddings inside the embedding module; Gemma2/3, Qwen2/3 and gpt-oss with sliding
    layers give each block its own attention mask (and Gemma3 its own rotary embeddings): block by block took
    the raw embedding rows and block 0's arguments for every block."""
    torch.manual_seed(0)
    MODELS[name]().save_pretrained(tmp_path / "src")
    prune_folder_blockwise(tmp_path / "src", tmp_path / "out", BATCHES, method="wanda")
    stored = _stored(tmp_path / "out")
    ref = getattr(T, type(MODELS[name]()).__name__).from_pretrained(tmp_path / "src", dtype=torch.float32)
    results = prune_layerwise_(ref, BATCHES, method="wanda", filter_fn=lambda m, f: f.startswith("model.layers."))
    assert len(results) == (8 if name == "gpt-oss" else 14)
    for fqn, r in results.items():
        for n, t in compress(r.weight, r.mask).state_tensors().items():
            assert torch.equal(stored[f"{fqn}.{n}"], t), (fqn, n)
    # the folder loads as the model it was pruned from, with every tensor left dense unchanged
    out = sparse24.from_pretrained(type(ref), tmp_path / "out", dtype=torch.float32)
    state = out.state_dict()
    for k, t in ref.state_dict().items():
        if k[:-len(".weight")] not in results:
            assert torch.equal(state[k], t), k


def test_blockwise_memory_script_runs(tmp_path, capsys):
    """scripts/blockwise_memory.py's pruning child called _skeleton(folder) without the shard headers."""
    tiny_llama().half().save_pretrained(tmp_path / "src", max_shard_size="40KB")
    load_script("blockwise_memory").prune(tmp_path / "src", tmp_path / "out", "wanda", 2, 8)
    assert "pruned 14 layers" in capsys.readouterr().out
    assert (tmp_path / "out" / "config.json").is_file()


def _four_blocks(tmp_path, edit):
    cfg = T.LlamaConfig(**{**SMALL, "num_hidden_layers": 4})
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).half().save_pretrained(tmp_path / "src")
    sd = load_file(tmp_path / "src/model.safetensors")
    edit(sd)
    save_file(sd, tmp_path / "src/model.safetensors", metadata={"format": "pt"})
    return tmp_path / "src"


@pytest.mark.parametrize("edit, needle", [
    (lambda sd: sd.pop("model.layers.3.post_attention_layernorm.weight"),
     "no model.layers.3.post_attention_layernorm.weight"),
    (lambda sd: sd.update({"model.layers.3.mlp.up_proj.weight": torch.zeros(128, 60, dtype=torch.half)}),
     r"describes 'model.layers.3.mlp.up_proj.weight' as \(128, 64\), but .* holds "
     r"'model.layers.3.mlp.up_proj.weight' as \(128, 60\)"),
    (lambda sd: sd.pop("model.embed_tokens.weight"), "no model.embed_tokens.weight"),
])
def test_late_missing_or_misshaped_tensor_refused_before_any_block(tmp_path, monkeypatch, edit, needle):
    """A tensor missing or mis-shaped in the last block was found after pruning every earlier block, and the
    message named neither the block nor the full key."""
    src = _four_blocks(tmp_path, edit)

    def never(*a, **k):
        raise AssertionError("a block was pruned before the checkpoint was checked")
    monkeypatch.setattr(bw, "prune_layerwise_", never)
    with pytest.raises(ValueError, match=needle):
        prune_folder_blockwise(src, tmp_path / "out", [tokens(shape=(1, 8))], method="sparsegpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output folder, no partial one


def test_materialize_names_the_block(tmp_path):
    """The per-block check (a checkpoint changed while pruning) names the full key too."""
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**SMALL)).save_pretrained(tmp_path / "src")
    with torch.device("meta"):
        block = T.LlamaForCausalLM(T.LlamaConfig(**SMALL)).model.layers[1]
    names = {k: (f"model.layers.1.{k}", "model.safetensors") for k in block.state_dict()}
    del names["input_layernorm.weight"]
    with pytest.raises(ValueError, match=r"no model.layers.1.input_layernorm.weight \(decoder block 1\)"):
        bw._materialize(block, names, tmp_path / "src", "model.layers.1.")


def _sparse_model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
    sparse24.sparsify_(m, min_features=0, skip_output_head=False)
    return m


def test_one_process_dcp_recipe_all_or_nothing(tmp_path):
    """docs/distributed.md: dcp.load writes into the tensors it is given, so loading into model.state_dict()
    changed the model before load_state_dict refused; the message said '(nothing was loaded)'. Loading into
    empty copies leaves the model as it was when the load is refused."""
    import torch.distributed.checkpoint as dcp
    bad = _sparse_model(0).state_dict()
    bad["0.mask"] = torch.ones_like(bad["0.mask"])  # not 2:4
    dcp.save(bad, checkpoint_id=tmp_path / "bad", no_dist=True)

    model = _sparse_model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=tmp_path / "bad", no_dist=True)
    with pytest.raises(RuntimeError, match=r"\(load_state_dict copied nothing\)") as e:
        model.load_state_dict(sd)
    assert "nothing was loaded" not in str(e.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    good = _sparse_model(2).state_dict()
    dcp.save(good, checkpoint_id=tmp_path / "good", no_dist=True)
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=tmp_path / "good", no_dist=True)
    model.load_state_dict(sd)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in good.items())


def test_out_as_a_symlink_to_an_empty_folder(tmp_path):
    # Accepted at the start, then the final rename failed on the link (NotADirectoryError) after all
    # the work: the link is followed, and names the result
    from sparse24.tools.hf_folder import prune_folder
    tiny_llama().half().save_pretrained(tmp_path / "src")
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    prune_folder(tmp_path / "src", tmp_path / "out")
    assert (tmp_path / "out").is_symlink() and (tmp_path / "real" / "model.safetensors").is_file()
    direct = tmp_path / "direct"
    prune_folder(tmp_path / "src", direct)
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == load_file(direct / "model.safetensors").keys()
    (tmp_path / "busy").symlink_to(tmp_path / "src")  # a link to a folder that is not empty: refused
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        prune_folder(tmp_path / "src", tmp_path / "busy")
    batches = list(tokens(0, (2, 8)).split(1))
    (tmp_path / "real2").mkdir()
    (tmp_path / "out2").symlink_to(tmp_path / "real2")
    prune_folder_blockwise(tmp_path / "src", tmp_path / "out2", batches, method="wanda")
    assert (tmp_path / "real2" / "config.json").is_file()

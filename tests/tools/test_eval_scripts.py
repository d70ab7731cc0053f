"""The evaluation scripts' model-specific permutation groups are exact: on small
random copies of the scripts' own models (BERT-style MiniLM, pre-LN char LM),
each group proves exact in float64 and the whole permuted model equals the
original. The scripts need their real weights and text only in main()."""

import torch

from sparse24.masks import calibrate, check_group, permute_model_

from conftest import load_script



def randomize_norms(model):
    with torch.no_grad():  # trained LayerNorms: a group that forgot one could not pass
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)


def check_model_groups(model, groups, batch):
    assert all(check_group(model, g, batch) for g in groups)
    model = model.double()
    ref = model(*batch) if isinstance(batch, tuple) else model(batch)
    stats = calibrate(model, [batch], hessian=True)
    permute_model_(model, groups, score="sparsegpt", calibration=stats, example=batch, max_iters=20)
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_minilm_groups_are_exact():
    mod = load_script("minilm_plain")
    torch.manual_seed(0)
    cfg = {"hidden_size": 32, "layer_norm_eps": 1e-12, "vocab_size": 50, "max_position_embeddings": 16,
           "type_vocab_size": 2, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2}
    model = mod.MiniLM(cfg).eval()
    randomize_norms(model)
    groups = mod.permutation_groups(model)
    assert [g.block for g in groups] == [None, 8, None, 8]
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    check_model_groups(model, groups, (ids, mask))


def test_charlm_groups_are_exact():
    mod = load_script("charlm_model")
    cfg = {"seed": 0, "d_model": 16, "layers": 2, "heads": 2, "ctx": 12}
    model = mod.build_model(cfg)
    randomize_norms(model)
    groups = mod.permutation_groups(model)
    assert groups[0].name == "residual" and len(groups[0].consumers) == 5 and len(groups) == 5
    check_model_groups(model, groups, torch.randint(0, 101, (2, 12)))

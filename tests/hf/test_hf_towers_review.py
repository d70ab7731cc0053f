"""Review finding: a sparsified CLIP / SigLIP folder loaded as one of its towers (``CLIPVisionModel``,
``CLIPTextModel``, ``SiglipVisionModel``), as transformers loads the dense folder. transformers 5.x's tower
classes have no ``vision_model.`` / ``text_model.`` wrapper and strip that prefix through their conversion
mapping (a ``PrefixChange``), and a tower's config class reads only its sub-config of a two-tower folder, which
has no ``quantization_config``. Before the fix: "quantization_config is missing" (two-tower folder), the
marker's size mismatch (compressed), or every 2:4 layer loaded as a plain ``nn.Linear`` with its mask dropped
(masked, with a warning calling the tower's layers "a head")."""
import copy
import re
import warnings

import pytest
import torch
import transformers as T

import sparse24
from sparse24 import Sparse24Linear

from hf_models import masked_reference

VISION = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, image_size=32,
              patch_size=8)
TEXT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, vocab_size=99,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=16)
MODES = [dict(mode="masked"), dict(mode="compressed"), dict(mode="compressed", quantize="int8")]
MODE_IDS = ["masked", "compressed", "int8"]


def clip():
    return T.CLIPModel(T.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=32))


def clip_vision_projection():
    return T.CLIPVisionModelWithProjection(T.CLIPVisionConfig(**VISION, projection_dim=32))


def siglip():
    return T.SiglipModel(T.SiglipConfig(text_config=TEXT, vision_config=VISION))


def layers_24(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def text_ids():
    return torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(2))


def saved(make, tmp_path, **how):
    """A sparsified model, its fp64 masked-dense reference (from a copy taken before pruning) and its folder."""
    torch.manual_seed(0)
    model = make().eval()
    dense = copy.deepcopy(model)
    sparse24.sparsify_(model, **how)
    model.save_pretrained(tmp_path)
    return model, masked_reference(dense, model), tmp_path


def load(cls, folder, **kwargs):
    """The loaded model and the message of sparse24's warning about listed layers it leaves out (or None)."""
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        tower = sparse24.from_pretrained(cls, folder, **kwargs).eval()
    warned = [str(w.message) for w in ws if "2:4 layer" in str(w.message)]
    assert len(warned) <= 1, warned  # one warning, not one per layer of the other tower
    return tower, (warned or [None])[0]


def left_out(message):
    """The layers a left-out warning names and how many it says there are."""
    names = re.findall(r"'([\w.]+)'", message.partition(" in a head")[0])
    total = re.search(r"\((\d+) in all\)", message)
    return names, int(total[1]) if total else len(names)


def check_tower(tower, model, part, ref_part, run, ref_run):
    """``tower`` holds ``part``'s 2:4 layers (names without the part's prefix), bit for bit, and computes what
    ``part`` of the original does (bit for bit) and what the fp64 reference does (float rounding)."""
    want = {n: m for n, m in layers_24(model).items() if n.startswith(part + ".")}
    got = layers_24(tower)
    assert want and sorted(got) == sorted(n[len(part) + 1:] for n in want)
    for name, layer in want.items():
        assert same_state(got[name[len(part) + 1:]], layer), name
    assert sorted(tower.config.quantization_config.layers) == sorted(got)
    with torch.no_grad():
        out = run(tower)
        assert torch.equal(out, run(model.get_submodule(part)))
        ref = ref_run(ref_part)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", MODES, ids=MODE_IDS)
def test_clip_folder_loads_as_its_vision_tower(tmp_path, how):
    model, ref, folder = saved(clip, tmp_path, **how)
    tower, warned = load(T.CLIPVisionModel, folder)
    # the other tower and the projections are not the vision tower's: left out with a warning, as transformers
    # drops their entries
    names, total = left_out(warned)
    assert all(n.startswith(("text_model.", "text_projection", "visual_projection")) for n in names) \
        and total == 6 + 2, warned
    check_tower(tower, model, "vision_model", ref.vision_model, lambda m: m(pixel_values=pixels()).pooler_output,
                lambda m: m(pixel_values=pixels().double()).pooler_output)


@pytest.mark.parametrize("how", MODES, ids=MODE_IDS)
def test_clip_vision_with_projection_folder_loads_as_clip_vision_model(tmp_path, how):
    model, ref, folder = saved(clip_vision_projection, tmp_path, **how)
    tower, warned = load(T.CLIPVisionModel, folder)
    assert left_out(warned) == (["visual_projection"], 1), warned  # only the projection head is left out
    check_tower(tower, model, "vision_model", ref.vision_model, lambda m: m(pixel_values=pixels()).pooler_output,
                lambda m: m(pixel_values=pixels().double()).pooler_output)


def test_plain_transformers_loader_takes_a_vision_tower_too(tmp_path):
    """With sparse24 registered, ``CLIPVisionModel.from_pretrained`` of a folder whose own config.json carries
    the section (a ``CLIPVisionModelWithProjection`` folder) rebuilds the 2:4 layers as well."""
    model, ref, folder = saved(clip_vision_projection, tmp_path, mode="masked")
    sparse24.hf.register()
    tower = T.CLIPVisionModel.from_pretrained(folder).eval()
    check_tower(tower, model, "vision_model", ref.vision_model, lambda m: m(pixel_values=pixels()).pooler_output,
                lambda m: m(pixel_values=pixels().double()).pooler_output)


@pytest.mark.parametrize("how", MODES[:2], ids=MODE_IDS[:2])
def test_clip_folder_loads_as_its_text_tower(tmp_path, how):
    model, ref, folder = saved(clip, tmp_path, **how)
    tower, warned = load(T.CLIPTextModel, folder)
    names, total = left_out(warned)
    assert all(n.startswith(("vision_model.", "text_projection", "visual_projection")) for n in names) \
        and total == 6 + 2, warned
    check_tower(tower, model, "text_model", ref.text_model, lambda m: m(input_ids=text_ids()).pooler_output,
                lambda m: m(input_ids=text_ids()).pooler_output)


@pytest.mark.parametrize("how", MODES[:2], ids=MODE_IDS[:2])
def test_siglip_folder_loads_as_its_vision_tower(tmp_path, how):
    model, ref, folder = saved(siglip, tmp_path, **how)
    tower, warned = load(T.SiglipVisionModel, folder)
    names, total = left_out(warned)
    assert all(n.startswith("text_model.") for n in names) and total == 6 + 1, warned  # (+ text head)
    check_tower(tower, model, "vision_model", ref.vision_model, lambda m: m(pixel_values=pixels()).pooler_output,
                lambda m: m(pixel_values=pixels().double()).pooler_output)


def test_a_loaded_tower_saves_and_loads_again(tmp_path):
    model, ref, folder = saved(clip, tmp_path / "clip", mode="compressed")
    tower, _ = load(T.CLIPVisionModel, folder)
    tower.save_pretrained(tmp_path / "tower")
    for cls in (T.CLIPVisionModel, T.CLIPVisionModelWithProjection):
        again, warned = load(cls, tmp_path / "tower")
        assert warned is None
        base = again if cls is T.CLIPVisionModel else again.vision_model
        with torch.no_grad():
            assert torch.equal(base(pixel_values=pixels()).pooler_output,
                               model.vision_model(pixel_values=pixels()).pooler_output)


def test_config_kwargs_still_reach_the_tower_config(tmp_path):
    """The tower's config gets the folder's section from sparse24.from_pretrained; a keyword that updates the
    config (``output_hidden_states``) still updates it, as transformers does when it reads the config itself."""
    _, _, folder = saved(clip, tmp_path, mode="masked")
    tower, _ = load(T.CLIPVisionModel, folder, output_hidden_states=True)
    assert tower.config.output_hidden_states is True
    with torch.no_grad():
        assert tower(pixel_values=pixels()).hidden_states is not None


@pytest.mark.parametrize("mode", ["masked", "compressed"])
def test_a_key_mapping_moving_a_2of4_layer_is_refused(tmp_path, mode):
    """A load that would put a 2:4 layer's entries anywhere but in its 2:4 layer (here a user ``key_mapping``)
    raises: a masked layer's weight would have loaded into a plain Linear, its mask dropped."""
    _, _, folder = saved(clip_vision_projection, tmp_path, mode=mode)
    with pytest.raises(ValueError, match=r"vision_model\.encoder\.layers\.0\.mlp\.fc1"):
        sparse24.from_pretrained(T.CLIPVisionModel, folder,
                                 key_mapping={r"^vision_model\.encoder\.layers\.0\.mlp\.fc1\.": "moved.fc1."})

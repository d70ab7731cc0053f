"""prune --quantize int4 --group-size N (state dict, Hugging Face folder, calibrated, block by block) and
inspect of INT4 layers: the files hold what the library writes, outputs match an independent fp64
reference of the INT4 grid, bytes are counted with the scales, bad options are one line and write nothing."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaForCausalLM

import sparse24
from sparse24 import Sparse24Linear
from sparse24.tools.blockwise import prune_folder_blockwise

from conftest import top2_mask
from hf_models import tiny_llama, tokens
from test_cli import run


def _int4_reference(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp64 dense weight: the top-2 mask, then per row and group of ``group_size`` columns the symmetric
    round-to-nearest INT4 grid (float16 scale amax / 7, codes -7..7), computed from the dense weight."""
    w = (w * top2_mask(w)).double()
    out = torch.zeros_like(w)
    for c0 in range(0, w.shape[1], group_size):
        g = w[:, c0:c0 + group_size]
        amax = g.abs().amax(1, keepdim=True)
        s = torch.where(amax > 0, (amax / 7).clamp(min=2.0 ** -24).half().double(), torch.ones_like(amax))
        out[:, c0:c0 + group_size] = torch.round(g / s).clamp(-7, 7) * s
    return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(96, 64), nn.Linear(64, 40)  # 96 columns: a short group at 64

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_prune_state_dict_int4_and_inspect(capsys, tmp_path):
    torch.manual_seed(0)
    dense = Net()
    sd = dense.state_dict()
    torch.save(sd, tmp_path / "dense.pt")
    out = tmp_path / "int4.safetensors"
    rc, text, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(out), "--quantize", "int4",
                        "--group-size", "64", "--min-features", "0")
    assert rc == 0, err
    assert "quantize=int4, group_size=64, symmetric=True" in text and "compressed int4 g64" in text
    pruned = load_file(out)
    assert pruned["fc1.values"].dtype == torch.uint8 and pruned["fc1.values"].shape == (64, 24)
    assert pruned["fc1.scale"].dtype == torch.float16 and pruned["fc1.scale"].shape == (64, 2)
    assert int(pruned["fc1.group_size"]) == 64 and "fc1.zero" not in pruned and "fc1.weight" not in pruned
    model = Net()
    sparse24.sparsify_(model, mode="compressed", quantize="int4", group_size=64, min_features=0,
                       skip_output_head=False)
    model.load_state_dict(pruned)  # strict: every key matches
    ref = Net().double()
    ref.load_state_dict({k: _int4_reference(v, 64) if k.endswith("weight") else v.double() for k, v in sd.items()})
    x = torch.randn(5, 96)
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), ref(x.double()), rtol=1e-5, atol=1e-5)
        assert (dense(x) - model(x)).abs().max() > 1e-3  # the reference is not the dense model

    rc, text, err = run(capsys, "inspect", str(out))
    assert rc == 0, err
    rows = {line.split()[0]: line for line in text.splitlines()[2:4]}
    # values R*C/4 + slots R*C/8 + fp16 scales 2*R*ceil(C/64) + the 4-byte group-size entry
    for name, (R, C) in (("fc1", (64, 96)), ("fc2", (40, 64))):
        cells = rows[name].split()
        assert cells[1:3] == ["INT4", "g64"] and cells[-1] == "exact"
        assert int(cells[-2]) == R * C // 4 + R * C // 8 + 2 * R * -(-C // 64) + 4
    assert "2 INT4" in text
    bad = dict(pruned)
    bad["fc2.scale"] = bad["fc2.scale"].clone()
    bad["fc2.scale"][3, 0] = 0
    save_file(bad, tmp_path / "bad.safetensors")
    rc, text, _ = run(capsys, "inspect", str(tmp_path / "bad.safetensors"))
    assert rc == 1 and "INVALID: corrupt INT4 scales: 'fc2.scale'[3, 0] is 0.0, not positive" in text


def test_prune_int4_option_errors(capsys, tmp_path):
    torch.save(Net().state_dict(), tmp_path / "dense.pt")
    for args, msg in ((["--quantize", "int8", "--group-size", "64"], "--group-size and --asymmetric go with "
                                                                      "--quantize int4"),
                      (["--asymmetric"], "--group-size and --asymmetric go with --quantize int4"),
                      (["--quantize", "int4", "--group-size", "48"], "invalid choice: 48")):
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(tmp_path / "o.pt"), *args)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "o.pt").exists()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    tiny_llama().save_pretrained(path, max_shard_size="40KB")
    return path


def _same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def test_prune_folder_int4_equals_the_library(capsys, tmp_path, folder):
    rc, text, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "int4"), "--quantize", "int4",
                        "--group-size", "32", "--asymmetric")
    assert rc == 0, err
    assert "compressed int4 g32 asym" in text
    got = sparse24.from_pretrained(LlamaForCausalLM, tmp_path / "int4")
    want = LlamaForCausalLM.from_pretrained(folder)
    sparse24.sparsify_(want, mode="compressed", quantize="int4", group_size=32, symmetric=False)
    assert _same_model(got, want)
    with torch.no_grad():
        assert torch.equal(got(tokens()).logits, want(tokens()).logits)
    layers = [m for m in got.modules() if isinstance(m, Sparse24Linear)]
    assert len(layers) == 14 and all(m.quantize == "int4" and m.symmetric is False for m in layers)
    rc, text, _ = run(capsys, "inspect", str(tmp_path / "int4"))
    assert rc == 0 and "14 2:4 layer(s) (14 INT4)" in text and "INT4 g32 asym" in text


def test_prune_block_by_block_int4(capsys, tmp_path, folder):
    batches = [tokens(seed=s, shape=(2, 11)) for s in range(2)]
    torch.save(torch.cat(batches), tmp_path / "ids.pt")
    rc, text, err = run(capsys, "prune", str(folder), "--out", str(tmp_path / "cli"), "--method", "wanda",
                        "--calibration-ids", str(tmp_path / "ids.pt"), "--batch-size", "2", "--quantize", "int4",
                        "--group-size", "64")
    assert rc == 0, err
    assert "compressed int4 g64" in text
    prune_folder_blockwise(folder, tmp_path / "api", batches, method="wanda", quantize="int4", group_size=64)
    a, b = (sparse24.from_pretrained(LlamaForCausalLM, tmp_path / n) for n in ("cli", "api"))
    assert _same_model(a, b)
    layers = [m for m in a.modules() if isinstance(m, Sparse24Linear)]
    assert layers and all(m.quantize == "int4" and int(m.group_size) == 64 for m in layers)


def test_calibrated_prune_int4_equals_the_library(capsys, tmp_path):
    from transformers import AutoTokenizer

    from test_cli_calibrated import TEXTS, _folder
    src, cls = _folder(tmp_path, "llama")
    rc, text, err = run(capsys, "prune", str(src), "--out", str(tmp_path / "sparse"), "--method", "wanda",
                        "--calibration", str(tmp_path / "calib.txt"), "--samples", "6", "--quantize", "int4")
    assert rc == 0, err
    assert "compressed int4 g128" in text
    got = sparse24.from_pretrained(cls, tmp_path / "sparse")
    want = cls.from_pretrained(src).eval()
    tok = AutoTokenizer.from_pretrained(src)
    batches = [{**tok(t, return_tensors="pt"), "use_cache": False} for t in TEXTS[:6]]
    stats = sparse24.calibrate(want, batches, hessian=False)
    sparse24.sparsify_(want, mode="compressed", method="wanda", calibration=stats, quantize="int4")
    assert _same_model(got, want)
    assert all(m.quantize == "int4" and int(m.group_size) == 128 for m in got.modules()
               if isinstance(m, Sparse24Linear))


def test_info_names_int4_weights_and_the_backend_that_runs_them(capsys):
    rc, text, _ = run(capsys, "info")
    line = next(x for x in text.splitlines() if "int4 weights" in x)
    assert rc == 0 and "quantize='int4', group_size=128" in line and "fused dequant in the Triton kernel" in line

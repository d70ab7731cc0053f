"""sparse24 under another torch default device or default dtype than its data's.

``torch.set_default_device`` / ``with torch.device(...)`` and ``torch.set_default_dtype`` are process-wide
settings (a GPU user often sets the device once); tensors sparse24 makes for its own use must follow the
data (or the CPU, for tables and generator draws), not those settings. The meta device stands in for
another device (the only one on a CPU machine): a CPU model under a meta default is a CPU model under a
CUDA default. Every sparse24 call here runs under the setting; the references are computed after it is
restored, in float64 with plain torch on the masked dense weights."""
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import sparse24
from sparse24.masks.kept_dense import _elements_overlap
from sparse24.masks.two_d import _block_patterns

from conftest import assert_matches_reference, int4_dequantized_reference, top2_mask
from hf_models import masked_reference, tiny_llama, tokens


@pytest.fixture
def meta_default():
    """torch's default device set to meta for the test, the previous default restored after (the CPU: no
    device mode left installed, as before the test)."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)
        # torch < 2.13 leaves device_context = None behind, on which its own get_default_device() then fails
        # (transformers calls it when building a model): the state of a process that never set a default
        ctx = torch._GLOBAL_DEVICE_CONTEXT
        if getattr(ctx, "device_context", True) is None:
            del ctx.device_context


def skip_unless_adamw_follows_its_parameters():
    """torch < 2.13's AdamW makes its step counters on the default device (meta here) and fails at its
    first step: torch's own failure, which sparse24's training calls (AdamW inside) cannot avoid."""
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    opt = torch.optim.AdamW([p])
    try:
        with torch.device("meta"):
            opt.step()
    except RuntimeError as e:
        pytest.skip(f"this torch's AdamW cannot step under a meta default device ({e})")


@pytest.fixture(params=[torch.float64, torch.bfloat16, torch.float16])
def default_dtype(request):
    """torch's default dtype set to a non-float32 one for the test, restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(before)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def assert_int4_layer_right(layer, w0, b0, gen):
    """The INT4 layer's codes round the masked dense weight to nearest, and it computes the float64
    linear of the weight its stored bytes define."""
    mask = top2_mask(w0)
    ref_w = int4_dequantized_reference(layer, mask)
    step = layer.scale.double().repeat_interleave(int(layer.group_size), 1)[:, :w0.shape[1]]
    assert bool(((ref_w - (w0 * mask).double()).abs()[mask] <= step[mask] * 0.5 * (1 + 2 ** -10)).all())
    x = torch.randn(3, w0.shape[1], generator=gen)
    assert_matches_reference(layer(x), x, ref_w.float(), b0)


# --- F1: INT4 quantization and other calls on CPU data under a meta default device ---

def test_int4_layer_with_device_cpu_under_meta_default(meta_default):
    layer = sparse24.Sparse24Linear(64, 32, mode="compressed", quantize="int4", device="cpu")
    assert {t.device.type for t in layer.state_dict().values()} == {"cpu"}


def test_int4_sparsify_of_cpu_model_under_meta_default(gen):
    dense = nn.Sequential(nn.Linear(128, 32))
    w0, b0 = dense[0].weight.detach().clone(), dense[0].bias.detach().clone()
    with torch.device("meta"):
        sparse24.sparsify_(dense, mode="compressed", quantize="int4", group_size=64, min_features=1)
    assert dense[0].values.device.type == "cpu"
    assert_int4_layer_right(dense[0], w0, b0, gen)


def test_int4_meta_flow_load_inside_the_meta_block(gen):
    """docs/modules.md's meta-device flow, with the load written inside the `with torch.device("meta")`."""
    dense = nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 16))
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 16))
        sparse24.sparsify_(m, mode="compressed", quantize="int4", group_size=32, min_features=1)
        m.load_state_dict(dense.state_dict(), assign=True)
    for i in (0, 2):
        assert m[i].values.device.type == "cpu"
        assert_int4_layer_right(m[i], dense[i].weight.detach(), dense[i].bias.detach(), gen)


def assert_round_trip_in_a_fresh_process(make: str):
    """Run ``make`` (code setting ``w``, a CPU weight, and ``back``, a Sparse24Tensor made from it) in a new
    process that set a meta default device before importing sparse24; ``back`` must hold ``w``'s top-2
    entries of each group of 4 (fp64, plain torch, after the default is the CPU again)."""
    code = textwrap.dedent("""
        import torch
        torch.set_default_device("meta")
        import sparse24
    """) + textwrap.dedent(make) + textwrap.dedent("""
        torch.set_default_device("cpu")
        g = w.double().abs().reshape(-1, 4)
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.argsort(1, descending=True)[:, :2], True)
        assert torch.equal(back.to_dense().double(), w.double() * keep.view(w.shape))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_import_under_meta_default():
    """Importing sparse24 after the default device is set builds its lookup tables on the CPU."""
    assert_round_trip_in_a_fresh_process("""
        w = torch.randn(8, 32, device="cpu")
        back = sparse24.compress(w)
    """)


def kept_fp64(w, perm):
    """float64 sum of the 2 largest |w| per group of 4 of w[:, perm]."""
    return float(w.double().abs()[:, perm].reshape(w.shape[0], -1, 4).topk(2, dim=-1).values.sum())


def test_search_permutation_under_meta_default():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        perm = sparse24.search_permutation(w, max_iters=300, time_limit=None, progress=False)
    assert perm.device.type == "cpu"
    assert torch.equal(perm.sort().values, torch.arange(128))
    assert kept_fp64(w, perm) > kept_fp64(w, torch.arange(128))   # 300 steps find a better grouping here


def test_apply_permutation_under_meta_default():
    net = mlp()
    x = torch.randn(5, 64)
    ref = net.double()(x.double())
    w2 = net[2].weight.detach().clone()
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        sparse24.apply_permutation(net[0], net[2], perm)
    assert torch.equal(net[2].weight, w2[:, perm])
    torch.testing.assert_close(net(x.double()), ref, rtol=0, atol=1e-12)


def test_permute_model_under_meta_default():
    net = mlp()
    x = torch.randn(16, 64)
    ref = net.double()(x.double())
    net.float()
    w2, w4 = net[2].weight.detach().clone(), net[4].weight.detach().clone()
    with torch.device("meta"):
        groups = sparse24.find_permutation_groups(net, x)
        assert all(sparse24.check_group(net, g, x) for g in groups)
        gains = sparse24.permute_model_(net, groups, max_iters=50, time_limit=None, progress=False)
    assert [(g.producers, g.consumers) for g in groups] == [(["0"], ["2"]), (["2"], ["4"])]
    assert set(gains) == {"2", "4"}
    # weights moved, not changed (the last layer's columns permuted), and the outputs unchanged (float64)
    cols = [int((w4.T == c).all(1).nonzero()) for c in net[4].weight.detach().T]
    assert sorted(cols) == list(range(64)) and cols != list(range(64))
    assert torch.equal(net[2].weight.detach().flatten().sort().values, w2.flatten().sort().values)
    torch.testing.assert_close(net.double()(x.double()), ref, rtol=1e-12, atol=1e-12)


def test_token_noise_under_meta_default():
    ids = tokens(0, (4, 16))
    plain = sparse24.token_noise([ids], copies=1, p=0.5, vocab=50, keep=[3, 4])
    with torch.device("meta"):
        noisy = sparse24.token_noise([ids], copies=1, p=0.5, vocab=50, keep=[3, 4])
    assert noisy[1].device.type == "cpu" and torch.equal(noisy[1], plain[1])
    changed = noisy[1] != ids
    assert bool(changed.any()) and not bool(torch.isin(ids[changed], torch.tensor([3, 4])).any())
    assert bool(((noisy[1] >= 0) & (noisy[1] < 50) | ~changed).all())


def test_learn_masks_under_meta_default():
    skip_unless_adamw_follows_its_parameters()
    net = mlp()
    X = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    dense = [net[i].weight.detach().clone() for i in (0, 2, 4)]
    with torch.device("meta"):
        sparse24.learn_masks(net, X, steps=2, min_features=1, progress=False)
    ref = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).double()
    for i, w0 in zip((0, 2, 4), dense):
        mask = net[i].mask
        assert mask.device.type == "cpu"
        assert bool((mask.view(-1, 4).sum(1) == 2).all())   # 2 kept of every 4
        with torch.no_grad():
            ref[i].weight.copy_(net[i].weight.double() * mask)   # (the learned weights, masked)
            ref[i].bias.copy_(net[i].bias.double())
    x = torch.randn(5, 64)
    torch.testing.assert_close(net(x).double(), ref(x.double()), rtol=1e-5, atol=1e-6)


def test_learnable_mask_under_meta_default():
    """The pattern table follows ``device`` (None: the default device, as torch's factories); the saved
    extra state is on the CPU and loads back."""
    with torch.device("meta"):
        on_cpu = sparse24.LearnableMask((8, 16), device="cpu")
        on_default = sparse24.LearnableMask((8, 16))
        state = on_cpu.state_dict()
    assert on_cpu.patterns.device.type == "cpu" and on_default.patterns.device.type == "meta"
    combos = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    expect = torch.zeros(6, 4, dtype=torch.bool)
    for p, c in enumerate(combos):
        expect[p, list(c)] = True
    assert torch.equal(on_cpu.patterns, expect)
    assert state["_extra_state"].device.type == "cpu"
    sparse24.LearnableMask((8, 16)).load_state_dict(state)


def test_mask_2d_optimal_under_meta_default():
    _block_patterns.cache_clear()   # its table is built once per process: build it here, under meta
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    with torch.device("meta"):
        mask = sparse24.mask_nm(w, 2, 4, method="2d_optimal")
    assert mask.device.type == "cpu"
    # the best block of each 4x4 tile with at most 2 kept per row and per column, by brute force
    rows = torch.tensor([[r >> j & 1 for j in range(4)] for r in range(16) if bin(r).count("1") <= 2],
                        dtype=torch.bool)                                       # (11, 4)
    idx = torch.cartesian_prod(*[torch.arange(len(rows))] * 4)                 # (11**4, 4)
    blocks = rows[idx]                                                          # (11**4, 4, 4)
    blocks = blocks[(blocks.sum(1) <= 2).all(1)]
    for bi in range(2):
        for bj in range(2):
            blk = w[4 * bi:4 * bi + 4, 4 * bj:4 * bj + 4].double().abs()
            best = float((blocks.double() * blk).sum((1, 2)).max())
            got = mask[4 * bi:4 * bi + 4, 4 * bj:4 * bj + 4]
            assert bool((got.sum(0) <= 2).all()) and bool((got.sum(1) <= 2).all())
            assert float(blk[got].sum()) == pytest.approx(best, rel=1e-12)


def test_interleaved_views_under_meta_default():
    """Strided views of one weight: elements compared in a host buffer, whatever the default device."""
    w = torch.zeros(8, 4)
    with torch.device("meta"):
        assert not _elements_overlap(w[0::2], w[1::2])
        assert _elements_overlap(w[0::2], w[0::4])


def test_save_pretrained_of_compressed_model_under_meta_default(tmp_path):
    model = tiny_llama()
    dense = tiny_llama()
    sparse24.sparsify_(model, mode="compressed")
    with torch.device("meta"):
        model.save_pretrained(tmp_path)
    loaded = sparse24.from_pretrained(type(model), tmp_path).eval()
    ids = tokens()
    ref = masked_reference(dense, loaded)(ids).logits
    torch.testing.assert_close(loaded(ids).logits.double(), ref, rtol=0, atol=1e-4)


# --- F2 and alike: another default dtype than float32 ---

def test_decode_packed_empty_int8_under_default_dtype(default_dtype):
    d = sparse24.DecodePacked.empty(32, 64, int8=True)
    assert d.scale.dtype == torch.float32 and d.scale.shape == (32,)
    assert d.dtype == torch.float32


def test_token_noise_draws_whatever_the_default_dtype():
    """The copies are reproducible from the seed: the same under any default dtype as under float32's."""
    ids = tokens(0, (4, 16))
    want = sparse24.token_noise([ids], copies=2, p=0.3, vocab=50, seed=3)
    for dt in (torch.float64, torch.bfloat16, torch.float16):
        before = torch.get_default_dtype()
        torch.set_default_dtype(dt)
        try:
            got = sparse24.token_noise([ids], copies=2, p=0.3, vocab=50, seed=3)
        finally:
            torch.set_default_dtype(before)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), dt


# --- the same kind of site outside the layers: interop's tables, evaluation, the CLI's helpers ---

def test_interop_tables_built_under_meta_default_round_trip():
    """interop's slot tables are built at its import: under a meta default they held no data, and a
    round trip through torch's CUTLASS layout failed (a meta table indexed with CPU nibbles)."""
    assert_round_trip_in_a_fresh_process("""
        from sparse24.interop import from_cutlass_layout, to_cutlass_layout
        w = torch.randn(32, 64, device="cpu", dtype=torch.float16)
        w[:, ::2] = 0
        w[::3, 1::4] = 0  # groups with one or no non-zero: the tables re-pick their slots
        back = from_cutlass_layout(*to_cutlass_layout(sparse24.compress(w)))
    """)


def test_embedding_fidelity_numpy_reference_under_meta_default():
    """A numpy reference (sentence-transformers' encode()) became a meta tensor under a meta default."""
    enc = nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2], [3, 4]])
    ref = enc.weight.detach()[ids].mean(1).double()
    with torch.device("meta"):
        got = sparse24.embedding_fidelity(enc, [ids], ref.numpy())
    assert got == pytest.approx(1.0, abs=1e-6)


def test_demo_evaluation_and_training_under_meta_default():
    """The demo's windows, evaluation and training draws follow the data (the CPU), not the default."""
    skip_unless_adamw_follows_its_parameters()
    from sparse24.tools.demo import CharMLP, TrainConfig, evaluate_bpc, train
    torch.manual_seed(0)
    model = CharMLP()
    ids = torch.randint(0, 96, (400,), generator=torch.Generator().manual_seed(1))
    x = ids[torch.arange(100)[:, None] + torch.arange(model.ctx + 1)]
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model.eval()(x[:, :-1]).double(), x[:, -1], reduction="mean")
    before = [p.detach().clone() for p in model.parameters()]
    with torch.device("meta"):
        bpc = evaluate_bpc(model, ids, n_chars=100, progress=False)
        loss = train(model, ids, TrainConfig(steps=2, batch=4), progress=False)
    assert bpc == pytest.approx(float(ref) / math.log(2), rel=1e-6)
    assert math.isfinite(loss) and loss > 0
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained

"""scripts/gpu_sparse_mm.py (run by scripts/gpu_check.sh on a GPU): its CPU smoke mode writes every
column, and its reader of cuSPARSELt's compressed layout tells plain row-major kept values from a
fixed or a mask-dependent order, on files made here by stand-ins for ``torch._cslt_compress``."""
import csv
import math

import torch

import sparse24
from conftest import load_script
from sparse24.interop import _cusparselt_sm90_buffer, _from_cusparselt_sm90_buffer

mod = load_script("gpu_sparse_mm")


def test_smoke_writes_every_column(tmp_path):
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sparse_mm.csv")))
    assert len(rows) == 1 and set(rows[0]) >= {f"{c}_us" for c in mod.COLUMNS} | {"cslt_alg_id"}
    r = rows[0]
    for c in ("dense", "unpack", "unpack_mm", "dense_eager"):   # the paths CPU has
        assert float(r[f"{c}_us"]) > 0
    for c in ("cslt", "cslt_alg", "cslt_eager", "cslt_mm_eager"):   # cuSPARSELt: CUDA only, nan
        assert math.isnan(float(r[f"{c}_us"]))
    assert float(r["worst_rel_diff"]) < 1e-2


def _meta_elems(t):
    return t.numel() // (16 if t.dtype == torch.float16 else 8)   # N*K/8 bytes, as cuSPARSELt's


def _meta(t, code=lambda lo, hi: lo | hi << 2, order=None):
    """Metadata as a stand-in writes it: one 4-bit field per group (its kept pair coded by ``code``),
    groups in row-major order or ``order(N, K)[p]`` in field p, two fields a byte, low nibble first."""
    N, K = t.shape
    idx = (t != 0).view(N, K // 4, 4).nonzero()[:, 2].view(-1, 2)     # each group's kept pair
    fields = code(idx[:, 0], idx[:, 1])
    if order is not None:
        fields = fields[order(N, K)]
    return (fields[0::2] | fields[1::2] << 4).to(torch.uint8).view(t.dtype)


def _compress(order, meta=_meta):
    """A stand-in for torch._cslt_compress: the kept values in ``order(mask)`` (a permutation of the
    row-major slots), then ``meta(t)``."""
    def compress(t):
        mask = t != 0   # every kept code is >= 1
        vals = t[mask]
        return torch.cat([vals[order(mask)], meta(t)])
    return compress


def _plain(m):
    return torch.arange(int(m.sum()))


def _layout(tmp_path, compress):
    path = tmp_path / "layout.pt"
    mod.dump_layout(path, torch.device("cpu"), compress=compress)
    return mod.analyze_layout(path)


def test_layout_plain_row_major(tmp_path):
    lines = _layout(tmp_path, _compress(_plain))
    assert len(lines) == 4
    assert all("kept values first, plain row-major" in ln for ln in lines[0::2])
    for ln in lines[1::2]:   # the metadata read back group by group
        assert "2.00 bits per kept value" in ln and "coded lo | hi << 2" in ln
        assert "field p holds row:group 0:0, 0:1, 0:2" in ln and "not the sm_90 order" in ln


def test_layout_metadata_in_torchaos_sm90_order(tmp_path):
    lines = _layout(tmp_path, _compress(_plain, lambda t: _meta(t, order=mod.sm90_meta_groups)))
    for ln in lines[1::2]:
        assert "coded lo | hi << 2" in ln and "field p holds row:group 0:0, 8:0, 0:4, 8:4, 0:1, 8:1" in ln, ln
        assert "the sm_90 order torchao's sparsify kernel writes" in ln and "not the" not in ln


def test_sm90_meta_groups_by_hand():
    N, K = 128, 128
    groups = mod.sm90_meta_groups(N, K)
    assert torch.equal(groups.sort().values, torch.arange(N * K // 4))   # every field one group
    at = {int(g): p for p, g in enumerate(groups)}
    G = K // 4
    # (row, group) -> field: rows r and r + 8 share a byte; groups 0, 4 / 1, 5 / 2, 6 / 3, 7 of a
    # 32-column chunk sit in bytes 0, 1 / 2, 3 / 4, 5 / 6, 7 of the row's 8; 16-row blocks 64 B
    # apart, 32-column chunks 256 B, 64-row bands 8 K bytes
    for (n, g), field in {(0, 0): 0, (8, 0): 1, (0, 4): 2, (0, 1): 4, (0, 2): 8, (0, 3): 12, (0, 7): 14,
                          (1, 0): 16, (9, 0): 17, (16, 0): 128, (0, 8): 512, (64, 0): 2 * 8 * K}.items():
        assert at[n * G + g] == field, (n, g)


def test_layout_metadata_reordered_and_recoded(tmp_path):
    lines = _layout(tmp_path, _compress(_plain, lambda t: _meta(t, lambda lo, hi: hi | lo << 2,
                                                               lambda N, K: torch.arange(N * K // 4).flip(0))))
    for ln, (N, K) in zip(lines[1::2], ((128, 128), (64, 64))):
        assert "coded hi | lo << 2" in ln and f"row:group {N - 1}:{K // 4 - 1}, {N - 1}:{K // 4 - 2}," in ln, ln


def test_layout_metadata_unreadable(tmp_path):
    lines = _layout(tmp_path, _compress(_plain, lambda t: torch.zeros(_meta_elems(t), dtype=t.dtype)))
    assert all("0 of" in ln and "4-bit fields match one group's kept pair" in ln for ln in lines[1::2]), lines


def test_layout_fixed_permutation(tmp_path):
    def pairs_swapped(m):   # rows 2i and 2i+1 trade places: fixed, whatever the mask
        N, half = m.shape[0], m.shape[1] // 2
        return torch.arange(N * half).view(N // 2, 2, half).flip(1).reshape(-1)
    lines = _layout(tmp_path, _compress(pairs_swapped))
    assert all("one fixed order" in ln and "element p holds row:rank 1:0, 1:1" in ln for ln in lines[0::2]), lines


def test_layout_mask_dependent(tmp_path):
    def by_lane_in_group(m):   # each row's kept values ordered by (k % 4, k): moves with the mask
        N, K = m.shape
        n, k = m.nonzero(as_tuple=True)
        return torch.argsort(n * 4 * K + (k % 4) * K + k)
    lines = _layout(tmp_path, _compress(by_lane_in_group))
    assert all("depends on the mask" in ln for ln in lines[0::2]), lines


def test_layout_values_not_first(tmp_path):
    def meta_first(t):
        c = _compress(_plain)(t)
        return torch.roll(c, _meta_elems(t))
    lines = _layout(tmp_path, meta_first)
    assert all("not the kept values" in ln for ln in lines), lines


def test_layout_compress_refused(tmp_path):
    def int8_refused(t):
        if t.dtype == torch.int8:
            raise RuntimeError("no int8 here")
        return _compress(_plain)(t)
    lines = _layout(tmp_path, int8_refused)
    assert "plain row-major" in lines[0] and "compress failed: RuntimeError: no int8 here" in lines[2]


def test_analyze_cli(tmp_path, capsys):
    path = tmp_path / "layout.pt"
    mod.dump_layout(path, torch.device("cpu"), compress=_compress(_plain))
    assert mod.main(["--analyze", str(path)]) == 0
    assert capsys.readouterr().out.count("plain row-major") == 2


def test_digit_masks_tell_every_group_apart():
    N, K = mod.LAYOUT_SHAPES[torch.float16]
    masks = [mod._digit_mask(N, K, m) for m in range(mod.N_MASKS)]
    assert all((m.view(N, K // 4, 4).sum(-1) == 2).all() for m in masks)
    seq = torch.stack([m.view(N * K // 4, 4) for m in masks], 1).reshape(N * K // 4, -1)
    assert torch.unique(seq, dim=0).shape[0] == N * K // 4


def _sm90_compress(t):
    """cuSPARSELt's compress as predicted: our buffer of the weight t's non-zeros name."""
    return _cusparselt_sm90_buffer(sparse24.compress(t, mask=t != 0))


def _sm90_mm(buf, xt, transpose_result):
    """cuSPARSELt's product as a stand-in: decode the predicted buffer, multiply in fp32."""
    K = xt.shape[0]
    w = _from_cusparselt_sm90_buffer(buf, (buf.numel() * 16 // 9 // K, K)).to_dense()
    assert transpose_result
    return (xt.t().float() @ w.float().t()).to(xt.dtype)


def test_layout_of_the_predicted_sm90_buffer(tmp_path):
    lines = _layout(tmp_path, _sm90_compress)
    assert "kept values first, plain row-major" in lines[0]
    assert "coded lo | hi << 2" in lines[1] and "the sm_90 order torchao's sparsify kernel writes" in lines[1]
    assert "compress failed: TypeError" in lines[2]   # an int8 buffer is not ours to build


def test_own_buffer_check_reports_equal_and_right():
    lines = mod.own_buffer_lines(torch.device("cpu"), shapes=((64, 128),), compress=_sm90_compress, mm=_sm90_mm)
    assert len(lines) == 2 and all("values equal, metadata equal" in ln and "(right)" in ln for ln in lines), lines


def test_own_buffer_check_reports_a_difference():
    def shuffled(t):   # the metadata of another order: the product on our buffer stays right
        b = _sm90_compress(t)
        half = t.numel() // 2
        return torch.cat([b[:half], b[half:].flip(0)])
    lines = mod.own_buffer_lines(torch.device("cpu"), shapes=((64, 128),), compress=shuffled, mm=_sm90_mm)
    assert all("values equal, metadata DIFFERS" in ln and "(right)" in ln for ln in lines), lines

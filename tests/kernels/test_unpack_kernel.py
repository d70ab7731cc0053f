"""The unpack kernel (kernels/sparse24_unpack.py, Triton's interpreter here): a decode-layout
weight written out dense equals the masked dense weight it was packed from, bit for bit
(INT8: each kept q times its row's float32 scale, rounded once to the output dtype; INT4:
(u - z) * s of its group, rounded once: the operand the kernels multiply with 16-bit x)."""
import pytest
import torch

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import launch

from conftest import assert_matches_reference, load_script, matches_reference
from test_int4_kernel import _int4   # the INT4 weight's fp64 dequantization, built independently


@pytest.mark.parametrize("R,C", [(16, 64), (37, 200), (130, 260)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_16bit_equals_the_masked_weight(R, C, dtype, gen):
    w = torch.randn(R, C, generator=gen).to(dtype)
    masked = w * sparse24.mask_nm(w)
    d = pack_decode(sparse24.compress(w))
    out = launch.unpack_dense(d.values, d.meta, None, (R, C), dtype)
    assert out.shape == (R, C) and out.dtype == dtype
    assert torch.equal(out, masked)


@pytest.mark.parametrize("R,C", [(16, 64), (37, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_int8_equals_the_dequantized_weight(R, C, dtype, gen):
    w = torch.randn(R, C, generator=gen)
    q = sparse24.quantize_values(sparse24.compress(w), "int8")
    # independent of the layouts: the kept positions from the mask, q = round(w / scale)
    kept = sparse24.mask_nm(w).bool()
    scale = w.masked_fill(~kept, 0).abs().amax(1).clamp_min(1e-30) / 127
    expect = torch.where(kept, (w / scale[:, None]).round().clamp(-127, 127) * scale[:, None], 0.0).to(dtype)
    assert torch.equal(q.scale, scale.float())
    d = pack_decode(q)
    out = launch.unpack_dense(d.values, d.meta, d.scale, (R, C), dtype)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("R,C,gs", [(16, 64, 32), (37, 200, 64), (130, 260, 128)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_int4_equals_the_dequantized_weight_rounded_once(R, C, gs, symmetric, dtype, gen):
    """Odd shapes (row and column padding, a partial quantization group), both zero-point modes:
    the fp64 dequantization (u - z) * s rounded once to the output dtype, bit for bit."""
    p, W = _int4(R, C, gs, symmetric, gen)
    d = pack_decode(p)
    out = launch.unpack_dense(d.values, d.meta, d.scale, (R, C), dtype, zero=d.zero, group_size=gs)
    assert out.shape == (R, C) and out.dtype == dtype
    assert torch.equal(out, W.to(dtype))


def test_unpack_int4_refuses_codes_at_an_unaligned_address(gen):
    """INT4 codes are read as 32-bit words: a view at an odd byte offset would fault on a GPU
    (the interpreter would not notice), so it is refused; a copy is aligned."""
    p, W = _int4(16, 64, 32, True, gen)
    d = pack_decode(p)
    shifted = torch.empty(d.values.numel() + 1, dtype=torch.uint8)[1:].view(d.values.shape)
    shifted.copy_(d.values)
    with pytest.raises(ValueError, match="4-byte aligned"):
        launch.unpack_dense(shifted, d.meta, d.scale, (16, 64), torch.float16, group_size=32)
    assert torch.equal(launch.unpack_dense(shifted.clone(), d.meta, d.scale, (16, 64), torch.float16, group_size=32),
                       W.half())


def test_unpack_int4_reads_exact_bfloat16_scales(gen):
    """A module's bfloat16 copy of scales bfloat16 holds exactly (format.bf16_exact_scales) gives
    the same weight as the float16 scales, and a wrong scale would not (the test can fail)."""
    from sparse24.format import bf16_exact_scales
    p, _ = _int4(32, 256, 64, True, gen)
    exact = bf16_exact_scales(p.scale.float())
    d = pack_decode(p)
    want = launch.unpack_dense(d.values, d.meta, exact, (32, 256), torch.bfloat16, group_size=64).clone()
    got = launch.unpack_dense(d.values, d.meta, exact.bfloat16(), (32, 256), torch.bfloat16, group_size=64)
    assert torch.equal(got, want)
    doubled = launch.unpack_dense(d.values, d.meta, exact.bfloat16() * 2, (32, 256), torch.bfloat16, group_size=64)
    assert torch.equal(doubled.float(), 2 * want.float()) and not torch.equal(doubled, want)


def test_unpack_reuses_one_scratch_per_device(gen):
    d = pack_decode(sparse24.compress(torch.randn(32, 128, generator=gen).half()))
    a = launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16)
    small = pack_decode(sparse24.compress(torch.randn(16, 64, generator=gen).half()))
    b = launch.unpack_dense(small.values, small.meta, None, (16, 64), torch.float16)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_unpack_route_int4_matches_reference(x_dtype, symmetric, gen):
    """INT4 on the unpack route against fp64 on the weight its kernels multiply with 16-bit x
    (the dequantized value rounded once to x's dtype), with a bias of x's dtype."""
    from sparse24.ops.linear24 import op
    N, K, gs = 48, 256, 64
    p, W = _int4(N, K, gs, symmetric, gen)
    d = pack_decode(p)
    b = torch.randn(N, generator=gen).to(x_dtype)
    x = torch.randn(2, 20, K, generator=gen).to(x_dtype)
    y = op._compute(x, d.values, d.meta, d.scale, d.zero, b, torch.float32, "unpack", N, gs)
    assert y.shape == (2, 20, N) and y.dtype == x_dtype
    assert_matches_reference(y.reshape(-1, N), x.reshape(-1, K), W.to(x_dtype).double(), b.double())


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
def test_unpack_route_int8_matches_reference(x_dtype, gen):
    """INT8 on the unpack route: against fp64 on q * s rounded once to x's dtype (the scratch's
    weight; the kernels apply the fp32 scale after the dot instead), bias of x's dtype, 3-D x;
    and that rounding is what the route does: against the exact weight some output is off by
    more than its bound (the test tells the two apart)."""
    from sparse24.ops.linear24 import op
    N, K = 48, 192
    w = torch.randn(N, K, generator=gen)
    q = sparse24.quantize_values(sparse24.compress(w), "int8")
    exact = q.to_dense().double() if q.dtype == torch.float32 else None
    assert exact is not None   # fp32 weight: to_dense is q * s in fp32, exact
    d = pack_decode(q)
    b = torch.randn(N, generator=gen).to(x_dtype)
    x = torch.randn(2, 30, K, generator=gen).to(x_dtype)
    y = op._compute(x, d.values, d.meta, d.scale, None, b, torch.float32, "unpack", N, 0)
    assert y.shape == (2, 30, N) and y.dtype == x_dtype
    rounded = exact.to(x_dtype).double()
    assert_matches_reference(y.reshape(-1, N), x.reshape(-1, K), rounded, b.double())
    assert not matches_reference(y.reshape(-1, N), x.reshape(-1, K), exact, b.double())


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [None, "x"])
def test_unpack_route_matches_reference(x_dtype, bias, gen):
    """The unpack route (op's "unpack": the scratch, then one mm / addmm) against fp64 on the
    masked weight, 2-D and 3-D x."""
    from sparse24.ops.linear24 import op
    N, K = 48, 192
    w = torch.randn(N, K, generator=gen).to(x_dtype)
    dense = (w * sparse24.mask_nm(w)).double()
    d = pack_decode(sparse24.compress(w))
    b = None if bias is None else torch.randn(N, generator=gen).to(x_dtype)
    for shape in ((40, K), (2, 20, K)):
        x = torch.randn(*shape, generator=gen).to(x_dtype)
        y = op._compute(x, d.values, d.meta, None, None, b, x_dtype, "unpack", N, 0)
        assert y.shape == (*shape[:-1], N) and y.dtype == x_dtype
        assert_matches_reference(y.reshape(-1, N), x.reshape(-1, K), dense, None if b is None else b.double())


@pytest.mark.parametrize("quantize,x_dtype", [(None, torch.float16), ("int8", torch.float16), ("int4", torch.float16),
                                             (None, torch.float32)])
def test_the_tuner_times_the_unpack_route_where_it_applies(quantize, x_dtype, gen):
    """``tuning.unpack_time_us`` (what ``sparse24 autotune`` records as ``unpack_us`` past 16
    rows): the route's launches handed to the timer, one per weight copy, each right; None for
    float32 x (the route does not apply) and for a result off the reference."""
    from sparse24.tools import tuning
    w = torch.randn(48, 256, generator=gen)
    p = sparse24.compress(w.half()) if quantize is None else sparse24.compress(w, quantize=quantize, group_size=64) \
        if quantize == "int4" else sparse24.compress(w, quantize=quantize)
    d = pack_decode(p)
    x = torch.randn(20, 256, generator=gen).to(x_dtype)
    dense = (p.to_dense().to(x_dtype) if quantize else p.to_dense()).double()
    ref = torch.nn.functional.linear(x.double(), dense)
    timed = []

    def timer(launches):
        timed.append([f() for f in launches])
        return 12.3456
    got = tuning.unpack_time_us(x, [d, d], ref, 1e-2, timer)
    if x_dtype == torch.float32:
        assert got is None and not timed
        return
    assert got == 12.346 and len(timed) == 1 and len(timed[0]) == 2
    for y in timed[0]:
        assert_matches_reference(y, x, dense)
    assert tuning.unpack_time_us(x, [d], -ref, 1e-2, timer) is None   # a wrong result is never timed
    assert len(timed) == 1


def test_unpack_route_leaves_another_bias_dtype_to_the_prefill_kernel(gen, monkeypatch):
    """A float32 bias with float16 x: the prefill kernel adds it before its one rounding (the
    route's mm would round twice); the unpack kernel is not launched."""
    from sparse24.ops.linear24 import op
    monkeypatch.setattr(launch, "_launch_unpack", lambda *a: pytest.fail("unpacked for a float32 bias"))
    N, K = 48, 192
    w = torch.randn(N, K, generator=gen).half()
    d = pack_decode(sparse24.compress(w))
    b = torch.randn(N, generator=gen)
    x = torch.randn(40, K, generator=gen).half()
    y = op._compute(x, d.values, d.meta, None, None, b, torch.float16, "unpack", N, 0)
    assert_matches_reference(y, x, (w * sparse24.mask_nm(w)).double(), b.double())


@pytest.mark.parametrize("M,x_dtype,values_dtype,scale,want", [
    (255, torch.float16, torch.float16, False, "prefill"), (256, torch.float16, torch.float16, False, "unpack"),
    (4096, torch.bfloat16, torch.bfloat16, False, "unpack"), (4096, torch.bfloat16, torch.float16, False, "prefill"),
    (4096, torch.float32, torch.float16, False, "prefill"), (4096, torch.float16, torch.uint8, True, "unpack"),
    (256, torch.bfloat16, torch.uint8, True, "unpack"), (255, torch.float16, torch.uint8, True, "prefill"),
    (4096, torch.float32, torch.uint8, True, "prefill")])
def test_prefill_backend(M, x_dtype, values_dtype, scale, want):
    """Unmeasured, from UNPACK_MIN_M rows with 16-bit x a 16-bit weight of x's dtype and a
    quantized one (INT8, INT4: a scale) take the unpack route; a 16-bit weight of another dtype
    and float32 x stay on the prefill kernel. Measured (this GPU's tuned entry), the faster of
    the two, where the route applies."""
    from sparse24.ops.linear24 import op
    assert op.UNPACK_MIN_M == 256
    assert op.prefill_backend(M, x_dtype, values_dtype, scale) == want
    applies = want == "unpack" or M < op.UNPACK_MIN_M and x_dtype != torch.float32 and (scale or values_dtype == x_dtype)
    for unpack_us, kernel_us in ((5.0, 9.0), (9.0, 5.0)):
        timings = {"unpack_us": unpack_us, "kernel_us": kernel_us, "dense_us": 1.0}
        faster = "unpack" if unpack_us < kernel_us else "prefill"
        assert op.prefill_backend(M, x_dtype, values_dtype, scale, timings) == (faster if applies else "prefill")
    assert op.prefill_backend(M, x_dtype, values_dtype, scale, {"kernel_us": 1.0}) == want   # one of the two: rule


@pytest.mark.parametrize("variant", ["fp16", "bf16", "int8", "int8-bf16", "int4", "int4-bf16", "int4-zero"])
def test_unpack_compiles_for_sm90(variant):
    """The same source compiles for sm_90 (it ran on an H200 bit-exact: results/NVIDIA_H200/probe.log),
    without local memory, specialized as a launch on a 4096 x 4096 weight is (pointers and sizes
    divisible by 16; kernel_static_check.py --unpack compiles it so): 16-bit values load as
    16-byte vectors, the dense rows store 4 slots at once."""
    ksc = load_script("kernel_static_check")
    (_, *args, _), = [v for v in ksc.UNPACK_VARIANTS if v[0] == variant]
    ptx = ksc.compile_unpack(*args).asm["ptx"]
    assert ".local" not in ptx and "st.global.v2.b32" in ptx   # 4 fp16 / bf16 slots per store
    assert ("ld.global.v4.b32" in ptx) == (variant in ("fp16", "bf16"))   # a lane's 8 16-bit values at once


@pytest.mark.parametrize("captured", [False, True])
def test_an_outgrown_scratch_a_cuda_graph_wrote_stays_alive(captured, gen, monkeypatch):
    """A CUDA graph captured while the scratch was B1 writes B1 on every replay: when a larger
    layer grows the scratch to B2, B1 is kept (until release_workspaces), not handed back to the
    allocator for another tensor to take; outside capture it is let go. (Capture faked: CPU.)"""
    launch.release_workspaces()
    small = pack_decode(sparse24.compress(torch.randn(16, 64, generator=gen).half()))
    monkeypatch.setattr(launch, "_capturing", lambda t: captured)
    launch.unpack_dense(small.values, small.meta, None, (16, 64), torch.float16)
    b1 = launch._DENSE_SCRATCH[torch.device("cpu")]
    monkeypatch.setattr(launch, "_capturing", lambda t: False)
    big = pack_decode(sparse24.compress(torch.randn(64, 256, generator=gen).half()))
    launch.unpack_dense(big.values, big.meta, None, (64, 256), torch.float16)
    assert launch._DENSE_SCRATCH[torch.device("cpu")] is not b1
    assert any(t is b1 for t in launch._RETIRED) == captured
    grown_again = pack_decode(sparse24.compress(torch.randn(128, 512, generator=gen).half()))
    launch.unpack_dense(grown_again.values, grown_again.meta, None, (128, 512), torch.float16)
    assert len(launch._RETIRED) == int(captured)          # B2 was never captured: let go
    launch.release_workspaces()
    assert not launch._RETIRED and not launch._GRAPHED


def test_an_outgrown_split_k_workspace_stays_alive():
    """The split-K workspace a plan (and a graph captured with it) used is kept when a larger
    plan grows the device's pair, also once the plans are gone (config_store.clear_cache())."""
    launch.release_workspaces()
    cfg = sparse24.ops.config_space.KernelConfig(16, 64, 256, 1, 4, 4, 1, kernel="decode")
    ws1, c1 = launch.decode_workspace("cpu", 256, cfg, 4)
    ws2, c2 = launch.decode_workspace("cpu", 4096, cfg, 4)
    assert ws2.numel() > ws1.numel() and any(t is ws1 for t in launch._RETIRED)
    assert any(t is c1 for t in launch._RETIRED)
    launch.release_workspaces()
    assert not launch._RETIRED


def test_release_workspaces_frees_the_scratch_and_calls_still_work(gen):
    d = pack_decode(sparse24.compress(torch.randn(32, 128, generator=gen).half()))
    a = launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16).clone()
    assert launch._DENSE_SCRATCH
    launch.release_workspaces()
    assert not launch._DENSE_SCRATCH and not launch._SCRATCH_VIEWS and not launch._WORKSPACES and not launch._PLANS
    assert not launch._RETIRED and not launch._GRAPHED
    assert torch.equal(launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16), a)


def test_static_check_reports_the_unpack_kernel(monkeypatch, capsys):
    """``kernel_static_check.py --unpack``: the sm_90 instruction count per thread and the
    predicted issue and HBM times it prints (INT4 with zero points here: one variant, for time)."""
    ksc = load_script("kernel_static_check")
    monkeypatch.setattr(ksc, "UNPACK_VARIANTS", [v for v in ksc.UNPACK_VARIANTS if v[0] == "int4-zero"])
    assert ksc.main(["--unpack", "--shape", "4096,4096"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("int4-zero"))
    n, issue, hbm = int(row[1]), float(row[3]), float(row[4])
    assert 100 < n < 2000   # a real kernel, fully unrolled over its 32 outputs a thread
    assert hbm == round(4096 * 4096 * (2 + 0.375 + 3 / 128) / 4.2e12 * 1e6, 1)
    assert issue == round(4096 * 4096 / 1024 * n / (132 * 4 * 1.98e9) * 1e6, 1)
    assert f"unpack at 4096 x 4096: max predicted {max(issue, hbm):.1f} us" in out

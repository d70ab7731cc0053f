"""The unpack kernel (kernels/sparse24_unpack.py, Triton's interpreter here): a decode-layout
weight written out dense equals the masked dense weight it was packed from, bit for bit
(INT8: each kept q times its row's float32 scale, rounded once to the output dtype)."""
import pytest
import torch

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.ops.linear24 import launch

from conftest import assert_matches_reference


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


def test_unpack_reuses_one_scratch_per_device(gen):
    d = pack_decode(sparse24.compress(torch.randn(32, 128, generator=gen).half()))
    a = launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16)
    small = pack_decode(sparse24.compress(torch.randn(16, 64, generator=gen).half()))
    b = launch.unpack_dense(small.values, small.meta, None, (16, 64), torch.float16)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


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


@pytest.mark.parametrize("M,x_dtype,values_dtype,scale,group,want", [
    (255, torch.float16, torch.float16, False, 0, "prefill"), (256, torch.float16, torch.float16, False, 0, "unpack"),
    (4096, torch.bfloat16, torch.bfloat16, False, 0, "unpack"), (4096, torch.bfloat16, torch.float16, False, 0,
                                                                  "prefill"),
    (4096, torch.float32, torch.float16, False, 0, "prefill"), (4096, torch.float16, torch.uint8, True, 0, "prefill"),
    (4096, torch.float16, torch.uint8, True, 64, "prefill")])
def test_prefill_backend(M, x_dtype, values_dtype, scale, group, want):
    """From UNPACK_MIN_M rows a 16-bit weight of x's dtype takes the unpack route; other weights
    (another dtype, INT8, INT4) and float32 x stay on the prefill kernel."""
    from sparse24.ops.linear24 import op
    assert op.UNPACK_MIN_M == 256
    assert op.prefill_backend(M, x_dtype, values_dtype, scale, group) == want


@pytest.mark.parametrize("int8,out", [(False, "*fp16"), (False, "*bf16"), (True, "*fp16"), (True, "*bf16")])
def test_unpack_compiles_for_sm90(int8, out):
    """The same source compiles for sm_90 (it ran on an H200 bit-exact: results/NVIDIA_H200/probe.log),
    without local memory, specialized as a launch on a 4096 x 4096 weight is (pointers and sizes
    divisible by 16): 16-bit values load as 16-byte vectors, the dense rows store 4 slots at once."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sparse24.kernels.sparse24_unpack import sparse24_unpack
    sig = {"v_ptr": "*u8" if int8 else out, "meta_ptr": "*i32", "scale_ptr": "*fp32", "out_ptr": out, "R": "i32",
           "C": "i32", "NT": "i32", "stride_ml": "i32", "stride_or": "i32", "INT8": "constexpr", "BLOCK_A": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    k = triton.compile(ASTSource(sparse24_unpack, sig, constexprs={"INT8": int8, "BLOCK_A": 4}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert ".local" not in ptx and "st.global.v2.b32" in ptx   # 4 fp16 / bf16 slots per store
    assert ("ld.global.v4.b32" in ptx) != int8                  # a lane's 8 16-bit values at once


def test_release_workspaces_frees_the_scratch_and_calls_still_work(gen):
    d = pack_decode(sparse24.compress(torch.randn(32, 128, generator=gen).half()))
    a = launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16).clone()
    assert launch._DENSE_SCRATCH
    launch.release_workspaces()
    assert not launch._DENSE_SCRATCH and not launch._SCRATCH_VIEWS and not launch._WORKSPACES and not launch._PLANS
    assert torch.equal(launch.unpack_dense(d.values, d.meta, None, (32, 128), torch.float16), a)

"""The M > 16 route of a decode-layout layer on CUDA, taken on CPU tensors: the
backend decision sees a CUDA-looking x and the kernel launch is a no-op, so a
call's aten ops and allocated bytes are counted at torch's dispatcher (as
``scripts/bench_host.py --prefill`` does). No call may convert or decompress
the weight; the layer holds one copy of the kept values."""

import dataclasses

import pytest
import torch
from torch import nn

import sparse24
from sparse24.decode_format import DecodePacked
from sparse24.format import Sparse24Tensor
from sparse24.ops import config_store
from sparse24.ops.linear24 import launch, op
from sparse24.ops.config_space import SP_MAX_M, KernelConfig, decode_default, dtype_key
from sparse24.ops.linear24.prefill import prefill_config, prefill_pair
from sparse24.tools.dispatch_count import count_dispatch

from conftest import load_script

_bench = load_script("bench_host")
_AsCuda = _bench._AsCuda  # what the backend decision reads of x, as a CUDA tensor shows it


@pytest.fixture
def cuda_route(monkeypatch):
    """The CUDA decision on CPU tensors, the launch a no-op; returns the launches' grids."""
    real = op._auto_backend
    monkeypatch.setattr(op, "_auto_backend", lambda x, *rest: real(_AsCuda(x), *rest))
    monkeypatch.setattr(op, "_triton_available", lambda: True)
    # the device query (tuned-file lookup, sparse tensor cores), as a GPU without a tuned file answers it
    monkeypatch.setattr(config_store, "device_info", _bench.as_cuda_device_info(config_store.device_info))
    config_store.clear_cache()
    grids = []
    monkeypatch.setattr(launch._Plan, "launch", lambda plan, grid, args, aligned: grids.append((plan.config, grid)))
    monkeypatch.setattr(launch, "_launch_unpack", lambda values, meta, scale, out, *rest: grids.append(("unpack", out.shape)))
    op._AUTO.clear()
    yield grids
    config_store.clear_cache()
    op._AUTO.clear()
    launch._PLANS.clear()


def _layer(quantize, N=256, K=512):
    torch.manual_seed(0)
    return sparse24.Sparse24Linear.from_linear(nn.Linear(K, N, dtype=torch.float16), mode="compressed",
                                               quantize=quantize).to_layout("decode")


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_prefill_route_converts_nothing(quantize, cuda_route, monkeypatch):
    layer = _layer(quantize)
    for cls, name in ((DecodePacked, "to_sparse24"), (DecodePacked, "to_dense"), (Sparse24Tensor, "to_dense")):
        monkeypatch.setattr(cls, name, lambda *a, _n=name, **k: pytest.fail(f"the M > 16 route called {_n}"))
    with torch.no_grad():
        # (to SP_MAX_M rows the sparse tensor-core kernel runs: the next test)
        for shape in ((SP_MAX_M + 1, 512), (128, 512), (255, 512), (256, 512),
                      (300, 512), (5, 60, 512)):
            x = torch.randn(*shape, dtype=torch.float16)
            M = x[..., 0].numel()
            route = "unpack" if M >= op.UNPACK_MIN_M else "prefill"
            assert op._auto_backend(x, layer.values, layer.scale, 256, layer.group_size or 0) == route
            layer(x)                                     # the plan (or the dense scratch) is made on the first call
            cuda_route.clear()
            y, count = count_dispatch(layer, x)
            assert y.shape == (*shape[:-1], 256)
            if route == "unpack":   # one unpack launch into the shared scratch, then cuBLAS (addmm: 1 kernel)
                assert cuda_route == [("unpack", (256, 512))]
                assert [o for o in count.ops if o != "view"] == ["addmm"], count.ops
            else:
                assert len(cuda_route) == 1 and cuda_route[0][0].kernel == "prefill"   # one launch
                pair = prefill_pair(dtype_key(torch.float16, int8_weights=quantize == "int8",
                                              int4_weights=quantize == "int4"))
                assert cuda_route[0][0] == prefill_config(M, 256, 512, pair=pair)   # the untuned default
            assert len(count.ops) <= 3, count.ops                                   # empty (+ views for 3-D x)
            assert count.bytes_allocated <= y.numel() * y.element_size(), count


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_sparse_tensor_core_kernel_serves_17_to_64_rows(dtype, quantize, cuda_route):
    """INT8 and INT4 with 16-bit x: to SP_MAX_M rows one launch of the sparse tensor-core kernel
    with 32 rows per program (block_m 32, the untuned default past 16 rows, split-K included;
    ceil(M / 32) row blocks per weight tile); then the prefill kernel. Nothing converted, only
    the output allocated once the plan exists. Untuned 16-bit weights keep the prefill kernel
    (measured faster there on an H200: config_space.sp_tunable; a tuned entry can choose the
    sparse kernel, test_a_tuned_entry_gives_16bit_weights_the_sparse_tensor_cores)."""
    layer = _layer(quantize).to(dtype)
    key = dtype_key(dtype, int8_weights=quantize == "int8", int4_weights=quantize == "int4")
    gs = layer.group_size or 0
    rows = [(17, 32), (32, 32), (33, 32), (48, 32), (64, 32), (65, None), (128, None)]
    if quantize is None:
        rows = [(M, None) for M, _ in rows]
    with torch.no_grad():
        for M, block_m in rows:
            x = torch.randn(M, 512, dtype=dtype)
            want = "prefill" if block_m is None else "triton"
            assert op._auto_backend(x, layer.values, layer.scale, 256, gs) == want, M
            layer(x)
            cuda_route.clear()
            y, count = count_dispatch(layer, x)
            assert len(cuda_route) == 1
            config, grid = cuda_route[0]
            if block_m is None:
                assert config.kernel == "prefill"
            else:
                assert config == decode_default(256, 512, key, rows=M) and config.block_m == block_m
                # block_m rows per program, the row blocks along x (the fastest)
                assert grid == (-(-M // block_m), -(-256 // config.block_n), config.split_k)
            assert len(count.ops) <= 3 and count.bytes_allocated <= y.numel() * y.element_size(), count
        x = torch.randn(20, 512, dtype=torch.float32)     # fp32 x: the byte-permute kernels, the prefill one here
        assert op._auto_backend(x, layer.values, layer.scale, 256, gs) == "prefill"
        # a GPU without sparse tensor cores (sm_75: mma.sp does not compile): every weight kind takes the
        # prefill kernel past 16 rows (and the byte-permute kernel to 16: tests/kernels/test_sp_kernel.py)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(config_store, "device_info", lambda device=None: config_store.DeviceInfo("Old GPU", (7, 5)))
            config_store.clear_cache()
            # (but INT4 with bfloat16 x: the bf16x2 asm needs sm_80, so the reference)
            want = "reference" if gs and dtype == torch.bfloat16 else None
            assert op._auto_backend(torch.randn(20, 512, dtype=dtype), layer.values, layer.scale, 256, gs) \
                == (want or "prefill")
            op._AUTO.clear()
            assert op._auto_backend(torch.randn(8, 512, dtype=dtype), layer.values, layer.scale, 256, gs) \
                == (want or "triton")
        config_store.clear_cache()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_tuned_entry_gives_16bit_weights_the_sparse_tensor_cores(dtype, cuda_route, tmp_path, monkeypatch):
    """A 16-bit weight of x's dtype at 17-64 rows runs the sparse tensor-core kernel where this
    GPU's tuned entry for the shape and bucket chose its 32-row config (the tuner times it beside
    the prefill kernel): that config, one launch, only the output allocated. Not from another
    bucket's entry, not for the other 16-bit dtype (mma.sp takes one type), not on a GPU without
    sparse tensor cores; a tuned prefill entry at the bucket keeps the prefill kernel."""
    from sparse24.tools import tuning
    layer = _layer(None).to(dtype)
    key = dtype_key(dtype)
    sp = dataclasses.replace(decode_default(256, 512, key, rows=32), split_k=2)
    pre = KernelConfig(32, 64, 64, 8, 1, 4, 3, kernel="prefill")
    assert sp.block_m == 32 and sp != decode_default(256, 512, key, rows=32)
    tuning.write_entries(tmp_path, "Fake GPU H1", (9, 0), {
        (32, 256, 512, key): {"config": sp, "kernel_us": 1.0, "dense_us": 2.0},
        (64, 256, 512, key): {"config": pre, "kernel_us": 1.0, "dense_us": 2.0}})
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(config_store, "device_info", lambda device=None: config_store.DeviceInfo("Fake GPU H1", (9, 0)))
    config_store.clear_cache()
    try:
        with torch.no_grad():
            for M, want in ((17, sp), (32, sp), (33, pre), (64, pre), (8, None)):
                x = torch.randn(M, 512, dtype=dtype)
                layer(x)   # a plan's first call makes its split-K workspace, kept for the process: not per call
                cuda_route.clear()
                y, count = count_dispatch(layer, x)
                assert len(cuda_route) == 1, M
                config, grid = cuda_route[0]
                if want is None:   # M <= 16: the byte-permute kernel
                    assert config.kernel == "decode" and config.block_m == 16
                    continue
                assert config == want, M
                if want is sp:
                    assert op._auto_backend(x, layer.values, None, 256) == "triton"
                    assert grid == (-(-M // 32), -(-256 // sp.block_n), sp.split_k)
                    assert len(count.ops) <= 3 and count.bytes_allocated <= y.numel() * y.element_size(), count
            other = torch.bfloat16 if dtype == torch.float16 else torch.float16
            assert op._auto_backend(torch.randn(20, 512, dtype=other), layer.values, None, 256) == "prefill"
        monkeypatch.setattr(config_store, "device_info",
                            lambda device=None: config_store.DeviceInfo("Fake GPU H1", (7, 5)))
        config_store.clear_cache()
        assert op._auto_backend(torch.randn(20, 512, dtype=dtype), layer.values, None, 256) == "prefill"
    finally:
        config_store.clear_cache()


def test_the_count_sees_a_whole_weight_conversion(cuda_route, monkeypatch):
    """The same measurement on the route the layer took before (the reference backend:
    re-order to layout v1, decompress, matmul) fails the prefill limits: the test can fail."""
    layer = _layer(None)
    monkeypatch.setattr(op, "_auto_backend", lambda *a: "reference")
    x = torch.randn(64, 512, dtype=torch.float16)
    with torch.no_grad():
        y, count = count_dispatch(layer, x)
    assert len(count.ops) > 3 and count.bytes_allocated > y.numel() * y.element_size() + 256 * 512


def test_decode_sizes_keep_the_decode_kernel(cuda_route):
    layer = _layer(None)
    with torch.no_grad():
        for M in (1, 16):
            layer(torch.randn(M, 512, dtype=torch.float16))
    assert [c.kernel for c, _ in cuda_route] == ["decode", "decode"]


@pytest.mark.parametrize("quantize,limit", [(None, 0.60), ("int8", 0.40)])
def test_layer_holds_one_copy(quantize, limit):
    """A decode-layout layer's memory (values + keep masks + scales + bias) against its dense
    fp16 weight: one copy of the kept values (fp16: 0.5625 + row/column padding; INT8: 0.3125
    + the mma.sp metadata words, 0.0625, + scales and padding: 0.396 at 1000 x 1000)."""
    layer = _layer(quantize, N=1000, K=1000)
    held = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
    assert held <= limit * 1000 * 1000 * 2, held / (1000 * 1000 * 2)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_bench_host_prefill_figures(quantize):
    """``scripts/bench_host.py --prefill`` on a small layer: the figures it prints are within
    issue 22's limits (<= 3 aten ops, allocation <= the output, no conversion, one copy). The
    first M is the first the prefill kernel runs (past SP_MAX_M rows: to there 16-bit weights of
    x's dtype and INT8 with 16-bit x run the sparse tensor-core kernel)."""
    first = SP_MAX_M + 1
    rows = load_script("bench_host").prefill_figures(256, 1024, (first, 128, 300), quantize)  # K = 1024: whole meta atoms
    assert [(r["M"], r["backend"]) for r in rows] == [(first, "prefill"), (128, "prefill"),
                                                      (300, "unpack")]
    for r in rows:
        assert r["aten_ops"] <= 3 and r["bytes_allocated"] <= r["output_bytes"] and r["conversions"] == 0, r
        assert r["layer_bytes_over_dense_fp16"] <= 0.60


def test_a_tuned_prefill_entry_serves_the_route(cuda_route, tmp_path, monkeypatch):
    """With this GPU's tuned file holding a prefill entry for the layer's shape (``sparse24
    autotune`` past 16 rows), the call runs that config, also as the nearest M; at 17-64 rows
    not (the space there tiles at most 64 rows: the untuned default serves); from UNPACK_MIN_M
    rows the unpack route (measured faster than the tuned prefill kernel on an H200)."""
    from sparse24.ops import config_store
    from sparse24.ops.config_space import KernelConfig
    from sparse24.tools import tuning
    layer = _layer(None)
    tuned = KernelConfig(128, 128, 64, 8, 1, 8, 3, kernel="prefill")
    assert tuned != prefill_config(300, 256, 512)
    tuning.write_entries(tmp_path, "Fake GPU H1", (9, 0),
                         {(512, 256, 512, "float16"): {"config": tuned, "kernel_us": 1.0, "dense_us": 2.0}})
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(config_store, "device_info", lambda device=None: config_store.DeviceInfo("Fake GPU H1", (9, 0)))
    config_store.clear_cache()
    try:
        with torch.no_grad():
            # (at 17-64 rows the prefill kernel's untuned default; from UNPACK_MIN_M rows the unpack route)
            for M, want in ((200, tuned), (100, tuned), (20, prefill_config(20, 256, 512)),
                            (300, "unpack"), (4096, "unpack")):
                cuda_route.clear()
                layer(torch.randn(M, 512, dtype=torch.float16))
                assert cuda_route[-1][0] == want, M
    finally:
        config_store.clear_cache()


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_faster_measured_route_serves(quantize, cuda_route, tmp_path, monkeypatch):
    """Where this GPU's tuned entry measured both the prefill kernel (``kernel_us``) and the
    unpack route (``unpack_us``), the faster one runs, on either side of UNPACK_MIN_M (also as
    the nearest M bucket); unmeasured shapes keep the rule; config_store.clear_cache() forgets."""
    from sparse24.ops import config_store
    from sparse24.ops.config_space import KernelConfig
    from sparse24.tools import tuning
    layer = _layer(quantize)
    key = "int8-float16" if quantize else "float16"
    tuned = KernelConfig(128, 128, 64, 8, 1, 8, 3, kernel="prefill")
    tuning.write_entries(tmp_path, "Fake GPU H1", (9, 0), {
        (128, 256, 512, key): {"config": tuned, "kernel_us": 9.0, "dense_us": 2.0, "unpack_us": 4.0},
        (4096, 256, 512, key): {"config": tuned, "kernel_us": 3.0, "dense_us": 2.0, "unpack_us": 4.0}})
    monkeypatch.setenv("SPARSE24_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(config_store, "device_info", lambda device=None: config_store.DeviceInfo("Fake GPU H1", (9, 0)))
    config_store.clear_cache()
    try:
        with torch.no_grad():
            for M, want in ((100, "unpack"), (128, "unpack"), (4096, tuned), (3000, tuned)):
                cuda_route.clear()
                layer(torch.randn(M, 512, dtype=torch.float16))
                assert cuda_route[-1][0] == want, M
            tuning.write_entries(tmp_path, "Fake GPU H1", (9, 0), {
                (4096, 256, 512, key): {"config": tuned, "kernel_us": 5.0, "dense_us": 2.0, "unpack_us": 4.0}})
            config_store.clear_cache()
            cuda_route.clear()
            layer(torch.randn(4096, 512, dtype=torch.float16))
            assert cuda_route[-1][0] == "unpack"
    finally:
        config_store.clear_cache()


def test_the_byte_permute_fallback_fills_this_gpus_sms(monkeypatch):
    """On a GPU without sparse tensor cores an INT8 weight with 16-bit x at 16 rows or fewer takes
    the byte-permute kernel's built-in config, sized for this GPU's multiprocessors: it was sized
    for an H200's 132 on any GPU (a 40-SM T4 split 4096 x 4096 by 4: three kernels' worth of
    partial sums where one wave is already filled)."""
    from sparse24.ops.config_space import builtin_config
    monkeypatch.setattr(config_store, "device_info", lambda device=None: config_store.DeviceInfo("Old GPU", (7, 5), 40))
    monkeypatch.setattr(launch, "check_triton_for_gpu", lambda: None)
    config_store.clear_cache()
    try:
        key = (torch.device("cuda", 0), torch.float16, torch.uint8, 3, torch.float32, None, 4096, 4096, 16, False,
               False, None, 0, False)
        # past the config choice the plan allocates its split-K workspace on the GPU this machine lacks
        monkeypatch.setattr(launch, "_split_extra", lambda *a: ())
        plan = launch._Plan(key, None)
        want = builtin_config(16, 4096, 4096, 40, "decode", "int8-float32")
        assert want != builtin_config(16, 4096, 4096, 132, "decode", "int8-float32")
        assert plan.config == want
    finally:
        config_store.clear_cache()

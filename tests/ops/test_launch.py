"""The launch path: one plan per key, the kept compiled handle launched with
exactly the arguments Triton's own path would bind, and Triton's path taken
whenever the arguments would specialize differently. No GPU: the compiled
handle is a recording stand-in; Triton's launch convention is checked in its
source."""
import inspect

import pytest
import torch

import sparse24
from sparse24.ops import config_store
from sparse24.ops.linear24 import launch
from sparse24.ops.config_space import KernelConfig

from conftest import assert_matches_reference, load_script


class _Recorder:
    """Stands in for a CompiledKernel: records how it is launched."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], object(), object()

    def run(self, *a):
        self.calls.append(a)


class _TritonPath:
    """Stands in for ``kernel[grid](...)`` (Triton's own path): records and returns a handle."""

    def __init__(self, handle):
        self.calls, self.handle = [], handle

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.handle
        return launch_


class _CudaLooking(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` as a CUDA one does: what the kept handle's path
    asks of the weight's tensors before it passes their addresses (x's device is the plan's)."""

    @property
    def is_cuda(self):
        return True


def _cuda_looking(*tensors):
    return tuple(t.as_subclass(_CudaLooking) for t in tensors)


@pytest.fixture
def fake_cuda_plan(monkeypatch):
    """A plan for CPU tensors that takes the CUDA launch branch with stand-ins."""
    monkeypatch.setattr(launch, "_fast_launch_ok", lambda device_index: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    launch._PLANS.clear()
    yield
    launch._PLANS.clear()


def test_kept_handle_gets_triton_s_arguments_in_signature_order(fake_cuda_plan, gen):
    from sparse24.kernels.sparse24_matmul import sparse24_matmul

    N, K, M = 40, 64, 3
    p = sparse24.compress(torch.randn(N, K, generator=gen), quantize="int8")
    x, b = torch.randn(M, K, generator=gen), torch.randn(N, generator=gen)
    cfg = KernelConfig(16, 32, 32, split_k=1)
    launch.run(x, p.values, p.meta, p.scale, b, N, cfg)  # makes the plan (CPU: interpreter)
    (plan,) = launch._PLANS.values()
    handle = _Recorder()
    plan.cuda, plan.kernel = True, _TritonPath(handle)
    values, meta, scale, b = _cuda_looking(p.values, p.meta, p.scale, b)
    launch.run(x, values, meta, scale, b, N, cfg)  # first CUDA-branch call: Triton's path, handle kept
    assert len(plan.kernel.calls) == 1 and plan.compiled is handle and not handle.calls
    (grid, args, kwargs), = plan.kernel.calls
    out = launch.run(x, values, meta, scale, b, N, cfg)  # steady state: the kept handle
    assert len(plan.kernel.calls) == 1 and len(handle.calls) == 1
    gx, gy, gz, stream, function, packed, launch_meta, enter, exit_, *bound = handle.calls[0]
    assert (gx, gy, gz, stream) == (grid[0], grid[1], 1, 1234)
    assert function is handle.function and packed is handle.packed_metadata and launch_meta is enter is exit_ is None
    # Triton binds every parameter in signature order, constexprs included; the kept handle gets
    # each tensor as its address (Triton's launcher reads an int as the pointer itself)
    names = sparse24_matmul.arg_names
    expected = list(args) + [kwargs[n] for n in names[len(args):]]
    assert len(bound) == len(expected) == len(names)
    for name, a, e in zip(names, bound, expected):
        if name == "out_ptr":  # each call writes its own output: this call's
            assert a == out.data_ptr()
        elif isinstance(e, torch.Tensor):
            assert type(a) is int and a == e.data_ptr(), name
        else:
            assert a == e, name
    by_name = dict(zip(names, bound))
    assert by_name["x_ptr"] == x.data_ptr() and by_name["scale_ptr"] == p.scale.data_ptr()
    assert by_name["v_ptr"] == p.values.data_ptr() and by_name["bias_ptr"] == b.data_ptr()
    assert (by_name["M"], by_name["N"], by_name["K"]) == (M, N, K)
    assert (by_name["stride_xm"], by_name["stride_vn"], by_name["stride_mk"], by_name["stride_om"]) == \
        (K, K // 2, N, N)
    assert (by_name["BLOCK_N"], by_name["HAS_SCALE"], by_name["HAS_BIAS"]) == (32, True, True)
    assert out.shape == (M, N)


def test_unaligned_or_strided_input_takes_triton_s_path(fake_cuda_plan, gen):
    N, K = 40, 64
    p = sparse24.compress(torch.randn(N, K, generator=gen))
    cfg = KernelConfig(16, 32, 32)
    x = torch.randn(3, K, generator=gen)
    launch.run(x, p.values, p.meta, None, None, N, cfg)
    (plan,) = launch._PLANS.values()
    handle = _Recorder()
    plan.cuda, plan.kernel = True, _TritonPath(handle)
    values, meta = _cuda_looking(p.values, p.meta)
    launch.run(x, values, meta, None, None, N, cfg)
    assert plan.compiled is handle
    launch.run(x, values, meta, None, None, N, cfg)
    assert len(handle.calls) == 1                              # aligned and contiguous: the kept handle
    strided = torch.randn(K, 3, generator=gen).t()             # (3, K), strides (1, 3)
    shifted = torch.randn(3 * K + 1, generator=gen)[1:].view(3, K)  # 4-byte offset: not 16-byte aligned
    for bad in (strided, shifted):
        launch.run(bad, values, meta, None, None, N, cfg)
    assert len(handle.calls) == 1 and len(plan.kernel.calls) == 3
    (_, args, _) = plan.kernel.calls[1]
    assert args[9:11] == (1, 3)  # the strided input's real strides reach Triton


def test_a_weight_tensor_off_the_gpu_takes_triton_s_path(fake_cuda_plan, gen):
    """Passing addresses skips the check Triton's launcher makes of a tensor's (a host pointer
    is refused there: "cpu tensor?"), so a weight tensor that is not on CUDA, here the bias,
    goes to Triton's own path, which asks."""
    N, K = 40, 64
    p = sparse24.compress(torch.randn(N, K, generator=gen))
    cfg = KernelConfig(16, 32, 32)
    x, b = torch.randn(3, K, generator=gen), torch.randn(N, generator=gen)
    launch.run(x, p.values, p.meta, None, b, N, cfg)
    (plan,) = launch._PLANS.values()
    handle = _Recorder()
    plan.cuda, plan.kernel = True, _TritonPath(handle)
    values, meta, cuda_b = _cuda_looking(p.values, p.meta, b)
    launch.run(x, values, meta, None, cuda_b, N, cfg)
    launch.run(x, values, meta, None, cuda_b, N, cfg)
    assert len(handle.calls) == 1 and len(plan.kernel.calls) == 1
    launch.run(x, values, meta, None, b, N, cfg)               # the bias on the host
    assert len(handle.calls) == 1 and len(plan.kernel.calls) == 2
    assert plan.kernel.calls[1][1][4] is b                      # the tensor itself reaches Triton


def test_triton_s_launcher_takes_an_int_as_the_pointer_itself():
    """The kept handle passes addresses as ints: Triton's CUDA launcher (the C source it builds
    or ships) must take a Python int as the device pointer before it calls ``data_ptr()`` and
    ``cuPointerGetAttribute``. If a Triton changes that, fail here."""
    import os
    import re

    import triton
    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    src = "".join(open(os.path.join(nvidia, f)).read() for f in ("driver.c", "driver.py")
                  if os.path.exists(os.path.join(nvidia, f)))
    found = re.search(r"PyLong_Check\(obj\)\)\s*\{\{?\s*(?:ptr_info\.dev_ptr|\*dev_ptr)\s*=\s*"
                      r"PyLong_AsUnsignedLongLong\(obj\);\s*return[^;]*;", src)
    assert found is not None
    rest = src[found.end():]
    # tensors: asked after the int case (Triton 3.4 names the method "data_ptr" in place, later ones data_ptr_str)
    ask = min(i for i in (rest.find("data_ptr_str"), rest.find('"data_ptr"')) if i >= 0)
    assert ask < rest.index("cuPointerGetAttribute")


def test_triton_launches_compiled_kernels_as_the_fast_path_does():
    """The kept handle is launched the way Triton's JITFunction.run ends:
    ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
    launch_metadata, enter_hook, exit_hook, *bound_args.values())`` (Triton 3.3 to 3.9; the hooks live
    in ``triton.knobs`` from 3.4, and without knobs the fast path stays off). If Triton changes that,
    fail here."""
    import re

    from triton.runtime.jit import JITFunction

    src = " ".join(inspect.getsource(JITFunction.run).split())
    call = re.search(r"kernel\.run\(grid_0, grid_1, grid_2, stream, kernel\.function, kernel\.packed_metadata, "
                     r"launch_metadata, ([\w.]+), ([\w.]+), \*bound_args\.values\(\)\)", src)
    assert call is not None and "return kernel" in src
    if launch._triton_runtime_knobs() is None:
        assert call.groups() == ("self.CompiledKernel.launch_enter_hook", "self.CompiledKernel.launch_exit_hook")
    else:  # the hooks _fast_launch_ok checks are the ones Triton passes
        assert call.groups() == ("knobs.runtime.launch_enter_hook", "knobs.runtime.launch_exit_hook")


def test_launch_hooks_are_idle_by_default_and_busy_when_one_is_set(monkeypatch):
    """Triton >= 3.5 keeps an empty HookChain as its launch hooks: that is no hook, and the kept
    handle must be used (the first H200 run found every eager call on Triton's own path);
    a profiler's hook, added to the chain or set in its place, turns the fast path off."""
    runtime = launch._triton_runtime_knobs()
    if runtime is None:
        assert not launch._launch_hooks_idle()
        return
    assert launch._launch_hooks_idle()
    hook = lambda *args: None  # noqa: E731
    for name in ("launch_enter_hook", "launch_exit_hook"):
        chain = getattr(runtime, name)
        if hasattr(chain, "add"):
            chain.add(hook)
            try:
                assert not launch._launch_hooks_idle()
            finally:
                chain.remove(hook)
            assert launch._launch_hooks_idle()
        monkeypatch.setattr(runtime, name, hook)
        assert not launch._launch_hooks_idle()
        monkeypatch.undo()
        assert launch._launch_hooks_idle()


def test_one_plan_per_key_and_lookups_only_once(monkeypatch, gen):
    lookups = []
    real = launch.get_config
    monkeypatch.setattr(launch, "get_config", lambda *a: lookups.append(a) or real(*a))
    config_store.clear_cache()
    p = sparse24.compress(torch.randn(40, 64, generator=gen))
    w = p.to_dense()
    for M in (1, 1, 1, 3, 4, 5):  # buckets 1, 4, 4, 8
        x = torch.randn(M, 64, generator=gen)
        assert_matches_reference(launch.run(x, p.values, p.meta, None, None, 40), x, w)
    assert [a[0] for a in lookups] == [1, 4, 8]
    config_store.clear_cache()  # forgets the plans too
    launch.run(torch.randn(1, 64, generator=gen), p.values, p.meta, None, None, 40)
    assert [a[0] for a in lookups] == [1, 4, 8, 1]


@pytest.mark.parametrize("pair,act", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("int8", torch.float16),
                                      ("int8-bf16", torch.bfloat16), ("fp16", torch.float32)])
def test_one_kernel_per_decode_call(pair, act):
    """A decode-sized call (M <= 16) of a decode-layout weight, the launch stubbed, counted at
    the dispatcher: exactly one launch and one aten op (the output's allocation), also where
    the untuned config splits K (4096 x 4096: split-K 4 or 8, reduced inside the launch). The
    same counter sees the three kernels of the general kernel's atomic split-K."""
    from sparse24.decode_format import DecodePacked
    from sparse24.ops.linear24 import forward

    bench = load_script("bench_host")
    with bench.stubbed_launch() as launches, torch.no_grad():
        for N, K in ((4096, 4096), (768, 3072), (72, 200)):
            w = DecodePacked.empty(N, K, act if pair == "bf16" else torch.float16, pair.startswith("int8"))
            bias = torch.empty(N, dtype=act)
            for M in (1, 5, 16):
                x = torch.empty(M, K, dtype=act)
                kernels, ops = bench.device_work(lambda: forward(x, w.values, w.meta, w.scale, bias, w.dtype, N),
                                                 launches)
                assert (kernels, ops) == (1, ["empty"]), (N, K, M)
                plan, grid = launches[0]
                # (the sparse tensor-core kernel's grid is (row blocks, tiles, splits), the others' (tiles, splits, ...))
                splits = grid[2] if plan.variant is launch._DecodeSP else grid[1]
                assert splits == plan.split_k and (plan.split_k > 1 or (N, K) != (4096, 4096))
        p = sparse24.compress(torch.randn(64, 256).half())   # layout v1, the general kernel
        x = torch.randn(3, 256).half()
        kernels, ops = bench.device_work(lambda: launch.run(x, p.values, p.meta, None, None, 64,
                                                            KernelConfig(16, 32, 32, split_k=2)), launches)
        assert (kernels, ops) == (3, ["zeros", "_to_copy"])   # zeroed fp32 buffer, the kernel, the cast


def test_compile_figures_compile_each_default_into_an_empty_cache(monkeypatch):
    """bench_host.py --compile: each pair's untuned config (16 rows; 32 too where the sparse
    tensor-core route takes 17-64 rows) is compiled once, into its own empty Triton cache (a warm
    one would time a cache hit), the caller's cache setting restored; memory ops counted from the IR."""
    import os

    import sparse24.ops.linear24 as linear24

    bench = load_script("bench_host")
    seen = []

    class Compiled:
        asm = {"ttir": "%a = tt.load %p\ntt.store %q, %a\n%c = tt.atomic_rmw add, %r\n%d = tt.load_x"}

    def fake(x, w, bias, target, cfg, split_k, cap):
        d = os.environ["TRITON_CACHE_DIR"]
        assert os.path.isdir(d) and not os.listdir(d) and d not in seen and cap == (9, 0)
        seen.append(d)
        return Compiled()

    monkeypatch.setattr(linear24, "aot_compile", fake)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    rows = bench.compile_figures(4096, 4096)
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else" and len(seen) == len(rows)
    assert [(r["dtype"], r["rows"]) for r in rows] == [
        ("float16", 16), ("bfloat16", 16), ("int8-float16", 16), ("int8-float16", 32), ("int8-bfloat16", 16),
        ("int8-bfloat16", 32), ("int4-float16", 16), ("int4-float16", 32), ("int4-bfloat16", 16),
        ("int4-bfloat16", 32)]
    assert all(r["memory_ops"] == 3 and r["config"].block_m == (32 if r["rows"] == 32 else 16) for r in rows)


def test_a_gpu_launch_needs_a_triton_that_compiles_the_kernels(monkeypatch, gen):
    """Triton 3.3 fails to compile several kernels for a GPU (the sparse tensor-core kernel, INT8
    weights' decode and prefill kernels, the 16-bit prefill kernel at some shapes: a
    CompilationError or "PassManager::run failed" deep in Triton). With it a CUDA plan refuses
    at once, with the version needed and the way out; CPU runs (the interpreter) and Triton 3.4
    are untouched."""
    import triton
    w = torch.randn(64, 128, generator=gen)
    q8 = sparse24.pack_decode(sparse24.compress(w, quantize="int8"))
    cfg = KernelConfig(16, 64, 128, 8, 1, 4, 1, kernel="decode")
    key = (torch.device("cuda", 0), torch.float16, torch.int8, 3, torch.float32, None, 64, 128, 32, False, False, cfg,
           0, False)
    monkeypatch.setattr(triton, "__version__", "3.3.0")
    with pytest.raises(RuntimeError, match=r"GPU kernels need Triton >= 3\.4: Triton 3\.3\.0.*backend='reference'"):
        launch._Plan(key, cfg)
    x = torch.randn(20, 128)                                   # CPU: the interpreter, as before
    assert_matches_reference(launch.linear_prefill(x, q8, None, config=KernelConfig(128, 64, 64, 8, 1, 4, 2,
                                                                                    kernel="prefill")),
                             x, q8.to_dense().double())
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    launch.check_triton_for_gpu()



@pytest.mark.parametrize("weight,x_dtype,prefill", [
    ("v1", torch.float32, False), ("float16", torch.float16, False), ("int8", torch.float32, False),
    ("int4", torch.float32, False), ("int8", torch.float16, False), ("int4", torch.bfloat16, False),
    ("float16", torch.float16, True), ("int4", torch.float16, True)])
def test_kept_handle_binds_constexprs_in_signature_order(weight, x_dtype, prefill, gen):
    """A kept CUDA handle takes the constexprs positionally after the runtime arguments:
    each variant's (matmul, decode, sparse tensor-core, prefill; INT8 and INT4) must follow
    its kernel's signature, whatever order the variant builds them in (the decode kernel's
    INT4 parameters came last in its signature but in the middle of its dict: the first GPU
    run refused every decode plan)."""
    from sparse24.decode_format import pack_decode
    N, K = 64, 256
    w = torch.randn(N, K, generator=gen)
    p = sparse24.compress(w.half() if weight == "float16" else w)
    if weight in ("int8", "int4"):
        p = sparse24.quantize_values(p, weight, **({"group_size": 64} if weight == "int4" else {}))
    p = p if weight == "v1" else pack_decode(p)
    x = torch.randn(64 if prefill else 3, K, generator=gen).to(x_dtype)
    launch._PLANS.clear()
    (launch.run_prefill if prefill else launch.run)(x, p.values, p.meta, p.scale, None, N, None,
                                                   getattr(p, "zero", None), getattr(p, "group_size", 0) or 0)
    (plan,) = launch._PLANS.values()
    names = plan.variant.kernel(cuda=True).arg_names
    tail = tuple(names[len(names) - len(plan.constexprs):])
    assert tuple(plan.constexprs) == tail
    assert plan.constexpr_values == tuple(plan.constexprs[n] for n in tail)
    launch._PLANS.clear()


def test_constexprs_that_are_not_the_last_parameters_are_refused():
    assert launch._in_signature_order({"B": 2, "A": 1}, ["x", "A", "B"]) == {"A": 1, "B": 2}
    with pytest.raises(AssertionError, match="last parameters"):
        launch._in_signature_order({"A": 1, "x": 0}, ["x", "A", "B"])


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_strided_bias_scales_and_zero_points_read_right_on_every_route(quantize, gen):
    """The kernels read bias, scales and zero points as pointers at unit stride: a sliced bias
    (``fused_bias.view(-1, 3)[:, 0]``) or INT8 scale gave wrong outputs on every Triton route (errors of
    3-29 here), where the reference backend, CPU's default, was right. Against the fp64 product with
    the weight's exact (dequantized) values."""
    N, K = 64, 128
    kw = {"int4": dict(quantize="int4", group_size=32, symmetric=False), "int8": dict(quantize="int8")}
    p = sparse24.compress(torch.randn(N, K, generator=gen), **kw[quantize]) if quantize else \
        sparse24.compress(torch.randn(N, K, generator=gen).half())
    dense = p.to_dense().double()
    # the prefill kernel multiplies INT4 weights as (u - z) * s rounded once to x's dtype (to 64 rows the
    # sparse tensor-core kernel multiplies them exactly)
    operand = dense.half().double() if quantize == "int4" else dense
    bias = torch.randn(2 * N, generator=gen).half()[::2]

    def strided(t):   # the same values as a non-contiguous view
        return None if t is None else torch.stack((t, t), -1).select(-1, 0)

    d = sparse24.pack_decode(p)
    # the decode layout (which refuses strided INT4 scales itself) and layout v1 (INT4: re-ordered to the
    # decode layout on every call)
    weights = [d if quantize == "int4" else sparse24.DecodePacked(d.values, d.meta, d.shape, d.dtype,
                                                                  strided(d.scale), check=False),
               sparse24.Sparse24Tensor(p.values, p.meta, p.shape, p.dtype, strided(p.scale), zero=strided(p.zero),
                                       group_size=p.group_size)]
    for M in (3, 20):
        x = torch.randn(M, K, generator=gen).half()
        for w in weights:
            assert_matches_reference(sparse24.linear(x, w, bias, backend="triton"), x, dense, bias)
            if w.values.dim() != 2 and M > 16:
                assert_matches_reference(launch.linear_prefill(x, w, bias), x, operand, bias)
    u = launch.unpack_dense(d.values, d.meta, strided(d.scale), (N, K), torch.float16, zero=strided(d.zero),
                            group_size=d.group_size or 0)
    assert torch.equal(u, dense.half())   # the exact values rounded once


def test_only_a_split_k_with_a_workspace_runs_in_bucket_sized_chunks(gen):
    # the general kernel's split-K adds into its output: capping its rows at the bucket sent M > 4096
    # through Triton's slower launch path in 4096-row chunks, for no workspace at all
    p = sparse24.compress(torch.randn(64, 128, generator=gen).half())
    x = torch.randn(5000, 128, generator=gen).half()
    matmul = launch.plan_for(x, p.values, None, None, 64, 5000, KernelConfig(64, 64, 32, 1, 4, 4, 2))
    assert matmul.atomic_split and matmul.max_rows > 5000
    d = sparse24.pack_decode(p)
    prefill = launch.plan_for(x, d.values, None, None, 64, 5000, KernelConfig(64, 64, 64, 8, 4, 4, 2, kernel="prefill"))
    assert prefill.split_k == 4 and prefill.max_rows == 4096   # its workspace holds the bucket's rows

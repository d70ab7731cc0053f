"""The 2:4 Triton kernel, run on CPU tensors in Triton's interpreter (same
source the GPU compiles), against F.linear in fp64 on the masked dense weight.
Configs are pinned: the interpreter cannot time anything."""
import pytest
import torch

import sparse24
from sparse24.ops.linear24 import launch
from sparse24.ops.linear24 import linear_triton
from sparse24.tools.tuning import KernelConfig

from conftest import assert_matches_reference, matches_reference

# Pinned configs: several programs along M and N, several K-tiles with a
# partial last one, and split-K (including a split that owns no K-tile).
SMALL = KernelConfig(16, 32, 32, group_m=2)
TALL = KernelConfig(32, 16, 64, group_m=4)
SPLIT3 = KernelConfig(16, 32, 32, split_k=3)


def _case(M, N, K, dtype, bias, config, lead=None):
    ids = f"M{M}-N{N}-K{K}-{str(dtype)[6:]}-{'bias' if bias else 'nobias'}-{config.block_m}x{config.block_n}x" \
          f"{config.block_k}s{config.split_k}"
    return pytest.param(M, N, K, dtype, bias, config, id=ids)


@pytest.mark.parametrize("M,N,K,dtype,bias,config", [
    _case(1, 64, 64, torch.float32, True, SMALL),
    _case(13, 40, 100, torch.float16, False, SMALL),
    _case(67, 40, 160, torch.float32, True, TALL),
    _case(13, 64, 36, torch.float16, True, TALL),
    _case(13, 40, 160, torch.float16, True, SPLIT3),    # 5 K-tiles over 3 splits
    _case(1, 40, 100, torch.float32, False, SPLIT3),    # 4 K-tiles: split 2 owns none
])
def test_kernel_matches_reference(M, N, K, dtype, bias, config, gen):
    w = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    x = torch.randn(M, K, generator=gen).to(dtype)
    tri = linear_triton(x, sparse24.compress(w), b, config=config)
    assert tri.dtype == dtype and tri.shape == (M, N)
    assert_matches_reference(tri, x, w * sparse24.mask_nm(w), b)


def _tuning_tiles() -> list[KernelConfig]:
    """One config per distinct (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) the tuner may pick."""
    from sparse24.tools.tuning import candidate_configs
    seen = {}
    for M in (1, 16, 64, 256):
        for c in candidate_configs(M, 4096, 4096):
            seen.setdefault((c.block_m, c.block_n, c.block_k, c.split_k), c)
    return list(seen.values())


def test_every_tuning_tile_matches_reference(gen):
    # The GPU tuner picks among these; each must be right before device time is spent on it.
    # N = 72 and K = 200 leave ragged tiles and a partial metadata word; deep split-K leaves
    # splits with no K-tile (about 5 s in the interpreter).
    w = torch.randn(72, 200, generator=gen)
    p, dense = sparse24.compress(w), w * sparse24.mask_nm(w)
    b = torch.randn(72, generator=gen)
    for cfg in _tuning_tiles():
        x = torch.randn(5, 200, generator=gen)
        assert_matches_reference(linear_triton(x, p, b, config=cfg), x, dense, b)


def test_strided_and_3d_inputs(gen):
    w = torch.randn(40, 64, generator=gen).half()
    p, wm = sparse24.compress(w), w * sparse24.mask_nm(w)
    x2 = torch.randn(64, 13, generator=gen).half().t()             # (13, 64), strides (1, 13)
    x3 = torch.randn(2, 3, 80, generator=gen).half()[:, :, 8:72]  # (2, 3, 64), rows 80 apart
    for x in (x2, x3):
        assert not x.is_contiguous()
        tri = linear_triton(x, p, config=SMALL)
        assert tri.shape == (*x.shape[:-1], 40)
        assert_matches_reference(tri, x, wm)


def test_empty_batch(gen):
    p = sparse24.compress(torch.randn(40, 64, generator=gen))
    for lead in ((0,), (2, 0)):
        y = linear_triton(torch.randn(*lead, 64), p, torch.randn(40))
        assert y.shape == (*lead, 40) and y.dtype == torch.float32


def test_zero_features(gen):
    # K = 0 used to fail in x.reshape(-1, 0) before reaching the K = 0 branch; y = bias
    p = sparse24.compress(torch.randn(5, 0))
    b = torch.randn(5, generator=gen)
    y = linear_triton(torch.randn(2, 3, 0), p, b)
    assert y.shape == (2, 3, 5) and torch.equal(y, b.expand(2, 3, 5))


def test_mixed_weight_and_activation_dtypes(gen):
    w = torch.randn(40, 64, generator=gen)
    x = torch.randn(13, 64, generator=gen)
    # fp16 weight, fp32 activations: output fp32, weight values exact in fp32
    tri = linear_triton(x, sparse24.compress(w.half()), config=SMALL)
    assert tri.dtype == torch.float32
    assert_matches_reference(tri, x, (w.half() * sparse24.mask_nm(w.half())).float())
    # fp32 weight, fp16 activations: the weight is rounded to fp16 like the reference backend does
    tri = linear_triton(x.half(), sparse24.compress(w), config=SMALL)
    assert tri.dtype == torch.float16
    assert_matches_reference(tri, x.half(), (w * sparse24.mask_nm(w)).half())


def _int8_reference_weight(w: torch.Tensor) -> torch.Tensor:
    """Dequantized masked weight in fp64 from the quantization spec (symmetric
    per-row, scale = max|row| / 127 in fp32), independent of sparse24.quant."""
    wm = (w * sparse24.mask_nm(w)).float()
    scale = wm.abs().amax(dim=1) / 127
    q = torch.round(wm / scale[:, None]).clamp(-127, 127)
    return q.double() * scale.double()[:, None]


@pytest.mark.parametrize("dtype,config", [
    pytest.param(torch.float16, SMALL, id="fp16"),
    pytest.param(torch.float32, TALL, id="fp32"),
    pytest.param(torch.float16, SPLIT3, id="fp16-splitk"),
])
def test_int8_kernel_matches_dequantized_reference(dtype, config, gen):
    N, K = 40, 160
    w = torch.randn(N, K, generator=gen)
    p = sparse24.compress(w, quantize="int8")
    assert p.values.dtype == torch.int8
    x = torch.randn(13, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen)
    tri = linear_triton(x, p, b, config=config)
    assert tri.dtype == dtype
    assert_matches_reference(tri, x, _int8_reference_weight(w), b)
    # The reference backend agrees too; it computes in x's dtype, so its
    # dequantized weight and the bias are rounded to that dtype first (the
    # kernel keeps the int8 values exact and scales and adds bias in fp32).
    ref_backend = sparse24.linear(x, p, b, backend="reference")
    assert_matches_reference(ref_backend, x, _int8_reference_weight(w).to(dtype), b.to(dtype))


def test_backend_triton_on_cpu_uses_interpreter_with_default_config(gen):
    w = torch.randn(40, 100, generator=gen)
    x = torch.randn(3, 5, 100, generator=gen)
    b = torch.randn(40, generator=gen)
    assert_matches_reference(sparse24.linear(x, sparse24.compress(w), b, backend="triton"),
                             x, w * sparse24.mask_nm(w), b)


def test_a_wrong_slot_fails_the_check(gen):
    """The error bound is tight enough to catch one mis-decoded group, and the
    kernel really decodes the slots: with one group's slots changed it
    matches the dense weight those slots describe, not the original."""
    N, K = 40, 64
    w = torch.randn(N, K, generator=gen)
    p = sparse24.compress(w)
    # Row 5, group 3: move the kept pair to the two other slots.
    word, shift = 0, 4 * 3
    nib = (int(p.meta[word, 5]) >> shift) & 15
    lo, hi = nib & 3, nib >> 2
    others = [s for s in range(4) if s not in (lo, hi)]
    meta = p.meta.clone()
    meta[word, 5] = (int(meta[word, 5]) & ~(15 << shift)) | ((others[0] | others[1] << 2) << shift)
    bad = sparse24.Sparse24Tensor(p.values, meta, p.shape)  # valid slots, wrong positions
    x = torch.randn(13, K, generator=gen)
    tri = linear_triton(x, bad, config=SMALL)
    assert not matches_reference(tri, x, w * sparse24.mask_nm(w))
    assert_matches_reference(tri, x, bad.to_dense())


def test_deterministic_mode_disables_split_k(monkeypatch, gen):
    seen = []
    real = launch._Plan.launch
    monkeypatch.setattr(launch._Plan, "launch", lambda plan, grid, *a: seen.append(grid[1]) or real(plan, grid, *a))
    w, x = torch.randn(40, 64, generator=gen), torch.randn(3, 64, generator=gen)
    p = sparse24.compress(w)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        det = linear_triton(x, p, config=KernelConfig(16, 32, 32, split_k=2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [1]
    assert_matches_reference(det, x, w * sparse24.mask_nm(w))


def test_rejects_unsupported_input_and_changes_nothing(gen):
    w = torch.randn(40, 64, generator=gen)
    p = sparse24.compress(w)
    x = torch.randn(3, 64, generator=gen)
    saved = [t.clone() for t in (x, p.values, p.meta)]
    with pytest.raises(TypeError, match="supports x of dtype float16, bfloat16 or float32, got torch.float64; "
                                        "use backend='reference'"):
        linear_triton(x.double(), p.to(dtype=torch.float64))
    with pytest.raises(TypeError, match="interpreter, which has no bfloat16 arithmetic"):
        linear_triton(x.bfloat16(), p)
    with pytest.raises(TypeError, match="cannot read float64 weight values"):
        linear_triton(x, p.to(dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be floating point"):
        linear_triton(x.long(), p)
    with pytest.raises(ValueError, match="x has 32 features but the weight expects 64"):
        linear_triton(x[:, :32], p)
    with pytest.raises(ValueError, match="bad kernel config BLOCK_K=48: must be a power of two in \\[32, 512\\]"):
        linear_triton(x, p, config=KernelConfig(16, 32, 48))
    with pytest.raises(ValueError, match="bad kernel config BLOCK_M=8"):
        linear_triton(x, p, config=KernelConfig(8, 32, 32))
    with pytest.raises(TypeError, match="config must be a sparse24.ops.config_space.KernelConfig"):  # was AttributeError
        linear_triton(x, p, config={"BLOCK_M": 16})
    for before, after in zip(saved, (x, p.values, p.meta)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("x_dtype,int8,bias,split_k,cap", [
    pytest.param(torch.float16, False, False, 1, 90, id="fp16-sm90"),
    pytest.param(torch.bfloat16, True, True, 2, 80, id="bf16-int8-bias-splitk-sm80"),
])
def test_kernel_compiles_for_gpus(x_dtype, int8, bias, split_k, cap, monkeypatch):
    """No GPU here: compile the kernel ahead of time (Triton -> PTX -> cubin
    with the ptxas shipped in Triton's wheel), with the exact arguments the
    launcher passes, so code that passes in the interpreter also compiles."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its notice)
    w = torch.randn(64, 128).to(torch.float32 if int8 else x_dtype)
    p = sparse24.compress(w, quantize="int8" if int8 else None)
    x = torch.randn(16, 128).to(x_dtype)
    target = torch.empty(16, 64, dtype=torch.float32 if split_k > 1 else x_dtype)
    cfg = KernelConfig(16, 64, 128, split_k=split_k, num_warps=4, num_stages=3)
    b = torch.randn(64) if bias else None
    compiled = launch.aot_compile(x, p, b, target, cfg, split_k, (cap // 10, cap % 10))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "mma.sync" in ptx              # tensor-core dot, not an FMA loop
    assert "cp.async.cg.shared.global" in ptx                       # 16-byte pipelined tile loads
    if split_k > 1:
        assert "atom.global" in ptx or "red.global" in ptx



def _language_state(objs) -> dict:
    """Identity of every attribute of ``objs``."""
    return {(id(obj), name): id(value) for obj in objs for name, value in vars(obj).items()}


def test_interpreted_launch_leaves_no_trace_for_a_later_compile(tmp_path, monkeypatch, gen):
    """An interpreted launch used to leave 64 triton.language.core functions replaced by
    interpreter lambdas, so the next real compile of a kernel not in the cache failed
    ("'block_argument' object has no attribute 'dtype'"). Launch, then compile a kernel
    no cache has seen, in one process."""
    import importlib.util
    import sys

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparse24.kernels.interpreter import _patchable

    objs = _patchable()  # the triton.language modules, the classes they define, JITFunction
    before, modules = _language_state(objs), set(sys.modules)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(3, 64, generator=gen)
    assert_matches_reference(linear_triton(x, sparse24.compress(w), config=SPLIT3), x, w * sparse24.mask_nm(w))
    assert _language_state(objs) == before
    # A Triton module first imported while triton.language was patched would keep patched functions.
    assert not [m for m in set(sys.modules) - modules if m.startswith("triton")]

    # A kernel whose source exists nowhere else, compiled into an empty cache.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its notice)
    src = tmp_path / "fresh_kernel.py"
    src.write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def fresh(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        f"    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * {tmp_path.stat().st_ino}.0, mask=offs < n)\n")
    spec = importlib.util.spec_from_file_location("fresh_kernel", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ast = ASTSource(mod.fresh, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
    compiled = triton.compile(ast, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]

"""Which GPUs the compiled kernels run on (review): a ROCm build's GPUs (torch's "cuda" devices, but
the kernels are NVIDIA PTX), NVIDIA GPUs older than sm_70 (Triton compiles nothing for them), INT4
weights with bfloat16 x before sm_80 (ptxas rejects bf16x2), and the prefill kernel's untuned
config on GPUs with less shared memory than sm_90's. The device is simulated on CPU tensors: the
backend decision sees a CUDA-looking x (``scripts/bench_host.py``'s ``_AsCuda``), the store's
device query answers for the simulated GPU, ``torch.version.hip`` says whether torch is a ROCm build."""

import dataclasses
import types

import pytest
import torch

import sparse24
from sparse24.decode_format import pack_decode
from sparse24.nn.layout import LayoutMixin
from sparse24.ops import config_store
from sparse24.ops.config_space import KernelConfig
from sparse24.ops.linear24 import launch, op, prefill
from sparse24.ops.linear24.prefill import cost_key, prefill_config, prefill_costs, prefill_pair
from sparse24.tools.cli import main

from conftest import load_script

_AsCuda = load_script("bench_host")._AsCuda

N, K = 256, 512
MI300X = config_store.DeviceInfo("AMD Instinct MI300X", (9, 4), 304)
MI250X = config_store.DeviceInfo("AMD Instinct MI250X / MI250", (9, 0), 208)


def _weights():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    return {"fp16": pack_decode(sparse24.compress(w.half())),
            "int8": pack_decode(sparse24.compress(w, quantize="int8")),
            "int4": pack_decode(sparse24.compress(w.half(), quantize="int4", group_size=128))}


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(info, hip=None)``: CUDA devices answer as ``info`` (CPU ones as before), torch a ROCm
    build when ``hip`` is a version string; every cache made from the device forgotten."""
    real = config_store.device_info
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(op, "_triton_available", lambda: True)
    monkeypatch.delenv("SPARSE24_CONFIG_DIR", raising=False)

    def simulate(info, hip=None):
        def device_info(device=None):
            return info if device is None or torch.device(device).type == "cuda" else real(device)
        monkeypatch.setattr(config_store, "device_info", device_info)
        monkeypatch.setattr(torch.version, "hip", hip)
        config_store.clear_cache()
        op._AUTO.clear()
    yield simulate
    config_store.clear_cache()
    op._AUTO.clear()


def _route(x_dtype, M, d):
    return op._auto_backend(_AsCuda(torch.empty(M, K, dtype=x_dtype)), d.values, d.scale, N, d.group_size or 0)


def _wanted_layout(scale=None):
    """The layout a frozen float16 layer on cuda:0 holds (the module's rule, on a stand-in for its tensors)."""
    values = types.SimpleNamespace(requires_grad=False, is_meta=False, dtype=torch.float16, is_cuda=True,
                                   device=torch.device("cuda", 0))
    return LayoutMixin._wanted_layout(types.SimpleNamespace(values=values, scale=scale, _is_sharded=lambda: False))


def _refusal(x_dtype, d):
    x = _AsCuda(torch.empty(1, K, dtype=x_dtype))
    x.device = torch.device("cuda", 0)
    try:
        launch.check_triton_args(x, d)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("info, hip, runs", [
    pytest.param(MI300X, "6.2.41133", False, id="rocm-mi300x"),
    pytest.param(config_store.DeviceInfo("Tesla P100-PCIE-16GB", (6, 0), 56), None, False, id="pascal-p100"),
    pytest.param(config_store.DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132), None, True, id="nvidia-h100")])
def test_the_compiled_kernels_run_only_on_nvidia_gpus_from_sm70(gpu, info, hip, runs):
    """ROCm and Pascal: "auto" runs the reference (the kernels fail to compile there, or on ROCm an INT4
    kernel compiles with its mma.sp dropped: undefined outputs), a module holds layout v1, no sparse
    tensor cores, and backend="triton" is a ValueError saying why; an H100 keeps every route."""
    gpu(info, hip)
    weights = _weights()
    for kind, d in weights.items():
        for x_dtype in (torch.float16, torch.bfloat16, torch.float32):
            routes = {_route(x_dtype, M, d) for M in (1, 16, 32, 300)}
            assert (routes == {"reference"}) == (not runs), (kind, x_dtype, routes)
    assert _wanted_layout() == ("decode" if runs else "v1")
    assert launch.sparse_tensor_cores(torch.device("cuda", 0)) == runs
    assert launch.kernels_run_on(torch.device("cuda", 0)) == runs
    why = _refusal(torch.float16, weights["int4"])
    if runs:
        assert why is None
    else:
        assert "use backend='reference'" in why
        assert ("NVIDIA PTX" in why) == (hip is not None), why
        assert (hip is not None) or "compute capability 6.0" in why


@pytest.mark.parametrize("cap, runs", [((7, 5), False), ((7, 0), False), ((8, 0), True)])
def test_int4_weights_with_bfloat16_x_need_sm80(gpu, cap, runs):
    """T4 / V100: ptxas rejects the INT4 kernels' bf16x2 instructions: "auto" runs the reference at every
    M and backend="triton" says why; INT4 with float16 x and INT8 with bfloat16 x keep the kernels."""
    gpu(config_store.DeviceInfo("Tesla T4" if cap == (7, 5) else "GPU", cap, 40))
    weights = _weights()
    routes = {_route(torch.bfloat16, M, weights["int4"]) for M in (1, 32, 300)}
    assert (routes == {"reference"}) == (not runs), routes
    why = _refusal(torch.bfloat16, weights["int4"])
    assert (why is None) == runs
    if not runs:
        assert "INT4 weights with bfloat16 x need compute capability 8.0" in why and "backend='reference'" in why
    assert _route(torch.float16, 1, weights["int4"]) == "triton"
    assert _route(torch.bfloat16, 1, weights["int8"]) == "triton"
    assert _refusal(torch.float16, weights["int4"]) is None


def test_a_rocm_gpu_takes_no_nvidia_family_file(gpu):
    """ROCm's major.minor numbers AMD architectures: an MI250X reports 9.0, an H200's. The tuned-config
    lookup must not take the shipped H200 file as its family (an NVIDIA H100 does)."""
    key = (1, 4096, 4096, "float16")
    assert config_store.lookup(*key, MI250X.name, MI250X.capability, 208, "decode").kind == "builtin"
    assert config_store.lookup(*key, "NVIDIA H100 80GB HBM3", (9, 0), 132, "decode").kind == "family"
    gpu(MI250X, "6.2.41133")
    assert config_store.get_choice(*key, torch.device("cuda", 0), "decode").kind == "builtin"
    assert "same family" not in config_store.describe_config_source(torch.device("cuda", 0))
    gpu(dataclasses.replace(MI250X, name="NVIDIA H100 80GB HBM3"))
    assert config_store.get_choice(*key, torch.device("cuda", 0), "decode").kind == "family"
    assert "same family" in config_store.describe_config_source(torch.device("cuda", 0))


@pytest.mark.parametrize("name, cap, hip", [("AMD Instinct MI300X", (9, 4), "6.2.41133"),
                                            ("Tesla P100-PCIE-16GB", (6, 0), None)])
def test_info_says_the_compiled_kernels_do_not_run_there(gpu, monkeypatch, capsys, name, cap, hip):
    gpu(config_store.DeviceInfo(name, cap, 56), hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    triton = next(line for line in out.splitlines() if line.strip().startswith("triton "))
    assert "available: compiled kernel" not in out
    assert "unavailable on this GPU" in triton and "backend='auto' runs the reference" in triton, triton
    assert ("NVIDIA PTX" in triton) == (hip is not None)


# --- the prefill kernel's untuned config and the GPU's shared memory -------------------------------

# A Llama-7B's projections and a few smaller ones, at every M past 16 rows the route takes
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096), (3072, 768)]
MS = (17, 32, 64, 100, 128, 256, 1024, 4096)
H200 = ("No Tuned GPU", (9, 0), 132, 232448)


def _device(name, capability, sms, shared_memory=None):
    """A DeviceInfo; ``shared_memory``: the per-program limit torch reports (None: not reported)."""
    if shared_memory is None:
        return config_store.DeviceInfo(name, capability, sms)
    return config_store.DeviceInfo(name, capability, sms, shared_memory)


def _need(config, pair, fp32_x, capability):
    """Shared memory of a prefill launch as measured by compiling the kernels with Triton 3.9 (sm_90: the
    cost table's figure with 16-bit x; sm_8x at most that; float32 x its x tiles at 4 bytes a value and
    the weight tile once more as float32; before sm_80 no stages: the weight tile, and float32 x's, as
    float32; docs/kernels.md, "The GPU's shared memory")."""
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    if capability < (8, 0):
        return bn * bk * 4 + (bm * bk * 4 if fp32_x else 0)
    row = {r["cfg"]: r for r in prefill_costs()[pair]["configs"]}[cost_key(config)]
    return row["shared"] + (stages * bm * bk * 2 + bn * bk * 4 if fp32_x else 0)


def _default(dtype):
    return lambda M, N, K: launch._prefill_default(torch.device("cuda", 0), dtype, M, N, K)


@pytest.mark.skipif(prefill_costs() is None, reason="no cost table for the installed Triton")
def test_sm90_16bit_choices_are_unchanged(gpu):
    """On sm_90 (227 KiB a program) with float16 / bfloat16 x every table choice fits: the limit changes
    nothing (the choice without one, as before: the shipped H200 file's family entry where it has
    one, else the model's), whether the device reports its limit or not."""
    for info in (_device(*H200), _device(*H200[:3])):
        gpu(info)
        for pair in ("float16", "bfloat16", "int8-float16", "int8-bfloat16", "int4-float16", "int4-bfloat16"):
            pick = _default(pair)
            for N, K in SHAPES:
                for M in MS:
                    tuned = config_store.get_choice(M, N, K, pair, torch.device("cuda", 0), "decode", "prefill")
                    before = tuned.config if tuned.kind != "builtin" else prefill_config(M, N, K, 132, pair)
                    assert prefill_config(M, N, K, 132, pair, False, 232448, (9, 0)) \
                        == prefill_config(M, N, K, 132, pair), (pair, N, K, M)
                    assert pick(M, N, K) == before, (pair, N, K, M)


@pytest.mark.skipif(prefill_costs() is None, reason="no cost table for the installed Triton")
@pytest.mark.parametrize("info, limit", [
    pytest.param(("NVIDIA GeForce RTX 4090", (8, 9), 128, 101376), 101376, id="rtx4090"),
    pytest.param(("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912), 166912, id="a100"),
    pytest.param(("Tesla T4", (7, 5), 40, 65536), 65536, id="t4"),
    pytest.param(("NVIDIA GeForce RTX 3090", (8, 6), 82), 101376, id="rtx3090-unreported"),
    pytest.param(H200, 232448, id="h200")])
def test_untuned_prefill_configs_fit_the_gpus_shared_memory(gpu, info, limit):
    """Every untuned prefill config the route picks fits the device's per-program shared memory (Triton
    raises OutOfResources at each launch of one that does not), float32 x counted at four bytes a
    value (and its weight tile once more as float32); a device that does not report its limit gets
    NVIDIA's published one for its capability. (Before: sm_90's choices everywhere, e.g. 64 x 128 x 128
    on 4 stages at 64 rows, 102 KiB on an RTX 4090 with float16 x, 246 KiB on an A100 with float32 x.)"""
    info = _device(*info)
    gpu(info)
    for key in ("float16", "float32", "int8-float16", "int8-float32", "int4-float16", "int4-float32"):
        pick, pair, fp32_x = _default(key), prefill_pair(key), key.endswith("float32")
        for N, K in SHAPES:
            for M in MS:
                config = pick(M, N, K)
                need = _need(config, pair, fp32_x, info.capability)
                assert need <= limit, (key, N, K, M, config, need, limit)


def test_shared_need_counts_float32_x_and_older_gpus():
    """The measured figures (Triton 3.9, 64 x 128 x 128, 8 warps, 4 stages, fp16 weight): sm_86 104448 B
    (float16 x: under sm_90's table figure, 120832 B), sm_80 / sm_86 251904 B (float32 x), sm_75 65536 /
    98304 B (no stages before sm_80)."""
    config, shared_need = KernelConfig(64, 128, 128, 8, 1, 8, 4, kernel="prefill"), prefill.shared_need
    assert shared_need(config, 120832) == shared_need(config, 120832, capability=(8, 6)) == 120832
    assert shared_need(config, 120832, fp32_x=True, capability=(8, 0)) == 251904
    assert shared_need(config, 120832, capability=(7, 5)) == 65536
    assert shared_need(config, 120832, fp32_x=True, capability=(7, 5)) == 98304


@pytest.mark.skipif(prefill_costs() is None, reason="no cost table for the installed Triton")
def test_where_no_config_fits_the_one_that_needs_least():
    """A limit nothing fits (here 1 KiB) still gives a config, the one that needs least; and a limit
    below a choice's need moves it to one that fits."""
    for M in (17, 64, 512):
        free = prefill_config(M, 4096, 4096, 132, "float16", True)
        tight = prefill_config(M, 4096, 4096, 132, "float16", True, 1024, (8, 6))
        assert _need(tight, "float16", True, (8, 6)) <= _need(free, "float16", True, (8, 6))
        limit = _need(free, "float16", True, (8, 6)) - 1
        fits = prefill_config(M, 4096, 4096, 132, "float16", True, limit, (8, 6))
        assert fits != free and _need(fits, "float16", True, (8, 6)) <= limit


@pytest.mark.parametrize("info, hip", [pytest.param(MI300X, "6.2.41133", id="rocm-mi300x"),
                                       pytest.param(config_store.DeviceInfo("Tesla P100", (6, 0), 56), None,
                                                    id="pascal-p100")])
def test_tuning_refuses_a_gpu_the_kernels_do_not_run_on(gpu, info, hip):
    # `sparse24 autotune` compiled every candidate there: Triton errors deep inside, or (ROCm, INT4) a kernel
    # with its mma.sp dropped
    from sparse24.tools import tuning
    gpu(info, hip)
    with pytest.raises(ValueError, match="tuning: .*use backend='reference'"):
        tuning.tune_key(16, N, K, "float16", "cuda:0")


def test_the_bench_skips_the_triton_providers_where_the_kernels_do_not_run(gpu):
    # it would have hit kernel_refusal's ValueError mid-sweep instead of skipping them with the reason
    from sparse24.tools.bench import provider_status
    gpu(MI300X, "6.2.41133")
    cuda = torch.device("cuda", 0)
    for name in ("sparse24-triton", "sparse24-int8-triton", "sparse24-int4-triton"):
        assert "use backend='reference'" in provider_status(name, cuda, torch.float16)
    assert provider_status("sparse24-auto", cuda, torch.float16) == ""   # (auto runs the reference there)
    gpu(config_store.DeviceInfo("Tesla T4", (7, 5), 40))
    assert provider_status("sparse24-int4-triton", cuda, torch.float16) == ""
    assert "need compute capability 8.0" in provider_status("sparse24-int4-triton", cuda, torch.bfloat16)


@pytest.mark.parametrize("setting", ["new", "generic", "legacy", "high"])
def test_tf32_switch_read_through_torchs_new_api(setting):
    """With torch's new TF32 setting (fp32_precision, torch >= 2.9) set, reading the legacy allow_tf32 raises
    ("a mix of the legacy and new APIs"): every float32 CUDA call of the Triton path did."""
    from sparse24.ops.linear24 import launch
    matmul, backends = torch.backends.cuda.matmul, torch.backends
    saved = matmul.fp32_precision, backends.fp32_precision
    try:
        if setting == "new":
            matmul.fp32_precision = "tf32"
        elif setting == "generic":
            backends.fp32_precision = "tf32"
        elif setting == "legacy":
            matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision("high")
        assert launch.tf32_matmul() is True

        class CudaX:  # what plan_for reads of x before any CUDA work: a (4, 64) float32 CUDA tensor
            is_cuda, dtype, device, shape = True, torch.float32, torch.device("cuda"), torch.Size((4, 64))

        p = sparse24.compress(torch.randn(32, 64))
        try:
            launch.plan_for(CudaX(), p.values, None, None, 32, 4)
        except RuntimeError as e:   # (no GPU here: the plan's own CUDA work fails, after the TF32 read)
            assert "legacy" not in str(e) and "new API" not in str(e), e
        except (AttributeError, TypeError, AssertionError):
            pass
    finally:
        matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        backends.fp32_precision, matmul.fp32_precision = saved[1], saved[0]
    assert launch.tf32_matmul() is False

"""``sparse24::linear``: the 2:4 linear layer as a registered torch op, and the
dispatch every caller goes through.

* The op (``torch.ops.sparse24.linear``) is what torch.compile, torch.export
  and autograd see: a fake (meta) kernel for tracing, a backward formula
  (:func:`~sparse24.ops.linear24.naive.linear_backward_reference`), one
  implementation for every device (Triton on CUDA, the reference on CPU unless
  asked otherwise). Config selection happens inside it, never in traced code.
  FlopCounterMode counts it as the dense ``F.linear`` it equals (``2 * M * N * K``:
  :func:`_linear_flops`); its backward runs aten matmuls, counted as they run.
* :func:`linear` (``sparse24.linear``) and the modules call the op only when
  something needs it (a gradient, or torch.compile tracing); otherwise they call
  the implementation directly: the op's Python dispatch costs more host time
  than a decode-sized kernel runs.
"""
from __future__ import annotations

import importlib.machinery
import math
import sys

import torch

from ...decode_format import DecodePacked
from ...format import Sparse24Tensor, has_tangent
from ..config_space import DECODE_M, decode_rows, dtype_key, m_bucket, sp_tunable
from ..config_store import get_choice, measured_timings, on_clear
from . import launch
from .naive import check_linear_args, grad_rows, linear_backward_reference, linear_reference, on_jagged

__all__ = ["linear", "choose_backend", "forward", "BACKENDS", "KERNEL_DTYPES"]

BACKENDS = ("auto", "reference", "triton")
KERNEL_DTYPES = launch.SUPPORTED_DTYPES
# At decode sizes (M <= DECODE_M) the kernel streams the weight once; the
# reference backend decompresses the whole weight every call, so "auto" never
# picks it there.


@torch.library.custom_op("sparse24::linear", mutates_args=())
def _linear_op(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None,
               zero: torch.Tensor | None, bias: torch.Tensor | None, weight_dtype: torch.dtype, backend: str,
               out_features: int, group_size: int) -> torch.Tensor:
    """``(..., K) -> (..., N)`` with W ``(N, K)`` given by its compressed tensors in
    either layout (v1: ``values (N, K/2)`` or INT4 ``(N, K/4)``, ``meta (ceil(K/32), N)``;
    the decode layout: :class:`~sparse24.decode_format.DecodePacked`'s tensors),
    ``scale`` (INT8 ``(N,)``, INT4 ``(N, ceil(K/group_size))``) or None, INT4 ``zero`` or
    None, its logical dtype, ``out_features`` = N and the INT4 ``group_size`` (0: not INT4)."""
    return _compute(x, values, meta, scale, zero, bias, weight_dtype, backend, out_features, group_size)


@_linear_op.register_fake
def _(x, values, meta, scale, zero, bias, weight_dtype, backend, out_features, group_size):
    per_column = 4 if group_size else 2  # dense columns per stored column of values
    if values.dim() == 2 and x.shape[-1] != per_column * values.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {per_column * values.shape[1]}")
    return x.new_empty(*x.shape[:-1], out_features)


def _setup_context(ctx, inputs, output):
    x, values, meta, scale, zero, bias, weight_dtype, backend, out_features, group_size = inputs
    ctx.weight_dtype, ctx.shape, ctx.group_size = weight_dtype, (out_features, x.shape[-1]), group_size
    ctx.bias_dtype = None if bias is None else bias.dtype
    need = ctx.needs_input_grad
    # The weight's tensors only for x's or the values' gradient: the bias's needs none of them, and
    # torch refuses to save inference tensors (a layer compressed under torch.inference_mode, run outside
    # it with a trainable bias, as nn.Linear runs)
    weight = (values, meta, scale, zero) if need[0] or need[1] else (None,) * 4
    ctx.save_for_backward(x if need[1] else None, *weight)


def _backward(ctx, grad_y):
    x, values, meta, scale, zero = ctx.saved_tensors
    need = ctx.needs_input_grad
    if not (need[0] or need[1]):   # the bias's gradient alone (no weight tensor saved)
        grad_bias = grad_rows(grad_y, ctx.shape[0]).sum(0).to(ctx.bias_dtype) if need[5] else None
        return None, None, None, None, None, grad_bias, None, None, None, None
    if need[1] and values.dim() != 2:
        raise RuntimeError("gradients for the kept values need layout v1 (trainable values stay in layout v1)")
    p = _weight(values, meta, scale, zero, ctx.group_size, ctx.weight_dtype, ctx.shape)
    grad_x, grad_values, grad_bias = linear_backward_reference(grad_y, x, p, need[0], need[1], need[5],
                                                               ctx.bias_dtype)
    return grad_x, grad_values, None, None, None, grad_bias, None, None, None, None


torch.library.register_autograd("sparse24::linear", _backward, setup_context=_setup_context)


def _linear_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``sparse24::linear`` call for ``torch.utils.flop_counter``: the dense-equivalent
    ``2 * M * N * K`` that FlopCounterMode counts for ``F.linear`` (and for this layer's no-grad path,
    plain aten ops) and that ``sparse24.tools.bench`` reports: the kernels expand each 2:4 tile and
    run dense dot products. Without it the op counts 0 (FlopCounterMode never sees inside it)."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * out_shape[-1]


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    # the check: a second registration raises, and importlib.reload of this module (or a second
    # import hook) runs this again; a reload re-creates the op, whose new packet is not yet listed
    if torch.ops.sparse24.linear not in flop_registry:
        register_flop_formula(torch.ops.sparse24.linear)(_linear_flops)


class _AfterFlopCounterImport:
    """Registers :func:`_linear_flops` right after ``torch.utils.flop_counter`` is imported (before
    any FlopCounterMode exists: each copies the registry when created). Importing it here would
    import triton (the module imports ``triton.runtime.jit``), and ``import sparse24`` stays light.
    A meta-path finder that wraps the module's loader; it stays, for an import that failed once
    and a reload (which builds a new registry)."""
    NAME = "torch.utils.flop_counter"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        # (the path finder itself: a new loader each time, and no second pass through this one)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _register_flops()
            spec.loader.exec_module = exec_module
        return spec


if _AfterFlopCounterImport.NAME in sys.modules:
    _register_flops()
# (one finder, also where flop_counter came first: a reload of it builds a new registry; and where this
# module is reloaded, the one installed before stays, which reads this module's new globals)
if not any(type(f).__name__ == _AfterFlopCounterImport.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterFlopCounterImport())


def _weight(values, meta, scale, zero, group_size, weight_dtype, shape) -> Sparse24Tensor | DecodePacked:
    """The op's weight tensors as the :class:`Sparse24Tensor` or :class:`DecodePacked` they are, never
    re-ordered whole: the reference forward and its x-gradient decompress a decode-layout weight a
    block of 128-row tiles at a time (``DecodePacked.to_dense(rows=)``)."""
    if group_size and scale.dtype == torch.bfloat16:   # a module's exact bfloat16 copy (nn/layout.py)
        scale = scale.half()
    cls = Sparse24Tensor if values.dim() == 2 else DecodePacked
    return cls(values, meta, shape, weight_dtype, scale, zero=zero, group_size=group_size or None, check=False)


def _compute(x, values, meta, scale, zero, bias, weight_dtype, backend, out_features, group_size):
    if backend == "auto":
        backend = _auto_backend(x, values, scale, out_features, group_size)
    if backend == "triton":
        return launch.run(x, values, meta, scale, bias, out_features, None, zero, group_size)
    if backend == "unpack" and (bias is None or bias.dtype == x.dtype):  # "auto" only, as "prefill"
        return unpack_linear(x, values, meta, scale, zero, group_size, bias, out_features)
    if backend in ("prefill", "unpack"):  # chosen by "auto" only: the decode layout at M > 16 on CUDA
        return launch.run_prefill(x, values, meta, scale, bias, out_features, None, zero, group_size)
    return linear_reference(x, _weight(values, meta, scale, zero, group_size, weight_dtype,
                                       (out_features, x.shape[-1])), bias)


def kernel_plan(x, values, scale, bias, out_features: int, zero=None, group_size: int = 0):
    """The launch plan (:func:`launch.plan_for`) that :func:`forward` runs for these arguments
    when it takes the kernel through :func:`launch.run` with 16-bit x (``backend="auto"`` choosing
    ``"triton"``, no autograd, not traced, the decode layout, M > 0), else None. Valid for later
    calls whose tensors, x's shape, dtype and device, the grad and tracing state, torch's
    deterministic switch and ``launch.PLAN_EPOCH`` are the same (the modules' fast path)."""
    if values.dim() == 2 or x.dtype not in (torch.float16, torch.bfloat16) or _needs_op(x, values, bias, scale):
        return None
    M = x.shape[0] if x.dim() == 2 else x.shape[:-1].numel()
    if M == 0 or out_features == 0 or x.shape[-1] == 0 \
            or _auto_backend(x, values, scale, out_features, group_size) != "triton":
        return None
    return launch.plan_for(x, values, scale, bias, out_features, M, None, zero, group_size)


def counting_flops() -> bool:
    """Whether torch's FlopCounterMode is active: it counts the registered op (:func:`_linear_flops`),
    where the kernel's launch is no aten op at all (0 FLOPs). Other dispatch modes (sparse24's own
    dispatch counter, debug modes) see the path a call takes without them."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return any(type(m).__module__ == _AfterFlopCounterImport.NAME for m in _get_current_dispatch_mode_stack())


def _needs_op(x, values, bias, scale=None) -> bool:
    """Only gradients, tracing and FLOP counting need the registered op (and torch.func, forward-mode
    AD and a trainable scale a pure-torch path: :func:`_pure_torch`). torch.jit.trace too: it records
    the op (the reference's ``view(torch.uint8)`` of the weight's bytes fails torch's tracer)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _pure_torch(x, values, bias, scale) \
            or counting_flops():
        return True
    return torch.is_grad_enabled() and (x.requires_grad or values.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _pure_torch(x, values, bias, scale) -> bool:
    """Calls that only the pure-torch reference differentiates: torch.func (jvp, grad, jacrev, vmap:
    through the registered op jvp's tangent came out all zeros, without a word, and grad raised),
    forward-mode AD (the op has no forward formula, and the kernel none at all) and a scale that
    requires grad (the op's backward gives x, the values and the bias theirs)."""
    return torch._C._are_functorch_transforms_active() or has_tangent(x, values, bias, scale) \
        or (scale is not None and scale.requires_grad and torch.is_grad_enabled())


def forward(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None,
            bias: torch.Tensor | None, weight_dtype: torch.dtype, out_features: int,
            backend: str = "auto", zero: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """:func:`linear` for callers whose weight tensors are valid by construction
    (the modules), in either layout: ``x`` is checked by the caller, the weight
    is not. Shapes as in :func:`linear`; ``zero`` and ``group_size`` (0: not INT4)
    as in :class:`~sparse24.format.Sparse24Tensor`."""
    if _needs_op(x, values, bias, scale):
        if _pure_torch(x, values, bias, scale):
            return _compute(x, values, meta, scale, zero, bias, weight_dtype, "reference", out_features, group_size)
        return torch.ops.sparse24.linear(x, values, meta, scale, zero, bias, weight_dtype, backend, out_features,
                                         group_size)
    return _compute(x, values, meta, scale, zero, bias, weight_dtype, backend, out_features, group_size)


def linear(x: torch.Tensor, p: Sparse24Tensor | DecodePacked, bias: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``y = x @ W^T + bias`` for a compressed 2:4 weight W.

    Differentiable in ``x``, ``p.values`` (when it requires grad) and ``bias``;
    traceable by torch.compile (``fullgraph=True``) and torch.export, which see
    the registered op ``torch.ops.sparse24.linear``. Under torch.func, forward-mode
    AD (dual tensors) or with a ``p.scale`` that requires grad, the pure-torch
    reference runs whatever ``backend`` says (it differentiates every input,
    the scales too; the kernels and the op's backward do not).

    Args:
        x: ``(..., K)`` floating input, any number of leading dims (M = 0 allowed),
            or a nested tensor of layout ``torch.jagged`` (a strided one: TypeError).
        p: :class:`Sparse24Tensor` of logical shape ``(N, K)``, or the same weight in
            the decode layout (:class:`~sparse24.decode_format.DecodePacked`, what the
            decode kernel reads; the modules hold it on CUDA).
        bias: ``(N,)`` or None.
        backend: ``"auto"`` (see :func:`choose_backend`), ``"reference"``
            or ``"triton"`` (interpreted on CPU tensors; a ValueError on a GPU the kernels do not
            run on: ROCm, compute capability below 7.0, INT4 weights with bfloat16 x below 8.0).
    Returns:
        ``(..., N)`` in x's dtype; equals ``F.linear(x, p.to_dense(), bias)``.
    Example:
        >>> p = sparse24.compress(torch.randn(64, 32))
        >>> linear(torch.randn(3, 32), p).shape
        torch.Size([3, 64])
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if isinstance(x, torch.Tensor) and x.is_nested:
        return on_jagged(x, lambda v: linear(v, p, bias, backend))
    check_linear_args(x, p, bias)
    if backend == "triton":
        launch.check_triton_args(x, p)
    return forward(x, p.values, p.meta, p.scale, bias, p.dtype, p.shape[0], backend, getattr(p, "zero", None),
                   getattr(p, "group_size", None) or 0)


def choose_backend(x: torch.Tensor, p: Sparse24Tensor | DecodePacked) -> str:
    """The backend ``"auto"`` runs for ``x`` and ``p``: the Triton kernel for
    fp16/bf16/fp32 x on an NVIDIA GPU of compute capability 7.0 or later (8.0 for INT4 weights
    with bfloat16 x; never on ROCm: the kernels are NVIDIA PTX); at M > 16, ``"prefill"`` (the prefill kernel,
    :func:`~sparse24.ops.linear24.launch.linear_prefill`) for a decode-layout
    weight, or from :data:`UNPACK_MIN_M` rows ``"unpack"`` (:func:`prefill_backend`;
    a call with a bias of another dtype than x runs the prefill kernel), and for layout v1 the reference backend (row-block decompression +
    cuBLAS) instead where this GPU's tuned file measured it faster than the
    kernel; the reference everywhere else (CPU, fp64, no triton, the GPUs above that the kernels
    do not run on)."""
    return _auto_backend(x, p.values, p.scale, p.shape[0], getattr(p, "group_size", None) or 0)


_AUTO: dict = {}
on_clear(_AUTO.clear)


def _auto_backend(x: torch.Tensor, values: torch.Tensor, scale, out_features: int, group_size: int = 0) -> str:
    if not (x.is_cuda and x.dtype in KERNEL_DTYPES and _triton_available()) \
            or launch.kernel_refusal(x.device, x.dtype, group_size > 0) is not None:
        # (a ROCm GPU, an NVIDIA GPU older than sm_70, INT4 weights with bfloat16 x before sm_80:
        # the compiled kernels do not run there)
        return "reference"
    if group_size and values.dim() == 2:
        # INT4 in layout v1: only the decode-layout kernels read INT4, and re-ordering the
        # whole weight every call costs about what the reference's decompression does
        # (the modules hold INT4 in the decode layout on CUDA).
        return "reference"
    M = x.shape[0] if x.dim() == 2 else x.shape[:-1].numel()
    if M <= DECODE_M:
        return "triton"
    if values.dim() != 2:
        dt = dtype_key(x.dtype, scale is not None)   # (INT4 keys as INT8's)
        if launch.sp_serves(x.dtype, values.dtype, scale is not None, x.device) \
                and (decode_rows(M, dt) == 32 or sp_tunable(M, dt) and _sp_tuned(x, out_features, M, dt)):
            # INT8 / INT4 with 16-bit x, or a 16-bit weight of x's dtype that this GPU's tuned entry
            # gave the sparse tensor-core kernel: 32 rows per program (config_space.SP_MAX_M says why).
            return "triton"
        # The decode layout (the one copy a module holds on CUDA): the prefill kernel decodes
        # each weight tile once per 128 rows, or from UNPACK_MIN_M rows one launch unpacks the
        # weight into a shared dense scratch for cuBLAS; the reference would decompress the whole
        # weight, 128 rows at a time, on every call.
        return _prefill_route(x, values, scale, out_features, group_size, M)
    key = (x.device, x.dtype, scale is not None, values.dim(), out_features, x.shape[-1], m_bucket(M))
    choice = _AUTO.get(key)
    if choice is None:
        layout = launch.layout_of(values)
        choice = _AUTO[key] = faster_backend(measured_timings(M, out_features, x.shape[-1],
                                                              dtype_key(x.dtype, scale is not None), x.device,
                                                              layout), layout, M)
    return choice


# Measured on an H200 (results/NVIDIA_H200/probe_prefill.csv: 4096x4096, 11008x4096, 4096x11008,
# fp16 and INT8 weights, fp16 x): from 256 rows the unpack kernel + cuBLAS beat the prefill kernel
# in 17 of the 18 cases (fp16: 0.37-0.91x of dense against 0.16-0.41x; INT8 0.33-0.90x against
# 0.24-0.37x, the prefill kernel ahead only at 4096x4096 and 256 rows, 63 against 72 us; the unpack
# costs 20-60 us a layer whatever M); at 64 rows the prefill kernel won in all 6 (0.52-0.95x
# against 0.15-0.42x).
UNPACK_MIN_M = 256


def _sp_tuned(x, out_features: int, M: int, dtype: str) -> bool:
    """Whether this GPU's tuned entry for the shape at M's bucket (exact, or tuned live) chose the
    sparse tensor-core kernel's 32 rows over the prefill kernel (the tuner times both:
    config_space.sp_tunable), once per key."""
    key = ("sp", x.device, dtype, out_features, x.shape[-1], m_bucket(M))
    chosen = _AUTO.get(key)
    if chosen is None:
        choice = get_choice(M, out_features, x.shape[-1], dtype, x.device, "decode", "decode")
        chosen = _AUTO[key] = choice.kind in ("exact", "live") and choice.config.kernel == "decode" \
            and choice.config.block_m == 32
    return chosen


def _prefill_route(x, values, scale, out_features: int, group_size: int, M: int) -> str:
    """:func:`prefill_backend` with this GPU's measurement for the shape, once per key."""
    key = ("prefill", x.device, x.dtype, values.dtype, scale is not None, group_size, out_features, x.shape[-1],
           m_bucket(M), M >= UNPACK_MIN_M)
    choice = _AUTO.get(key)
    if choice is None:
        timings = {}
        if launch.half_pair(x.dtype, values.dtype, scale is not None):
            timings = measured_timings(M, out_features, x.shape[-1],
                                       dtype_key(x.dtype, scale is not None, group_size > 0), x.device, "decode",
                                       "prefill")
        choice = _AUTO[key] = prefill_backend(M, x.dtype, values.dtype, scale is not None, timings)
    return choice


def prefill_backend(M: int, x_dtype: torch.dtype, values_dtype: torch.dtype, has_scale: bool,
                    timings: dict | None = None) -> str:
    """The decode layout's route past decode sizes on CUDA: ``"unpack"`` (the weight unpacked
    dense into a shared scratch in x's dtype, then cuBLAS) or ``"prefill"`` (the prefill
    kernel). Where :func:`~sparse24.ops.linear24.launch.half_pair`: the faster of the two where this GPU's tuned entry
    for the shape measured both (``timings``: ``kernel_us`` of the prefill kernel and
    ``unpack_us``, from :func:`~sparse24.ops.config_store.measured_timings`), else the unpack
    route from :data:`UNPACK_MIN_M` rows. 16-bit and INT4 weights give the kernels' products
    exactly (INT4's dot operand is already its dequantized value rounded once to x's dtype);
    INT8's dequantized value q * s is rounded once to x's dtype there (relative 2**-12 float16,
    2**-9 bfloat16, as a dense copy in that dtype holds it), where the kernels apply the fp32
    row scale after the dot: measured on an H200, 0.69-0.90x of dense from 1024 rows against
    the prefill kernel's 0.24-0.37x."""
    if not launch.half_pair(x_dtype, values_dtype, has_scale):
        return "prefill"
    if timings and "unpack_us" in timings and "kernel_us" in timings:
        return "unpack" if timings["unpack_us"] < timings["kernel_us"] else "prefill"
    return "unpack" if M >= UNPACK_MIN_M else "prefill"


def unpack_linear(x, values, meta, scale, zero, group_size, bias, out_features):
    """``x @ W^T + bias`` on the weight unpacked dense (``launch.unpack_dense``), the unpack route.

    x: ``(..., K)`` float16 / bfloat16; values, meta, scale, zero: a decode-layout ``(N, K)``
    weight (``sparse24.decode_format``) where :func:`~sparse24.ops.linear24.launch.half_pair`: 16-bit
    of x's dtype, INT8 or INT4 (``group_size`` > 0); bias: ``(N,)`` of x's dtype or None (the caller runs the prefill
    kernel otherwise: it adds a bias of another dtype before its one rounding); out_features: N.
    Returns ``(..., N)`` of x's dtype: one unpack launch and one ``mm`` / ``addmm``."""
    K = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    with launch.SCRATCH_LOCK:   # the unpack and the matmul reading the shared scratch, queued together
        wt = launch.unpack_dense(values, meta, scale, (out_features, K), x.dtype, transpose=True, zero=zero,
                                 group_size=group_size)   # (K, N) view
        y = torch.mm(x2, wt) if bias is None else torch.addmm(bias, x2, wt)   # one aten op (and cuBLAS kernel)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


# Unmeasured, the decode kernel (which re-decodes the weight for every 16 rows of x)
# serves up to this many rows; above, the reference backend (decompression + cuBLAS).
# (``sparse24.linear``'s "auto" runs the prefill kernel for a decode-layout weight
# at M > 16 before asking this.)
DECODE_KERNEL_MAX_M = 64


def faster_backend(timings: dict, layout: str = "v1", M: int = 1) -> str:
    """``"reference"`` where a tuned entry measured it faster than the kernel, else ``"triton"``;
    with no measurement, the reference for a decode-layout weight past
    :data:`DECODE_KERNEL_MAX_M` rows (the tuner's comparison of the decode kernel)."""
    if "reference_us" in timings and "kernel_us" in timings:
        return "reference" if timings["reference_us"] < timings["kernel_us"] else "triton"
    return "reference" if layout == "decode" and M > DECODE_KERNEL_MAX_M else "triton"


def _triton_available() -> bool:
    if not _TRITON:
        try:
            import triton  # noqa: F401
            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


_TRITON: list = []

"""Launching the 2:4 Triton kernels (``kernels/``): argument checks, the
config choice, and a launch path that costs one dict lookup per call.

Kernel variants: ``sparse24_matmul`` reads layout v1
(:class:`~sparse24.format.Sparse24Tensor`); at M <= 16 the decode layout
(:class:`~sparse24.decode_format.DecodePacked`, the layout the modules hold on
CUDA) runs ``sparse24_decode`` (16-bit weights, and any weight with fp32 x) or
``sparse24_sp`` (INT8 / INT4 weights with fp16 / bf16 x, on the sparse tensor
cores); above 16 rows ``sparse24_prefill``. Each keeps within the sm_90
instruction budget where docs/kernels.md says so.

``linear_triton(x, w, bias)``: (1) checks, (2) finds the call's *plan* (kernel
variant, config, split-K, grid shape) in a dict keyed by (device, dtypes,
layout, bias/scale, N, K, M bucket, ...), making it on the first call of that
key (the only time tuned files are read or devices queried), (3) allocates the
output, (4) launches: compiled on CUDA tensors, through Triton's interpreter on
CPU tensors (same kernel source).

On CUDA the first launch of a plan goes through Triton's ``kernel[grid](...)``
(compile or disk-cache load, argument binding: ~29 us of host time per call in
Triton 3.9) and keeps the compiled kernel it returns; later calls launch that
handle directly (``CompiledKernel.run``, the call Triton itself ends with),
which is valid as long as Triton would specialize the arguments the same way:
contiguous, 16-byte aligned tensors (then every integer argument is fixed by
N and K, which are in the key, and M is never specialized). Anything else
(strided input, an unaligned view, a launch hook, another current device)
takes Triton's own path.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import torch

from ...decode_format import DecodePacked, check_word_aligned, decode_dims, pack_decode
from ...format import Sparse24Tensor
from ..config_space import (DECODE_M, LAYOUT_KERNEL, SPLIT_K_MAX_M, KernelConfig, builtin_config, check_decode_config,
                            check_prefill_runs, dtype_key, fp32_twin, m_bucket, sparse_kernel)
from .. import config_store
from ..config_store import get_choice, get_config, on_clear
from .naive import check_linear_args
from .prefill import natural_tile, untuned_prefill

__all__ = ["linear_triton", "linear_prefill", "check_triton_args", "kernel_call", "aot_compile", "layout_of",
           "target_dtype", "kernels_run_on", "kernel_refusal",
           "SUPPORTED_DTYPES"]

# tl.dot takes fp16/bf16/fp32 operands; fp64 has no tensor-core path, so
# float64 inputs are rejected here (backend="reference" computes them).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def layout_of(values: torch.Tensor) -> str:
    """``"v1"`` for layout v1's ``(N, K/2)`` values, ``"decode"`` for the decode layout's."""
    return "v1" if values.dim() == 2 else "decode"


def check_triton_args(x: torch.Tensor, p: Sparse24Tensor | DecodePacked) -> None:
    """Raise a clear error for inputs the Triton kernels cannot compute."""
    try:
        import triton  # noqa: F401  (once imported: a dict lookup)
    except ImportError:
        raise RuntimeError("backend='triton' needs the triton package (Linux; pip install triton); "
                           "use backend='reference' or backend='auto'") from None
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"backend='triton' supports x of dtype float16, bfloat16 or float32, got {x.dtype}; "
                        f"use backend='reference' for {x.dtype}")
    if x.device.type == "cpu":
        if x.dtype == torch.bfloat16:
            # numpy has no bfloat16, so Triton's interpreter cannot compute it.
            raise TypeError("backend='triton' on CPU tensors runs Triton's interpreter, which has no bfloat16 "
                            "arithmetic; use float16/float32 on CPU, backend='reference', or a CUDA device")
    elif x.device.type != "cuda":
        raise ValueError(f"backend='triton' needs CUDA or CPU tensors, got device {x.device}")
    else:
        why = kernel_refusal(x.device, x.dtype, getattr(p, "group_size", None) is not None)
        if why is not None:
            raise ValueError(f"backend='triton' cannot run here: {why}")
    if p.scale is None and p.values.dtype == torch.float64:
        raise TypeError("backend='triton' cannot read float64 weight values; cast the weight with "
                        "p.to(dtype=torch.float32) or use backend='reference'")


def linear_triton(x: torch.Tensor, p: Sparse24Tensor | DecodePacked, bias: torch.Tensor | None = None, *,
                  config: KernelConfig | None = None) -> torch.Tensor:
    """``y = x @ W^T + bias`` with the compressed 2:4 Triton kernel of W's layout.

    The kernel reads W only compressed (values + 2-bit slots or keep masks),
    expands each tile in registers, accumulates in fp32, applies the INT8
    scale (if ``p.scale`` is set) and the bias in the epilogue, and writes x's dtype.

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, any leading dims (M = 0
            allowed), any strides. CUDA tensors run compiled; CPU tensors run
            in Triton's interpreter (float16/float32 only; slow, for tests).
        p: ``(N, K)``: a :class:`Sparse24Tensor` (float16/bfloat16/float32 values,
            or int8 values with ``(N,)`` float32 scales; the ``matmul`` kernel) or a
            :class:`DecodePacked` (float16/bfloat16, INT8 or INT4; the ``decode`` kernel).
            An INT4 :class:`Sparse24Tensor` is re-ordered to the decode layout on every
            call (only the decode kernels read INT4): pack it once with ``pack_decode``.
        bias: ``(N,)`` or None, any float dtype (added in fp32).
        config: a :class:`~sparse24.ops.config_space.KernelConfig` of the weight's
            kernel variant to pin; default: the tuned-config lookup
            (:mod:`sparse24.ops.config_store`).
    Returns:
        ``(..., N)`` in x's dtype.
    Raises:
        TypeError: float64 (or integer) x, bfloat16 x on CPU, float64 weight values.
        ValueError: a config of the other kernel variant, bad shapes, a GPU the kernels do not
            run on (ROCm, compute capability below 7.0; INT4 weights with bfloat16 x below 8.0:
            :func:`kernel_refusal`).
    Example:
        Not run as a test: needs a CUDA GPU.

        >>> p = sparse24.compress(torch.randn(64, 128, device="cuda", dtype=torch.float16))  # doctest: +SKIP
        >>> linear_triton(torch.randn(4, 128, device="cuda", dtype=torch.float16), p).shape  # doctest: +SKIP
        torch.Size([4, 64])
    """
    check_linear_args(x, p, bias)
    check_triton_args(x, p)
    if config is not None:
        _config_type(config)
        layout = "v1" if isinstance(p, Sparse24Tensor) and p.group_size is None else "decode"
        if config.kernel != LAYOUT_KERNEL[layout]:
            raise ValueError(f"a {type(p).__name__} weight runs the {LAYOUT_KERNEL[layout]!r} kernel, got a config "
                             f"for {config.kernel!r}")
        config.validate() if layout == "v1" else check_decode_config(config)
    return run(x, p.values, p.meta, p.scale, bias, p.shape[0], config, p.zero, p.group_size or 0)


def _config_type(config) -> KernelConfig:
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a sparse24.ops.config_space.KernelConfig, got {type(config).__name__}")
    return config


def linear_prefill(x: torch.Tensor, p: DecodePacked, bias: torch.Tensor | None = None, *,
                   config: KernelConfig | None = None) -> torch.Tensor:
    """``y = x @ W^T + bias`` with the prefill kernel (``kernels/sparse24_prefill.py``):
    W in the decode layout, each weight tile decoded once per ``config.block_m``
    rows of x. What ``sparse24.linear`` runs for M > 16 on CUDA.

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32 (CPU: float16/float32, in
            Triton's interpreter), any leading dims and strides.
        p: :class:`DecodePacked` ``(N, K)`` (float16/bfloat16, INT8 or INT4 values).
        bias: ``(N,)`` or None (added in fp32).
        config: a ``kernel="prefill"`` :class:`KernelConfig`; default
            :func:`~sparse24.ops.linear24.prefill.prefill_config` for x's rows
            (at 16 rows or fewer, its 17-row config).
    Returns:
        ``(..., N)`` in x's dtype.
    Raises:
        TypeError: a layout-v1 weight, float64 x, bfloat16 x on CPU.
        ValueError: bad shapes or config, a GPU the kernels do not run on (:func:`kernel_refusal`).
    Example:
        >>> d = sparse24.pack_decode(sparse24.compress(torch.randn(64, 128).half()))
        >>> linear_prefill(torch.randn(40, 128).half(), d).shape
        torch.Size([40, 64])
    """
    if not isinstance(p, DecodePacked):
        raise TypeError(f"the prefill kernel reads the decode layout (sparse24.pack_decode), got {type(p).__name__}")
    check_linear_args(x, p, bias)
    check_triton_args(x, p)
    if config is not None:
        check_prefill_runs(_config_type(config))
    return run_prefill(x, p.values, p.meta, p.scale, bias, p.shape[0], config, p.zero, p.group_size or 0)


def run_prefill(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None, N: int, config: KernelConfig | None = None,
                zero: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """:func:`run` with the prefill kernel (arguments already checked, decode-layout
    tensors), unless ``config`` is given: this GPU's tuned prefill config for the shape
    (``sparse24 autotune`` past 16 rows), else the untuned
    :func:`~sparse24.ops.linear24.prefill.prefill_config` for x's rows, the weight kind and
    x's dtype on x's device's SMs."""
    if config is None:
        M = x.shape[0] if x.dim() == 2 else x.shape[:-1].numel()
        config = _prefill_default(x.device, dtype_key(x.dtype, scale is not None, group_size > 0), M, N, x.shape[-1])
    return run(x, values, meta, scale, bias, N, config, zero, group_size)


@functools.lru_cache(maxsize=4096)
def _prefill_default(device: torch.device, dtype: str, M: int, N: int, K: int) -> KernelConfig:
    """This GPU's tuned prefill config for the shape (exact, nearest M or its family's entry),
    else the model's choice for exactly these M rows (a tuned file is cached per M bucket) among the
    configs that fit the device's shared memory (float32 x counted at four bytes a value).
    Cached here, off the per-call path (the store's lookup takes ~17 us a call); forgotten
    with the store's cache."""
    choice = get_choice(M, N, K, dtype, device, "decode", "prefill")
    if choice.kind != "builtin":
        return choice.config
    info = config_store.device_info(device)
    return untuned_prefill(M, N, K, dtype, info.num_sms, config_store.shared_memory_limit(info), info.capability)


on_clear(_prefill_default.cache_clear)


def run(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None,
        bias: torch.Tensor | None, N: int, config: KernelConfig | None = None, zero: torch.Tensor | None = None,
        group_size: int = 0) -> torch.Tensor:
    """The launch behind :func:`linear_triton`, for arguments already checked
    (the registered op and the modules call it directly); W's layout is read
    off ``values`` (:func:`layout_of`), N is its logical rows. Shapes as there;
    INT4 (``group_size`` > 0): ``scale`` and ``zero`` (or None) of the weight's layout
    (a layout-v1 INT4 weight is re-ordered to the decode layout first, every call).
    Every line here runs on every call: each costs 0.1-2 us of host time."""
    if group_size and values.dim() == 2:
        d = pack_decode(Sparse24Tensor(values, meta, (N, x.shape[-1]), torch.float32, scale, zero=zero,
                                       group_size=group_size, check=False))
        values, meta, scale, zero = d.values, d.meta, d.scale, d.zero
    K = x.shape[-1]
    flat = x.dim() == 2
    M = x.shape[0] if flat else x.shape[:-1].numel()
    if M == 0 or N == 0 or K == 0:
        out = x.new_zeros(*x.shape[:-1], N)
        return out if bias is None or M == 0 else out.add_(bias.to(out.dtype))
    plan = plan_for(x, values, scale, bias, N, M, config, zero, group_size)
    if flat:
        return plan(x, values, meta, scale, bias, M, zero)
    return plan(x.reshape(M, K), values, meta, scale, bias, M, zero).view(*x.shape[:-1], N)


# Options of every compile of our kernels: FP fusion (fma) stated, not left to Triton's default, which
# Triton 3.9 warns will turn off in 3.10 (the kernels' instruction budgets, docs/kernels.md, count fmas).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def tf32_matmul() -> bool:
    """torch's matmul TF32 switch (``torch.backends.cuda.matmul``), read through ``fp32_precision`` where
    torch has it: after a user set that (or ``torch.backends.fp32_precision``), reading the legacy
    ``allow_tf32`` raises ("a mix of the legacy and new APIs"); it also reflects the legacy flag and
    ``torch.set_float32_matmul_precision("high")``."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(torch.backends.cuda.matmul.allow_tf32)


def plan_for(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, N: int,
             M: int, config: KernelConfig | None = None, zero: torch.Tensor | None = None,
             group_size: int = 0) -> "_Plan":
    """The plan :func:`run` launches for these arguments and ``M`` (> 0) rows of x, made on the
    first call of its key. A caller may keep it and call it again for arguments that give the same
    key while :data:`PLAN_EPOCH` is unchanged (the modules' fast path does)."""
    # fp32 dots follow torch's own matmul TF32 switch (off by default, so fp32
    # results match F.linear); half types ignore it.
    tf32 = x.dtype == torch.float32 and x.is_cuda and tf32_matmul()
    key = (x.device, x.dtype, values.dtype, values.dim(), None if scale is None else scale.dtype,
           None if bias is None else bias.dtype, N, x.shape[-1], m_bucket(M),
           torch.are_deterministic_algorithms_enabled(), tf32, config, group_size, zero is not None)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(key, config)
    return plan


_PLANS: dict = {}
on_clear(_PLANS.clear)  # sparse24.ops.config_store.clear_cache() forgets the plans made from its lookups
# Bumped whenever a kept plan may no longer be what plan_for would make (configs re-read, workspaces
# released): a plan kept outside _PLANS is valid only while this is unchanged.
PLAN_EPOCH = [0]


def _next_epoch() -> None:
    PLAN_EPOCH[0] += 1


on_clear(_next_epoch)


class _Plan:
    """Everything about a launch that is fixed for one key: the kernel, its
    config, split-K, the constexprs, and (CUDA) the compiled kernel handle."""

    def __init__(self, key, config: KernelConfig | None):
        device, x_dtype, values_dtype, values_dim, scale_dtype, bias_dtype, N, K, bucket, deterministic, tf32, _, \
            group_size, has_zero = key
        has_scale = scale_dtype is not None
        if scale_dtype == torch.bfloat16 and not (group_size and x_dtype == torch.bfloat16):
            # (a module's exact copy of INT4 scales, passed only with bfloat16 x: nn/layout.py)
            raise ValueError(f"bfloat16 scales are read only for INT4 weights with bfloat16 x; got "
                             f"{'INT4' if group_size else 'INT8'} weights and {x_dtype} x")
        layout = "v1" if values_dim == 2 else "decode"
        if config is not None and (config.kernel == "matmul") != (layout == "v1"):
            # internal callers pass configs unchecked: a kernel reading the other layout's
            # bytes would compute garbage, silently (once per plan, not per call)
            raise ValueError(f"a {config.kernel!r} config cannot read a layout-{layout} weight "
                             f"(layout v1: 'matmul'; decode layout: 'decode' or 'prefill')")
        if device.type == "cuda":
            check_triton_for_gpu()
        sparse_cores = sparse_tensor_cores(device)
        if config is None:
            key = dtype_key(x_dtype, has_scale, group_size > 0)
            config = get_config(bucket, N, K, key, device, layout)
            if config.kernel == "decode" and (config.block_m == 32 or sparse_kernel(key)) \
                    and not sp_serves(x_dtype, values_dtype, has_scale, device):
                # a sparse-kernel config for a 16-bit weight of the other 16-bit dtype than x, or on a GPU
                # without sparse tensor cores: the byte-permute kernel's (the builtin config of the
                # key's float32-x twin, which that kernel serves)
                config = builtin_config(bucket, N, K, config_store.device_info(device).num_sms, layout, fp32_twin(key))
        self.config, self.variant = config, variant_of(config, x_dtype, has_scale, values_dtype, sparse_cores)
        self.variant.check_config(config)
        self.split_k = self.variant.split_k(config, bucket, deterministic)
        self.kernel = self.variant.kernel(device.type == "cuda")
        self.constexprs = _in_signature_order(
            self.variant.constexprs(config, self.split_k, has_scale, values_dtype, bias_dtype is not None, tf32, K,
                                    group_size, has_zero, bucket), self.variant.kernel(cuda=True).arg_names)
        # the kept handle binds them positionally, after the runtime arguments
        self.constexpr_values = tuple(self.constexprs.values())
        self.options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **COMPILE_OPTIONS}
        self.N, self.device, self.cuda, self.device_index = N, device, device.type == "cuda", device.index
        # the integer arguments of contiguous tensors: fixed by N and K
        self.contiguous_ints = self.variant.contiguous_ints(N, K, has_scale)
        self.max_rows = self.variant.max_rows(N, config)
        self.atomic_split = _atomic_split(config, self.split_k)
        if self.split_k > 1 and not self.atomic_split:
            # the split-K workspace holds the bucket's rows (M past the last bucket: chunks); the general
            # kernel's split-K adds into the output and needs none
            self.max_rows = min(self.max_rows, bucket)
        # the variant's extra tensors (decode: split-K workspace and counters, kept for the process)
        self.extra = self.variant.extra(device, N, config, self.split_k, bucket)
        self.extra_ptrs = tuple(t.data_ptr() for t in self.extra)   # (the plan keeps the tensors alive)
        # its launches use the device's shared split-K workspace: one stream at a time (follow_last_stream)
        self.shares = self.split_k > 1 and not self.atomic_split
        self.compiled = None
        # per call, only what varies: the grid per M (a few buckets' rows), whether the kernel takes
        # INT4 zero points, whether x needs preparing (host time is what a decode-sized call costs)
        self.grids: dict = {}
        self.takes_zero = bool(self.variant.zero_arg(None))
        self.prepares_x = self.variant.prepare_x is not _as_is
        if device.type == "cuda" and x_dtype == torch.float32 and layout == "decode":
            warnings.warn(f"sparse24: float32 activations on a "
                          f"{values_dtype if not has_scale else 'INT4' if group_size else 'INT8'} "
                          f"decode-layout weight ({N}x{K}) run fp32 dots on CUDA cores (about 5-7x the decode "
                          f"path's instruction budget, docs/kernels.md); for the tensor-core path cast the "
                          f"activations once (e.g. model.half() or torch.autocast)", RuntimeWarning, stacklevel=5)

    def __call__(self, x2, values, meta, scale, bias, M, zero=None):
        if self.shares:
            with SCRATCH_LOCK:
                # (the common case, the same stream as the last launch, inline: host time is what a
                # decode call costs)
                if self.cuda and _LAST_STREAM.get(self.device_index, _NO_STREAM)[0] \
                        != torch._C._cuda_getCurrentRawStream(self.device_index):
                    follow_last_stream(self.device)
                return self._run(x2, values, meta, scale, bias, M, zero)
        return self._run(x2, values, meta, scale, bias, M, zero)

    def _run(self, x2, values, meta, scale, bias, M, zero=None):
        if self.prepares_x:
            x2 = self.variant.prepare_x(x2)
        if not self.atomic_split:  # one launch writes x's dtype (decode split-K reduces in the kernel)
            # (sizes as arguments, not a tuple: ~1 us less of torch's argument parsing here)
            target = torch.empty(M, self.N, dtype=x2.dtype, device=self.device)
        else:  # the general kernel's split-K adds fp32 partial sums into a zeroed buffer
            target = torch.zeros(M, self.N, dtype=torch.float32, device=self.device)
        s = meta if scale is None else scale  # never read when there is no scale / bias / zero point
        b = meta if bias is None else bias
        zt = meta if zero is None else zero  # INT4 zero points (never read without them)
        z = (zt,) if self.takes_zero else ()  # an argument of the decode kernels only
        if x2.is_contiguous() and values.is_contiguous() and meta.is_contiguous() and s.is_contiguous() \
                and b.is_contiguous() and zt.is_contiguous():
            px, pv, pm, ps, pb, pz = (x2.data_ptr(), values.data_ptr(), meta.data_ptr(), s.data_ptr(), b.data_ptr(),
                                      zt.data_ptr())
            aligned = (px | pv | pm | ps | pb | pz) % 16 == 0
            if aligned and self.compiled is not None and M <= self.max_rows and values.is_cuda and meta.is_cuda \
                    and s.is_cuda and b.is_cuda and zt.is_cuda and _fast_launch_ok(self.device_index):
                # The kept handle, pointers passed as the integers just read: Triton's launcher takes
                # an int as the address itself, where for a tensor it calls data_ptr() again and asks
                # the driver (cuPointerGetAttribute) whether the address is a device one, per pointer
                # (the is_cuda checks above stand for that question; x's device is the plan's).
                grid = self._grid(M)
                c = self.compiled
                c.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(self.device_index), c.function,
                      c.packed_metadata, None, None, None, px, pv, pm, ps, *((pz,) if self.takes_zero else ()), pb,
                      target.data_ptr(), *self.extra_ptrs, M, *self.contiguous_ints, *self.constexpr_values)
                return target if not self.atomic_split else target.to(x2.dtype)
            args = (x2, values, meta, s, *z, b, target, *self.extra, M, *self.contiguous_ints)
        else:
            # the kernels read bias, scales and zero points at unit stride (a sliced bias gave wrong outputs)
            s, b = s.contiguous(), b.contiguous()
            z = tuple(t.contiguous() for t in z)
            args = self.variant.args(x2, values, meta, s, b, target, M, self.extra, z)
            aligned = False
        if not aligned:  # off the fast path only: 16-byte aligned pointers are word-aligned
            self.variant.check_alignment(values, meta)
        if M <= self.max_rows:
            self.launch(self._grid(M), args, aligned)
        else:  # the grid would pass CUDA's limits: one launch per row chunk (Triton's path)
            for r0, r1 in grid_chunks(M, self.max_rows):
                self.launch(self.variant.grid(r1 - r0, self.N, self.config, self.split_k),
                            self.variant.args(x2[r0:r1], values, meta, s, b, target[r0:r1], r1 - r0, self.extra, z),
                            False)
        return target if not self.atomic_split else target.to(x2.dtype)  # the same tensor when x is fp32

    def _grid(self, M: int) -> tuple:
        """The launch grid for ``M`` rows (at most ``max_rows``), made once per M."""
        grid = self.grids.get(M)
        if grid is None:
            grid = self.grids[M] = self.variant.grid(M, self.N, self.config, self.split_k)
        return grid

    def launch(self, grid, args, aligned: bool) -> None:
        """Launch once through Triton's own path (the kept compiled handle runs in ``__call__``);
        keep the handle it returns when the arguments specialize as the handle's later calls
        will (``aligned``: contiguous, 16-byte aligned tensors) and launching it directly is
        right (:func:`_fast_launch_ok`)."""
        fast = aligned and self.cuda and _fast_launch_ok(self.device_index)
        with torch.cuda.device(self.device_index) if self.cuda else contextlib.nullcontext():
            compiled = self.kernel[grid](*args, **self.constexprs, **self.options)
        if fast and self.compiled is None:
            self.compiled = compiled


def _in_signature_order(constexprs: dict, arg_names) -> dict:
    """``constexprs`` reordered as the kernel's signature lists them; they must be its
    trailing parameters, since a kept handle appends their values after the runtime ones."""
    tail = tuple(arg_names[len(arg_names) - len(constexprs):])
    if set(tail) != set(constexprs):
        raise AssertionError(f"constexprs {sorted(constexprs)} are not the kernel's last parameters {tail}")
    return {n: constexprs[n] for n in tail}


def _fast_launch_ok(device_index) -> bool:
    """Whether launching a kept handle directly is right now (see the module docstring)."""
    if not _launch_hooks_idle():
        return False  # a profiler's launch hooks must see every launch: Triton's own path calls them
    return torch._C._cuda_getDevice() == device_index


def _launch_hooks_idle() -> bool:
    """Whether Triton's launch hooks are unset: None, or (Triton >= 3.5) an empty ``HookChain``,
    which Triton keeps there by default. (Reading only None as unset kept every eager call on
    Triton's own launch path: ~80 us a call against nn.Linear's ~26 us on an H200.)"""
    runtime = _triton_runtime_knobs()
    return runtime is not None and _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


_RUNTIME_KNOBS = []


def _triton_runtime_knobs():
    """``triton.knobs.runtime`` (Triton >= 3.4), or None: no fast path without it."""
    if not _RUNTIME_KNOBS:
        try:
            from triton import knobs
            _RUNTIME_KNOBS.append(knobs.runtime)
        except ImportError:
            _RUNTIME_KNOBS.append(None)
    return _RUNTIME_KNOBS[0]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# CUDA's grid limits: x up to 2**31 - 1 programs, y and z up to 65535.
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)


def grid_chunks(M: int, rows: int) -> list[tuple[int, int]]:
    """``[(r0, r1), ...]``: M rows cut into consecutive launches of at most ``rows`` rows
    (the launches' counterpart of :func:`.naive.row_chunks`, which bounds dense memory)."""
    return [(r0, min(M, r0 + rows)) for r0 in range(0, M, rows)]


def _atomic_split(config: KernelConfig, split_k: int) -> bool:
    """Whether the splits meet by fp32 atomic adds in a zeroed buffer (the general kernel's
    split-K; the decode kernel's reduces inside its launch)."""
    return config.kernel == "matmul" and split_k > 1


def target_dtype(config: KernelConfig, split_k: int, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the ``target`` a launch of ``config`` writes: x's, except the
    general kernel's split-K, which adds fp32 partial sums into a zeroed buffer."""
    return torch.float32 if _atomic_split(config, split_k) else x_dtype


# Split-K workspaces (decode and prefill kernels), per device: the latest is the largest,
# and every plan made since takes it (fp32 partials and int32 arrival counters). Never freed, so
# a CUDA graph that captured a launch keeps valid pointers; a plan holds the one it was made with.
# Launches on one stream run one after another and each leaves its counters at zero, so plans
# share it; a launch on another stream first waits for the last one's (follow_last_stream).
# Growing by at least twice keeps all of them under twice the largest need (the partials and the
# counters each).
_WORKSPACES: dict = {}


def decode_workspace(device, N: int, config: KernelConfig, split_k: int, bucket: int = DECODE_M,
                     block_m: int = 16) -> tuple:
    """``(workspace, counters)`` of the split-K inside one launch for up to ``bucket`` rows of x, in
    blocks of ``block_m`` rows (the decode kernels: 16, to SPLIT_K_MAX_M rows; the prefill
    kernel: its BLOCK_M): fp32 partials, at least ``(tiles, split_k, BLOCK_N, block_m)``, and
    int32 arrival counters, at least ``(tiles, split_k)`` (the decode kernels use one per tile,
    the prefill kernel's tree one per node), zero between launches, one tile per BLOCK_N
    rows of W and block of x (tiles = ceil(N / BLOCK_N) * ceil(bucket / block_m), the kernels'
    grid without its split-K axis): the device's shared pair, grown where this plan needs
    more; ``(None, None)`` without split-K."""
    if split_k == 1:
        return None, None
    tiles = _cdiv(N, config.block_n) * _cdiv(bucket, block_m)
    floats = tiles * split_k * config.block_n * block_m
    device = torch.device(device)
    old = ws, counts = _WORKSPACES.get(device, (None, None))
    # each grows on its own (more counters need not double the partials' buffer)
    ws = _grown(ws, floats, lambda n: persistent(torch.float32, n, device))
    # zeroed before any stream can launch on them (a zero_() queued on this caller's stream left another
    # thread's stream free to launch first, and a fill landing mid-kernel left a counter non-zero for good)
    counts = _grown(counts, tiles * split_k, lambda n: persistent(torch.int32, n, device, zero=True))
    # an outgrown pair stays alive: a CUDA graph captured with a plan that used it writes it on every
    # replay, even once that plan is gone (config_store.clear_cache()); geometric growth bounds them
    # below the current pair's size
    _RETIRED.extend(t for t, new in zip(old, (ws, counts)) if t is not None and t is not new)
    _WORKSPACES[device] = ws, counts
    return ws, counts


_DENSE_SCRATCH: dict = {}
_SCRATCH_VIEWS: dict = {}
# Held from a call's unpack launch through the matmul that reads the scratch (op.unpack_linear): threads
# sharing a stream then queue each call's two launches together (another thread's unpack queued in between
# overwrote the scratch before the first one's matmul read it: a wrong product, found by review).
SCRATCH_LOCK = threading.Lock()
_GRAPHED: set = set()   # devices whose current dense scratch a CUDA graph capture has written
_RETIRED: list = []     # outgrown buffers a captured CUDA graph may still write: kept to release_workspaces()


def unpack_dense(values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, int],
                 dtype: torch.dtype, transpose: bool = False, zero: torch.Tensor | None = None,
                 group_size: int = 0) -> torch.Tensor:
    """A decode-layout 16-bit, INT8 or INT4 weight written out dense (``kernels/sparse24_unpack.py``,
    one launch), into the device's shared scratch buffer (grown to the largest layer unpacked,
    kept for the process: a fixed workspace, not a copy per layer).

    Args:
        values, meta: the decode layout (``sparse24.decode_format``), 16-bit, INT8 or INT4 values.
        scale: INT8's per-row float32 scales ``(R,)``; INT4's float16 (or exact bfloat16) group
            scales ``(R, ceil(C / group_size))``; else None.
        shape: ``(R, C)`` of the dense weight; dtype: float16 or bfloat16 (INT8 / INT4: the exact
            dequantized value, ``q * s`` or ``(u - z) * s``, rounded once into it).
        transpose: return the ``(C, R)`` transposed view (what ``torch.mm(x, ·)`` takes).
        zero: INT4's uint8 zero points (asymmetric), shaped as ``scale``; None: symmetric (z = 8).
        group_size: INT4's quantization group along C; 0 for the others.
    Returns:
        ``(R, C)`` tensor of ``dtype`` (``(C, R)`` with ``transpose``), a view of the scratch: valid
        until the next call on this device (stream order: the matmul that reads it runs before the
        next unpack writes it; callers in several threads hold :data:`SCRATCH_LOCK` from this call
        through their matmul's launch; on another stream than the last call's, the current stream first
        waits for that one: :func:`follow_last_stream`).
    """
    R, C = shape
    if group_size:   # the kernel reads INT4 codes as 32-bit words (16-bit values: Triton specializes)
        check_word_aligned(values, meta)
    dev = values.device
    follow_last_stream(dev)   # (first: the growth below frees the old scratch on this stream's turn)
    out = _SCRATCH_VIEWS.get((dev, R, C, dtype))
    if out is None:  # views kept per shape: a call runs no aten op of its own
        buf = _DENSE_SCRATCH.get(dev)
        if buf is None or buf.numel() < R * C * 2:
            _SCRATCH_VIEWS.clear()  # (views of a smaller scratch stay valid for their holders)
            if dev in _GRAPHED:      # a captured graph writes the old one on every replay: keep it
                _RETIRED.append(buf)
                _GRAPHED.discard(dev)
            elif buf is not None and buf.is_cuda:   # freed once the current stream's work on it is done
                buf.record_stream(torch.cuda.current_stream(dev))
            buf = _DENSE_SCRATCH[dev] = _grown(buf, R * C * 2, lambda n: persistent(torch.uint8, n, dev))
        out = buf[:R * C * 2].view(dtype).view(R, C)
        out = _SCRATCH_VIEWS[(dev, R, C, dtype)] = out, out.t()
    if _capturing(values):
        _GRAPHED.add(dev)
    _launch_unpack(values, meta, scale, out[0], zero, group_size)
    return out[transpose]


def persistent(dtype: torch.dtype, n: int, device, zero: bool = False) -> torch.Tensor:
    """``torch.empty(n)`` (``zero``: ``torch.zeros``) of a buffer kept for the process (workspace,
    scratch), allocated outside any CUDA-graph memory pool: during torch.compile(mode="reduce-overhead")'s
    warm-up run torch sends every allocation of the current thread into its graph's pool, and a
    tensor still alive there that is not an output fails the run ("tensor(s) in the cudagraph pool not
    tracked as outputs"). A short-lived thread allocates from the ordinary caching allocator (on every
    device: one path, which the CPU tests see; a buffer grows a few times per process). That thread's
    stream is the default one, whose pool may hand out a block a kernel queued there still writes,
    and the caller's stream is not ordered after it: the thread waits for its stream (a host wait,
    once per growth), which also leaves ``zero``'s fill done before any stream reads the buffer.
    Not while a CUDA graph is captured (no host wait is allowed then): warm up before capturing."""
    device = torch.device(device)
    wait = device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
    got = []

    def make():
        try:
            t = (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
            if wait:
                torch.cuda.current_stream(device).synchronize()
            got.append(t)
        except BaseException as e:   # (out of memory: raised in the caller's thread)
            got.append(e)

    t = threading.Thread(target=make, name="sparse24-alloc")
    t.start()
    t.join()
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


# The device index -> (raw stream, stream) whose launches last used the device's shared buffers
# (split-K workspace and counters, the unpack scratch).
_LAST_STREAM: dict = {}
_NO_STREAM = (None, None)


def follow_last_stream(device: torch.device) -> None:
    """Before a launch on the device's shared buffers: if the current stream is not the one that
    used them last, make it wait for that one (an event on the device, no host wait), so launches
    on two streams (a model per stream, pipeline stages) take turns instead of overwriting each
    other's partial sums or unpacked weight. Callers hold :data:`SCRATCH_LOCK` through their
    launches, so threads each on their own stream queue them in one order. Not while a CUDA graph
    is captured (a captured wait on an uncaptured stream fails the capture): a graph replays on
    the stream that replays it, after what that stream queued before. (Off CUDA: nothing.)"""
    if device.type != "cuda":
        return
    raw = torch._C._cuda_getCurrentRawStream(device.index)
    last = _LAST_STREAM.get(device.index)
    if last is not None and last[0] == raw:
        return
    stream = torch.cuda.current_stream(device.index)
    if torch.cuda.is_current_stream_capturing():
        return
    if last is not None:
        stream.wait_stream(last[1])
    _LAST_STREAM[device.index] = raw, stream


def _capturing(t: torch.Tensor) -> bool:
    """Whether a launch for ``t`` now is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def release_workspaces() -> None:
    """Drop what launches keep for the process: the dense scratch of the unpack route (as large
    as the largest 16-bit or INT4 layer unpacked: 470 MiB for a 28672 x 8192 one), the split-K
    workspaces and the plans that hold them, and the outgrown ones kept because a captured CUDA
    graph may still write them. The next call makes what it needs again. Not while a captured CUDA
    graph (``torch.compile(mode="reduce-overhead")``) that ran these layers is still replayed: its
    kernels address these buffers."""
    kept = (*_DENSE_SCRATCH.values(), *_RETIRED, *(t for pair in _WORKSPACES.values() for t in pair))
    for dev in {t.device for t in kept if t is not None and t.is_cuda}:
        torch.cuda.synchronize(dev)   # nothing queued (on any stream) still uses what is freed here
    del kept
    _DENSE_SCRATCH.clear()
    _SCRATCH_VIEWS.clear()
    _GRAPHED.clear()
    _RETIRED.clear()
    _WORKSPACES.clear()
    _LAST_STREAM.clear()
    _PLANS.clear()
    for forget in _ON_RELEASE:   # (the modules' kept plans hold their workspaces too)
        forget()
    _next_epoch()


_ON_RELEASE: list = []


def on_release(forget) -> None:
    """Have :func:`release_workspaces` also call ``forget()`` (for plans kept above this module)."""
    _ON_RELEASE.append(forget)


def _launch_unpack(values, meta, scale, out, zero=None, group_size=0) -> None:
    """One launch of ``kernels/sparse24_unpack.py`` writing ``out`` (R, C)."""
    from sparse24.kernels.sparse24_unpack import sparse24_unpack, sparse24_unpack_interpreted
    kernel = sparse24_unpack if values.is_cuda else sparse24_unpack_interpreted
    scale, zero = (None if t is None else t.contiguous() for t in (scale, zero))   # read at unit stride
    R, C = out.shape
    block_a = 4   # atoms of 64 columns per program: 4 x 16 rows x 64 columns
    grid = (meta.shape[0], _cdiv(_cdiv(C, 64), block_a))
    with torch.cuda.device(values.device) if values.is_cuda else contextlib.nullcontext():
        kernel[grid](values, meta, scale if scale is not None else values, zero if zero is not None else values, out,
                     R, C, meta.shape[0], scale.shape[1] if group_size else 1, meta.shape[2], out.stride(0),
                     INT8=scale is not None and not group_size, GROUP=group_size, HAS_ZERO=zero is not None,
                     BLOCK_A=block_a, **COMPILE_OPTIONS)


def _grown(buf, need: int, make):
    """``buf`` while it holds ``need`` elements, else ``make(n)`` with n at least twice its size."""
    return buf if buf is not None and buf.numel() >= need else make(need if buf is None else max(need, 2 * buf.numel()))


def _split_extra(device, N, config, split_k, bucket, block_m) -> tuple:
    """The decode and prefill kernels' workspace and counters arguments."""
    ws, counts = decode_workspace(device, N, config, split_k, bucket, block_m)
    # without split-K the two pointers are never read: any tensor will do
    if ws is not None:
        return ws, counts
    if device not in _PLACEHOLDER:
        _PLACEHOLDER[device] = persistent(torch.int32, 1, device)
    return (_PLACEHOLDER[device],) * 2


# --- the three kernels' arguments ---------------------------------------------------
# Each variant: its kernel, its constexprs (in signature order: the kept handle
# appends them to the runtime arguments), its runtime arguments (general and
# for contiguous tensors) and its grid.

def _as_is(x2):
    """A variant's ``prepare_x`` that keeps x as it is (the plan skips the call)."""
    return x2


class _Matmul:
    """``kernels/sparse24_matmul.py``: layout v1, any M."""

    @staticmethod
    def kernel(cuda: bool):
        from sparse24.kernels.sparse24_matmul import sparse24_matmul, sparse24_matmul_interpreted
        return sparse24_matmul if cuda else sparse24_matmul_interpreted

    @staticmethod
    def constexprs(config, split_k, has_scale, values_dtype, has_bias, tf32, K, group_size=0, has_zero=False,
                   bucket=16) -> dict:
        return dict(HAS_SCALE=has_scale, HAS_BIAS=has_bias, DOT_PRECISION="tf32" if tf32 else "ieee",
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                    GROUP_M=config.group_m, SPLIT_K=split_k)

    @staticmethod
    def split_k(config, bucket, deterministic) -> int:
        # Split-K partial sums meet by fp32 atomic adds in a zeroed buffer: run-to-run
        # differences at fp32 rounding, so deterministic mode forces SPLIT_K = 1.
        return 1 if deterministic else config.split_k

    @staticmethod
    def extra(device, N, config, split_k, bucket) -> tuple:
        return ()

    @staticmethod
    def zero_arg(zero) -> tuple:
        return ()   # no INT4: no zero-point argument

    @staticmethod
    def args(x2, values, meta, s, b, target, M, extra=(), z=()) -> tuple:
        N, K = target.shape[1], x2.shape[1]
        return (x2, values, meta, s, b, target, M, N, K, x2.stride(0), x2.stride(1), values.stride(0),
                values.stride(1), meta.stride(0), meta.stride(1), target.stride(0), target.stride(1))

    prepare_x = staticmethod(_as_is)

    @staticmethod
    def check_config(config) -> None:
        """Nothing beyond ``KernelConfig.validate``."""

    @staticmethod
    def contiguous_ints(N, K, quantized=False) -> tuple:
        # N, K and the strides of contiguous x (M, K), values (N, K/2), meta (K/32, N), out (M, N)
        return (N, K, K, 1, K // 2, 1, N, 1, N, 1)

    @staticmethod
    def grid(M, N, config, split_k) -> tuple:
        return (_cdiv(M, config.block_m) * _cdiv(N, config.block_n), split_k, 1)

    @staticmethod
    def max_rows(N, config) -> int:
        """Most rows one launch takes: grid x = row blocks * column blocks <= 2**31 - 1."""
        return GRID_LIMITS[0] // _cdiv(N, config.block_n) * config.block_m

    @staticmethod
    def check_alignment(values, meta) -> None:
        """Nothing to check: the kernel loads every tensor in its own element type."""


def _decode_weight_constexprs(has_scale, values_dtype, has_bias, tf32, group_size, has_zero) -> dict:
    """The decode layout's weight and epilogue constexprs, shared by the decode and prefill kernels."""
    return dict(INT8=has_scale and not group_size, W_BF16=values_dtype == torch.bfloat16, HAS_BIAS=has_bias,
                DOT_PRECISION="tf32" if tf32 else "ieee", INT4=group_size > 0, GROUP=group_size or 128,
                HAS_ZERO=has_zero)


class _Decode:
    """``kernels/sparse24_decode.py``: the decode layout, 16 rows of x per program."""

    @staticmethod
    def kernel(cuda: bool):
        from sparse24.kernels.sparse24_decode import sparse24_decode, sparse24_decode_interpreted
        return sparse24_decode if cuda else sparse24_decode_interpreted

    @staticmethod
    def constexprs(config, split_k, has_scale, values_dtype, has_bias, tf32, K, group_size=0, has_zero=False,
                   bucket=16) -> dict:
        return dict(_decode_weight_constexprs(has_scale, values_dtype, has_bias, tf32, group_size, has_zero),
                    BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, EVEN_K=K % config.block_k == 0,
                    ONE_TILE=split_k == _cdiv(K, config.block_k))  # one K-tile per split: no loop

    @staticmethod
    def split_k(config, bucket, deterministic) -> int:
        # Serial split-K sums the partials in split order: deterministic. Up to
        # SPLIT_K_MAX_M rows (the workspace holds a block of partials per 16 rows).
        return config.split_k if bucket <= SPLIT_K_MAX_M else 1

    @staticmethod
    def extra(device, N, config, split_k, bucket) -> tuple:
        return _split_extra(device, N, config, split_k, bucket, 16)

    @staticmethod
    def zero_arg(zero) -> tuple:
        return (zero,)   # INT4 zero points (any tensor when there are none: never read)

    @staticmethod
    def args(x2, values, meta, s, b, target, M, extra, z) -> tuple:
        N, K = target.shape[1], x2.shape[1]
        return (x2, values, meta, s, *z, b, target, *extra, M, N, K, _cdiv(K, 64), meta.shape[2],
                x2.stride(0), x2.stride(1), target.stride(0), target.stride(1))

    prepare_x = staticmethod(_as_is)

    @staticmethod
    def check_config(config) -> None:
        """The byte-permute decode (and prefill) kernels give each warp one 16-row tile and
        a program 16 rows of x."""
        if config.kernel == "decode" and config.block_m != 16:
            raise ValueError(f"bad decode config {config} for this weight and x: the byte-permute decode kernel "
                             f"(16-bit weights, or float32 x) takes block_m == 16 (32 is the sparse tensor-core "
                             f"kernel's: INT8 / INT4 weights with float16 / bfloat16 x)")
        if config.kernel == "decode" and config.num_warps != config.block_n // 16:
            raise ValueError(f"bad decode config {config} for this weight and x: the byte-permute decode kernel "
                             f"(16-bit weights, or float32 x) needs num_warps == block_n // 16 (two or four tiles per "
                             f"warp, num_warps == block_n // 32 or // 64, is the sparse tensor-core kernel's: INT8 / "
                             f"INT4 weights with float16 / bfloat16 x)")

    @staticmethod
    def contiguous_ints(N, K, quantized=False) -> tuple:
        # N, K, atoms KA and the meta row stride (KM atoms; INT8 / INT4 2 KM: keep masks and
        # mma.sp words) of the layout, strides of x (M, K) and out (M, N)
        _, KA, KM = decode_dims(N, K)
        return (N, K, KA, KM * (2 if quantized else 1), K, 1, N, 1)

    @staticmethod
    def grid(M, N, config, split_k) -> tuple:
        return (_cdiv(N, config.block_n), split_k, _cdiv(M, config.block_m))   # block_m 16 (SP: or 32) rows

    @staticmethod
    def max_rows(N, config) -> int:
        """Most rows one launch takes: 65535 programs of 16 rows along grid z (1,048,560)."""
        return GRID_LIMITS[2] * 16

    @staticmethod
    def check_alignment(values, meta) -> None:
        """The kernel reads values and meta as 4-byte words: a view at an unaligned
        storage offset would fault on a GPU (the interpreter would not notice)."""
        check_word_aligned(values, meta)


class _Prefill(_Decode):
    """``kernels/sparse24_prefill.py``: the decode layout, BLOCK_M rows of x per program
    (the decode kernel's arguments; one program per (BLOCK_N, BLOCK_M) tile and split of K,
    the split-K workspace per BLOCK_M rows)."""

    @staticmethod
    def kernel(cuda: bool):
        from sparse24.kernels.sparse24_prefill import sparse24_prefill, sparse24_prefill_interpreted
        return sparse24_prefill if cuda else sparse24_prefill_interpreted

    @staticmethod
    def constexprs(config, split_k, has_scale, values_dtype, has_bias, tf32, K, group_size=0, has_zero=False,
                   bucket=16) -> dict:
        return dict(_decode_weight_constexprs(has_scale, values_dtype, has_bias, tf32, group_size, has_zero),
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                    NATURAL=natural_tile(config.block_m, config.block_n), SPLIT_K=split_k)

    @staticmethod
    def split_k(config, bucket, deterministic) -> int:
        # The split-K tree adds each node's two halves, the same bits in any arrival order:
        # deterministic (the workspace holds a tile per BLOCK_M rows of the bucket; longer x runs
        # in chunks of the bucket's rows).
        return config.split_k

    @staticmethod
    def extra(device, N, config, split_k, bucket) -> tuple:
        return _split_extra(device, N, config, split_k, bucket, config.block_m)

    @staticmethod
    def grid(M, N, config, split_k) -> tuple:
        return (_cdiv(M, config.block_m) * _cdiv(N, config.block_n), split_k, 1)


class _DecodeSP(_Decode):
    """``kernels/sparse24_sp.py``: INT8 / INT4 decode-layout weights with float16 / bfloat16 x
    on the sparse tensor cores (``mma.sp``), and 16-bit weights of x's dtype at 32 rows per
    program (:func:`half_pair`); the decode kernel's config, split-K and arguments, plus ``N16``
    (a second mma per chunk for x rows 8-15: M buckets above 8),
    ``RT``, the 16-row tiles per warp (``block_n // (16 num_warps)``: 1, 2 or 4), and ``R32``
    (``block_m`` 32: 32 rows of x per program, two 16-row blocks on the same weight registers);
    its grid is (row blocks, weight tiles, splits): the row blocks fastest."""

    @staticmethod
    def kernel(cuda: bool):
        from sparse24.kernels.sparse24_sp import sparse24_sp, sparse24_sp_interpreted
        return sparse24_sp if cuda else sparse24_sp_interpreted

    @staticmethod
    def constexprs(config, split_k, has_scale, values_dtype, has_bias, tf32, K, group_size=0, has_zero=False,
                   bucket=16) -> dict:
        return dict(_Decode.constexprs(config, split_k, has_scale, values_dtype, has_bias, tf32, K, group_size,
                                       has_zero), N16=bucket > 8, RT=config.block_n // (16 * config.num_warps),
                    R32=config.block_m == 32)

    @staticmethod
    def grid(M, N, config, split_k) -> tuple:
        # (row blocks, weight tiles, splits): the row blocks fastest (the kernel says why)
        tiles = _cdiv(N, config.block_n)
        if tiles > GRID_LIMITS[1]:
            raise ValueError(f"{N} output features make {tiles} weight tiles of {config.block_n} rows, over CUDA's "
                             f"{GRID_LIMITS[1]} programs along the grid's y: use a config with a larger block_n")
        return (_cdiv(M, config.block_m), tiles, split_k)

    @staticmethod
    def max_rows(N, config) -> int:
        """Most rows one launch takes: 2**31 - 1 row blocks along the grid's x."""
        return GRID_LIMITS[0] * config.block_m

    @staticmethod
    def extra(device, N, config, split_k, bucket) -> tuple:
        # partials per 16 rows, for whole programs: with block_m 32 a program of a 16-row bucket still
        # stores its second block's (it wrote past the workspace sized for 16 rows)
        return _split_extra(device, N, config, split_k, _cdiv(bucket, config.block_m) * config.block_m, 16)

    @staticmethod
    def check_config(config) -> None:
        """One, two or four 16-row tiles per warp: ``check_decode_config`` allows them all."""

    @staticmethod
    def prepare_x(x2):
        """The kernel reads x as 32-bit words of two columns: unit column stride, even row
        stride, 4-byte aligned start (any contiguous x from torch; a copy otherwise)."""
        if x2.stride(1) == 1 and (x2.stride(0) % 2 == 0 or x2.shape[0] == 1) and x2.data_ptr() % 4 == 0:
            return x2
        return x2.clone(memory_format=torch.contiguous_format)


def variant_of(config: KernelConfig, x_dtype: torch.dtype, has_scale: bool, values_dtype: torch.dtype | None = None,
               sparse_cores: bool = True):
    """The kernel variant a launch of ``config`` runs: a decode config with INT8 / INT4
    weights and float16 / bfloat16 x runs the sparse tensor-core kernel, and so does one of
    32 rows per program (17 to SP_MAX_M rows) with a 16-bit weight of x's dtype (``values_dtype``),
    where the GPU has sparse tensor cores (``sparse_cores``: :func:`sparse_tensor_cores`; without
    them the byte-permute decode kernel, which takes 16 rows per program)."""
    if config.kernel == "decode" and sparse_cores and (
            sparse_kernel(dtype_key(x_dtype, has_scale))   # INT4 keys as INT8's
            or config.block_m == 32 and half_pair(x_dtype, values_dtype, has_scale)):
        return _DecodeSP
    return _VARIANTS[config.kernel]


def half_pair(x_dtype: torch.dtype, values_dtype: torch.dtype | None, has_scale: bool) -> bool:
    """Whether a (weight, x) pair is one the 16-bit-x routes serve, the sparse tensor-core kernel
    past 16 rows and the unpack route: float16 / bfloat16 x with INT8 / INT4 weights
    (``has_scale``) or a 16-bit weight of x's dtype (``mma.sp`` takes one type for both operands;
    the unpack scratch holds x's dtype)."""
    return x_dtype in (torch.float16, torch.bfloat16) and (has_scale or values_dtype == x_dtype)


def sp_serves(x_dtype: torch.dtype, values_dtype: torch.dtype | None, has_scale: bool, device: torch.device) -> bool:
    """Whether the sparse tensor-core kernel takes this pair on ``device``: :func:`half_pair`
    where :func:`sparse_tensor_cores`."""
    return half_pair(x_dtype, values_dtype, has_scale) and sparse_tensor_cores(device)


# The first compute capability whose GPUs have sparse tensor cores (``mma.sp`` compiles from sm_80).
SPARSE_CORES_CAPABILITY = (8, 0)


def sparse_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` runs the sparse tensor-core kernel: an NVIDIA GPU with sparse tensor cores
    (compute capability 8.0 or later: ``mma.sp`` does not compile for older ones, such as a T4,
    where INT8 weights with 16-bit x, and INT4 with float16 x, take the byte-permute decode kernel
    to 16 rows and the prefill or unpack route beyond, as 16-bit weights do (INT4 with bfloat16 x:
    the reference, :func:`kernel_refusal`); never a ROCm GPU, whose capability
    numbers are not NVIDIA's), or Triton's interpreter (CPU tensors). (The store's device query,
    which is cached, read through the module: a decision simulated on CPU answers it for its
    CUDA-looking device, scripts/bench_host.py.)"""
    if device.type != "cuda":
        return True
    why, capability = _kernel_device(device)
    return why is None and capability >= SPARSE_CORES_CAPABILITY


# The oldest GPUs the compiled kernels run on: Triton compiles nothing for compute capability
# below 7.0 (Pascal: P100, GTX 10xx), and the kernels' bf16x2 instructions (INT4 weights with
# bfloat16 x) need 8.0 (ptxas rejects them for a T4 or a V100).
KERNELS_CAPABILITY = (7, 0)
BF16X2_CAPABILITY = (8, 0)
_KERNEL_DEVICES: dict = {}
on_clear(_KERNEL_DEVICES.clear)


def _kernel_device(device: torch.device) -> tuple:
    """``(why the compiled kernels cannot run on CUDA device ``device``, or None; its capability)``,
    once per device (the routes ask on every call)."""
    got = _KERNEL_DEVICES.get(device)
    if got is None:
        capability = config_store.device_info(device).capability
        capability = (0, 0) if capability is None else tuple(capability)
        if torch.version.hip is not None:
            # a ROCm build's GPUs are torch's "cuda" devices, but the kernels hold NVIDIA PTX (prmt,
            # mma.sp, f16x2 / bf16x2 inline asm): AMD's compiler rejects it, or drops mma.sp silently
            why = (f"{device} is an AMD GPU (ROCm {torch.version.hip}): the kernels are NVIDIA PTX; "
                   f"use backend='reference'")
        elif capability < KERNELS_CAPABILITY:
            why = (f"{device} has compute capability {capability[0]}.{capability[1]}: Triton compiles the kernels "
                   f"for 7.0 or later only; use backend='reference'")
        else:
            why = None
        got = _KERNEL_DEVICES[device] = (why, capability)
    return got


def kernels_run_on(device: torch.device) -> bool:
    """Whether the compiled kernels can run on ``device``: an NVIDIA GPU (not a ROCm build's GPU)
    of compute capability 7.0 or later. Elsewhere ``backend="auto"`` runs the reference, a module
    keeps layout v1, and ``backend="triton"`` is a ValueError (:func:`kernel_refusal`)."""
    return device.type == "cuda" and _kernel_device(device)[0] is None


def kernel_refusal(device: torch.device, x_dtype: torch.dtype, int4: bool = False) -> str | None:
    """Why the compiled kernels cannot compute x of ``x_dtype`` (with INT4 weights: ``int4``) on CUDA
    device ``device`` (None: they can; CPU tensors are not asked: the interpreter runs them)."""
    if device.type != "cuda":
        return None
    why, capability = _kernel_device(device)
    if why is None and int4 and x_dtype == torch.bfloat16 and capability < BF16X2_CAPABILITY:
        why = (f"INT4 weights with bfloat16 x need compute capability 8.0 (the kernels' bf16x2 instructions), "
               f"{device} has {capability[0]}.{capability[1]}; use float16 x or backend='reference'")
    return why


_VARIANTS = {"matmul": _Matmul, "decode": _Decode, "prefill": _Prefill}


def int_specialization(config: KernelConfig, N: int, K: int, quantized: bool = False) -> tuple:
    """How Triton specializes the integer arguments of a launch of ``config`` on contiguous
    tensors (N, K, the sizes the layout derives from them, the strides; M is not specialized),
    in argument order: 1, ``"D"`` (divisible by 16) or ``""``. Launches that differ here compile
    different kernels: at K = 11008 the decode layout's atom count K / 64 = 172 is not divisible
    by 16 where at K = 4096 it is. ``quantized``: INT8 / INT4 weights."""
    ints = _VARIANTS[config.kernel].contiguous_ints(N, K, quantized)
    return tuple(1 if v == 1 else "D" if v % 16 == 0 else "" for v in ints)
_PLACEHOLDER: dict = {}


# Triton 3.3 fails to compile several of these kernels for GPUs: the sparse tensor-core kernel
# (CompilationError), the decode and prefill kernels with INT8 weights and the 16-bit prefill kernel
# at some shapes ('tt.join' type inference, "PassManager::run failed"); sm_80 / sm_90, compiled here
# with Triton 3.3, 3.4, 3.5, 3.6 and 3.9: from 3.4 every kernel compiles. pyproject.toml asks for
# 3.4; a Triton installed against it (its interpreter runs CPU tensors) gets a clear error here.
GPU_TRITON = (3, 4)


def check_triton_for_gpu() -> None:
    """Raise RuntimeError, before any compile, where the installed Triton is older than
    :data:`GPU_TRITON` (a GPU launch, or a tuner's compile for one)."""
    import triton

    from sparse24.kernels.interpreter import triton_version
    if triton_version() < GPU_TRITON:
        raise RuntimeError(f"the GPU kernels need Triton >= {'.'.join(map(str, GPU_TRITON))}: Triton "
                           f"{triton.__version__} fails to compile several of them (CPU tensors run in its "
                           f"interpreter). Install a newer triton, or use backend='reference' on the GPU")


def kernel_call(x2, p: Sparse24Tensor | DecodePacked, bias, target, config: KernelConfig, split_k: int,
                sparse_cores: bool | None = None, cuda: bool | None = None):
    """``(kernel, grid, args, kwargs)`` of one launch writing ``target`` (M, N)
    (dtype :func:`target_dtype`; zeroed when that is the general kernel's fp32
    split-K buffer); shared by the tuner's parallel pre-compilation and the
    ahead-of-time compile, so both build the same kernel variant as the launch path
    (``sparse_cores``: as :func:`variant_of`, default :func:`sparse_tensor_cores` of x's device;
    ``cuda``: the compiled kernel rather than the interpreted one, default: x on CUDA)."""
    if x2.is_cuda:
        check_triton_for_gpu()
    sparse_cores = sparse_tensor_cores(x2.device) if sparse_cores is None else sparse_cores
    variant = variant_of(config, x2.dtype, p.scale is not None, p.values.dtype, sparse_cores)
    x2 = variant.prepare_x(x2)
    M = x2.shape[0]
    if target.dtype != target_dtype(config, split_k, x2.dtype):
        raise ValueError(f"target must be {target_dtype(config, split_k, x2.dtype)} for {config}, got {target.dtype}")
    tf32 = x2.is_cuda and x2.dtype == torch.float32 and tf32_matmul()
    s = p.meta if p.scale is None else p.scale
    b = p.meta if bias is None else bias
    group_size, zero = getattr(p, "group_size", None) or 0, getattr(p, "zero", None)
    kwargs = dict(variant.constexprs(config, split_k, p.scale is not None, p.values.dtype, bias is not None, tf32,
                                     x2.shape[1], group_size, zero is not None, m_bucket(M)),
                  num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS)
    grid = variant.grid(M, p.shape[0], config, split_k)
    extra = variant.extra(x2.device, p.shape[0], config, split_k, m_bucket(M))
    z = variant.zero_arg(p.meta if zero is None else zero)
    return (variant.kernel(x2.is_cuda if cuda is None else cuda), grid,
            variant.args(x2, p.values, p.meta, s, b, target, M, extra, z), kwargs)


def aot_compile(x2, p: Sparse24Tensor | DecodePacked, bias, target, config: KernelConfig, split_k: int,
                capability: tuple[int, int] = (9, 0)):
    """Compile (not run) the launch :func:`kernel_call` describes for a CUDA
    target, without a GPU: Triton -> PTX -> cubin with the ptxas shipped in
    Triton's wheel. Specializes arguments as the JIT does on a GPU (ints equal
    to 1 become constants, M excepted; 16-byte aligned pointers and ints
    divisible by 16 are marked so), so the code matches what a GPU would build.

    Args:
        x2: ``(M, K)`` CPU tensor, p: weight (either layout), bias: ``(N,)`` or None,
        target: ``(M, N)`` output (dtype :func:`target_dtype`), config, split_k.
        capability: ``(major, minor)``, e.g. ``(9, 0)`` for H100/H200.
    Returns:
        Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    sparse_cores = tuple(capability) >= SPARSE_CORES_CAPABILITY
    _, _, args, kwargs = kernel_call(x2, p, bias, target, config, split_k, sparse_cores)
    jit_fn = variant_of(config, x2.dtype, p.scale is not None, p.values.dtype, sparse_cores).kernel(cuda=True)
    names = jit_fn.arg_names
    constexprs = {k: v for k, v in kwargs.items() if k in names}
    constexprs.update({n: 1 for n, a in zip(names, args)
                       if n != "M" and isinstance(a, int) and not isinstance(a, bool) and a == 1})
    signature = {n: ("constexpr" if n in constexprs else mangle_type(a)) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, a) in enumerate(zip(names, args))
             if n not in constexprs and ((isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
                                         or (n != "M" and isinstance(a, int) and a % 16 == 0))}
    src = ASTSource(jit_fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                                   **COMPILE_OPTIONS})

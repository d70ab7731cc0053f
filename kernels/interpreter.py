"""Run a ``@triton.jit`` kernel's source on CPU tensors through Triton's
interpreter, leaving no trace in ``triton.language``.

Triton builds its own helpers (``tl.zeros``, ``tl.cdiv``...) as compiled JIT
functions unless ``TRITON_INTERPRET=1`` was set before ``import triton``; an
interpreted kernel calling them then fails. During a launch we route calls of
such helpers through the interpreter, exactly what ``TRITON_INTERPRET=1``
would have built.

Each interpreted call patches ``triton.language`` (its modules' functions and
the methods of ``tl.tensor``, ``tl.dtype``...) with numpy-backed versions.
Triton 3.9 restores only what the outer launch patched (a helper call through
``InterpretedFunction.__call__`` patches again and never restores), and 3.5 and
older restore nothing: a later real compile in the same process then fails
("'block_argument' object has no attribute 'dtype'"). So a launch snapshots
the attributes of every ``triton.language`` module and class it defines, and
puts back exactly that snapshot afterwards, whatever the Triton version did.
Modules Triton imports lazily inside that window (Triton 3.9: the code
generator, Gluon, libdevice, through argument specialization) would keep
the patched functions they import, so they are imported here, before any
launch.

Triton 3.3-3.6 with numpy >= 2.4: the interpreter holds a scalar as a
shape-(1,) array and gives ``tl.tensor`` an ``__index__`` of
``int(array)``, which numpy 2.4 turned into a TypeError ("only
0-dimensional arrays can be converted to Python scalars"). Every ``range``
over runtime bounds in a kernel (our K loop) calls it, so every launch
failed. Triton 3.7 converts with ``int(array.squeeze())``
(triton-lang/triton#9172); on older Triton a launch installs that same
conversion right after the interpreter's own tensor patch, and puts the
interpreter back afterwards. For a one-element array both forms give its
value under any numpy, and for a larger one both raise TypeError, so
nothing else changes. Delete ``_scalar_index_fix`` once Triton >= 3.7 is the
floor in pyproject.toml.
"""
import importlib
import sys
import threading

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction, TensorHandle
from triton.runtime.jit import JITFunction

for _name in ("triton.compiler.code_generator", "triton.language.extra.libdevice"):
    try:
        importlib.import_module(_name)
    except ImportError:  # not in every Triton version
        pass
libdevice = sys.modules.get("triton.language.extra.libdevice")

__all__ = ["InterpretedKernel", "byte_perm_reference", "prmt_raw_reference", "ASM_EMULATIONS", "f16x2_reference",
           "triton_version"]


def _patchable() -> list:
    """The objects whose attributes an interpreted launch may change."""
    objs = {id(JITFunction): JITFunction}  # we route its __call__ ourselves
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        objs[id(mod)] = mod
        for value in list(vars(mod).values()):
            if isinstance(value, type) and getattr(value, "__module__", "").startswith("triton.language"):
                objs[id(value)] = value
    return list(objs.values())


def _snapshot() -> list[tuple[object, dict]]:
    return [(obj, dict(vars(obj))) for obj in _patchable()]


def _restore(snapshot: list[tuple[object, dict]]) -> None:
    for obj, saved in snapshot:
        current = vars(obj)
        # A submodule imported meanwhile is bound on its package: keep that binding.
        for name in [n for n, v in current.items() if n not in saved and not isinstance(v, type(sys))]:
            delattr(obj, name)
        for name, value in saved.items():
            if current.get(name, _MISSING) is not value:
                setattr(obj, name, value)


_MISSING = object()
_INTERPRETED_HELPERS: dict = {}

# Triton 3.2-3.6 (checked in each wheel) patch __index__ to int(self.handle.data).
def triton_version() -> tuple[int, int]:
    """The installed Triton's (major, minor), read when called."""
    return tuple(int(v) for v in triton.__version__.split(".")[:2])


_NEEDS_INDEX_FIX = triton_version() < (3, 7)


def _scalar_index(self) -> int:
    return int(self.handle.data.squeeze())  # Triton 3.7's own conversion


def _scalar_index_fix():
    """Make the interpreter's tensor patch use Triton 3.7's ``__index__``;
    returns the function that undoes it (a no-op on Triton >= 3.7)."""
    original = getattr(_interpreter, "_patch_lang_tensor", None)
    if not _NEEDS_INDEX_FIX or original is None:
        return lambda: None

    def patch_lang_tensor(tensor, *scope):  # Triton 3.6 passes a restore scope, older ones do not
        original(tensor, *scope)
        tensor.__index__ = _scalar_index  # the launch's snapshot puts tl.tensor back afterwards

    _interpreter._patch_lang_tensor = patch_lang_tensor
    return lambda: setattr(_interpreter, "_patch_lang_tensor", original)


def byte_perm_reference(x, y, s):
    """``__nv_byte_perm(x, y, s)`` on numpy int32 arrays (or ints), broadcast:
    byte n of the result is byte ``(s >> 4n) & 7`` of the 8 bytes (y:x), x's
    bytes first; the upper 16 bits of s are ignored (CUDA Math API; libdevice
    masks the selector with 0x7777 before ``prmt.b32``). Returns int32."""
    return _prmt(x, y, s, replicate_sign=False)


def prmt_raw_reference(x, y, s):
    """PTX ``prmt.b32 d, x, y, s`` (default mode) as written, without
    libdevice's 0x7777 mask: as :func:`byte_perm_reference`, except that a set
    bit 3 of a selector nibble fills that result byte with the sign bit of
    the byte it picks. The decode kernel's selectors set such bits: bound to
    :data:`BYTE_PERM`, it shows a kernel calling raw PRMT decodes wrong."""
    return _prmt(x, y, s, replicate_sign=True)


def _prmt(x, y, s, replicate_sign: bool):
    x, y, s = (np.asarray(v).astype(np.int64) & 0xFFFFFFFF for v in (x, y, s))
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros(np.broadcast_shapes(x.shape, y.shape, s.shape), dtype=np.int64)
    for n in range(4):
        nibble = np.broadcast_to((s >> (4 * n)) & 15, out.shape)
        byte = np.choose(nibble & 7, [np.broadcast_to(b, out.shape) for b in src])
        if replicate_sign:
            byte = np.where(nibble & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte << (8 * n)
    return np.where(out >= 2 ** 31, out - 2 ** 32, out).astype(np.int32)


# What an interpreted launch binds libdevice.byte_perm to (a test swaps in raw PRMT).
BYTE_PERM = byte_perm_reference


def _byte_perm_interpreted(x, y, s, *args, **kwargs):
    """``libdevice.byte_perm`` on the interpreter's tensors."""
    def data(v):
        return v.handle.data if isinstance(v, tl.tensor) else v
    out = BYTE_PERM(data(x), data(y), data(s))
    ty = tl.block_type(tl.int32, list(out.shape)) if out.shape else tl.int32
    return tl.tensor(TensorHandle(out, tl.int32), ty)


# Triton's dependency hashing (run for interpreted helper calls too) accepts
# the libdevice stubs by their module name; this stands in for one of them.
_byte_perm_interpreted.__module__ = "triton.language.extra.libdevice"


def f16x2_reference(op: str):
    """A numpy emulation of PTX ``{op}.f16x2`` (sub, mul, fma.rn) on int32 words (two float16
    each, low half first): each float16 result rounded once to nearest even, as the GPU does
    (fma: a * b + c exact in float64, then one rounding)."""
    def run(*words):
        shape = np.broadcast_shapes(*(np.shape(v) for v in words))
        a, b, *c = (np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=np.int32), shape)).view(np.float16)
                    for v in words)
        if op == "fma":
            return (a.astype(np.float64) * b + c[0]).astype(np.float16).view(np.int32)
        return (a - b if op == "sub" else a * b).view(np.int32)
    return run


def bf16x2_fma_reference(a, b, c):
    """A numpy emulation of PTX ``fma.rn.bf16x2`` on int32 words (two bfloat16 each, low half
    first): a * b + c exact in float64 (subnormal operands included: the default without .ftz),
    then one rounding to the nearest even bfloat16, subnormal results on the 2**-133 grid."""
    shape = np.broadcast_shapes(*(np.shape(v) for v in (a, b, c)))
    words = [np.broadcast_to(np.asarray(v, dtype=np.int32), shape).astype(np.int64) & 0xFFFFFFFF for v in (a, b, c)]

    def half(w, k):   # bfloat16 bits -> float64, exactly (they are float32's high half)
        return (((w >> (16 * k)) & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)

    out = np.zeros(shape, dtype=np.int64)
    for k in (0, 1):
        r = half(words[0], k) * half(words[1], k) + half(words[2], k)
        _, e = np.frexp(r)
        step = np.ldexp(1.0, np.maximum(e, -125) - 8)   # the bfloat16 spacing at r (8-bit significand)
        with np.errstate(over="ignore", invalid="ignore"):
            q = (np.round(r / step) * step).astype(np.float32)   # exact, or inf past the range
        out |= (q.view(np.uint32).astype(np.int64) >> 16) << (16 * k)
    return out.astype(np.uint32).view(np.int32)


def bf16x2_cvt_reference(a):
    """A numpy emulation of PTX ``cvt.rn.bf16x2.f32 d, a, a`` on a float32 array: a rounded to the
    nearest even bfloat16 in both halves of an int32 word (NaN stays NaN)."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    r = np.where(np.isnan(a), 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return ((r << 16) | r).astype(np.uint32).view(np.int32)


# Inline PTX an interpreted launch can run: asm string -> numpy function of the operands'
# int32 arrays (a kernel module registers its own strings; the interpreter has no PTX).
ASM_EMULATIONS: dict = {}


class _AsmResults:
    def __init__(self, outs):
        self.outs = outs

    def get_result(self, i):
        return self.outs[i]


def _inline_asm_interpreted(builder, asm, constraints, values, types, is_pure, pack):
    """``tl.inline_asm_elementwise`` on the interpreter's tensors, through :data:`ASM_EMULATIONS`."""
    fn = ASM_EMULATIONS.get(asm)
    if fn is None or pack != 1:
        raise NotImplementedError(f"no interpreter emulation of this inline asm (pack {pack}): {asm!r}")
    outs = fn(*[v.data for v in values])
    outs = outs if isinstance(outs, tuple) else (outs,)   # one array per output: int32 words or float32
    return _AsmResults([TensorHandle(o, tl.float32) if o.dtype == np.float32 else
                        TensorHandle(np.asarray(o, dtype=np.int32), tl.int32) for o in map(np.asarray, outs)])


def _call_interpreted(jit_fn, *args, **kwargs):
    # Keyed by identity: hashing a JITFunction computes its cache key, which walks its globals
    # and fails on the interpreter's patched reductions (a kernel calling tl.sum).
    entry = _INTERPRETED_HELPERS.get(id(jit_fn))
    if entry is None or entry[0] is not jit_fn:
        entry = _INTERPRETED_HELPERS[id(jit_fn)] = (jit_fn, InterpretedFunction(jit_fn.fn))
    # The interpreter's rewrite of a helper (cached by Triton, once per process) reads names
    # that Triton adds to the helper's module globals only when it first rewrites it (3.9:
    # interpreter_semantic); a launch's restore removes them from triton.language again. So
    # they are added here for the call, and taken away after it.
    helper_globals = jit_fn.fn.__globals__
    added = vars(_interpreter).keys() - helper_globals.keys()
    helper_globals.update((name, vars(_interpreter)[name]) for name in added)
    try:
        return entry[1](*args, **kwargs)
    finally:
        for name in added:
            helper_globals.pop(name, None)


# Held for a whole interpreted launch: each patches Triton's module state and restores its snapshot, so a
# thread snapshotting while another's patches are in place would restore those for good (found by review).
_PATCHING = threading.RLock()


class InterpretedKernel:
    """``kernel[grid](*args)`` for CPU tensors through Triton's interpreter.

    Wraps the plain Python function a ``triton.jit`` kernel is made from, so
    the GPU build and the CPU run share one source. Compiled launches never
    call ``JITFunction.__call__`` (it only raises), so routing it during a
    launch cannot affect them, and the snapshot puts it back anyway.
    """

    def __init__(self, fn):
        self.fn = InterpretedFunction(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _PATCHING:   # one launch at a time: a thread's snapshot must not catch another's patches
                return _launch(args, kwargs)

        def _launch(args, kwargs):
            snapshot = _snapshot()
            JITFunction.__call__ = _call_interpreted
            undo_index_fix = _scalar_index_fix()
            if libdevice is not None:
                libdevice.byte_perm = _byte_perm_interpreted
            asm = _interpreter.InterpreterBuilder.create_inline_asm
            _interpreter.InterpreterBuilder.create_inline_asm = _inline_asm_interpreted
            try:
                return self.fn[grid](*args, **kwargs)
            finally:
                _interpreter.InterpreterBuilder.create_inline_asm = asm
                undo_index_fix()
                _restore(snapshot)
        return launch

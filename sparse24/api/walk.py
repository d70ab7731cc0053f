"""Walking a model for the whole-model calls: which modules are Linear (or
Hugging Face ``Conv1D``), which are skipped and why (direct weight readers,
tied weights, the output head, layers too small, modules not handled), and
swapping children in a way that can be undone (all or nothing)."""
from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import weakref
from typing import Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from .._checks import is_exporting
from ..format import FLOAT_DTYPES
from ..masks.kept_dense import _is_linear, _tied_or_head, _unswappable
from ..nn import Sparse24Linear, compressed_nbytes, linear_shape, memory_nbytes
from ..nn.sharded import is_dtensor
from ..nn.state import _whole_model_check, guard_loading
from .report import LayerReport

FilterFn = Callable[[nn.Module, str], bool]
# Smaller layers are skipped: under 32 input columns the packed metadata word
# is partly padding, and a layer that small costs less than one kernel launch.
MIN_FEATURES = 32
# Mask methods that need per-layer calibration statistics.
_CALIBRATED_METHODS = ("wanda", "sparsegpt")
# Parents that read these children's `.weight` directly instead of calling them.
_DIRECT_READERS = {
    nn.MultiheadAttention: ("out_proj", "nn.MultiheadAttention reads out_proj.weight in its functional forward"),
    nn.TransformerEncoderLayer: ("linear1", "linear2",
                                 "nn.TransformerEncoderLayer reads linear1/linear2.weight in its inference fast path"),
}
_CONV = "a convolution: sparse24's layers and kernels are matmuls (nn.Linear, transformers Conv1D); 2:4 " \
        "convolutions are not implemented"
# Why modules that hold a weight matrix but are no Linear are left alone (checked in this order).
_NOT_HANDLED = (
    ((nn.Embedding, nn.EmbeddingBag), "a lookup table, not a matmul: 2:4 would speed nothing up"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), _CONV),
    ((nn.MultiheadAttention,), "its in_proj_weight is used inside F.multi_head_attention_forward, not by a "
                               "Linear (its out_proj is handled)"),
    ((nn.RNNBase,), "recurrent weights are used inside the fused RNN kernel, not by a Linear"),
    ((nn.Bilinear,), "a bilinear form, not a Linear"),
)


def _child_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) -> every (parent, attribute name) holding it (a module may be reused)."""
    slots: dict[int, list] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                slots.setdefault(id(child), []).append((parent, name))
    return slots


# nn.Module's tables of per-module hooks (a user's activation, gradient or state_dict hooks), which a swap carries
# over: torch calls each with the module that holds it, now the new one (state_dict hooks see its own entries:
# weight + mask, or values + meta). load_state_dict pre-hooks are not carried: such a layer is not swapped
# (_load_hooks_reason).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
                "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_post_hooks")


def _set_child(parent: nn.Module, name: str, new: nn.Module) -> None:
    setattr(parent, name, new)


class _Undo:
    """Changes to a model that can be taken back: each step records its inverse."""

    def __init__(self):
        self._steps: list[Callable[[], None]] = []

    def replace(self, slots, old: nn.Module, new: nn.Module) -> None:
        """Put ``new`` in every slot holding ``old``, with ``old``'s hooks (:data:`_HOOK_TABLES`)."""
        for parent, name in slots[id(old)]:
            self._steps.append(lambda parent=parent, name=name: parent._modules.__setitem__(name, old))
            _set_child(parent, name, new)
        for table in _HOOK_TABLES:
            hooks, own = getattr(old, table, None), getattr(new, table, None)
            if hooks and own is not None and not own:
                # the same dict object: a handle the user holds still removes its hook
                setattr(new, table, hooks)
                self._steps.append(lambda table=table, own=own: setattr(new, table, own))
        if old._backward_hooks and new._backward_hooks is old._backward_hooks:  # full or old-style, as registered
            flag = new._is_full_backward_hook
            new._is_full_backward_hook = old._is_full_backward_hook
            self._steps.append(lambda: setattr(new, "_is_full_backward_hook", flag))

    def add(self, inverse: Callable[[], None]) -> None:
        self._steps.append(inverse)

    def undo(self) -> None:
        for step in reversed(self._steps):
            step()
        self._steps.clear()


def _direct_readers(model: nn.Module) -> dict[int, str]:
    """id(child Linear) -> why its weight is read directly by its parent: the known readers, and
    any module whose methods' source reads ``self.<path>.weight`` of a module below it (``self.fc``,
    ``self.block.fc``, ``self.layers[1]``, every layer of ``self.heads[k]``; :func:`_forward_weight_reads`:
    T5's feed-forward casts to ``self.wo.weight.dtype`` in its forward, WavLM's attention passes
    ``self.q_proj.weight`` to ``F.multi_head_attention_forward`` in a helper its forward calls: a
    compressed layer has no ``weight``, so such a child stays in masked mode)."""
    out = {}
    for mod in model.modules():
        for path, (why, known) in _reader_paths(mod).items():
            child = _submodule(mod, path)
            if child is not None and (known or id(child) not in out):
                out[id(child)] = why
    return out


def _reader_paths(mod: nn.Module) -> dict[str, tuple[str, bool]]:
    """Path below ``mod`` -> (why, listed in _DIRECT_READERS) for the modules whose ``.weight`` ``mod``'s
    forward (or a method of it) reads directly."""
    out = {}
    for cls, (*names, why) in _DIRECT_READERS.items():
        if isinstance(mod, cls):
            out.update((n, (why, True)) for n in names)
    for expr, where in _forward_weight_reads(type(mod)).items():
        for path in _read_paths(mod, expr):
            out.setdefault(path, (f"{where} reads self.{expr}.weight", False))
    return out


def _read_paths(mod: nn.Module, expr: str) -> list[str]:
    """The paths below ``mod`` (as :func:`_submodule` takes them) of the modules a read of
    ``self.<expr>.weight`` may reach: ``expr`` is attribute names and subscripts (``block.fc``,
    ``layers[1]``, ``heads['q']``). A literal index picks one child (by position: ``nn.ModuleList``,
    ``nn.Sequential``), a literal key one child by name (``nn.ModuleDict``); any other subscript
    (``heads[k]``) every child of that container, since which one is read is known only at run time."""
    found = [("", mod)]
    for name, index in _STEP.findall(expr):
        step = []
        for path, m in found:
            if name:
                kids = [(name, m._modules.get(name))]
            else:
                kids = list(m._modules.items())
                try:
                    key = ast.literal_eval(index)
                except (ValueError, SyntaxError):
                    key = None   # a variable, an expression: any child
                if isinstance(key, int) and not isinstance(key, bool):
                    kids = kids[key:key + 1] if key >= 0 else kids[key:][:1]
                elif isinstance(key, str):
                    kids = [(key, m._modules.get(key))]
            step += [(f"{path}.{n}" if path else n, c) for n, c in kids if c is not None]
        found = step
    return [path for path, _ in found]


def _submodule(mod: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        mod = mod._modules.get(name) if isinstance(mod, nn.Module) else None
    return mod


def _put_back(table: dict, saved: dict) -> None:
    table.clear()  # the same table: handles of the user's hooks keep working
    table.update(saved)


@torch.compiler.assume_constant_result
def _is_inference(t: torch.Tensor) -> bool:
    """``t.is_inference()``, which Dynamo cannot trace (a graph break): under torch.compile a constant
    of the graph; Dynamo's guards on ``t`` (its dispatch keys) tell an inference tensor from another."""
    return t.is_inference()


class _MaskDirectReads:
    """Forward pre-hook of a module holding masked layers whose ``.weight`` their parent reads directly
    (their own forward, which masks, never runs; the hook's module is that parent, or a module above
    it, see :func:`_hook_owner`): re-zeroes a layer's pruned entries in place when the weight
    changed since it was last found zero there (a user's re-init, ``vector_to_parameters``, ``copy_``
    under ``no_grad``; ``_zero_where_pruned`` caches the answer per version, so an unchanged weight
    costs no pass over it). Holds the layers' paths only, looked up per call: survives deepcopy and pickle.

    Under torch.compile the write is in the graph, on every call: a graph has no version counter to
    tell an unchanged weight (the cost of one pass over the weight, as a masked layer's own compiled
    forward masks on every call); skipping it would let a compiled model multiply by a weight
    written in place since (``model.apply(init)``), silently.

    Left alone: a weight ``torch.func.functional_call`` substituted (no Parameter: never the caller's
    tensor to write), calls under torch.export or torch.func transforms (an exported program would
    write its own parameters; a write is no functional op), inference tensors (cannot be written
    outside inference mode), meta and sharded (FSDP2) weights."""

    def __init__(self, paths: tuple[str, ...]):
        self.paths = paths

    def __call__(self, parent: nn.Module, args) -> None:
        if is_exporting() or torch._C._are_functorch_transforms_active():
            return
        compiling = torch.compiler.is_compiling()
        for path in self.paths:
            child = _submodule(parent, path)
            if not isinstance(child, Sparse24Linear) or child.__dict__.get("_mode") != "masked":
                continue
            if child.__dict__.get("_pending") is not None:
                # its weight read directly would be the one a loader set (accelerate's, dense), never masked;
                # the layer's own forward refuses so too
                raise RuntimeError(child._pending_message("run"))
            w, mask = child._parameters.get("weight"), child._buffers.get("mask")
            if not isinstance(w, nn.Parameter) or mask is None or w.is_meta or _is_inference(w) \
                    or is_dtensor(w) or is_dtensor(mask):
                continue
            if compiling or not child._zero_where_pruned(w):
                with torch.no_grad():
                    w.masked_fill_(~mask, 0)


def _sync_reader_hooks(model: nn.Module, undo: "_Undo") -> None:
    """One :class:`_MaskDirectReads` on each module of ``model`` that must check directly read masked
    ``Sparse24Linear`` weights (:func:`_hook_owner`), covering exactly those; none on the others (after
    densify_). Run at the end of every whole-model call; ``undo`` puts each changed hook table back."""
    wanted: dict[int, list[str]] = {}  # id(owner) -> the paths below it to check
    for fqn, parent in model.named_modules():
        paths = [p for p in _reader_paths(parent)
                 if isinstance(c := _submodule(parent, p), Sparse24Linear) and c.mode == "masked"]
        if paths:
            owner = _hook_owner(model, fqn)
            below = fqn[len(owner):].lstrip(".")
            found = wanted.setdefault(id(model.get_submodule(owner)), [])
            found += [q for q in (f"{below}.{p}" if below else p for p in paths) if q not in found]
    for mod in model.modules():
        paths = tuple(wanted.get(id(mod), ()))
        hooks = mod._forward_pre_hooks
        ours = [k for k, h in hooks.items() if isinstance(h, _MaskDirectReads)]
        if (not ours and not paths) or (len(ours) == 1 and hooks[ours[0]].paths == paths):
            continue
        undo.add(functools.partial(_put_back, hooks, dict(hooks)))
        for k in ours[1:] if paths else ours:
            del hooks[k]
        if paths and ours:
            hooks[ours[0]] = _MaskDirectReads(paths)  # in its place among the user's hooks
        elif paths:
            mod.register_forward_pre_hook(_MaskDirectReads(paths))


def _hook_owner(model: nn.Module, fqn: str) -> str:
    """Where the check for the module ``fqn``'s direct reads goes: on it, unless it is (inside) an
    ``nn.TransformerEncoderLayer``, whose fused inference fast path turns off when any module inside
    it has a hook: then on the nearest module above that layer that is called (not a ModuleList), so
    that the check runs before the layer does. The layer itself where nothing above it is called
    (correct, without the fast path)."""
    parts = fqn.split(".") if fqn else []
    names = [".".join(parts[:i]) for i in range(len(parts) + 1)]  # root first
    mods = [model.get_submodule(n) for n in names]
    inside = [i for i, m in enumerate(mods) if isinstance(m, nn.TransformerEncoderLayer)]
    if not inside:
        return fqn
    above = [i for i in range(inside[0]) if type(mods[i]).forward is not nn.Module.forward]
    return names[above[-1]] if above else names[inside[0]]


# class -> its _forward_weight_reads; weak: fx.GraphModule and parametrize make a class per instance
_WEIGHT_READS: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()
# class -> the reads of the functions defined in its own body (shared by its subclasses' lookups)
_OWN_READS: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()
# self.<path>.weight: attribute names with subscripts (self.fc, self.block.fc, self.layers[1], self.heads[k])
_READ = re.compile(r"self\.(\w+(?:\[[^\[\]\n]*\])*(?:\.\w+(?:\[[^\[\]\n]*\])*)*)\.weight\b")
_STEP = re.compile(r"(\w+)|\[([^\[\]\n]*)\]")   # one attribute name, or one subscript's text


def _forward_weight_reads(cls: type) -> dict[str, str]:
    """Path read -> where (``Class.method``) the source of ``cls`` reads ``self.<path>.weight`` (``fc``,
    ``block.fc``, ``layers[1]``, ``heads[k]``, spaces removed; :func:`_read_paths` finds the modules): its
    ``forward`` and every other method, property and static/class method defined on it or on its bases
    below ``nn.Module``, as a forward may hand the weights on from a helper it calls (WavLM's attention,
    Reformer's ``_query_per_attn_head``). Left out: construction and (re-)initialization methods
    (:func:`_initializes`), which read weights to fill them, never inside a forward pass (a false read
    there would only keep a layer in masked mode, but T5, BERT, ... define ``_init_weights``).
    Sources that are not available read nothing. Cached per class."""
    found = _WEIGHT_READS.get(cls)
    if found is None:
        found = {}
        for c in cls.__mro__:
            if c is nn.Module:
                break   # (nn.Module's own methods, and the mixins after it, run no model's forward)
            for name, where in _own_weight_reads(c).items():
                # forward first: the reason names the method a reader of the report looks at
                if name not in found or where.endswith(".forward"):
                    found[name] = where
        _WEIGHT_READS[cls] = found
    return found


def _own_weight_reads(c: type) -> dict[str, str]:
    """:func:`_forward_weight_reads` of the functions defined in ``c``'s own body."""
    found = _OWN_READS.get(c)
    if found is None:
        found = {}
        for attr, fn in vars(c).items():
            fn = fn.fget if isinstance(fn, property) else fn.__func__ if isinstance(fn, (staticmethod, classmethod)) \
                else fn
            if not inspect.isfunction(fn) or _initializes(attr):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            for name in _READ.findall(src):
                name = re.sub(r"\s+", "", name)  # (self.heads[ k ]: one expression however spaced)
                if name not in found or attr == "forward":
                    found[name] = f"{c.__name__}.{attr}"
        _OWN_READS[c] = found
    return found


def _initializes(method: str) -> bool:
    """Whether a method named so builds or (re-)initializes weights rather than running them: ``__init__``,
    ``_init_weights``, ``init_weights``, ``reset_parameters``, ``post_init``, Mamba's ``init_mamba_weights``
    (the word ``init``, ``initialize`` or ``reset`` in its name; ``get_initial_state`` is none)."""
    return not {"init", "initialize", "reset"}.isdisjoint(method.strip("_").split("_"))


def _entry(fqn: str, mod: nn.Module, action: str, reason: str = "") -> LayerReport:
    R, C = linear_shape(mod)
    if isinstance(mod, Sparse24Linear):
        dtype, mode = mod.dtype, mod.mode
        elt = torch.empty(0, dtype=dtype).element_size()
        q = mod._quant()
        comp = compressed_nbytes(R, C, elt, q.get("quantize"), q.get("group_size"), q.get("symmetric", True))
        mem = memory_nbytes(mod)
    else:
        dtype, mode = mod.weight.dtype, None
        elt = mod.weight.element_size()
        comp = compressed_nbytes(R, C, elt) if C % 4 == 0 else 0
        mem = mod.weight.numel() * elt
    return LayerReport(fqn, (R, C), dtype, action, mode, reason, R * C * elt, comp, mem)


def _not_handled(fqn: str, mod: nn.Module) -> LayerReport | None:
    """A report line for a module owning a weight matrix that sparsify_ leaves alone (a lazy
    module not materialized yet too, Linear or not: it has no shape to read), else None."""
    lazy = next((p for p in mod._parameters.values() if p is not None and is_lazy(p)), None)
    if lazy is not None:
        return LayerReport(fqn, (), lazy.dtype, "skipped",
                           reason=f"not handled: {type(mod).__name__}: lazy, not materialized: run a forward pass "
                                  "first")
    if _is_linear(mod) or isinstance(mod, Sparse24Linear) or isinstance(mod, parametrize.ParametrizationList):
        return None   # (a ParametrizationList: its owner's line says why it is left alone)
    # a parametrized matrix (weight_norm on a Conv1d, orthogonal on an Embedding) lives in the owner's
    # ParametrizationList (as `original`, or weight_norm's `original0` / `original1`), not in its _parameters
    stored = dict(mod._parameters)
    for n, plist in (mod.parametrizations.items() if parametrize.is_parametrized(mod) else ()):
        stored[n] = max(plist._parameters.values(), key=lambda t: -1 if t is None else t.numel(), default=None)
    mats = [(n, p) for n, p in stored.items() if p is not None and p.dim() >= 2]
    if not mats:
        return _quantized_elsewhere(fqn, mod)
    pname, p = mats[0]
    why = next((why for types, why in _NOT_HANDLED if isinstance(mod, types)),
               f"holds a weight matrix ({pname!r}) but is no nn.Linear or transformers Conv1D")
    return LayerReport(fqn, tuple(p.shape), p.dtype, "skipped", reason=f"not handled: {type(mod).__name__}: {why}")


def _quantized_elsewhere(fqn: str, mod: nn.Module) -> LayerReport | None:
    """The report line of a layer quantized by another tool whose weight matrix is no Parameter, else
    None: torch.ao's quantized Linear (``quantize_dynamic``, static quantization: the weight packed in
    an opaque object) and a module holding a 2-D integer or float8 weight as a buffer (GPTQ / AWQ
    ``QuantLinear``'s ``qweight``: position ids and masks are no weights by name)."""
    quantized = sys.modules.get("torch.ao.nn.quantized")   # (imported by torch; looked up: it is deprecated)
    if quantized is not None and isinstance(mod, quantized.Linear):
        return LayerReport(fqn, (mod.out_features, mod.in_features), mod._packed_params.dtype, "skipped",
                           reason=f"not handled: {type(mod).__name__}: quantized by torch.ao.quantization (its "
                                  "weight is packed for torch's quantized kernels); sparsify_ the float model "
                                  "before quantizing it")
    name, b = next(((n, b) for n, b in mod._buffers.items() if b is not None and b.dim() == 2
                    and "weight" in n.lower() and b.dtype not in FLOAT_DTYPES), (None, None))
    if b is None:
        return None
    return LayerReport(fqn, tuple(b.shape), b.dtype, "skipped",
                       reason=f"not handled: {type(mod).__name__}: holds its weight matrix as the buffer {name!r} "
                              f"({str(b.dtype)[6:]}: quantized or packed by another tool); sparsify_ prunes "
                              "floating-point nn.Linear / Conv1D weights: prune the dense original")


def check_min_features(min_features) -> None:
    """ValueError unless ``min_features`` is a non-negative int (not a bool)."""
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"min_features must be a non-negative int, got {min_features!r}")


def _too_small(mod: nn.Module, min_features: int) -> str:
    """Why ``mod`` (an nn.Linear or Conv1D) is too small to prune (a side under ``min_features``), else ""."""
    R, C = linear_shape(mod)
    return f"smaller than min_features={min_features} ({R}x{C}): too small to gain" if min(R, C) < min_features else ""


def _load_hooks_reason(mod: nn.Module) -> str:
    """Why a layer with load_state_dict pre-hooks is not swapped, else "". Such a hook renames or converts
    the layer's entries (an old checkpoint's names) before nn.Module copies them, but a 2:4 layer checks
    its entries before its hooks run (and the whole model's before any), holds other entries than
    ``weight``, and a hook registered with its module would be handed the old layer: carried over it
    could not work, dropped it would be lost without a word."""
    hooks = [h for h in mod._load_state_dict_pre_hooks.values() if getattr(h, "hook", h) is not _whole_model_check]
    if not hooks:
        return ""
    return (f"has {len(hooks)} load_state_dict pre-hook(s) (e.g. renaming old checkpoint keys), which a 2:4 layer "
            "cannot run (it checks and holds other entries than 'weight'); remove them to prune this layer")


EXCLUDED_BY = "excluded by filter_fn"  # the reason a layer filter_fn rejects is skipped


def _skip_reason(fqn, mod, filter_fn, min_features, shared, readers, heads, method, calibration) -> str:
    """Why ``mod`` (an nn.Linear or Conv1D) cannot be swapped, or "" if it can."""
    if not fqn:
        return "the model itself is this Linear (no parent to swap it in); use Sparse24Linear.from_linear"
    if why := _unswappable(mod):   # (prune_layerwise_ keeps these dense with the same words)
        return why
    if why := _load_hooks_reason(mod):
        return why
    if filter_fn is not None and not filter_fn(mod, fqn):
        return EXCLUDED_BY
    if linear_shape(mod)[1] % 4:
        return f"in_features={linear_shape(mod)[1]} is not divisible by 4"
    if why := _too_small(mod, min_features):
        return why
    if not mod.weight.is_floating_point():
        return f"weight dtype {mod.weight.dtype} is not floating point"
    if why := _tied_or_head(fqn, mod, shared, heads):
        return why
    if method in _CALIBRATED_METHODS and calibration is not None and fqn not in calibration and id(mod) in readers:
        # any other layer without statistics is an error (api.guard.check_calibration)
        return (f"no calibration statistics for this layer (method={method!r}): {readers[id(mod)]}, "
                "so calibrate() never sees its input")
    return ""


# --- Hugging Face models (transformers is imported by the caller, never here) ---------

def _is_transformers_model(model: nn.Module) -> bool:
    utils = sys.modules.get("transformers.modeling_utils")
    return utils is not None and isinstance(model, utils.PreTrainedModel)


def _check_foreign_quantization(model: nn.Module) -> None:
    """A transformers model quantized by another method cannot also carry sparse24's config section."""
    if not _is_transformers_model(model):
        return
    qc = getattr(model.config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if qc is not None and method != "sparse24":
        name = getattr(method, "value", method)   # transformers' QuantizationMethod enum: its value, not its repr
        raise ValueError(f"the model is already quantized with {name!r}: its config.json cannot describe 2:4 "
                         f"layers as well, so save_pretrained would lose them (nothing was changed)")


def _after_change(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` all or nothing (:func:`sparse24.nn.state.guard_loading`);
    record the sparse24 section of a transformers model's config (what save_pretrained writes)."""
    guard_loading(model)
    if _is_transformers_model(model):
        from .. import hf  # imports transformers: only for transformers models
        hf.attach(model)

"""Argument checks shared by every layer (the bottom floor: imports only torch).

Each raises a clear TypeError/ValueError naming what is wrong and changes nothing.
"""
from __future__ import annotations

import copy
import math
import numbers
import os
import sys
import warnings
from collections import UserDict

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed: nothing is ever sharded
    DTensor = ()

__all__ = ["FLOAT_DTYPES", "check_bool", "check_seed", "check_nonnegative", "check_weight", "check_nm", "check_mask",
           "check_model", "check_separate_teacher", "check_finite", "computable", "is_exporting", "local_piece",
           "refuse_dtensor", "refuse_inference_mode", "refuse_meta", "row_chunks", "safetensors_headers",
           "refuse_single_batch", "warn_user", "with_context"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_exporting() -> bool:
    """Whether torch.export (strict or not) is tracing: the flag it sets around its trace, which
    ``torch.compiler.is_exporting()`` returns in eager code. Inside a graph Dynamo traces, torch < 2.13
    folds that call to True, under plain torch.compile too (pytorch#176347, fixed by #176499): work
    skipped under export was skipped under torch.compile as well. Dynamo reads the flag as a constant
    (a torch without that private flag: its public call, right from 2.13)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


def check_bool(v, name: str) -> bool:
    """``v`` as a Python bool: a bool or numpy's (``np.True_``); TypeError for anything else (0, None or
    the string ``"False"`` are mistakes where a flag is due)."""
    if isinstance(v, bool):
        return v
    if type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):
        return bool(v)
    raise TypeError(f"{name} must be a bool, got {type(v).__module__}.{type(v).__qualname__} {v!r}"
                    if type(v).__module__ != "builtins" else f"{name} must be a bool, got {type(v).__name__} {v!r}")


def check_seed(seed, name: str = "seed") -> int:
    """``seed`` as an int (a numpy int made a Python one, which ``torch.Generator().manual_seed`` needs):
    ValueError for anything else, or outside the 64 bits a generator takes (None, ``"0"``, 1.5 or a bool
    reached ``manual_seed`` before, whose RuntimeError names no argument)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= seed < 2**64:
        raise ValueError(f"{name} must be an int (64 bits: -2**63 <= {name} < 2**64), got {seed!r}")
    return int(seed)


def as_real(v) -> float:
    """``v`` as a float: a real number (Python's or numpy's) or a one-element real tensor, as torch's
    optimizers take hyper-parameters; TypeError for anything else (bools, strings, complex, None)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not (v.dtype == torch.bool or v.is_complex()):
        return float(v.item())
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"not a real number: {v!r}")
    return float(v)


def check_nonnegative(v, name: str) -> float:
    """``v`` as a float (see :func:`as_real`): ValueError unless it is a finite number >= 0 (bools,
    strings, NaN and inf refused)."""
    try:
        x = as_real(v)
    except TypeError:
        x = None
    if x is None or not 0 <= x < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return x


def with_context(e: Exception, message: str, note: str) -> Exception:
    """The exception to raise (``raise with_context(e, ...)`` in the ``except``) for ``e`` caught where
    more can be said of it: a new one of the same type saying ``message`` when ``e`` is exactly a
    ValueError or TypeError (the errors sparse24's own checks raise), else ``e`` itself with ``note``
    added. A subclass is not re-created: its constructor may take other arguments (a model's own
    ``ShapeError(got, want)``, json.JSONDecodeError), and the caller may catch it by type or read its
    attributes."""
    if type(e) in (ValueError, TypeError):
        new = type(e)(message)
        new.__cause__ = e  # as ``raise ... from e``
        return new
    e.add_note(note)
    return e


def refuse_inference_mode(who: str) -> None:
    """RuntimeError under ``torch.inference_mode()``, for a call that trains: autograd cannot record
    inference tensors (``torch.enable_grad()`` does not undo inference mode for the tensors made in it)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{who} trains (backward and optimizer steps), which torch.inference_mode() rules out: "
                           "call it outside torch.inference_mode() (under torch.no_grad() it trains with autograd "
                           "on; nothing was changed)")


def refuse_meta(t, name: str) -> None:
    """ValueError if ``t`` (a tensor or module) is on the meta device: a mask or a check reads values,
    which it has none of (torch's own error, "Tensor.item() cannot be called on meta tensors", names
    neither). A layer built on the meta device defers its mask until its weights are loaded
    (:mod:`sparse24.nn`)."""
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it has no values to read; load the weights first "
                         "(e.g. load_state_dict(..., assign=True) or module.to_empty(device=...))")


def refuse_dtensor(t, name: str) -> None:
    """TypeError if ``t`` is a DTensor (sharded by fully_shard or parallelize_module): a mask or a
    compression needs the whole weight, and torch's own error ("got mixed torch.Tensor and DTensor")
    names neither the tensor nor the fix."""
    if isinstance(t, DTensor):
        raise TypeError(f"{name} is a DTensor (sharded): call full_tensor() first, or run before fully_shard / "
                        "parallelize_module")


def check_weight(w: torch.Tensor, m: int, name: str = "weight") -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    refuse_dtensor(w, name)
    refuse_meta(w, name)
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {w.dtype}")
    if w.shape[1] % m != 0:
        raise ValueError(f"{name}'s last dimension ({w.shape[1]}) must be divisible by m={m}")


def check_nm(n: int, m: int) -> None:
    # bool is an int to Python, but True as a pattern size is a mistake (mask_nm(w, True, 4) meant 1:4)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, m)) or m < 1 or not 0 <= n <= m:
        raise ValueError(f"need integers 0 <= n <= m and m >= 1, got n={n!r}, m={m!r}")


def check_mask(mask: torch.Tensor, w: torch.Tensor) -> None:
    """Raise a clear error unless ``mask`` is a bool tensor shaped and placed like ``w``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != w.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match weight shape {tuple(w.shape)}")
    if mask.device != w.device:
        raise ValueError(f"mask is on {mask.device} but weight is on {w.device}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")


def check_model(model, filter_fn, who: str = "") -> None:
    """TypeError unless ``model`` is an nn.Module and ``filter_fn`` None or callable;
    ``who`` prefixes the message (e.g. ``"SRSTE: "``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}model must be a torch.nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"{who}filter_fn must be callable (module, fqn) -> bool, got {type(filter_fn).__name__}")


def check_separate_teacher(model: nn.Module, teacher: nn.Module) -> None:
    """ValueError if ``teacher`` is ``model`` or shares a parameter with it (the same Parameter, or
    another over the same memory, as ``nn.Parameter(w.data)`` makes): training or pruning the
    model would change the reference it is measured against (distilling from itself: loss 0)."""
    ids = {id(p) for p in model.parameters()}
    memory = {p.data_ptr() for p in model.parameters() if p.numel()}
    if teacher is model or any(id(p) in ids or (p.numel() and p.data_ptr() in memory) for p in teacher.parameters()):
        raise ValueError("teacher shares parameters with the model: pass a separate copy made before pruning "
                         "(copy.deepcopy(model))")


# Batches passed to the model as keyword arguments, model(**batch): dicts and UserDicts (a tokenizer's
# BatchEncoding, a processor's BatchFeature). Other mappings (a TensorDict) stay one positional argument,
# as models written for them take it.
KEYWORD_BATCH = (dict, UserDict)


def call_with_batch(model: nn.Module, batch):
    """``model`` run on one batch: a :data:`KEYWORD_BATCH` as ``model(**batch)``, a tuple or list as
    ``model(*batch)``, anything else as ``model(batch)`` (every call that runs the model on the user's
    batches: calibrate, prune_layerwise_, learn_masks, distill_, the permutations' example)."""
    if isinstance(batch, KEYWORD_BATCH):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def map_keyword_batch(batch, fn):
    """A :data:`KEYWORD_BATCH` with ``fn`` applied to each entry: a dict, or a copy of a UserDict's own
    type (a BatchEncoding keeps its attribute access, e.g. ``b.attention_mask``); ``batch`` unchanged."""
    if isinstance(batch, UserDict):
        out = copy.copy(batch)
        out.data = {k: fn(v) for k, v in batch.items()}
        return out
    return {k: fn(v) for k, v in batch.items()}


def map_sequence_batch(batch, fn):
    """A tuple or list batch rebuilt with ``fn`` applied to each item, keeping its type: a
    namedtuple's constructor takes its fields as separate arguments, other tuples and lists an
    iterable."""
    items = [fn(v) for v in batch]
    return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)


def refuse_single_batch(batches) -> None:
    """TypeError unless ``batches`` is an iterable of batches: one batch passed alone (a dict or other
    mapping such as a tokenizer's output, a str, a tensor) would be iterated as its keys, characters or
    rows, each run as a batch, and fail deep inside the model with an error naming none of this. Only
    types are looked at: a one-shot iterator or generator is not consumed."""
    if isinstance(batches, (*KEYWORD_BATCH, str, bytes, torch.Tensor)):
        what = (f"a tensor of shape {tuple(batches.shape)}; list(tensor) makes its rows the batches"
                if isinstance(batches, torch.Tensor) else f"a {type(batches).__name__}")
        raise TypeError(f"batches is a single batch ({what}): pass a list of batches, e.g. [batch] (an iterable "
                        "of batches, each one model call)")
    if not (hasattr(batches, "__iter__") or hasattr(type(batches), "__getitem__")):   # (a map-style Dataset)
        raise TypeError("batches must be an iterable of batches (a list of tensors, tuples or dicts), got "
                        f"{type(batches).__name__}")


def _package_dir(name: str) -> str | None:
    mod = sys.modules.get(name)
    file = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside sparse24, transformers and torch:
    the user's line, however deep in those libraries the warning is raised (a fixed ``stacklevel``
    lands in whichever library frame happens to be there, e.g. transformers' loader calling our
    quantizer; Python 3.11 has no ``skip_file_prefixes``). Python's default filter then shows it once
    per user line."""
    skip = tuple(d for d in map(_package_dir, ("sparse24", "transformers", "torch")) if d)
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    # every frame a library one (run from inside them): the caller's line then
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def computable(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, float8 widened to float32 (exactly, inf/NaN kept): torch has no CPU kernels
    for float8 isfinite (found by fuzzing) nor, in torch 2.9, for float8 indexing."""
    x = t.detach()
    return x.float() if x.is_floating_point() and x.element_size() == 1 else x


# Elements per block of rows of the passes over a whole weight (compress, validate, kept_mask, check_finite,
# the masks, the reference backend): their int64 slot indices and float32 temporaries then stay a few MiB,
# where whole they took 2.5-9x a bf16 weight's bytes. Off the CPU blocks are 64x larger: each costs several
# kernel launches (and a host sync where it is checked).
ROW_BLOCK = 1 << 18


def row_chunks(R: int, C: int, device, multiple: int = 1, budget: int | None = None) -> list[slice]:
    """Slices of ``R`` rows of ``C`` columns, ``budget`` elements or so each (at least one row; by default
    :data:`ROW_BLOCK` on the CPU, 64x that elsewhere), each starting at a multiple of ``multiple`` rows.
    The one row-block rule of every whole-weight pass."""
    if budget is None:
        budget = ROW_BLOCK if torch.device(device).type == "cpu" else ROW_BLOCK << 6
    rows = -(-max(1, budget // max(C, 1)) // multiple) * multiple
    return [slice(r0, min(R, r0 + rows)) for r0 in range(0, R, rows)]


def local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(piece, offset)``: a DTensor's own local piece (no communication) and the index of its first
    entry in the whole tensor, for checks that look at each entry alone and name it by its index in
    the whole; any other tensor itself, at offset 0."""
    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(int(o) for o in offset)


def check_finite(t: torch.Tensor, name: str = "weight",
                 why: str = "a 2:4 mask ranks magnitudes, and inf/NaN would spread to every output") -> None:
    """ValueError unless every entry of a floating ``t`` is finite; the message names ``name``,
    how many entries are inf/NaN, where the first one is, and ``why`` (integer tensors pass).
    A DTensor: this rank's own piece is checked, without communication (slicing a DTensor is a
    collective, and its nonzero has no sharding rule), so it may fail on some ranks only."""
    if not t.is_floating_point() or t.is_meta:
        return
    where = " in this rank's shard" if isinstance(t, DTensor) else ""
    t, offset = local_piece(t)
    # a block of rows at a time (row_chunks): isfinite's temporaries over a whole weight took 2.5x its bytes
    # (bf16); the count and the first index are computed on the whole only for a tensor that fails
    x = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    if all(bool(torch.isfinite(computable(x[rows])).all()) for rows in row_chunks(x.shape[0], x[:1].numel(), x.device)):
        return
    bad = ~torch.isfinite(computable(t))
    first = tuple(int(i) + o for i, o in zip(bad.nonzero()[0], offset))
    raise ValueError(f"{name} has {int(bad.sum())} non-finite value(s) (inf/NaN){where}, the first at index {first}"
                     + (f": {why}" if why else ""))


def safetensors_headers(files) -> dict:
    """``{tensor name: (safetensors dtype, shape, file)}`` from the headers of safetensors files
    (nothing else is read), so that a truncated or foreign file is named in one line before any
    work: safetensors checks that a header covers its whole file, and its own error type names
    neither the file nor the fix (found by fuzzing).

    Args:
        files: paths of ``.safetensors`` files (a model's shards).
    Raises:
        ValueError naming the file: missing, not a file, unreadable, or not a whole safetensors file.
    """
    from safetensors import safe_open

    found = {}
    for f in files:
        if not os.path.isfile(f):  # (safetensors says "No such device" of a folder)
            raise ValueError(f"{f} {'is not a file' if os.path.exists(f) else 'does not exist'}: the checkpoint "
                             "names it as one of its safetensors files (a shard missing, or not downloaded?)")
        try:
            open(f, "rb").close()   # "Permission denied" where safetensors would say "No such file or directory"
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    s = fh.get_slice(k)
                    found[k] = (s.get_dtype(), tuple(s.get_shape()), f)
        except OSError as e:  # it could not be opened or read (permissions, I/O): its bytes are not to blame
            raise ValueError(f"cannot read {f}: {e}") from None
        except Exception as e:
            raise ValueError(f"cannot read {f} as a safetensors file (truncated, or not one): "
                             f"{' '.join(str(e).split())[:300]}") from None
    return found

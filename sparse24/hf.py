"""Hugging Face ``transformers``: ``save_pretrained`` / ``from_pretrained`` of 2:4 models (layer 6).

Needs ``transformers`` (``pip install "sparse24[hf]"``); ``import sparse24`` never
imports it (this module is imported once a transformers model is sparsified,
by :func:`from_pretrained`, or by ``import sparse24`` when transformers is
already imported).

**Saving.** :func:`sparse24.sparsify_`, ``compress_``, ``decompress_`` and
``densify_`` keep the sparse24 section of a transformers model's config up to
date (:func:`attach`), and ``model.save_pretrained(d)`` writes it to
``config.json`` as ``quantization_config`` (transformers' place for
third-party quantization and compression methods)::

    "quantization_config": {"quant_method": "sparse24", "format_version": 1, "sparse24_version": "0.1.0",
                            "n": 2, "m": 4, "mode": "compressed", "quantization": null,
                            "layers": {"model.layers.0.mlp.up_proj": {"mode": "compressed", "quantize": null,
                                                                      "kind": "linear"}, ...}}

``mode`` / ``quantization`` summarize the layers (``"mixed"`` when they differ);
``layers`` names every 2:4 layer with its mode, quantization (``null``,
``"int8"``, ``"int4"``; an INT4 entry adds ``"group_size": 128`` and
``"symmetric": true``), and ``kind`` (``"conv1d"`` for GPT-2's transposed
layers); ``group_size`` summarizes the INT4 layers' group sizes when there are
any. The weights file holds each layer's state-dict entries
(``values``/``meta``/``scale``, INT4 ``zero``/``group_size`` too, or
``weight``/``mask``) plus, for a compressed layer, a one-byte ``<layer>.weight``
marker: a ``from_pretrained`` that does not know sparse24 finds it the wrong
shape and raises instead of filling the layer with random weights.

**Loading.** :func:`register` adds sparse24 to transformers' quantizer registry
(:func:`from_pretrained` does it for you), so every loader
(``AutoModelForCausalLM.from_pretrained``, pipelines, ``Trainer`` resume) builds the
model on the meta device, puts an empty :class:`~sparse24.Sparse24Linear` of the
recorded mode in each listed layer (no dense random init, no masks computed on
random weights), lets transformers assign the checkpoint's tensors, then checks
every 2:4 layer (masks, metadata, scales) and re-arms the masking. The result is
the saved model, bit for bit. A folder whose config lists a layer the model
does not have, or whose checkpoint lacks a layer's entries, is an error.
Without sparse24 registered, transformers warns "Unknown quantization type,
got sparse24" and then fails on the markers of compressed layers; masked layers
load as plain Linear layers holding the masked weights (same outputs, masks lost).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ._version import __version__
from .format import INT4_GROUP_SIZES
from .nn import MODES, QUANTIZE, Sparse24Linear, is_conv1d, is_conv1d_class, linear_shape

__all__ = ["register", "from_pretrained", "attach", "sparsity_config", "Sparse24Config", "Sparse24Quantizer",
           "QUANT_METHOD", "FORMAT_VERSION"]

QUANT_METHOD = "sparse24"
# Bumped when the meaning of the section or of the saved tensors changes; a reader refuses newer ones.
FORMAT_VERSION = 1
_KINDS = ("linear", "conv1d")
# The marker saved as "<layer>.weight" of a compressed layer (see the module docstring).
_MARKER_DTYPE = torch.uint8


def sparsity_config(model: nn.Module) -> dict:
    """The sparse24 section describing ``model``'s 2:4 layers (see the module docstring).

    Args:
        model: any ``nn.Module``; a layer reused under several names is listed under each.
    Returns:
        a JSON-serializable dict; ``layers`` is empty when the model has no 2:4 layer.
    Example:
        >>> sparsity_config(model)["layers"]["model.layers.0.mlp.up_proj"]
        {'mode': 'compressed', 'quantize': None, 'kind': 'linear'}
    """
    layers = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, Sparse24Linear) and fqn:
            entry = {"mode": m.mode, **{"quantize": None} | m._quant(),
                     "kind": "conv1d" if is_conv1d_class(m.__dict__.get("_dense_cls")) else "linear"}
            if m.mode == "compressed" and m.values.requires_grad:
                entry["trainable_values"] = True
            layers[fqn] = entry

    def summary(key):
        found = {e[key] for e in layers.values() if key in e}
        return found.pop() if len(found) == 1 else ("mixed" if found else None)
    section = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "sparse24_version": __version__,
               "n": 2, "m": 4, "mode": summary("mode"), "quantization": summary("quantize"), "layers": layers}
    if any("group_size" in e for e in layers.values()):
        section["group_size"] = summary("group_size")
    return section


def _readable(e) -> bool:
    """A layer entry of the section this sparse24 can rebuild a layer from."""
    if not isinstance(e, dict) or e.get("mode") not in MODES or "quantize" not in e \
            or e["quantize"] not in QUANTIZE or e.get("kind", "linear") not in _KINDS:
        return False
    if e["quantize"] == "int4":
        return e.get("group_size") in INT4_GROUP_SIZES and not isinstance(e.get("group_size"), bool) \
            and isinstance(e.get("symmetric"), bool)
    return "group_size" not in e and "symmetric" not in e


class Sparse24Config(QuantizationConfigMixin):
    """The sparse24 section of ``config.json`` as transformers holds it
    (``model.config.quantization_config``); fields as in :func:`sparsity_config`.

    Raises ValueError for a section this sparse24 cannot read (newer format, not
    2:4, unknown mode, quantization or layer kind).
    """

    def __init__(self, layers: dict | None = None, n: int = 2, m: int = 4, mode: str | None = None,
                 quantization: str | None = None, format_version: int = FORMAT_VERSION,
                 sparse24_version: str | None = None, quant_method: str = QUANT_METHOD, **kwargs):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"not a sparse24 section: quant_method={quant_method!r}")
        if isinstance(format_version, bool) or not isinstance(format_version, int) or format_version > FORMAT_VERSION:
            raise ValueError(f"this folder was written in sparse24 format {format_version!r} (sparse24 "
                             f"{sparse24_version}); this sparse24 ({__version__}) reads up to {FORMAT_VERSION}: "
                             "upgrade sparse24")
        if (n, m) != (2, 4):
            raise ValueError(f"sparse24 stores 2:4 layers, the section says {n}:{m}")
        if layers is not None and not isinstance(layers, dict):  # found by fuzzing (an AttributeError before)
            raise ValueError(f"sparse24 section: 'layers' must map layer names to entries, got {layers!r:.60}")
        for fqn, e in (layers or {}).items():
            if not _readable(e):
                raise ValueError(f"sparse24 section: layer {fqn!r} has an unreadable entry {e!r}")
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.sparse24_version = sparse24_version
        self.n, self.m = n, m
        self.mode, self.quantization = mode, quantization
        self.layers = dict(layers or {})
        for k, v in kwargs.items():  # later sparse24 versions may add informative fields
            setattr(self, k, v)


class Sparse24Quantizer(HfQuantizer):
    """transformers' hook for a folder whose config carries a sparse24 section (see the
    module docstring). Registered by :func:`register`; used by ``from_pretrained``
    (loading) and by ``save_pretrained`` of a sparsified model (saving)."""

    # Loading only: a sparse24 folder holds 2:4 tensors; pruning a dense folder is sparsify_'s job.
    requires_calibration = True

    def validate_environment(self, *args, **kwargs):
        return

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """Put an empty 2:4 layer of the recorded mode in every listed place (the model is on
        the meta device here), after checking the checkpoint has each layer's entries."""
        layers = self.quantization_config.layers
        found = _checkpoint_keys(checkpoint_files)
        ignore = []  # compressed layers, whose "<layer>.weight" is the marker
        self._names = {}  # the section's layer name -> the name in this model
        for saved, spec in layers.items():
            fqn = _resolve(model, saved)
            if fqn is None:
                raise ValueError(f"config.json lists 2:4 layer {saved!r}, which {type(model).__name__} built from "
                                 "this config does not have")
            self._names[saved] = fqn
            dense = model.get_submodule(fqn)
            kind = "conv1d" if is_conv1d(dense) else "linear" if isinstance(dense, nn.Linear) else None
            if kind != spec.get("kind", "linear"):
                raise ValueError(f"config.json lists {fqn!r} as a 2:4 {spec.get('kind', 'linear')} layer, but the "
                                 f"model built from this config has a {type(dense).__name__} there")
            shell = _shell(dense, spec)
            if found is not None:
                need = [k for k in shell.state_dict(keep_vars=True) if k != "bias"]
                lacking = [k for k in need if f"{saved}.{k}" not in found]
                if lacking:
                    raise ValueError(f"the checkpoint lacks {', '.join(f'{saved}.{k}' for k in lacking)} for the 2:4 "
                                     f"{spec['mode']} layer {saved!r} that config.json lists")
                _check_stored(found, saved, shell, need, spec)
            model.set_submodule(fqn, shell)
            if spec["mode"] == "compressed":
                ignore += [re.escape(saved), re.escape(fqn)]
        if ignore:  # the markers (one pattern: transformers joins all of them into one regex)
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
                rf"^({'|'.join(dict.fromkeys(ignore))})\.weight$"}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Check every 2:4 layer the checkpoint filled, re-arm the masking, and describe the model
        under its own layer names (a base model's folder loaded into a task model adds a prefix)."""
        for saved, spec in self.quantization_config.layers.items():
            fqn = self._names[saved]
            try:
                model.get_submodule(fqn)._finish_loading(bool(spec.get("trainable_values")))
            except ValueError as e:
                raise ValueError(f"layer {fqn!r}: {e}") from None
        attach(model)
        return model

    def get_state_dict_and_metadata(self, model):
        """Saving: the section is refreshed from the model as it is now (so layers switched one
        by one are described right) and the marker of each compressed layer is added."""
        attach(model)
        state_dict = model.state_dict()
        for fqn, spec in model.config.quantization_config.layers.items():
            if spec["mode"] == "compressed":
                state_dict[f"{fqn}.weight"] = torch.zeros(1, dtype=_MARKER_DTYPE)
        return state_dict, {"sparse24_format": str(FORMAT_VERSION)}

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: every 2:4 layer back to the dense class it replaced."""
        for fqn, m in list(model.named_modules()):
            if isinstance(m, Sparse24Linear) and fqn:
                model.set_submodule(fqn, m.to_dense_module())
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # masked layers train with frozen masks; compressed ones pass gradients through

    @property
    def is_qat_trainable(self) -> bool:
        return True  # Trainer may fine-tune the model itself, not only adapters on it

    @property
    def is_compileable(self) -> bool:
        return True


def _resolve(model: nn.Module, name: str) -> str | None:
    """``name`` as a submodule of ``model``: as is, or with the base-model prefix added or removed
    (transformers loads a base model's checkpoint into a task model and back)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = [name, f"{prefix}.{name}"] + ([name[len(prefix) + 1:]] if name.startswith(prefix + ".") else [])
    for fqn in candidates if prefix else [name]:
        try:
            model.get_submodule(fqn)
            return fqn
        except AttributeError:
            continue
    return None


def _shell(dense: nn.Module, spec: dict) -> Sparse24Linear:
    """An empty 2:4 layer (meta tensors, right shapes and dtypes) to take ``dense``'s place."""
    R, C = linear_shape(dense)
    with torch.device("meta"):
        shell = Sparse24Linear(C, R, bias=dense.bias is not None, mode=spec["mode"], quantize=spec["quantize"],
                               trainable_values=bool(spec.get("trainable_values")), group_size=spec.get("group_size"),
                               symmetric=spec.get("symmetric"), device="meta", dtype=dense.weight.dtype)
    shell._dense_cls = type(dense)
    if dense.bias is not None:
        shell.bias = dense.bias
    if spec["mode"] == "compressed":
        # While loading, transformers' _init_weights of a parent module may read child.weight (GPT-2's
        # c_proj; ~500 such reads across its models) to initialize missing entries: a meta stand-in
        # flagged as loaded makes its init functions skip it. _finish_loading removes it.
        stand_in = torch.empty(R, C, dtype=dense.weight.dtype, device="meta")
        stand_in._is_hf_initialized = True
        shell.__dict__["weight"] = stand_in
    return shell


def _checkpoint_keys(files) -> dict | None:
    """``{tensor name: (safetensors dtype, shape, file)}`` of a model's checkpoint files (headers only), or
    None when they cannot be listed cheaply (then missing entries surface in transformers' load report)."""
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    from safetensors import safe_open
    keys = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as fh:
                keys.update({k: (fh.get_slice(k).get_dtype(), tuple(fh.get_slice(k).get_shape()), f)
                             for k in fh.keys()})
        except Exception as e:  # safetensors' own error type names neither the file nor the fix (found by fuzzing)
            raise ValueError(f"cannot read the weights file {f}: {' '.join(str(e).split())[:300]}") from None
    return keys


_FLOATS = ("F16", "BF16", "F32", "F64")


def _check_stored(found: dict, saved: str, shell: Sparse24Linear, need: list, spec: dict) -> None:
    """Refuse a 2:4 entry stored in a dtype its layer cannot take as it is: transformers casts
    each tensor to the dtype of the layer's buffer, so float8 values became INT8 values without a
    word (found by fuzzing: tests/tools/test_fuzz.py). Floating entries may differ in width, as
    in ``load_state_dict``. Shapes must be the shell's: an INT4 scale of another group size would
    otherwise surface as transformers' size-mismatch report, which does not say why."""
    shapes = {k: tuple(t.shape) for k, t in shell.state_dict(keep_vars=True).items()}
    q = spec["quantize"]
    allowed = {"meta": ("I32",), "mask": ("BOOL",), "scale": ("F16",) if q == "int4" else ("F32",),
               "weight": _FLOATS, "values": {None: _FLOATS, "int8": ("I8",), "int4": ("U8",)}[q],
               "zero": ("U8",), "group_size": ("I32",)}
    for k in need:
        dtype, shape, file = found[f"{saved}.{k}"]
        what = f"the 2:4 {spec['mode']}{' ' + q.upper() if q else ''} layer"
        if k in allowed and dtype not in allowed[k]:
            raise ValueError(f"{file}: '{saved}.{k}' is stored as {dtype}; {what} needs {' or '.join(allowed[k])}")
        if shape != shapes[k]:
            group = f" (group_size {spec['group_size']} in config.json)" if q == "int4" else ""
            raise ValueError(f"{file}: '{saved}.{k}' has shape {shape}; {what}{group} needs {shapes[k]}")


def attach(model: nn.Module) -> None:
    """Record ``model``'s sparse24 section in ``model.config.quantization_config`` and give it
    the quantizer that saves it (what :func:`sparse24.sparsify_` and friends call on a
    transformers model); with no 2:4 layer left, remove both.

    Args:
        model: a ``transformers.PreTrainedModel``.
    """
    register()
    section = sparsity_config(model)
    current = getattr(model, "hf_quantizer", None)
    if not section["layers"]:
        if isinstance(current, Sparse24Quantizer):
            current.remove_quantization_config(model)
        return
    config = Sparse24Config(**section)
    model.config.quantization_config = config
    if isinstance(current, Sparse24Quantizer):
        current.quantization_config = config
    else:
        model.hf_quantizer = Sparse24Quantizer(config, pre_quantized=True)


_REGISTERED = False


def register() -> None:
    """Make transformers (and PEFT, when installed) know sparse24: loaders rebuild 2:4 layers
    from a sparse24 section, and LoRA wraps :class:`~sparse24.Sparse24Linear` (see
    :mod:`sparse24.lora`). Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantization_config(QUANT_METHOD)(Sparse24Config)
        register_quantizer(QUANT_METHOD)(Sparse24Quantizer)
    if importlib.util.find_spec("peft") is not None:
        from . import lora
        lora.register()
    _REGISTERED = True


def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a model folder, rebuilding its 2:4 layers bit for bit (see the module docstring).

    The same as ``cls.from_pretrained(path, **kwargs)`` once sparse24 is registered, which
    this does first; a folder without a sparse24 section loads as usual.

    Args:
        cls: a transformers model class (``LlamaForCausalLM``, ``AutoModelForCausalLM``, ...).
        path: a folder written by ``save_pretrained`` (or ``python -m sparse24 prune``), or a Hub id.
        **kwargs: passed to ``cls.from_pretrained`` (``dtype``, ``device_map``, ...).
    Returns:
        the model, its 2:4 layers as :class:`~sparse24.Sparse24Linear` in their saved modes.
    Example:
        >>> model = sparse24.from_pretrained(LlamaForCausalLM, "out/llama-2of4")
    """
    register()
    return cls.from_pretrained(path, **kwargs)


def read_section(folder: str | os.PathLike) -> dict | None:
    """The sparse24 section of ``folder/config.json``, or None when it has none."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None

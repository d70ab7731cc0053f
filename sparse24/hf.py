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
marker right after them: a ``from_pretrained`` that does not know sparse24 finds it the wrong
shape and raises instead of filling the layer with random weights. Every tensor keeps the model's own
name, also for a family whose older checkpoint names transformers would restore on save (ViT, Llava,
...: see :meth:`Sparse24Quantizer.get_state_dict_and_metadata`).

**Loading.** :func:`register` adds sparse24 to transformers' quantizer registry
(:func:`from_pretrained` does it for you), so every loader
(``AutoModelForCausalLM.from_pretrained``, pipelines, ``Trainer`` resume) builds the
model on the meta device, puts an empty :class:`~sparse24.Sparse24Linear` of the
recorded mode in each listed layer (no dense random init, no masks computed on
random weights), lets transformers assign the checkpoint's tensors, then checks
every 2:4 layer (masks, metadata, scales) and re-arms the masking. The result is
the saved model, bit for bit. In another dtype (``dtype=`` or config.json's ``dtype``), a float
layer's kept values or masked weight are cast to it as transformers casts every float tensor;
INT8 / INT4 values, metadata and scales stay as stored. The section's layer names are renamed as
transformers renames the checkpoint's tensors (its conversion mapping: the base-model prefix added or
removed, ``CLIPVisionModel`` dropping ``vision_model.``); a load that would put a 2:4 layer's entries
anywhere else (a ``key_mapping`` moving them) is an error. Layers the config lists in a head or tower the
model lacks (an MLM folder loaded as a classifier, a ``CLIPModel`` folder as ``CLIPVisionModel``) are left
out with one warning, as transformers drops an unused head's entries. A folder whose config lists a layer
the base model does not have, or whose checkpoint lacks a layer's entries (its bias included) or holds
ones the listed layer has no place for (zero points of an INT4 layer listed as symmetric), is an error.
A tower's config class reads only its part of a two-tower folder's config.json, without the section:
:func:`from_pretrained` gives it the folder's (a plain ``CLIPVisionModel.from_pretrained`` of a
``CLIPModel`` folder loads without sparse24).
Without sparse24 registered, transformers warns "Unknown quantization type,
got sparse24" and then fails on the markers of compressed layers; masked layers
load as plain Linear layers holding the masked weights (same outputs, masks lost).

**Casting, dequantizing, resizing.** A loaded model casts as the same model in memory does
(``model.half()``, ``.float()``, ``.to(dtype)``: transformers refuses the first two for a model its loader
quantized, so the quantizer clears that mark, ``model.is_quantized``). ``model.dequantize(dtype=None)``
turns every 2:4 layer back into the dense class it replaced, holding the masked (INT8 / INT4: dequantized)
weight in the layer's dtype, or in ``dtype`` when given (those layers only, as transformers' own
quantizers). ``model.resize_token_embeddings`` of a model whose output head is a 2:4 layer is refused
before anything changes when it would resize the head (transformers resized the input embedding, then
failed on the head; a call keeping its size, ``len(tokenizer)`` equal to the vocabulary, passes): make the
head dense (``model.set_output_embeddings(model.get_output_embeddings().to_dense_module())``), resize,
then prune it again (``sparsify_(model, skip_output_head=False)``).
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import os
import re

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ._checks import check_model, safetensors_headers, warn_user
from ._version import __version__
from .format import INT4_GROUP_SIZES
from .nn import MODES, QUANTIZE, Sparse24Linear, is_conv1d, is_conv1d_class, linear_shape
from .nn.state import _ALL_KEYS, guard_loading

__all__ = ["register", "from_pretrained", "check_folder", "read_config", "check_blocks",
           "attach", "sparsity_config", "Sparse24Config", "Sparse24Quantizer",
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
        Not run as a test: ``model`` stands for a Llama model after ``sparsify_(model, mode="compressed")``.

        >>> sparsity_config(model)["layers"]["model.layers.0.mlp.up_proj"]  # doctest: +SKIP
        {'mode': 'compressed', 'quantize': None, 'kind': 'linear'}
    """
    check_model(model, None, "sparsity_config: ")
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

    Args:
        layers: ``{fqn: entry}``, each entry ``{"mode", "quantize", "kind"}`` (INT4: with
            ``"group_size"`` and ``"symmetric"``; ``"trainable_values"`` optional), as
            :func:`sparsity_config` writes them; the entries are what layers are rebuilt from.
        n, m: the pattern: 2 and 4.
        mode, quantization: informative summaries of the entries (one value, ``"mixed"`` or None);
            not checked, as nothing is built from them.
        format_version: the sparse24 format the folder was written in (at most this sparse24's).
        sparse24_version: the sparse24 that wrote it (informative).
        quant_method: ``"sparse24"``.
        **kwargs: fields a later sparse24 may add (informative; a name starting with ``_`` or
            naming an attribute of this class, such as ``to_dict``, is refused).

    Raises ValueError for a section this sparse24 cannot read (newer format, not
    2:4, a layer entry's unknown mode, quantization or layer kind).
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
            if k.startswith("_") or hasattr(type(self), k):  # would replace a method transformers calls (to_dict)
                raise ValueError(f"sparse24 section: field {k!r} names an attribute of the config class, not a "
                                 "section field")
            setattr(self, k, v)


class Sparse24Quantizer(HfQuantizer):
    """transformers' hook for a folder whose config carries a sparse24 section (see the
    module docstring). Registered by :func:`register`; used by ``from_pretrained``
    (loading) and by ``save_pretrained`` of a sparsified model (saving)."""

    # Loading only: a sparse24 folder holds 2:4 tensors; pruning a dense folder is sparsify_'s job.
    requires_calibration = True

    def validate_environment(self, *args, device_map=None, **kwargs):
        """Called again with the resolved device map (transformers' ``_get_device_map``): 2:4
        layers must hold their tensors when loaded (they are checked, and compressed ones have no
        dense weight for accelerate's offload hooks to stream in), so a map sending one to disk is
        refused before anything loads."""
        if not isinstance(device_map, dict) or not getattr(self, "_names", None):
            return
        offloaded = []
        for fqn in self._names.values():
            owner = max((k for k in device_map if k == "" or fqn == k or fqn.startswith(k + ".")), key=len,
                        default=None)
            if owner is not None and device_map[owner] in ("disk", "meta"):
                offloaded.append(fqn)
        if offloaded:
            raise ValueError(f"device_map sends 2:4 layer(s) {', '.join(offloaded[:4])}"
                             f"{' ...' if len(offloaded) > 4 else ''} to disk: sparse24 layers load into memory "
                             "(GPU or CPU). Give max_memory room for them (2:4 layers are 0.56x their dense "
                             "size), or a device_map placing them on a device")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """Put an empty 2:4 layer of the recorded mode in every listed place (the model is on
        the meta device here), after checking the checkpoint has each layer's entries."""
        layers = self.quantization_config.layers
        found = _checkpoint_keys(checkpoint_files)
        ignore = []  # compressed layers, whose "<layer>.weight" is the marker
        self._names = {}  # the section's layer name -> the name in this model
        self._files = {}  # the section's layer name -> the checkpoint file holding its entries
        rename, left_out = _loader_names(model), []
        for saved, spec in layers.items():
            fqn = _resolve(model, saved, rename)
            if fqn is None and _in_head(model, rename(f"{saved}.weight")[0].removesuffix(".weight")):
                # A head or tower this model class lacks (an MLM folder loaded as a classifier, a CLIP folder as
                # its vision tower): transformers drops its entries, reporting them as unexpected; its 2:4 layer
                # goes with them (update_weight_conversions checks none of them loads into the model).
                left_out.append(saved)
                continue
            if fqn is None:
                raise ValueError(f"config.json lists 2:4 layer {saved!r}, which {type(model).__name__} built from "
                                 "this config does not have")
            self._names[saved] = fqn
            dense = model.get_submodule(fqn)
            kind = "conv1d" if is_conv1d(dense) else "linear" if isinstance(dense, nn.Linear) else None
            if kind != spec.get("kind", "linear"):
                raise ValueError(f"config.json lists {fqn!r} as a 2:4 {spec.get('kind', 'linear')} layer, but the "
                                 f"model built from this config has a {type(dense).__name__} there")
            try:
                shell = _shell(dense, spec)
            except (ValueError, TypeError) as e:  # e.g. in_features not divisible by 4 (found by fuzzing)
                raise ValueError(f"config.json lists {fqn!r} as a 2:4 layer, which it cannot be: {e}") from None
            if found is not None:
                # The bias too: transformers' init never reaches a Sparse24Linear, so a missing one stayed
                # uninitialized memory.
                need = list(shell.state_dict(keep_vars=True))
                lacking = [k for k in need if f"{saved}.{k}" not in found]
                if lacking:
                    raise ValueError(f"the checkpoint lacks {', '.join(f'{saved}.{k}' for k in lacking)} for the 2:4 "
                                     f"{spec['mode']} layer {saved!r} that config.json lists")
                _check_stored(found, saved, shell, need, spec)
                _check_unplaced(found, saved, need, spec)
                self._files[saved] = found[f"{saved}.{need[0]}"][2]
            model.set_submodule(fqn, shell)
            if spec["mode"] == "compressed":
                ignore += [re.escape(saved), re.escape(fqn)]
        if left_out:  # (one warning: a CLIP folder loaded as its vision tower leaves out every text layer)
            warn_user(f"config.json lists 2:4 layer(s) {', '.join(map(repr, left_out[:3]))}"
                      f"{f', ... ({len(left_out)} in all)' if len(left_out) > 3 else ''} in a head or another tower "
                      f"{type(model).__name__} does not have: their entries are not loaded")
        if ignore:  # the markers (one pattern: transformers joins all of them into one regex)
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
                rf"^({'|'.join(dict.fromkeys(ignore))})\.weight$"}
        return model

    def update_weight_conversions(self, weight_conversions, model):
        """Loading, once the renamings are known (the model's conversion mapping, a ``key_mapping`` given to
        ``from_pretrained``): refuse a load that would put a 2:4 layer's entries anywhere but in the 2:4 layer
        placed for it, or an entry of a layer left out (a head the model lacks) into the model. A masked
        layer's weight would load into a plain Linear, its mask dropped without an error."""
        weight_conversions = super().update_weight_conversions(weight_conversions, model)
        names = getattr(self, "_names", None)
        if names is None:  # (not a load this quantizer prepared)
            return weight_conversions
        rename = _loader_names(model, weight_conversions)
        own = set(model.state_dict())
        for saved in self.quantization_config.layers:
            fqn = names.get(saved)
            entries = list(model.get_submodule(fqn).state_dict(keep_vars=True)) if fqn else _ALL_KEYS
            for k in entries:
                got, converted = rename(f"{saved}.{k}")
                if fqn is not None and (got != f"{fqn}.{k}" or converted):
                    raise ValueError(f"the load would {'convert' if converted else 'put'} '{saved}.{k}' "
                                     f"{'into' if converted else 'at'} {got!r}, not load it as it is into the 2:4 "
                                     f"layer {fqn!r} config.json lists as {saved!r} (a key_mapping or "
                                     f"{type(model).__name__}'s conversion mapping takes it): refused, the layer "
                                     "would lose its 2:4 entries")
                if fqn is None and got in own:
                    raise ValueError(f"config.json lists 2:4 layer {saved!r}, which {type(model).__name__} does not "
                                     f"have, but the load would put its '{saved}.{k}' into {got!r} (a key_mapping or "
                                     "the model's conversion mapping renames it): refused, a plain layer would take "
                                     "it without the layer's other 2:4 entries")
        return weight_conversions

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Check every 2:4 layer the checkpoint filled, re-arm the masking, and describe the model
        under its own layer names (a base model's folder loaded into a task model adds a prefix)."""
        for saved, spec in self.quantization_config.layers.items():
            fqn = self._names.get(saved)
            if fqn is None:
                continue  # a head this model lacks (see _process_model_before_weight_loading)
            try:
                model.get_submodule(fqn)._finish_loading(bool(spec.get("trainable_values")))
            except ValueError as e:
                where = self._files.get(saved)
                raise ValueError(f"{where + ': ' if where else ''}layer {fqn!r}: {e}") from None
        guard_loading(model)
        attach(model)
        # transformers' preprocess_model marked the model quantized, and a quantized model refuses .half() /
        # .float() ("already casted to the correct dtype"); a 2:4 model casts as the same model in memory does
        # (float values and weights cast, INT8 / INT4 values and scales kept), where nothing sets the mark
        model.is_quantized = False
        return model

    def get_state_dict_and_metadata(self, model):
        """Saving: the section is refreshed from the model as it is now (so layers switched one
        by one are described right) and the marker of each compressed layer is added right after
        the layer's entries: save_pretrained cuts shards in this order, and a shard loaded on its own
        (Trainer's resume of a sharded checkpoint) then rarely holds a marker without its layer.

        The folder holds the model's own tensor names, which the section lists: for a family with a
        checkpoint conversion mapping in transformers (ViT, DeiT, BEiT, Dinov2, Llava, Gemma 3, Qwen2-VL,
        Mistral 3, ...) save_pretrained would rename the tensors back to the family's older checkpoint
        names after this call (``revert_weight_conversion``; Dinov2's SwiGLU gate/up fused into one
        tensor, 2:4 entries and markers concatenated), and the folder would not load. So such a model
        gets ``model._weight_conversions = []``, what transformers records after loading a folder
        that needed no renaming: nothing is reverted (the same as ``save_original_format=False``), and
        transformers' loaders take the model's own names as they are. It stays set, so later saves
        of the model write its own names too, until the last 2:4 layer goes (``densify_`` removes
        the quantizer, and with it the attribute: a dense model saves in the older names again).
        Families without a mapping (Llama, GPT-2, BERT) save as before, byte for byte."""
        attach(model)
        _keep_own_names(model)
        state_dict = model.state_dict()
        compressed = {fqn for fqn, spec in model.config.quantization_config.layers.items()
                      if spec["mode"] == "compressed"}
        last = {k.rpartition(".")[0]: k for k in state_dict if k.rpartition(".")[0] in compressed}
        ordered = type(state_dict)()   # (markers on the CPU, whatever torch's default device)
        for k, v in state_dict.items():
            ordered[k] = v
            if last.get(k.rpartition(".")[0]) == k:
                ordered[f"{k.rpartition('.')[0]}.weight"] = torch.zeros(1, dtype=_MARKER_DTYPE, device="cpu")
        for fqn in sorted(compressed - set(last)):  # (a layer with no entries: none, but never without a marker)
            ordered[f"{fqn}.weight"] = torch.zeros(1, dtype=_MARKER_DTYPE, device="cpu")
        if hasattr(state_dict, "_metadata"):
            ordered._metadata = state_dict._metadata
        # no metadata of our own: config.json carries the format, and safetensors writes a header of
        # two or more metadata keys in random order (two saves of one model differed byte for byte)
        return ordered, {}

    def dequantize(self, model, dtype=None):
        """``model.dequantize(dtype=None)``: every 2:4 layer back to the dense class it replaced, holding the
        masked (INT8 / INT4: dequantized) weight in the layer's dtype, or in ``dtype`` when given (as
        transformers' own quantizers, only the layers dequantized are cast); then the sparse24 section goes.
        transformers' default fills in ``config.dtype``, which ``model.half()`` does not update: not taken."""
        model = self._dequantize(model, dtype=dtype)
        self.remove_quantization_config(model)
        return model

    def _dequantize(self, model, dtype=None):
        for fqn, m in list(model.named_modules()):
            if isinstance(m, Sparse24Linear) and fqn:
                dense = m.to_dense_module()
                model.set_submodule(fqn, dense if dtype is None else dense.to(dtype))
        return model

    def is_serializable(self):
        """True: transformers may save a model loaded or sparsified with this quantizer
        (``save_pretrained`` writes the 2:4 tensors as they are held)."""
        return True

    @property
    def is_trainable(self) -> bool:
        """True: transformers' Trainer may train the model (PEFT adapters on it too)."""
        return True  # masked layers train with frozen masks; compressed ones pass gradients through

    @property
    def is_qat_trainable(self) -> bool:
        """True: Trainer may train the quantized model's own weights, not only adapters."""
        return True  # Trainer may fine-tune the model itself, not only adapters on it

    @property
    def is_compileable(self) -> bool:
        """True: the model may run under ``torch.compile`` (transformers' compiled generation)."""
        return True


def _keep_own_names(model: nn.Module) -> None:
    """Make save_pretrained's renaming to older checkpoint names a no-op for ``model`` (see
    :meth:`Sparse24Quantizer.get_state_dict_and_metadata`), where it would do anything: the
    conversions it would revert are the model's recorded ones, else its family's mapping as
    ``revert_weight_conversion`` builds it (no legacy renamings, no prefix changes)."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if conversions:  # (None or [] already: transformers keeps the names and the order as they are)
        model._weight_conversions = []


def _loader_names(model: nn.Module, conversions=None):
    """A function giving the name transformers' loader gives a checkpoint tensor of ``model``, and whether a
    converter (an op: fused tensors split, experts stacked, a transpose) takes it: ``conversions``
    (by default the model's conversion mapping, as ``from_pretrained`` builds it without a ``key_mapping``)
    applied as the loader applies them (``rename_source_key``), which then adds or removes the base-model
    prefix where that names a tensor of the model (a task model's folder loaded as a base model and back);
    a name the model has and the renamings lose stays. transformers 5's ``CLIPVisionModel``, for one, has no
    ``vision_model.`` wrapper and drops that prefix through its mapping."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    # (a copy of given ones: renaming marks a transform used, which save_pretrained later reads)
    conversions = get_model_conversion_mapping(model) if conversions is None else copy.deepcopy(conversions)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    own, prefix = model.state_dict(), model.base_model_prefix

    def rename(key: str) -> tuple[str, bool]:
        new, pattern = rename_source_key(key, renamings, converters, prefix, own)
        if new not in own and key in own:
            new, pattern = rename_source_key(key, [], [], prefix, own)
        return new, pattern is not None
    return rename


def _resolve(model: nn.Module, name: str, rename) -> str | None:
    """``name`` (a layer the section lists) as a submodule of ``model``: the one transformers' loader puts the
    tensor ``<name>.weight`` in (``rename``, from :func:`_loader_names`), None when it puts it in none."""
    loaded = rename(f"{name}.weight")[0]
    if not loaded.endswith(".weight"):
        return None
    try:
        model.get_submodule(loaded[:-7])
    except AttributeError:
        return None
    return loaded[:-7]


def _in_head(model: nn.Module, name: str) -> bool:
    """Whether ``name`` (a listed layer ``model`` lacks, as the loader renames it) lies outside ``model``'s
    base-model part: not under the base model prefix nor under a part of the base model (a base model's
    folder names its layers without the prefix). False for a model without a base model prefix."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return False
    base = getattr(model, prefix, model)  # a task model holds its base model there; a base model is its own
    first = name.partition(".")[0]
    return first != prefix and first not in (base if isinstance(base, nn.Module) else model)._modules


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
    """``{tensor name: (safetensors dtype, shape, file)}`` of a model's checkpoint files (headers only),
    or None when they cannot be listed cheaply (then missing entries surface in transformers' load report)."""
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    return safetensors_headers(files)


# sparse24.format.FLOAT_DTYPES as safetensors headers name them: the dtypes a weight is pruned and stored in
FLOAT_SAFETENSORS_DTYPES = ("F16", "BF16", "F32", "F64")


def _check_stored(found: dict, saved: str, shell: Sparse24Linear, need: list, spec: dict) -> None:
    """Refuse a 2:4 entry stored in a shape or a dtype its layer cannot take as it is:
    transformers casts each tensor to the dtype of the layer's buffer, so float8 values became
    INT8 values without a word, and reports a wrong shape naming no file (both found by fuzzing:
    tests/tools/test_fuzz.py); an INT4 scale of another group size has another shape. Floating
    entries may differ in width, as in ``load_state_dict``."""
    shapes = {k: tuple(t.shape) for k, t in shell.state_dict(keep_vars=True).items()}
    q = spec["quantize"]
    allowed = {"meta": ("I32",), "mask": ("BOOL",), "scale": ("F16",) if q == "int4" else ("F32",),
               "weight": FLOAT_SAFETENSORS_DTYPES,
               "values": {None: FLOAT_SAFETENSORS_DTYPES, "int8": ("I8",), "int4": ("U8",)}[q],
               "zero": ("U8",), "group_size": ("I32",)}
    for k in need:
        dtype, shape, file = found[f"{saved}.{k}"]
        what = f"the 2:4 {spec['mode']}{' ' + q.upper() if q else ''} layer"
        if tuple(shape) != shapes[k]:
            group = f", group_size {spec['group_size']}" if q == "int4" else ""
            raise ValueError(f"{file}: '{saved}.{k}' has shape {tuple(shape)}; {what} config.json describes "
                             f"({shell.out_features}x{shell.in_features}{group}) needs {shapes[k]}")
        if k in allowed and dtype not in allowed[k]:
            raise ValueError(f"{file}: '{saved}.{k}' is stored as {dtype}; {what} needs {' or '.join(allowed[k])}")


def _check_unplaced(found: dict, saved: str, need: list, spec: dict) -> None:
    """Refuse a stored 2:4 entry the layer config.json describes has no place for (``need``: that
    layer's entry names): transformers drops it as UNEXPECTED and the layer computes something else
    (zero points of a layer listed as symmetric INT4: wrong logits, no error)."""
    for k in _ALL_KEYS:
        if k in need or (k == "weight" and spec["mode"] == "compressed"):  # (a compressed layer's marker)
            continue
        if f"{saved}.{k}" in found:
            q = spec["quantize"]
            hint = " (zero points are stored for an asymmetric INT4 layer: is 'symmetric' wrong?)"
            raise ValueError(f"{found[f'{saved}.{k}'][2]}: '{saved}.{k}' is stored, but the 2:4 {spec['mode']}"
                             f"{' ' + q.upper() if q else ''} layer config.json describes for {saved!r} has no such "
                             f"entry: config.json does not describe the stored layer{hint if k == 'zero' else ''}")


def attach(model: nn.Module) -> None:
    """Record ``model``'s sparse24 section in ``model.config.quantization_config`` and give it
    the quantizer that saves it (what :func:`sparse24.sparsify_` and friends call on a transformers
    model); with no 2:4 layer left, remove both.

    Args:
        model: a ``transformers.PreTrainedModel``.
    """
    check_model(model, None, "attach: ")
    register()
    section = sparsity_config(model)
    current = getattr(model, "hf_quantizer", None)
    if not section["layers"]:
        if isinstance(current, Sparse24Quantizer):
            current.remove_quantization_config(model)
        return
    config = Sparse24Config(**section)
    _guard_resizes(type(model))   # (PreTrainedModel's own method too: every 2:4 model comes through here)
    if isinstance(current, Sparse24Quantizer):
        current.quantization_config = config
    else:
        _own_config(model)
        model.hf_quantizer = Sparse24Quantizer(config, pre_quantized=True)
    model.config.quantization_config = config


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a config object of its own (sub-configs included, wherever its modules hold them) before
    its sparse24 section is written into it: models built from one config object share it (a teacher and a
    student, ``Model(cfg)`` twice), and the section made the dense one save a folder that did not load."""
    old = model.config
    new = copy.deepcopy(old)
    swap = {}

    def pair(a, b):   # every config at every depth (Qwen2.5-Omni: thinker_config.text_config) with its copy
        swap[id(a)] = b
        for k, v in vars(a).items():
            if isinstance(v, PretrainedConfig) and id(v) not in swap:
                pair(v, getattr(b, k))

    pair(old, new)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if id(value) in swap:
                setattr(module, name, swap[id(value)])


def _guard_resize(resize):
    """A model class's ``resize_token_embeddings``, refusing (before anything changes) a call that would resize
    a 2:4 output head (also one a LoRA layer wraps): transformers resizes the input embedding first and fails on
    the head after (no ``nn.Linear``), leaving the embedding, the head and ``config.vocab_size`` disagreeing (a
    folder saved then does not load). A call that keeps the head's size passes (``len(tokenizer)`` equal to the
    vocabulary, ``None``); a compressed head, which has no dense ``weight`` for transformers to read, is not
    touched then. The arguments go on as given (a class's own method may take fewer)."""
    @functools.wraps(resize)
    def resize_token_embeddings(self, *args, **kwargs):
        head = self.get_output_embeddings()
        base = head.get_base_layer() if hasattr(head, "get_base_layer") else head
        if not isinstance(base, Sparse24Linear):
            return resize(self, *args, **kwargs)
        given = dict(zip(("new_num_tokens", "pad_to_multiple_of"), args), **kwargs)
        new_num_tokens, pad = given.get("new_num_tokens"), given.get("pad_to_multiple_of")
        rows = getattr(self.get_input_embeddings(), "num_embeddings", base.out_features)
        n = rows if new_num_tokens is None else new_num_tokens
        if pad:
            n = -(-n // pad) * pad
        if n == rows == base.out_features or new_num_tokens is pad is None:
            return self.get_input_embeddings() if base.mode == "compressed" or base is not head else \
                resize(self, *args, **kwargs)
        name = next((fqn for fqn, m in self.named_modules() if m is head), "the output head")
        raise TypeError(f"resize_token_embeddings: {name} is a 2:4 layer (Sparse24Linear), whose rows transformers "
                        "cannot resize (nothing was changed): make it dense first, "
                        "model.set_output_embeddings(model.get_output_embeddings().to_dense_module()), resize, "
                        "then prune it again (sparse24.sparsify_(model, skip_output_head=False, ...))")
    resize_token_embeddings._sparse24_guard = True
    return resize_token_embeddings


def _guard_resizes(cls: type) -> None:
    """Guard (:func:`_guard_resize`) ``resize_token_embeddings`` of ``cls`` and of every class above it that
    defines its own: an override (MobileBERT's resizes its own head first) runs before the base class's."""
    for c in cls.__mro__:
        own = vars(c).get("resize_token_embeddings")
        if callable(own) and not getattr(own, "_sparse24_guard", False):
            setattr(c, "resize_token_embeddings", _guard_resize(own))


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
    this does first; a folder without a sparse24 section loads as usual. For a tower of a local two-tower
    folder (``CLIPVisionModel`` of a ``CLIPModel`` folder), whose config class reads only its sub-config
    (no ``quantization_config``), the config read from the folder is passed with the folder's section
    (``kwargs`` naming a config attribute set on it, as transformers does when it reads the config).

    Args:
        cls: a transformers model class (``LlamaForCausalLM``, ``AutoModelForCausalLM``, ...).
        path: a folder written by ``save_pretrained`` (or ``python -m sparse24 prune``), or a Hub id.
        **kwargs: passed to ``cls.from_pretrained`` (``dtype``, ``device_map``, ...).
    Returns:
        the model, its 2:4 layers as :class:`~sparse24.Sparse24Linear` in their saved modes.
    Example:
        Not run as a test: needs transformers and a model folder on disk.

        >>> from transformers import LlamaForCausalLM  # doctest: +SKIP
        >>> model = sparse24.from_pretrained(LlamaForCausalLM, "out/llama-2of4")  # doctest: +SKIP
    """
    if not (isinstance(cls, type) and callable(getattr(cls, "from_pretrained", None))):
        raise TypeError(f"cls must be a transformers model class (with from_pretrained), got {cls!r}")
    register()
    import transformers

    subfolder, config = kwargs.get("subfolder") or "", kwargs.get("config")
    folder = os.path.join(path, subfolder) if isinstance(subfolder, str) else path
    given = isinstance(config, transformers.PretrainedConfig)
    # Checked here when transformers reads the files check_folder reads: its own config.json (or a config
    # object), model.safetensors or its index; other files (variants, .bin, GGUF) and remote code are
    # transformers' own to read.
    ours = (isinstance(subfolder, str) and (config is None or given) and not kwargs.get("trust_remote_code")
            and kwargs.get("variant") is None and kwargs.get("gguf_file") is None
            and kwargs.get("use_safetensors") is not False)
    if ours and os.path.isdir(folder) and (given or os.path.isfile(os.path.join(folder, "config.json"))):
        check_folder(folder, cls, config if given else None, bool(kwargs.get("ignore_mismatched_sizes")))
        if not given:
            config, tower = _folder_config(folder, cls)
            if tower:  # a tower of a two-tower folder: transformers would load it without the section
                kwargs = {**_onto_config(config, kwargs), "config": config}
    return cls.from_pretrained(path, **kwargs)


def _folder_config(folder, cls) -> tuple:
    """``(config, tower)``: ``folder/config.json`` as ``cls`` reads it (:func:`read_config`), given the folder's
    sparse24 section where it has none (``tower`` True): a tower's config class (``CLIPVisionConfig``,
    ``SiglipTextConfig``) reads only its part of a two-tower folder's config.json (``vision_config``), and
    transformers gives that no ``quantization_config``."""
    config = read_config(folder, cls)
    section = read_section(folder) if getattr(config, "quantization_config", None) is None else None
    if section is not None:
        config.quantization_config = section
    return config, section is not None


def _onto_config(config, kwargs: dict) -> dict:
    """Set on ``config`` the ``kwargs`` naming one of its attributes (``output_hidden_states=True``), as
    transformers does when it reads the config itself rather than being given one; the others (``dtype`` too,
    which transformers also keeps as an argument) are returned."""
    rest = {}
    for k, v in kwargs.items():
        if k.startswith("_") or k in ("dtype", "torch_dtype") or not hasattr(config, k):
            rest[k] = v
        else:
            setattr(config, k, v)
    return rest


# The elements a model may hold beyond its checkpoint's (freshly initialized heads, buffers) before
# check_folder refuses it: the memory a folder makes transformers allocate stays within a bound
# from the checkpoint's size (its elements plus as many again, plus this).
EXTRA_ELEMENTS = 2 ** 24


def read_config(folder: str | os.PathLike, cls=None):
    """``folder/config.json`` as transformers reads it (``cls.config_class``, or ``AutoConfig``),
    every failure one ValueError naming the file: transformers' config classes raise KeyError,
    AttributeError, ZeroDivisionError, ... on corrupt values (found by fuzzing). The folder's own code
    is never run (``trust_remote_code=False``; only a caller's ``from_pretrained(...,
    trust_remote_code=True)`` skips these checks): a config whose ``auto_map`` needs it, for the
    config or for ``cls`` (an Auto class), is refused. transformers would otherwise ask on stdin and run
    the code on "y", even with the caller's ``trust_remote_code=False``."""
    import transformers

    path = os.path.join(folder, "config.json")
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: nesting too deep for json's decoder)
        raise ValueError(f"{path}: not a readable JSON file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    config_cls = getattr(cls, "config_class", None) or transformers.AutoConfig
    auto_map = data.get("auto_map") if isinstance(data.get("auto_map"), dict) else {}

    def needs_code(name):
        return ValueError(f"{path}: its auto_map names the folder's own code for {name} ({auto_map[name]!r:.80}), "
                          "which sparse24 runs only when from_pretrained is given trust_remote_code=True (the "
                          "command line never runs it)")
    try:
        config = config_cls.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:
        model_type = data.get("model_type")   # (a type transformers knows is read by its own class)
        if config_cls is transformers.AutoConfig and "AutoConfig" in auto_map and not (
                isinstance(model_type, str) and model_type in transformers.CONFIG_MAPPING):
            raise needs_code("AutoConfig") from None
        raise ValueError(f"{path}: transformers cannot read it ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    # an Auto class builds the folder's model class where transformers has none for this config (from_config)
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is not None and getattr(cls, "__name__", None) in auto_map and type(config) not in mapping:
        raise needs_code(cls.__name__)
    return config


def check_blocks(config, headers: dict, folder, path: str | None = None) -> None:
    """Refuse a config describing far more layers than the checkpoint holds, before any model is built
    (a corrupt ``num_hidden_layers`` of 1M made transformers spend 9 s building it). The
    checkpoint's layers are its longest run of numbered names (``model.layers.<i>.``, ``h.<i>.``).
    Valid folders may describe more: ALBERT runs one shared layer group ``num_hidden_layers`` times,
    Funnel's ``num_hidden_layers`` is ``sum(block_sizes)``. So only a count past ``max(4 * most,
    most + 256)`` is refused: that bounds the build; layers the checkpoint really lacks are bounded
    by :func:`check_folder`'s element count.

    Args:
        config: the model's transformers config (its ``num_hidden_layers`` is read, if any).
        headers: ``{tensor name: ...}`` of the checkpoint (:func:`sparse24._checks.safetensors_headers`).
        folder: the checkpoint's folder, named in the error.
        path: the config file to name instead of ``folder/config.json``.
    Raises:
        ValueError naming the file, the count and the checkpoint's layers.
    """
    n = getattr(config, "num_hidden_layers", None)
    runs: dict[str, int] = {}
    for key in headers:
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part.isdigit() and len(part) < 10:
                group = ".".join(parts[:i])
                runs[group] = max(runs.get(group, 0), int(part) + 1)
    most = max(runs.values(), default=0)
    if isinstance(n, int) and not isinstance(n, bool) and n > max(4 * most, most + 256):
        where = max(runs, key=runs.get) if runs else None
        raise ValueError(f"{path or os.path.join(folder, 'config.json')}: num_hidden_layers={n}, but the checkpoint "
                         "holds " + (f"{most} ({where}.0 to {where}.{most - 1})" if where else "no numbered layers"))


def read_shard_index(folder) -> dict | None:
    """``folder``'s ``model.safetensors.index.json`` (None when there is none), checked: an object whose
    ``weight_map`` maps tensor names to shard file names, each a plain name inside the folder (a name
    such as ``../x.safetensors`` or an absolute path would have a tool that rewrites the shards write
    outside the folder; transformers refuses them too). ValueError naming the file otherwise."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    try:
        with open(index) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: nesting too deep for json's decoder)
        raise ValueError(f"{index}: not a readable shard index ({type(e).__name__}: {e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"{index}: 'weight_map' must be an object mapping tensor names to shard file names")
    bad = [v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..") or "\\" in v]
    if bad:
        raise ValueError(f"{index}: shard file {bad[0]!r} is not a plain file name inside the folder")
    return data


def _checkpoint_files(folder) -> list[str] | None:
    """The safetensors files transformers loads from ``folder``: ``model.safetensors`` when there is one
    (an unsharded save_pretrained over a sharded one leaves the old index), else the index's shards."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = read_shard_index(folder)
    return None if index is None else [os.path.join(folder, s) for s in sorted(set(index["weight_map"].values()))]


def _layers_24(config, headers: dict, path: str) -> set:
    """The 2:4 layers of a folder: those its sparse24 section lists (checked first) and those with
    2:4 entries in the checkpoint, which then must have a sparse24 section (else transformers finds
    the markers the wrong shape, or loads masked weights as dense ones)."""
    section = getattr(config, "quantization_config", None)
    stored = {k[:-7] for k in headers if k.endswith(".values") and k[:-7] + ".meta" in headers} | {
        k[:-5] for k, (dtype, shape, _) in headers.items() if k.endswith(".mask") and dtype == "BOOL"
        and headers.get(k[:-5] + ".weight", (None, None))[1] == shape}
    if section is None:
        method = None
    elif isinstance(section, dict):
        method = section.get("quant_method")
    else:
        method = getattr(section, "quant_method", None)
    if section is not None and not isinstance(method, str):
        raise ValueError(f"{path}: quantization_config must be an object with a 'quant_method' string, got "
                         f"{section!r:.80}")
    if method == QUANT_METHOD:
        try:
            listed = set((section if isinstance(section, Sparse24Config) else Sparse24Config(**section)).layers)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None
        if stored - listed:  # transformers would find such a layer's marker the wrong shape, naming no file
            raise ValueError(f"{path}: the checkpoint holds 2:4 entries for {sorted(stored - listed)[0]!r}, which "
                             "the sparse24 section does not list (sparse24 before 2026-12-05 saved the 2:4 models "
                             "of families transformers renames on load, ViT, DeiT, BEiT, Dinov2, ..., under the "
                             "family's older names, which no version loads: sparsify the dense model again)")
        return listed
    if stored:
        raise ValueError(f"{path}: the checkpoint holds 2:4 entries ({sorted(stored)[0]}, ...) but quantization_config "
                         f"is {'missing' if method is None else repr(method)}, not a sparse24 section")
    return stored


def check_folder(folder: str | os.PathLike, cls, config=None, ignore_mismatched_sizes: bool = False) -> None:
    """Before transformers builds anything: ``config.json`` (or ``config``, a config object given
    to ``from_pretrained``) reads (:func:`read_config`), describes
    no more layers than the checkpoint holds (:func:`check_blocks`), and the model it describes,
    built on the meta device, matches the safetensors headers: each tensor the checkpoint has
    under a model name has the model's shape, and the model holds at most
    ``EXTRA_ELEMENTS`` + the checkpoint's element count in tensors the checkpoint lacks (so a
    corrupt size cannot make transformers allocate past a bound from the files' size). With
    ``ignore_mismatched_sizes`` (as given to ``from_pretrained``: a new head), a tensor of another shape
    counts as one the checkpoint lacks, since transformers initializes it afresh. The 2:4 layers the
    section lists are checked by the quantizer, which refuses them in another shape all the same.
    Raises ValueError naming the file."""
    files = _checkpoint_files(folder)
    if files is None:
        return  # no safetensors checkpoint: transformers' own loader decides
    headers = safetensors_headers(files)
    _check_loadable_dtypes(headers)
    path = os.path.join(folder, "config.json") if config is None else "the config given to from_pretrained"
    if config is None:
        config = _folder_config(folder, cls)[0]
    check_blocks(config, headers, folder, path)
    layers_24 = _layers_24(config, headers, path)
    try:
        with torch.device("meta"):
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    except Exception as e:
        raise ValueError(f"{path}: transformers cannot build the model it describes ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    # each model tensor's checkpoint name, as transformers' loader renames them (CLIPVisionModel: a CLIP
    # folder's "vision_model.encoder..." loads as "encoder..."); one a converter takes is not compared (the
    # op changes its shape)
    rename, loaded = _loader_names(model), {}
    for k in headers:
        new, converted = rename(k)
        if not converted:
            loaded.setdefault(new, k)
    lacking, seen = 0, set()
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    supplied = set()
    for name, t in tensors:
        key = loaded.get(name)
        if key is not None and key.endswith(".weight") and key[:-7] in layers_24:
            supplied.add(id(t))  # a 2:4 layer's weight: the quantizer checks its entries, with clearer words
        elif key is not None:
            if tuple(headers[key][1]) == tuple(t.shape):
                supplied.add(id(t))
            elif not ignore_mismatched_sizes:
                raise ValueError(f"{path} describes {name!r} as {tuple(t.shape)}, but {headers[key][2]} holds "
                                 f"{key!r} as {tuple(headers[key][1])}")
    for name, t in tensors:
        if id(t) not in supplied and id(t) not in seen:
            seen.add(id(t))
            lacking += t.numel()
    stored = sum(math.prod(shape) for _, shape, _ in headers.values())
    if lacking > EXTRA_ELEMENTS + stored:
        raise ValueError(f"{path} describes a model with {lacking:,} elements the checkpoint does not hold "
                         f"(it holds {stored:,}): not this checkpoint's config")


def _check_loadable_dtypes(headers: dict) -> None:
    """Refuse a tensor stored in a dtype transformers' loader has no torch dtype for (its own table:
    float8 FNUZ kinds, complex): it raised "Cannot load safetensors of unknown dtype", naming no file
    (found by fuzzing)."""
    from transformers import modeling_utils
    known = getattr(modeling_utils, "str_to_torch_dtype", None)
    if not isinstance(known, dict):
        return   # another transformers: its loader decides
    for key, (dtype, _, file) in headers.items():
        if dtype not in known:
            raise ValueError(f"{file}: '{key}' is stored as {dtype}, which transformers cannot load "
                             f"(it reads {', '.join(known)})")


def read_section(folder: str | os.PathLike) -> dict | None:
    """The sparse24 section of ``folder/config.json``, or None when it has none. ValueError naming
    the file when config.json is not JSON (nested too deeply, say) or not a JSON object."""
    with open(os.path.join(folder, "config.json"), "rb") as f:
        try:
            config = json.load(f)
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
            raise ValueError(f"config.json is not a readable JSON file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


def check_section(section: dict) -> None:
    """ValueError unless ``section`` (a folder's sparse24 section) is one this sparse24 reads: as
    :class:`Sparse24Config` checks it when transformers loads the folder."""
    try:
        Sparse24Config(**section)
    except TypeError as e:   # (a field of the wrong kind, e.g. a number where a name belongs)
        raise ValueError(f"sparse24 section: {e}") from None

"""2:4-prune a Hugging Face model folder into a new one (``python -m sparse24 prune FOLDER --out DIR``).

The model class named in ``config.json`` is built on the meta device (no
memory, no random init) and :func:`sparse24.sparsify_` plans it there, so a
folder gets exactly the layers, skips (output head, tied weights, ...) and
``Conv1D`` orientation that ``sparsify_`` gives the loaded model. Then every
weights shard is read, pruned and written one at a time (peak memory: about one
shard in and one out). The new folder has the same shard layout, a
``config.json`` with the sparse24 section (and the dtype the source loads in when its config names
none: transformers would take it from the first floating tensor stored, maybe a quantized layer's
scale), and every other file and subfolder copied (a sentence-transformers ``1_Pooling/``; symbolic
links inside the folder as the files they point to, but a folder link back up; not a link out of it:
:func:`copy_rest`), except the dense weights in other formats (``pytorch_model*.bin``,
``tf_model*.h5``, ``flax_model*.msgpack``, ``*.ot``; and at any depth the ``onnx/`` and ``openvino/``
folders, ``*.onnx``, ``*.onnx_data``, ``openvino_model*``), which would hold the dense model again beside
the pruned one. Stored names are matched to
the model's as transformers renames them on load (:func:`stored_names`: a family's older Hub names are
written in the model's own); :func:`sparse24.from_pretrained` (or any ``from_pretrained`` once sparse24
is registered) loads it.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import stat
from pathlib import Path

import torch

from .._checks import with_context
from ..api import MIN_FEATURES, sparsify_
from ..hf import (FLOAT_SAFETENSORS_DTYPES, check_blocks, check_folder, read_config, read_shard_index,
                  sparsity_config)
from ..masks import kept_magnitude_fraction
from ..nn import Sparse24Linear, is_conv1d_class
from .._progress import progress_bar
from .checkpoint import (check_shards, dense_row, exclude_pattern, finish_folder, is_model_folder, is_weight_matrix,
                         output_folder, partial_folder, quant_label)
from .cli_common import CLIError, exclude_filter, exclude_reason

__all__ = ["is_model_folder", "prune_folder", "stored_names", "check_layer_weights", "WEIGHT_FILES", "OTHER_WEIGHTS",
           "other_weight_files", "copy_rest", "links_left_out"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# The dense weights in the other formats a Hub folder may carry beside model.safetensors: not copied.
OTHER_WEIGHTS = ("pytorch_model*.bin", "pytorch_model*.bin.index.json", "tf_model*.h5", "tf_model*.h5.index.json",
                 "flax_model*.msgpack", "flax_model*.msgpack.index.json", "*.ot")
# ... and at any depth: the ONNX and OpenVINO exports (sentence-transformers' Hub folders carry them), which
# SentenceTransformer(folder, backend="onnx"/"openvino") would load instead of the pruned model
OTHER_FOLDERS = ("onnx", "openvino")
OTHER_ANYWHERE = ("*.onnx", "*.onnx_data", "openvino_model*")


def _other_weight(folder: str | os.PathLike, name: str, top: bool) -> bool:
    """Whether entry ``name`` of ``folder`` holds weights in another format (``top``: ``folder`` is the model's)."""
    if os.path.isdir(os.path.join(folder, name)):
        return name in OTHER_FOLDERS
    return any(fnmatch.fnmatch(name, pat) for pat in OTHER_ANYWHERE + (OTHER_WEIGHTS if top else ()))


def other_weight_files(src: Path) -> list[str]:
    """The files and folders of ``src`` (paths relative to it, a folder with a trailing ``/``) holding its
    weights in other formats than safetensors (left out of the output)."""
    found = []
    for here, dirs, files in os.walk(src):
        rel = Path(here).relative_to(src)
        found += [(rel / n).as_posix() + ("/" if n in dirs else "") for n in dirs + files
                  if _other_weight(here, n, rel == Path("."))]
        dirs[:] = [d for d in dirs if d not in OTHER_FOLDERS]
    return sorted(found)


def _links_back(src: Path, path: Path) -> bool:
    """Whether ``path`` (below ``src``, reached through the links copied so far) is a link to ``src``, a folder
    above it, or a folder the copy passed through to reach it: followed, it would copy a folder into itself
    until the kernel's link limit (``up -> ..``, or ``a/b -> ../b`` with ``b/a -> ../a``)."""
    if not (path.is_symlink() and path.is_dir()):
        return False
    top = Path(os.path.realpath(src))
    passed = {top, *top.parents}
    for part in path.parent.relative_to(src).parts:
        src = src / part
        passed.add(Path(os.path.realpath(src)))
    return Path(os.path.realpath(path)) in passed


def _link_roots(src: Path) -> list[Path]:
    """The real folders whose files a copy of ``src`` may hold: ``src``, and for a Hugging Face cache
    snapshot (``<repo>/snapshots/<revision>/``, or a subfolder of one such as ``text_encoder_2/``, its files
    relative links into ``<repo>/blobs/``) that ``blobs/``. A link leading anywhere else
    (``README.md -> ~/.aws/credentials``, ``x -> /etc``) is not followed: the output, maybe published, would
    hold files the model folder does not."""
    top = Path(os.path.realpath(src))
    for revision in (top, *top.parents):
        if revision.parent.name == "snapshots" and (revision.parent.parent / "blobs").is_dir():
            return [top, Path(os.path.realpath(revision.parent.parent / "blobs"))]
    return [top]


def _left_out(path: Path, roots: list[Path]) -> bool:
    """Whether ``copy_rest`` leaves ``path`` (an existing entry) out for where it leads: a link out of the
    ``roots`` (:func:`_link_roots`), or neither a regular file nor a folder (a FIFO or a device, which a copy
    would read forever: ``/dev/zero``)."""
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(r) for r in roots):
        return True
    mode = os.stat(path).st_mode
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def links_left_out(src: Path) -> list[str]:
    """The entries of ``src`` (paths relative to it, sorted) that :func:`copy_rest` leaves out of a pruned
    copy for where they lead (:func:`_left_out`): symbolic links out of the folder, FIFOs, devices."""
    shards, _ = _shards(src)
    left: list[str] = []
    _copy_folder(src, None, src, _link_roots(src), None, {*WEIGHT_FILES, "config.json", *shards}, left)
    return sorted(left)


def copy_rest(src: Path, tmp: Path, skip) -> list[str]:
    """Copy every file and subfolder of ``src`` into ``tmp`` (tokenizer, generation config, README, a
    sentence-transformers ``1_Pooling/``, ...) but the names in ``skip``, those already in ``tmp``, the
    other-format weights (:func:`other_weight_files`), and ``tmp`` itself or a folder holding it (an --out
    inside ``src``). Symbolic links are copied as the files they point to (a Hugging Face cache snapshot's
    files are relative links into its ``blobs/``, which would dangle in the copy) when they lead inside the
    folder (or that ``blobs/``); a link out of it, a FIFO or a device (:func:`_left_out`), a dangling
    link and a folder link back up (to ``src``, a folder above it or one it is inside of:
    :func:`_links_back`) are skipped. Returns the entries left out for where they lead (as
    :func:`links_left_out`)."""
    left: list[str] = []
    _copy_folder(src, tmp.absolute(), src, _link_roots(src), Path(os.path.realpath(tmp)), set(skip), left)
    return sorted(left)


def _copy_folder(folder: Path, dst: Path | None, src: Path, roots: list[Path], tmp: Path | None, skip: set,
                 left: list[str]) -> None:
    """:func:`copy_rest` of ``folder`` (``src`` or a subfolder reached from it) into ``dst`` (None: nothing
    copied, ``left`` filled only); ``skip``: names left out (at the top only, as are those already in
    ``dst``); ``left``: gets the paths left out for where they lead."""
    top = folder == src
    for item in sorted(folder.iterdir()):
        if item.name in skip and top or _other_weight(folder, item.name, top) or not os.path.exists(item) \
                or (top and dst is not None and (dst / item.name).exists()) or _links_back(src, item):
            continue
        if _left_out(item, roots):
            left.append(item.relative_to(src).as_posix())
        elif item.is_dir():
            if tmp is not None and tmp.is_relative_to(os.path.realpath(item)):
                continue   # (--out inside it: the copy would copy itself)
            if dst is not None:
                (dst / item.name).mkdir()
            _copy_folder(item, None if dst is None else dst / item.name, src, roots, tmp, skip, left)
            if dst is not None:
                shutil.copystat(item, dst / item.name)   # (as copytree: after the files, a read-only folder too)
        elif dst is not None:
            shutil.copy2(item, dst / item.name)


NOT_SWAPPED = "not the weight of a layer sparsify_ prunes (an embedding table, or not a Linear)"


def _shards(folder: Path) -> tuple[list[str], dict | None]:
    """The safetensors weight files of ``folder`` and its index (None when not sharded), in transformers'
    order: ``model.safetensors`` first (an unsharded save over a sharded one leaves the old index)."""
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"], None
    data = read_shard_index(folder)
    if data is not None:
        # (read_shard_index checks the weight_map only; the metadata is read for the dtype and written again)
        if not isinstance(data.get("metadata", {}), dict):
            raise ValueError(f"{folder / 'model.safetensors.index.json'}: 'metadata' must be an object, got "
                             f"{json.dumps(data['metadata'])[:80]}")
        return sorted(set(data["weight_map"].values())), data
    raise ValueError(f"{folder} has no model.safetensors or model.safetensors.index.json (only safetensors "
                     "folders are supported; save_pretrained writes them)")


def _skeleton(folder: Path, headers: dict):
    """The model class of ``folder/config.json``, built on the meta device, after the config is
    checked against the checkpoint's ``headers`` (:func:`sparse24.hf.check_blocks`), and the model it
    describes against every stored shape and the checkpoint's size (:func:`sparse24.hf.check_folder`, as
    ``sparse24.from_pretrained`` checks a folder: the calibrated methods load it with transformers, and
    the output must load)."""
    import transformers

    config = read_config(folder)
    check_blocks(config, headers, folder)
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        if isinstance(qc, dict) and _plain_compressed_tensors(qc):
            raise ValueError(f"{folder / 'config.json'}: its quantization_config (compressed-tensors, format 'dense', "
                             "no quantization) describes plain dense weights, which prune takes once that section "
                             "is gone: delete \"quantization_config\" from config.json (in a copy of the folder) and "
                             "prune that")
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "?")
        raise ValueError(f"{folder} is already quantized or compressed ({method}); prune its dense original")
    archs = getattr(config, "architectures", None)
    arch = archs[0] if isinstance(archs, list) and archs else None
    # a model class only: the name comes from the file, and any other attribute of transformers would be called
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and cls is not transformers.PreTrainedModel):
        raise ValueError(f"{folder}/config.json names no model class transformers knows (architectures="
                         f"{archs!r:.100})")
    check_folder(folder, cls)
    try:
        with torch.device("meta"):
            return config, cls(config)
    except Exception as e:  # transformers' model classes raise anything on a corrupt config value
        raise ValueError(f"{folder / 'config.json'}: transformers cannot build the {arch} it describes "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def _plain_compressed_tensors(qc: dict) -> bool:
    """Whether a compressed-tensors ``quantization_config`` describes plain dense weights: format
    ``"dense"``, no quantization (``config_groups``, ``kv_cache_scheme``) or transforms, and a sparsity
    section, if any, stored dense too (llm-compressor's sparsity-only export: already pruned weights
    stored as plain tensors). Such a folder is a dense original, refused only for its config section."""
    sparsity = qc.get("sparsity_config")
    return qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "dense" \
        and not any(qc.get(k) for k in ("config_groups", "kv_cache_scheme", "transform_config")) \
        and (not sparsity or isinstance(sparsity, dict) and sparsity.get("format") == "dense")



def check_layer_weights(headers: dict, names: dict, layers, model, folder: Path) -> None:
    """Every layer to prune stored as a plain floating-point ``weight``, checked from the shard
    ``headers`` before any work (on every path: shard by shard, calibrated, block by block). A layer
    quantized by another tool has no ``weight`` (GPTQ's ``qweight``) or int8 / float8 codes under that
    name with their scale beside it (``weight_scale``, bitsandbytes' ``SCB``), which pruning would take
    for the weights (transformers casts the codes to float and drops the scale on load).

    Args:
        headers: ``{stored name: (safetensors dtype, shape, file)}`` (:func:`~.checkpoint.check_shards`).
        names: :func:`stored_names` of those keys.
        layers: the model's ``<layer>.weight`` names of the layers to prune.
        model: the model (its class names it in the error).
        folder: the model folder (named in the error).
    Raises:
        ValueError naming the layers missing, or the tensor, its file and dtype, and what is stored beside
        it under the layer's name."""
    stored = {own: key for key, (own, _) in names.items()}

    def beside(weight: str) -> str:   # the layer's other stored entries (its bias left out)
        fqn = weight[:-len(".weight")]
        found = [k for k, (own, _) in names.items() if own.startswith(fqn + ".") and own not in (weight, fqn + ".bias")]
        return ", ".join(map(repr, found[:3])) + (" ..." if len(found) > 3 else "") \
            + (f" (in {Path(headers[found[0]][2]).name})" if found else "")

    missing = [w for w in layers if w not in stored]
    if missing:
        other = beside(missing[0])
        raise ValueError(f"the checkpoint has no weight for layer(s) {', '.join(m[:-7] for m in missing[:5])}"
                         + (" ..." if len(missing) > 5 else "") + f" of {type(model).__name__} ({folder}"
                         + (f"; it stores {other} instead: quantized by another tool, prune its dense original"
                            if other else "") + ")")
    for w in layers:
        key = stored[w]
        dtype, _, file = headers[key]
        if dtype not in FLOAT_SAFETENSORS_DTYPES:
            other = beside(w)
            raise ValueError(f"{file}: {key!r}: weight must be floating point "
                             f"({', '.join(FLOAT_SAFETENSORS_DTYPES)}) to be pruned, but it is stored as {dtype}"
                             + (f", with {other} beside it" if other else "")
                             + f": quantized by another tool{';' if other else '?'} prune its dense original")


def stored_names(model, keys, layers, folder) -> dict[str, tuple[str, str]]:
    """Each stored tensor name in ``keys`` -> (the model's name for it, the name to store it under).

    A family with a checkpoint conversion mapping in transformers (ViT, DeiT, BEiT, Dinov2, Llava, Gemma 3,
    Qwen2-VL, Mistral 3, ...) stores older names in its Hub folders, which ``from_pretrained`` renames: the
    model's name is the key after transformers' own renamings (``get_model_conversion_mapping``, applied by
    its ``rename_source_key`` as at load), with the base model prefix added or removed as transformers
    does. The name to store it under is the key after the renamings alone (a folder of the model's own
    names, as ``save_pretrained`` of a 2:4 model writes, see :mod:`sparse24.hf`; families without a mapping
    keep every key as stored). A tensor transformers builds by a conversion (fusing or splitting stored
    tensors: the experts of an MoE) keeps its stored name, transformers converts it on load. ``layers``:
    the ``<layer>.weight`` names of the layers to prune; one that comes out of such a conversion
    (Dinov2-SwiGLU's gate/up projections, stored fused as ``mlp.weights_in``) is a CLIError (exit 2):
    its stored tensor is not the layer's weight."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)  # as from_pretrained builds it (with the legacy renamings)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    known = dict.fromkeys([*model.state_dict(), *layers], True)
    prefix = model.base_model_prefix or None
    out = {}
    for key in keys:
        own, converted = rename_source_key(key, renamings, converters, prefix, known)
        if converted is not None:
            if own in layers:
                raise CLIError(f"{folder}: {type(model).__name__} stores layer {own[:-7]!r} inside {key!r}, which "
                               "transformers converts on load (fused or split): prune cannot rewrite it; load the "
                               "model with transformers in Python, sparse24.sparsify_(model, mode='compressed'), "
                               "then model.save_pretrained(OUT)")
            out[key] = (own, key)
        else:
            out[key] = (own, rename_source_key(key, renamings, [])[0])
    return out


def prune_folder(src: str | os.PathLike, dst: str | os.PathLike, method: str = "magnitude",
                 quantize: str | None = None, min_features: int | None = None, exclude: str | None = None,
                 prune_head: bool = False, progress: bool | None = None, *, group_size: int | None = None,
                 symmetric: bool | None = None) -> list[dict]:
    """2:4-prune the model in Hugging Face folder ``src`` into the new folder ``dst``.

    Args:
        src: folder with ``config.json`` and ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` + shards.
        dst: folder to create (must not exist, or be empty); written under a temporary
            name (inside ``dst`` when it exists: it is kept, with its permissions) and renamed at
            the end, so a failure leaves nothing half-written.
        method: ``"magnitude"``, ``"2d_greedy"`` or ``"2d_optimal"`` (no calibration data).
        quantize: ``None``, ``"int8"`` or ``"int4"`` (``group_size``, ``symmetric``: as for
            :func:`sparse24.sparsify_`).
        min_features: as :func:`sparse24.sparsify_` (default its ``MIN_FEATURES``).
        exclude: regular expression; layers whose name (or weight name, ``<name>.weight``) it
            matches stay dense (default None: none).
        prune_head: prune the output head too (``skip_output_head=False``).
        progress: a tqdm bar over the shards (default None: when stderr is a terminal).
    Returns:
        one report dict per 2-D floating-point ``weight`` tensor stored in the checkpoint (the
        tensors :func:`sparse24.tools.prune.prune_state_dict` reports for a file): ``name, shape,
        dtype, action, reason, kept, bytes_before, bytes_after``.
    Example:
        Not run as a test: needs a model folder on disk.

        >>> prune_folder("llama-dense", "llama-2of4", quantize="int8")  # doctest: +SKIP
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), output_folder(dst)
    excl = exclude_pattern(exclude)
    shards, index = _shards(src)
    headers = check_shards(src, shards)
    config, model = _skeleton(src, headers)
    report = sparsify_(model, filter_fn=exclude_filter(excl),
                       mode="compressed", method=method, quantize=quantize, group_size=group_size,
                       symmetric=symmetric,
                       min_features=MIN_FEATURES if min_features is None else min_features,
                       skip_output_head=not prune_head)
    layers = {f"{fqn}.weight": (fqn, m) for fqn, m in model.named_modules(remove_duplicate=False)
              if isinstance(m, Sparse24Linear)}
    if not layers:  # (as for a state dict: a dense copy whose config says sparse24 would help nobody)
        raise CLIError(f"{src}: no layer to prune (see --min-features / --exclude)", 1)
    names = stored_names(model, headers, layers, src)
    check_layer_weights(headers, names, layers, model, src)
    rows, done = [], set()
    skipped = {r.fqn + ".weight": exclude_reason(r.reason, exclude) for r in report.skipped}
    with partial_folder(dst) as tmp:
        weight_map = {}
        for shard in progress_bar(shards, desc="prune", progress=progress, unit="shard"):
            out = {}
            with safe_open(src / shard, framework="pt") as f:
                for key in f.keys():
                    name, kept_as = names[key]
                    t = f.get_tensor(key)
                    if name not in layers:
                        out[kept_as] = t
                        if is_weight_matrix(key, t):  # counted as prune_state_dict counts a file's weights
                            rows.append(dense_row(key, t, skipped.get(name) or NOT_SWAPPED))
                        continue
                    fqn, layer = layers[name]
                    try:
                        entries, mask = layer.entries_from_dense(t)
                    except (ValueError, TypeError) as e:
                        raise with_context(e, f"{src / shard}: {key!r}: {e}", f"in {src / shard}: {key!r}")
                    new = {f"{fqn}.{k}": v.contiguous() for k, v in entries.items()}
                    if layer.mode == "compressed":
                        new[f"{fqn}.weight"] = torch.zeros(1, dtype=torch.uint8, device="cpu")  # sparse24.hf's marker
                    out.update(new)
                    done.add(name)
                    rows.append({"name": key, "shape": tuple(mask.shape), "dtype": str(t.dtype)[6:],
                                 "action": layer.mode + quant_label(layer._quant()), "reason": "",
                                 "kept": kept_magnitude_fraction(t.t() if is_conv1d_class(layer._dense_cls) else t,
                                                                 mask),
                                 "bytes_before": t.numel() * t.element_size(),
                                 "bytes_after": sum(v.numel() * v.element_size() for v in entries.values())})
            # one metadata key: safetensors writes the map in (random) hash order; config.json has the format
            save_file(out, tmp / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, shard))
        missing = sorted(set(layers) - done)
        if missing:
            raise ValueError(f"the checkpoint has no weight for layer(s) {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else "") + f" of {type(model).__name__}")
        _finish_folder(src, tmp, dst, shards, weight_map, config, model,
                       None if index is None else index.get("metadata", {}))
    return rows


def _auto_dtype(folder: Path) -> torch.dtype | None:
    """The dtype ``from_pretrained(folder)`` gives a model whose ``config.json`` names none (transformers'
    default ``dtype="auto"``): the shard index's ``metadata.dtype``, else transformers' own
    ``get_state_dict_dtype`` of the first checkpoint file (its first floating tensor). None when that is no
    floating dtype."""
    from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

    shards, index = _shards(folder)
    dtype = ((index or {}).get("metadata") or {}).get("dtype")
    if dtype is None:
        dtype = get_state_dict_dtype(load_state_dict(str(folder / shards[0]), map_location="meta"))
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _finish_folder(src: Path, tmp: Path, dst: Path, shards, weight_map: dict, config, model,
                   metadata: dict | None) -> None:
    """Complete the new folder ``tmp`` (the shard index when ``metadata`` is given, every other file
    of ``src``, the config with ``model``'s sparse24 section, and the dtype ``src`` loads in when its
    config names none: :func:`_auto_dtype`), then make it ``dst`` (:func:`~.checkpoint.finish_folder`)."""
    if metadata is not None:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    copy_rest(src, tmp, (*WEIGHT_FILES, "config.json", *shards))
    config.quantization_config = sparsity_config(model)
    if getattr(config, "dtype", None) is None:
        # transformers' default dtype="auto" takes a dtype config.json does not name from the first floating
        # tensor stored: here maybe a quantized layer's scale (float32 INT8, float16 INT4), not the model's
        config.dtype = _auto_dtype(src)
    config.save_pretrained(tmp)
    finish_folder(tmp, dst)

"""Pruning a Hugging Face folder larger than memory, one decoder block at a time, with
calibration (``python -m sparse24 prune FOLDER --out DIR --method wanda --calibration-ids ids.pt``).

SparseGPT's sequential scheme, on a model that never exists whole: the model is built on
the meta device; the first decoder block's inputs are computed from the checkpoint's
embedding rows by the model's own forward (attention masks, rotary embeddings), stopped
at block 0. Then each block in turn is materialized in fp32 from the safetensors shards and
pruned layer by layer on the inputs it receives (:func:`sparse24.prune_layerwise_`); each layer,
as soon as it is pruned (in place), is compressed in the checkpoint's dtype, a few rows at a time,
and written as its own output shard, so no mask outlives its layer. The pruned block then runs
once more to give the next block its inputs, its other tensors (norms) are written, and it is
freed. The result is what pruning the whole fp32 model in memory with ``prune_layerwise_`` gives
(the tests compare the two), stored in the checkpoint's dtype.

Memory: one block in fp32, plus one layer's mask and compressed form and a few MiB of
temporaries; the calibration hidden states twice (a block's inputs and outputs); the method's
statistics (Wanda: ``K`` numbers per layer; SparseGPT: a ``K x K`` fp64 Hessian per layer of a
wave and its solver's copies); and a fixed overhead (Python, torch, transformers, the meta
model). No copy of the block is kept to undo a failure (the output folder is discarded instead).
Tensors are read one at a time from memory-mapped shards, each file closed after its read, so
no shard is ever resident whole.
Supported: Llama-shaped decoders (``model.model.layers``, ``embed_tokens``, ``rotary_emb``).
"""
from __future__ import annotations

import copy
import ctypes
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..api import MIN_FEATURES, sparsify_
from ..format import compress
from ..hf import FORMAT_VERSION
from ..masks import prune_layerwise_
from ..masks.nm import _row_chunks
from ..nn import Sparse24Linear, compressed_entries, quant_options
from .checkpoint import check_shards, exclude_pattern, partial_folder, quant_label
from .hf_folder import _finish_folder, _shards, _skeleton, prune_folder

__all__ = ["prune_folder_blockwise", "CALIBRATED"]

# Methods that need calibration inputs: the ones pruned block by block here.
CALIBRATED = ("wanda", "sparsegpt")


class _Caught(Exception):
    def __init__(self, inputs: dict):
        self.inputs = inputs


class _Catch(nn.Module):
    """Stands in for decoder block 0: records the arguments the model gives it, then stops the forward."""

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise TypeError("the decoder block got positional arguments beyond hidden_states: not Llama-shaped")
        raise _Caught({"hidden_states": hidden_states, **kwargs})


def _read(src: Path, shard: str, key: str) -> torch.Tensor:
    """One tensor, its file mapped only while reading it."""
    from safetensors import safe_open
    with safe_open(src / shard, framework="pt") as f:
        return f.get_tensor(key)


def _check_batches(batches) -> list[torch.Tensor]:
    if isinstance(batches, torch.Tensor):
        raise TypeError("batches must be a list of (B, L) token-id tensors (split a tensor with .split(batch_size))")
    batches = list(batches)
    if not batches:
        raise ValueError(f"pruning block by block with calibration needs at least one batch of token ids")
    for i, b in enumerate(batches):
        if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"batch {i} must be a (B, L) int64 tensor of token ids, got "
                            f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}"
                            f"{' ' + str(b.dtype) if isinstance(b, torch.Tensor) else ''}")
        if b.numel() == 0:
            raise ValueError(f"batch {i} holds no token ids (shape {tuple(b.shape)})")
    return batches


def _first_block_inputs(body: nn.Module, config, embedding: torch.Tensor, batches) -> list[dict]:
    """Every batch's keyword arguments of decoder block 0, hidden states in fp32."""
    vocab = embedding.shape[0]
    body.rotary_emb = type(body.rotary_emb)(config=config)  # real frequencies (a buffer no checkpoint holds)
    first = body.layers[0]
    body.layers[0] = _Catch()
    inputs = []
    try:
        with torch.no_grad():
            for ids in batches:
                if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                    raise ValueError(f"token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
                try:  # the fp32 model's lookup: an exact cast of the stored rows
                    body(inputs_embeds=F.embedding(ids.long(), embedding).float(), use_cache=False)
                except _Caught as c:
                    inputs.append(c.inputs)
                else:
                    raise RuntimeError("the model's forward never reached decoder block 0")
    finally:
        body.layers[0] = first
    return inputs


def _materialize(block: nn.Module, names: dict[str, tuple[str, str]], src: Path) -> dict[str, torch.dtype]:
    """Fill the meta block's tensors in place (fp32 on CPU) from the checkpoint; returns each
    entry's stored dtype. ``names``: block-relative state key -> (checkpoint key, shard)."""
    block.to_empty(device="cpu")
    state, stored = block.state_dict(), {}
    missing = sorted(set(state) - set(names))
    if missing:
        raise ValueError(f"the checkpoint has no {', '.join(missing[:5])} for this block")
    with torch.no_grad():
        for k, t in state.items():
            key, shard = names[k]
            loaded = _read(src, shard, key)
            if loaded.shape != t.shape:
                raise ValueError(f"checkpoint entry {key} has shape {tuple(loaded.shape)}, the model expects "
                                 f"{tuple(t.shape)}")
            t.copy_(loaded)
            stored[k] = loaded.dtype
    return stored


def prune_folder_blockwise(src: str | os.PathLike, dst: str | os.PathLike, batches, method: str = "wanda",
                           quantize: str | None = None, min_features: int | None = None, exclude: str | None = None,
                           *, group_size: int | None = None, symmetric: bool | None = None,
                           **method_kwargs) -> list[dict]:
    """2:4-prune the model of Hugging Face folder ``src`` into ``dst`` one decoder block at a time
    (see the module docstring), calibrated on ``batches``.

    Args:
        src: folder with ``config.json`` and safetensors weights (sharded or not), Llama-shaped.
        dst: folder to create (must not exist, or be empty); written under a temporary name.
        batches: list of ``(B, L)`` int64 token-id tensors (what ``model(batch)`` takes).
        method: ``"wanda"`` or ``"sparsegpt"``; a method without calibration goes to
            :func:`~sparse24.tools.hf_folder.prune_folder` (shard by shard, ``batches`` unused).
        quantize: ``None``, ``"int8"`` or ``"int4"`` (``group_size``, ``symmetric``: as for
            :func:`sparse24.sparsify_`).
        min_features, exclude: as :func:`~sparse24.tools.hf_folder.prune_folder`; the output
            head stays dense.
        **method_kwargs: for the method (``blocksize=``, ``percdamp=``, ``refit=``).
    Returns:
        one report row per pruned weight (as :func:`~sparse24.tools.hf_folder.prune_folder`).
    Example:
        >>> ids = torch.load("calibration_ids.pt")  # (N, L) token ids
        >>> prune_folder_blockwise("llama-70b", "llama-70b-2of4", list(ids.split(1)), method="sparsegpt")
    """
    from safetensors import safe_open

    if method not in CALIBRATED:
        return prune_folder(src, dst, method, quantize, min_features, exclude, group_size=group_size,
                            symmetric=symmetric)
    quant = quant_options(quantize, group_size, symmetric)
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"--out {dst}: exists and is not an empty folder")
    batches = _check_batches(batches)
    excl = exclude_pattern(exclude)
    shards, _ = _shards(src)
    config, model = _skeleton(src, check_shards(src, shards))
    body = getattr(model, "model", None)
    if not all(hasattr(body, a) for a in ("layers", "embed_tokens", "rotary_emb")):
        raise ValueError(f"{type(model).__name__} is not Llama-shaped (model.layers, model.embed_tokens, "
                         "model.rotary_emb): block-by-block pruning supports those; prune it in memory with "
                         "sparse24.prune_layerwise_")
    plan = copy.deepcopy(model)  # which layers sparsify_ takes (meta: nothing computed)
    sparsify_(plan, filter_fn=None if excl is None else (lambda m, fqn: not excl.search(fqn)), mode="compressed",
              min_features=MIN_FEATURES if min_features is None else min_features, **quant)
    layers = {fqn: m for fqn, m in plan.named_modules() if isinstance(m, Sparse24Linear)}
    if not layers:
        raise ValueError(f"{src}: no layer to prune (see --min-features / --exclude)")
    outside = [f for f in layers if not f.startswith("model.layers.")]
    if outside:
        raise ValueError(f"layers outside the decoder blocks cannot be pruned block by block: {outside[:3]}")
    # module state key -> (checkpoint key, shard): checkpoint keys may lack the base model's prefix
    names = set(model.state_dict())
    where = {}
    for shard in shards:
        with safe_open(src / shard, framework="pt") as f:
            for key in f.keys():
                where[key if key in names else f"{model.base_model_prefix}.{key}"] = (key, shard)
    embedding = _read(src, where["model.embed_tokens.weight"][1], where["model.embed_tokens.weight"][0])
    inputs = _first_block_inputs(body, config, embedding, batches)
    del embedding

    rows, weight_map, nbytes = [], {}, 0
    with partial_folder(dst) as tmp:
        for i in range(len(body.layers)):
            pre = f"model.layers.{i}."
            block = body.layers[i]
            stored = _materialize(block, {k[len(pre):]: v for k, v in where.items() if k.startswith(pre)}, src)
            mine = {f[len(pre):] for f in layers if f.startswith(pre)}

            def write_layer(f, r, i=i, pre=pre, stored=stored):
                """Each layer written as soon as it is pruned: its mask never outlives this call."""
                nonlocal nbytes
                entries, row = _layer_entries(pre + f, r, layers[pre + f], stored[f + ".weight"], quant)
                nbytes += _write(entries, tmp, f"model-block-{i:05d}-{f}.safetensors", weight_map)
                del entries, r
                _return_freed_memory()
                return row

            # rollback=False: a failure discards the whole output folder, so no copy of the block is kept
            rows += prune_layerwise_(block, inputs, method=method, filter_fn=lambda m, f: f in mine,
                                     on_layer=write_layer, rollback=False, **method_kwargs).values()
            with torch.no_grad():  # the next block's inputs, from this pruned block
                block.eval()
                inputs = [{**b, "hidden_states": block(**b)} for b in inputs]
            # the rest of the block (norms, biases) cast back: an exact round trip
            rest = {pre + k: t.to(stored[k]) for k, t in block.state_dict().items()
                    if not (k.endswith(".weight") and k[:-len(".weight")] in mine)}
            block.to("meta")
            nbytes += _write(rest, tmp, f"model-block-{i:05d}.safetensors", weight_map)
            del rest
            _return_freed_memory()
        nbytes += _copy_rest(src, tmp, where, weight_map)
        _finish_folder(src, tmp, dst, shards, weight_map, config, plan, {"total_size": nbytes})
    return rows


def _layer_entries(name: str, r, layer: Sparse24Linear, dtype: torch.dtype, quant: dict) -> tuple[dict, dict]:
    """One pruned layer's output entries (``{"weight": marker, "values", "meta"[, "scale", ...]}`` compressed
    in ``dtype`` with ``quant`` (:func:`sparse24.nn.quant_options`), or the masked weight and its mask) and
    its report row. Compressed a chunk of rows at a time (every 2:4 group, meta word, scale and INT4
    quantization group belongs to one row), so the temporaries stay a few MiB instead of ~1.5x the fp32
    weight."""
    w, mask = r.weight, r.mask
    if layer.mode == "compressed":
        entries = {}
        for rows in _row_chunks(w):
            for n, t in compressed_entries(compress(w[rows].to(dtype), mask[rows], **quant)).items():
                if t.dim() == 0:  # INT4's group size: one per layer
                    entries[n] = t
                    continue
                dim = 1 if n == "meta" else 0  # meta is (words, R)
                if n not in entries:
                    entries[n] = t.new_empty(t.shape[:dim] + w.shape[:1] + t.shape[dim + 1:])
                entries[n].narrow(dim, rows.start, t.shape[dim]).copy_(t)
        entries["weight"] = torch.zeros(1, dtype=torch.uint8)  # see sparse24.hf: the marker
    else:
        entries = {"weight": torch.where(mask, w.to(dtype), 0), "mask": mask}
    size = w.numel() * dtype.itemsize
    row = {"name": name + ".weight", "shape": tuple(w.shape), "dtype": str(dtype)[6:],
           "action": layer.mode + quant_label(quant if layer.mode == "compressed" else {}), "reason": "",
           "kept": r.kept_fraction, "bytes_before": size,
           "bytes_after": sum(v.numel() * v.element_size() for n, v in entries.items()
                              if n != "weight" or layer.mode == "masked")}
    return {f"{name}.{n}": v.contiguous() for n, v in entries.items()}, row


def _return_freed_memory() -> None:
    """Hand the C heap's freed pages back to the OS (glibc only; elsewhere nothing).

    Each block allocates and frees tensors of a few to tens of MiB; glibc keeps freed ones
    below its (self-raising) mmap threshold in the heap, so the process grew by ~40 MiB a
    block without holding a single object more (22-block 1.1e9-parameter Llama: 1561 MiB peak).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write(tensors: dict, folder: Path, name: str, weight_map: dict) -> int:
    """Write one output shard; returns its tensor bytes."""
    from safetensors.torch import save_file
    save_file(tensors, folder / name, metadata={"format": "pt", "sparse24_format": str(FORMAT_VERSION)})
    weight_map.update(dict.fromkeys(tensors, name))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _copy_rest(src: Path, tmp: Path, where: dict, weight_map: dict) -> int:
    """Every checkpoint tensor outside the decoder blocks, unchanged, one output shard each."""
    outside = sorted((k, v) for k, v in where.items() if not k.startswith("model.layers."))
    return sum(_write({key: _read(src, shard, key)}, tmp, f"model-other-{j:05d}.safetensors", weight_map)
               for j, (_, (key, shard)) in enumerate(outside))

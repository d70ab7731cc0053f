"""Pruning a Hugging Face folder larger than memory, one decoder block at a time, with
calibration (``python -m sparse24 prune FOLDER --out DIR --method wanda --calibration-ids ids.pt``).

SparseGPT's sequential scheme, on a model that never exists whole: the model is built on
the meta device and every tensor it needs is checked against the shard headers. One pass of
the model's own forward per batch, each decoder block replaced by a recorder that passes its
input on, gives the first block's inputs (the checkpoint's embedding rows through the model's
embedding module) and every block's own keyword arguments (attention masks and rotary
embeddings differ between sliding-window and full-attention layers). Then each block in turn
is materialized in fp32 from the safetensors shards and pruned layer by layer on the inputs it
receives (:func:`sparse24.prune_layerwise_`); each layer, as soon as it is pruned (in place), is
compressed in the checkpoint's dtype, a few rows at a time, and written as its own output shard,
so no mask outlives its layer. The pruned block then runs once more to give the next block its
inputs, its other tensors (norms) are written, and it is freed. The result is what pruning the
whole fp32 model in memory with ``prune_layerwise_`` gives (the tests compare the two), stored in
the checkpoint's dtype.

Memory: one block in fp32, plus one layer's mask and compressed form and a few MiB of
temporaries; the calibration hidden states twice (a block's inputs and outputs); the method's
statistics (Wanda: ``K`` numbers per layer; SparseGPT: a ``K x K`` fp64 Hessian per layer of a
wave and its solver's copies); and a fixed overhead (Python, torch, transformers, the meta
model). No copy of the block is kept to undo a failure (the output folder is discarded instead).
Tensors are read one at a time from memory-mapped shards, each file closed after its read, so
no shard is ever resident whole.
Supported: Llama-shaped decoders (``model.model.layers``, an ``nn.Embedding`` ``embed_tokens``,
``rotary_emb``; tested: Llama, Qwen2/3, Gemma 1-3, gpt-oss, EXAONE) whose forward passes each block's output
straight to the next. Stored names are matched to the model's as transformers renames them on load
(:func:`~sparse24.tools.hf_folder.stored_names`: EXAONE's Hub folders keep ``transformer.h.*``), and written
in the model's own, as :func:`~sparse24.tools.hf_folder.prune_folder` writes them.
"""
from __future__ import annotations

import copy
import ctypes
import os
from pathlib import Path

import torch
from torch import nn

from .._checks import refuse_single_batch
from ..api import MIN_FEATURES, sparsify_
from ..format import compress
from ..masks import prune_layerwise_
from ..masks.nm import _row_chunks
from ..nn import Sparse24Linear, compressed_entries, quant_options
from .checkpoint import (check_shards, dense_row, exclude_pattern, is_weight_matrix, output_folder, partial_folder,
                         quant_label)
from .cli_common import exclude_filter, exclude_reason
from .hf_folder import (NOT_SWAPPED, _finish_folder, _shards, _skeleton, check_layer_weights, prune_folder,
                        stored_names)
from .prune_calibrated import _SAFETENSORS_DTYPES

__all__ = ["prune_folder_blockwise", "CALIBRATED"]

# Methods that need calibration inputs: the ones pruned block by block here.
CALIBRATED = ("wanda", "sparsegpt")


class _Stop(Exception):
    pass


class _Record(nn.Module):
    """Stands in for one decoder block in a pass of the model's forward: records the keyword arguments the
    model gives that block (a model with several layer types gives each its own attention mask and rotary
    embeddings) and returns the hidden states unchanged; the last one stops the forward (what follows
    is on the meta device)."""

    def __init__(self, seen: list, last: bool):
        super().__init__()
        self.seen, self.last = seen, last

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise TypeError("the decoder block got positional arguments beyond hidden_states: not Llama-shaped")
        self.seen.append((hidden_states, kwargs))
        if self.last:
            raise _Stop
        return hidden_states


def _read(src: Path, shard: str, key: str) -> torch.Tensor:
    """One tensor, its file mapped only while reading it."""
    from safetensors import safe_open
    with safe_open(src / shard, framework="pt") as f:
        return f.get_tensor(key)


def _check_batches(batches) -> list[torch.Tensor]:
    if isinstance(batches, torch.Tensor):
        raise TypeError("batches must be a list of (B, L) token-id tensors (split a tensor with .split(batch_size))")
    refuse_single_batch(batches)
    batches = list(batches)
    if not batches:
        raise ValueError("pruning block by block with calibration needs at least one batch of token ids")
    for i, b in enumerate(batches):
        if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"batch {i} must be a (B, L) int64 tensor of token ids, got "
                            f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}"
                            f"{' ' + str(b.dtype) if isinstance(b, torch.Tensor) else ''}")
        if b.numel() == 0:
            raise ValueError(f"batch {i} holds no token ids (shape {tuple(b.shape)})")
    return batches


def _embed(model: nn.Module, module: nn.Embedding, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The fp32 model's embeddings of ``ids`` by its own embedding module (Gemma scales the rows inside it),
    run on a copy holding only the rows ``ids`` use: the whole table in fp32 can outweigh a block."""
    used, local = ids.long().unique(return_inverse=True)
    small = copy.deepcopy(module)  # meta
    small.weight = nn.Parameter(torch.empty(len(used), table.shape[1], dtype=torch.float32, device="meta"),
                                requires_grad=False)
    small.num_embeddings, small.padding_idx = len(used), None  # padding_idx only masks gradients; its row moved
    small.to_empty(device="cpu")
    model._init_weights(small)  # its non-persistent buffers (Gemma's embed_scale), which no checkpoint holds
    with torch.no_grad():
        small.weight.copy_(table[used])  # an exact cast of the stored rows
        return small(local)


def _block_arguments(model: nn.Module, body: nn.Module, config, table: torch.Tensor,
                     batches) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """Every batch's hidden states entering decoder block 0 (fp32), and every block's other keyword
    arguments for every batch (``[block][batch]``), from one pass of the model's forward per batch with
    each block replaced by a :class:`_Record`."""
    vocab = table.shape[0]
    body.rotary_emb = type(body.rotary_emb)(config=config)  # real frequencies (a buffer no checkpoint holds)
    blocks = list(body.layers)
    seen = [[] for _ in blocks]
    for i, s in enumerate(seen):
        body.layers[i] = _Record(s, last=i == len(seen) - 1)
    hidden = []
    try:
        for ids in batches:
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
            x = _embed(model, body.embed_tokens, table, ids)
            try:
                with torch.no_grad():
                    body(inputs_embeds=x, use_cache=False)
            except _Stop:
                pass
            else:
                raise RuntimeError("the model's forward never reached its last decoder block")
            # Each block's inputs are then its predecessor's outputs: only if the forward changes nothing
            # between blocks (and calls each once) is running them one by one the same.
            if any(len(s) != len(hidden) + 1 or s[-1][0] is not seen[0][-1][0] for s in seen):
                raise ValueError(f"{type(model).__name__}'s forward does not pass each decoder block's output "
                                 "straight to the next: block-by-block pruning cannot reproduce it; prune it in "
                                 "memory with sparse24.prune_layerwise_")
            hidden.append(seen[0][-1][0])
    finally:
        for i, b in enumerate(blocks):
            body.layers[i] = b
    return hidden, [[kw for _, kw in s] for s in seen]


def _materialize(block: nn.Module, names: dict[str, tuple[str, str]], src: Path,
                 prefix: str) -> dict[str, torch.dtype]:
    """Fill the meta block ``prefix`` (``model.layers.<i>.``) in place (fp32 on CPU) from the checkpoint;
    returns each entry's stored dtype. ``names``: block-relative state key -> (checkpoint key, shard).
    The checks repeat those done before any block (the folder may change while a large model is pruned)."""
    block.to_empty(device="cpu")
    state, stored = block.state_dict(), {}
    where = f"(decoder block {prefix.split('.')[-2]})"
    missing = sorted(set(state) - set(names))
    if missing:
        raise ValueError(f"the checkpoint has no {', '.join(prefix + k for k in missing[:5])} {where}")
    with torch.no_grad():
        for k, t in state.items():
            key, shard = names[k]
            loaded = _read(src, shard, key)
            if loaded.shape != t.shape:
                raise ValueError(f"checkpoint entry {key} has shape {tuple(loaded.shape)}, the model expects "
                                 f"{tuple(t.shape)} {where}")
            t.copy_(loaded)
            stored[k] = loaded.dtype
    return stored


def _check_entries(model: nn.Module, where: dict, headers: dict) -> None:
    """Every tensor the blocks and the embeddings need is in the checkpoint with the model's shape, checked
    from the shard headers before any work: a gap in the last block was found hours into a large model."""
    expected = model.state_dict()  # meta: shapes only
    needed = [k for k in expected if k.startswith("model.layers.") or k == "model.embed_tokens.weight"]
    missing = [k for k in needed if k not in where]
    if missing:
        raise ValueError(f"the checkpoint has no {', '.join(missing[:5])}"
                         f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}")
    for k in needed:
        key = where[k][0]
        shape = tuple(headers[key][1])
        if shape != tuple(expected[k].shape):
            raise ValueError(f"checkpoint entry {key} has shape {shape}, the model expects "
                             f"{tuple(expected[k].shape)}")
    for i, block in enumerate(model.model.layers):
        # to_empty leaves them uninitialized and no checkpoint holds them: they would be garbage
        odd = [n for n, _ in block.named_buffers() if n not in block.state_dict()]
        if odd:
            raise ValueError(f"decoder block {i} has buffers no checkpoint holds ({', '.join(odd[:3])}): "
                             "block-by-block pruning cannot rebuild them; prune it in memory with "
                             "sparse24.prune_layerwise_")


def prune_folder_blockwise(src: str | os.PathLike, dst: str | os.PathLike, batches, method: str = "wanda",
                           quantize: str | None = None, min_features: int | None = None, exclude: str | None = None,
                           *, group_size: int | None = None, symmetric: bool | None = None,
                           all_weights: bool = False, **method_kwargs) -> list[dict]:
    """2:4-prune the model of Hugging Face folder ``src`` into ``dst`` one decoder block at a time
    (see the module docstring), calibrated on ``batches``.

    Args:
        src: folder with ``config.json`` and safetensors weights (sharded or not), Llama-shaped
            (see the module docstring).
        dst: folder to create (must not exist, or be empty); written under a temporary name.
        batches: list of ``(B, L)`` int64 token-id tensors (what ``model(batch)`` takes).
        method: ``"wanda"`` or ``"sparsegpt"``; a method without calibration goes to
            :func:`~sparse24.tools.hf_folder.prune_folder` (shard by shard, ``batches`` unused).
        quantize: ``None``, ``"int8"`` or ``"int4"`` (``group_size``, ``symmetric``: as for
            :func:`sparse24.sparsify_`).
        min_features, exclude: as :func:`~sparse24.tools.hf_folder.prune_folder`; the output
            head stays dense.
        all_weights: report every 2-D float weight stored in the checkpoint, not only the pruned ones
            (the command line's summary: embedding table and output head listed as kept dense).
        **method_kwargs: for the method (``blocksize=``, ``percdamp=``, ``refit=``).
    Returns:
        one report row per pruned weight (as :func:`~sparse24.tools.hf_folder.prune_folder`), and with
        ``all_weights`` one per other 2-D float weight stored, in checkpoint order.
    Example:
        Not run as a test: needs a model folder and a token-id file on disk.

        >>> ids = torch.load("calibration_ids.pt")  # (N, L) token ids  # doctest: +SKIP
        >>> batches = list(ids.split(1))  # doctest: +SKIP
        >>> prune_folder_blockwise("llama-70b", "llama-70b-2of4", batches, method="sparsegpt")  # doctest: +SKIP
    """
    if method not in CALIBRATED:
        return prune_folder(src, dst, method, quantize, min_features, exclude, group_size=group_size,
                            symmetric=symmetric)
    quant = quant_options(quantize, group_size, symmetric)
    src, dst = Path(src), output_folder(dst)
    batches = _check_batches(batches)
    excl = exclude_pattern(exclude)
    shards, _ = _shards(src)
    headers = check_shards(src, shards)
    config, model = _skeleton(src, headers)
    body = getattr(model, "model", None)
    if not all(hasattr(body, a) for a in ("layers", "embed_tokens", "rotary_emb")) \
            or not isinstance(body.embed_tokens, nn.Embedding):
        raise ValueError(f"{type(model).__name__} is not Llama-shaped (model.layers, an nn.Embedding "
                         "model.embed_tokens, model.rotary_emb): block-by-block pruning supports those; prune it "
                         "in memory with sparse24.prune_layerwise_")
    plan = copy.deepcopy(model)  # which layers sparsify_ takes (meta: nothing computed)
    report = sparsify_(plan, filter_fn=exclude_filter(excl), mode="compressed",
              min_features=MIN_FEATURES if min_features is None else min_features, **quant)
    layers = {fqn: m for fqn, m in plan.named_modules() if isinstance(m, Sparse24Linear)}
    if not layers:
        raise ValueError(f"{src}: no layer to prune (see --min-features / --exclude)")
    outside = [f for f in layers if not f.startswith("model.layers.")]
    if outside:
        raise ValueError(f"layers outside the decoder blocks cannot be pruned block by block: {outside[:3]}")
    # module state key -> (checkpoint key, shard), as transformers renames on load: checkpoint keys may lack
    # the base model's prefix, or be a family's older Hub names (EXAONE's transformer.h.*); those are written
    # under the model's own names, as prune_folder writes them
    names = stored_names(model, headers, {f + ".weight" for f in layers}, src)
    check_layer_weights(headers, names, [f + ".weight" for f in layers], model, src)
    shard_of = {src / s: s for s in shards}
    where = {names[key][0]: (key, shard_of[f]) for key, (_, _, f) in headers.items()}
    _check_entries(model, where, headers)
    table = _read(src, where["model.embed_tokens.weight"][1], where["model.embed_tokens.weight"][0])
    hidden, arguments = _block_arguments(model, body, config, table, batches)
    del table

    rows, weight_map, nbytes = [], {}, 0
    with partial_folder(dst) as tmp:
        for i in range(len(body.layers)):
            pre = f"model.layers.{i}."
            block = body.layers[i]
            stored = _materialize(block, {k[len(pre):]: v for k, v in where.items() if k.startswith(pre)}, src, pre)
            inputs = [{**kw, "hidden_states": h} for kw, h in zip(arguments[i], hidden)]
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
                hidden = [block(**b) for b in inputs]
            del inputs
            # the rest of the block (norms, biases) cast back: an exact round trip
            rest = {pre + k: t.to(stored[k]) for k, t in block.state_dict().items()
                    if not (k.endswith(".weight") and k[:-len(".weight")] in mine)}
            block.to("meta")
            nbytes += _write(rest, tmp, f"model-block-{i:05d}.safetensors", weight_map)
            del rest
            _return_freed_memory()
        nbytes += _copy_rest(src, tmp, where, {key: kept_as for key, (_, kept_as) in names.items()}, weight_map)
        _finish_folder(src, tmp, dst, shards, weight_map, config, plan, {"total_size": nbytes})
    return _with_dense_rows(rows, headers, where, report, exclude) if all_weights else rows


def _with_dense_rows(rows: list[dict], headers: dict, where: dict, report, exclude) -> list[dict]:
    """The pruned layers' rows and, in checkpoint order, one row per other 2-D float weight stored (embedding
    table, output head, layers left dense), as the other paths count the checkpoint's weights."""
    pruned = {r["name"]: r for r in rows}
    key_of = {key: name for name, (key, _) in where.items()}  # checkpoint key -> model state name
    skipped = {r.fqn + ".weight": exclude_reason(r.reason, exclude) for r in report.skipped}
    out = []
    for key, (dtype, shape, _) in headers.items():
        name = key_of.get(key, key)
        if name in pruned:
            out.append(pruned.pop(name))
            continue
        # (other dtypes, float8, ...: no weight matrix sparse24 prunes, so not counted as one)
        t = torch.empty(tuple(shape), dtype=_SAFETENSORS_DTYPES.get(dtype, torch.uint8), device="meta")
        if is_weight_matrix(key, t):
            out.append(dense_row(key, t, skipped.get(name) or NOT_SWAPPED))
    return out + list(pruned.values())


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
        entries["weight"] = torch.zeros(1, dtype=torch.uint8, device="cpu")  # see sparse24.hf: the marker
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
    # one metadata key: safetensors writes the map in (random) hash order; config.json has the format
    save_file(tensors, folder / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, name))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _copy_rest(src: Path, tmp: Path, where: dict, kept_as: dict, weight_map: dict) -> int:
    """Every checkpoint tensor outside the decoder blocks, unchanged, one output shard each, stored under
    ``kept_as[key]`` (:func:`~sparse24.tools.hf_folder.stored_names`)."""
    outside = sorted((k, v) for k, v in where.items() if not k.startswith("model.layers."))
    return sum(_write({kept_as[key]: _read(src, shard, key)}, tmp, f"model-other-{j:05d}.safetensors", weight_map)
               for j, (_, (key, shard)) in enumerate(outside))

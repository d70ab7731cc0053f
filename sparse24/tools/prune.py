"""``python -m sparse24 prune``: 2:4-prune a checkpoint without its model class:
a raw state dict (torch or safetensors file, :func:`prune_state_dict`) or a
Hugging Face model folder (:mod:`sparse24.tools.hf_folder`)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import re
from pathlib import Path

import torch

from .._progress import progress_bar
from .checkpoint import (LAYER_ENTRIES, CheckpointError, dense_row, exclude_pattern, is_model_folder, is_weight_matrix,
                         load_torch_file, new_parents, quant_label)
from .cli_common import (CLIError, _one_line, _prog, check_out_writable, excluded, int4_args, printable,
                         prune_quant, temp_name)

__all__ = ["prune_state_dict", "PRUNE_EXCLUDE", "cmd_prune", "add_blockwise_args"]

# A raw state dict does not say which 2-D weights are embedding tables; these
# names (GPT-2's wte/wpe, *embed*, *emb*) are, and pruning a lookup table 2:4
# is not what a user asking to prune a checkpoint's linear layers wants. (The
# default of --exclude for a state dict file only: a model folder knows its
# nn.Embedding tables, which sparsify_ never prunes.)
PRUNE_EXCLUDE = r"emb|wte|wpe"


def _load_state_dict(path: str) -> tuple[dict, str]:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such checkpoint file: {path} (a state dict file, or a Hugging Face model folder with "
                       "config.json)")
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CLIError("reading .safetensors needs the safetensors package: pip install 'sparse24[hf]'", 1) from None
        try:
            return load_file(p), ""
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CLIError(f"cannot read {path} as a safetensors file: {_one_line(e)[:200]}") from None
    try:
        obj = load_torch_file(p)
    except CheckpointError as e:  # ours: names the file and the record
        raise CLIError(_one_line(e)[:300]) from None
    except Exception as e:  # torch raises many types for non-checkpoint files
        why = _refused_unpickling(e) or _one_line(e)[:200]
        raise CLIError(f"cannot read {path} as a torch checkpoint: "
                       f"{why or type(e).__name__ + (' (empty file)' if not p.stat().st_size else '')}") from None
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, ""
    for key in ("state_dict", "model"):
        inner = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return inner, key
    raise CLIError(f"{path} is not a state dict (a dict of tensors, or one under 'state_dict'/'model')")


def _refused_unpickling(e: Exception) -> str:
    """Why torch's tensors-only loader refused a file, in our words, or "" for other errors.

    torch's own text is a paragraph that also explains how to load the file with the
    unrestricted unpickler; cut short it read as advice to do so. Unpickling runs whatever
    code the file names, so sparse24 never does it: the user is told that, and what to save.
    """
    text = str(e)
    if not (isinstance(e, pickle.UnpicklingError) and text.startswith("Weights only load failed")):
        return ""
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (f"it holds objects other than tensors ({found.group(1)}): loading them needs unrestricted "
                "unpickling, which can run arbitrary code from the file, and sparse24 refuses to do that; "
                "save model.state_dict() alone (torch.save or safetensors) and prune that file")
    cause = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:\n|Check the|$)", text)
    return (f"it is not a tensors-only torch.save file ({_one_line(cause.group(1)) if cause else 'refused'}); "
            "sparse24 loads only tensors and never unpickles arbitrary objects, which can run code")


# A raw state dict whose keys show LongT5 (its encoder's attention), whose gated feed-forward reads no weight
_LONGT5 = re.compile(r"\.(LocalSelfAttention|TransientGlobalSelfAttention)\.")


def _direct_reader(prefix: str, sd: dict) -> str:
    """Why ``prefix`` (a Linear's name) must stay in masked mode, mirroring ``sparse24.api``: parents
    that read the child's ``.weight`` directly, known by name only (a raw state dict shows no code):
    nn.MultiheadAttention, nn.TransformerEncoderLayer and the T5 family's feed-forward."""
    parent, _, leaf = prefix.rpartition(".")
    head = parent + "." if parent else ""
    # T5, mT5, UMT5, LongT5, UDOP, Pop2Piano, SwitchTransformers, Pix2Struct, Kosmos-2.5 (transformers):
    # the feed-forward's forward casts to self.wo.weight.dtype (LongT5's gated one alone does not)
    if leaf == "wo" and (head + "wi.weight" in sd or head + "wi_0.weight" in sd and head + "wi_1.weight" in sd
                         and not any(_LONGT5.search(k) for k in sd)):
        return "the T5 family's feed-forward reads wo.weight in its forward (transformers)"
    if leaf == "out_proj" and (head + "in_proj_weight" in sd or head + "q_proj_weight" in sd):
        return "nn.MultiheadAttention reads out_proj.weight in its functional forward"
    # (a decoder layer holds self_attn.in_proj_weight too, and a cross-attention, and has no fast path)
    if leaf in ("linear1", "linear2") and head + "self_attn.in_proj_weight" in sd \
            and not any(k.startswith(head + "multihead_attn.") for k in sd):
        return "nn.TransformerEncoderLayer reads linear1/linear2.weight in its inference fast path"
    return ""


def _moe_router(prefix: str, moe: bool) -> str:
    """Why the layer ``prefix`` stays dense as an MoE router, else "": it or its parent is named as
    ``sparsify_`` names a router (``masks.kept_dense._ROUTER_PART`` as a whole name: ``mlp.gate``,
    ``router``, ``router.classifier``; never a ``*_proj`` layer) in a checkpoint holding experts (a
    name with ``expert`` in it: ``mlp.experts.0.w1``, ``shared_experts``, anywhere, since a shard
    may hold a router without its experts). A state dict has no config to count the experts by; the
    experts keep a dense model's ``gate`` (D-FINE's) in the plan. Most routers are custom modules
    (Qwen-MoE, Mixtral, DeepSeek) that ``sparsify_`` never swaps: compressed, the file would load
    into no model."""
    from ..masks.kept_dense import _ROUTER_PART
    parent, _, leaf = prefix.rpartition(".")
    named = _ROUTER_PART.fullmatch(leaf) or _ROUTER_PART.fullmatch(parent.rpartition(".")[2])
    if leaf.endswith("_proj") or not named or not moe:
        return ""
    return ("MoE router (named so, in a checkpoint holding experts): kept dense as sparsify_ keeps it; pruning it "
            "changes which experts each token takes")


def _torch_pruned(sd: dict) -> None:
    """ValueError naming the tensors saved with ``torch.nn.utils.prune`` (``<name>_orig`` + ``<name>_mask``,
    the layer's ``<name>`` being their product, made by a forward pre-hook): the file holds no
    ``<name>`` to prune, and it loads into no model without those hooks."""
    pairs = [k[:-len("_orig")] for k in sd if k.endswith("_orig") and k[:-len("_orig")] + "_mask" in sd]
    if pairs:
        shown = ", ".join(f"{n}_orig + {n}_mask" for n in pairs[:3]) + (f" and {len(pairs) - 3} more"
                                                                          if len(pairs) > 3 else "")
        raise ValueError(f"{len(pairs)} tensor(s) were saved with torch.nn.utils.prune ({shown}): its hook "
                         "computes each as orig * mask, so the file holds no plain weight for them; call "
                         "torch.nn.utils.prune.remove(module, 'weight') on each pruned layer before saving the "
                         "state dict, then prune that file")


def _stored_quantized(key: str, t: torch.Tensor, sd: dict) -> str:
    """Why a 2-D floating-point ``<prefix>.weight`` of a dtype sparse24 does not prune (float8:
    quantized by another tool, its scale beside it) is kept dense, else "". Counted and listed
    with the others (the report names every 2-D floating-point weight)."""
    if not ((key == "weight" or key.endswith(".weight")) and t.dim() == 2 and t.is_floating_point()
            and t.layout == torch.strided) or is_weight_matrix(key, t):
        return ""
    prefix = key[:-len("weight")]
    scale = next((prefix + n for n in ("weight_scale_inv", "weight_scale") if prefix + n in sd), None)
    return (f"stored as {str(t.dtype)[6:]} (quantized by another tool" + (f"; its scale is {scale}" if scale else "")
            + "): sparse24 prunes float16/bfloat16/float32/float64 weights; prune the dense original")


def prune_state_dict(sd: dict, method: str = "magnitude", quantize: str | None = None,
                     min_features: int | None = None, exclude: str = PRUNE_EXCLUDE,
                     prune_head: bool = False, progress: bool | None = None, *, group_size: int | None = None,
                     symmetric: bool | None = None) -> tuple[dict, list[dict]]:
    """2:4-prune the linear weights of a raw state dict (no model class needed).

    Every 2-D floating ``<prefix>.weight`` with in-features divisible by 4 and
    both dimensions >= ``min_features`` is pruned, unless its name matches
    ``exclude``, it is an MoE router (named ``gate`` / ``router``, or under a
    module so named, in a checkpoint holding experts), its storage is shared
    with another entry (tied weights) or it
    is the output head (as many rows as the largest excluded embedding table:
    kept dense as LLM pruning does, unless ``prune_head``). A float8 weight
    (quantized by another tool) is listed and kept as stored. A state dict saved
    with ``torch.nn.utils.prune`` (``weight_orig`` + ``weight_mask``) is refused
    (ValueError): its layers hold no plain weight. A raw state dict does
    not say which layers are Hugging Face ``Conv1D`` (weight stored transposed):
    prune a model folder for GPT-2-style models.
    Pruned entries are stored the way :class:`sparse24.Sparse24Linear` holds
    them, so ``load_state_dict`` of a model prepared with
    ``sparse24.sparsify_(model, mode="compressed", quantize=...)`` takes them:

    * ``<prefix>.values`` ``(R, C/2)``, ``<prefix>.meta`` ``(ceil(C/32), R)`` int32 and,
      for INT8, ``<prefix>.scale`` ``(R,)`` fp32 (INT4: values ``(R, C/4)`` uint8, scale
      ``(R, ceil(C/group_size))`` fp16, zero points when asymmetric, and ``group_size``),
      replacing ``<prefix>.weight``;
    * layers whose parent reads ``.weight`` directly (``nn.MultiheadAttention.out_proj``,
      ``nn.TransformerEncoderLayer.linear1/2``, the T5 family's feed-forward ``wo``) stay in
      masked mode, as ``sparsify_`` keeps them: ``<prefix>.weight`` (zeros where pruned) +
      ``<prefix>.mask`` (bool). A state dict shows no code: other direct readers are not
      seen (prune a Hugging Face model folder, or ``sparsify_`` the model, for those).

    Everything else is copied unchanged.

    Args:
        sd: ``{name: tensor}``.
        method: a mask method needing no calibration data (``"magnitude"``,
            ``"2d_greedy"``, ``"2d_optimal"``).
        quantize: ``None``, ``"int8"`` or ``"int4"``.
        min_features: default ``sparse24.api.MIN_FEATURES`` (the same rule as ``sparsify_``).
        exclude: regular expression; a weight whose layer name or weight name (``<prefix>.weight``)
            it matches is left dense (default ``PRUNE_EXCLUDE``: the embedding tables; the largest
            of them gives the vocabulary, which finds the output head).
        prune_head: prune the output head too.
        progress: a tqdm bar over the entries (default None: when stderr is a terminal).
        group_size, symmetric: ``quantize="int4"`` only, as for :func:`sparse24.compress_`.
    Returns:
        ``(new_state_dict, report)`` with one report dict per 2-D float weight:
        ``name, shape, dtype, action ("compressed" | "masked" | "kept dense"),
        reason, kept (fraction of |w| kept), bytes_before, bytes_after``.
    Example:
        >>> sd = torch.nn.Linear(64, 32).state_dict()  # keys 'weight', 'bias'
        >>> new, report = prune_state_dict({"fc." + k: v for k, v in sd.items()})
        >>> sorted(new), report[0]["action"]
        (['fc.bias', 'fc.meta', 'fc.values'], 'compressed')
    """
    from ..api import MIN_FEATURES
    from ..format import compress
    from ..masks import kept_magnitude_fraction, mask_nm
    from ..nn import compressed_entries, quant_options

    if method in ("wanda", "sparsegpt"):
        raise ValueError(f"method {method!r} needs calibration data (layer inputs), which a checkpoint does not "
                         f"have; prune a Hugging Face model folder with calibration text (python -m sparse24 "
                         f"prune FOLDER --method {method} --calibration TEXT), use sparse24.calibrate + sparsify_ "
                         "in Python, or magnitude/2d_greedy/2d_optimal")
    quant = quant_options(quantize, group_size, symmetric)
    min_features = MIN_FEATURES if min_features is None else min_features
    if min_features < 0:
        raise ValueError(f"--min-features must be >= 0, got {min_features}")
    excl = exclude_pattern(exclude)
    _torch_pruned(sd)
    # sparse-layout or meta tensors hold no dense data to prune (and have no storage): copied as they are
    # (a dict: the state dict's order, which "the last 2-D weight" below reads; a set's order varies per run)
    plain = {k: None for k, v in sd.items() if v.layout == torch.strided and not v.is_meta}
    storages: dict[int, list[str]] = {}
    for k in plain:
        storages.setdefault(sd[k].untyped_storage().data_ptr(), []).append(k)
    # The output head, chosen as sparsify_ chooses it (masks.kept_dense._output_heads). A raw state dict names no
    # nn.Embedding: the input embedding is the largest 2-D weight named like one (PRUNE_EXCLUDE), else the
    # largest one --exclude names; among the other 2-D weights with as many rows as its vocabulary, the one
    # sharing its storage (tied), else the last in the state dict.
    mats = [k for k in plain if is_weight_matrix(k, sd[k])]
    named = re.compile(PRUNE_EXCLUDE, re.IGNORECASE)
    tables = ([k for k in mats if excluded(named, k[:-len("weight")].rstrip("."))]
              or [k for k in mats if excluded(excl, k[:-len("weight")].rstrip("."))])
    emb = max(tables, key=lambda k: sd[k].shape[0], default=None)
    wide = [k for k in mats if emb is not None and k not in tables and sd[k].shape[0] == sd[emb].shape[0]]
    ptr = None if emb is None else sd[emb].untyped_storage().data_ptr()
    heads = set(([k for k in wide if sd[k].untyped_storage().data_ptr() == ptr] or wide)[-1:])
    moe = any("expert" in k.lower() for k in sd)
    out, report = {}, []
    for key, t in progress_bar(sd.items(), desc="prune", progress=progress, unit="tensor"):
        if not is_weight_matrix(key, t) or key not in plain:
            quantized = _stored_quantized(key, t, sd) if key in plain else ""
            if quantized:
                report.append(dense_row(key, t, quantized))
            out[key] = t
            continue
        prefix = key[: -len("weight")]  # "fc." (or "" for a bare Linear's state dict)
        R, C = t.shape
        row = dense_row(key, t, "")
        tied = [k for k in storages[t.untyped_storage().data_ptr()] if k != key]
        taken = [prefix + n for n in LAYER_ENTRIES[1:] if prefix + n in sd]
        if taken:  # writing them would overwrite those entries silently
            row["reason"] = f"the state dict already has {', '.join(taken)}"
        elif C % 4:
            row["reason"] = f"in-features {C} not divisible by 4"
        elif min(R, C) < min_features:
            row["reason"] = f"smaller than min_features={min_features}: too small to gain"
        elif excluded(excl, prefix.rstrip(".")):
            row["reason"] = f"name matches --exclude {exclude!r} (an embedding table?)"
        elif router := _moe_router(prefix.rstrip("."), moe):
            row["reason"] = router
        elif tied:   # (the first names: a tensor saved under 300 names made a 300-name line)
            row["reason"] = (f"storage shared with {', '.join(tied[:3])}"
                             + (f" and {len(tied) - 3} more" if len(tied) > 3 else "")
                             + " (tied weights): pruning would prune those too")
        elif not prune_head and key in heads:
            row["reason"] = (f"output head ({R} rows = the vocabulary of {emb[:-len('.weight')] or emb}): kept "
                             "dense as LLM pruning does; --prune-head prunes it")
        if row["reason"]:
            out[key] = t
            report.append(row)
            continue
        mask = mask_nm(t, 2, 4, method=method)
        row["kept"] = kept_magnitude_fraction(t, mask)
        reader = _direct_reader(prefix.rstrip("."), sd)
        if reader:
            written = {key: torch.where(mask, t, 0), prefix + "mask": mask}
            row.update(action="masked", reason=f"kept as weight + mask: {reader}")
        else:
            written = {prefix + n: v for n, v in compressed_entries(compress(t, mask, **quant)).items()}
            row["action"] = "compressed" + quant_label(quant)
        out.update(written)
        # this layer's entries only (rescanning all of `out` per layer was quadratic: 16000 layers took 122 s)
        row["bytes_after"] = sum(v.numel() * v.element_size() for v in written.values())
        report.append(row)
    return out, report


def _check_prune_out(args) -> Path:
    if Path(args.out).resolve() == Path(args.checkpoint).resolve():
        raise CLIError("--out must differ from the input checkpoint (it would be overwritten)")
    out = Path(args.out)
    check_out_writable(out)  # before the work (calibration can take an hour), and before creating any folder
    return out


@contextlib.contextmanager
def _writing(out: Path, only: bool = False):
    """Turn an OSError writing ``out`` (or its temporary names; any OSError when ``only``: the block does
    nothing else) into a one-line error naming --out. A writer's own error for a failed write counts as
    the OSError it stands for, and an interrupt it wrapped is raised as itself (exit 130 / 143, not a
    traceback): see :func:`_write_failure`."""
    try:
        yield
    except Exception as e:
        err = _write_failure(e, out)
        if err is None:
            raise
        if only or _concerns(err.filename, out):
            raise CLIError(f"--out {out}: cannot write it ({err.strerror or _one_line(err)})") from None
        if err is e:
            raise
        raise err from None


def _write_failure(e: Exception, out: Path) -> OSError | None:
    """``e`` as the OSError it reports, or None. torch.save raises a RuntimeError ("unexpected pos") whose
    context is the failed write's OSError, or the KeyboardInterrupt / SIGTERM exception raised while it
    wrote (raised again here); safetensors a SafetensorError "Error while serializing: ... (os error N)"
    (only ``out`` is serialized: the OSError names it)."""
    ctx = e.__context__
    if ctx is not None and not isinstance(ctx, Exception):
        raise ctx from None
    if isinstance(e, OSError):
        return e
    if isinstance(e, RuntimeError) and isinstance(ctx, OSError):
        return ctx
    if type(e).__name__ == "SafetensorError" and str(e).startswith("Error while serializing"):
        code = re.search(r"os error (\d+)", str(e))
        return OSError(int(code[1]), os.strerror(int(code[1])), str(out)) if code else \
            OSError(0, _one_line(e)[:200], str(out))
    return None


def _concerns(filename, out: Path) -> bool:
    """Whether an OSError's ``filename`` is ``out``, inside it, a folder above it, or one of the temporary
    names written beside it (``.s24-PID-HASH.*``, :func:`~sparse24.tools.cli_common.temp_name`); ``out`` a
    symbolic link: or its target (written in its place, :func:`~.checkpoint.output_folder`)."""
    if not filename:
        return False
    name = Path(filename).absolute()
    return any(str(name).startswith(str(here)) or here.is_relative_to(name)
               or name.parent == here.parent and name.name.startswith(
                   (f".{here.name}.", f".{here.stem}.", temp_name(here.name, "").rstrip(".")))
               for here in {out.absolute(), out.resolve()})


def _load_hint(report: list[dict], quant: dict, min_features: int | None, out: Path) -> str:
    """The exact ``sparsify_`` call whose model loads the state dict written: the layers kept dense are named
    (sparsify_ would prune some of them: --exclude, its own head rule), ``min_features`` when given."""
    dense = [r["name"][:-len(".weight")] if r["name"] != "weight" else "" for r in report
             if r["action"] == "kept dense"]
    call = "sparse24.sparsify_(model, mode='compressed'" + "".join(f", {k}={v!r}" for k, v in quant.items())
    if min_features is not None:
        call += f", min_features={min_features}"
    if dense:
        call += f", filter_fn=lambda m, name: name not in {sorted(dense)!r}"
    call += ", skip_output_head=False"  # the head this command chose is among those named
    return (f"  load it with: {call}); model.load_state_dict("
            + ("safetensors.torch.load_file(...))" if out.suffix == ".safetensors" else "torch.load(...))"))


def _save_state_dict(sd: dict, path: Path) -> None:
    """``torch.save``, or safetensors for a ``.safetensors`` name (tensors sharing storage, i.e.
    tied weights kept dense, are stored as copies: safetensors refuses shared tensors)."""
    if path.suffix != ".safetensors":
        # through a file object: torch.save names the zip records after a path's file name (here
        # write_together's pid-bearing temporary one), so two identical runs wrote different bytes
        with open(path, "wb") as f:
            torch.save(sd, f)
        return
    from safetensors.torch import save_file
    seen, flat = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) if v.numel() else None
        flat[k] = v.clone() if key in seen else v.contiguous()
        seen.add(key)
    save_file(flat, path, metadata={"format": "pt"})


def _check_copies(sd: dict, out: Path, size_in: int) -> None:
    """CLIError when the copies :func:`_save_state_dict` would write for names sharing memory (tied
    weights: stored once in a torch file, kept dense, one copy per name in safetensors) exceed 8 times
    the input's size: one tensor saved under 300 names made a 1 MB file 315 MB (and as much memory),
    while a T5 embedding tied under 4 names (the copies 1.6x the input) is an ordinary file."""
    groups: dict[tuple, list[str]] = {}
    for k, v in sd.items():
        if v.layout == torch.strided and not v.is_meta and v.numel():
            groups.setdefault((v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()), []).append(k)
    extra = sum(sd[k].numel() * sd[k].element_size() for names in groups.values() for k in names[1:])
    if extra > 8 * size_in:
        shared = [names for names in groups.values() if len(names) > 1]
        top = max(shared, key=len)
        raise CLIError(f"--out {out}: {sum(map(len, shared))} names share the memory of {len(shared)} tensor(s) "
                       f"(tied weights: {top[0]} has {len(top) - 1} other name(s), e.g. {top[1]}); safetensors "
                       f"stores every name separately, {extra} more bytes, over 8 times the {size_in}-byte input; "
                       "write a .pt file, which keeps one copy")


def _print_prune_table(title: str, report: list[dict], out: Path, size_in: int) -> None:
    names = [printable(r["name"]) for r in report]  # a file's names may hold terminal control sequences
    w = max(len(n) for n in names)
    print(title)
    print(f"  {'weight':<{w}}  {'shape':>12}  {'dtype':>8}  {'|w| kept':>8}  {'bytes':>10}  {'-> bytes':>10}  action")
    for name, r in zip(names, report):
        kept = f"{100 * r['kept']:.1f}%" if r["action"] != "kept dense" else "-"
        print(f"  {name:<{w}}  {str(r['shape']):>12}  {r['dtype']:>8}  {kept:>8}  {r['bytes_before']:>10}  "
              f"{r['bytes_after']:>10}  {r['action']}" + (f" ({printable(r['reason'])})" if r["reason"] else ""))
    before, after = (sum(r[k] for r in report) for k in ("bytes_before", "bytes_after"))
    n = sum(r["action"] != "kept dense" for r in report)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else out.stat().st_size
    print(f"  {n} of the checkpoint's {len(report)} 2-D float weight tensors pruned (embedding tables "
          f"and heads count too); their bytes {before} -> {after} "
          f"({100 * after / max(before, 1):.1f}%); other tensors copied unchanged")
    print(f"  {'folder' if out.is_dir() else 'file'}: {out} ({size} bytes; input {size_in} bytes)")


def cmd_prune(args) -> int:
    from .prune_calibrated import CALIBRATED, check_calibration_arguments
    out = _check_prune_out(args)
    src = Path(args.checkpoint)
    quant = prune_quant(args)
    settings = f": method={args.method}" + "".join(f", {k}={v}" for k, v in quant.items())
    if getattr(args, "calibration_ids", None) is not None:
        return _prune_blockwise(args, src, out, settings)
    check_calibration_arguments(args, src)
    if args.method in CALIBRATED:
        return _prune_calibrated(args, src, out, settings)
    if is_model_folder(src):
        return _prune_folder(args, src, out, settings)
    if out.is_dir() or str(args.out).endswith(("/", os.sep)):  # (Path drops a trailing slash: "new/" is a folder)
        raise CLIError(f"--out {args.out}: is a folder; name the file to write")
    if out.suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        raise CLIError("writing .safetensors needs the safetensors package: pip install 'sparse24[hf]'", 1)
    sd, wrapper = _load_state_dict(args.checkpoint)
    sd, restored = _restore_ties(src, sd)
    odd = next((k for k, v in sd.items() if v.layout != torch.strided), None) if out.suffix == ".safetensors" else None
    if odd is not None:
        raise CLIError(f"--out {out}: safetensors stores dense tensors only, and {odd!r} is a "
                       f"{str(sd[odd].layout).removeprefix('torch.')} tensor; write a .pt file")
    if out.suffix == ".safetensors":
        _check_copies(sd, out, src.stat().st_size)
    exclude = PRUNE_EXCLUDE if args.exclude is None else args.exclude  # (a file names no embedding table)
    new, report = prune_state_dict(sd, args.method, args.quantize, args.min_features, exclude, args.prune_head,
                                   args.progress, **int4_args(quant))
    if not any(r["action"] != "kept dense" for r in report):
        kinds = {}   # one weight per kind of reason, at most 3 (an fp8 file's routers hid its fp8 weights)
        for r in report:
            kinds.setdefault(r["reason"].split(" (")[0].split(":")[0], f"{r['name']}: {r['reason']}")
        raise CLIError(f"{args.checkpoint}: no weight could be pruned ({len(report)} 2-D float weight(s), "
                       "none eligible" + (f"; e.g. {'; '.join(list(kinds.values())[:3])}" if report else "")
                       + "); see --min-features / --exclude", 1)
    from .bench import make_parent, write_together
    with new_parents(out), _writing(out, only=True):  # (the folders it makes are removed again if it fails)
        make_parent(out)
        write_together({out: lambda p: _save_state_dict(new, p)})  # a failed write leaves an existing file whole
    _print_prune_table(f"{_prog()} prune {args.checkpoint}" + (f" (state dict under '{wrapper}')" if wrapper else "")
                       + settings, report, out, src.stat().st_size)
    if restored:
        print(f"  tied names the file left out (safetensors save_model; its metadata names them), written again: "
              f"{', '.join(restored)}")
    print(_load_hint(report, quant, args.min_features, out))
    return 0


def _restore_ties(path: Path, sd: dict) -> tuple[dict, list[str]]:
    """``sd`` with the tied names ``safetensors.torch.save_model`` left out of the file at ``path`` put back
    (each the very tensor of the name it was tied to, after it), and ``["removed = kept", ...]``.
    save_model stores one copy of tensors sharing memory and records each name it drops in the file's
    metadata (``{removed: kept}``). Without them the pair looks untied: the copy kept would be pruned,
    while ``sparsify_`` keeps a tied layer dense, and the model's load would miss the names dropped."""
    if path.suffix != ".safetensors":
        return sd, []
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    # (a user's metadata may name a tensor too: only a name of the same kind, weight for weight, is a tie)
    ties = {k: v for k, v in meta.items() if k not in sd and v in sd and k.rpartition(".")[2] == v.rpartition(".")[2]}
    if not ties:
        return sd, []
    out = {}
    for k, t in sd.items():
        out[k] = t
        out.update((removed, t) for removed, kept in ties.items() if kept == k)
    return out, [f"{removed} = {kept}" for removed, kept in ties.items()]


def _prune_folder(args, src: Path, out: Path, settings: str) -> int:
    """``prune FOLDER --out DIR``: a Hugging Face model folder (see :mod:`sparse24.tools.hf_folder`)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
        raise CLIError("pruning a model folder needs transformers and safetensors: pip install 'sparse24[hf]'", 1)
    from .hf_folder import prune_folder
    with _writing(out):
        report = prune_folder(src, out, args.method, args.quantize, args.min_features, args.exclude, args.prune_head,
                              args.progress, **int4_args(prune_quant(args)))
    size_in = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    _print_prune_table(f"{_prog()} prune {src} (Hugging Face folder){settings}", report, out, size_in)
    _print_folder_tail(src, out)
    return 0


def _print_folder_tail(src: Path, out: Path) -> None:
    """The last lines for a folder: the other-format weight files left out, and how to load the result."""
    from .hf_folder import links_left_out, other_weight_files
    other = other_weight_files(src)
    if other:
        print(f"  not copied (the dense weights in other formats): {', '.join(other)}")
    links = links_left_out(src)
    if links:
        print(f"  not copied (links out of the folder, FIFOs, devices): {', '.join(map(printable, links))}")
    print(f"  load it with: sparse24.from_pretrained(<model class>, {str(out)!r})")
    return 0


def _prune_calibrated(args, src: Path, out: Path, settings: str) -> int:
    """``prune FOLDER --method wanda|sparsegpt|layerwise --calibration TEXT`` (see
    :mod:`sparse24.tools.prune_calibrated`)."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
        raise CLIError("pruning a model folder needs transformers and safetensors: pip install 'sparse24[hf]'", 1)
    from .prune_calibrated import prune_folder_calibrated
    with _writing(out):
        report, note = prune_folder_calibrated(src, out, args)
    size_in = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    _print_prune_table(f"{_prog()} prune {src} (Hugging Face folder){settings}; {note}", report, out, size_in)
    _print_folder_tail(src, out)
    return 0


def add_blockwise_args(parser) -> None:
    """The options of ``prune`` with calibration: a Hugging Face folder pruned block by block."""
    parser.add_argument("--calibration-ids", metavar="FILE",
                        help="torch file holding an (N, L) int64 tensor of token ids: prune a Hugging Face folder "
                             "one decoder block at a time on them (--method wanda or sparsegpt; a model larger "
                             "than memory)")
    parser.add_argument("--batch-size", type=int, help="calibration sequences per forward (default 1)")


def _prune_blockwise(args, src: Path, out: Path, settings: str) -> int:
    """``prune FOLDER --out DIR --method wanda|sparsegpt --calibration-ids FILE``
    (see :mod:`sparse24.tools.blockwise`)."""
    if args.method not in ("wanda", "sparsegpt"):
        raise CLIError(f"--calibration-ids (block by block) takes --method wanda or sparsegpt, not {args.method}")
    if args.calibration is not None or args.permute or args.noise is not None or args.noise_p is not None:
        raise CLIError("--calibration-ids prunes block by block on token ids: give it without --calibration, "
                       "--permute and --noise (those are the in-memory calibrated path)")
    unread = [f"--{k.replace('_', '-')}" for k in ("samples", "seq_len", "permute_iters")
              if getattr(args, k, None) is not None]
    if unread:
        raise CLIError(f"--calibration-ids prunes block by block on token ids: give it without {', '.join(unread)} "
                       "(options of the in-memory calibrated path)")
    args.batch_size = 1 if args.batch_size is None else args.batch_size
    if args.prune_head:   # (it was ignored: only the decoder blocks' layers are pruned on this path)
        raise CLIError("--calibration-ids prunes the decoder blocks' layers only: the output head stays dense; "
                       "give it without --prune-head")
    if not is_model_folder(src):
        raise CLIError(f"{src}: calibrated pruning takes a Hugging Face model folder (config.json + safetensors)")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
        raise CLIError("pruning a model folder needs transformers and safetensors: pip install 'sparse24[hf]'", 1)
    try:
        ids = load_torch_file(args.calibration_ids)
    except Exception as e:  # torch raises many types for non-checkpoint files
        raise CLIError(f"cannot read --calibration-ids {args.calibration_ids}: {_one_line(e)[:200]}") from None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise CLIError(f"--calibration-ids {args.calibration_ids}: expected an (N, L) int64 tensor of token ids")
    from .blockwise import prune_folder_blockwise
    try:
        with _writing(out):
            report = prune_folder_blockwise(src, out, list(ids.split(args.batch_size)), args.method, args.quantize,
                                            args.min_features, args.exclude, **int4_args(prune_quant(args)),
                                            all_weights=True)
    except (ValueError, TypeError) as e:
        raise CLIError(f"{src}: {_one_line(e)}") from None
    size_in = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    _print_prune_table(f"{_prog()} prune {src} (Hugging Face folder, block by block on {ids.shape[0]} x "
                       f"{ids.shape[1]} tokens){settings}", report, out, size_in)
    _print_folder_tail(src, out)
    return 0

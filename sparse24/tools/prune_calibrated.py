"""Calibrated pruning of a Hugging Face model folder from the command line:
``python -m sparse24 prune FOLDER --out DIR --method wanda|sparsegpt|layerwise
[--permute] --calibration TEXT [--samples N] [--seq-len L] [--noise COPIES [--noise-p P]]``.

The calibration text (a file with one sample per line, or a folder with one
sample per file) is tokenized with the folder's own tokenizer, one sample per
batch (no padding, so every statistic counts real tokens only and layers that
read one vector per sequence, such as BERT's pooler, calibrate too). Then the
library runs exactly what a user would write in Python (:func:`prune_calibrated`):

* ``wanda``: ``calibrate`` + ``sparsify_(method="wanda")``;
* ``sparsegpt``: ``calibrate(hessian=True)`` + ``sparsify_(method="sparsegpt",
  refit=True)`` (SparseGPT's mask, kept weights re-solved by least squares);
* ``layerwise`` (the recommended one-shot recipe, docs/masks.md): each layer, in
  order, fit by SparseGPT + least squares to the dense model's outputs from the
  inputs the pruned layers before it give (``prune_layerwise_(..., teacher=dense,
  refit=True, percdamp=LAYERWISE_PERCDAMP)``, damping 0.1), then ``sparsify_``;
* ``--noise COPIES`` (``layerwise``: 2 unless given; the others: 0): the samples
  are followed by COPIES noisy copies of each (:func:`sparse24.token_noise`: each
  token replaced with probability ``--noise-p``, 0.3, by a random one of the
  tokenizer's vocabulary, special tokens kept), which keeps the recipe from
  leaning on what a few hundred samples of one kind of text happened to show
  (docs/recipes.md, "How much calibration data is enough");
* ``--permute`` first: channel permutations found by ``find_permutation_groups``
  (proved exact on the longest sample) and searched on the method's importance
  (``permute_model_``).

The layers are those ``sparsify_`` picks (output head dense unless
``--prune-head``, ``--exclude``, ``--min-features``), planned on a meta-device
copy as for magnitude pruning. The new folder is ``save_pretrained``'s, with the
tokenizer and every other file and subfolder copied (not the dense weights in other formats:
:func:`sparse24.tools.hf_folder.copy_rest`); ``sparse24.from_pretrained`` loads it.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..api import MIN_FEATURES, sparsify_
from ..masks import (calibrate, find_permutation_groups, kept_magnitude_fraction, permute_model_, prune_layerwise_,
                     token_noise)
from ..masks.reconstruct import LAYERWISE_PERCDAMP
from ..nn import Sparse24Linear, is_conv1d_class
from .._progress import progress_enabled
from .checkpoint import (LAYER_ENTRIES, check_shards, dense_row, exclude_pattern, is_model_folder, is_weight_matrix,
                         finish_folder, output_folder, partial_folder, quant_label)
from .cli_common import CLIError, _one_line, exclude_filter, exclude_reason, int4_args, prune_quant

__all__ = ["CALIBRATED", "read_samples", "tokenize_samples", "prune_calibrated", "prune_folder_calibrated",
           "add_calibration_arguments", "check_calibration_arguments"]

CALIBRATED = ("wanda", "sparsegpt", "layerwise")
PERMUTE_ITERS = 200  # search steps per permutation group: deterministic (the time limit is far away)
# Noisy copies per sample for --method layerwise unless --noise is given (docs/recipes.md: 256 code lines judged
# on prose 0.897 / 0.890 -> 0.905 / 0.901; chosen on selection texts, results/minilm-calibration/select-256.md).
LAYERWISE_NOISE, NOISE_P = 2, 0.3


def read_samples(path: str | os.PathLike, samples: int) -> list[str]:
    """The first ``samples`` calibration texts of ``path``: its non-empty lines (a file; split at ``\\n`` only,
    ``\\r\\n`` counting as one)
    or the text of each file (a folder, in name order; empty files skipped)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        texts = [t for t in (_read_text(f) for f in files) if t.strip()]
    elif p.is_file():
        # "\n" only: str.splitlines() also splits at form feeds, \x1c-\x1e, \x85, U+2028/9 inside a line
        texts = [line for line in _read_text(p).replace("\r\n", "\n").split("\n") if line.strip()]
    else:
        raise CLIError(f"--calibration {path}: no such file or folder")
    if not texts:
        raise CLIError(f"--calibration {path}: no text in it (a file with one sample per line, or a folder with one "
                       "sample per file)")
    return [t.strip() for t in texts[:samples]]


def _read_text(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"--calibration: {f} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def tokenize_samples(tokenizer, model: torch.nn.Module, texts: list[str], seq_len: int) -> list[dict]:
    """One batch per text: ``tokenizer(text, truncation=True, max_length=seq_len)`` as ``(1, L)``
    tensors, keeping only the inputs ``model.forward`` names (a tokenizer may add
    ``token_type_ids`` a decoder does not take), plus ``use_cache=False`` where it takes one."""
    names = {n for n, prm in inspect.signature(model.forward).parameters.items()
             if prm.kind not in (prm.VAR_KEYWORD, prm.VAR_POSITIONAL)}
    # no key/value cache: nothing reads it, and its objects make two runs' outputs compare unequal
    extra = {"use_cache": False} if "use_cache" in names else {}
    batches = []
    for text in texts:
        enc = tokenizer(text, truncation=True, max_length=seq_len, return_tensors="pt")
        b = {**{k: v for k, v in enc.items() if k in names}, **extra}
        if "input_ids" not in b or b["input_ids"].numel() == 0:
            continue  # nothing left of this sample (e.g. only characters the tokenizer drops)
        batches.append(b)
    if not batches:
        raise CLIError("--calibration: the tokenizer gave no tokens for any sample")
    return batches


def prune_calibrated(model: torch.nn.Module, batches: list, method: str, layers: set[str], permute: bool = False,
                     heads: int | None = None, quantize: str | None = None, prune_head: bool = False,
                     min_features: int = MIN_FEATURES, permute_iters: int = PERMUTE_ITERS,
                     progress: bool | None = None, *, group_size: int | None = None,
                     symmetric: bool | None = None) -> tuple[dict[str, float], int]:
    """Prune ``model`` in place with a calibrated ``method`` (see the module docstring), the
    ``layers`` (names) compressed, and return each layer's kept fraction of the dense ``sum |W|``.

    Args:
        model: a dense model (``nn.Linear`` layers).
        batches: ``model(**batch)`` inputs, one sample each.
        method: ``"wanda"``, ``"sparsegpt"`` or ``"layerwise"``.
        layers: the ``nn.Linear`` names to prune (``sparsify_``'s plan).
        permute: search channel permutations first (``heads``: attention heads, for the value channels).
        quantize, prune_head, min_features, group_size, symmetric: as :func:`sparse24.sparsify_`.
        permute_iters: search steps per permutation group.
        progress: tqdm bars (None: on a terminal).
    Returns:
        ``({layer name: kept fraction of sum |W| of the dense (permuted) weight}, permutation groups applied)``.
    """
    def chosen(mod, fqn):
        return fqn in layers

    options = {"filter_fn": chosen, "mode": "compressed", "quantize": quantize, "min_features": min_features,
               "skip_output_head": not prune_head, "group_size": group_size, "symmetric": symmetric}
    stats, groups = None, []
    if permute or method != "layerwise":
        stats = calibrate(model, batches, hessian=method != "wanda", filter_fn=chosen, progress=progress)
    if permute:
        # the proof's example: the longest batch (a one-token first line proved nothing: check_example)
        example = max(batches, key=lambda b: b["input_ids"].shape[-1] if isinstance(b, Mapping) else 0)
        groups = [g for g in find_permutation_groups(model, example, heads=heads)
                  if all(c in layers for c in g.consumers)]
        permute_model_(model, groups, score="wanda" if method == "wanda" else "sparsegpt", calibration=stats,
                       example=example, max_iters=permute_iters, time_limit=3600,
                       progress=progress_enabled(progress))
    if method != "layerwise":
        report = sparsify_(model, method=method, calibration=stats, **options,
                           **({"refit": True} if method == "sparsegpt" else {}))
        return {r.fqn: r.kept_fraction for r in report.changed}, len(groups)
    del stats
    dense = copy.deepcopy(model)  # the teacher: the dense (permuted) model, only read
    prune_layerwise_(model, batches, method="sparsegpt", refit=True, teacher=dense, filter_fn=chosen,
                     percdamp=LAYERWISE_PERCDAMP, progress=progress)
    sparsify_(model, **options)  # magnitude masks keep exactly the non-zeros left
    mods = dict(dense.named_modules())
    return {fqn: kept_magnitude_fraction(mods[fqn].weight, m.sparse_tensor().kept_mask())
            for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)}, len(groups)


# --- the command line ------------------------------------------------------------------

def add_calibration_arguments(p) -> None:
    """The options of ``prune`` for the calibrated methods."""
    p.add_argument("--calibration", metavar="TEXT", help="calibration text for --method wanda|sparsegpt|layerwise: "
                   "a file (one sample per line) or a folder (one sample per file), tokenized with the model "
                   "folder's own tokenizer")
    p.add_argument("--samples", type=int, help="calibration samples used (the first N; default 128)")
    p.add_argument("--seq-len", type=int, help="tokens per sample at most (default 512)")
    p.add_argument("--noise", type=int, metavar="COPIES", help="noisy copies of each sample added to the calibration "
                   "(sparse24.token_noise: tokens replaced by random vocabulary tokens; default "
                   f"{LAYERWISE_NOISE} for layerwise, 0 for wanda and sparsegpt)")
    p.add_argument("--noise-p", type=float, metavar="P",
                   help=f"probability that a token of a noisy copy is replaced (default {NOISE_P})")
    p.add_argument("--permute", action="store_true", help="search channel permutations first (proved exact on the "
                   "longest sample; calibrated methods only)")
    p.add_argument("--permute-iters", type=int,
                   help=f"search steps per permutation group (default {PERMUTE_ITERS})")


def noise_copies(args) -> int:
    """Noisy copies per calibration sample: ``--noise``, else LAYERWISE_NOISE for layerwise, 0 for the others."""
    if args.noise is not None:
        return args.noise
    return LAYERWISE_NOISE if args.method == "layerwise" else 0


# The options only the in-memory calibrated path reads (None when not given), and their defaults.
CALIBRATION_DEFAULTS = {"samples": 128, "seq_len": 512, "permute_iters": PERMUTE_ITERS}


def check_calibration_arguments(args, src: Path) -> None:
    """Refuse what cannot work, or would be ignored, before anything is read (exit 2); fill in the
    defaults of the calibrated path's options."""
    if getattr(args, "batch_size", None) is not None:
        raise CLIError("--batch-size is for block-by-block pruning (--calibration-ids), which this is not")
    if args.method not in CALIBRATED:
        for flag, given in (("--calibration", args.calibration is not None), ("--permute", args.permute),
                            ("--noise", args.noise is not None), ("--noise-p", args.noise_p is not None),
                            *((f"--{k.replace('_', '-')}", getattr(args, k) is not None)
                              for k in CALIBRATION_DEFAULTS)):
            if given:
                raise CLIError(f"{flag} is for the calibrated methods ({', '.join(CALIBRATED)}), not --method "
                               f"{args.method}")
        return
    if not is_model_folder(src):
        what = "a bare state dict" if src.is_file() else "not a Hugging Face model folder"
        raise CLIError(f"--method {args.method} runs calibration text through the model, so it needs a Hugging Face "
                       f"model folder (config.json, weights, tokenizer); {src} is {what}: use --method magnitude, "
                       "2d_greedy or 2d_optimal for it")
    if args.calibration is None:
        raise CLIError(f"--method {args.method} needs --calibration TEXT (a file with one sample per line, or a "
                       "folder with one sample per file)")
    # options that would be ignored (the output as if they were absent) are refused, as for the other methods
    if args.permute_iters is not None and not args.permute:
        raise CLIError("--permute-iters goes with --permute (it sets that search's steps)")
    if args.noise_p is not None and noise_copies(args) == 0:
        raise CLIError(f"--noise-p goes with noisy copies: --noise COPIES > 0 (--method {args.method} makes none "
                       "by default)")
    for k, v in CALIBRATION_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for flag, v in (("--samples", args.samples), ("--seq-len", args.seq_len), ("--permute-iters", args.permute_iters)):
        if v < 1:
            raise CLIError(f"{flag} must be >= 1, got {v}")
    if args.noise is not None and args.noise < 0:
        raise CLIError(f"--noise must be >= 0, got {args.noise}")
    if args.noise_p is not None and not 0 <= args.noise_p <= 1:
        raise CLIError(f"--noise-p must be in [0, 1], got {args.noise_p}")


def prune_folder_calibrated(src: Path, dst: Path, args) -> tuple[list[dict], str]:
    """``prune FOLDER --method wanda|sparsegpt|layerwise``: everything is checked (arguments,
    calibration text, shards, model class, tokenizer) before the model is loaded; the new
    folder is written under a temporary name and renamed. Returns the report rows (one per
    2-D float ``*.weight`` stored in the checkpoint, as for the other methods) and a note on
    the calibration data."""
    from transformers import AutoTokenizer

    from .hf_folder import (NOT_SWAPPED, WEIGHT_FILES, _shards, _skeleton, check_layer_weights, copy_rest,
                            stored_names)

    try:
        dst = output_folder(dst)
    except ValueError as e:
        raise CLIError(str(e)) from None
    quant = prune_quant(args)
    texts = read_samples(args.calibration, args.samples)
    excl = exclude_pattern(args.exclude)
    shards, _ = _shards(src)
    headers = check_shards(src, shards)
    config, skeleton = _skeleton(src, headers)
    try:   # (never the folder's own code: transformers would ask on stdin, and run it on "y")
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError or its own types for a missing tokenizer
        if "trust_remote_code" in str(e):
            raise CLIError(f"{src}: its tokenizer is the folder's own code (auto_map in tokenizer_config.json or "
                           "config.json), which the command line never runs") from None
        raise CLIError(f"{src} has no tokenizer that transformers.AutoTokenizer loads ({_one_line(e)[:160]}); the "
                       "calibration text is tokenized with the model's own: save it into the folder "
                       "(tokenizer.save_pretrained)") from None
    min_features = MIN_FEATURES if args.min_features is None else args.min_features
    plan = sparsify_(skeleton, filter_fn=exclude_filter(excl),
                     mode="compressed", min_features=min_features, skip_output_head=not args.prune_head)
    planned = {fqn: m for fqn, m in skeleton.named_modules() if isinstance(m, Sparse24Linear)}
    conv = [fqn for fqn, m in planned.items() if is_conv1d_class(m._dense_cls)]
    if conv:
        raise CLIError(f"--method {args.method} calibrates nn.Linear layers, and {type(skeleton).__name__} holds "
                       f"transformers Conv1D layers ({conv[0]}, ...): prune it with --method magnitude")
    if not planned:
        raise CLIError(f"{src}: no layer to prune (see --min-features / --exclude)", 1)
    # from_pretrained would give a layer missing from the checkpoint transformers' random init, and int8 / fp8
    # codes stored as a layer's weight cast to float, their scale dropped: either pruned and written as the
    # model's. Refused from the shard headers, before loading, as on the other paths. The stored keys as
    # transformers renames them on load (a family's older checkpoint names, the base model prefix); a layer it
    # builds from fused stored tensors is refused there.
    names = stored_names(skeleton, headers, {f"{fqn}.weight" for fqn in planned}, src)
    check_layer_weights(headers, names, [f"{fqn}.weight" for fqn in planned], skeleton, src)
    # no longer than the model's positions (a longer sample would fail inside its embedding lookup)
    seq_len = min(args.seq_len, getattr(config, "max_position_embeddings", None) or args.seq_len)
    batches = tokenize_samples(tokenizer, skeleton, texts, seq_len)  # (the forward's signature only)
    # a tokenizer may have more entries than the model's embedding rows: its text must not use them, and the
    # noisy copies draw their replacement tokens from the rows only
    emb_rows = getattr(skeleton.get_input_embeddings(), "num_embeddings", None) or len(tokenizer)
    top = max(int(b["input_ids"].max()) for b in batches)
    if top >= emb_rows:
        raise CLIError(f"--calibration: the folder's tokenizer gives token id {top}, but the model's input "
                       f"embedding has {emb_rows} rows: the tokenizer does not belong to this model")
    with _transformers_bars(progress_enabled(args.progress)):
        model = type(skeleton).from_pretrained(src).eval()
    copies, p = noise_copies(args), NOISE_P if args.noise_p is None else args.noise_p
    calib = token_noise(batches, copies, p, vocab=min(len(tokenizer), emb_rows), keep=tokenizer.all_special_ids)
    kept, groups = prune_calibrated(model, calib, args.method, set(planned), args.permute,
                            getattr(config, "num_attention_heads", None), args.quantize, args.prune_head,
                            min_features, args.permute_iters, args.progress, **int4_args(quant))
    with partial_folder(dst) as tmp:
        with _transformers_bars(progress_enabled(args.progress)):
            model.save_pretrained(tmp)
        # tokenizer, generation config, README, subfolders, ... (what save_pretrained did not write)
        copy_rest(src, tmp, (*WEIGHT_FILES, "config.json", *shards))
        finish_folder(tmp, dst)
    skipped = {r.fqn + ".weight": exclude_reason(r.reason, args.exclude) for r in plan.skipped}
    state = model.state_dict()
    rows = []
    for key, (dtype, shape, _) in headers.items():
        # other dtypes (float8, ...): no weight matrix sparse24 prunes, so not counted as one
        t = torch.empty(tuple(shape), dtype=_SAFETENSORS_DTYPES.get(dtype, torch.uint8), device="meta")
        if not is_weight_matrix(key, t):
            continue
        # the model's name for it (see stored_names)
        name = names[key][0]
        fqn = name[:-len(".weight")]
        if fqn not in planned:
            rows.append(dense_row(key, t, skipped.get(name) or NOT_SWAPPED))
            continue
        stored = [state[f"{fqn}.{n}"] for n in LAYER_ENTRIES if f"{fqn}.{n}" in state]
        rows.append({**dense_row(key, t, ""), "action": "compressed" + quant_label(quant),
                     "kept": kept[fqn], "bytes_after": sum(v.numel() * v.element_size() for v in stored)})
    tokens = sum(b["input_ids"].numel() for b in batches)
    note = (f"{len(batches)} calibration samples from {args.calibration} ({tokens} tokens, at most {seq_len} "
            "each)" + (f", each with {copies} noisy cop{'y' if copies == 1 else 'ies'} (p = {p:g})"
                       if copies else "")
            + (f"; channel permutations in {groups} group(s) proved exact" if args.permute else ""))
    return rows, note


@contextlib.contextmanager
def _transformers_bars(progress: bool):
    """transformers' own loading and saving bars only when ours are on."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    if not progress:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}

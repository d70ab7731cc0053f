"""How close a pruned model stays to its dense original, on held-out data (layer 6).

* :func:`mean_pool`: sentence-transformers' mean pooling, differentiable (the
  ``forward=`` of :func:`sparse24.learn_masks` / :func:`sparse24.distill_` when
  a sentence encoder is trained on its sentence embeddings).
* :func:`sentence_embeddings` / :func:`embedding_fidelity`: a sentence encoder
  (e.g. ``transformers.AutoModel`` of all-MiniLM-L6-v2) judged by the mean
  cosine between its sentence embeddings and the dense model's, with the mean
  pooling over the tokens the attention mask keeps that sentence-transformers
  uses.
* :func:`bits_per_char`: a causal character-level language model judged by
  its cross-entropy in bits per character on fixed held-out windows.

Batches are passed to the model as :func:`sparse24.calibrate` passes them:
dicts (a tokenizer's output too) as ``model(**batch)``, tuples and lists as ``model(*batch)``, tensors as
``model(batch)``. Every function runs under ``torch.no_grad()`` in eval mode
and restores the model's train/eval flags afterwards.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._checks import call_with_batch, check_bool, check_model, refuse_single_batch
from .learn.objective import _output_tensor

__all__ = ["mean_pool", "sentence_embeddings", "embedding_fidelity", "bits_per_char"]


class _EvalMode:
    """``model.eval()`` for the block; every submodule's train/eval flag restored afterwards."""

    def __init__(self, model: nn.Module):
        self.modes = [(mod, mod.training) for mod in model.modules()]

    def __enter__(self):
        for mod, _ in self.modes:
            mod.training = False

    def __exit__(self, *exc):
        for mod, training in self.modes:
            mod.training = training


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor | None = None, normalize: bool = True) -> torch.Tensor:
    """Mean of each sentence's token vectors over the tokens ``mask`` keeps (sentence-transformers'
    pooling), optionally L2-normalized. Differentiable: usable inside a training step.

    Args:
        hidden: ``(B, L, D)`` token vectors (``last_hidden_state``).
        mask: ``(B, L)`` bool or 0/1 tensor of the tokens to average (the attention mask);
            None averages every token.
        normalize: L2-normalize each sentence vector.
    Returns:
        ``(B, D)`` tensor in ``hidden``'s dtype, computed in at least float32.
    Example:
        >>> h = torch.tensor([[[1., 0.], [3., 0.], [9., 9.]]]); mask = torch.tensor([[1, 1, 0]])
        >>> mean_pool(h, mask, normalize=False)
        tensor([[2., 0.]])
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"mean_pool: hidden must be a (B, L, D) tensor, got {got}")
    normalize = check_bool(normalize, "normalize")   # ("False" from a config file normalized)
    # at least fp32: in fp16 a long sentence's sum overflows and clamp(min=1e-9) underflows to 0 (0/0 = NaN)
    h = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
    if mask is None:
        pooled = h.mean(1)
    else:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(hidden.shape[:2]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"the token mask has shape {got} but the model's output {tuple(hidden.shape)} "
                             f"needs ({hidden.shape[0]}, {hidden.shape[1]})")
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # a sentence with no kept token gives 0
    return (F.normalize(pooled, dim=-1) if normalize else pooled).to(hidden.dtype)


def sentence_embeddings(model: nn.Module, batches, token_mask: Callable | None = None,
                        normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings of every batch, concatenated in batch order.

    A ``(B, L, D)`` output (token vectors; ``last_hidden_state`` of a Hugging
    Face output) is mean-pooled over the tokens ``token_mask`` keeps; a
    ``(B, D)`` output is taken as already pooled.

    Args:
        model: the encoder.
        batches: iterable of batches (see the module docstring).
        token_mask: optional ``token_mask(batch) -> (B, L)`` bool or 0/1 tensor of
            the tokens to average. Default: ``batch["attention_mask"]`` for a dict
            batch (or tokenizer output) that has one, else every token. Padding left in changes the
            embedding, so pass it for tuple batches of padded sentences.
        normalize: L2-normalize each embedding (as sentence-transformers does
            for all-MiniLM-L6-v2).
    Returns:
        ``(N, D)`` float32 tensor on the output's device, ``N`` the total batch size.
    Example:
        >>> enc = nn.Embedding(10, 4)                      # (B, L) ids -> (B, L, 4)
        >>> ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
        >>> e = sentence_embeddings(enc, [ids], token_mask=lambda b: b != 0)
        >>> e.shape, torch.allclose(e[1], F.normalize(enc.weight[3], dim=0))
        (torch.Size([2, 4]), True)
    """
    check_model(model, None)
    refuse_single_batch(batches)
    _check_token_mask(token_mask)
    normalize = check_bool(normalize, "normalize")
    with _EvalMode(model), torch.no_grad():
        out = [_embed(model, b, i, token_mask, normalize) for i, b in enumerate(batches)]
    _check_nonempty(out, batches)
    return torch.cat(out)


def _check_token_mask(token_mask) -> None:
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"token_mask must be callable (batch) -> (B, L) tensor, got {type(token_mask).__name__}")


def _check_nonempty(out: list, batches) -> None:
    if not out:
        raise ValueError("batches is empty: nothing to embed" + (" (a generator or iterator that was used up "
                                                                 "already? pass a list)" if iter(batches) is batches
                                                                 else ""))


def _embed(model: nn.Module, b, i: int, token_mask: Callable | None, normalize: bool) -> torch.Tensor:
    """``(B, D)`` float32 sentence embeddings of batch number ``i`` (see :func:`sentence_embeddings`)."""
    # token vectors: last_hidden_state of a Hugging Face output; pooled and normalized in fp32
    h = _output_tensor(call_with_batch(model, b), "last_hidden_state", "read embeddings from").float()
    if h.dim() == 3:
        mask = token_mask(b) if token_mask is not None else (
            b["attention_mask"] if isinstance(b, Mapping) and "attention_mask" in b else None)
        try:
            h = mean_pool(h, mask, normalize=False)
        except ValueError as e:
            raise ValueError(f"batch {i}: {e}") from None
    elif h.dim() != 2:
        raise ValueError(f"batch {i}: expected a (B, D) or (B, L, D) output, got shape {tuple(h.shape)}")
    return F.normalize(h, dim=-1) if normalize else h


def embedding_fidelity(model: nn.Module, batches, reference, token_mask: Callable | None = None) -> float:
    """Mean cosine similarity between ``model``'s sentence embeddings and ``reference``'s.

    Args:
        model: the pruned encoder.
        batches: iterable of batches, read once (a shuffling DataLoader is fine: both models
            see each batch as it comes).
        reference: the dense encoder (an ``nn.Module``, run on each batch beside ``model``) or
            its ``(N, D)`` embeddings, a tensor from :func:`sentence_embeddings` or a numpy array
            (sentence-transformers' ``encode()``) (compute them once when judging several models;
            they must come from the same batches in the same order, so not from a shuffling
            DataLoader). Anything else is a TypeError.
        token_mask: as in :func:`sentence_embeddings`.
    Returns:
        the mean over the ``N`` sentences of ``cos(e_model, e_reference)``: 1.0 = identical.
    Example:
        >>> enc = nn.Embedding(10, 4); ids = torch.tensor([[1, 2], [3, 4]])
        >>> round(embedding_fidelity(enc, [ids], enc), 6)  # fp32 cosines: 1 - 6e-8 for some weights
        1.0
    """
    check_model(model, None)
    refuse_single_batch(batches)
    if isinstance(reference, np.ndarray):   # sentence-transformers' encode() returns numpy by default
        reference = torch.as_tensor(reference, device="cpu")
    if not isinstance(reference, (torch.Tensor, nn.Module)):
        raise TypeError(f"reference must be the dense encoder (an nn.Module) or its (N, D) embeddings (a tensor or "
                        f"numpy array), got {type(reference).__name__}")
    if isinstance(reference, torch.Tensor):
        emb, ref = sentence_embeddings(model, batches, token_mask), reference
    else:
        # both models on each batch in one pass: a second pass over a shuffling DataLoader would pair
        # different sentences
        _check_token_mask(token_mask)
        pairs = []
        with _EvalMode(model), _EvalMode(reference), torch.no_grad():
            for i, b in enumerate(batches):
                pairs.append((_embed(model, b, i, token_mask, True), _embed(reference, b, i, token_mask, True)))
        _check_nonempty(pairs, batches)
        emb, ref = (torch.cat(t) for t in zip(*pairs))
    if ref.shape != emb.shape:
        raise ValueError(f"reference embeddings have shape {tuple(ref.shape)} but the model gives "
                         f"{tuple(emb.shape)} on these batches")
    ref = F.normalize(ref.float().to(emb.device), dim=-1)
    return float((emb * ref).sum(-1).mean())  # both L2-normalized: the dot product is the cosine


def bits_per_char(model: nn.Module, ids: torch.Tensor, ctx: int, windows: int, batch_size: int = 64) -> float:
    """Held-out bits per character of a causal language model.

    Scores ``windows`` fixed, evenly spaced windows of ``ctx + 1`` ids from
    ``ids`` (non-overlapping when ``ids`` is long enough): the model reads the
    first ``ctx`` and predicts every next one.

    Args:
        model: ``(B, ctx)`` int64 ids -> ``(B, ctx, vocab)`` logits (or an output holding them:
            ``.logits`` of a Hugging Face causal LM).
        ids: ``(T,)`` integer tensor of character ids, ``T > ctx + 1``.
        ctx: context length.
        windows: how many windows to score.
        batch_size: windows per forward pass.
    Returns:
        the mean cross-entropy over the ``windows * ctx`` predictions, in bits.
    Example:
        >>> class Uniform(nn.Module):
        ...     def forward(self, x): return torch.zeros(*x.shape, 8)
        >>> round(bits_per_char(Uniform(), torch.randint(0, 8, (100,)), ctx=16, windows=4), 4)  # log2(8)
        3.0
    """
    check_model(model, None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
        raise TypeError("ids must be a 1-D integer tensor of character ids")
    for name, v in (("ctx", ctx), ("windows", windows), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if ids.numel() < ctx + 2:
        raise ValueError(f"ids holds {ids.numel()} characters: windows of ctx + 1 = {ctx + 1} need at least {ctx + 2}")
    # integer arithmetic: a float32 linspace rounds the last start past the end above 2**24 ids
    last = ids.numel() - ctx - 1
    starts = [i * last // max(windows - 1, 1) for i in range(windows)]
    total, count = 0.0, 0
    with _EvalMode(model), torch.no_grad():
        for i in range(0, windows, batch_size):
            win = torch.stack([ids[s:s + ctx + 1] for s in starts[i:i + batch_size]]).long()
            logits = _output_tensor(model(win[:, :-1]), "logits", "score")   # (a Hugging Face output: .logits)
            if logits.dim() != 3 or logits.shape[:2] != win[:, :-1].shape:
                raise ValueError(f"the model gave logits of shape {tuple(logits.shape)} for ({len(win)}, {ctx}) ids: "
                                 f"expected ({len(win)}, {ctx}, vocab), a prediction at every position")
            # at least fp32: summed in fp16 the loss overflows to inf, in bf16 it is off by ~0.05 bits/char
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            total += float(F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum"))
            count += win[:, 1:].numel()
    return total / count / math.log(2)

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
dicts as ``model(**batch)``, tuples and lists as ``model(*batch)``, tensors as
``model(batch)``. Every function runs under ``torch.no_grad()`` in eval mode
and restores the model's train/eval flags afterwards.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .learn.objective import _call, _output_tensor

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
        ``(B, D)`` tensor in ``hidden``'s dtype.
    Example:
        >>> h = torch.tensor([[[1., 0.], [3., 0.], [9., 9.]]]); mask = torch.tensor([[1, 1, 0]])
        >>> mean_pool(h, mask, normalize=False)
        tensor([[2., 0.]])
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"mean_pool: hidden must be a (B, L, D) tensor, got {got}")
    if mask is None:
        pooled = hidden.mean(1)
    else:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(hidden.shape[:2]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"the token mask has shape {got} but the model's output {tuple(hidden.shape)} "
                             f"needs ({hidden.shape[0]}, {hidden.shape[1]})")
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # a sentence with no kept token gives 0
    return F.normalize(pooled, dim=-1) if normalize else pooled


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
            batch that has one, else every token. Padding left in changes the
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
    if token_mask is not None and not callable(token_mask):
        raise TypeError(f"token_mask must be callable (batch) -> (B, L) tensor, got {type(token_mask).__name__}")
    out = []
    with _EvalMode(model), torch.no_grad():
        for i, b in enumerate(batches):
            # token vectors: last_hidden_state of a Hugging Face output
            h = _output_tensor(_call(model, b), "last_hidden_state", "read embeddings from")
            if h.dim() == 3:
                mask = token_mask(b) if token_mask is not None else (
                    b["attention_mask"] if isinstance(b, dict) and "attention_mask" in b else None)
                try:
                    h = mean_pool(h, mask, normalize=False)  # normalized in fp32 below
                except ValueError as e:
                    raise ValueError(f"batch {i}: {e}") from None
            elif h.dim() != 2:
                raise ValueError(f"batch {i}: expected a (B, D) or (B, L, D) output, got shape {tuple(h.shape)}")
            out.append(F.normalize(h.float(), dim=-1) if normalize else h.float())
    if not out:
        raise ValueError("batches is empty: nothing to embed" + (" (a generator or iterator that was used up "
                                                                 "already? pass a list)" if iter(batches) is batches
                                                                 else ""))
    return torch.cat(out)


def embedding_fidelity(model: nn.Module, batches, reference, token_mask: Callable | None = None) -> float:
    """Mean cosine similarity between ``model``'s sentence embeddings and ``reference``'s.

    Args:
        model: the pruned encoder.
        batches: a re-iterable collection of batches (the same ones give the reference).
        reference: the dense encoder (an ``nn.Module``, run on the same batches) or
            its ``(N, D)`` embeddings from :func:`sentence_embeddings` (compute them
            once when judging several models).
        token_mask: as in :func:`sentence_embeddings`.
    Returns:
        the mean over the ``N`` sentences of ``cos(e_model, e_reference)``: 1.0 = identical.
    Example:
        >>> enc = nn.Embedding(10, 4); ids = torch.tensor([[1, 2], [3, 4]])
        >>> embedding_fidelity(enc, [ids], enc)
        1.0
    """
    if iter(batches) is batches and not isinstance(reference, torch.Tensor):
        raise TypeError("batches must be re-iterable (a list, not a generator or iterator): the reference "
                        "model runs on the same batches after the model")
    emb = sentence_embeddings(model, batches, token_mask)
    ref = reference if isinstance(reference, torch.Tensor) else sentence_embeddings(reference, batches, token_mask)
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
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
        raise TypeError("ids must be a 1-D integer tensor of character ids")
    for name, v in (("ctx", ctx), ("windows", windows), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if ids.numel() < ctx + 2:
        raise ValueError(f"ids holds {ids.numel()} characters: windows of ctx + 1 = {ctx + 1} need at least {ctx + 2}")
    starts = torch.linspace(0, ids.numel() - ctx - 1, windows).long().tolist()
    total, count = 0.0, 0
    with _EvalMode(model), torch.no_grad():
        for i in range(0, windows, batch_size):
            win = torch.stack([ids[s:s + ctx + 1] for s in starts[i:i + batch_size]]).long()
            logits = _output_tensor(model(win[:, :-1]), "logits", "score")   # (a Hugging Face output: .logits)
            total += float(F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum"))
            count += win[:, 1:].numel()
    return total / count / math.log(2)

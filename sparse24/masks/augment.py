"""Calibration batches for small or off-domain calibration text: token noise.

One-shot pruning fits each layer to the few hundred samples it is given. When
they come from another domain than the model will see (code lines for a prose
encoder), the layers' input statistics leave out most of the vocabulary and the
contexts it forms, and the fit leans on directions the calibration never showed.
:func:`token_noise` adds copies of the batches in which each real token is, with
probability ``p``, replaced by a token drawn at random from the vocabulary: the
samples' own structure with other words in it. On all-MiniLM-L6-v2 calibrated on
256 code lines and judged on prose, two copies at ``p = 0.3`` lifted the
recommended recipe from 0.897 / 0.890 to 0.905 / 0.901 mean cosine (docs/recipes.md,
"How much calibration data is enough").
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from .._checks import check_seed, refuse_single_batch

__all__ = ["token_noise"]


def token_noise(batches: Iterable, copies: int = 2, p: float = 0.3, *, vocab, keep: Sequence[int] = (),
                seed: int = 0) -> list:
    """The calibration ``batches`` followed by ``copies`` noisy copies of each.

    In a copy, every token that counts (attention mask 1, id not in ``keep``) is
    replaced with probability ``p`` by an id drawn uniformly from ``vocab``;
    padding, the ``keep`` ids (special tokens: [CLS], [SEP], BOS, ...) and every
    other entry of a batch stay as they are. Nothing is changed in place.

    Args:
        batches: token batches: dicts with ``"input_ids"`` (``[B, L]`` or ``[L]``
            integer tensor, and optionally ``"attention_mask"`` of the same shape),
            or bare integer id tensors.
        copies: noisy copies per batch (>= 0; 0 returns the batches as a list).
        p: replacement probability per token, in [0, 1].
        vocab: the ids to draw from: an int ``V`` (ids ``0 .. V-1``), a ``(low, high)``
            pair (``low .. high-1``) or a 1-D integer tensor / sequence of ids.
        keep: ids never replaced (a tokenizer's ``all_special_ids``).
        seed: the generator's seed (the copies are reproducible).

    Returns:
        ``list(batches) + copies x [noisy batch for each batch]``.

    Raises:
        TypeError / ValueError: a batch without integer token ids, a bad ``copies``,
        ``p``, ``vocab`` or ``seed`` (not an int); checked for every batch before any copy is made.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise ValueError(f"copies must be an int >= 0, got {copies!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"p must be a number in [0, 1], got {p!r}")
    seed = check_seed(seed)
    refuse_single_batch(batches)
    pool = _vocab_ids(vocab)
    keep_ids = torch.as_tensor(list(keep), dtype=torch.long, device="cpu")
    batches = list(batches)
    ids = [_ids_of(b, i) for i, b in enumerate(batches)]
    g = torch.Generator().manual_seed(seed)
    out = list(batches)
    for _ in range(copies):
        for b, t in zip(batches, ids):
            noisy = _noisy(t, b.get("attention_mask") if isinstance(b, Mapping) else None, pool, keep_ids, p, g)
            out.append({**b, "input_ids": noisy} if isinstance(b, Mapping) else noisy)
    return out


def _vocab_ids(vocab) -> torch.Tensor:
    if isinstance(vocab, bool):
        raise TypeError(f"vocab must be an int, a (low, high) pair or a sequence of ids, got {vocab!r}")
    if isinstance(vocab, int):
        vocab = (0, vocab)
    if isinstance(vocab, tuple) and len(vocab) == 2 and all(isinstance(v, int) for v in vocab):
        low, high = vocab
        if not 0 <= low < high:
            raise ValueError(f"vocab range must have 0 <= low < high, got {vocab!r}")
        return torch.arange(low, high, device="cpu")
    ids = torch.as_tensor(vocab, device="cpu")
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool \
            or bool((ids < 0).any()):
        raise ValueError("vocab must be an int, a (low, high) pair or a non-empty 1-D sequence of ids >= 0")
    return ids.long()


def _ids_of(b, index: int) -> torch.Tensor:
    """Batch ``index``'s token ids, checked (integer tensor; an attention mask of the same shape)."""
    ids = b.get("input_ids") if isinstance(b, Mapping) else b
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"batch {index}: token_noise needs integer token ids (a tensor, or a dict with "
                        f"'input_ids'), got {type(ids).__name__ if not isinstance(ids, torch.Tensor) else ids.dtype}")
    if isinstance(b, Mapping) and b.get("attention_mask") is not None \
            and tuple(b["attention_mask"].shape) != tuple(ids.shape):
        raise ValueError(f"batch {index}: attention_mask of shape {tuple(b['attention_mask'].shape)} does not match "
                         f"input_ids of shape {tuple(ids.shape)}")
    return ids


def _noisy(ids: torch.Tensor, mask, pool: torch.Tensor, keep: torch.Tensor, p: float, g) -> torch.Tensor:
    """``ids`` with each counting token replaced by a random ``pool`` id with probability ``p``."""
    counts = ~torch.isin(ids.cpu(), keep)
    if mask is not None:
        counts &= mask.cpu().bool()
    # Drawn on the CPU generator's device in float32: the same draws whatever torch's default device and dtype
    swap = (torch.rand(ids.shape, generator=g, dtype=torch.float32, device=g.device) < p) & counts
    new = pool[torch.randint(len(pool), (int(swap.sum()),), generator=g, device=g.device)]
    out = ids.clone()
    out[swap.to(ids.device)] = new.to(device=ids.device, dtype=ids.dtype)
    return out

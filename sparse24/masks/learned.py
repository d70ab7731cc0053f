"""Learnable N:M masks (MaskLLM, Fang et al., NeurIPS 2024), the per-tensor piece.

Every group of ``m`` consecutive inputs of an ``(R, C)`` weight gets a
categorical distribution over the ``C(m, n)`` N:M patterns (6 for 2:4), held
as logits of shape ``(P, R, C // m)``: ``P`` floats per group and nothing
else, so the memory is proportional to the number of groups (6 fp32 = 24 bytes
per group of 4 weights for 2:4, i.e. 1.5 floats per weight; 12 bytes with
bf16 logits). A training step draws a differentiable mask with the
Gumbel-softmax; late in training a hard (one-hot) draw with straight-through
gradients makes the forward see exactly N:M masks; the final mask is the most
probable pattern of every group, exactly N:M by construction.

The model-level training loop (distillation from the dense model, schedules,
writing the masks into ``Sparse24Linear`` layers) is
:func:`sparse24.learn.learn_masks`.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from .._checks import check_bool, check_mask, check_nm, check_nonnegative

__all__ = ["nm_patterns", "LearnableMask"]

# Not float16: Adam's eps (1e-8) rounds to 0 there, so a logit whose gradient is 0 becomes 0/0 = NaN at the
# first step (and the ~1e-4 gradients of a realistic loss underflow in its second moment).
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def nm_patterns(n: int = 2, m: int = 4, device=None) -> torch.Tensor:
    """Every N:M pattern of one group, in lexicographic order of the kept slots.

    Args:
        n, m: keep ``n`` of every ``m``.
        device: where to build the table (None: torch's default device, as torch's factories).
    Returns:
        ``(P, m)`` bool, ``P = C(m, n)``; row ``p`` keeps the slots of the
        ``p``-th ``n``-combination of ``range(m)``.
    Example:
        >>> nm_patterns(2, 4).int().tolist()[:2]
        [[1, 1, 0, 0], [1, 0, 1, 0]]
    """
    check_nm(n, m)
    combos = list(itertools.combinations(range(m), n))
    # One factory call from Python data, not an entry-by-entry fill (which a meta table cannot take)
    return torch.tensor([[s in slots for s in range(m)] for slots in combos], dtype=torch.bool, device=device)


class LearnableMask(nn.Module):
    """A learnable N:M mask of one ``(R, C)`` weight: per-group logits over the N:M patterns.

    Args:
        shape: ``(R, C)`` of the weight, ``C % m == 0``.
        n, m: the pattern (any ``1 <= n < m``; ``P = C(m, n)`` logits per group).
        prior: optional ``(R, C)`` bool N:M mask to start from (a one-shot
            mask: magnitude, Wanda, SparseGPT). Default: uniform logits.
        confidence: how strongly the prior is believed: pattern ``p`` starts
            with logit ``confidence * (overlap(p, prior) - n)``, so the prior's
            own pattern has logit 0 and a pattern sharing ``k`` kept slots with
            it ``-confidence * (n - k)``. For 2:4 and ``confidence=3`` the
            prior's pattern starts at probability 0.83.
        dtype: logits dtype (fp32 default; bf16 halves the memory; fp64; the
            sampling computes in fp32). fp16 is refused: Adam cannot train it.
        device: where the logits live.
    Attributes:
        logits: ``(P, R, C // m)`` Parameter, the only per-group state. Patterns
            come first so that the softmax over them runs over contiguous planes:
            a draw + backward of a 1536x384 layer took 201 ms this way vs 365 ms
            with the patterns last (one loaded CPU core).
        patterns: ``(P, m)`` bool buffer (not saved in the state dict; the pattern ``n, m`` is, as
            ``_extra_state``, and loading a state of another pattern is refused: 1:4 and 3:4 have
            logits of one shape, ``C(m, n) = C(m, m - n)``, but not of one meaning).
    Example:
        >>> from sparse24 import mask_nm
        >>> w = torch.randn(8, 16)
        >>> lm = LearnableMask(w.shape, prior=mask_nm(w, 2, 4))
        >>> soft = lm.sample(tau=1.0, generator=torch.Generator().manual_seed(0))  # (8, 16), differentiable
        >>> torch.equal(lm.hard_mask(), mask_nm(w, 2, 4))   # the prior is still the most probable
        True
    """

    def __init__(self, shape, n: int = 2, m: int = 4, prior: torch.Tensor | None = None, confidence: float = 3.0,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        check_nm(n, m)
        if not 1 <= n < m:
            raise ValueError(f"a learnable mask needs 1 <= n < m (more than one pattern), got n={n}, m={m}")
        if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2
                or not all(isinstance(s, int) and s >= 0 for s in shape)):
            raise ValueError(f"shape must be (rows, cols) of non-negative ints, got {shape!r}")
        R, C = shape
        if C % m:
            raise ValueError(f"the weight's columns ({C}) must be divisible by m={m}")
        if dtype not in _LOGIT_DTYPES:
            raise TypeError(f"dtype must be one of {_LOGIT_DTYPES}, got {dtype}"
                            + (": float16 logits cannot train (Adam's eps, 1e-8, is 0 in float16 and turns them NaN); "
                               "bfloat16 takes as little memory" if dtype == torch.float16 else ""))
        self.n, self.m, self.shape = n, m, (R, C)
        self.register_buffer("patterns", nm_patterns(n, m, device), persistent=False)
        self.logits = nn.Parameter(torch.zeros(len(self.patterns), R, C // m, dtype=dtype, device=device))
        if prior is not None:
            self.init_from_mask(prior, confidence)

    def get_extra_state(self) -> torch.Tensor:
        """The pattern ``[n, m]``, saved beside the logits (a tensor: any state-dict format holds it)."""
        return torch.tensor([self.n, self.m], device="cpu")   # (loading reads it back with tolist)

    def set_extra_state(self, state) -> None:
        pass  # checked in _load_from_state_dict, before the logits are copied

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:  # refused before anything is copied (torch sets the extra state last)
            saved = state_dict[key]
            nm = saved.tolist() if isinstance(saved, torch.Tensor) and saved.shape == (2,) else None
            if nm != [self.n, self.m]:
                raise ValueError(f"LearnableMask: the state holds the logits of a "
                                 f"{f'{nm[0]}:{nm[1]}' if nm else f'(unreadable pattern {saved!r})'} mask, this "
                                 f"mask is {self.n}:{self.m} (the logits may have the same shape, not the same "
                                 f"meaning): build LearnableMask(shape, n, m) with the saved pattern to load it "
                                 "(nothing was changed)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key not in state_dict and key in missing_keys:  # a state saved before the pattern was: taken as is
            missing_keys.remove(key)

    @property
    def num_patterns(self) -> int:
        """How many N:M patterns each group chooses among: ``comb(m, n)`` (6 for 2:4), the logits' first dim."""
        return self.patterns.shape[0]

    @torch.no_grad()
    def init_from_mask(self, prior: torch.Tensor, confidence: float = 3.0) -> None:
        """Set the logits from a prior N:M mask (see the class docstring); changes nothing on bad input.

        Args:
            prior: ``(R, C)`` bool mask keeping exactly ``n`` of every ``m``.
            confidence: finite, ``>= 0`` (0 gives uniform logits).
        """
        if not isinstance(prior, torch.Tensor):
            raise TypeError(f"prior must be a torch.Tensor, got {type(prior).__name__}")
        check_mask(prior, torch.empty(self.shape, device=self.logits.device))
        groups = prior.view(self.shape[0], -1, self.m)
        if not bool((groups.sum(-1) == self.n).all()):
            raise ValueError(f"prior must keep exactly n={self.n} of every m={self.m} (an exact N:M mask)")
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < float("inf"):
            raise ValueError(f"confidence must be a finite number >= 0, got {confidence!r}")
        overlap = groups.to(torch.float32) @ self.patterns.T.to(torch.float32)  # (R, G, P) kept slots in common
        self.logits.copy_(confidence * (overlap.permute(2, 0, 1) - self.n))

    def probs(self) -> torch.Tensor:
        """``(P, R, C // m)`` fp32 pattern probabilities (softmax of the logits over patterns)."""
        return self.logits.float().softmax(0)

    def sample(self, tau: float = 1.0, hard: bool = False, generator: torch.Generator | None = None,
               noise: float = 1.0) -> torch.Tensor:
        """Draw a mask with the Gumbel-softmax, differentiable w.r.t. the logits.

        ``y = softmax((logits + noise * g) / tau)`` per group, ``g`` standard
        Gumbel; the mask's slot ``j`` sums ``y`` over the patterns keeping it, so each group's entries are in
        [0, 1] and sum to ``n``. With ``hard=True`` the forward value is the
        one-hot of the drawn pattern (an exact N:M 0/1 mask) and the gradient is
        that of the soft ``y`` (straight-through).

        Args:
            tau: temperature > 0 (low: near one-hot draws).
            hard: straight-through hard draw.
            generator: ``torch.Generator`` for the noise (draws are
                reproducible for a seed; a CPU generator gives the same draws on
                any device, a generator on the logits' device avoids a copy).
            noise: scale of the Gumbel noise, a finite number >= 0 (0: no randomness).
        Returns:
            ``(R, C)`` fp32 mask.
        """
        if not (isinstance(tau, (int, float)) and tau > 0):
            raise ValueError(f"tau must be a number > 0, got {tau!r}")
        hard = check_bool(hard, "hard")   # ("False" drew hard masks)
        noise = check_nonnegative(noise, "noise")   # (NaN / inf made every entry NaN)
        z = self.logits.float()
        if noise:
            dev = z.device if generator is None else generator.device
            # Gumbel noise -log(-log(U)), U uniform on (0, 1): a uniform draw and two logs take 2/3 of the
            # time of exponential_ and one log (CPU generators; the draws dominate a step's mask cost)
            u = torch.empty(z.shape, dtype=torch.float32, device=dev).uniform_(generator=generator)
            tiny = torch.finfo(torch.float32).tiny
            g = u.clamp_min_(tiny).log_().neg_().clamp_min_(tiny).log_().neg_()
            z = z + noise * g.to(z.device)
        y = (z / tau).softmax(0)
        if hard:
            one_hot = torch.zeros_like(y).scatter_(0, y.argmax(0, keepdim=True), 1.0)
            y = one_hot - y.detach() + y
        return self._to_mask(y)

    def _to_mask(self, y: torch.Tensor) -> torch.Tensor:
        """``(P, R, G)`` pattern weights -> ``(R, C)`` mask: slot ``j`` sums the patterns keeping it."""
        P, R, G = y.shape
        slots = self.patterns.T.to(y.dtype) @ y.reshape(P, -1)  # (m, R*G)
        return slots.view(self.m, R, G).permute(1, 2, 0).reshape(self.shape)

    @torch.no_grad()
    def hard_mask(self) -> torch.Tensor:
        """``(R, C)`` bool: the most probable pattern of every group (exactly N:M)."""
        best = self.logits.argmax(0)  # (R, G)
        return self.patterns[best].view(self.shape)

    def expected_mask(self) -> torch.Tensor:
        """``(R, C)`` fp32 expected mask ``probs @ patterns`` (each group sums to ``n``), differentiable."""
        return self._to_mask(self.probs())

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, n={self.n}, m={self.m}, patterns={self.num_patterns}, "
                f"dtype={self.logits.dtype}")

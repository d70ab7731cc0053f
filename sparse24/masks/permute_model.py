"""Model-wide channel permutations driven by calibrated importance.

A :class:`PermutationGroup` names every tensor that indexes one set of hidden
channels: the Linears that read them (``consumers``: their input columns, the
2:4 groups a permutation improves), the Linears that write them
(``producers``: output rows and bias, or a slice of rows for a fused QKV), and
any other parameter laid out along them (LayerNorm weight and bias, embedding
columns). Permuting all of them by the same permutation leaves the model's
function unchanged when nothing else mixes the channels: elementwise ops
(GELU, dropout, a gated product), LayerNorm (its statistics ignore the order),
residual adds whose every writer and reader is in the group, and attention
when ``block`` keeps each channel inside its head.

* :func:`find_permutation_groups` proposes Linear -> elementwise -> Linear
  pairs (and attention value -> output pairs, per head, given ``heads``) by
  structure and keeps those that a test proves exact: a random permutation,
  applied to a float64 copy, must leave the outputs on ``example`` equal.
* :func:`permute_model_` searches one permutation per group on the stacked
  importance of its consumers (``|W|``, Wanda's ``(|W| ||x||)^2`` or
  SparseGPT's OBS error ``W^2 / [H^-1]_jj``), applies it, and permutes the
  calibration statistics with it so the one-shot pruning that follows needs
  no second calibration pass.
"""
from __future__ import annotations

import copy
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .._checks import (KEYWORD_BATCH, call_with_batch, check_model, check_nm, check_seed, map_keyword_batch,
                       map_sequence_batch)
from .._progress import progress_enabled
from .nm import LayerStats
from .permutation import check_search_args, search_permutation
from .reconstruct import PERCDAMP, damp_

__all__ = ["PermutationGroup", "find_permutation_groups", "check_group", "permute_model_", "group_importance"]

SCORES = ("magnitude", "wanda", "sparsegpt")


@dataclass
class PermutationGroup:
    """Tensors indexed by one set of ``size`` hidden channels (see the module docstring).

    Attributes:
        consumers: names of Linears whose ``in_features`` are the channels.
        producers: names of Linears whose output rows are the channels, or
            ``(name, first_row)`` for a slice of a fused layer's rows (e.g. the
            value rows of a fused QKV); the bias follows the rows.
        params: ``(parameter name, dim)`` of other parameters indexed by the
            channels along ``dim`` (LayerNorm ``weight``/``bias``: dim 0;
            embeddings: dim 1).
        block: if set, channels only move inside consecutive blocks of this
            many (an attention head's dimension).
        name: a label for reports.
    """
    consumers: list = field(default_factory=list)
    producers: list = field(default_factory=list)
    params: list = field(default_factory=list)
    block: int | None = None
    name: str = ""

    def size(self, model: nn.Module) -> int:
        """The number of channels (every consumer's ``in_features``); raises on a mismatch."""
        mods = dict(model.named_modules())
        sizes = set()
        for c in self.consumers:
            lin = mods.get(c)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"group {self.name!r}: consumer {c!r} is not an nn.Linear of the model")
            sizes.add(lin.in_features)
        if len(sizes) != 1:
            raise ValueError(f"group {self.name!r}: consumers must share in_features, got {sorted(sizes)}")
        (H,) = sizes
        for p in self.producers:
            fqn, first = (p, 0) if isinstance(p, str) else p
            lin = mods.get(fqn)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"group {self.name!r}: producer {fqn!r} is not an nn.Linear of the model")
            if first < 0 or first + H > lin.out_features or (isinstance(p, str) and lin.out_features != H):
                raise ValueError(f"group {self.name!r}: producer {fqn!r} has {lin.out_features} output rows, "
                                 f"cannot hold {H} channels from row {first}")
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, dim in self.params:
            if name not in params or params[name].dim() <= dim or params[name].shape[dim] != H:
                raise ValueError(f"group {self.name!r}: parameter {name!r} has no dimension {dim} of size {H}")
        if self.block is not None and (not isinstance(self.block, int) or self.block < 1 or H % self.block):
            raise ValueError(f"group {self.name!r}: block must be a positive divisor of {H}, got {self.block!r}")
        return H


@torch.no_grad()
def _apply(model: nn.Module, group: PermutationGroup, perm: torch.Tensor, inverse: bool = False) -> None:
    """Permute every tensor of ``group`` in place (same Parameter objects). ``inverse=True`` undoes
    ``_apply(model, group, perm)`` exactly: the inverse permutation, its steps in reverse order (two
    steps on one tensor need not commute, e.g. the overlapping row slices of a group that is not exact)."""
    mods = dict(model.named_modules())
    H = perm.numel()
    done = set()   # each tensor (and slice) once, whatever names it was listed under (tied ones included)
    steps = []     # (tensor, dim, first row): its H entries from ``first`` along ``dim`` are permuted

    def once(key) -> bool:
        new = key not in done
        done.add(key)
        return new
    for c in group.consumers:
        w = mods[c].weight
        if once((id(w), "columns")):
            steps.append((w, 1, 0))
    for p in group.producers:
        fqn, first = (p, 0) if isinstance(p, str) else p
        lin = mods[fqn]
        if once((id(lin.weight), "rows", first)):
            steps += [(t, 0, first) for t in (lin.weight, lin.bias) if t is not None]  # the bias follows the rows
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, dim in group.params:
        t = params[name]
        if once((id(t), dim)):
            steps.append((t, dim, 0))
    if inverse:
        perm, steps = torch.argsort(perm), steps[::-1]

    def permute(t, dim, first, p):
        part = t.narrow(dim, first, H)
        part.copy_(part.index_select(dim, p.to(t.device)))
    done_steps = []
    try:
        for step in steps:
            permute(*step, perm)
            done_steps.append(step)
    except BaseException:   # (Ctrl-C, out of memory) part of the group: its caller's undo knows only whole ones
        back = torch.argsort(perm)
        for step in reversed(done_steps):
            permute(*step, back)
        raise


def _random_perm(H: int, block: int | None, gen: torch.Generator) -> torch.Tensor:
    # On the generator's device (the CPU), whatever torch's default device
    if block is None:
        return torch.randperm(H, generator=gen, device=gen.device)
    return torch.cat([b * block + torch.randperm(block, generator=gen, device=gen.device)
                      for b in range(H // block)])


def _is_kv_cache(x) -> bool:
    """A Hugging Face KV cache (``transformers.Cache``: ``DynamicCache``, ...), returned beside the logits."""
    cache_utils = sys.modules.get("transformers.cache_utils")   # (never imports transformers)
    return cache_utils is not None and isinstance(x, getattr(cache_utils, "Cache", ()))


def _outputs_equal(a, b, tol: float | None = None) -> bool:
    """Equal up to rounding: ``tol`` relative to the largest output (default: 1e-9 for
    float64 outputs, else the larger of 1e-4 and 8 ulps of 1.0 in the output's dtype, 7.8e-3 in
    float16 and 6.3e-2 in bfloat16: the permuted sums run in another order, rounded at every layer).

    Two KV caches count as equal: they are the attention's keys and values kept for the next call, not an
    output (compared as objects, a decoder's default ``use_cache=True`` made every group fail; their
    tensors would differ for an exact value -> output group, whose value channels move with the
    permutation). Any other object that is not a tensor, mapping or sequence must compare ``==``."""
    if _is_kv_cache(a) or _is_kv_cache(b):
        return _is_kv_cache(a) and _is_kv_cache(b)
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape):
            return False
        if not a.is_floating_point():
            return torch.equal(a, b)
        t = tol if tol is not None else (1e-9 if a.dtype == torch.float64 else max(1e-4, 8 * torch.finfo(a.dtype).eps))
        finite = a.detach().abs()[torch.isfinite(a.detach())]
        scale = float(finite.max()) if finite.numel() else 0.0
        return torch.allclose(a.double(), b.double(), rtol=t, atol=t * max(scale, 1e-30), equal_nan=True)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_outputs_equal(a[k], b[k], tol) for k in a)
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_outputs_equal(x, y, tol) for x, y in zip(a, b)))
    return a == b


def _run_eval(model, example):
    """The outputs in eval mode (dropout off: the groups are proved on an eval copy), the modes restored."""
    modes = [(mod, mod.training) for mod in model.modules()]
    model.eval()
    try:
        return call_with_batch(model, example)
    finally:
        for mod, training in modes:
            mod.training = training


def _double(example):
    if isinstance(example, torch.Tensor):
        return example.double() if example.is_floating_point() else example
    if isinstance(example, KEYWORD_BATCH):
        return map_keyword_batch(example, _double)
    if isinstance(example, (tuple, list)):
        return map_sequence_batch(example, _double)
    return example


def _tensors(x, where: str):
    """``(where, tensor)`` for every tensor in ``x`` and its dicts, tuples and lists."""
    if isinstance(x, torch.Tensor):
        yield where, x
    elif isinstance(x, Mapping):
        for k, v in x.items():
            yield from _tensors(v, f"{where}[{k!r}]")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{where}[{i}]")


def check_example(example) -> None:
    """ValueError for an example with an empty tensor (0 rows: any permutation leaves nothing
    unchanged, so every group would pass) or a token batch of one position (``input_ids``
    ``(..., 1)``, ``inputs_embeds`` ``(..., 1, H)``): attention over one key is 1 and rotary
    embeddings at position 0 are the identity, so query rows permuted with key columns (not
    exact) leave its outputs unchanged."""
    for where, t in _tensors(example, "example"):
        if t.numel() == 0:
            raise ValueError(f"{where} has shape {tuple(t.shape)}, 0 elements: a test on no data proves every "
                             "permutation exact; give a batch with rows (nothing was changed)")
    if isinstance(example, Mapping):
        for key, dim in (("input_ids", -1), ("inputs_embeds", -2)):
            t = example.get(key)
            if isinstance(t, torch.Tensor) and t.dim() >= -dim and t.shape[dim] < 2:
                raise ValueError(f"example {key!r} has {t.shape[dim]} position(s): a test on one token cannot tell "
                                 "an exact permutation from one that mixes attention's query and key channels; give "
                                 "a batch of at least 2 tokens (more is a stronger test)")


def _check_outputs(out) -> None:
    """ValueError if the output tensors on the example hold no element: nothing to compare, any permutation passes."""
    shapes = [tuple(t.shape) for _, t in _tensors(out, "")]
    if shapes and not any(math.prod(s) for s in shapes):
        raise ValueError(f"the model's outputs on example have no element (shapes {shapes}): they cannot tell an "
                         "exact permutation from one that is not (nothing was changed)")


class _Float64Copy:
    """A float64 copy of a model and its outputs on one example, to test groups:
    each test permutes the copy, compares, and permutes it back (exactly)."""

    def __init__(self, model: nn.Module, example):
        check_example(example)
        self.model = copy.deepcopy(model).double().eval()
        self.example = _double(example)
        with torch.no_grad():
            self.ref = call_with_batch(self.model, self.example)
        _check_outputs(self.ref)

    @torch.no_grad()
    def exact(self, group: PermutationGroup, seed: int = 0) -> bool:
        perm = _random_perm(group.size(self.model), group.block, torch.Generator().manual_seed(seed))
        _apply(self.model, group, perm)
        try:
            return _outputs_equal(self.ref, call_with_batch(self.model, self.example), 1e-9)
        finally:
            _apply(self.model, group, perm, inverse=True)


def check_group(model: nn.Module, group: PermutationGroup, example, seed: int = 0) -> bool:
    """True if a random permutation of ``group`` (within its blocks) leaves the
    outputs of a float64 copy of ``model`` on ``example`` equal (to 1e-9 of the
    largest output); ``model`` itself is not changed. An ``example`` with an empty tensor, or
    on which the outputs hold no element, proves nothing: a ValueError. A Hugging Face KV cache
    (``transformers.Cache``, returned with ``use_cache=True``) is not compared: it holds the keys and
    values for the next call, which an exact group may permute; every tensor output is.

    Args:
        model: the model (not modified; the test runs on a float64 copy).
        group: the :class:`PermutationGroup` to test.
        example: one input batch as for :func:`sparse24.calibrate`, with rows.
        seed: an int, seeding the random permutation tested.
    Returns:
        Whether the outputs stayed equal.
    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> check_group(mlp, PermutationGroup(["2"], ["0"]), torch.randn(4, 8))
        True
    """
    check_model(model, None)
    _check_group_type(group)
    seed = check_seed(seed)
    group.size(model)
    return _Float64Copy(model, example).exact(group, seed)


def _check_group_type(group) -> None:
    if not isinstance(group, PermutationGroup):
        raise TypeError(f"group must be a PermutationGroup, got {type(group).__name__}")


def _check_calibration(calibration) -> None:
    """TypeError unless ``calibration`` is None or a dict ``{fqn: LayerStats}`` (a dict of ``act_norm``
    tensors, or one LayerStats, failed inside with an AttributeError)."""
    if calibration is None:
        return
    if not isinstance(calibration, dict):
        raise TypeError(f"calibration must be a dict {{fqn: LayerStats}} from sparse24.calibrate, got "
                        f"{type(calibration).__name__}")
    for k, v in calibration.items():
        if not isinstance(v, LayerStats):
            raise TypeError(f"calibration[{k!r}] must be a LayerStats (from sparse24.calibrate), got "
                            f"{type(v).__name__}")


@torch.no_grad()
def find_permutation_groups(model: nn.Module, example, heads: int | None = None) -> list[PermutationGroup]:
    """Groups that can absorb a permutation, found by structure and proven by a test.

    For every ``nn.Linear`` (consumer), the candidate producers are the other
    Linears under the same parent module (or its parent; where that is a
    ``ModuleList`` / ``Sequential`` / ``ModuleDict`` of blocks, only the consumer's
    block and the one just before it) with
    ``out_features == consumer.in_features``: first all of them together
    (gated MLPs: gate and up rows with down columns), then each alone. A
    candidate is kept if :func:`check_group` proves it exact on ``example``;
    with ``heads``, a candidate that fails is tried again with channels kept
    inside their head (``block = in_features // heads``: attention value rows
    with the output projection's columns). Residual-stream groups (LayerNorm
    and embedding parameters, every block's readers and writers) are not
    searched for: build them with :class:`PermutationGroup` and check them
    with :func:`check_group`.

    Args:
        model: the model (not modified; tests run on float64 copies).
        example: one input batch as for :func:`sparse24.calibrate`, with rows (an empty tensor in it
            is a ValueError: no data proves every candidate exact).
        heads: attention heads, to also find per-head value -> output pairs.
    Returns:
        list of :class:`PermutationGroup`, at most one per consumer.
    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> [(g.producers, g.consumers) for g in find_permutation_groups(mlp, torch.randn(4, 8))]
        [(['0'], ['2'])]
    """
    check_model(model, None)
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"heads must be a positive int or None, got {heads!r}")
    mods = dict(model.named_modules())
    linears = {fqn: m for fqn, m in mods.items() if isinstance(m, nn.Linear)}
    f64 = _Float64Copy(model, example)

    def parent(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""

    def grandparent(name: str) -> str:
        return parent(name).rsplit(".", 1)[0]   # (a top-level parent is its own "grandparent")

    previous: dict[tuple[str, str], str | None] = {}

    def previous_block(gp: str, item: str) -> str | None:
        """The nearest child before ``item`` of the container ``gp`` that holds a Linear (the block whose
        outputs ``item`` reads; activations and norms between them are skipped)."""
        if (gp, item) not in previous:
            children = list(mods[gp]._modules.items())   # all, in order (named_children skips repeated modules)
            names = [k for k, _ in children]
            previous[gp, item] = next((k for k, child in reversed(children[:names.index(item)]) if child is not None
                                       and any(isinstance(x, nn.Linear) for x in child.modules())), None)
        return previous[gp, item]

    def near(p: str, c: str) -> bool:
        """Producer ``p`` for consumer ``c``: the same parent, or the same grandparent; but where that
        grandparent is a container of blocks (``nn.ModuleList``, a model's ``layers``), only the block
        just before ``c``'s. Every block of a stack was a candidate for every other's consumers (O(L^2)
        candidates, each proved by a whole-model forward); a block reads its predecessor's outputs."""
        pp, pc = parent(p), parent(c)
        if pp == pc:
            return True
        gp = grandparent(p)
        if gp != grandparent(c):
            return False
        if pp == gp or pc == gp or not isinstance(mods.get(gp), (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            return True
        return previous_block(gp, pc[len(gp) + 1:]) == pp[len(gp) + 1:]

    # candidates share the consumer's grandparent (the same parent implies it): look only there
    by_grandparent: dict[str, list[str]] = {}
    for fqn in linears:
        by_grandparent.setdefault(grandparent(fqn), []).append(fqn)
    groups = []
    for c, lin in linears.items():
        cands = [p for p in by_grandparent[grandparent(c)]
                 if p != c and linears[p].out_features == lin.in_features and near(p, c)]
        tries = ([cands] if len(cands) > 1 else []) + [[p] for p in cands]
        blocks = [None] + ([lin.in_features // heads] if heads and lin.in_features % heads == 0 else [])
        found = None
        for block in blocks:
            for producers in tries:
                g = PermutationGroup([c], list(producers), block=block, name=c)
                if f64.exact(g):
                    found = g
                    break
            if found is not None:
                break
        if found is not None:
            groups.append(found)
    return groups


def _importance(lin: nn.Linear, score: str, stats: LayerStats | None, percdamp: float = PERCDAMP) -> torch.Tensor:
    """``(R, C)`` non-negative importance of each weight of ``lin`` under ``score``."""
    w = lin.weight.detach().double()
    if score == "magnitude":
        return w.abs()
    if stats is None:
        raise ValueError(f"score={score!r} needs calibration statistics for every consumer (sparse24.calibrate)")
    if score == "wanda":
        return (w.abs() * stats.act_norm.to(w))**2
    H = stats.hessian.to(w).clone()
    damp_(H, percdamp)
    d = torch.linalg.inv(H).diagonal()
    return w.pow(2) / d


def group_importance(model: nn.Module, group: PermutationGroup, score: str = "magnitude",
                     calibration: dict | None = None) -> torch.Tensor:
    """``(sum of consumer rows, H)`` stacked importance of the group's consumers.

    ``"magnitude"``: ``|W|`` (the kept magnitude ASP maximises); ``"wanda"``:
    ``(|W_ij| ||x_j||)^2``, the output error of dropping ``W_ij`` with a
    diagonal Hessian; ``"sparsegpt"``: ``W_ij^2 / [H^-1]_jj``, the OBS error
    SparseGPT's mask choice weighs (1% damping as in SparseGPT).

    Args:
        model: the model holding the group's layers (not modified).
        group: the :class:`PermutationGroup` whose consumers are scored.
        score: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"``.
        calibration: ``{fqn: LayerStats}`` from :func:`sparse24.calibrate`, with an entry for every consumer
            for ``"wanda"`` and ``"sparsegpt"`` (``hessian=True`` for the latter); unused for ``"magnitude"``.
    Returns:
        ``(sum of consumer rows, H)`` float64 tensor, ``H`` the group's channels.
    """
    check_model(model, None)
    _check_group_type(group)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    _check_calibration(calibration)
    group.size(model)   # a ValueError naming a layer the model lacks (was a KeyError)
    mods = dict(model.named_modules())
    rows = [_importance(mods[c], score, (calibration or {}).get(c)) for c in group.consumers]
    return torch.cat(rows)


def _permute_stats(stats: LayerStats, perm: torch.Tensor) -> None:
    p = perm.to(stats.sq_sum.device)
    stats.sq_sum = stats.sq_sum[p]
    if stats.xtx is not None:
        stats.xtx = stats.xtx[p][:, p]
    if stats.xtx_teacher is not None:   # x^T x_t: the model's inputs permuted, the teacher's as they were
        stats.xtx_teacher = stats.xtx_teacher[p]


def permute_model_(model: nn.Module, groups: list, score: str = "magnitude", calibration: dict | None = None,
                   n: int = 2, m: int = 4, example=None, time_limit: float | None = None, max_iters: int | None = 2000,
                   seed: int = 0, progress: bool | None = False) -> dict[str, float]:
    """Search and apply one input-channel permutation per group, in place.

    Each group's permutation maximises the importance its consumers' N:M masks
    keep (:func:`group_importance` stacked over the consumers, searched by
    :func:`sparse24.search_permutation`, per block if the group has one).
    ``calibration`` (``{fqn: LayerStats}``) is updated in place so it
    describes the permuted model (the consumers' input statistics are
    permuted too). With ``example``, the outputs before and after are
    compared (to 1e-4 of the largest output, 1e-9 in float64, 8 ulps in 16-bit dtypes; a KV cache
    in them is not, as in :func:`check_group`) and everything is undone if they differ (a group that was not exact).

    All or nothing: the pattern, every group's tensors and width (``m`` must divide the channels
    of a group searched without ``block``) and the calibration statistics are checked before
    anything changes; if a search still fails part way (or on Ctrl-C), the groups already
    permuted are permuted back (exactly: the inverse permutations) and the statistics objects
    get their own tensors back before the error is raised.

    Args:
        model: the dense model, before pruning.
        groups: :class:`PermutationGroup` list (e.g. :func:`find_permutation_groups`).
        score: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"`` (the last two need ``calibration``).
        calibration: ``{fqn: LayerStats}`` from ``sparse24.calibrate`` (hessian=True for sparsegpt); another
            type is a TypeError.
        n, m: the N:M pattern.
        example: optional batch to check the outputs on (no empty tensor in it, as for :func:`check_group`).
        time_limit, max_iters, seed: per search. By default each search runs ``max_iters=2000``
            steps with no time limit: the result depends only on the inputs and the seed. A
            ``time_limit`` (finite seconds > 0) stops a search earlier on a slow or busy machine,
            so the permutation then depends on its speed. ``max_iters`` an int >= 0 or None
            (then ``time_limit`` is required); bools refused.
        progress: progress bars on stderr (True, False, or None: when stderr is a terminal or in a notebook).
    Returns:
        ``{group name: relative gain in kept importance}``.
    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> gains = permute_model_(mlp, [PermutationGroup(["2"], ["0"], name="mlp")], max_iters=50)
        >>> gains["mlp"] >= 0
        True
    """
    check_model(model, None)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    _check_calibration(calibration)
    if score != "magnitude" and calibration is None:
        raise ValueError(f"score={score!r} needs calibration= from sparse24.calibrate")
    check_nm(n, m)
    check_search_args(time_limit, max_iters, seed)
    progress = progress_enabled(progress)
    groups = list(groups)
    if not all(isinstance(g, PermutationGroup) for g in groups):
        raise TypeError("groups must be PermutationGroup objects")
    sizes = [g.size(model) for g in groups]  # every group checked before anything changes
    for g, H in zip(groups, sizes):  # (a block group is searched by whole blocks of groups, or not at all)
        if g.block is None and H % m:
            raise ValueError(f"group {g.name!r}: its {H} channels are not divisible by m={m}, so they do not "
                             "form N:M groups: leave the group out (nothing was changed)")
    if example is not None:
        check_example(example)
    for g in groups:
        if score != "magnitude":
            missing = [c for c in g.consumers if c not in calibration]
            if missing or (score == "sparsegpt" and any(calibration[c].xtx is None for c in g.consumers)):
                raise ValueError(f"group {g.name!r}: no calibration statistics{' with a Hessian' if not missing else ''}"
                                 f" for {missing or g.consumers} (calibrate(..., hessian=True) for sparsegpt)")
    with torch.no_grad():
        before = _run_eval(model, example) if example is not None else None
    if example is not None:
        _check_outputs(before)
    # to undo everything: the permutations applied (inverted exactly, no copy of the model) and the
    # statistics objects' own tensors (the caller may hold those objects)
    applied: list[tuple[PermutationGroup, torch.Tensor]] = []
    stats_before = {k: (v, v.sq_sum, v.xtx, v.xtx_teacher) for k, v in (calibration or {}).items()}

    @torch.no_grad()
    def undo():
        for g, perm in reversed(applied):
            _apply(model, g, perm, inverse=True)
        if calibration is not None:
            calibration.clear()
            for k, (obj, sq_sum, xtx, xtx_teacher) in stats_before.items():
                obj.sq_sum, obj.xtx, obj.xtx_teacher = sq_sum, xtx, xtx_teacher
                calibration[k] = obj

    gains = {}
    try:
        with torch.no_grad():
            for g, H in zip(groups, sizes):
                S = group_importance(model, g, score, calibration)
                if g.block is None:
                    perm = search_permutation(S.float(), n, m, time_limit=time_limit, max_iters=max_iters,
                                              seed=seed, progress=progress)
                elif g.block % m == 0 and g.block >= 2 * m:
                    # One window per block, never re-drawn: all blocks searched side by side, none mixed.
                    perm = search_permutation(S.float(), n, m, time_limit=time_limit, max_iters=max_iters,
                                              seed=seed, progress=progress, window=g.block,
                                              round_iters=(max_iters or 1 << 62) + 1)
                else:  # blocks of one group (no permutation changes the masks), or not made of whole groups
                    # (the windowed search takes whole groups; such blocks are not searched)
                    perm = torch.arange(H, device="cpu")
                perm = perm.cpu()
                kept = lambda A: float(A.reshape(A.shape[0], -1, m).topk(n, dim=-1).values.sum())  # noqa: E731
                base = kept(S)
                gains[g.name or ",".join(g.consumers)] = kept(S[:, perm.to(S.device)]) / base - 1 if base else 0.0
                _apply(model, g, perm)  # only indexes tensors that g.size() checked
                applied.append((g, perm))
                for c in g.consumers:
                    if calibration is not None and c in calibration:
                        _permute_stats(calibration[c], perm)
            if example is not None and not _outputs_equal(before, _run_eval(model, example)):
                raise ValueError("the permuted model's outputs differ from the original's: a group is not "
                                 "exact (check it with check_group); nothing was changed")
    except BaseException:
        undo()
        raise
    return gains

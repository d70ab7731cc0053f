"""Input-channel permutations that raise the magnitude an N:M mask keeps
(a permuted weight's groups mix columns that used to sit apart), and their
application to a producer/consumer pair of layers so outputs stay equal."""
from __future__ import annotations

import math
import numbers
import time

import torch
from torch import nn

from .._checks import check_nm, check_seed, check_weight
from .._progress import progress_bar
from .two_d import score_dtype

__all__ = ["search_permutation", "apply_permutation"]


def search_permutation(w: torch.Tensor, n: int = 2, m: int = 4, time_limit: float | None = 10.0,
                       max_iters: int | None = None, seed: int = 0, progress: bool | None = None,
                       window: int = 128, tenure: int = 10, round_iters: int = 64) -> torch.Tensor:
    """Input-channel permutation raising the magnitude an N:M mask keeps.

    Regrouping the input columns changes which columns compete inside each
    group of ``m``. The search is a tabu search over swaps of two columns
    between groups (Glover 1989): every step takes, in every window, the
    swap with the best exact gain in kept magnitude, even a negative one,
    except that recently moved columns may not move again for ``tenure``
    steps unless that gives a new best; the best grouping seen is returned.
    Wide matrices are cut into windows of ``window`` columns searched side by
    side (vectorized), re-drawn at random every ``round_iters`` steps so
    columns can travel between windows. Only the grouping matters: the order
    inside a group and of the groups is kept as found.

    The result is deterministic for a ``seed`` when the search stops at
    ``max_iters``; when it stops at ``time_limit`` it depends on the machine's
    speed. It never keeps less than the identity.

    Args:
        w: ``(R, C)`` float weight, ``C % m == 0`` (searched on its device).
        n, m: the N:M pattern the mask will use.
        time_limit: seconds for the whole call (finite): no step starts that would end
            past it (judged by the last step's duration), and a step still
            running at the deadline stops at its next ~16M-term chunk; None: no
            time limit (``max_iters`` is then required).
        max_iters: optional cap on search steps.
        seed: seeds the window draws.
        progress: a tqdm bar on stderr: share of the time (or steps) used, kept-magnitude gain
            (default None: when stderr is a terminal or in a notebook).
        window: columns per window (rounded down to a multiple of ``m``).
        tenure: steps a moved column stays tabu.
        round_iters: steps between window re-draws (when ``C > window``).
    Returns:
        ``(C,)`` int64 permutation: ``w[:, perm]`` keeps more magnitude under
        ``mask_nm(w[:, perm], n, m)``. Apply it to a model with
        :func:`apply_permutation`.
    Example:
        >>> w = torch.randn(64, 128)
        >>> perm = search_permutation(w, time_limit=1.0, progress=False)
        >>> kept = lambda v: sparse24.kept_magnitude_fraction(v, sparse24.mask_nm(v, 2, 4))
        >>> kept(w[:, perm]) > kept(w)
        True
    """
    check_nm(n, m)
    check_weight(w, m)
    if not bool(torch.isfinite(w).all()):   # (NaN made every swap's score NaN: the identity, after time_limit)
        raise ValueError("the importance matrix contains NaN or inf: no permutation can be scored")
    check_search_args(time_limit, max_iters, seed)
    for name, v in (("window", window), ("tenure", tenure), ("round_iters", round_iters)):
        if not _is_int(v) or v < (0 if name == "tenure" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'tenure' else 'positive'} int, got {v!r}")
    t0 = time.perf_counter()
    C = w.shape[1]
    groups = C // m
    identity = torch.arange(C, device=w.device)
    if n in (0, m) or groups < 2 or w.shape[0] == 0:
        return identity  # every grouping keeps the same magnitude
    wg = max(2, min(groups, window // m))  # groups per window
    sdt = score_dtype(w)
    # One zero column at index C pads the last window; its positions never move.
    A = torch.cat([w.detach().abs().to(sdt), torch.zeros(w.shape[0], 1, dtype=sdt, device=w.device)], 1)
    t1 = time.perf_counter()
    base = _kept_nm(A[:, :C], identity, n, m)
    # The final check costs what this one did: keep time for it so the whole call fits time_limit.
    deadline = math.inf if time_limit is None else t0 + time_limit - (time.perf_counter() - t1)
    gen = torch.Generator().manual_seed(int(seed))
    bar = _Progress(time_limit, max_iters, base, progress)
    perm, it, rnd, gained = identity, 0, 0, 0.0

    last_step = 0.0  # stop when the next step, as long as the last one, would pass the deadline

    def done():
        return time.perf_counter() + last_step >= deadline or (max_iters is not None and it >= max_iters)

    search = None
    try:
        while not done():
            # Round 0 keeps the given grouping; later rounds re-draw which groups share a window.
            # (on the CPU generator's device, whatever torch's default device; moved to the weight's below)
            order = torch.arange(groups, device=gen.device) if rnd == 0 else \
                torch.randperm(groups, generator=gen, device=gen.device)
            search = _TabuWindows(A, perm.view(groups, m)[order.to(w.device)], n, m, wg, tenure, deadline)
            search.start()
            while not done() and (groups <= wg or search.it < round_iters):
                t_step = time.perf_counter()
                search.step()
                last_step = time.perf_counter() - t_step
                it += 1
                bar.update(deadline, it, gained + search.gained())
            perm, gained, rnd = search.best_columns(), gained + search.gained(), rnd + 1
    except _OutOfTime:
        perm = search.best_columns() if search is not None else perm
    finally:
        bar.close()
    # The gains were summed in the search precision: confirm with an fp64 sum.
    return perm if _kept_nm(A[:, :C], perm, n, m) >= base else identity


def _is_int(v) -> bool:
    # bool is an int to Python, but window=True (1 column) or max_iters=True (1 step) is a mistake
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_search_args(time_limit, max_iters, seed) -> None:
    """ValueError unless ``time_limit`` is a finite number > 0, or None with ``max_iters`` given
    (inf or None alone never stop), ``max_iters`` an int >= 0 or None and ``seed`` an int; bools refused."""
    if time_limit is None:
        if max_iters is None:
            raise ValueError("time_limit=None (no time limit) needs max_iters: the search would never stop")
    elif isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit < math.inf:
        raise ValueError(f"time_limit must be a positive number of seconds, and finite, got {time_limit!r}")
    if max_iters is not None and (not _is_int(max_iters) or max_iters < 0):
        raise ValueError(f"max_iters must be a non-negative int or None, got {max_iters!r}")
    check_seed(seed)


def apply_permutation(producer: nn.Linear, consumer: nn.Linear, perm: torch.Tensor) -> None:
    """Reorder the hidden features between two Linears in place, keeping the model's function.

    For ``consumer(act(producer(x)))`` with ``act`` elementwise (ReLU, GELU,
    dropout...), permuting ``producer``'s output rows (weight and bias) and
    ``consumer``'s input columns by the same ``perm`` leaves the output
    unchanged, while ``consumer.weight`` becomes ``consumer.weight[:, perm]``
    (the matrix :func:`search_permutation` was run on). Anything mixing the
    hidden features between the two (a LayerNorm, a residual add, another
    reader of the hidden activations) breaks this: only use it on such a pair.
    The Parameters are updated in place (same objects); optimizer state such
    as momentum is NOT permuted, so apply it before building the optimizer.

    Args:
        producer: ``nn.Linear`` with ``out_features == len(perm)``.
        consumer: ``nn.Linear`` with ``in_features == len(perm)``.
        perm: ``(H,)`` integer permutation of ``range(H)``.
    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        >>> perm = search_permutation(mlp[2].weight, time_limit=0.5, progress=False)
        >>> apply_permutation(mlp[0], mlp[2], perm)
    """
    for name, mod in (("producer", producer), ("consumer", consumer)):
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"{name} must be an nn.Linear, got {type(mod).__name__}")
        # .weight of a parametrized Linear is a computed copy: writing it would permute nothing
        if nn.utils.parametrize.is_parametrized(mod, "weight"):
            raise ValueError(f"{name}'s weight is parametrized (e.g. SR-STE, weight_norm): apply the permutation "
                             "before adding the parametrization, or after removing it")
    if producer is consumer:
        raise ValueError("producer and consumer are the same module: permuting its rows and columns together "
                         "changes its function")
    if producer.out_features != consumer.in_features:
        raise ValueError(f"producer.out_features ({producer.out_features}) must equal consumer.in_features "
                         f"({consumer.in_features}): the permuted features must be the ones passed between them")
    H = producer.out_features
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64) or perm.shape != (H,):
        got = f"{perm.dtype} {tuple(perm.shape)}" if isinstance(perm, torch.Tensor) else type(perm).__name__
        raise ValueError(f"perm must be an integer tensor of shape ({H},), got {got}")
    if not torch.equal(torch.sort(perm.cpu()).values, torch.arange(H, dtype=perm.dtype, device="cpu")):
        raise ValueError(f"perm must be a permutation of 0..{H - 1} (each index exactly once)")
    with torch.no_grad():
        producer.weight.copy_(producer.weight[perm.to(producer.weight.device)])
        if producer.bias is not None:
            producer.bias.copy_(producer.bias[perm.to(producer.bias.device)])
        consumer.weight.copy_(consumer.weight[:, perm.to(consumer.weight.device)])


class _OutOfTime(Exception):
    pass


def _kept_nm(a: torch.Tensor, perm: torch.Tensor, n: int, m: int) -> float:
    """Kept |w| of the best N:M mask of ``a[:, perm]`` (a = |w|)."""
    return float(a[:, perm].reshape(a.shape[0], -1, m).topk(n, dim=-1).values.sum(dtype=torch.float64))


class _TabuWindows:
    """Tabu search over column swaps in ``B`` independent windows of ``wg`` groups.

    Position ``p`` of a window is slot ``p % m`` of its group ``p // m``;
    ``loc[b, p]`` is the window-local column sitting there. ``gain[b, p, c]``
    is the exact change of window ``b``'s kept magnitude when the column at
    ``p`` is replaced by local column ``c`` (the other groups unchanged), so a
    swap of positions ``p, q`` in different groups changes it by
    ``gain[p, loc[q]] + gain[q, loc[p]]``.
    """

    def __init__(self, A, group_cols, n, m, wg, tenure, deadline):
        G = group_cols.shape[0]
        B = -(-G // wg)
        pad = torch.full((B * wg - G, m), A.shape[1] - 1, dtype=torch.long, device=A.device)
        self.cols = torch.cat([group_cols, pad]).view(B, wg * m)  # global column of local column j
        self.A, self.n, self.m, self.tenure, self.deadline = A, n, m, tenure, deadline
        self.At = A.t()[self.cols]  # (B, P, R): |w| of each local column
        self.col_sums = self.At.sum(2)  # (B, P)
        self.others = torch.tensor([[j for j in range(m) if j != i] for i in range(m)], device=A.device)
        self.B, self.P = B, wg * m
        dev = A.device
        self.loc = torch.arange(self.P, device=dev).repeat(B, 1)
        real = torch.arange(B * self.P, device=dev).view(B, self.P) < G * m
        grp = torch.arange(self.P, device=dev) // m
        # swaps forbidden forever: inside one group, or touching a padding position
        self.fixed = (grp[:, None] == grp[None, :]) | ~(real[:, :, None] & real[:, None, :])
        self.tabu_until = torch.zeros(B, self.P, dtype=torch.long, device=dev)  # per local column
        self.gain = torch.empty(B, self.P, self.P, dtype=A.dtype, device=dev)
        self.cur = torch.zeros(B, dtype=torch.float64, device=dev)  # gain vs the start, per window
        self.best = self.cur.clone()
        self.best_loc = self.loc.clone()
        self.it = 0

    def start(self):
        """Fill ``gain`` for every position (the costly part: R x P x P per window)."""
        self._refresh(torch.arange(self.P // self.m, device=self.A.device).repeat(self.B, 1))

    def _refresh(self, grps):
        """Recompute ``gain`` rows of the positions in groups ``grps`` (B, g)."""
        n, m = self.n, self.m
        B, g = grps.shape
        R = self.At.shape[2]
        pos = (grps[:, :, None] * m + torch.arange(m, device=grps.device)).view(B, -1)  # (B, g*m)
        vals = self.At.gather(1, self.loc.gather(1, pos)[:, :, None].expand(-1, -1, R))  # (B, g*m, R)
        vals = vals.view(B, g, m, R).transpose(2, 3)  # (B, g, R, m)
        rest = vals[..., self.others].topk(n, dim=-1).values  # (B, g, R, m, n): top n without slot i
        full = vals.topk(n, dim=-1).values.sum(-1)  # (B, g, R)
        # Inserting x next to the others keeps top-n(others) + relu(x - nth largest(others)).
        base = (rest.sum(-1) - full[..., None]).sum(2).reshape(B, -1)  # (B, g*m)
        thr = rest[..., -1].transpose(2, 3).reshape(B, g * m, R)  # (B, g*m, R)
        # sum_r relu(a_r - t_r) = (sum_r |a_r - t_r| + sum_r a_r - sum_r t_r) / 2, the L1 sums from
        # cdist: 2.5x faster than materializing a - t (0.46 s vs 1.1 s per step of a 4096x4096 weight).
        rows = torch.empty(B, g * m, self.P, dtype=self.A.dtype, device=self.A.device)
        # chunks of ~16M terms between deadline checks: whole windows, or a large window's positions in parts
        step = max(1, (1 << 24) // (g * m * R * self.P))
        part = g * m if step > 1 or g * m * R * self.P <= 1 << 24 else max(1, (1 << 24) // (R * self.P))
        for i in range(0, B, step):
            for j in range(0, g * m, part):
                if time.perf_counter() > self.deadline:
                    raise _OutOfTime
                rows[i:i + step, j:j + part] = torch.cdist(thr[i:i + step, j:j + part], self.At[i:i + step], p=1)
        rows += self.col_sums[:, None, :] - thr.sum(2)[:, :, None]
        self.gain.scatter_(1, pos[:, :, None].expand(-1, -1, self.P), rows / 2 + base[:, :, None])

    def step(self):
        self.it += 1
        g_loc = self.gain.gather(2, self.loc[:, None, :].expand(-1, self.P, -1))  # gain[p, loc[q]]
        delta = (g_loc + g_loc.transpose(1, 2)).masked_fill_(self.fixed, -math.inf)
        flat = delta.view(self.B, -1)
        v_all, k_all = flat.max(1)
        tabu = self.tabu_until.gather(1, self.loc) > self.it
        v, k = delta.masked_fill_(tabu[:, :, None] | tabu[:, None, :], -math.inf).view(self.B, -1).max(1)
        aspire = self.cur + v_all.double() > self.best + 1e-9  # a tabu move giving a new best is allowed
        v, k = torch.where(aspire, v_all, v), torch.where(aspire, k_all, k)
        moving = torch.isfinite(v)
        if not bool(moving.any()):
            return
        b = moving.nonzero()[:, 0]
        p, q = k[b] // self.P, k[b] % self.P
        lp, lq = self.loc[b, p], self.loc[b, q]
        self.loc[b, p], self.loc[b, q] = lq, lp
        self.tabu_until[b, lp] = self.it + self.tenure
        self.tabu_until[b, lq] = self.it + self.tenure
        self.cur[b] += v[b].double()
        better = self.cur > self.best + 1e-9
        self.best = torch.where(better, self.cur, self.best)
        self.best_loc[better] = self.loc[better]
        grps = torch.stack([p // self.m, q // self.m], 1)
        full = torch.zeros(self.B, 2, dtype=torch.long, device=grps.device)  # still windows: group 0 twice
        full[b] = grps
        self._refresh(full)

    def gained(self) -> float:
        """Kept magnitude gained so far by the best arrangements (search precision)."""
        return float(self.best.sum())

    def best_columns(self) -> torch.Tensor:
        """``(C,)`` permutation made of each window's best arrangement (padding dropped)."""
        cols = self.cols.gather(1, self.best_loc).view(-1, self.m)
        return cols[cols[:, 0] < self.A.shape[1] - 1].reshape(-1)


class _Progress:
    """The search's tqdm bar: share of the time (or steps) used, in percent, and the kept-magnitude gain."""

    def __init__(self, time_limit, max_iters, base, progress):
        self.time_limit, self.max_iters, self.base = time_limit, max_iters, base
        self.bar = progress_bar(total=100, desc="search_permutation", progress=progress, unit="%")
        self.last = -1.0

    def update(self, deadline, it, gain):
        now = time.perf_counter()
        if self.bar.disable or now - self.last < 0.25:
            return
        self.last = now
        frac = 0.0 if self.time_limit is None else 1 - (deadline - now) / self.time_limit
        if self.max_iters:
            frac = max(frac, it / self.max_iters)
        self.bar.n = round(100 * min(max(frac, 0.0), 1.0))
        self.bar.set_postfix_str(f"step {it} kept {100 * gain / max(self.base, 1e-30):+.3f}%")  # redraws

    def close(self):
        self.bar.close()

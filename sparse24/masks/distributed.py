"""Data-parallel calibration: every statistic :func:`~sparse24.masks.calibrate` collects is a sum
over tokens, so N processes that each ran 1/N of the calibration data hold the whole data's
statistics once their sums are added (one ``all_reduce`` per layer input, plus one for all
token counts). Every rank then computes the same masks and weights."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .nm import LayerStats

__all__ = ["check_group", "sum_over_ranks", "agree"]


def check_group(group) -> None:
    """TypeError/ValueError unless ``group`` is None or a usable process group."""
    if group is None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group= needs torch.distributed initialized (torch.distributed.init_process_group, "
                         "or torchrun); leave it None in a single process")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD), "
                        f"got {type(group).__name__}")


def sum_over_ranks(stats: dict[str, LayerStats], layers: dict[str, nn.Linear], hessian: bool, teacher: bool,
                   dtype: torch.dtype, device, group) -> dict[str, LayerStats]:
    """Add every rank's statistics; a collective: every rank of ``group`` calls it with the same layers.

    Args:
        stats: this rank's ``{fqn: LayerStats}`` (layers it saw no input for may be missing).
        layers: ``{fqn: nn.Linear}``, every selected layer, in the same order on every rank.
        hessian, teacher: whether ``xtx`` / ``xtx_teacher`` were collected.
        dtype: accumulation dtype. device: where the batches ran (None: each layer's weight's device).
        group: the process group.
    Returns:
        ``{fqn: LayerStats}`` summed over the ranks, for the layers some rank saw input for.
    """
    def where(fqn):
        return device if device is not None else layers[fqn].weight.device
    names = list(layers)
    if not names:
        return {}
    counts = torch.tensor([stats[f].count if f in stats else 0 for f in names], dtype=torch.int64,
                          device=where(names[0]))
    dist.all_reduce(counts, group=group)  # tokens: exact integers, whatever the accumulation dtype
    out = {}
    for fqn, total in zip(names, counts.tolist()):
        k, s = layers[fqn].in_features, stats.get(fqn)
        parts = [k] + [k * k] * (int(hessian) + int(teacher))
        if s is None:
            flat = torch.zeros(sum(parts), dtype=dtype, device=where(fqn))
        else:
            flat = torch.cat([t.reshape(-1) for t in (s.sq_sum, s.xtx, s.xtx_teacher) if t is not None])
        dist.all_reduce(flat, group=group)
        if total == 0:
            continue
        sq_sum, *squares = flat.split(parts)
        squares = iter(t.view(k, k) for t in squares)
        out[fqn] = LayerStats(sq_sum, total, next(squares) if hessian else None, next(squares) if teacher else None)
    return out


def agree(error: Exception | None, group, what: str) -> None:
    """A collective after a step that may fail on some ranks only (a bad batch on one rank): every rank
    of ``group`` learns which failed and raises, its own error where it failed, so that no rank is
    left waiting in the next collective for one that has left.

    Args:
        error: this rank's exception, or None. group: the process group. what: the step, for the message.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    failed = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    failed[dist.get_rank(group)] = error is not None
    dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if bool(failed.any()):
        ranks = failed.nonzero().flatten().tolist()
        raise RuntimeError(f"{what} failed on rank(s) {ranks} of the process group (see their errors); stopped on "
                           "every rank, so that none waits for them in a collective")

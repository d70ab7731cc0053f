"""Masks of sharded weights (FSDP2's ``fully_shard``, or any DTensor weight).

``fully_shard`` turns each Parameter into a DTensor holding this rank's rows
and leaves buffers alone, so a plain mask would meet a sharded weight in the
optimizer hooks (``masked_fill_`` refuses to mix the two). The mask is
therefore sharded exactly like its weight, with no communication: each rank
keeps its own piece of its own full mask, as ``fully_shard`` keeps its own
piece of its own full weight. In FSDP2's forward the weight is gathered
(plain) while the mask stays sharded; the forward then gathers the mask too,
packed 8 entries a byte (1/16 of the bytes of a bf16 weight's all-gather).

Loading checks each rank's own piece of a sharded entry, so a corrupt part may
fail on one rank only: :func:`agree` then makes every rank refuse together."""
from __future__ import annotations

import torch

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # a torch build without torch.distributed: nothing is ever sharded
    DTensor = ()

__all__ = ["is_dtensor", "shard_like", "gather_mask", "local_pair", "agree"]

# The bytes of the first failing rank's message that the others quote (sent only when a check failed).
_MESSAGE_BYTES = 1024


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def _same_spec(a, b) -> bool:
    return a.device_mesh == b.device_mesh and tuple(a.placements) == tuple(b.placements)


def _spec(t) -> str:
    return f"DTensor{tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"


def _rows_only(t) -> bool:
    """Sharded (if at all) along rows only: every 2:4 group of a row lies whole on one rank."""
    return all(not isinstance(p, Shard) or p.dim == 0 for p in t.placements)


def shard_like(mask: torch.Tensor, weight) -> "DTensor":
    """``mask`` as a DTensor with ``weight``'s mesh and placements.

    Args:
        mask: ``(R, C)`` bool, plain (this rank's full mask) or a DTensor.
        weight: ``(R, C)`` DTensor.
    Returns:
        the bool DTensor; each rank's local piece covers the same positions as ``weight``'s.
    """
    if is_dtensor(mask):
        if _same_spec(mask, weight):
            return mask
        mask = mask.full_tensor()
    out = distribute_tensor(mask.to(weight.device), weight.device_mesh, weight.placements, src_data_rank=None)
    if out.to_local().shape != weight.to_local().shape:
        raise RuntimeError(f"could not shard the 2:4 mask like its weight: local pieces {tuple(out.to_local().shape)} "
                           f"vs {tuple(weight.to_local().shape)}")
    return out


def gather_mask(mask: "DTensor") -> torch.Tensor:
    """The full ``(R, C)`` bool mask on every rank (one all-gather of its bits)."""
    if not _rows_only(mask):
        return mask.full_tensor()
    local = mask.to_local()
    r, C = local.shape
    pad = -C % 8
    if pad:
        local = torch.cat([local, local.new_zeros(r, pad)], dim=1)
    bit = torch.arange(8, dtype=torch.uint8, device=local.device)
    # (the width given: a rank holding no rows of the layer has r = 0)
    packed = (local.view(r, (C + pad) // 8, 8).to(torch.uint8) << bit).sum(-1, dtype=torch.uint8)
    R, width = mask.shape[0], (C + pad) // 8
    whole = DTensor.from_local(packed, mask.device_mesh, mask.placements, shape=torch.Size((R, width)),
                               stride=(width, 1)).full_tensor()
    return ((whole.unsqueeze(-1) >> bit) & 1).bool().view(R, C + pad)[:, :C]


def local_pair(weight: torch.Tensor, mask: torch.Tensor,
               whole_groups: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, mask)`` as plain tensors covering the same positions: each rank's own pieces
    (views: in-place changes reach the DTensors) when both are sharded alike. ``whole_groups``
    (for checking the 2:4 pattern): pieces only when sharded along rows, else the full tensors
    (copies); otherwise a DTensor not sharded like the other is an error."""
    alike = is_dtensor(weight) and is_dtensor(mask) and _same_spec(weight, mask)
    if alike and (_rows_only(weight) or not whole_groups):
        return weight.to_local(), mask.to_local()
    if not whole_groups and (is_dtensor(weight) or is_dtensor(mask)):
        raise RuntimeError("a 2:4 weight (or its gradient) and its mask are not sharded alike: "
                           f"{_spec(weight)} vs {_spec(mask)}")
    full = [t.full_tensor() if is_dtensor(t) else t for t in (weight, mask)]
    return full[0], full[1]


def _sum_over_mesh(t: torch.Tensor, mesh) -> None:
    """``t`` summed over every rank of ``mesh``, in place: over each of its dimensions in turn."""
    for d in range(mesh.ndim):
        dist.all_reduce(t, group=mesh.get_group(d))


def agree(error: Exception | None, t: "DTensor") -> None:
    """After a check that each rank of ``t``'s mesh made on its own piece (no communication, so it may
    fail on some ranks only): every rank learns whether any failed and, if so, raises: its own error
    where it failed, a ValueError quoting the first failing rank's where it did not. So every rank
    refuses a load together and none is left waiting in a later collective for one that has left.
    A collective (one all-reduce per mesh dimension; a second one for the message when some rank
    failed): every rank of the mesh calls it, in the same order, whatever its own check found.

    Args:
        error: this rank's exception, or None. t: a DTensor whose mesh the checked entries share.
    """
    mesh = t.device_mesh
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    ranks = mesh.mesh.flatten().tolist()
    me = ranks.index(dist.get_rank())
    failed = torch.zeros(len(ranks), dtype=torch.int32, device=device)
    failed[me] = error is not None
    _sum_over_mesh(failed, mesh)
    failed = failed.nonzero().flatten().tolist()
    if not failed:
        return
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if me == failed[0]:
        raw = str(error).encode()[:_MESSAGE_BYTES]
        text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    _sum_over_mesh(text, mesh)
    if error is not None:
        raise error
    quoted = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    raise ValueError(f"refused on rank(s) {[ranks[i] for i in failed]} of the mesh, where rank {ranks[failed[0]]} "
                     f"says: {quoted}")

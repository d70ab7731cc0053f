"""Running a test body on N CPU processes over gloo on this machine."""
import datetime
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, folder, args, timeout):
    # rendezvous through a file: no port to pick, so no race with other processes for a free one
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            **({} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}))
    try:
        torch.set_num_threads(1)
        result = fn(rank, *args)
        if rank == 0:
            torch.save(result, f"{folder}/rank0.pt")
        # Tear down together: a rank leaving while the other still works aborted at exit now and then
        # ("terminate called without an active exception", after DCP and full-state-dict gathers).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: leave without the interpreter's teardown. A joinable C++ thread destroyed there
    # (gloo / autograd workers after FSDP and DCP) aborted the process now and then even after
    # the barrier (1 run in ~10 of the HF FSDP test); the result is already saved, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, timeout: float | None = None):
    """Run ``fn(rank, *args)`` in ``world`` processes with the default process group initialized
    and return what rank 0 returned; ``fn`` must be a module-level function. A failure in any
    process fails the caller; ``timeout``: seconds a collective may wait (a test of what would
    otherwise hang fails instead)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(fn, world, d, args, timeout), nprocs=world, join=True)
        return torch.load(Path(d) / "rank0.pt", weights_only=False)


# why the INT8 scenarios skip where fsdp2_shards_integer_parameters says no
NO_INTEGER_FSDP2 = "this torch's FSDP2 cannot shard integer Parameters (INT8 values): needs torch >= 2.13"


def fsdp2_shards_integer_parameters(mesh) -> bool:
    """Whether this torch's ``fully_shard`` takes an integer Parameter (INT8 / INT4 compressed values). torch
    2.9-2.11's FSDP2 wraps each shard in ``nn.Parameter`` without its ``requires_grad`` and raises "only Tensors
    of floating point dtype can require gradients" (pytorch#177844, fixed by #177948; torch 2.13 has it).
    Probed on a throwaway module (no collective: fully_shard communicates at the first forward)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    probe = nn.Module()
    probe.q = nn.Parameter(torch.zeros(2 * mesh.size(), 4, dtype=torch.int8), requires_grad=False)
    try:
        fully_shard(probe, mesh=mesh)
    except RuntimeError as e:
        if "floating point dtype can require gradients" not in str(e):
            raise
        return False
    return True

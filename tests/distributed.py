"""Running a test body on N CPU processes over gloo on loopback (free ports on 127.0.0.1 only)."""
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, *args)`` in ``world`` processes with the default process group initialized;
    ``fn`` must be a module-level function. A failure in any process fails the caller."""
    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)

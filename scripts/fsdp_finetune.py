"""Fine-tune a 2:4-pruned causal LM with frozen masks under FSDP2, save a distributed checkpoint,
and export a compressed Hugging Face folder (see docs/distributed.md).

    torchrun --nproc_per_node 8 scripts/fsdp_finetune.py --model path/to/llama --bf16 --steps 1000 --out ft
    torchrun --nproc_per_node 2 scripts/fsdp_finetune.py --tiny --device cpu --steps 3 --out /tmp/ft  # gloo, CPU
    torchrun --nproc_per_node 2 scripts/fsdp_finetune.py --tiny --width 1024 --layers 8 --device cpu --steps 3 \
        --memory --out /tmp/ft  # per-rank memory (run with 1 and 2 processes to compare)

The order matters: ``sparsify_`` first (every mask computed from the whole weight), then
``fully_shard`` (each mask is sharded with its weight); ``sparsify_`` on sharded weights raises.
The batches here are random tokens: put your data loader in ``batches``.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import sparse24


def tiny_config(width: int = 64, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=width, intermediate_size=width * 5 // 2, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2)


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set size (``VmHWM``: its peak since the last :func:`reset_peak`), Linux."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def local_mib(tensors) -> float:
    """Bytes this rank holds of ``tensors`` (its shard of a DTensor), MiB."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors) / 2 ** 20


def memory_report(model, opt, rank: int, world: int, before: float, sharded: float) -> str:
    """One rank's line: its shards of the parameters, masks, gradients and AdamW state, and its RSS."""
    masks = [b for n, b in model.named_buffers() if n.endswith(".mask")]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return (f"rank {rank}/{world}: parameters {local_mib(model.parameters()):.0f} MiB, "
            f"masks {local_mib(masks):.0f} MiB, "
            f"gradients {local_mib(grads):.0f} MiB, AdamW state {local_mib(state):.0f} MiB (this rank's shards); "
            f"RSS before the model {before:.0f} MiB, after sharding {sharded:.0f} MiB, "
            f"peak while training {rss_mib('VmHWM'):.0f} MiB")


def batches(args, rank: int, vocab: int):
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own share of the data
    for _ in range(args.steps):
        yield torch.randint(3, vocab, (args.batch, args.seq), generator=gen).to(args.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face folder or id of the dense model")
    ap.add_argument("--tiny", action="store_true", help="a small Llama from a config instead (no download)")
    ap.add_argument("--width", type=int, default=64, help="--tiny: hidden size (MLP: 2.5x)")
    ap.add_argument("--layers", type=int, default=2, help="--tiny: decoder blocks")
    ap.add_argument("--memory", action="store_true", help="print each rank's shard sizes and peak RSS")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bfloat16)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--out", required=True, help="folder for dcp/ (the distributed checkpoint) and hf/")
    args = ap.parse_args(argv)
    if bool(args.tiny) == bool(args.model):
        ap.error("give --model or --tiny")

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    config = tiny_config(args.width, args.layers) if args.tiny else AutoConfig.from_pretrained(args.model)
    before = rss_mib()

    def dense():
        torch.manual_seed(0)  # the same weights on every rank (fully_shard keeps each rank's own piece)
        if args.tiny:
            return AutoModelForCausalLM.from_config(config)
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    model = dense()
    sparse24.sparsify_(model)  # 1. sparsify: masks from the whole weights
    if args.checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    mesh = init_device_mesh(args.device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    for layer in model.model.layers:  # 2. shard: each mask goes with its weight
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    sharded = rss_mib()
    if args.memory:  # the peak of training alone, not of building the whole model on every rank first
        reset_peak()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step, ids in enumerate(batches(args, rank, config.vocab_size)):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()  # pruned weights and their optimizer state stay exactly zero
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step}: loss {float(loss) / world:.4f}", flush=True)
    if args.memory:
        lines = [None] * world
        dist.all_gather_object(lines, memory_report(model, opt, rank, world, before, sharded))
        if rank == 0:
            print("\n".join(lines), flush=True)

    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(args.out, "dcp"))  # sharded, masks included
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the gathered weights and masks -> an unsharded model -> compressed folder
        with torch.device("meta"):
            export = AutoModelForCausalLM.from_config(config)
        sparse24.sparsify_(export)  # masks pending: taken from the state dict below
        export.load_state_dict(full, assign=True)
        sparse24.compress_(export)
        export.save_pretrained(os.path.join(args.out, "hf"))
        print(f"saved {args.out}/dcp (distributed checkpoint) and {args.out}/hf (compressed 2:4 folder)")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak memory and wall time of pruning a checkpoint block by block (docs/distributed.md).

Writes a Llama-shaped fp16 checkpoint with random weights (default: TinyLlama-1.1B's shape,
1.1e9 parameters, 2.2 GB in 5 shards) without ever holding it whole, then prunes it with
``prune_folder_blockwise`` in a fresh process and prints that process's peak RSS against
the goal: 1.5 x one block's fp32 weights + the calibration activations + the fixed overhead
(the process's RSS after importing everything and building the meta model).

    python scripts/blockwise_memory.py --folder /tmp/llama1b [--method wanda] [--sequences 4 --seq 128]
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4)
MIB = 2 ** 20


def rss_mib() -> float:
    """The current resident set size (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    """This process's peak RSS (Linux). Not getrusage's ru_maxrss: that one survives exec, so the
    child reported the parent's peak from generating the checkpoint."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def generate(folder: Path, layers: int, shard_bytes: int = 500 * MIB) -> int:
    """The checkpoint, tensor by tensor from a meta model's shapes; returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, architectures=["LlamaForCausalLM"],
                         torch_dtype="float16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups, size = [[]], 0
    for k, shape in shapes.items():
        n = shape.numel() * 2
        if size + n > shard_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.ones(shapes[k]) if k.endswith("norm.weight") else
                       torch.randn(shapes[k], generator=gen) * 0.02).half() for k in keys}
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    total = sum(s.numel() for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return total


def prune(folder: Path, out: Path, method: str, sequences: int, seq: int) -> None:
    """Runs in its own process: the peak RSS is this pruning's alone."""
    from sparse24.tools.blockwise import prune_folder_blockwise
    from sparse24.tools.checkpoint import check_shards
    from sparse24.tools.hf_folder import _shards, _skeleton

    config, model = _skeleton(folder, check_shards(folder, _shards(folder)[0]))  # as the pruning; in the overhead
    block = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    fixed = rss_mib()
    ids = torch.randint(3, config.vocab_size, (sequences, seq), generator=torch.Generator().manual_seed(1))
    hidden = sequences * seq * config.hidden_size * 4  # one copy of the hidden states, fp32
    t0 = time.perf_counter()
    rows = prune_folder_blockwise(folder, out, list(ids.split(1)), method=method)
    wall = time.perf_counter() - t0
    peak = peak_mib()
    goal = 1.5 * block / MIB + 2 * hidden / MIB + fixed
    n_params = sum(r["shape"][0] * r["shape"][1] for r in rows)
    print(f"pruned {len(rows)} layers ({n_params / 1e9:.2f}e9 weights) by {method} on {sequences} x {seq} tokens, "
          f"block by block, in {wall:.0f} s")
    print(f"one block fp32: {block / MIB:.0f} MiB; calibration hidden states: 2 x {hidden / MIB:.0f} MiB; "
          f"fixed overhead (imports + meta model): {fixed:.0f} MiB")
    if method == "sparsegpt":  # its statistics: a K x K fp64 Hessian per layer of a wave, not in the goal
        k = max(m.in_features for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
        print(f"SparseGPT's largest Hessian (K = {k}, fp64): {8 * k * k / MIB:.0f} MiB")
    print(f"peak RSS: {peak:.0f} MiB = fixed + {(peak - fixed) / (block / MIB):.2f} x one block's fp32 weights "
          f"(activations aside); goal (1.5 x block + activations + fixed): {goal:.0f} MiB -> "
          f"{'met' if peak <= goal else 'NOT met'} ({peak / goal:.2f}x of the goal)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, type=Path, help="where the dense checkpoint is (generated if absent)")
    ap.add_argument("--out", type=Path, help="pruned folder (default: FOLDER-2of4, replaced)")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder blocks (when generating)")
    ap.add_argument("--method", default="wanda", choices=("wanda", "sparsegpt"))
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.out or args.folder.with_name(args.folder.name + "-2of4")
    if args.child:
        prune(args.folder, out, args.method, args.sequences, args.seq)
        return 0
    if not (args.folder / "config.json").exists():
        t0 = time.perf_counter()
        n = generate(args.folder, args.layers)
        print(f"wrote {args.folder}: {n / 1e9:.2f}e9 parameters, fp16, in {time.perf_counter() - t0:.0f} s")
    if out.exists():
        import shutil
        shutil.rmtree(out)
    return subprocess.call([sys.executable, __file__, "--child", "--folder", str(args.folder), "--out", str(out),
                            "--method", args.method, "--sequences", str(args.sequences), "--seq", str(args.seq)])


if __name__ == "__main__":
    raise SystemExit(main())

"""Saved checkpoint size of a 2:4 model against its dense fp16 checkpoint.

Builds a stack of transformer-MLP-shaped Linear layers in fp16, saves its state
dict with torch.save dense, in masked mode, compressed, and compressed INT8,
reloads each into a freshly built and sparsified model and checks the outputs
are bit-identical, then prints the file sizes.

    python scripts/checkpoint_size.py [--dim 1024] [--blocks 2]

``--dim`` must be a multiple of 4 and at least ``sparse24``'s ``min_features`` (32): every
Linear is 2:4, or the sizes would include a layer ``sparsify_`` kept dense.
"""
import argparse
import io
import platform

import torch
from torch import nn

import sparse24
from sparse24.api import MIN_FEATURES


def build(dim: int, blocks: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*layers).half().eval()


def prepare(model: nn.Module, kind: str) -> nn.Module:
    if kind != "dense":
        skipped = sparse24.sparsify_(model).skipped
        if skipped:  # its fp16 weight would be counted in a "2:4" checkpoint's size
            raise ValueError("layers left dense, the 2:4 sizes would include them: "
                             + "; ".join(f"{r.fqn} ({r.reason})" for r in skipped))
        if kind != "masked":
            sparse24.compress_(model, quantize="int8" if kind == "int8" else None)
    return model


def saved_bytes(sd: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024, help="a multiple of 4, >= 32 (default 1024)")
    ap.add_argument("--blocks", type=int, default=2)
    args = ap.parse_args()
    if args.dim % 4 or args.dim < MIN_FEATURES:  # sparsify_ would keep such layers dense
        ap.error(f"--dim must be a multiple of 4 and >= {MIN_FEATURES} (every Linear 2:4), got {args.dim}")
    x = torch.randn(4, args.dim).half()
    weight_elems = 8 * args.dim * args.dim * args.blocks
    print(f"# {args.blocks} x (Linear({args.dim}, {4 * args.dim}) + Linear({4 * args.dim}, {args.dim})), fp16, "
          f"{weight_elems / 1e6:.1f}M weights + biases; torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'checkpoint':<22} {'bytes':>12} {'vs dense fp16':>14}  entries")
    dense_size = None
    for kind in ("dense", "masked", "compressed", "int8"):
        src = prepare(build(args.dim, args.blocks, seed=0), kind)
        sd = src.state_dict()
        assert all(type(v) is torch.Tensor for v in sd.values())  # plain tensors (safetensors-compatible)
        blob = saved_bytes(sd)
        fresh = prepare(build(args.dim, args.blocks, seed=1), kind)
        fresh.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        with torch.no_grad():
            assert torch.equal(fresh(x), src(x)), kind  # bit-identical after the round trip
        dense_size = dense_size or len(blob)
        entries = sorted({k.split(".")[-1] for k in sd})
        print(f"{kind:<22} {len(blob):>12} {100 * len(blob) / dense_size:>13.1f}%  {', '.join(entries)}")
    # Exact byte counts of the weights alone (biases are stored dense in every case).
    print(f"# weights only: fp16 2:4 = {100 * 9 / 16:.2f}% of fp16 (values + 2-bit slots); "
          f"int8 2:4 = {100 * 5 / 16:.2f}% of fp16 = 62.5% of dense int8, plus 4 B per row of scales")


if __name__ == "__main__":
    main()

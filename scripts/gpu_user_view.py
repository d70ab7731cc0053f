"""What a user sees at decode time: eager wall time per call of one layer, and
tokens/s of a Llama-7B-shaped MLP stack decoding one token at a time under
torch.compile, dense vs 2:4 (fp16 values) vs 2:4 INT8, with the graph-break
count. Writes ``user_view.csv`` and prints a table; run by scripts/gpu_check.sh.

Model: ``blocks`` residual MLP blocks ``h = h + down(silu(up(h)))`` with
up ``d -> ff`` and down ``ff -> d`` (Llama-2-7B: d = 4096, ff = 11008), fp16,
batch M = 1. Every Linear is 2:4 in the sparse variants (compressed, the
registered ``sparse24::linear`` op).

    python scripts/gpu_user_view.py --out results/GPU/            # on a GPU (defaults)
    python scripts/gpu_user_view.py --device cpu --d 64 --ff 128 --blocks 2 --tokens 4 \\
        --backend aot_eager --mode default --out /tmp/uv            # a CPU dry run of every step
"""
import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparse24


class MLPStack(nn.Module):
    """``blocks`` residual SiLU MLPs: ``(M, d) -> (M, d)``."""

    def __init__(self, d: int, ff: int, blocks: int, dtype, device):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(d, ff, bias=False, dtype=dtype, device=device) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(ff, d, bias=False, dtype=dtype, device=device) for _ in range(blocks))
        for lin in [*self.up, *self.down]:  # keep activations O(1) through the residual stream
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)

    def forward(self, h):
        for up, down in zip(self.up, self.down):
            h = h + down(F.silu(up(h)))
        return h


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_us(fn, device, calls: int, repeats: int) -> float:
    """Median wall time per call, synchronized: what an eager loop of calls costs end to end."""
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append(1e6 * (time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def eager_layer(d: int, ff: int, device, calls: int, repeats: int) -> list[dict]:
    """Wall time per call of one ff x d layer at M = 1: nn.Linear vs Sparse24Linear (fp16, INT8)."""
    dense = nn.Linear(d, ff, bias=False, dtype=torch.float16, device=device)
    variants = {"dense nn.Linear": dense,
                "2:4 fp16": sparse24.Sparse24Linear.from_linear(_clone(dense), mode="compressed"),
                "2:4 int8": sparse24.Sparse24Linear.from_linear(_clone(dense), mode="compressed", quantize="int8")}
    x = torch.randn(1, d, dtype=torch.float16, device=device)
    rows = []
    with torch.no_grad():
        for name, mod in variants.items():
            rows.append({"what": "eager layer", "variant": name, "shape": f"{ff}x{d}",
                         "us_per_call": round(_wall_us(lambda: mod(x), device, calls, repeats), 3)})
    return rows


def _clone(lin: nn.Linear) -> nn.Linear:
    c = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype,
                  device=lin.weight.device)
    c.load_state_dict(lin.state_dict())
    return c


def variants(make, layers: int) -> dict:
    """``{"dense", "2:4 fp16", "2:4 int8": model}``: ``make()`` built once dense (seed 0) and twice
    more with its weights, sparsified compressed (fp16 / INT8 values); each must swap ``layers`` Linears."""
    torch.manual_seed(0)
    base = make().eval()
    models = {"dense": base}
    for name, quantize in (("2:4 fp16", None), ("2:4 int8", "int8")):
        m = make().eval()
        m.load_state_dict(base.state_dict())
        report = sparse24.sparsify_(m, mode="compressed", quantize=quantize)
        assert sum(isinstance(mod, sparse24.Sparse24Linear) for mod in m.modules()) == layers, report
        models[name] = m
    return models


def decode(d: int, ff: int, blocks: int, device, tokens: int, backend: str, mode: str, repeats: int) -> list[dict]:
    """Tokens/s of the compiled MLP stack at M = 1, dense vs 2:4 vs 2:4 INT8, with graph breaks and
    the largest difference of the compiled 2:4 output from the same model run eagerly."""
    models = variants(lambda: MLPStack(d, ff, blocks, torch.float16, device), 2 * blocks)
    x = torch.randn(1, d, dtype=torch.float16, device=device)
    rows = []
    with torch.no_grad():
        for name, m in models.items():
            torch._dynamo.reset()
            breaks = torch._dynamo.explain(m)(x).graph_break_count
            torch._dynamo.reset()
            compiled = torch.compile(m, backend=backend, mode=None if mode == "default" else mode)
            t0 = time.perf_counter()
            for _ in range(3):  # compile, capture, settle
                y = compiled(x)
            _sync(device)
            compile_s = time.perf_counter() - t0
            err = float((y.float() - m(x).float()).abs().max())

            def step():
                h = x
                for _ in range(tokens):
                    h = compiled(h)
                return h
            per_token_us = _wall_us(step, device, 1, repeats) / tokens
            rows.append({"what": "compiled decode", "variant": name, "shape": f"{blocks}x({ff}x{d},{d}x{ff})",
                         "us_per_call": round(per_token_us, 3), "tokens_per_s": round(1e6 / per_token_us, 1),
                         "graph_breaks": breaks, "compile_s": round(compile_s, 1), "max_abs_diff_vs_eager": err})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for user_view.csv")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=11008)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=100, help="decode steps per timed sample")
    ap.add_argument("--calls", type=int, default=200, help="eager calls per timed sample")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode, or 'default'")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_user_view: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = eager_layer(a.d, a.ff, device, a.calls, a.repeats)
    rows += decode(a.d, a.ff, a.blocks, device, a.tokens, a.backend, a.mode, a.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cols = ["device", "what", "variant", "shape", "us_per_call", "tokens_per_s", "graph_breaks", "compile_s",
            "max_abs_diff_vs_eager"]
    with open(out / "user_view.csv", "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(dict(r, device=name) for r in rows)
    base = {r["what"]: r["us_per_call"] for r in rows if r["variant"] in ("dense", "dense nn.Linear")}
    print(f"# {name}, torch {torch.__version__}, M = 1, fp16 activations; compile backend={a.backend} mode={a.mode}")
    for r in rows:
        extra = (f"  {r['tokens_per_s']:>9} tok/s  breaks {r['graph_breaks']}  max|diff| {r['max_abs_diff_vs_eager']:.2e}"
                 if "tokens_per_s" in r else "")
        print(f"{r['what']:16s} {r['variant']:16s} {r['us_per_call']:>10.2f} us  "
              f"{base[r['what']] / r['us_per_call']:5.2f}x dense{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

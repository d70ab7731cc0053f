"""Both phases of one Llama-7B-shaped block, dense vs 2:4 vs 2:4 INT8, eager and
compiled: decode tokens/s at batch 1 and 8, prefill tokens/s of 2048 tokens, and
CUDA kernels per call (torch.profiler); eager only, after all of those, decode at batch 32 (INT8
on the sparse tensor cores with 32 rows per program; compiling a fourth shape would not fit
gpu_check.sh's time for this step). Order: eager, compiled, then the batch-32 rows, whose first
calls compile kernels for 20-35 s (runs 2 and 4): a step cut by its time limit loses those, not
the compiled rows (the compiled INT8 decode is what the GPU plan's call 1 checks). Writes
``block.csv`` and ``block.md`` after every row; run by scripts/gpu_check.sh.

Block (fp16): ``h = h + o(attn(q(h), k(h), v(h)))``, ``h = h + down(silu(gate(h)) * up(h))``
with q, k, v, o ``d x d`` and gate, up ``ff x d``, down ``d x ff`` (Llama-2-7B:
d = 4096, ff = 11008, 32 heads). Attention runs over the tokens of the call
only (causal; no KV cache): the weights, which 2:4 changes, are the same as
in a real block, the attention product is not. In the 2:4 variants every
Linear is a compressed ``Sparse24Linear`` (``sparsify_``): on CUDA the decode
kernel at M <= 16 (INT8 with fp16 x: to 64 rows), the prefill kernel above.

    python scripts/gpu_block.py --out results/GPU/     # on a GPU (defaults)
    python scripts/gpu_block.py --smoke --out /tmp/b   # CPU, tiny shapes: every step, no figures worth keeping
"""
import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24.tools.dispatch_count import count_dispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_user_view import _sync, _wall_us, variants  # noqa: E402  (the same timer and model variants)


class Block(nn.Module):
    """One pre-norm-free Llama-shaped block: ``(B, T, d) -> (B, T, d)``."""

    def __init__(self, d: int, ff: int, heads: int, dtype, device):
        super().__init__()
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype, device=device)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(d, d), lin(d, d), lin(d, d), lin(d, d)
        self.gate, self.up, self.down = lin(d, ff), lin(d, ff), lin(ff, d)
        self.heads = heads
        for m in self.modules():  # keep activations O(1) through the residual stream
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features ** -0.5)

    def forward(self, h):
        B, T, d = h.shape
        split = lambda t: t.view(B, T, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=T > 1)
        h = h + self.o(a.transpose(1, 2).reshape(B, T, d))
        return h + self.down(F.silu(self.gate(h)) * self.up(h))


def _kernels_per_call(fn, device, calls: int = 3):
    """Device kernels (and memsets/copies) torch.profiler records per call; None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return n / calls


def build(d, ff, heads, device) -> dict:
    return variants(lambda: Block(d, ff, heads, torch.float16, device), 7)


def run(a) -> list[dict]:
    device = torch.device(a.device)
    models = build(a.d, a.ff, a.heads, device)
    phases = [(f"decode B={b}", b, 1) for b in a.batches] + [(f"prefill T={a.prefill}", 1, a.prefill)]
    eager_only = [(f"decode B={b}", b, 1) for b in a.eager_batches]
    rows = []
    with torch.no_grad():
        for mode, todo in (("eager", phases), ("compiled", phases), ("eager", eager_only)):
            for name, model in models.items():
                if mode == "compiled":
                    torch._dynamo.reset()
                    fn = torch.compile(model, backend=a.backend, mode=None if a.mode == "default" else a.mode,
                                       dynamic=False)
                else:
                    fn = model
                for phase, B, T in todo:
                    x = torch.randn(B, T, a.d, dtype=torch.float16, device=device)
                    t0 = time.perf_counter()
                    for _ in range(3):  # compile / capture / warm up
                        y = fn(x)
                    _sync(device)
                    warm_s = time.perf_counter() - t0
                    calls = max(1, a.calls // T) if T > 1 else a.calls
                    us = _wall_us(lambda: fn(x), device, calls, a.repeats)
                    err = float((y.float() - model(x).float()).abs().max())
                    row = dict(mode=mode, variant=name, phase=phase, tokens=B * T, us_per_call=round(us, 2),
                               tokens_per_s=float(f"{B * T * 1e6 / us:.4g}"), kernels_per_call=_kernels_per_call(
                                   lambda: fn(x), device), aten_ops_per_call=None, warmup_s=round(warm_s, 1),
                               max_abs_diff_vs_eager=err)
                    if mode == "eager":
                        row["aten_ops_per_call"] = len(count_dispatch(fn, x)[1].ops)
                    rows.append(row)
                    print(f"{mode:8} {name:9} {phase:14} {row['us_per_call']:>11.1f} us {row['tokens_per_s']:>11.1f} "
                          f"tok/s  kernels {row['kernels_per_call']}  aten {row['aten_ops_per_call']}", flush=True)
                    _write(a, rows)
    return rows


COLUMNS = ["device", "mode", "variant", "phase", "tokens", "us_per_call", "tokens_per_s", "speedup_vs_dense",
           "kernels_per_call", "aten_ops_per_call", "warmup_s", "max_abs_diff_vs_eager"]


def _write(a, rows) -> None:
    """CSV and a markdown table of the rows so far (a run cut short keeps what it measured)."""
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dense = {(r["mode"], r["phase"]): r["us_per_call"] for r in rows if r["variant"] == "dense"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    full = [dict(r, device=name, speedup_vs_dense=float(f"{dense[(r['mode'], r['phase'])] / r['us_per_call']:.4g}")
                 if (r["mode"], r["phase"]) in dense else None) for r in rows]
    with open(out / "block.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(full)
    head = (f"Llama-7B-shaped block (d {a.d}, ff {a.ff}, {a.heads} heads), fp16 activations, {name}, torch "
            f"{torch.__version__}; compiled: backend={a.backend} mode={a.mode}; medians of {a.repeats} samples")
    lines = [head, "", "| mode | variant | phase | us/call | tokens/s | x dense | kernels/call | aten ops/call |",
             "|---|---|---|---|---|---|---|---|"]
    cell = lambda v: "-" if v is None else v  # noqa: E731  (kernels: CUDA only; aten ops: eager only)
    lines += [f"| {r['mode']} | {r['variant']} | {r['phase']} | {r['us_per_call']} | {r['tokens_per_s']} | "
              f"{r['speedup_vs_dense']} | {cell(r['kernels_per_call'])} | {cell(r['aten_ops_per_call'])} |"
              for r in full]
    (out / "block.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for block.csv and block.md")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, aot_eager: checks every step runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--eager-batches", default="32", help="decode batch sizes measured eager only, after prefill")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens")
    ap.add_argument("--calls", type=int, default=50, help="decode calls per sample (prefill: fewer)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode, or 'default'")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device, a.d, a.ff, a.heads, a.batches, a.prefill, a.calls, a.repeats = "cpu", 64, 128, 2, "1,3", 20, 1, 1
        a.backend, a.mode = "aot_eager", "default"
    a.batches = [int(b) for b in str(a.batches).split(",")]
    a.eager_batches = [int(b) for b in str(a.eager_batches).split(",") if b]
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_block: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    run(a)
    print(f"wrote {Path(a.out) / 'block.csv'} and block.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

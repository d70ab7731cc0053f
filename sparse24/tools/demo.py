"""The main job, ``python -m sparse24 demo``: the whole 2:4 story on one CPU in minutes, offline.

1. Train a small next-character model on real text that every Python
   install ships: the standard library's top-level ``.py`` files
   (``sysconfig.get_paths()['stdlib']``, sorted; every 8th file is held out,
   so the evaluation text comes from files never trained on).
2. Prune every ``nn.Linear`` 2:4 by magnitude (``sparsify_``, masked mode): one-shot accuracy.
3. Retrain with the mask frozen and the SAME hyper-parameters, schedule and
   batch order (Mishra et al. 2021's recipe; training time doubles). The same
   second run without a mask is the control: it shows what the extra training
   alone is worth, so "2:4 retrained vs dense retrained" is the cost of 2:4.
4. Compress and swap (``compress_``: values + 2-bit indices, fp32 and INT8):
   accuracy must not move (fp32) or barely (INT8); bytes saved.
5. A quick throughput sweep on this CPU (``sparse24.tools.bench``) and its plot.

Accuracy is bits per character (BPC) on held-out text: lower is better.
Everything is seeded; results depend only on the machine's float rounding
(thread count included). Outputs go to ``--out`` (default ``runs/demo``).
"""
from __future__ import annotations

import copy
import csv
import math
import os
import string
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._checks import refuse_inference_mode
from .._progress import progress_bar
from .cli_common import add_progress_argument

__all__ = ["CharMLP", "TrainConfig", "load_corpus", "train", "evaluate_bpc", "add_demo_arguments", "run_demo"]

VOCAB = string.printable  # 100 characters; id 100 = any other character
HELD_OUT_EVERY = 8


# --- data --------------------------------------------------------------------------

def load_corpus(max_files: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The standard library's top-level ``.py`` files as character ids.

    Args:
        max_files: use only the first files (sorted by name); None = all.
    Returns:
        ``(train_ids, heldout_ids, info)``: 1-D uint8 tensors of ids in
        ``[0, len(VOCAB)]``; every 8th file goes to held-out; ``info`` names
        the folder and sizes.
    Example:
        >>> train_ids, val_ids, info = load_corpus(max_files=16)
        >>> int(train_ids.max()) <= len(VOCAB)
        True
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:max_files]
    if len(files) < HELD_OUT_EVERY:
        raise ValueError(f"found only {len(files)} .py files in {stdlib}: the demo trains on the standard "
                         f"library's source, which this Python install lacks")
    lut = np.full(128, len(VOCAB), dtype=np.uint8)
    lut[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB), dtype=np.uint8)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for i, f in enumerate(files):
        cps = np.frombuffer(f.read_text(encoding="utf-8", errors="replace").encode("utf-32-le"), dtype=np.uint32)
        ids = np.where(cps < 128, lut[np.minimum(cps, 127)], len(VOCAB)).astype(np.uint8)
        parts["val" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"].append(ids)
    train_ids, val_ids = (torch.from_numpy(np.concatenate(parts[k])) for k in ("train", "val"))
    info = {"folder": str(stdlib), "files": len(files), "heldout_files": len(parts["val"]),
            "train_chars": train_ids.numel(), "heldout_chars": val_ids.numel()}
    return train_ids, val_ids, info


def _windows(ids: torch.Tensor, starts: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, ctx)`` contexts and ``(B,)`` next characters starting at ``starts``."""
    win = ids[starts[:, None] + torch.arange(ctx + 1, device=starts.device)].long()
    return win[:, :ctx], win[:, ctx]


# --- model -------------------------------------------------------------------------

class CharMLP(nn.Module):
    """Next-character model: the embeddings of the last ``ctx`` characters,
    concatenated, through three GELU ``nn.Linear`` layers (the last two
    residual), a LayerNorm and a linear head. Every Linear is 2:4-eligible
    (in-features ``ctx * emb``, ``hidden``: multiples of 4).

    Shapes:
        ``(B, ctx)`` int64 ids -> ``(B, vocab)`` logits of the next character.
    Example:
        >>> CharMLP()(torch.zeros(2, 32, dtype=torch.long)).shape
        torch.Size([2, 101])
    """

    def __init__(self, vocab: int = len(VOCAB) + 1, ctx: int = 32, emb: int = 16, hidden: int = 256):
        super().__init__()
        self.ctx = ctx
        self.emb = nn.Embedding(vocab, emb)
        self.fc1 = nn.Linear(ctx * emb, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.emb(x).flatten(1)))
        h = h + F.gelu(self.fc2(h))
        h = h + F.gelu(self.fc3(h))
        return self.head(self.ln(h))


# --- training and evaluation -------------------------------------------------------------

@dataclass
class TrainConfig:
    """One training run's hyper-parameters; the retraining reuses them unchanged.

    AdamW (weight decay 0.01), linear warm-up then cosine decay to 0, batches
    drawn from ``seed`` (the same batch order in every run).
    """
    steps: int = 600
    batch: int = 256
    lr: float = 6e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / max(self.warmup, 1))
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * step / max(self.steps, 1)))


def train(model: CharMLP, ids: torch.Tensor, cfg: TrainConfig, label: str = "train",
          progress: bool | None = None) -> float:
    """Train ``model`` on ``ids`` with a fresh AdamW; returns the last 50 steps' mean loss in bits/char.

    Works the same for a dense model and a ``sparsify_``-ed one (masks stay frozen), with autograd on
    whatever the caller's grad mode (inside ``torch.no_grad()`` too); under ``torch.inference_mode()``,
    whose tensors autograd cannot record, a RuntimeError (nothing changed).
    """
    refuse_inference_mode("sparse24.tools.demo.train")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    recent: list[float] = []
    bar = progress_bar(total=cfg.steps, desc=label, progress=progress, unit="step")
    with torch.enable_grad():  # it trains: under the caller's torch.no_grad() too
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            starts = torch.randint(0, ids.numel() - model.ctx - 1, (cfg.batch,), generator=gen, device="cpu")
            x, y = _windows(ids, starts, model.ctx)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            recent = (recent + [loss.item() / math.log(2)])[-50:]
            bar.set_postfix_str(f"loss {sum(recent) / len(recent):.3f} bits/char", refresh=False)
            bar.update()
    bar.close()
    return sum(recent) / max(len(recent), 1)


@torch.no_grad()
def evaluate_bpc(model: nn.Module, ids: torch.Tensor, n_chars: int, ctx: int | None = None, label: str = "",
                 progress: bool | None = False) -> float:
    """Bits per character predicting each of the first ``n_chars`` held-out
    characters after the first ``ctx`` (``ids[ctx:ctx + n_chars]``; all of
    ``ids[ctx:]`` when fewer) from the ``ctx`` before it.

    ``ctx`` defaults to the model's own ``ctx`` attribute (:class:`CharMLP`
    has one), else 32. The loss is summed in at least float32 whatever the
    model's dtype (a bf16 sum of ~19,000 has a spacing of 128).

    Raises:
        ValueError: ``n_chars < 1``, or ``ids`` holds no character after the first ``ctx``.
    Example:
        >>> _, val, _ = load_corpus(max_files=16)
        >>> 6.0 < evaluate_bpc(CharMLP(), val, n_chars=256) < 8.0  # untrained: ~log2(101) = 6.66
        True
    """
    if isinstance(n_chars, bool) or not isinstance(n_chars, int) or n_chars < 1:
        raise ValueError(f"n_chars must be an int >= 1, got {n_chars!r}")
    if ctx is None:
        ctx = getattr(model, "ctx", 32)
    if ids.numel() < ctx + 1:
        raise ValueError(f"ids holds {ids.numel()} characters: predicting one from the ctx = {ctx} before it "
                         f"needs at least {ctx + 1}")
    model.eval()
    # start s predicts ids[s + ctx], the last one too
    starts = torch.arange(0, min(n_chars, ids.numel() - ctx), device=ids.device)
    total, chunk = 0.0, 4096
    for a in progress_bar(range(0, len(starts), chunk), desc=label, progress=progress, unit="chunk"):
        x, y = _windows(ids, starts[a:a + chunk], ctx)
        logits = model(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16: off by ~0.006 bits/char
        total += F.cross_entropy(logits, y, reduction="sum").item()
    return total / len(starts) / math.log(2)


# --- the command ---------------------------------------------------------------------

def add_demo_arguments(p) -> None:
    """Options of ``python -m sparse24 demo`` (added to an argparse parser)."""
    d = TrainConfig()
    p.add_argument("--out", default=os.path.join("runs", "demo"), metavar="DIR",
                   help="where results, checkpoints and the plot go (default runs/demo)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {d.steps}; "
                                                           "--quick: 30)")
    p.add_argument("--eval-chars", type=int, default=None, help="held-out characters scored (default 50000; "
                                                                "--quick: 4000)")
    p.add_argument("--quick", action="store_true", help="a tiny setting for a smoke test (seconds)")
    p.add_argument("--no-control", action="store_true", help="skip the dense-retrained control run")
    p.add_argument("--no-bench", action="store_true", help="skip the throughput sweep")
    p.add_argument("--threads", default="auto", help="torch CPU threads: N, or auto (probe 1 vs all: on a "
                                                     "busy machine one thread can be several times faster)")
    p.add_argument("--seed", type=int, default=0)
    add_progress_argument(p)


def _pick_threads(choice: str) -> tuple[int, str]:
    """Thread count and a note. ``auto`` times a small GEMM with 1 thread and
    with all of them: on a shared 2-core machine under load, 2 threads ran a
    256x512x512 fp32 GEMM at 3.4 GFLOP/s and 1 thread at 16 GFLOP/s (threads
    wait for each other); idle, 2 threads ran it at 65 GFLOP/s and 1 at 35.
    The probe costs ~3 GFLOP (0.1-0.5 s)."""
    n_all = max(1, torch.get_num_threads())
    if choice != "auto":
        try:
            n = int(choice)
        except ValueError:
            raise ValueError(f"--threads must be a positive integer or 'auto', got {choice!r}") from None
        if n < 1:
            raise ValueError(f"--threads must be a positive integer or 'auto', got {choice!r}")
        if n > (os.cpu_count() or 1):  # oversubscription only; 100000 crashed the process (exit 139)
            raise ValueError(f"--threads must be at most {os.cpu_count() or 1} (this machine's logical CPUs), "
                             f"got {n}")
        return n, "as asked"
    if n_all == 1:
        return 1, "one available"
    a, b = torch.randn(256, 512, device="cpu"), torch.randn(512, 512, device="cpu")
    rates = {}
    for n in (1, n_all, 1, n_all):  # twice each, keep the best: the first call warms up
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        rates[n] = max(rates.get(n, 0.0), 5 * 2 * 256 * 512 * 512 / (time.perf_counter() - t0) / 1e9)
    best = max(rates, key=rates.get)
    return best, "probe: " + ", ".join(f"{n} thread{'s' * (n > 1)} {r:.0f} GFLOP/s" for n, r in rates.items())


def _file_bytes(sd: dict, path: Path) -> int:
    torch.save(sd, path)
    return path.stat().st_size


def _bench_step(out: Path, machine: str, threads: int, quick: bool, progress: bool | None = None) -> str:
    """The quick CPU throughput sweep (CSV + PNG in ``out``); returns a one-line summary."""
    from . import bench
    from .plot import plot_rows
    from .shapes import parse_shapes

    cpu = torch.device("cpu")
    if quick:  # tiny: includes the Triton interpreter, which only tiny weights afford on CPU
        shapes, ms, repeats = ["64,128"], [1, 8], 2
    else:
        d = bench.default_settings(cpu, quick=True)
        shapes, ms, repeats = d["shapes"], d["ms"], d["repeats"]
    settings = bench.BenchSettings(cpu, parse_shapes(shapes), ms, [torch.float32], list(bench.PROVIDERS), repeats)
    rows = bench.run_bench(settings, log=sys.stdout, progress=progress)
    csv_path = bench.write_csv(rows, out / "bench.csv")
    png = plot_rows(rows, out / "bench.png", title=f"sparse24 demo: throughput on {machine} "
                                                   f"(CPU, fp32, {threads} thread(s))")
    best = max(float(r["speedup_vs_dense"]) for r in rows if r["provider"] != "dense")
    return (f"{csv_path} and {png} (on a CPU the reference backend decompresses the weight, so it is slower "
            f"than dense: best {best:.2f}x here; the speedups come from the Triton kernel on a GPU)")


def _report(rows: list[dict], header: str, files: str) -> str:
    """The results as markdown: a table (bits/char and weight bytes) and the differences that matter."""
    by = {r["model"]: r["bpc"] for r in rows}
    dense = by["dense"]
    lines = [header, "", "| model | held-out bits/char | vs dense | Linear weights stored (fp32 model) |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['bpc']:.4f} | {r['bpc'] - dense:+.4f} | {r['weights']} |" for r in rows]
    lines += ["", f"- one-shot 2:4 without retraining costs {by[ONESHOT] - dense:+.4f} bits/char"]
    if CONTROL in by:
        lines.append(f"- after retraining, 2:4 vs the dense control given the same extra training: "
                     f"{by[RETRAINED] - by[CONTROL]:+.4f} bits/char (the cost of 2:4 itself)")
    lines += [f"- compress_ (values + 2-bit indices, swapped in) moved bits/char by "
              f"{by[COMPRESSED] - by[RETRAINED]:+.1e}; INT8 on top of 2:4: {by[INT8] - by[COMPRESSED]:+.4f} bits/char",
              f"- {files}"]
    return "\n".join(lines)


ONESHOT, RETRAINED = "2:4 one-shot (magnitude, no retraining)", "2:4 retrained, frozen mask"
CONTROL, COMPRESSED = "dense retrained the same way (control)", "2:4 compressed + swapped (fp32 values)"
INT8 = "2:4 compressed INT8 (+ fp32 row scales)"


def run_demo(args) -> int:
    """Run the demo with parsed ``args`` (see :func:`add_demo_arguments`); returns 0.

    Sets torch's thread count and seeds torch's global random generator (``--seed``) for the run, and
    restores both afterwards, also when it fails (it uses no numpy or Python random state). It makes
    every tensor it trains itself, so it trains with autograd on whatever the caller's grad mode
    (``torch.no_grad()`` and ``torch.inference_mode()`` included).
    """
    threads_before = torch.get_num_threads()
    # (devices=[]: the demo runs on the CPU, and forking CUDA's generators would initialise CUDA)
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode(False):
            return _run_demo(args)
    finally:
        torch.set_num_threads(threads_before)


def _run_demo(args) -> int:
    from ..api import compress_, sparsify_
    from .bench import device_info

    t_start = time.perf_counter()
    steps = args.steps if args.steps is not None else (30 if args.quick else TrainConfig.steps)
    eval_chars = args.eval_chars if args.eval_chars is not None else (4000 if args.quick else 50_000)
    if steps < 1 or eval_chars < 1:
        raise ValueError(f"--steps and --eval-chars must be >= 1, got {steps} and {eval_chars}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    threads, why = _pick_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    cfg = TrainConfig(steps=steps, seed=args.seed)
    machine = device_info(torch.device("cpu"))["device"]
    say = lambda *a: print(*a, flush=True)  # noqa: E731

    train_ids, val_ids, info = load_corpus()
    torch.manual_seed(args.seed)
    model = CharMLP()
    # evaluate_bpc scores at most this many; the report and results.csv must say what was scored
    eval_chars = min(eval_chars, val_ids.numel() - model.ctx)
    say(f"sparse24 demo on {machine}, {threads} torch thread(s) ({why})")
    say(f"data: {info['files']} stdlib files from {info['folder']}: {info['train_chars']:,} training characters; "
        f"held out: {info['heldout_chars']:,} characters from {info['heldout_files']} other files "
        f"(scoring the first {eval_chars:,})")
    say(f"model: CharMLP, {sum(p.numel() for p in model.parameters()):,} parameters; each training run: {steps} "
        f"steps of {cfg.batch} windows, AdamW lr {cfg.lr}, warm-up + cosine")
    rows: list[dict] = []

    def record(name: str, m: nn.Module, weights: str) -> None:
        bpc = evaluate_bpc(m, val_ids, eval_chars, m.ctx, "eval", progress=args.progress)
        rows.append({"model": name, "bpc": bpc, "weights": weights})

    say("\n[1/5] dense training")
    train(model, train_ids, cfg, "dense training", progress=args.progress)
    dense_state = copy.deepcopy(model.state_dict())
    dense_file = _file_bytes(dense_state, out / "dense.pt")

    say("\n[2/5] prune every Linear 2:4 by magnitude (sparsify_, masked mode)")
    report = sparsify_(model, skip_output_head=False)  # every Linear, the head too, as the published figures
    say(str(report))
    dense_w = f"{report.dense_bytes:,} B"
    record("dense", _dense_copy(dense_state), dense_w)
    record(ONESHOT, model, "dense + mask (training form)")

    say("\n[3/5] retrain with the mask frozen, same hyper-parameters and batch order")
    train(model, train_ids, cfg, "2:4 retraining", progress=args.progress)
    record(RETRAINED, model, "dense + mask (training form)")
    if not args.no_control:
        control = _dense_copy(dense_state)
        train(control, train_ids, cfg, "control: dense retraining", progress=args.progress)
        record(CONTROL, control, dense_w)
        del control

    say("\n[4/5] compress and swap (compress_), fp32 values and INT8")
    int8_model = copy.deepcopy(model)
    comp = compress_(model)
    say(str(comp))
    q = compress_(int8_model, quantize="int8")
    share = lambda r: f"{r.compressed_bytes:,} B ({100 * r.compressed_bytes / r.dense_bytes:.1f}%)"  # noqa: E731
    record(COMPRESSED, model, share(comp))
    record(INT8, int8_model, share(q))
    sparse_file = _file_bytes(model.state_dict(), out / "sparse24.pt")
    int8_file = _file_bytes(int8_model.state_dict(), out / "sparse24-int8.pt")

    bench_note = "skipped (--no-bench)"
    if not args.no_bench:
        say("\n[5/5] throughput sweep on this CPU (sparse24.tools.bench, --quick settings)")
        bench_note = _bench_step(out, machine, threads, args.quick, args.progress)

    files = (f"state dict files: dense {dense_file:,} B; 2:4 fp32 {sparse_file:,} B "
             f"({100 * sparse_file / dense_file:.1f}%); 2:4 INT8 {int8_file:,} B "
             f"({100 * int8_file / dense_file:.1f}%) (embedding, LayerNorm and biases stay dense)")
    header = (f"sparse24 demo on {machine} ({threads} torch thread(s)), torch {torch.__version__}: {steps} steps "
              f"per training run, {eval_chars:,} held-out characters, wall time {time.perf_counter() - t_start:.0f} s")
    text = _report(rows, header, files)
    (out / "results.md").write_text(text + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "bpc", "linear_weights", "machine", "threads", "steps", "eval_chars"])
        w.writerows([r["model"], f"{r['bpc']:.5f}", r["weights"], machine, threads, steps, eval_chars] for r in rows)
    say("\n" + text)
    say(f"\nresults: {out / 'results.md'} (and results.csv); checkpoints: {out}/dense.pt, sparse24.pt, "
        f"sparse24-int8.pt")
    say(f"throughput: {bench_note}")
    return 0


def _dense_copy(state: dict) -> CharMLP:
    m = CharMLP()
    m.load_state_dict(state)
    return m

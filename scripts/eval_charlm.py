"""2:4 sparsity on real text: a character-level transformer LM on CPU.

Corpus: the Python standard library's own top-level ``.py`` files
(``sysconfig.get_paths()['stdlib']``), sorted by name; every 8th file is
held out, so the validation text comes from files never seen in training.
Characters outside ``string.printable`` share one id.

Every run trains the same model from the same initialization on the same
batch sequence with the same hyper-parameters (AdamW, warmup + cosine), and
bits per character are measured on the same fixed held-out windows:

* ``dense``; ``dense INT8`` (per-output-channel symmetric weight quantization);
* one-shot 2:4 of the dense model: ``magnitude``, ``wanda`` and ``sparsegpt``
  (statistics from ``sparse24.calibrate`` on training batches);
* ``2:4 retrained``: magnitude 2:4, then the whole training run repeated
  with the mask frozen (Mishra et al. 2021's recipe; training time doubles),
  then compressed (fp32 values, must not change the BPC) and compressed to INT8;
* ``dense retrained``: the same second run without a mask (the control that
  shows what the extra training alone is worth);
* ``2:4 retrained, learned masks``: the same second run (same batches, steps,
  optimizer settings and schedule) from the learned-mask model below, masks
  frozen: the recovery recipe; and ``... distilled``: the same run with half
  of the loss the KL divergence to the dense control's predictions (and
  ``2:4 retrained, distilled``: the same from the magnitude masks, to see what
  the learned start adds once a teacher is there);
* one-shot ``sparsegpt + permutation`` (``sparse24.permute_model_``: the
  residual stream with its LayerNorms and embeddings, each head's value
  channels, the MLP channels) and ``learned masks (weights frozen)``
  (``learn_masks`` distilling from the dense model (KL), SparseGPT +
  permutation prior, no retraining);
* from scratch, same steps: 50% unstructured gradual magnitude pruning and
  2:4 gradual pruning (``GradualPruner``, cubic schedule), and 2:4 SR-STE;
* ``..., head dense``: the retrained and distilled recipes with the output
  head left dense, as
  ``sparsify_`` does by default (as SparseGPT, Wanda and published 2:4 LLM
  checkpoints keep it);
* the 0.03 comparison (control, 2:4 retrained, both distilled recipes, head
  pruned and dense) again at the ``--check-seeds`` (default 1 and 2): a gap of a few
  thousandths on one seed decides nothing.

All ``nn.Linear`` layers are pruned (attention in/out projections, MLP, and
the output head, but in the rows marked head dense); embeddings and
LayerNorms stay dense.

Writes ``table.csv``, ``table.md`` (machine, versions, steps, wall time,
per-layer INT8 SQNR), ``sqnr.csv`` and ``bpc.png`` to ``--out``.

This file holds the recipes (one job per group of rows) and ``main``; the
corpus, the model and its training run are in ``charlm_model.py``, the tables
and the plot in ``charlm_report.py``.

Usage:
    python scripts/eval_charlm.py                  # the committed results (11.7 min on 2 cores)
    python scripts/eval_charlm.py --quick          # smoke test, ~1 min, writes results/charlm-quick
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

from sparse24 import (GradualPruner, SRSTE, calibrate, compress, compress_, learn_masks, permute_model_, sparsify_,
                      sqnr_db)

from charlm_model import (all_nm, bpc, build_model, calibration_batches, fake_quant_int8, get_batch, linear_weights,
                          load_corpus, permutation_groups, train, zero_fraction)
from charlm_report import write_results

ROOT = Path(__file__).resolve().parent.parent


# --- the runs (each one a job; jobs run in worker processes) ---------------------

def _setup_worker(cfg: dict):
    torch.set_num_threads(cfg["threads"])
    return load_corpus()


def row(name, model, val_ids, cfg, steps, seconds, group, note=""):
    r = {"row": name, "group": group, "bpc": bpc(model, val_ids, cfg), "zero_fraction": zero_fraction(model),
         "train_steps": steps, "train_seconds": round(seconds, 1), "note": note}
    print(f"  {name:<38} BPC {r['bpc']:.4f}  zeros {r['zero_fraction']:.3f}  ({seconds:.0f} s training)", flush=True)
    return r


def job_dense(cfg: dict) -> dict:
    """Dense training, then everything derived from it without training."""
    train_ids, val_ids, _ = _setup_worker(cfg)
    model = build_model(cfg)
    curve, secs = train(model, train_ids, cfg)
    rows = [row("dense", model, val_ids, cfg, cfg["steps"], secs, "dense")]
    q = copy.deepcopy(model)
    sqnr = []
    with torch.no_grad():
        for fqn, mod in q.named_modules():
            if isinstance(mod, nn.Linear):
                wq = fake_quant_int8(mod.weight)
                sqnr.append({"model": "dense", "layer": fqn, "sqnr_db": sqnr_db(mod.weight, wq)})
                mod.weight.copy_(wq)
    rows.append(row("dense INT8", q, val_ids, cfg, cfg["steps"], secs, "dense", "per-channel symmetric weights"))
    calib = calibration_batches(train_ids, cfg)
    for method in ("magnitude", "wanda", "sparsegpt"):
        m = copy.deepcopy(model)
        stats = calibrate(m, calib, hessian=method == "sparsegpt") if method != "magnitude" else None
        t0 = time.perf_counter()
        sparsify_(m, method=method, calibration=stats, skip_output_head=False)  # every Linear, the head too
        assert all_nm(m)
        rows.append(row(f"2:4 one-shot {method}", m, val_ids, cfg, cfg["steps"], secs, "one-shot",
                        f"pruned in {time.perf_counter() - t0:.1f} s, no retraining"))
    # channel permutations on SparseGPT's importance (outputs checked equal), then SparseGPT; then masks
    # learned with the weights frozen, distilled from the dense model on training text
    t0 = time.perf_counter()
    one_shot, m, gains, rep = learned_model(cfg, model, train_ids, calib)
    rows.append(row("2:4 one-shot sparsegpt + permutation", one_shot, val_ids, cfg, cfg["steps"], secs, "one-shot",
                    f"{len(gains)} groups, OBS importance kept +{100 * sum(gains.values()) / len(gains):.2f}% on "
                    f"average; {time.perf_counter() - t0 - rep.seconds:.1f} s, no retraining"))
    rows.append(row("2:4 learned masks (weights frozen)", m, val_ids, cfg, cfg["steps"], secs, "one-shot",
                    f"{cfg['learn_steps']} steps distilling from the dense model (KL), prior sparsegpt + "
                    f"permutation; {100 * sum(rep.layers.values()) / len(rep.layers):.1f}% of groups changed; "
                    f"{rep.seconds:.0f} s, no retraining"))
    learned_head = learned_model(cfg, model, train_ids, calib, head_dense=True)[1]
    return {"rows": rows, "curves": {"dense": curve}, "state": model.state_dict(), "sqnr": sqnr,
            "learned_state": m.state_dict(), "learned_state_head_dense": learned_head.state_dict()}


def learned_model(cfg: dict, model: nn.Module, train_ids: torch.Tensor, calib: list, head_dense: bool = False):
    """From a trained dense model: (its one-shot SparseGPT 2:4 model after channel permutations, the
    learned-mask model, permutation gains, learn_masks report). Every Linear is pruned, the head too
    unless ``head_dense`` (the library's default)."""
    permuted = copy.deepcopy(model)
    stats = calibrate(permuted, calib, hessian=True)
    gains = permute_model_(permuted, permutation_groups(permuted), score="sparsegpt", calibration=stats,
                           example=calib[0], max_iters=cfg["perm_iters"], time_limit=600)
    one_shot = copy.deepcopy(permuted)
    sparsify_(one_shot, method="sparsegpt", calibration=stats, skip_output_head=head_dense)
    gen = torch.Generator().manual_seed(cfg["seed"] + 2)
    batches = [get_batch(train_ids, cfg["batch"], cfg["ctx"], gen)[0] for _ in range(cfg["learn_steps"])]
    learned = copy.deepcopy(permuted)
    rep = learn_masks(learned, batches, cfg["learn_steps"], teacher=permuted, prior="sparsegpt", calibration=stats,
                      output_loss="kl", lr=cfg["mask_lr"], seed=cfg["seed"], skip_output_head=head_dense)
    assert all_nm(one_shot, head_dense) and all_nm(learned, head_dense)
    return one_shot, learned, gains, rep


def job_seed(cfg: dict, seed: int) -> dict:
    """The 0.03 comparison again at another seed (initialization and batch order): the dense
    run, then from it the control, 2:4 retrained from magnitude, distilled from magnitude and
    distilled from learned masks (the control as teacher), each with the head pruned and dense."""
    cfg = {**cfg, "seed": seed}
    train_ids, val_ids, _ = _setup_worker(cfg)
    dense = build_model(cfg)
    train(dense, train_ids, cfg)
    control = copy.deepcopy(dense)
    train(control, train_ids, cfg)
    out = {"seed": seed, "dense": bpc(dense, val_ids, cfg), "control": bpc(control, val_ids, cfg)}
    calib = calibration_batches(train_ids, cfg)
    for head_dense, suffix in ((False, ""), (True, "_head_dense")):
        plain, kd = copy.deepcopy(dense), copy.deepcopy(dense)
        for m in (plain, kd):
            sparsify_(m, skip_output_head=head_dense)
        train(plain, train_ids, cfg)
        train(kd, train_ids, cfg, teacher=control.eval())
        learned = learned_model(cfg, dense, train_ids, calib, head_dense)[1]
        train(learned, train_ids, cfg, teacher=control.eval())
        for key, m in (("plain", plain), ("kd_magnitude", kd), ("distilled", learned)):
            assert all_nm(m, head_dense)
            out[key + suffix] = bpc(m, val_ids, cfg)
    print(f"  seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in out.items() if k != "seed"), flush=True)
    return {"rows": [], "curves": {}, "seed_row": out}


def job_retrain(cfg: dict, dense_state: dict, masked: bool, head_dense: bool = False) -> dict:
    """Repeat the training run from the trained dense weights, with the 2:4
    magnitude mask frozen (masked=True; the output head dense too with ``head_dense``)
    or without any mask (the control)."""
    train_ids, val_ids, _ = _setup_worker(cfg)
    model = build_model(cfg)
    model.load_state_dict(dense_state)
    if not masked:
        curve, secs = train(model, train_ids, cfg)
        return {"rows": [row("dense retrained (control)", model, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                             "second run without mask")], "curves": {"dense retrained (control)": curve},
                "state": model.state_dict()}
    # masked mode: Sparse24Linear keeps pruned weights at exactly 0 through AdamW; every Linear, the head too
    sparsify_(model, skip_output_head=head_dense)
    curve, secs = train(model, train_ids, cfg)
    assert all_nm(model, head_dense)
    if head_dense:
        name = "2:4 retrained, head dense"
        return {"rows": [row(name, model, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                             "as 2:4 retrained, the output head left dense (sparsify_'s default)")],
                "curves": {}}
    rows = [row("2:4 retrained", model, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                "magnitude mask frozen, same hyper-parameters")]
    masked_w = linear_weights(model)
    c = copy.deepcopy(model)
    compress_(c)
    rows.append(row("2:4 retrained, compressed", c, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                    "values + 2-bit indices, fp32"))
    q = copy.deepcopy(model)
    compress_(q, quantize="int8")
    rows.append(row("2:4 retrained + INT8", q, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                    "compressed, INT8 values"))
    sqnr = [{"model": "2:4 retrained", "layer": fqn,
             "sqnr_db": sqnr_db(compress(w, w != 0), compress(w, w != 0, quantize="int8"))}
            for fqn, w in masked_w.items()]
    return {"rows": rows, "curves": {"2:4 retrained": curve}, "sqnr": sqnr}


def job_learned_retrain(cfg: dict, learned_state: dict) -> dict:
    """The recovery recipe: start from the learned-mask model (the one-shot row above:
    permuted SparseGPT prior, masks learned with the weights frozen) and repeat the
    training run with those masks frozen, exactly as "2:4 retrained" does from the
    magnitude mask."""
    train_ids, val_ids, _ = _setup_worker(cfg)
    model = build_model(cfg)
    sparsify_(model, skip_output_head=False)  # masked layers of the right shapes; the checkpoint brings the masks
    model.load_state_dict(learned_state)
    curve, secs = train(model, train_ids, cfg)
    assert all_nm(model)
    name = "2:4 retrained, learned masks"
    return {"rows": [row(name, model, val_ids, cfg, 2 * cfg["steps"], secs, "retrained",
                         "learned-mask model above retrained with its masks frozen, same hyper-parameters")],
            "curves": {name: curve}}


def job_distilled_retrain(cfg: dict, state: dict, control_state: dict, head_dense: bool = False,
                          learned: bool = True) -> dict:
    """The recovery recipe with a teacher: the same second run, masks frozen, its loss mixing the
    cross-entropy with the KL divergence to the dense control (the best dense model of the table:
    the first run's dense model is worse than what the 2:4 model reaches, and distilling from it
    pulls the student back); from the learned-mask model (``state``), or with ``learned=False``
    from the dense model's magnitude masks (``state`` = the dense weights)."""
    train_ids, val_ids, _ = _setup_worker(cfg)
    teacher = build_model(cfg)
    teacher.load_state_dict(control_state)
    model = build_model(cfg)
    if learned:
        sparsify_(model, skip_output_head=head_dense)  # the checkpoint brings the masks
        model.load_state_dict(state)
    else:
        model.load_state_dict(state)
        sparsify_(model, skip_output_head=head_dense)
    curve, secs = train(model, train_ids, cfg, teacher=teacher.eval())
    assert all_nm(model, head_dense)
    name = "2:4 retrained, " + ("learned masks, " if learned else "") + "distilled" + (", head dense" if head_dense else "")
    note = (f"{'learned-mask model' if learned else 'magnitude masks'}, masks frozen, same run with the loss "
            f"(1 - {cfg['kd']:g}) x cross-entropy + {cfg['kd']:g} x KL to the dense control (teacher)")
    if head_dense:
        note += "; output head dense"
    return {"rows": [row(name, model, val_ids, cfg, 2 * cfg["steps"], secs, "retrained", note)],
            "curves": {} if head_dense or not learned else {name: curve}}


def _gradual_schedule(steps: int) -> dict:
    """Prune from 10% to 60% of training (every ~2%), then train the rest with fixed masks.

    The last pruning step is at most ``steps - 1`` (``train`` calls ``after_step(0 .. steps - 1)``); it must
    come after the first, so ``steps >= 2``.
    """
    if steps < 2:
        raise ValueError(f"gradual pruning needs at least 2 training steps (a first and a last pruning step), "
                         f"got {steps}")
    freq = max(1, steps // 50)
    start = (steps // 10) // freq * freq
    end = start + max(1, (steps * 6 // 10 - start) // freq) * freq
    return {"start_step": start, "end_step": end, "frequency": freq}


def job_from_scratch(cfg: dict, kind: str) -> dict:
    train_ids, val_ids, _ = _setup_worker(cfg)
    model = build_model(cfg)
    if kind == "srste":
        srste = SRSTE(model, 2, 4, decay=cfg["srste_decay"], skip_output_head=False)
        curve, secs = train(model, train_ids, cfg)
        srste.finalize()
        assert all_nm(model)
        name, note = "2:4 SR-STE from scratch", f"decay {cfg['srste_decay']:g}"
    else:
        target = 0.5 if kind == "gradual50" else (2, 4)
        sched = _gradual_schedule(cfg["steps"])
        pruner = GradualPruner(model, target, skip_output_head=False, **sched)
        curve, secs = train(model, train_ids, cfg, after_step=pruner.step)
        name = "50% unstructured gradual" if kind == "gradual50" else "2:4 gradual"
        note = "cubic schedule, steps {start_step}..{end_step} every {frequency}".format(**sched)
        assert kind == "gradual50" or all_nm(model)
    return {"rows": [row(name, model, val_ids, cfg, cfg["steps"], secs, "from scratch", note)],
            "curves": {name: curve}}


# --- main ------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps of every training run")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (40 steps, small eval)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default results/charlm)")
    ap.add_argument("--jobs", type=int, default=2, help="training runs in parallel (worker processes)")
    # One thread per worker: with other jobs sharing the 2 cores, a training
    # step took 0.49 s with 1 thread vs 1.26 s with 2 (median of 8, d_model 128, batch 16x128).
    # Model size and batch: at equal CPU time on this machine, d_model 64 with
    # batch 8 x 128 (1600 steps, 252 s) reached 2.54 held-out BPC, vs 2.63 for
    # batch 16 (800 steps, 296 s), 2.65 for d_model 96 and 2.70 for d_model 128
    # with context 64 (800 steps each, ~310 s): small and many steps learn fastest.
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--eval-windows", type=int, default=1024)
    ap.add_argument("--srste-decay", type=float, default=2e-4)
    ap.add_argument("--mask-lr", type=float, default=0.1, help="learning rate of the mask logits")
    ap.add_argument("--learn-steps", type=int, default=300, help="steps of the frozen-weight learned-mask row")
    # kd: exploratory runs from the magnitude mask (2000 steps, teacher = the dense control): 0.25 -> 2.345,
    # 0.5 -> 2.336, 0.9 -> 2.353 BPC; distilling from the first run's dense model instead (0.3): 2.373
    ap.add_argument("--kd", type=float, default=0.5, help="weight of the KL term in the distilled retraining")
    ap.add_argument("--perm-iters", type=int, default=300, help="permutation search steps per group")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-seeds", type=int, nargs="*", default=[1, 2],
                    help="more seeds for the 0.03 comparison (control, 2:4 retrained, distilled)")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        ap.error("--jobs and --threads must be >= 1")
    if args.steps < 2:  # the gradual-pruning rows prune first at step 0 and last at a later step
        ap.error(f"--steps must be >= 2 (gradual pruning needs a first and a last pruning step), got {args.steps}")
    cfg = {"steps": args.steps, "d_model": args.d_model, "layers": args.layers, "heads": 4, "ctx": 128,
           "batch": args.batch, "lr": args.lr, "wd": 0.01, "eval_windows": args.eval_windows,
           "calib_batches": 8, "srste_decay": args.srste_decay, "seed": args.seed, "mask_lr": args.mask_lr,
           "learn_steps": args.learn_steps, "perm_iters": args.perm_iters, "kd": args.kd,
           "threads": args.threads, "jobs": args.jobs}
    if args.quick:
        cfg.update(steps=40, eval_windows=64, calib_batches=2, learn_steps=5, perm_iters=5)
        args.check_seeds = args.check_seeds[:1]
    out = args.out or ROOT / "results" / ("charlm-quick" if args.quick else "charlm")
    torch.set_num_threads(args.threads)
    _, _, info = load_corpus()
    print(f"corpus: {info}; config: {cfg}", flush=True)
    t0 = time.perf_counter()
    rows, curves, sqnr, seed_rows = [], {}, [], []

    def collect(res):
        rows.extend(res["rows"])
        curves.update(res["curves"])
        sqnr.extend(res.get("sqnr", []))
        if "seed_row" in res:
            seed_rows.append(res["seed_row"])
        return res

    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        dense = pool.submit(job_dense, cfg)
        scratch = [pool.submit(job_from_scratch, cfg, k) for k in ("gradual50", "gradual24", "srste")]
        first = collect(dense.result())
        control = pool.submit(job_retrain, cfg, first["state"], False)
        second = [pool.submit(job_retrain, cfg, first["state"], True),
                  pool.submit(job_learned_retrain, cfg, first["learned_state"]),
                  pool.submit(job_retrain, cfg, first["state"], True, True)]
        control_state = collect(control.result())["state"]
        third = [pool.submit(job_distilled_retrain, cfg, first["learned_state"], control_state),
                 pool.submit(job_distilled_retrain, cfg, first["learned_state_head_dense"], control_state, True),
                 pool.submit(job_distilled_retrain, cfg, first["state"], control_state, False, False),
                 pool.submit(job_distilled_retrain, cfg, first["state"], control_state, True, False)]
        seeds = [pool.submit(job_seed, cfg, sd) for sd in args.check_seeds if sd != cfg["seed"]]
        for f in scratch + second + third + seeds:
            collect(f.result())
    wall = time.perf_counter() - t0
    write_results(out, rows, curves, sqnr, seed_rows, cfg, info, wall, argv)
    print((out / "table.md").read_text())
    print(f"wrote {out}/table.csv, table.md, sqnr.csv, bpc.png in {wall / 60:.1f} min")


if __name__ == "__main__":
    main()

"""Choosing the recommended one shot's options without the evaluation texts: variants of
``prune_layerwise_`` (given as JSON, e.g. '{}' '{"percdamp": 0.1}') on all-MiniLM-L6-v2 calibrated
on the first N (env N, default 512) lines of eval_minilm_calibration.py's code (env DOM=code) or
docstring sentences (DOM=docstrings), after the same permutation (its weights cached in
~/.cache/sparse24, or $XDG_CACHE_HOME/sparse24).

Judged on two selection texts that are no evaluation text: 512 other code lines (the last of the
shuffle, val-code) and 512 docstring sentences of the training files (the last of their shuffle,
val-doc; the held-out docstrings come from other files). The evaluation texts are printed too (EVAL-).

Besides ``prune_layerwise_``'s own options, a variant may set: ``"perm": false`` (no permutation),
``"teacher": false`` (fit each layer to its own dense output), ``"distill_steps": S`` and
``"distill_lr"`` (then S steps of frozen-mask distillation on the calibration lines themselves, cycled),
``"learn_steps": S`` (masks learned on the calibration lines, cycled, weights frozen),
``"augment": k`` (the lines again, joined in k random pairings: new contexts, no new text) and
``"random": R`` (R strings of random vocabulary tokens added: a data-free prior) and ``"noise": [k, p]``
(k copies of the lines with each token replaced, with probability p, by a random vocabulary token, on the
text: decoded and tokenized again) and ``"token_noise": [k, p, low]`` (the library's ``sparse24.token_noise`` on the
token batches: k copies, ids drawn from ``low`` to the vocabulary's end, special tokens kept; an optional fourth
entry is the seed).

Each variant must be a JSON object (printed as its label); anything else is refused before the model loads.

Usage: OMP_NUM_THREADS=1 python scripts/select_minilm_options.py '{}' '{"percdamp": 0.1}'
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

from sparse24 import (calibrate, distill_, embedding_fidelity, learn_masks, permute_model_, prune_layerwise_,
                      sentence_embeddings, sparsify_, token_noise)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minilm_common import Encoder, code_lines, docstring_sentences, manual_sentences  # noqa: E402


def parse_variants(argv: list[str]) -> list[tuple[str, dict]]:
    """``[(label, options)]`` from the command line, each variant a JSON object (a non-JSON variant
    such as ``percdamp=0.1`` once ran as the default options under that label); argparse's error and
    usage otherwise, and on ``-h`` or no variant."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", metavar="JSON", help="a variant's options, e.g. '{\"percdamp\": 0.1}'")
    out = []
    for spec in ap.parse_args(argv).variants:
        try:
            opts = json.loads(spec)
        except json.JSONDecodeError as e:
            ap.error(f"variant {spec!r} is not JSON ({e}): give a JSON object, e.g. '{{\"percdamp\": 0.1}}'")
        if not isinstance(opts, dict):
            ap.error(f"variant {spec!r} is not a JSON object: give one, e.g. '{{\"percdamp\": 0.1}}'")
        if "token_noise" in opts:  # the name of the library function the run calls
            opts["token_noise_"] = opts.pop("token_noise")
        out.append((spec, opts))
    return out


def load() -> None:
    """The model, the texts, the selection references and the permuted model every variant starts from,
    as module globals (minutes: in :func:`main`, after the variants are checked, never on import)."""
    global N, DOM, enc, calib, refs, dense, batches, permuted
    N = int(os.environ.get("N", 512)); DOM = os.environ.get("DOM", "code")
    enc = Encoder("hf", 128)
    train, held = docstring_sentences()
    manual = manual_sentences(set(train))
    gen = torch.Generator().manual_seed(0)
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:512].tolist()]
    prose = [train[i] for i in torch.randperm(len(train), generator=gen).tolist()]
    manual = [manual[i] for i in torch.randperm(len(manual), generator=gen)[:512].tolist()]
    code = code_lines()
    code = [code[i] for i in torch.randperm(len(code), generator=torch.Generator().manual_seed(1)).tolist()]
    calib = (code if DOM == "code" else prose)[:N]
    sel = {"val-code": code[-512:], "val-doc": prose[-512:], "EVAL-held": held, "EVAL-manual": manual}
    assert not set(code[-512:]) & set(code[:1024]) and not set(prose[-512:]) & set(prose[:1024])
    refs = {}
    for k, t in sel.items():
        b = enc.batches(sorted(t, key=len), 64)
        refs[k] = (b, sentence_embeddings(enc.model, b, token_mask=enc.token_mask))
    dense = enc.model
    batches = enc.batches(calib, 32)
    permuted = cached_permutation(dense, os.path.join(CACHE, f"select-perm-{DOM}{N}.pt"), permute)


def cached_permutation(base, path: str, permute_fn) -> torch.nn.Module:
    """A copy of ``base`` permuted by ``permute_fn(copy)``, its state dict cached at ``path``: tensors
    only, read with weights_only=True, in a folder of the user's own (a whole pickled model read from
    a shared temp folder would run whatever code another user planted there)."""
    permuted = copy.deepcopy(base)
    if os.path.exists(path):
        permuted.load_state_dict(torch.load(path, weights_only=True))
        return permuted
    permute_fn(permuted)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(permuted.state_dict(), tmp)
    os.replace(tmp, path)  # whole or absent: an interrupted save leaves no partial cache
    return permuted


def permute(model):
    t0 = time.perf_counter()
    stats = calibrate(dense, batches, hessian=True, token_mask=enc.token_mask, filter_fn=enc.filter_fn)
    permute_model_(model, enc.groups, score="sparsegpt", calibration=stats, example=enc.batch(calib[:8]),
                   max_iters=300, time_limit=600)
    print(f"permutation {time.perf_counter()-t0:.0f} s", flush=True)


CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparse24")


def random_texts(n: int, seed: int = 7) -> list[str]:
    """``n`` strings of random vocabulary tokens, as long as the calibration lines (a data-free prior)."""
    g = torch.Generator().manual_seed(seed)
    lens = [len(enc.tokens(t)) - 2 for t in calib]
    vocab = enc._tok.vocab_size
    return [enc._tok.decode(torch.randint(1999, vocab, (lens[i % len(lens)],), generator=g).tolist())
            for i in range(n)]


def noisy_texts(k: int, p: float, seed: int = 11) -> list[str]:
    """``k`` copies of the calibration lines, each token replaced by a random vocabulary token with
    probability ``p``: the lines' contexts with other words in them."""
    g = torch.Generator().manual_seed(seed)
    vocab = enc._tok.vocab_size
    out = []
    for _ in range(k):
        for t in calib:
            ids = torch.tensor(enc.tokens(t)[1:-1])
            swap = torch.rand(len(ids), generator=g) < p
            ids[swap] = torch.randint(1999, vocab, (int(swap.sum()),), generator=g)
            out.append(enc._tok.decode(ids.tolist()))
    return out


def run(label, perm=True, distill_steps=0, distill_lr=2e-4, augment=0, random=0, learn_steps=0, noise=None,
        token_noise_=None, **opts):
    t0 = time.perf_counter()
    base = permuted if perm else dense
    m = copy.deepcopy(base)
    texts = list(calib) + (random_texts(random) if random else []) + (noisy_texts(*noise) if noise else [])
    for k in range(augment):  # the same lines again, joined in random pairs: new contexts, no new text
        order = torch.randperm(len(calib), generator=torch.Generator().manual_seed(100 + k)).tolist()
        texts += [calib[order[i]] + " " + calib[order[i + 1]] for i in range(0, len(order) - 1, 2)]
    calib_batches = enc.batches(texts, 32) if augment or random or noise else batches
    if token_noise_:
        k, p, low, seed = (*token_noise_, 0)[:4]
        calib_batches = token_noise(calib_batches, k, p, vocab=(low, enc._tok.vocab_size),
                                    keep=enc._tok.all_special_ids, seed=seed)
    prune_layerwise_(m, calib_batches, method="sparsegpt",
                     refit=opts.pop("refit", True), token_mask=enc.token_mask,
                     teacher=base if opts.pop("teacher", True) else None, filter_fn=enc.filter_fn, progress=False,
                     **opts)
    sparsify_(m, filter_fn=enc.filter_fn)
    if learn_steps:  # masks learned on the calibration lines themselves (cycled), eval_minilm.py's settings
        stream = [batches[i % len(batches)] for i in range(learn_steps)]
        learn_masks(m, stream, learn_steps, teacher=base, lr=0.1, tau=(1.0, 0.05), noise=(0.3, 0.01),
                    hard_fraction=0.2, confidence=3.0, output_loss="cosine", hidden=enc.hidden, hidden_weight=1.0,
                    forward=enc.forward, filter_fn=enc.filter_fn, seed=0, progress=False)
    if distill_steps:  # frozen masks, fit to the dense model on the calibration lines themselves (cycled)
        stream = [batches[i % len(batches)] for i in range(distill_steps)]
        distill_(m, stream, distill_steps, teacher=base, lr=distill_lr, output_loss="cosine", hidden=enc.hidden,
                 hidden_weight=1.0, parameters=enc.trainable(m), forward=enc.forward, progress=False)
    cos = {k: embedding_fidelity(m, b, r, token_mask=enc.token_mask) for k, (b, r) in refs.items()}
    print(f"{DOM}{N} {label:<34} " + "  ".join(f"{k} {v:.4f}" for k, v in cos.items())
          + f"  ({time.perf_counter()-t0:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    variants = parse_variants(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    load()
    for label, opts in variants:
        run(label, **opts)


if __name__ == "__main__":
    main()
